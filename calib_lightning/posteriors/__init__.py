r"""One interface over conditional density estimators :math:`q(\theta \mid x)`.

Every diagnostic in the package talks to a :class:`Posterior`, never to zuko,
nflows, sbi or torch.distributions directly. :func:`as_posterior` picks the adapter,
one module per estimator family:

* :mod:`~calib_lightning.posteriors.base`: the :class:`Posterior` interface and the
  input checks every adapter shares;
* :mod:`~calib_lightning.posteriors.distributions`: any callable ``x -> Distribution``
  (zuko flows, Gaussians);
* :mod:`~calib_lightning.posteriors.flows`: nflows ``Flow`` s;
* :mod:`~calib_lightning.posteriors.sbi`: sbi's density estimators;
* :mod:`~calib_lightning.posteriors.vector_fields`: sbi's flow-matching and score
  estimators (``FMPE``, ``NPSE``) through their probability-flow ODE;
* :mod:`~calib_lightning.posteriors.samples`: samples-only posteriors
  (:class:`SamplePosterior`);
* :mod:`~calib_lightning.posteriors.unnormalized`: posteriors known up to a constant,
  :math:`\exp f(\theta, x)\, p(\theta)` (:class:`UnnormalizedPosterior`: sbi's ratio and
  likelihood estimators and MCMC posteriors, given the prior), scores only.

An adapter lists what it can compute in ``capabilities`` (:data:`CAPABILITIES`: sample,
log_prob, score, to_latent); a method it cannot support raises an
:class:`UnsupportedError` (a ``ValueError``) naming the missing capability and the checks
that need it; so does a score whose log-density has no gradient in ``theta``
(:class:`NotDifferentiableError`) and a latent map without a normal base.

Shape convention, identical for every backend:

* ``x``: observations, shape ``(N, *X)`` (usually ``(N, X)``);
* ``sample(x, S)`` -> ``(S, N, D)``;
* ``log_prob(theta, x)``: ``theta`` of shape ``(*, N, D)`` -> ``(*, N)``;
* ``score(theta, x)``: :math:`\nabla_\theta \log q(\theta \mid x)`, ``(*, N, D)``;
* ``to_latent(theta, x)``: the flow's base-space point :math:`z = T^{-1}(\theta; x)`,
  ``(*, N, D)``, standard normal when ``theta ~ q(. | x)``.

Inputs are checked against the model before it runs: ``theta``'s width against the
event size ``D`` and ``x``'s feature shape against the context the estimator was built
for, wherever the adapter can read them (zuko MAF/NSF, nflows, sbi; the event shape of
any returned distribution). A mismatch raises a :class:`ValueError` naming the argument,
the expected and the received shape; torch's own shape errors from inside the model are
translated the same way.

Dtypes: the model is evaluated in its own dtype (that of its parameters). ``theta`` and
``x`` are cast to it, so float64 pairs work with a float32 flow and the reverse; integer
or boolean ``x`` is cast the same way (to torch's default dtype when the model has no
parameters). Results come back in the caller's dtype: that of ``theta`` for
``log_prob``, ``score`` and ``to_latent``, that of ``x`` (floating) for ``sample``, else
the model's. Metrics thus accumulate in the dtype of the data they are given, with the
model's precision.

Example:
    >>> import torch
    >>> from torch.distributions import Independent, Normal
    >>> post = as_posterior(lambda x: Independent(Normal(0.5 * x, 1.0), 1))
    >>> x = torch.zeros(4, 2)
    >>> post.sample(x, 3).shape
    torch.Size([3, 4, 2])
    >>> post.score(torch.ones(4, 2), x)[0]
    tensor([-1., -1.])
"""

from __future__ import annotations

from typing import Any

from calib_lightning._model_info import is_nflows, sbi_estimator
from calib_lightning.posteriors._lampe import LampeFlow, lampe_kind, masked_ratio_error
from calib_lightning.posteriors.base import (
    CAPABILITIES,
    NotDifferentiableError,
    Posterior,
    UnsupportedError,
    WrappedPosterior,
    check_width,
    density_draws,
    supports,
    unsupported,
)
from calib_lightning.posteriors.distributions import DistributionPosterior
from calib_lightning.posteriors.flows import NflowsPosterior
from calib_lightning.posteriors.samples import SamplePosterior
from calib_lightning.posteriors.sbi import SbiPosterior
from calib_lightning.posteriors.unnormalized import (
    UnnormalizedPosterior,
    sbi_kind,
    unnormalized_from_sbi,
)
from calib_lightning.posteriors.vector_fields import VectorFieldPosterior, vector_field_estimator

__all__ = [
    "CAPABILITIES",
    "DistributionPosterior",
    "NflowsPosterior",
    "NotDifferentiableError",
    "Posterior",
    "SamplePosterior",
    "SbiPosterior",
    "UnnormalizedPosterior",
    "UnsupportedError",
    "VectorFieldPosterior",
    "WrappedPosterior",
    "as_posterior",
    "check_width",
    "density_draws",
    "supports",
    "unsupported",
]


def as_posterior(obj: Any, *, prior: Any = None) -> Posterior:
    """Wrap a conditional density estimator in the package's :class:`Posterior` interface.

    Arguments:
        obj: a :class:`Posterior` (returned as is, e.g. a :class:`SamplePosterior` for a
            callable that returns samples only), an ``nflows`` ``Flow``, a zuko flow
            (any ``zuko.lazy.LazyDistribution``), an sbi density estimator or
            ``DirectPosterior``, an sbi vector-field estimator (``FMPE``, ``NPSE``) or
            ``VectorFieldPosterior``, a lampe ``NPE`` or ``FMPE``, any callable
            ``x -> torch.distributions.Distribution`` with event shape ``(D,)``; with
            ``prior``: an sbi ratio estimator (``NRE_A/B/C``, ``BNRE``) or likelihood
            estimator (``NLE``, ``MNLE``), a lampe ``NRE``; an sbi ``MCMCPosterior``,
            ``RejectionPosterior`` or ``ImportanceSamplingPosterior`` (its potential's
            prior unless ``prior`` is given). The last three give an
            :class:`UnnormalizedPosterior` (scores only).
        prior: the prior :math:`p(\theta)` of a ratio or likelihood estimator, a
            ``torch.distributions.Distribution`` with event shape ``(D,)``.

    Returns:
        The adapter.

    Raises:
        ValueError: an sbi or lampe ratio or likelihood estimator without ``prior`` (it is
            not a posterior), or a ``prior`` given with a posterior estimator.
    """
    if isinstance(obj, Posterior):
        if prior is not None:
            raise _prior_unused(obj)
        return obj
    unnormalized = unnormalized_from_sbi(obj, prior)
    if unnormalized is not None:
        return unnormalized
    lampe = lampe_kind(obj)
    if lampe is not None:
        return _from_lampe(obj, lampe, prior)
    kind = sbi_kind(obj)
    if kind in ("ratio", "likelihood"):
        if prior is None:
            what = "ratio estimator r(theta, x)" if kind == "ratio" else (
                "likelihood estimator q(x | theta)")  # fmt: skip
            raise ValueError(
                f"posterior must be a posterior estimator, got an sbi {what}, whose posterior "
                "is known only up to a constant given the prior: pass "
                "cl.as_posterior(estimator, prior=prior) or "
                "cl.UnnormalizedPosterior(estimator, prior=prior)"
            )
        return UnnormalizedPosterior(obj, prior=prior)
    if prior is not None:
        if sbi_estimator(obj) is not None and kind is None:  # sbi cannot say: a likelihood
            return UnnormalizedPosterior(sbi_estimator(obj), prior=prior)
        raise _prior_unused(obj)
    if vector_field_estimator(obj) is not None:
        return VectorFieldPosterior(obj)
    estimator = sbi_estimator(obj)
    if estimator is not None:
        return SbiPosterior(estimator)
    if is_nflows(obj):
        return NflowsPosterior(obj)
    if callable(obj):
        return DistributionPosterior(obj)
    raise ValueError(
        "posterior must be a zuko flow, an nflows Flow, or a callable "
        f"x -> torch.distributions.Distribution, got {type(obj).__name__}"
    )


def _from_lampe(obj: Any, kind: str, prior: Any) -> Posterior:
    """The adapter of a lampe estimator (:mod:`~calib_lightning.posteriors._lampe`)."""
    if kind == "masked_ratio":
        raise masked_ratio_error(obj)
    if kind == "ratio":
        if prior is None:
            raise ValueError(
                "posterior must be a posterior estimator, got a lampe NRE (a ratio estimator "
                "r(theta, x)), whose posterior is known only up to a constant given the "
                "prior: pass cl.as_posterior(estimator, prior=prior)"
            )
        return UnnormalizedPosterior(obj, prior=prior)
    if prior is not None:
        raise _prior_unused(obj)
    if kind == "posterior":
        return DistributionPosterior(obj.flow)
    posterior = DistributionPosterior(LampeFlow(obj))
    posterior.costly = frozenset({"log_prob", "score"})
    return posterior


def _prior_unused(obj: Any) -> ValueError:
    return ValueError(
        "prior must be given only with a ratio or likelihood estimator (or an sbi MCMC "
        f"posterior), got a prior with {type(obj).__name__}, a posterior estimator that "
        "needs none"
    )
