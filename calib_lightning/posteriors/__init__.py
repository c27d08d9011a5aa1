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

from calib_lightning.posteriors._dispatch import (
    check_kind,
    prior_unused,
    recognize,
    resolve,
    tried,
)
from calib_lightning.posteriors.base import (
    CAPABILITIES,
    NotDifferentiableError,
    Posterior,
    Recognized,
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
from calib_lightning.posteriors.unnormalized import UnnormalizedPosterior
from calib_lightning.posteriors.vector_fields import VectorFieldPosterior

__all__ = [
    "CAPABILITIES",
    "DistributionPosterior",
    "NflowsPosterior",
    "NotDifferentiableError",
    "Posterior",
    "Recognized",
    "SamplePosterior",
    "SbiPosterior",
    "UnnormalizedPosterior",
    "UnsupportedError",
    "VectorFieldPosterior",
    "WrappedPosterior",
    "as_posterior",
    "check_width",
    "density_draws",
    "recognize",
    "supports",
    "unsupported",
]


def as_posterior(obj: Any, *, prior: Any = None, kind: str | None = None) -> Posterior:
    """Wrap a conditional density estimator in the package's :class:`Posterior` interface.

    What ``obj`` is comes from ``obj`` itself (its class and its shapes), through the
    adapter modules' ``recognize`` (:data:`~calib_lightning.posteriors._dispatch.FAMILIES`).

    Arguments:
        obj: a :class:`Posterior` (returned as is, e.g. a :class:`SamplePosterior` for a
            callable that returns samples only), an ``nflows`` ``Flow``, a zuko flow
            (any ``zuko.lazy.LazyDistribution``), an sbi density estimator or
            ``DirectPosterior``, an sbi vector-field estimator (``FMPE``, ``NPSE``) or
            ``VectorFieldPosterior``, a lampe ``NPE`` or ``FMPE``, any callable
            ``x -> torch.distributions.Distribution`` with event shape ``(D,)``; with
            ``prior``: an sbi ratio estimator (``NRE_A/B/C``, ``BNRE``) or likelihood
            estimator (``NLE``, ``MNLE``), a lampe ``NRE``, a callable ``f(theta, x)``
            (a log-likelihood or log-ratio, ``(M, D), (M, *X) -> (M,)``); an sbi
            ``MCMCPosterior``, ``RejectionPosterior`` or ``ImportanceSamplingPosterior``
            (its potential's prior unless ``prior`` is given). These give an
            :class:`UnnormalizedPosterior` (scores only).
        prior: the prior :math:`p(\theta)` of a ratio or likelihood estimator, a
            ``torch.distributions.Distribution`` with event shape ``(D,)``.
        kind: what ``obj`` estimates, where it cannot tell: ``"posterior"``,
            ``"likelihood"`` or ``"ratio"``. sbi's posterior and likelihood estimators
            are the same classes: one that models ``theta`` given ``x`` of the same
            width needs ``kind="posterior"`` (or, for a likelihood, its ``prior``).

    Returns:
        The adapter.

    Raises:
        ValueError: a ratio or likelihood estimator without ``prior`` (it is not a
            posterior), a ``prior`` given with a posterior estimator, an estimator whose
            kind neither it nor the caller tells, a ``kind`` it cannot be, or an object
            no adapter knows.

    Example:
        >>> import torch
        >>> from torch.distributions import Independent, Normal
        >>> def log_likelihood(theta, x):  # x ~ N(theta, 1)
        ...     return Normal(theta, 1.0).log_prob(x).sum(-1)
        >>> prior = Independent(Normal(torch.zeros(2), torch.ones(2)), 1)
        >>> as_posterior(log_likelihood, prior=prior)
        UnnormalizedPosterior(log_likelihood, prior=Independent)
    """
    check_kind(kind)
    if isinstance(obj, Posterior):
        return _declared_posterior(obj, prior, kind)
    found = recognize(obj)
    if found is None:
        raise ValueError(f"posterior must be one of: {tried()}; got {type(obj).__name__}")
    reading = resolve(found, prior=prior, kind=kind)
    if reading == "posterior":
        return found.posterior()
    declared = kind if kind != "posterior" else None
    return UnnormalizedPosterior(obj, prior=found.prior if prior is None else prior, kind=declared)


def _declared_posterior(post: Posterior, prior: Any, kind: str | None) -> Posterior:
    """A :class:`Posterior` as it is, if ``prior`` and ``kind`` fit it."""
    unnormalized = isinstance(post, UnnormalizedPosterior)
    if prior is not None:
        raise prior_unused(Recognized(f"the adapter {post!r}", ("posterior",), "posterior"))
    if kind is not None and (kind == "posterior") == unnormalized:
        raise ValueError(
            f"kind must fit the estimator: posterior is the adapter {post!r}, got kind={kind!r}"
        )
    return post
