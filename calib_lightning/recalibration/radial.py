r"""A recalibrated posterior: a fitted map of the flow's latent space, placed before the flow.

For any posterior with an inverse (``to_latent``) and a forward map (``from_latent``):
zuko flows, nflows ``Flow`` s, sbi's flow estimators, torch ``TransformedDistribution`` s
and Gaussians. With :math:`z = T_x^{-1}(\theta)` the flow's latent and :math:`u = g(z)`
the recalibrated one, :math:`g` = per-coordinate scales :math:`s` then the radial map
:math:`R` (:mod:`calib_lightning.functional.radial`),

.. math::
    g(z) = R(\|z / s\|) \frac{z / s}{\|z / s\|}, \qquad
    \log q'(\theta \mid x) = \log q(\theta \mid x) - \log N(z) + \log N(g(z))
    + \log |\det \partial g / \partial z|,

and sampling draws :math:`u \sim N(0, I_D)` and returns :math:`T_x(g^{-1}(u))`. The
density stays explicit, so every check of the package (ranks, latent, KCCSD, L-C2ST-NF,
``cl.diagnose``) runs on the recalibrated posterior as on the flow.

References:
    V. Dheur and S. Ben Taieb, "Multivariate latent recalibration for conditional
    normalizing flows", arXiv:2505.16636, 2025.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

from calib_lightning.functional.radial import radial_map
from calib_lightning.posteriors import WrappedPosterior

__all__ = ["LatentMap", "RecalibratedPosterior"]


def standard_normal_log_prob(z: Tensor) -> Tensor:
    """``log N(z; 0, I_D)`` summed over the last axis."""
    return -0.5 * z.pow(2).sum(-1) - 0.5 * z.shape[-1] * math.log(2 * math.pi)


class LatentMap(nn.Module):
    r"""The map :math:`g` of the latent space: scales :math:`s`, then a radial map.

    Its state (``log_scale (D,)``, zeros without scales; ``knots (2, K)``, empty without
    a radial map) is a pair of buffers, saved and loaded with ``state_dict`` (a fresh
    ``LatentMap(D)`` loads any fitted state).

    Arguments:
        dim: :math:`D`.
        log_scale: :math:`\log s`, ``(D,)``; ``None``: no scaling.
        knots: ``(2, K)`` knots of :func:`~calib_lightning.functional.radial.radial_knots`;
            ``None``: no radial map.
    """

    def __init__(
        self, dim: int, log_scale: Tensor | None = None, knots: Tensor | None = None
    ) -> None:
        super().__init__()
        if log_scale is None:
            log_scale = torch.zeros(dim, dtype=torch.float64)
        if tuple(log_scale.shape) != (dim,):
            raise ValueError(f"log_scale must have shape ({dim},), got {tuple(log_scale.shape)}")
        self.register_buffer("log_scale", log_scale.detach().double().clone())
        empty = torch.zeros(2, 0, dtype=torch.float64)
        self.register_buffer("knots", empty if knots is None else knots.detach().double().clone())

    @property
    def radial(self) -> bool:
        """Whether the map has a radial part."""
        return self.knots.shape[1] > 0

    def _load_from_state_dict(self, state_dict: dict, prefix: str, *args: Any) -> None:
        saved = state_dict.get(prefix + "knots")
        if saved is not None:  # fitted knots have their own number of columns
            self.knots = torch.empty_like(saved, device=self.knots.device)
        super()._load_from_state_dict(state_dict, prefix, *args)

    def forward(self, z: Tensor) -> tuple[Tensor, Tensor]:
        r"""``u = g(z)`` ``(*, D)`` and :math:`\log |\det \partial g / \partial z|` ``(*,)``."""
        log_scale = self.log_scale.to(z)
        u = z * torch.exp(-log_scale)
        log_det = -log_scale.sum().expand(z.shape[:-1])
        if self.radial:
            t = u.norm(dim=-1)
            r, log_slope = radial_map(t, self.knots)
            ratio = torch.where(t > 0, r / t.clamp_min(1e-300), torch.ones_like(t))
            u = u * ratio.unsqueeze(-1)
            log_det = log_det + z.shape[-1] * ratio.log() + log_slope
        return u, log_det

    def inverse(self, u: Tensor) -> Tensor:
        """``z = g^{-1}(u)``, ``(*, D)``."""
        if self.radial:
            r = u.norm(dim=-1)
            t, _ = radial_map(r, self.knots, inverse=True)
            ratio = torch.where(r > 0, t / r.clamp_min(1e-300), torch.ones_like(r))
            u = u * ratio.unsqueeze(-1)
        return u * torch.exp(self.log_scale.to(u))

    def extra_repr(self) -> str:
        scales = ", ".join(f"{float(v):.3g}" for v in self.log_scale.exp()[:4])
        more = ", ..." if self.log_scale.numel() > 4 else ""
        return f"scale=[{scales}{more}], radial knots={self.knots.shape[1]}"


class RecalibratedPosterior(WrappedPosterior):
    """A posterior whose latent space goes through a fitted :class:`LatentMap` first.

    Built by :func:`calib_lightning.recalibrate`; accepted by every metric, callback and
    ``cl.diagnose`` like the posterior it wraps.

    Arguments:
        posterior: anything :func:`calib_lightning.as_posterior` accepts, with
            ``to_latent`` and ``from_latent``.
        latent_map: the fitted map.
        method: the name of the method that fitted it (shown in the ``repr``).
        selection: held-out scores of the candidate methods when ``method="auto"``
            chose (see :func:`calib_lightning.recalibrate`).

    Attributes:
        inner: the wrapped :class:`~calib_lightning.posteriors.Posterior`.
        latent_map: the :class:`LatentMap`.
        method: what was fitted (``"none"``, ``"scale"``, ``"radial"``,
            ``"scale+radial"``).
        selection: method -> its held-out scores, or ``None``.
    """

    def __init__(
        self,
        posterior: Any,
        latent_map: LatentMap,
        method: str = "",
        selection: dict[str, dict[str, float]] | None = None,
    ) -> None:
        super().__init__(posterior)
        self.latent_map, self.method, self.selection = latent_map, method, selection

    def __repr__(self) -> str:
        picked = ", picked by 'auto'" if self.selection is not None else ""
        return f"RecalibratedPosterior({self.inner!r}, method={self.method!r}{picked})"

    def event_size(self) -> int | None:
        return self.latent_map.log_scale.numel()

    def _density_change(self, z: Tensor) -> tuple[Tensor, Tensor]:
        """``u = g(z)`` and ``log q' - log q`` at the same ``theta``."""
        u, log_det = self.latent_map(z)
        return u, standard_normal_log_prob(u) - standard_normal_log_prob(z) + log_det

    def log_prob(self, theta: Tensor, x: Tensor) -> Tensor:
        z = self.inner.to_latent(theta, x)
        return self.inner.log_prob(theta, x) + self._density_change(z)[1]

    def to_latent(self, theta: Tensor, x: Tensor) -> Tensor:
        return self.latent_map(self.inner.to_latent(theta, x))[0]

    def from_latent(self, z: Tensor, x: Tensor) -> Tensor:
        return self.inner.from_latent(self.latent_map.inverse(z), x)

    def log_prob_and_latent(self, theta: Tensor, x: Tensor) -> tuple[Tensor, Tensor]:
        log_q, z = self.inner.log_prob_and_latent(theta, x)
        u, change = self._density_change(z)
        return log_q + change, u

    def sample(self, x: Tensor, num_posterior_samples: int) -> Tensor:
        x_model, out = self._sampling_inputs(x, num_posterior_samples)
        shape = (num_posterior_samples, x_model.shape[0], self.event_size())
        u = torch.randn(shape, dtype=x_model.dtype, device=x_model.device)
        with torch.no_grad():
            return self.from_latent(u, x_model).to(out)
