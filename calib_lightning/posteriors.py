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
from zuko.lazy import LazyDistribution

from calib_lightning._model_info import (
    default_dtype,
    distribution_dtype,
    is_nflows,
    nflows_context,
    sbi_estimator,
    zuko_context,
)
from calib_lightning._posterior_base import Posterior, check_width

__all__ = [
    "DistributionPosterior",
    "NflowsPosterior",
    "Posterior",
    "SbiPosterior",
    "as_posterior",
    "check_width",
]


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
                joint = getattr(dist, "rsample_and_log_prob", None)
                if joint is not None:
                    theta, log_prob = joint((num_posterior_samples,))
                else:
                    theta = dist.sample((num_posterior_samples,))
                    log_prob = dist.log_prob(theta)
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

    def log_prob_and_latent(self, theta: Tensor, x: Tensor) -> tuple[Tensor, Tensor]:
        both = self._evaluate(theta, x, _log_prob_and_latent)
        return both[..., 0], both[..., 1:]


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
    raise ValueError(
        "to_latent needs a flow or a Gaussian whose base is a normal distribution, got "
        f"{type(dist).__name__}"
    )


class NflowsPosterior(Posterior):
    """Adapter for an ``nflows.flows.Flow`` conditioned on ``x`` through its context.

    nflows works on flat batches: ``(*, N, D)`` inputs are flattened and the
    context repeated, then reshaped back. nflows draws its base noise in torch's
    default dtype; the adapter samples under the flow's own dtype so float64 flows
    work.

    Arguments:
        module: an ``nflows.flows.base.Flow``.
    """

    # nflows' Flow exposes its parts only as private attributes (_distribution,
    # _transform, _embedding_net); they are the only way to read D and the context width.
    def event_size(self) -> int | None:
        shape = getattr(getattr(self.module, "_distribution", None), "_shape", None)
        return int(shape[-1]) if shape is not None and len(shape) == 1 else None

    def context_shape(self) -> tuple[int, ...] | None:
        if not hasattr(self, "_context"):
            self._context = nflows_context(self.module)
        return self._context

    def sample(self, x: Tensor, num_posterior_samples: int) -> Tensor:
        x, out = self._sampling_inputs(x, num_posterior_samples)
        with torch.no_grad(), default_dtype(x.dtype), self._errors(None, x):
            return self.module.sample(num_posterior_samples, context=x).transpose(0, 1).to(out)

    def sample_and_log_prob(self, x: Tensor, num_posterior_samples: int) -> tuple[Tensor, Tensor]:
        x, out = self._sampling_inputs(x, num_posterior_samples)
        with torch.no_grad(), default_dtype(x.dtype), self._errors(None, x):
            theta, log_prob = self.module.sample_and_log_prob(num_posterior_samples, context=x)
        return theta.transpose(0, 1).to(out), log_prob.transpose(0, 1).to(out)

    def _flat(self, theta: Tensor, x: Tensor) -> tuple[Tensor, Tensor, torch.Size]:
        x = self._prepare_x(x)
        theta = self._prepare_theta(theta, x)
        lead = theta.shape[:-2]
        reps = lead.numel()
        flat = theta.reshape(-1, theta.shape[-1])
        context = x.repeat((reps,) + (1,) * (x.ndim - 1)) if reps > 1 else x
        return flat, context, lead

    def log_prob(self, theta: Tensor, x: Tensor) -> Tensor:
        flat, context, lead = self._flat(theta, x)
        with self._errors(flat, context):
            log_prob = self.module.log_prob(flat, context=context)
        return log_prob.reshape(*lead, x.shape[0]).to(theta.dtype)

    def to_latent(self, theta: Tensor, x: Tensor) -> Tensor:
        flat, context, lead = self._flat(theta, x)
        base = self.module._distribution
        name = type(base).__name__
        if name not in ("StandardNormal", "ConditionalDiagonalNormal"):
            raise ValueError(
                "to_latent needs an nflows base distribution StandardNormal or "
                f"ConditionalDiagonalNormal, got {name}"
            )
        with self._errors(flat, context):
            noise = self.module.transform_to_noise(flat, context=context)
            if name == "ConditionalDiagonalNormal":
                mean, log_std = base._compute_params(self.module._embedding_net(context))
                noise = (noise - mean) * torch.exp(-log_std)
        return noise.reshape(*lead, x.shape[0], theta.shape[-1]).to(theta.dtype)


class SbiPosterior(Posterior):
    """Adapter for an sbi (>= 0.24) ``ConditionalDensityEstimator`` (``ZukoFlow``,
    ``NFlowsFlow``, mixture density networks), or the estimator inside an sbi
    ``DirectPosterior``.

    The estimator is diagnosed as trained, without the prior-support rejection that
    ``DirectPosterior`` adds when sampling. Samples and their log-densities come from
    separate ``sample`` and ``log_prob`` calls, never from sbi's
    ``sample_and_log_prob`` (its nflows version mismatches samples and conditions
    in sbi 0.27).

    ``to_latent`` (flows only: ``NFlowsFlow``, ``ZukoFlow``) passes ``x`` through the
    estimator's embedding net, which z-scores ``x`` in sbi's builders, before the flow,
    exactly as ``log_prob`` and ``sample`` do: it goes through the nflows or zuko flow
    the estimator wraps, never through sbi's ``inverse_transform`` (in sbi 0.27,
    ``NFlowsFlow.inverse_transform`` skips the embedding net, so the latents of the
    model's own samples are not standard normal when ``x`` is not standardized).
    Another estimator (a mixture density network) raises a :class:`ValueError`.

    Arguments:
        module: the estimator.
    """

    def event_size(self) -> int | None:
        shape = getattr(self.module, "input_shape", None)
        return int(shape[-1]) if shape is not None and len(shape) == 1 else None

    def context_shape(self) -> tuple[int, ...] | None:
        shape = getattr(self.module, "condition_shape", None)
        return tuple(int(s) for s in shape) if shape is not None else None

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
    raise ValueError(
        "to_latent needs an sbi flow estimator (NFlowsFlow, whose net is an nflows Flow, or "
        "ZukoFlow, whose net is a zuko flow with an embedding_net), got "
        f"{type(estimator).__name__} with net {type(net).__name__}"
    )


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
