"""The adapter for sbi's conditional density estimators (flows and mixture density
networks, alone or inside a ``DirectPosterior``)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.distributions import Distribution
from zuko.lazy import LazyDistribution

from calib_lightning._model_info import default_dtype, is_nflows
from calib_lightning.posteriors.base import Posterior, UnsupportedError
from calib_lightning.posteriors.distributions import DistributionPosterior
from calib_lightning.posteriors.flows import NflowsPosterior

__all__ = ["SbiPosterior"]


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
