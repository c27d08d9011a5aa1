r"""Posteriors known up to their normalizing constant:
:math:`q(\theta \mid x) \propto \exp f(\theta, x)\, p(\theta)`.

A ratio estimator (sbi's ``NRE_A/B/C``, ``BNRE``) gives :math:`f = \log r(\theta, x)`, a
likelihood estimator (sbi's ``NLE``, ``MNLE``) :math:`f = \log q(x \mid \theta)`, an sbi
``MCMCPosterior`` / ``RejectionPosterior`` / ``ImportanceSamplingPosterior`` its potential.
Such a posterior has a score and nothing else the package uses (no sampler, no latent
map, no normalized density): KCCSD checks it from scores alone; the checks that need
samples, densities or latents refuse it with an :class:`UnsupportedError`.

Bounded priors: the Stein identity behind KCCSD needs the density to vanish at the edge
of its support, which a posterior truncated to a box does not. :meth:`UnnormalizedPosterior.
unconstrained` gives the same posterior in :math:`u = T^{-1}(\theta)` with
:math:`T` = ``torch.distributions.biject_to(prior.support)`` (a scaled sigmoid for a box,
as sbi's ``mcmc_transform``), whose density :math:`q(T(u) \mid x) |\det T'(u)|` lives on
all of :math:`\mathbb{R}^D`; :class:`calib_lightning.KCCSD` tests there.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.distributions import Transform, biject_to, constraints

from calib_lightning._utils.prior import not_a_prior, outside_support
from calib_lightning.posteriors._dispatch import recognize, resolve
from calib_lightning.posteriors.base import Posterior, unsupported
from calib_lightning.posteriors.samples import SamplePosterior

__all__ = ["SampledUnnormalizedPosterior", "UnnormalizedPosterior", "in_testing_space"]


class UnnormalizedPosterior(Posterior):
    r"""The posterior :math:`q(\theta \mid x) \propto \exp f(\theta, x)\, p(\theta)`, known
    through its score only.

    Capabilities: ``score`` (autograd of :math:`f + \log p` in ``theta``) and
    :meth:`unnormalized_log_prob`; no ``sample``, ``log_prob`` or ``to_latent``: the
    checks needing them raise an :class:`~calib_lightning.posteriors.UnsupportedError`.
    Where the prior's density is zero (``theta`` outside its support) the score is NaN,
    which the metrics report as a non-finite score.

    Arguments:
        log_likelihood: :math:`f`, a batched callable ``(theta (M, D), x (M, *X)) -> (M,)``
            returning a log-likelihood or a log-ratio, up to any function of ``x``; an sbi
            ``RatioEstimator`` (``NRE_A/B/C``, ``BNRE``: :math:`\log r`), an sbi
            likelihood estimator (``NLE``, ``MNLE``: :math:`\log q(x \mid \theta)`), a
            lampe ``NRE`` or an sbi ``MCMCPosterior`` is adapted as such.
        prior: :math:`p`, a ``torch.distributions.Distribution`` with event shape
            ``(D,)`` (batch and event shape together; sbi's ``BoxUniform``), whose
            ``support`` decides the space KCCSD tests in (:meth:`unconstrained`).
        kind: ``"ratio"`` or ``"likelihood"``: what :math:`f` is, where the estimator does
            not say (a plain callable); a ratio gets the balance check.

    Attributes:
        kind: ``"ratio"``, ``"likelihood"``, or ``None`` when not known.

    Example:
        A Gaussian likelihood :math:`x \sim N(\theta, I)` and a standard normal prior:
        the posterior is :math:`N(x / 2, I / 2)`, its score :math:`x - 2 \theta`.

        >>> from torch.distributions import Independent, Normal
        >>> def log_lik(theta, x):
        ...     return -0.5 * ((x - theta) ** 2).sum(-1)
        >>> prior = Independent(Normal(torch.zeros(2), torch.ones(2)), 1)
        >>> post = UnnormalizedPosterior(log_lik, prior=prior)
        >>> post.score(torch.ones(3, 2), torch.zeros(3, 2))[0]
        tensor([-2., -2.])
        >>> sorted(post.capabilities)
        ['score']
    """

    capabilities: frozenset[str] = frozenset({"score"})

    def __init__(
        self,
        log_likelihood: Callable[[Tensor, Tensor], Tensor],
        prior: Any,
        *,
        kind: str | None = None,
    ) -> None:
        if kind not in (None, "ratio", "likelihood"):
            raise ValueError(f"kind must be 'ratio', 'likelihood' or None, got {kind!r}")
        found = None if isinstance(log_likelihood, Posterior) else recognize(log_likelihood)
        if found is None:
            got = type(log_likelihood).__name__
            raise ValueError(
                "log_likelihood must be a callable (theta (M, D), x (M, *X)) -> (M,), an sbi "
                f"RatioEstimator or an sbi likelihood estimator, got {got}"
            )
        self._size = _prior_size(prior)
        if found.readings == ("posterior",):
            raise ValueError(
                f"log_likelihood must be a likelihood or ratio estimator, got {found.what} "
                "(a posterior estimator): pass it to cl.as_posterior without a prior"
            )
        reading = resolve(found, prior=prior, kind=kind, argument="log_likelihood")
        size, context = found.shapes.get(reading, (None, None))
        if size is not None and size != self._size:
            raise ValueError(
                f"prior must have event shape (D,) = ({size},) like the estimator's "
                f"parameters, got ({self._size},)"
            )
        super().__init__(found.log_likelihood)
        self.prior = prior
        self.kind = kind if kind is not None else (reading if reading != "unnormalized" else None)
        self._context = context

    def __repr__(self) -> str:
        name = getattr(self.module, "__name__", type(self.module).__name__)
        return f"{type(self).__name__}({name}, prior={type(self.prior).__name__})"

    def event_size(self) -> int | None:
        return self._size

    def context_shape(self) -> tuple[int, ...] | None:
        return self._context

    # -- the density, up to a constant per x ----------------------------------------
    def log_likelihood(self, theta: Tensor, x: Tensor) -> Tensor:
        r""":math:`f(\theta, x)` at ``theta (*, N, D)``, ``x (N, *X)``: ``(*, N)``, with the
        graph of ``theta`` and the model's parameters."""
        x = self._prepare_x(x)
        inner = self._prepare_theta(theta, x)
        lead, n = inner.shape[:-2], x.shape[0]
        flat = inner.reshape(-1, inner.shape[-1])
        rep = x.expand(*lead, *x.shape).reshape(-1, *x.shape[1:]) if lead else x
        with self._errors(flat, rep):
            out = self.module(flat, rep)
        if not isinstance(out, Tensor) or out.shape != (flat.shape[0],):
            got = tuple(out.shape) if isinstance(out, Tensor) else type(out).__name__
            raise ValueError(
                f"log_likelihood must return shape (M,) = ({flat.shape[0]},) for theta of shape "
                f"(M, D) = {tuple(flat.shape)} and x of shape (M, *X), got {got}"
            )
        return out.reshape(*lead, n).to(theta.dtype)

    def log_prior(self, theta: Tensor) -> Tensor:
        r""":math:`\log p(\theta)` at ``theta (..., D)``: ``(...)``, ``-inf`` outside the
        support (where torch's argument validation would raise)."""
        outside = outside_support(self.prior, theta)
        safe = theta
        if bool(outside.any()):
            inside = biject_to(self.prior.support)(torch.zeros_like(theta))
            safe = torch.where(outside[..., None], inside, theta)
        log_p = self.prior.log_prob(safe)
        if log_p.shape == theta.shape:  # a Uniform with batch shape (D,)
            log_p = log_p.sum(-1)
        return log_p.masked_fill(outside, float("-inf"))

    def unnormalized_log_prob(self, theta: Tensor, x: Tensor) -> Tensor:
        r""":math:`f(\theta, x) + \log p(\theta)` at ``theta (*, N, D)``, ``x (N, *X)``:
        ``(*, N)``, the log-density up to a constant per ``x``; ``-inf`` outside the
        prior's support whatever :math:`f` is there.

        Raises:
            ValueError: :math:`f` is ``+inf`` or NaN inside the prior's support.
        """
        f = self.log_likelihood(theta, x)
        log_p = self.log_prior(theta.to(f.dtype)).to(f)
        outside = log_p == float("-inf")
        bad = ~outside & (torch.isnan(f) | (f == float("inf")))
        if bool(bad.any()):
            what = "NaN" if bool(torch.isnan(f[bad]).any()) else "+inf"
            rows = bad.reshape(-1, bad.shape[-1]).any(0).nonzero().flatten()[:5].tolist()
            raise ValueError(
                f"log_likelihood must be finite inside the prior's support, got {what} at "
                f"{int(bad.sum())} of {bad.numel()} points (rows of x: {rows})"
            )
        return torch.where(outside, log_p, f + log_p)

    def score(self, theta: Tensor, x: Tensor, *, create_graph: bool = False) -> Tensor:
        r"""Score :math:`\nabla_\theta [f(\theta, x) + \log p(\theta)]`, ``(*, N, D)``, NaN
        where the prior's density is zero. ``create_graph=True`` keeps it differentiable
        in the model's parameters (``theta`` is data), as :meth:`Posterior.score`."""
        grad, log_q = self._autograd_score(
            self.unnormalized_log_prob,
            theta,
            x,
            create_graph,
            "whose log-likelihood and log-prior have no gradient in theta",
            finite_only=True,
        )
        return grad.masked_fill(~torch.isfinite(log_q)[..., None], float("nan"))

    def sample(self, x: Tensor, num_posterior_samples: int) -> Tensor:
        raise unsupported(self, "sample")

    def log_prob(self, theta: Tensor, x: Tensor) -> Tensor:
        raise unsupported(self, "log_prob")

    def to_latent(self, theta: Tensor, x: Tensor) -> Tensor:
        raise unsupported(self, "to_latent")

    # -- the unconstrained space ----------------------------------------------------------
    def support_transform(self) -> Transform | None:
        r""":math:`T: \mathbb{R}^D \to` the prior's support (``biject_to(prior.support)``),
        or ``None`` when the support is all of :math:`\mathbb{R}^D` (or unknown)."""
        support = getattr(self.prior, "support", None)
        if support is None or _is_real(support):
            return None
        transform = biject_to(support)
        if tuple(transform.forward_shape((self._size,))) != (self._size,):
            raise ValueError(
                f"prior must have a support mapped elementwise onto R^D, got {support}"
            )
        return transform

    def unconstrained(self) -> UnnormalizedPosterior | None:
        r"""The same posterior in :math:`u = T^{-1}(\theta)` (:meth:`support_transform`), with
        density :math:`q(T(u) \mid x) |\det T'(u)|` on :math:`\mathbb{R}^D`; ``None`` when
        the prior's support is unbounded (``theta`` is already unconstrained)."""
        transform = self.support_transform()
        return None if transform is None else _Unconstrained(self, transform)

    def to_unconstrained(self, theta: Tensor) -> Tensor:
        r""":math:`u = T^{-1}(\theta)` ``(..., D)``; ``theta`` must lie inside the support."""
        transform = self.support_transform()
        if transform is None:
            return theta
        u = transform.inv(theta)
        bad = outside_support(self.prior, theta) | ~torch.isfinite(u).all(-1)
        if bool(bad.any()):
            raise ValueError(
                f"theta must lie inside the prior's support to be tested in the unconstrained "
                f"space, got {int(bad.sum())} rows outside it"
            )
        return u


class SampledUnnormalizedPosterior(UnnormalizedPosterior):
    """An :class:`UnnormalizedPosterior` with a sampler of the user's (MCMC, say) for the
    checks that need samples; its scores stay those of ``inner``.

    Arguments:
        inner: the posterior known up to its constant.
        sampler: a callable ``(x (N, *X), num_samples) -> (S, N, D)`` or a posterior that
            samples.
    """

    capabilities = frozenset({"score", "sample"})

    def __init__(self, inner: UnnormalizedPosterior, sampler: Any) -> None:
        Posterior.__init__(self, inner.module)
        self.prior, self._size, self._context = inner.prior, inner._size, inner._context
        self.kind = inner.kind
        self.sampler = (
            sampler
            if isinstance(sampler, Posterior)
            else SamplePosterior(sampler, num_dims=inner._size)
        )
        if "sample" not in self.sampler.capabilities:
            raise ValueError(
                f"sampler must draw samples: a callable (x (N, *X), num_samples) "
                f"-> (S, N, D) or a posterior that samples, got {self.sampler!r}"
            )

    def sample(self, x: Tensor, num_posterior_samples: int) -> Tensor:
        return self.sampler.sample(x, num_posterior_samples)


class _Unconstrained(UnnormalizedPosterior):
    """An :class:`UnnormalizedPosterior` seen in :math:`u = T^{-1}(\\theta)`."""

    def __init__(self, inner: UnnormalizedPosterior, transform: Transform) -> None:
        Posterior.__init__(self, inner.module)
        self.inner, self.transform, self.kind = inner, transform, inner.kind
        self.prior, self._size, self._context = inner.prior, inner._size, inner._context

    def unnormalized_log_prob(self, theta: Tensor, x: Tensor) -> Tensor:
        u = theta
        theta = self.transform(u)
        jacobian = self.transform.log_abs_det_jacobian(u, theta)
        if jacobian.shape == u.shape:
            jacobian = jacobian.sum(-1)
        return self.inner.unnormalized_log_prob(theta, x) + jacobian

    def support_transform(self) -> Transform | None:
        return None


def in_testing_space(posterior: Any, theta: Tensor) -> tuple[Any, Tensor, str | None]:
    """``(posterior, theta, space)`` in the space a Stein test runs in: for an
    :class:`UnnormalizedPosterior` with a bounded prior (or an sbi posterior over a
    potential, which carries its prior), its :meth:`~UnnormalizedPosterior.unconstrained`
    posterior, ``u = T^{-1}(theta)`` and ``"unconstrained"``; otherwise the inputs
    unchanged and ``None``."""
    if not isinstance(posterior, UnnormalizedPosterior):
        found = None if isinstance(posterior, Posterior) else recognize(posterior)
        if found is None or found.prior is None:
            return posterior, theta, None
        posterior = UnnormalizedPosterior(posterior, prior=found.prior)
    inner = posterior.unconstrained()
    if inner is None:
        return posterior, theta, None
    return inner, posterior.to_unconstrained(theta.detach()), "unconstrained"


def _prior_size(prior: Any) -> int:
    """``D`` of a prior with event shape ``(D,)`` (batch and event shape together)."""
    if prior is None:
        raise ValueError(
            "prior must be the prior of the unnormalized posterior (a torch Distribution with "
            "event shape (D,)), got None"
        )
    if not hasattr(prior, "log_prob"):
        raise not_a_prior(prior)
    shape = tuple(getattr(prior, "batch_shape", ())) + tuple(getattr(prior, "event_shape", ()))
    if len(shape) != 1:
        raise ValueError(
            f"prior must have event shape (D,) (batch and event shape together), got {shape}"
        )
    return int(shape[0])


def _is_real(support: Any) -> bool:
    while isinstance(support, constraints.independent):
        support = support.base_constraint
    return isinstance(support, constraints._Real)
