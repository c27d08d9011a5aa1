r"""A recalibrated posterior: a fitted map of the flow's latent space, placed before the flow.

For any posterior with an inverse (``to_latent``) and a forward map (``from_latent``):
zuko flows, nflows ``Flow`` s, sbi's flow estimators, torch ``TransformedDistribution`` s
and Gaussians. With :math:`z = T_x^{-1}(\theta)` the flow's latent and :math:`u = g(z)`
the recalibrated one, :math:`g` = per-coordinate scales :math:`s` then the radial map
:math:`R` (:mod:`calib_lightning.functional.radial`), after a marginal map :math:`m`
when there is one (a monotone map per coordinate, :mod:`calib_lightning.functional.marginal`;
left out below),

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
from torch.distributions import Transform, constraints

from calib_lightning.functional.marginal import marginal_map
from calib_lightning.functional.radial import radial_map

__all__ = ["IDENTITY_TOLERANCE", "LatentMap", "LatentMapTransform", "standard_normal_log_prob"]

#: a fitted map is the identity when its log-scales, its knots' distance to the diagonal
#: and the log-slopes between them are all below this: it then moves ``log q`` by at most
#: about ``(D + |z|^2) 1e-6`` nats and a latent norm by a factor ``exp(1e-6)``, far below
#: any Monte Carlo or sampling error, while the fits never land there by chance (the HPD
#: scale's grid steps by 0.035 in log-scale; the latent scales are Adam iterates)
IDENTITY_TOLERANCE = 1e-6


def standard_normal_log_prob(z: Tensor) -> Tensor:
    """``log N(z; 0, I_D)`` summed over the last axis."""
    return -0.5 * z.pow(2).sum(-1) - 0.5 * z.shape[-1] * math.log(2 * math.pi)


class LatentMap(nn.Module):
    r"""The map :math:`g` of the latent space: a marginal map :math:`m` (per coordinate,
    :mod:`calib_lightning.functional.marginal`), scales :math:`s`, then a radial map.

    Its state (``log_scale (D,)``, zeros without scales; ``knots (2, K)``, empty without
    a radial map; ``marginal_knots (3, D, K')``, empty without a marginal map) are
    buffers, saved and loaded with ``state_dict`` (a fresh ``LatentMap(D)`` loads any
    fitted state, and a state saved before the marginal map existed).

    Arguments:
        dim: :math:`D`.
        log_scale: :math:`\log s`, ``(D,)``; ``None``: no scaling.
        knots: ``(2, K)`` knots of :func:`~calib_lightning.functional.radial.radial_knots`;
            ``None``: no radial map.
        marginal_knots: ``(3, D, K')`` knots of
            :func:`~calib_lightning.functional.marginal.marginal_knots`; ``None``: no
            marginal map.
    """

    def __init__(
        self,
        dim: int,
        log_scale: Tensor | None = None,
        knots: Tensor | None = None,
        marginal_knots: Tensor | None = None,
    ) -> None:
        super().__init__()
        if log_scale is None:
            log_scale = torch.zeros(dim, dtype=torch.float64)
        if tuple(log_scale.shape) != (dim,):
            raise ValueError(f"log_scale must have shape ({dim},), got {tuple(log_scale.shape)}")
        self.register_buffer("log_scale", log_scale.detach().double().clone())
        empty = torch.zeros(2, 0, dtype=torch.float64)
        self.register_buffer("knots", empty if knots is None else knots.detach().double().clone())
        if marginal_knots is None:
            marginal_knots = torch.zeros(3, dim, 0, dtype=torch.float64)
        if marginal_knots.ndim != 3 or tuple(marginal_knots.shape[:2]) != (3, dim):
            raise ValueError(
                f"marginal_knots must have shape (3, {dim}, K), got {tuple(marginal_knots.shape)}"
            )
        self.register_buffer("marginal_knots", marginal_knots.detach().double().clone())

    @property
    def marginal(self) -> bool:
        """Whether the map has a marginal part."""
        return self.marginal_knots.shape[-1] > 0

    def _marginal_is_identity(self, tolerance: float) -> bool:
        if not self.marginal:
            return True
        x, y, derivative = self.marginal_knots
        gaps = torch.stack([y - x, derivative.log()]).abs()
        return bool((gaps < tolerance).all())

    def _same_marginal(self, other: LatentMap, tolerance: float) -> bool:
        mine, theirs = self._marginal_is_identity(tolerance), other._marginal_is_identity(tolerance)
        if mine or theirs:
            return mine and theirs
        if self.marginal_knots.shape != other.marginal_knots.shape:
            return False
        gap = self.marginal_knots - other.marginal_knots.to(self.marginal_knots)
        return bool((gap.abs() < tolerance).all())

    @property
    def radial(self) -> bool:
        """Whether the map has a radial part."""
        return self.knots.shape[1] > 0

    def is_identity(self, tolerance: float = IDENTITY_TOLERANCE) -> bool:
        r"""Whether :math:`g` is the identity within ``tolerance``: every
        :math:`|\log s_d|`, for a radial part every knot's
        :math:`|\log R - \log t|` and every log-slope between knots, and for a marginal
        part every knot's :math:`|y - x|` and log-derivative, below it."""
        if bool((self.log_scale.abs() >= tolerance).any()):
            return False
        if not self._marginal_is_identity(tolerance):
            return False
        if not self.radial:
            return True
        log_t, log_r = self.knots
        if bool(((log_r - log_t).abs() >= tolerance).any()):
            return False
        slopes = (log_r.diff() / log_t.diff()).log()
        return bool((slopes.abs() < tolerance).all())

    def same_as(self, other: LatentMap, tolerance: float = IDENTITY_TOLERANCE) -> bool:
        """Whether ``other`` is the same map within ``tolerance`` (log-scales, and knots
        of the same number; a radial or marginal part that is the identity counts as none)."""
        if self.log_scale.shape != other.log_scale.shape:
            return False
        if not self._same_marginal(other, tolerance):
            return False
        if bool(((self.log_scale - other.log_scale.to(self.log_scale)).abs() >= tolerance).any()):
            return False
        mine = self.radial and not LatentMap(self.log_scale.numel(), None, self.knots).is_identity(
            tolerance
        )
        theirs = other.radial and not LatentMap(
            other.log_scale.numel(), None, other.knots
        ).is_identity(tolerance)
        if not (mine or theirs):
            return True
        if not (mine and theirs) or self.knots.shape != other.knots.shape:
            return False
        return bool(((self.knots - other.knots.to(self.knots)).abs() < tolerance).all())

    def describe(self) -> str:
        """The map in words: its scales and its radial part."""
        if self.is_identity():
            return "identity"
        parts = []
        if not self._marginal_is_identity(IDENTITY_TOLERANCE):
            parts.append(f"marginal map with {self.marginal_knots.shape[-1]} knots per coordinate")
        if bool((self.log_scale.abs() >= IDENTITY_TOLERANCE).any()):
            scales = ", ".join(f"{float(v):.3g}" for v in self.log_scale.exp()[:4])
            more = ", ..." if self.log_scale.numel() > 4 else ""
            parts.append(f"scale=[{scales}{more}]")
        if self.radial:
            parts.append(f"radial map with {self.knots.shape[1]} knots")
        return ", ".join(parts)

    def _load_from_state_dict(self, state_dict: dict, prefix: str, *args: Any) -> None:
        saved = state_dict.get(prefix + "knots")
        if saved is not None:  # fitted knots have their own number of columns
            self.knots = torch.empty_like(saved, device=self.knots.device)
        saved = state_dict.get(prefix + "marginal_knots")
        dim = self.log_scale.numel()
        if saved is not None:
            self.marginal_knots = torch.empty_like(saved, device=self.marginal_knots.device)
        else:  # a state saved before the marginal map: none
            self.marginal_knots = torch.zeros(
                2, dim, 0, dtype=torch.float64, device=self.marginal_knots.device
            )
        super()._load_from_state_dict(state_dict, prefix, *args)
        missing = args[2]  # (local_metadata, strict, missing_keys, ...)
        if saved is None and prefix + "marginal_knots" in missing:
            missing.remove(prefix + "marginal_knots")

    def forward(self, z: Tensor) -> tuple[Tensor, Tensor]:
        r"""``u = g(z)`` ``(*, D)`` and :math:`\log |\det \partial g / \partial z|` ``(*,)``."""
        log_scale = self.log_scale.to(z)
        log_det = -log_scale.sum().expand(z.shape[:-1])
        if self.marginal:
            z, log_derivative = marginal_map(z, self.marginal_knots)
            log_det = log_det + log_derivative.sum(-1)
        u = z * torch.exp(-log_scale)
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
        u = u * torch.exp(self.log_scale.to(u))
        return marginal_map(u, self.marginal_knots, inverse=True)[0] if self.marginal else u

    def extra_repr(self) -> str:
        scales = ", ".join(f"{float(v):.3g}" for v in self.log_scale.exp()[:4])
        more = ", ..." if self.log_scale.numel() > 4 else ""
        marginal = f", marginal knots={self.marginal_knots.shape[-1]}" if self.marginal else ""
        return f"scale=[{scales}{more}], radial knots={self.knots.shape[1]}{marginal}"


class LatentMapTransform(Transform):
    r""":math:`g` as a ``torch.distributions`` transform, ``(*, D)`` to ``(*, D)``: the
    piece a recalibrated zuko flow adds after the flow's own transform.

    With the base's ``loc`` and ``scale`` (a diagonal normal that is not standard), it maps
    :math:`y \mapsto \mathrm{loc} + \mathrm{scale} \odot g((y - \mathrm{loc}) /
    \mathrm{scale})` (the standardization's Jacobians cancel).

    Arguments:
        latent_map: the :class:`LatentMap` (read at every call, so a loaded state applies).
        loc: the base's mean, broadcastable to ``(*, D)``; ``None``: 0.
        scale: the base's standard deviation, likewise; ``None``: 1.
    """

    domain = constraints.real_vector
    codomain = constraints.real_vector
    bijective = True

    def __init__(
        self, latent_map: LatentMap, loc: Tensor | None = None, scale: Tensor | None = None
    ) -> None:
        super().__init__()
        self.latent_map, self.loc, self.scale = latent_map, loc, scale

    def __eq__(self, other: object) -> bool:
        return other is self

    def __hash__(self) -> int:
        return id(self)

    def _standard(self, y: Tensor) -> Tensor:
        loc = 0.0 if self.loc is None else self.loc
        return (y - loc) if self.scale is None else (y - loc) / self.scale

    def _back(self, u: Tensor) -> Tensor:
        u = u if self.scale is None else u * self.scale
        return u if self.loc is None else u + self.loc

    def _call(self, y: Tensor) -> Tensor:
        return self._back(self.latent_map(self._standard(y))[0])

    def _inverse(self, v: Tensor) -> Tensor:
        return self._back(self.latent_map.inverse(self._standard(v)))

    def log_abs_det_jacobian(self, y: Tensor, v: Tensor) -> Tensor:
        return self.latent_map(self._standard(y))[1]

    def call_and_ladj(self, y: Tensor) -> tuple[Tensor, Tensor]:
        """``g(y)`` and its log-determinant in one evaluation (zuko's protocol)."""
        u, ladj = self.latent_map(self._standard(y))
        return self._back(u), ladj
