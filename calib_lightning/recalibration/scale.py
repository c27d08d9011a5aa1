r"""Held-out latent recalibration of a flow: per-coordinate latent scales.

NPE trained on a small budget is over-confident on *new* pairs, not on its training
pairs, so a calibration term computed on training batches has little to correct. The
latent scale uses pairs the flow never trained on (the validation split that early
stopping already keeps aside) and only ``D`` numbers: the flow's map
:math:`T_x` is kept and its latent is rescaled,

.. math::
    q_s(\theta \mid x) \text{ is the law of } T_x(s \odot z), \quad z \sim N(0, I_D),
    \qquad z^*_s = T_x^{-1}(\theta^*) / s,

with :math:`s` fitted by minimizing :func:`~calib_lightning.losses.latent_coverage_loss`
of the held-out :math:`z^*_s`. With ``D`` parameters fitted on hundreds of pairs there
is nothing to over-fit, unlike a term with the flow's weights on the same split. It
is the flow counterpart of temperature scaling for classifiers (Guo et al., 2017).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributions import Distribution, Independent, Normal, TransformedDistribution
from torch.distributions.transforms import AffineTransform

from calib_lightning import evaluation
from calib_lightning._utils.validation import check_pairs, check_positive
from calib_lightning.losses.latent import latent_coverage_loss
from calib_lightning.recalibration._hpd import (
    LatentDraws,
    latent_draws,
    shared_scale_levels,
)

__all__ = ["LatentScale", "hpd_log_scale", "latent_log_scale", "shared_hpd_log_scale"]


class LatentScale(nn.Module):
    r"""A flow with per-coordinate latent scales :math:`s`, fitted on held-out pairs.

    ``LatentScale(flow)(x)`` is the rescaled conditional distribution (the flow's own
    until :meth:`fit` is called), so the wrapper goes wherever the flow went: sampling,
    ``log_prob``, the calibration metrics and callbacks. The scales are a buffer, not a
    parameter: an optimizer over ``module.parameters()`` never trains them with the NLL.

    Supports zuko flows (``flow(x)`` a ``NormalizingFlow``) and torch
    ``TransformedDistribution`` s over a standard-normal base. For nflows and sbi
    estimators (any posterior with ``to_latent`` and ``from_latent``),
    ``cl.recalibrate(posterior, theta, x, method="scale")`` fits the same scales and
    returns a posterior.

    Arguments:
        flow: callable ``x -> distribution`` as above.
        shared: one scale for every coordinate (1 number fitted instead of ``D``: less
            noise from a small validation split, blind to per-coordinate errors).

    Example:
        >>> from calib_lightning.tasks import GaussianToy
        >>> toy = GaussianToy(dim=2)
        >>> theta, x = toy.sample(2000, torch.Generator().manual_seed(0))
        >>> too_narrow = LatentScale(toy.posterior(variance_scale=0.25)).fit(theta, x)
        >>> bool(((too_narrow.scale - 2.0).abs() < 0.15).all())  # std 0.5x: scale 2
        True
    """

    def __init__(self, flow: nn.Module, shared: bool = False) -> None:
        super().__init__()
        if not callable(flow):
            raise ValueError(f"flow must be callable x -> distribution, got {flow!r}")
        self.flow, self.shared = flow, bool(shared)
        self.register_buffer("log_scale", torch.zeros(0))

    @property
    def scale(self) -> Tensor:
        """The fitted scales ``(D,)`` (empty before :meth:`fit`)."""
        return self.log_scale.exp()

    def _load_from_state_dict(self, state_dict: dict, prefix: str, *args: object) -> None:
        saved = state_dict.get(prefix + "log_scale")
        if saved is not None:  # a fitted state has D scales, a fresh module none
            self.log_scale = torch.empty_like(saved, device=self.log_scale.device)
        super()._load_from_state_dict(state_dict, prefix, *args)

    def forward(self, x: Tensor) -> Distribution:
        dist = self.flow(x)
        if self.log_scale.numel() == 0:
            return dist
        dtype = x.dtype if x.is_floating_point() else None
        scale = self.log_scale.exp().to(device=x.device, dtype=dtype)
        zero = torch.zeros_like(scale)
        if hasattr(dist, "transform") and hasattr(dist, "base"):  # zuko: z = f(theta)
            from zuko.distributions import NormalizingFlow
            from zuko.transforms import ComposedTransform

            shrink = AffineTransform(zero, 1.0 / scale, event_dim=1)
            return NormalizingFlow(ComposedTransform(dist.transform, shrink), dist.base)
        if isinstance(dist, TransformedDistribution):  # torch: theta = t_k(...t_1(z))
            stretch = AffineTransform(zero, scale, event_dim=1)
            return TransformedDistribution(dist.base_dist, [stretch, *dist.transforms])
        if isinstance(dist, Independent) and isinstance(dist.base_dist, Normal):
            return Independent(Normal(dist.base_dist.loc, dist.base_dist.scale * scale), 1)
        raise ValueError(
            "LatentScale needs a zuko flow, a torch TransformedDistribution or an "
            f"Independent Normal, got {type(dist).__name__}"
        )

    def fit(
        self,
        theta: Tensor,
        x: Tensor,
        *,
        target: str = "latent",
        steps: int = 200,
        lr: float = 0.05,
        num_posterior_samples: int | None = None,
        num_scales: int = 41,
    ) -> LatentScale:
        r"""Fit :math:`s` on held-out pairs ``theta (n, D)``, ``x (n, *X)`` (pairs the flow
        did not train on, e.g. the validation split); returns ``self``.

        ``target="latent"`` (sampling-free): one pass of the flow (its latents, no
        gradient), then ``steps`` Adam steps on :math:`\log s` minimizing
        :func:`~calib_lightning.losses.latent_coverage_loss` of :math:`z / s`, from the
        root mean square of each coordinate of :math:`z`.

        ``target="hpd"``: the expected coverage of the highest-density regions, the one
        :class:`~calib_lightning.RankCalibration` reports: :func:`hpd_log_scale`, a
        grid of ``num_scales`` shared scales over ``[1/2, 2]`` scored from
        ``3 * num_posterior_samples`` draws per pair shared by the whole grid
        (importance-weighted; ``None``: :func:`~._hpd.draws_per_pair`); it implies
        ``shared``.
        """
        check_pairs(theta, x, min_rows=2)
        if target not in ("latent", "hpd"):
            raise ValueError(f"target must be 'latent' or 'hpd', got {target!r}")
        for name, value in (
            ("steps", steps),
            ("num_posterior_samples", num_posterior_samples),
            ("num_scales", num_scales),
        ):
            if value is not None:
                check_positive(name, value, integer=True)
        check_positive("lr", lr)
        dim = theta.shape[1]
        if target == "hpd":
            log_scale = hpd_log_scale(self.flow, theta, x, num_posterior_samples, num_scales)
        else:
            z = evaluation.latents(self.flow, theta, x).detach().to(torch.float64)
            log_scale = latent_log_scale(z, shared=self.shared, steps=steps, lr=lr)
        log_scale = log_scale.expand(dim)
        self.log_scale = log_scale.to(self.log_scale.device, torch.float32).clone()
        return self


def latent_log_scale(
    z: Tensor, *, shared: bool = False, steps: int = 200, lr: float = 0.05
) -> Tensor:
    r""":math:`\log s` ``(D,)`` (or ``(1,)`` when ``shared``) minimizing
    :func:`~calib_lightning.losses.latent_coverage_loss` of held-out latents ``z / s``,
    ``z (n, D)``: ``steps`` Adam steps from the root mean square of each coordinate."""
    z = z.detach().to(torch.float64)
    start = z.pow(2).mean() if shared else z.pow(2).mean(0)
    log_scale = (0.5 * start.clamp_min(1e-12).log()).reshape(-1).requires_grad_(True)
    optimizer = torch.optim.Adam([log_scale], lr=lr)
    with torch.enable_grad():  # callers may hold torch.no_grad
        for _ in range(steps):
            optimizer.zero_grad()
            loss = latent_coverage_loss(z / log_scale.exp())
            loss.backward()
            optimizer.step()
    return log_scale.detach()


def hpd_log_scale(
    posterior: Any,
    theta: Tensor,
    x: Tensor,
    num_posterior_samples: int | None = None,
    num_scales: int = 41,
    proposal_scales: tuple[float, ...] = (0.5, 1.0, 2.0),
    prior: Any = None,
) -> Tensor:
    r"""The shared :math:`\log s` ``(1,)`` on a log grid over ``[1/2, 2]`` whose held-out
    HPD levels are closest to uniform (mean squared gap of the sorted levels to
    :math:`(i - 1/2)/n`).

    Shared draws (:func:`~calib_lightning.recalibration._hpd.latent_draws`):
    ``num_posterior_samples`` draws per pair (``None``:
    :func:`~calib_lightning.recalibration._hpd.draws_per_pair`, 100 up to 200 pairs, 20
    from 1,000) at each of the ``proposal_scales`` (latent :math:`s_j u`,
    :math:`u \sim N(0, I)`, pushed through the flow, one pass each, the log-density from
    the same pass for a zuko flow), reused for every grid scale by importance weighting
    against their mixture:
    with :math:`z_k` a draw's latent, its weight under scale :math:`s` is
    :math:`N(z_k/s) s^{-D} / \frac1J \sum_j N(z_k/s_j) s_j^{-D}` (at most ``J`` on the
    proposal scales), and the level of :math:`\theta^*` is the weighted fraction of
    draws of higher density :math:`q_s`. Three flow passes instead of one per grid scale;
    the grid costs only tensor arithmetic. Works for any posterior with ``to_latent`` and
    ``from_latent``. With ``prior``, the levels are those of the scaled posterior
    restricted to the prior's support (the draws outside it count for nothing).
    """
    draws = latent_draws(posterior, theta, x, num_posterior_samples, proposal_scales, prior=prior)
    return shared_hpd_log_scale(draws, num_scales)


def shared_hpd_log_scale(
    draws: LatentDraws, num_scales: int = 41, rows: Tensor | None = None
) -> Tensor:
    r""":func:`hpd_log_scale` from draws already made, on the pairs ``rows`` (default
    all): the grid scale whose HPD levels are closest to uniform."""
    grid = torch.linspace(-math.log(2.0), math.log(2.0), num_scales, dtype=torch.float64)
    n = draws.z_true.shape[0] if rows is None else rows.numel()
    quantiles = (torch.arange(n, dtype=torch.float64, device=draws.z.device) + 0.5) / n
    # log q_s = base + log N(z / s) - D log s, up to a shared constant: the whole grid at once
    levels = shared_scale_levels(draws, grid, rows)  # (G, n)
    gaps = (levels.sort(-1).values - quantiles).pow(2).mean(-1)
    return grid[int(gaps.cpu().argmin())].reshape(1)
