r"""One interface over conditional density estimators :math:`q(\theta \mid x)`.

Every diagnostic in the package talks to a :class:`Posterior`, never to zuko,
nflows or torch.distributions directly. :func:`as_posterior` picks the adapter.

Shape convention, identical for every backend:

* ``x``: observations, shape ``(N, *X)`` (usually ``(N, X)``);
* ``sample(x, S)`` -> ``(S, N, D)``;
* ``log_prob(theta, x)``: ``theta`` of shape ``(*, N, D)`` -> ``(*, N)``;
* ``score(theta, x)``: :math:`\nabla_\theta \log q(\theta \mid x)`, ``(*, N, D)``;
* ``to_latent(theta, x)``: the flow's base-space point :math:`z = T^{-1}(\theta; x)`,
  ``(*, N, D)``, standard normal when ``theta ~ q(. | x)``.

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

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor
from torch.distributions import (
    Distribution,
    Independent,
    MultivariateNormal,
    Normal,
    TransformedDistribution,
)

from calib_lightning._checks import check_finite, check_positive

__all__ = [
    "DistributionPosterior",
    "NflowsPosterior",
    "Posterior",
    "SbiPosterior",
    "as_posterior",
]


def _check_x(x: Tensor) -> Tensor:
    if not isinstance(x, Tensor):
        raise ValueError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.ndim < 2:
        raise ValueError(
            f"x must have shape (N, X) with a leading batch dimension, got {tuple(x.shape)}"
        )
    return x


def _check_theta(theta: Tensor, x: Tensor) -> Tensor:
    if not isinstance(theta, Tensor):
        raise ValueError(f"theta must be a torch.Tensor, got {type(theta).__name__}")
    if theta.ndim < 2 or theta.shape[-2] != x.shape[0]:
        raise ValueError(
            f"theta must have shape (*, N, D) with N = {x.shape[0]} (the rows of x), "
            f"got {tuple(theta.shape)}"
        )
    return theta


def _check_num_samples(num_samples: int) -> int:
    check_positive("num_samples", num_samples, integer=True)
    return num_samples


class Posterior:
    r"""Base class: a conditional density :math:`q(\theta \mid x)` with a fixed interface.

    Subclasses implement :meth:`sample`, :meth:`log_prob` and :meth:`to_latent`;
    :meth:`score` and :meth:`sample_and_log_prob` have generic implementations.

    Arguments:
        module: the wrapped estimator (kept so callers can reach its parameters).
    """

    def __init__(self, module: Any) -> None:
        self.module = module

    def __repr__(self) -> str:
        return f"{type(self).__name__}({type(self.module).__name__})"

    def sample(self, x: Tensor, num_samples: int) -> Tensor:
        """Draw ``num_samples`` parameters per observation: ``(S, N, D)``, no gradient."""
        raise NotImplementedError

    def log_prob(self, theta: Tensor, x: Tensor) -> Tensor:
        """Log-density of ``theta`` ``(*, N, D)`` under ``q(. | x)``: ``(*, N)``."""
        raise NotImplementedError

    def to_latent(self, theta: Tensor, x: Tensor) -> Tensor:
        """Map ``theta`` ``(*, N, D)`` to the standard-normal base space: ``(*, N, D)``."""
        raise NotImplementedError

    def sample_and_log_prob(self, x: Tensor, num_samples: int) -> tuple[Tensor, Tensor]:
        """Samples ``(S, N, D)`` and their log-densities ``(S, N)``, without gradient.

        Flows override this to reuse the sampling pass for the density.
        """
        with torch.no_grad():
            theta = self.sample(x, num_samples)
            return theta, self.log_prob(theta, x)

    def score(self, theta: Tensor, x: Tensor, *, create_graph: bool = False) -> Tensor:
        r"""Score :math:`\nabla_\theta \log q(\theta \mid x)`, shape ``(*, N, D)``.

        Computed by autograd through the estimator. With ``create_graph=True`` the
        result stays differentiable with respect to the estimator's parameters
        (needed for calibration losses); ``theta`` itself is treated as data.
        """
        x = _check_x(x)
        theta = _check_theta(theta, x)
        with torch.enable_grad():
            leaf = theta.detach().requires_grad_(True)
            log_prob = self.log_prob(leaf, x)
            (grad,) = torch.autograd.grad(log_prob.sum(), leaf, create_graph=create_graph)
        return grad


class DistributionPosterior(Posterior):
    r"""Adapter for any callable ``x -> torch.distributions.Distribution``.

    Covers zuko flows (``flow(x)`` is a :class:`zuko.distributions.NormalizingFlow`),
    and user functions returning ``Independent(Normal)``, ``MultivariateNormal`` or a
    ``TransformedDistribution``. The distribution must have batch shape ``(N,)`` and
    event shape ``(D,)``; a ``Normal`` with batch shape ``(N, D)`` is reinterpreted
    as ``Independent(Normal, 1)``.

    Arguments:
        module: callable taking ``x`` of shape ``(N, *X)``.
    """

    def __init__(self, module: Callable[[Tensor], Distribution]) -> None:
        if not callable(module):
            raise ValueError(f"module must be callable x -> Distribution, got {module!r}")
        super().__init__(module)

    def distribution(self, x: Tensor) -> Distribution:
        """The conditional distribution at ``x``, batch shape ``(N,)``, event ``(D,)``."""
        x = _check_x(x)
        dist = self.module(x)
        if not isinstance(dist, Distribution):
            raise ValueError(
                "the posterior callable must return a torch.distributions.Distribution, "
                f"got {type(dist).__name__}"
            )
        n = x.shape[0]
        if len(dist.event_shape) == 0 and len(dist.batch_shape) == 2:
            dist = Independent(dist, 1)
        if tuple(dist.batch_shape) != (n,) or len(dist.event_shape) != 1:
            raise ValueError(
                "the posterior distribution must have batch shape (N,) and event shape (D,) "
                f"with N = {n}, got batch {tuple(dist.batch_shape)} and event "
                f"{tuple(dist.event_shape)}"
            )
        return dist

    def sample(self, x: Tensor, num_samples: int) -> Tensor:
        num_samples = _check_num_samples(num_samples)
        with torch.no_grad():
            return self.distribution(x).sample((num_samples,))

    def rsample(self, x: Tensor, num_samples: int) -> Tensor:
        """Reparameterized samples ``(S, N, D)`` that carry gradients to the parameters."""
        return self.distribution(x).rsample((_check_num_samples(num_samples),))

    def sample_and_log_prob(self, x: Tensor, num_samples: int) -> tuple[Tensor, Tensor]:
        num_samples = _check_num_samples(num_samples)
        with torch.no_grad():
            dist = self.distribution(x)
            joint = getattr(dist, "rsample_and_log_prob", None)
            if joint is not None:
                return joint((num_samples,))
            theta = dist.sample((num_samples,))
            return theta, dist.log_prob(theta)

    def log_prob(self, theta: Tensor, x: Tensor) -> Tensor:
        theta = _check_theta(theta, x)
        return self.distribution(x).log_prob(theta)

    def to_latent(self, theta: Tensor, x: Tensor) -> Tensor:
        theta = _check_theta(theta, x)
        return _to_standard_normal(self.distribution(x), theta)


def _to_standard_normal(dist: Distribution, value: Tensor) -> Tensor:
    """Invert ``dist``'s generative map down to a standard normal base."""
    transform = getattr(dist, "transform", None)
    base = getattr(dist, "base", None)
    if transform is not None and base is not None:  # zuko NormalizingFlow: z = f(theta)
        return _to_standard_normal(base, transform(value))
    if isinstance(dist, TransformedDistribution):  # torch: theta = t_k(...t_1(z))
        for t in reversed(dist.transforms):
            value = t.inv(value)
        return _to_standard_normal(dist.base_dist, value)
    if isinstance(dist, Independent):
        return _to_standard_normal(dist.base_dist, value)
    if isinstance(dist, Normal):
        return (value - dist.loc) / dist.scale
    if isinstance(dist, MultivariateNormal):
        diff = (value - dist.loc).unsqueeze(-1)
        tril = dist.scale_tril.expand(diff.shape[:-2] + dist.scale_tril.shape[-2:])
        return torch.linalg.solve_triangular(tril, diff, upper=False).squeeze(-1)
    raise ValueError(
        "to_latent needs a flow or a Gaussian whose base is a normal distribution, got "
        f"{type(dist).__name__}"
    )


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


class NflowsPosterior(Posterior):
    """Adapter for an ``nflows.flows.Flow`` conditioned on ``x`` through its context.

    nflows works on flat batches: ``(*, N, D)`` inputs are flattened and the
    context repeated, then reshaped back. nflows draws its base noise in torch's
    default dtype; the adapter samples under the flow's own dtype so float64 flows
    work.

    Arguments:
        module: an ``nflows.flows.base.Flow``.
    """

    def _dtype(self, x: Tensor) -> torch.dtype:
        param = next(iter(self.module.parameters()), None)
        return param.dtype if param is not None else x.dtype

    def sample(self, x: Tensor, num_samples: int) -> Tensor:
        num_samples = _check_num_samples(num_samples)
        x = _check_x(x)
        with torch.no_grad(), _default_dtype(self._dtype(x)):
            return self.module.sample(num_samples, context=x).transpose(0, 1)

    def sample_and_log_prob(self, x: Tensor, num_samples: int) -> tuple[Tensor, Tensor]:
        num_samples = _check_num_samples(num_samples)
        x = _check_x(x)
        with torch.no_grad(), _default_dtype(self._dtype(x)):
            theta, log_prob = self.module.sample_and_log_prob(num_samples, context=x)
        return theta.transpose(0, 1), log_prob.transpose(0, 1)

    def _flat(self, theta: Tensor, x: Tensor) -> tuple[Tensor, Tensor, torch.Size]:
        theta = _check_theta(theta, _check_x(x))
        lead = theta.shape[:-2]
        reps = lead.numel()
        flat = theta.reshape(-1, theta.shape[-1])
        context = x.repeat((reps,) + (1,) * (x.ndim - 1)) if reps > 1 else x
        return flat, context, lead

    def log_prob(self, theta: Tensor, x: Tensor) -> Tensor:
        flat, context, lead = self._flat(theta, x)
        return self.module.log_prob(flat, context=context).reshape(*lead, x.shape[0])

    def to_latent(self, theta: Tensor, x: Tensor) -> Tensor:
        flat, context, lead = self._flat(theta, x)
        noise = self.module.transform_to_noise(flat, context=context)
        base = self.module._distribution
        name = type(base).__name__
        if name == "ConditionalDiagonalNormal":
            mean, log_std = base._compute_params(self.module._embedding_net(context))
            noise = (noise - mean) * torch.exp(-log_std)
        elif name != "StandardNormal":
            raise ValueError(
                "to_latent needs an nflows base distribution StandardNormal or "
                f"ConditionalDiagonalNormal, got {name}"
            )
        return noise.reshape(*lead, x.shape[0], theta.shape[-1])


class SbiPosterior(Posterior):
    """Adapter for an sbi (>= 0.24) ``ConditionalDensityEstimator`` (``ZukoFlow``,
    ``NFlowsFlow``, mixture density networks), or the estimator inside an sbi
    ``DirectPosterior``.

    The estimator is diagnosed as trained, without the prior-support rejection that
    ``DirectPosterior`` adds when sampling. ``to_latent`` uses the estimator's
    ``inverse_transform`` (flows only). Samples and their log-densities come from
    separate ``sample`` and ``log_prob`` calls, never from sbi's
    ``sample_and_log_prob`` (its nflows version mismatches samples and conditions
    in sbi 0.27).

    Arguments:
        module: the estimator.
    """

    def sample(self, x: Tensor, num_samples: int) -> Tensor:
        num_samples = _check_num_samples(num_samples)
        with torch.no_grad():
            return self.module.sample((num_samples,), condition=_check_x(x))

    # sample_and_log_prob is inherited (sample, then log_prob) on purpose: in sbi 0.27,
    # NFlowsFlow.sample_and_log_prob reshapes nflows' (N, S, D) output to (S, N, D)
    # without transposing, which pairs samples with the wrong conditions.

    def log_prob(self, theta: Tensor, x: Tensor) -> Tensor:
        theta = _check_theta(theta, _check_x(x))
        lead = theta.shape[:-2]
        flat = theta.reshape(-1, *theta.shape[-2:])
        return self.module.log_prob(flat, condition=x).reshape(*lead, x.shape[0])

    def to_latent(self, theta: Tensor, x: Tensor) -> Tensor:
        theta = _check_theta(theta, _check_x(x))
        return self.module.inverse_transform(theta, x)


def _sbi_estimator(obj: object) -> Any | None:
    """The sbi density estimator behind ``obj``, or ``None`` if ``obj`` is not from sbi."""
    if not type(obj).__module__.startswith("sbi."):
        return None
    try:
        from sbi.neural_nets.estimators.base import ConditionalDensityEstimator
    except ImportError:  # pragma: no cover - an old sbi
        return None
    estimator = getattr(obj, "posterior_estimator", obj)
    return estimator if isinstance(estimator, ConditionalDensityEstimator) else None


def _is_nflows(obj: object) -> bool:
    try:
        from nflows.flows.base import Flow
    except ImportError:  # pragma: no cover - nflows is a dependency
        return False
    return isinstance(obj, Flow)


def as_posterior(obj: Any) -> Posterior:
    """Wrap a conditional density estimator in the package's :class:`Posterior` interface.

    Arguments:
        obj: a :class:`Posterior` (returned as is), an ``nflows`` ``Flow``, a zuko flow
            (any ``zuko.lazy.LazyDistribution``), an sbi density estimator or
            ``DirectPosterior``, or any callable ``x -> torch.distributions.Distribution``
            with event shape ``(D,)``.

    Returns:
        The adapter.
    """
    if isinstance(obj, Posterior):
        return obj
    estimator = _sbi_estimator(obj)
    if estimator is not None:
        return SbiPosterior(estimator)
    if _is_nflows(obj):
        return NflowsPosterior(obj)
    if callable(obj):
        return DistributionPosterior(obj)
    raise ValueError(
        "posterior must be a zuko flow, an nflows Flow, or a callable "
        f"x -> torch.distributions.Distribution, got {type(obj).__name__}"
    )


def checked_samples(samples: Tensor, log_prob: Tensor | None = None) -> None:
    """Raise if a posterior produced non-finite samples or log-densities, naming how many pairs."""
    check_finite("posterior samples", samples.transpose(0, 1))
    if log_prob is not None:
        check_finite("posterior log_prob", log_prob.transpose(0, 1))
