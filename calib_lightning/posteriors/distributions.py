"""The adapter for any callable ``x -> torch.distributions.Distribution`` (zuko flows,
Gaussians, ``TransformedDistribution`` s), and the inverse map of such a distribution to
its standard-normal base."""

from __future__ import annotations

import inspect
from collections.abc import Callable
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

from calib_lightning.posteriors._model_info import distribution_dtype, zuko_context
from calib_lightning.posteriors.base import Posterior, Recognized, UnsupportedError

__all__ = ["DistributionPosterior", "draws_and_log_prob", "recognize", "required_arguments"]


def required_arguments(fn: Any) -> int | None:
    """How many positional arguments calling ``fn`` needs (an ``nn.Module``'s ``forward``'s),
    ``None`` when its signature does not say (``*args``, a builtin)."""
    target = fn.forward if isinstance(fn, torch.nn.Module) else fn
    try:
        parameters = inspect.signature(target).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in parameters):
        return None
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return sum(p.kind in positional and p.default is inspect.Parameter.empty for p in parameters)


def recognize(obj: Any) -> Recognized | None:
    """Any other callable, by what calling it needs: one argument, ``x -> Distribution``
    (a posterior); two, ``f(theta, x)``, a log-likelihood or log-ratio (a posterior known
    up to a constant, given the prior); a signature that does not say, a posterior unless
    a prior is given."""
    if not callable(obj):
        return None
    what = (
        type(obj).__name__
        if isinstance(obj, torch.nn.Module)
        else getattr(obj, "__name__", type(obj).__name__)
    )
    needed = required_arguments(obj)
    if needed is not None and needed > 2:
        return None
    if needed == 2:
        return Recognized(
            f"a callable of two arguments, {what}(theta, x), read as a log-likelihood or "
            "log-ratio f(theta, x)",
            ("unnormalized",),
            "unnormalized",
            log_likelihood=obj,
        )
    readings = ("posterior",) if needed is not None else ("posterior", "unnormalized")
    return Recognized(
        f"a callable {what}, read as x -> Distribution",
        readings,
        "posterior",
        lambda: DistributionPosterior(obj),
        log_likelihood=obj,
    )


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
        self.costly = _ode_costs(module)

    def context_shape(self) -> tuple[int, ...] | None:
        if not hasattr(self, "_context"):
            self._context = zuko_context(self.module)
        return self._context

    def distribution(self, x: Tensor) -> Distribution:
        """The conditional distribution at ``x``, batch shape ``(N,)``, event ``(D,)``.

        ``x`` is checked and cast to the model's dtype first.
        """
        x = self._prepare_x(x)
        with self._errors(None, x):
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

    def _draw(self, x: Tensor, num_posterior_samples: int, reparameterized: bool) -> Tensor:
        x, out = self._sampling_inputs(x, num_posterior_samples)
        dist = self.distribution(x)
        with self._errors(None, x):
            draw = dist.rsample if reparameterized else dist.sample
            return draw((num_posterior_samples,)).to(out)

    def sample(self, x: Tensor, num_posterior_samples: int) -> Tensor:
        with torch.no_grad():
            return self._draw(x, num_posterior_samples, reparameterized=False)

    def rsample(self, x: Tensor, num_posterior_samples: int) -> Tensor:
        """Reparameterized samples ``(S, N, D)`` that carry gradients to the parameters."""
        return self._draw(x, num_posterior_samples, reparameterized=True)

    def sample_and_log_prob(self, x: Tensor, num_posterior_samples: int) -> tuple[Tensor, Tensor]:
        x, out = self._sampling_inputs(x, num_posterior_samples)
        with torch.no_grad():
            dist = self.distribution(x)
            with self._errors(None, x):
                theta, log_prob = draws_and_log_prob(dist, num_posterior_samples)
        return theta.to(out), log_prob.to(out)

    def _evaluate(self, theta: Tensor, x: Tensor, method: Callable[..., Tensor]) -> Tensor:
        """``method(dist, theta)`` with ``theta`` checked against the event shape and cast
        to the distribution's dtype; the result in ``theta``'s dtype."""
        x = self._prepare_x(x)
        dist = self.distribution(x)
        inner = self._prepare_theta(theta, x, size=dist.event_shape[-1])
        inner = inner.to(self.dtype or distribution_dtype(dist) or inner.dtype)
        with self._errors(inner, x, size=dist.event_shape[-1]):
            return method(dist, inner).to(theta.dtype)

    def log_prob(self, theta: Tensor, x: Tensor) -> Tensor:
        return self._evaluate(theta, x, lambda dist, value: dist.log_prob(value))

    def to_latent(self, theta: Tensor, x: Tensor) -> Tensor:
        return self._evaluate(theta, x, _to_standard_normal)

    def from_latent(self, z: Tensor, x: Tensor) -> Tensor:
        return self._evaluate(z, x, _from_standard_normal)

    def log_prob_and_latent(self, theta: Tensor, x: Tensor) -> tuple[Tensor, Tensor]:
        both = self._evaluate(theta, x, _log_prob_and_latent)
        return both[..., 0], both[..., 1:]


def draws_and_log_prob(
    dist: Distribution, num: int, *, reparameterized: bool = False
) -> tuple[Tensor, Tensor]:
    """``num`` draws of ``dist`` and their log-densities, in one pass where it has one:
    :func:`_flow_sample_and_log_prob` for an autoregressive zuko flow, else its
    ``rsample_and_log_prob``, else ``sample`` (``rsample`` if ``reparameterized``) then
    ``log_prob``."""
    if _autoregressive_flow(dist):
        return _flow_sample_and_log_prob(dist, num)
    joint = getattr(dist, "rsample_and_log_prob", None)
    if joint is not None:
        return joint((num,))
    theta = (dist.rsample if reparameterized else dist.sample)((num,))
    return theta, dist.log_prob(theta)


def _autoregressive_flow(dist: Distribution) -> bool:
    """A zuko ``NormalizingFlow`` with an autoregressive transform (MAF, NSF, NAF, ...),
    nested compositions (a standardizing affine map in front) included."""
    try:
        from zuko.distributions import NormalizingFlow
        from zuko.transforms import AutoregressiveTransform, ComposedTransform
    except ImportError:  # pragma: no cover - zuko is a dependency
        return False

    def has(transform: object) -> bool:
        if isinstance(transform, ComposedTransform):
            return any(has(part) for part in transform.transforms)
        return type(transform) is AutoregressiveTransform

    return type(dist) is NormalizingFlow and has(dist.transform)


def _flow_sample_and_log_prob(dist: Distribution, num: int) -> tuple[Tensor, Tensor]:
    r"""zuko's ``rsample_and_log_prob`` with one network pass fewer per autoregressive
    transform: the same draws and log-densities, and the same gradients (the coordinates
    the last pass's transform depends on equal the exact inverse's at every parameter
    value, so they are the same functions of the parameters).

    Inverting an autoregressive transform takes ``passes`` passes, each building the
    element-wise transform ``f = meta(x)`` from the current ``x``; zuko then builds
    ``meta(x)`` once more for the Jacobian. The last pass's ``f`` is that transform
    already: it was built from an ``x`` whose every coordinate that a parameter depends on
    (those of earlier passes) is final, and the masked network ignores the others. So
    its ``log_abs_det_jacobian`` is the transform's, and the extra pass (a third of the
    work at ``D = 2``, where sampling takes two) is skipped.
    """
    from torch.distributions.utils import _sum_rightmost

    base = dist.base
    z = (base.rsample if base.has_rsample else base.sample)((num,))
    theta, ladj = _inverse_and_ladj(dist.transform, z)
    return theta, base.log_prob(z) - _sum_rightmost(ladj, dist.reinterpreted)


def _inverse_and_ladj(transform: object, y: Tensor) -> tuple[Tensor, Tensor]:
    """``transform.inv.call_and_ladj(y)`` as zuko computes it (a composition's event
    dimensions summed the same way), autoregressive parts without their extra pass."""
    from torch.distributions.utils import _sum_rightmost
    from zuko.transforms import AutoregressiveTransform, ComposedTransform

    if isinstance(transform, ComposedTransform):
        acc, event_dim = 0, transform.codomain_dim
        for part in reversed(transform.transforms):
            inverse = part.inv
            y, ladj = _inverse_and_ladj(part, y)
            acc = acc + _sum_rightmost(ladj, event_dim - inverse.domain.event_dim)
            event_dim += inverse.codomain.event_dim - inverse.domain.event_dim
        return y, acc
    if type(transform) is AutoregressiveTransform:
        x = torch.zeros_like(y)
        for _ in range(transform.passes):
            step = transform.meta(x)
            x = step.inv(y)
        return x, -step.log_abs_det_jacobian(x, y)
    return transform.inv.call_and_ladj(y)


def _ode_costs(module: object) -> frozenset[str]:
    """What a continuous flow (a zuko ``CNF``: an ODE whose density integrates a trace
    along the path) computes only at many times the cost of sampling; nothing otherwise."""
    if isinstance(module, torch.nn.Module):
        from zuko.flows.continuous import FFJTransform

        if any(isinstance(part, FFJTransform) for part in module.modules()):
            return frozenset({"log_prob", "score"})
    return frozenset()


def _log_prob_and_latent(dist: Distribution, value: Tensor) -> Tensor:
    """``[log q, z]`` stacked ``(*, 1 + D)``; one transform pass for a zuko flow."""
    transform, base = getattr(dist, "transform", None), getattr(dist, "base", None)
    if base is None or not hasattr(transform, "call_and_ladj"):
        return torch.cat([dist.log_prob(value).unsqueeze(-1), _to_standard_normal(dist, value)], -1)
    z, ladj = transform.call_and_ladj(value)
    return torch.cat([(base.log_prob(z) + ladj).unsqueeze(-1), _to_standard_normal(base, z)], -1)


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
    raise UnsupportedError(
        "to_latent needs a flow or a Gaussian whose base is a normal distribution, got "
        f"{type(dist).__name__}"
    )


def _from_standard_normal(dist: Distribution, z: Tensor) -> Tensor:
    """The generative map of ``dist`` from its standard normal base: the inverse of
    :func:`_to_standard_normal`."""
    transform = getattr(dist, "transform", None)
    base = getattr(dist, "base", None)
    if transform is not None and base is not None:  # zuko NormalizingFlow: theta = f^-1(z)
        return transform.inv(_from_standard_normal(base, z))
    if isinstance(dist, TransformedDistribution):
        value = _from_standard_normal(dist.base_dist, z)
        for t in dist.transforms:
            value = t(value)
        return value
    if isinstance(dist, Independent):
        return _from_standard_normal(dist.base_dist, z)
    if isinstance(dist, Normal):
        return dist.loc + dist.scale * z
    if isinstance(dist, MultivariateNormal):
        tril = dist.scale_tril.expand(z.shape[:-1] + dist.scale_tril.shape[-2:])
        return dist.loc + (tril @ z.unsqueeze(-1)).squeeze(-1)
    raise UnsupportedError(
        "from_latent needs a flow or a Gaussian whose base is a normal distribution, got "
        f"{type(dist).__name__}"
    )
