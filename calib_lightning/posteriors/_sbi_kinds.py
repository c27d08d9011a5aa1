"""Which sbi estimators estimate what (ratio, likelihood, posterior), and their
log-ratio or log-likelihood as batched callables ``f(theta (M, D), x (M, *X)) -> (M,)``
for :class:`~calib_lightning.posteriors.UnnormalizedPosterior`."""

from __future__ import annotations

import copy
import gc
import weakref
from typing import Any

import torch
from torch import Tensor

from calib_lightning.posteriors._lampe import lampe_kind, masked_ratio_error

__all__ = ["POTENTIAL_POSTERIORS", "PotentialOverPairs", "adapt_sbi", "sbi_kind"]

_KINDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def sbi_kind(estimator: Any) -> str | None:
    """What an sbi estimator estimates: ``"ratio"`` (a ``RatioEstimator``), ``"likelihood"``
    (an ``MNLE`` estimator, or a ``ConditionalDensityEstimator`` held by an sbi ``NLE``
    / ``MNLE`` trainer or likelihood potential alive in this process), ``"posterior"``
    (held by an ``NPE`` trainer or a ``DirectPosterior``), or ``None`` when not from sbi
    or not known.

    sbi's likelihood and posterior estimators are the same classes: only what trained
    them tells them apart, found among the objects that refer to the estimator (about
    0.1 s in a process of 2.4 million objects; the answer is kept per estimator, ``None``
    too). An estimator reloaded from disk, whose trainer is gone, is ``None`` and read as
    a posterior estimator: for a likelihood estimator, pass it with ``prior=`` to
    :class:`~calib_lightning.UnnormalizedPosterior` to say what it is.
    """
    if not type(estimator).__module__.startswith("sbi."):
        return None
    try:
        from sbi.inference.posteriors.direct_posterior import DirectPosterior
        from sbi.inference.potentials.likelihood_based_potential import LikelihoodBasedPotential
        from sbi.inference.trainers.nle.nle_base import LikelihoodEstimatorTrainer
        from sbi.inference.trainers.npe.npe_base import PosteriorEstimatorTrainer
        from sbi.neural_nets.estimators.base import ConditionalDensityEstimator
        from sbi.neural_nets.estimators.mixed_density_estimator import MixedDensityEstimator
        from sbi.neural_nets.ratio_estimators import RatioEstimator
    except ImportError:  # pragma: no cover - another sbi
        return None
    if isinstance(estimator, RatioEstimator):
        return "ratio"
    if isinstance(estimator, MixedDensityEstimator):
        return "likelihood"
    if not isinstance(estimator, ConditionalDensityEstimator):
        return None
    if estimator in _KINDS:
        return _KINDS[estimator]
    kind = None
    holders = gc.get_referrers(estimator)
    for holder in holders:  # an object's own __dict__, when materialized, holds it instead
        if isinstance(holder, dict) and any(v is estimator for v in holder.values()):
            holders = holders + [h for h in gc.get_referrers(holder) if not isinstance(h, dict)]
    for holder in holders:
        if isinstance(holder, (LikelihoodEstimatorTrainer, LikelihoodBasedPotential)):
            kind = "likelihood"
            break
        if isinstance(holder, (PosteriorEstimatorTrainer, DirectPosterior)):
            kind = "posterior"
    _KINDS[estimator] = kind
    return kind


POTENTIAL_POSTERIORS = ("MCMCPosterior", "RejectionPosterior", "ImportanceSamplingPosterior")


class PotentialOverPairs:
    r"""``f(theta, x)`` = an sbi potential :math:`\log p(x \mid \theta) p(\theta)` at
    ``(theta_i, x_i)``, minus :math:`\log p(\theta_i)`: a copy of the potential with
    ``x`` set as a batch of (not iid) observations, one per ``theta``."""

    def __init__(self, potential: Any, prior: Any) -> None:
        self.potential, self.prior = potential, prior
        self.__name__ = type(potential).__name__

    def __call__(self, theta: Tensor, x: Tensor) -> Tensor:
        potential = copy.copy(self.potential)  # set_x must not change the user's posterior
        try:
            potential.set_x(x, x_is_iid=False)
            out = potential(theta, track_gradients=True)
        except (AssertionError, TypeError, ValueError) as error:
            raise ValueError(
                f"the sbi potential {type(self.potential).__name__} cannot be evaluated over "
                "(theta, x) pairs (sbi's x_is_iid=False); wrap its likelihood or ratio "
                "estimator instead: cl.as_posterior(estimator, prior=prior)"
            ) from error
        log_p = self.prior.log_prob(theta)
        return out.reshape(-1) - (log_p.sum(-1) if log_p.shape == theta.shape else log_p)


class _SbiLikelihood(torch.nn.Module):
    r""":math:`\log q(x \mid \theta)` of an sbi likelihood estimator, batched over pairs
    (sbi's convention: ``log_prob(x (1, M, *X), condition=theta (M, D)) -> (1, M)``)."""

    def __init__(self, estimator: torch.nn.Module) -> None:
        super().__init__()
        self.estimator = estimator

    def forward(self, theta: Tensor, x: Tensor) -> Tensor:
        return self.estimator.log_prob(x[None], condition=theta)[0]


class _SbiRatio(torch.nn.Module):
    r""":math:`\log r(\theta, x)` of an sbi ``RatioEstimator`` at pairs ``(M, D), (M, *X)``."""

    def __init__(self, estimator: torch.nn.Module) -> None:
        super().__init__()
        self.estimator = estimator

    def forward(self, theta: Tensor, x: Tensor) -> Tensor:
        return self.estimator.unnormalized_log_ratio(theta, x)


def adapt_sbi(f: Any) -> tuple[Any, tuple[int | None, tuple[int, ...]] | None]:
    """``f`` as a callable ``(theta, x) -> (M,)``, and ``(D, X)`` when an sbi estimator says."""
    kind = sbi_kind(f)
    if lampe_kind(f) in ("posterior", "flow_matching"):
        raise ValueError(
            f"log_likelihood must be a likelihood or ratio estimator, got a lampe "
            f"{type(f).__name__} (a posterior estimator): pass it to cl.as_posterior without "
            "a prior"
        )
    if lampe_kind(f) == "masked_ratio":
        raise masked_ratio_error(f)
    if kind == "ratio":
        return _SbiRatio(f), (int(f.theta_shape[-1]), tuple(int(s) for s in f.x_shape))
    if kind == "posterior":
        raise ValueError(
            "log_likelihood must be a likelihood or ratio estimator, got an sbi posterior "
            "estimator (trained by NPE): pass it to cl.as_posterior without a prior"
        )
    if kind == "likelihood" or _is_sbi_density(f):
        size = f.condition_shape[-1] if len(f.condition_shape) == 1 else None
        return _SbiLikelihood(f), (size, tuple(int(s) for s in f.input_shape))
    return f, None


def _is_sbi_density(f: Any) -> bool:
    try:
        from sbi.neural_nets.estimators.base import ConditionalDensityEstimator
    except ImportError:  # pragma: no cover - sbi is optional here
        return False
    return isinstance(f, ConditionalDensityEstimator)
