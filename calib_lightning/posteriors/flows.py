"""The adapter for an nflows ``Flow`` (zuko flows are distributions: see
:mod:`calib_lightning.posteriors.distributions`)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from calib_lightning.posteriors._model_info import default_dtype, is_nflows, nflows_context
from calib_lightning.posteriors.base import Posterior, Recognized, UnsupportedError

__all__ = ["NflowsPosterior", "recognize"]


def recognize(obj: Any) -> Recognized | None:
    """An nflows ``Flow`` is read as a posterior estimator, its context as ``x``."""
    if not is_nflows(obj):
        return None
    return Recognized(
        f"an nflows {type(obj).__name__}",
        ("posterior",),
        "posterior",
        lambda: NflowsPosterior(obj),
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

    def _base(self, method: str) -> tuple[Any, str]:
        """The flow's base distribution and its class name, if ``method`` supports it."""
        base = self.module._distribution
        name = type(base).__name__
        if name not in ("StandardNormal", "ConditionalDiagonalNormal"):
            raise UnsupportedError(
                f"{method} needs an nflows base distribution StandardNormal or "
                f"ConditionalDiagonalNormal, got {name}"
            )
        return base, name

    def to_latent(self, theta: Tensor, x: Tensor) -> Tensor:
        flat, context, lead = self._flat(theta, x)
        base, name = self._base("to_latent")
        with self._errors(flat, context):
            noise = self.module.transform_to_noise(flat, context=context)
            if name == "ConditionalDiagonalNormal":
                mean, log_std = base._compute_params(self.module._embedding_net(context))
                noise = (noise - mean) * torch.exp(-log_std)
        return noise.reshape(*lead, x.shape[0], theta.shape[-1]).to(theta.dtype)

    def from_latent(self, z: Tensor, x: Tensor) -> Tensor:
        flat, context, lead = self._flat(z, x)
        base, name = self._base("from_latent")
        with self._errors(flat, context):
            embedded = self.module._embedding_net(context)
            if name == "ConditionalDiagonalNormal":
                mean, log_std = base._compute_params(embedded)
                flat = mean + flat * torch.exp(log_std)
            theta, _ = self.module._transform.inverse(flat, context=embedded)
        return theta.reshape(*lead, x.shape[0], z.shape[-1]).to(z.dtype)
