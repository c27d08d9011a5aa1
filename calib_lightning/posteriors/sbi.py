r"""sbi's estimators: the adapter for its conditional density estimators (flows and mixture
density networks, alone or inside a ``DirectPosterior``), and what each sbi object is
(:func:`recognize`).

What an sbi object estimates is read from the object, never from what else is alive:

* a ``RatioEstimator`` (``NRE_A/B/C``, ``BNRE``) is a ratio :math:`r(\theta, x)`;
* an ``MCMCPosterior``, ``RejectionPosterior`` or ``ImportanceSamplingPosterior`` is the
  posterior of its potential (likelihood or ratio estimator, and prior), known up to a
  constant;
* a ``DirectPosterior`` is a posterior estimator; a ``MixedDensityEstimator`` (``MNLE``)
  a likelihood estimator;
* any other ``ConditionalDensityEstimator`` models its ``input_shape`` given its
  ``condition_shape``: a posterior estimator (``NPE``) when ``input_shape`` is
  ``theta``'s, a likelihood estimator (``NLE``) when it is ``x``'s. When the two shapes
  differ, it is read as a posterior, and data shaped the other way round raise a
  ``ValueError`` that says so; when they are equal, nothing in the object tells, and the
  caller must declare it (``cl.as_posterior(estimator, kind="posterior")``, or the prior of
  a likelihood estimator).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import Tensor
from torch.distributions import Distribution
from zuko.lazy import LazyDistribution

from calib_lightning.posteriors._model_info import default_dtype, is_nflows
from calib_lightning.posteriors.base import Posterior, Recognized, UnsupportedError
from calib_lightning.posteriors.distributions import DistributionPosterior
from calib_lightning.posteriors.flows import NflowsPosterior

__all__ = ["PotentialOverPairs", "SbiLikelihood", "SbiPosterior", "SbiRatio", "recognize"]

#: sbi's posteriors that hold a potential (likelihood or ratio estimator, and prior)
POTENTIAL_POSTERIORS = ("MCMCPosterior", "RejectionPosterior", "ImportanceSamplingPosterior")


class SbiPosterior(Posterior):
    """Adapter for an sbi (>= 0.24) ``ConditionalDensityEstimator`` (``ZukoFlow``,
    ``NFlowsFlow``, mixture density networks), or the estimator inside an sbi
    ``DirectPosterior``.

    The estimator is diagnosed as trained, without the prior-support rejection that
    ``DirectPosterior`` adds when sampling. Samples and their log-densities come from
    separate ``sample`` and ``log_prob`` calls, never from sbi's
    ``sample_and_log_prob``.

    ``to_latent`` (flows only: ``NFlowsFlow``, ``ZukoFlow``) passes ``x`` through the
    estimator's embedding net, which z-scores ``x`` in sbi's builders, before the flow,
    exactly as ``log_prob`` and ``sample`` do: it goes through the nflows or zuko flow
    the estimator wraps, never through sbi's ``inverse_transform``. Another estimator (a
    mixture density network) raises a :class:`ValueError`. Why (two sbi 0.27 bugs):
    ``docs/design.md``, "Posterior adapters: one sampling call per quantity".

    Arguments:
        module: the estimator.
    """

    def event_size(self) -> int | None:
        shape = getattr(self.module, "input_shape", None)
        return int(shape[-1]) if shape is not None and len(shape) == 1 else None

    def context_shape(self) -> tuple[int, ...] | None:
        shape = getattr(self.module, "condition_shape", None)
        return tuple(int(s) for s in shape) if shape is not None else None

    def check_reading(self, theta: Tensor | None, x: Tensor) -> None:
        """Raise where ``x`` is shaped as what the estimator models, not as its condition:
        data for a likelihood estimator q(x | theta)."""
        self._check_x_reading(x)

    def _check_x_reading(self, x: Tensor) -> None:
        expected, modeled = self.context_shape(), getattr(self.module, "input_shape", None)
        shape = tuple(x.shape[1:]) if isinstance(x, Tensor) and x.ndim >= 2 else None
        if (
            shape is None
            or expected is None
            or modeled is None
            or shape == expected
            or shape != tuple(int(s) for s in modeled)
        ):
            return
        raise ValueError(
            f"x must have shape (N, {', '.join(map(str, expected))}) for this sbi "
            f"{type(self.module).__name__}, which models {tuple(modeled)} given {expected}, "
            f"got {tuple(x.shape)}: shaped as what it models, so it reads as a likelihood "
            "estimator q(x | theta) (sbi's NLE), not a posterior estimator. Check the "
            "posterior it implies: cl.as_posterior(estimator, prior=prior) or "
            "cl.UnnormalizedPosterior(estimator, prior=prior)"
        )

    def _prepare_x(self, x: Tensor) -> Tensor:
        """As :meth:`Posterior._prepare_x`, and the error of data shaped for a likelihood
        estimator (:meth:`check_reading`)."""
        self._check_x_reading(x)
        return super()._prepare_x(x)

    def sample(self, x: Tensor, num_posterior_samples: int) -> Tensor:
        x, out = self._sampling_inputs(x, num_posterior_samples)
        # sbi's nflows estimators draw base noise in torch's default dtype
        with torch.no_grad(), default_dtype(x.dtype), self._errors(None, x):
            return self.module.sample((num_posterior_samples,), condition=x).to(out)

    # sample_and_log_prob is inherited (sample, then log_prob) on purpose: in sbi 0.27,
    # NFlowsFlow.sample_and_log_prob reshapes nflows' (N, S, D) output to (S, N, D)
    # without transposing, which pairs samples with the wrong conditions.

    def log_prob(self, theta: Tensor, x: Tensor) -> Tensor:
        x = self._prepare_x(x)
        inner = self._prepare_theta(theta, x)
        lead = inner.shape[:-2]
        flat = inner.reshape(-1, *inner.shape[-2:])
        with self._errors(flat, x):
            log_prob = self.module.log_prob(flat, condition=x)
        return log_prob.reshape(*lead, x.shape[0]).to(theta.dtype)

    def to_latent(self, theta: Tensor, x: Tensor) -> Tensor:
        x = self._prepare_x(x)
        inner = self._prepare_theta(theta, x)
        return _sbi_flow(self.module).to_latent(inner, x).to(theta.dtype)

    def from_latent(self, z: Tensor, x: Tensor) -> Tensor:
        x = self._prepare_x(x)
        inner = self._prepare_theta(z, x)
        return _sbi_flow(self.module).from_latent(inner, x).to(z.dtype)


class _EmbeddedFlow(torch.nn.Module):
    """``x -> flow(embedding(x))``: a zuko flow conditioned on an embedding of ``x``."""

    def __init__(self, embedding: torch.nn.Module, flow: torch.nn.Module) -> None:
        super().__init__()
        self.embedding, self.flow = embedding, flow

    def forward(self, x: Tensor) -> Distribution:
        return self.flow(self.embedding(x))


def _sbi_flow(estimator: Any) -> Posterior:
    """An adapter for the nflows or zuko flow inside an sbi estimator, embedding included.

    ``NFlowsFlow.net`` is an nflows ``Flow`` that holds the embedding net itself (its
    ``log_prob`` and ``transform_to_noise`` embed the context); ``ZukoFlow.net`` is a zuko
    flow that sbi calls on ``embedding_net(x)``.
    """
    net, embedding = getattr(estimator, "net", None), getattr(estimator, "embedding_net", None)
    if is_nflows(net):
        return NflowsPosterior(net)
    if isinstance(net, LazyDistribution) and isinstance(embedding, torch.nn.Module):
        return DistributionPosterior(_EmbeddedFlow(embedding, net))
    raise UnsupportedError(
        "to_latent needs an sbi flow estimator (NFlowsFlow, whose net is an nflows Flow, or "
        "ZukoFlow, whose net is a zuko flow with an embedding_net), got "
        f"{type(estimator).__name__} with net {type(net).__name__}"
    )


class SbiLikelihood(torch.nn.Module):
    r""":math:`\log q(x \mid \theta)` of an sbi likelihood estimator, batched over pairs
    ``theta (M, D)``, ``x (M, *X)`` -> ``(M,)`` (sbi's convention:
    ``log_prob(x (1, M, *X), condition=theta (M, D)) -> (1, M)``)."""

    def __init__(self, estimator: torch.nn.Module) -> None:
        super().__init__()
        self.estimator = estimator

    def forward(self, theta: Tensor, x: Tensor) -> Tensor:
        return self.estimator.log_prob(x[None], condition=theta)[0]


class SbiRatio(torch.nn.Module):
    r""":math:`\log r(\theta, x)` of an sbi ``RatioEstimator`` at pairs ``(M, D), (M, *X)``."""

    def __init__(self, estimator: torch.nn.Module) -> None:
        super().__init__()
        self.estimator = estimator

    def forward(self, theta: Tensor, x: Tensor) -> Tensor:
        return self.estimator.unnormalized_log_ratio(theta, x)


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


def _shape(shape: Any) -> tuple[int, ...] | None:
    return None if shape is None else tuple(int(s) for s in shape)


def _width(shape: tuple[int, ...] | None) -> int | None:
    return shape[-1] if shape is not None and len(shape) == 1 else None


def recognize(obj: Any) -> Recognized | None:
    """What an sbi object is (module docstring), or ``None`` for anything not from sbi (its
    vector-field estimators: :mod:`~calib_lightning.posteriors.vector_fields`)."""
    if not type(obj).__module__.startswith("sbi."):
        return None
    try:
        from sbi.inference.posteriors.direct_posterior import DirectPosterior
        from sbi.neural_nets.estimators.base import ConditionalDensityEstimator
        from sbi.neural_nets.estimators.mixed_density_estimator import MixedDensityEstimator
        from sbi.neural_nets.ratio_estimators import RatioEstimator
    except ImportError:  # pragma: no cover - another sbi
        return None
    name = type(obj).__name__
    if name in POTENTIAL_POSTERIORS:
        return _potential_posterior(obj)
    if isinstance(obj, DirectPosterior):
        estimator = obj.posterior_estimator
        return Recognized(
            f"an sbi DirectPosterior over {type(estimator).__name__}",
            ("posterior",),
            "posterior",
            lambda: SbiPosterior(estimator),
        )
    if isinstance(obj, RatioEstimator):
        theta_shape, x_shape = _shape(obj.theta_shape), _shape(obj.x_shape)
        return Recognized(
            f"an sbi {name} (a ratio estimator r(theta, x), as NRE_A/B/C and BNRE train)",
            ("ratio",),
            "ratio",
            log_likelihood=SbiRatio(obj),
            shapes={"ratio": (_width(theta_shape), x_shape)},
        )
    if not isinstance(obj, ConditionalDensityEstimator):
        return None
    modeled, condition = _shape(obj.input_shape), _shape(obj.condition_shape)
    as_likelihood = (_width(condition), modeled)
    if isinstance(obj, MixedDensityEstimator):
        return Recognized(
            f"an sbi {name} (a likelihood estimator q(x | theta), as MNLE trains)",
            ("likelihood",),
            "likelihood",
            log_likelihood=SbiLikelihood(obj),
            shapes={"likelihood": as_likelihood},
        )
    return Recognized(
        f"an sbi {name} modelling {modeled} given {condition}",
        ("posterior", "likelihood"),
        "posterior" if modeled != condition else None,
        lambda: SbiPosterior(obj),
        SbiLikelihood(obj),
        {"posterior": (_width(modeled), condition), "likelihood": as_likelihood},
    )


def _potential_posterior(obj: Any) -> Recognized:
    """An sbi posterior over a potential: sbi's own potential is its estimator and prior;
    a subclass of the user's (tempered, say) is evaluated as it is."""
    potential = obj.potential_fn
    prior = getattr(potential, "prior", None)
    what = f"an sbi {type(obj).__name__} (known up to a constant)"
    if type(potential).__module__.startswith("sbi."):
        pairs = (("likelihood_estimator", "likelihood"), ("ratio_estimator", "ratio"))
        for attribute, reading in pairs:
            estimator = getattr(potential, attribute, None)
            inner = recognize(estimator) if estimator is not None else None
            if inner is not None and reading in inner.readings:
                return Recognized(
                    what,
                    (reading,),
                    reading,
                    log_likelihood=inner.log_likelihood,
                    shapes={reading: inner.shapes.get(reading, (None, None))},
                    prior=prior,
                )
    return Recognized(
        what,
        ("unnormalized",),
        "unnormalized",
        log_likelihood=PotentialOverPairs(potential, prior),
        prior=prior,
    )
