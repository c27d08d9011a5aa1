"""``as_posterior``: the adapter of an estimator, as the adapter modules recognize it."""

from __future__ import annotations

from typing import Any

from calib_lightning.posteriors._dispatch import (
    check_kind,
    prior_unused,
    recognize,
    resolve,
    tried,
)
from calib_lightning.posteriors.base import Posterior, Recognized
from calib_lightning.posteriors.unnormalized import UnnormalizedPosterior

__all__ = ["as_posterior"]


def as_posterior(obj: Any, *, prior: Any = None, kind: str | None = None) -> Posterior:
    r"""Wrap a conditional density estimator in the package's :class:`Posterior` interface.

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
