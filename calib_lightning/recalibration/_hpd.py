r"""HPD levels of latent-recalibrated posteriors, from one set of shared posterior draws.

A map :math:`g` of the flow's latent space (:class:`~.radial.LatentMap`) gives the
posterior :math:`q_g(\theta \mid x) = q(\theta \mid x)\, p_g(z) / N(z)` with
:math:`z = T_x^{-1}(\theta)` and :math:`p_g(z) = N(g(z))\, |\det \partial g / \partial z|`.
The HPD level of a true :math:`\theta^*` under :math:`q_g` (the :math:`q_g`-mass of the
parameters more probable than it, what :class:`~calib_lightning.RankCalibration` ranks)
is estimated from draws :math:`z_k` of a mixture of latent Gaussians
:math:`N(0, s_j^2 I)`, pushed through the flow once (one density pass per proposal
scale), and reweighted by :math:`p_g(z_k) / \text{mixture}(z_k)`:

.. math::
    c(\theta^*) = \frac{\sum_k w_k\, 1\{\log q_g(\theta_k) > \log q_g(\theta^*)\}}
                       {\sum_k w_k}, \qquad
    \log q_g(\theta) = \log q(\theta) + \tfrac12 \|z\|^2 + \log p_g(z) + \text{const}.

Every map (every scale of a grid, every candidate of ``method="auto"``, both folds of a
cross-fit) is then scored with tensor arithmetic on the same draws: common random
numbers, so differences between maps carry no Monte Carlo noise of their own draws.

Given a prior, the levels are those of the map's posterior restricted to the prior's
support (:class:`~.truncation.TruncatedPosterior`, what ``recalibrate(..., prior=...)``
returns): the draws outside get weight 0, the others are renormalized (the normalizer
:math:`Z(x)` cancels within a pair), so the maps are fitted and scored as they will be
used.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from typing import Any

import torch
from torch import Tensor

from calib_lightning._utils.prior import outside_support
from calib_lightning.posteriors import as_posterior

__all__ = [
    "DRAW_BUDGET",
    "LatentDraws",
    "draws_per_pair",
    "from_latent_and_log_prob",
    "hpd_levels",
    "inside_log_share",
    "latent_draws",
    "levels_and_log_share",
    "normal_log_kernel",
    "on_cpu",
    "shared_scale_levels",
]


#: draws per proposal scale, over all pairs, that :func:`draws_per_pair` aims at
DRAW_BUDGET = 20_000
#: bounds of :func:`draws_per_pair`
MIN_DRAWS, MAX_DRAWS = 20, 100


def draws_per_pair(n: int) -> int:
    r"""Draws per pair and proposal scale for ``n`` held-out pairs when none is given:
    ``clamp(ceil(DRAW_BUDGET / n), 20, 100)`` (100 up to 200 pairs, 50 at 400, 20 from
    1,000), so that the flow passes cost about the same from a few hundred pairs on.

    The Monte Carlo error of each pair's level is independent across pairs, so what is
    fitted from all of them (one shared scale, a choice among maps) averages it out; at
    1,000 pairs the shared HPD scale fitted from 20 and from 100 draws per pair and scale
    is the same grid point (``examples/benchmarks/results/recalibration_fit_time.md``).
    """
    return min(MAX_DRAWS, max(MIN_DRAWS, math.ceil(DRAW_BUDGET / max(int(n), 1))))


def from_latent_and_log_prob(posterior: Any, z: Tensor, x: Tensor) -> tuple[Tensor, Tensor]:
    r"""``theta = T_x(z)`` ``(*, N, D)`` and :math:`\log q(\theta \mid x)` ``(*, N)``.

    For a zuko flow (an autoregressive one above all, whose inverse takes ``D`` network
    passes per transform) the log-density comes from the Jacobian of the inverse pass,
    :math:`\log q(\theta) = \log N(z) - \log |\det \partial T_x / \partial z|`, instead of
    one more pass of the flow (a quarter of the work at ``D = 3``); for every other
    posterior, ``from_latent`` then ``log_prob``."""
    from calib_lightning.posteriors import DistributionPosterior

    post = as_posterior(posterior)
    if isinstance(post, DistributionPosterior):
        dist = post.distribution(x)
        if _zuko_flow_on_normal(dist):
            from torch.distributions.utils import _sum_rightmost

            from calib_lightning.posteriors.distributions import _inverse_and_ladj

            base = dist.base
            inner = z.to(post.dtype or z.dtype)
            y = base.base_dist.loc + base.base_dist.scale * inner
            theta, ladj = _inverse_and_ladj(dist.transform, y)
            log_prob = base.log_prob(y) - _sum_rightmost(ladj, dist.reinterpreted)
            return theta.to(z.dtype), log_prob.to(z.dtype)
    theta = post.from_latent(z, x)
    return theta, post.log_prob(theta, x)


def _zuko_flow_on_normal(dist: Any) -> bool:
    """A zuko ``NormalizingFlow`` over a diagonal normal base (``Independent(Normal)``)."""
    from torch.distributions import Independent, Normal
    from zuko.distributions import NormalizingFlow

    base = getattr(dist, "base", None)
    return (
        type(dist) is NormalizingFlow
        and isinstance(base, Independent)
        and isinstance(base.base_dist, Normal)
        and base.reinterpreted_batch_ndims == 1
    )


def normal_log_kernel(z: Tensor, log_s: Tensor | float) -> Tensor:
    """``log N(z / s) - D log s`` up to a constant: the latent density at scale ``s``."""
    log_s = torch.as_tensor(log_s, dtype=z.dtype, device=z.device)
    return -0.5 * z.pow(2).sum(-1) * torch.exp(-2 * log_s) - z.shape[-1] * log_s


@dataclass
class LatentDraws:
    """Posterior draws shared by every latent map scored on the same pairs (float64).

    Attributes:
        z_true: ``(n, D)`` latents of the true parameters.
        base_true: ``(n,)`` :math:`\\log q(\\theta^*) + \\|z^*\\|^2 / 2`.
        z: ``(K, n, D)`` latents of the draws (``K`` = draws per pair x proposals).
        base: ``(K, n)`` the same for the draws.
        log_mixture: ``(K, n)`` log-density of the proposal mixture at ``z`` (the
            constant of :func:`normal_log_kernel`).
        inside: ``(K, n)`` whether each draw lies in the prior's support (``None``:
            no prior, every draw counts).
    """

    z_true: Tensor
    base_true: Tensor
    z: Tensor
    base: Tensor
    log_mixture: Tensor
    inside: Tensor | None = None


def on_cpu(draws: LatentDraws) -> LatentDraws:
    """``draws`` with every tensor on the CPU (where the latent maps are fitted)."""
    return replace(
        draws,
        **{
            f.name: getattr(draws, f.name).cpu()
            for f in fields(draws)
            if getattr(draws, f.name) is not None
        },
    )


def latent_draws(
    posterior: Any,
    theta: Tensor,
    x: Tensor,
    num_posterior_samples: int | None = None,
    proposal_scales: tuple[float, ...] = (0.5, 1.0, 2.0),
    seed: int = 0,
    truth: tuple[Tensor, Tensor] | None = None,
    prior: Any = None,
) -> LatentDraws:
    r"""``num_posterior_samples`` draws per pair at each of the ``proposal_scales``
    (latent :math:`s_j u`, :math:`u \sim N(0, I)`, pushed through the flow), with their
    latents and log-densities (:func:`from_latent_and_log_prob`; ``None``:
    :func:`draws_per_pair`); seeded by ``seed`` without touching the caller's random
    state. Needs ``to_latent`` and ``from_latent``. ``truth``: the latents ``(n, D)``
    and log-densities ``(n,)`` at the pairs when the caller has them (one ODE solve
    each for sbi's vector-field estimators), else computed here. ``prior``: mark the
    draws inside its support (``LatentDraws.inside``)."""
    post = as_posterior(posterior)
    n, dim = theta.shape
    if num_posterior_samples is None:
        num_posterior_samples = draws_per_pair(n)
    proposals = torch.tensor(proposal_scales, dtype=torch.float64).log()
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)  # common random numbers: the same draws for every map
        if truth is None:
            truth = (post.to_latent(theta, x), post.log_prob(theta, x))
        z_true = truth[0].double()
        base_true = truth[1].double() + 0.5 * z_true.pow(2).sum(-1)
        latents, bases, inside = [], [], []
        for log_s in proposals:
            u = torch.randn(num_posterior_samples, n, dim, dtype=theta.dtype, device=theta.device)
            z = (u * log_s.exp()).to(theta.dtype)
            draws, log_prob = from_latent_and_log_prob(post, z, x)
            latents.append(z.double())
            bases.append(log_prob.double() + 0.5 * z.double().pow(2).sum(-1))
            if prior is not None:
                inside.append(~outside_support(prior, draws))
    z, base = torch.cat(latents), torch.cat(bases)
    log_mixture = torch.logsumexp(torch.stack([normal_log_kernel(z, p) for p in proposals]), 0)
    return LatentDraws(
        z_true,
        base_true,
        z,
        base,
        log_mixture - math.log(len(proposal_scales)),
        torch.cat(inside) if inside else None,
    )


def levels_and_log_share(
    draws: LatentDraws,
    log_latent_density: Callable[[Tensor], Tensor],
    rows: Tensor | None = None,
    *,
    with_share: bool = True,
) -> tuple[Tensor, Tensor | None]:
    r"""The HPD levels of :func:`hpd_levels` and :math:`\log \hat Z(x_i)` ``(n,)`` (on
    the CPU), the log of that posterior's mass inside the prior's support at each pair:
    the self-normalized importance estimate from the same weights (0 without
    ``draws.inside``, and for a pair with no draw inside, which is scored unrestricted).
    The restricted posterior's log-density at a parameter inside is the posterior's
    minus it. ``with_share=False``: the levels alone (``None`` for the share)."""
    z, base, mixture, inside = draws.z, draws.base, draws.log_mixture, draws.inside
    z_true, base_true = draws.z_true, draws.base_true
    if rows is not None:
        z, base, mixture = z[:, rows], base[:, rows], mixture[:, rows]
        z_true, base_true = z_true[rows], base_true[rows]
        inside = None if inside is None else inside[:, rows]
    log_density = log_latent_density(z)
    log_weight = log_density - mixture
    log_share = torch.zeros(log_weight.shape[1], dtype=log_weight.dtype) if with_share else None
    if inside is not None:
        inside = inside.to(log_weight.device)
        some = inside.any(0)  # a pair with no draw inside keeps all of its draws
        if with_share:
            share = (torch.softmax(log_weight, 0) * inside).sum(0)
            log_share = torch.where(some, share.log(), torch.zeros_like(share)).cpu()
        log_weight = log_weight.masked_fill(~(inside | ~some), -math.inf)
    weight = torch.softmax(log_weight, 0)
    higher = base + log_density > (base_true + log_latent_density(z_true)).unsqueeze(0)
    return (weight * higher).sum(0), log_share


def inside_log_share(
    draws: LatentDraws, log_latent_density: Callable[[Tensor], Tensor], rows: Tensor | None = None
) -> Tensor:
    r""":math:`\log \hat Z(x_i)` ``(n,)`` of :func:`levels_and_log_share`."""
    return levels_and_log_share(draws, log_latent_density, rows)[1]


def hpd_levels(
    draws: LatentDraws, log_latent_density: Callable[[Tensor], Tensor], rows: Tensor | None = None
) -> Tensor:
    r"""HPD levels ``(n,)`` (or ``(len(rows),)``) of the true parameters under the
    posterior whose latent density is ``exp(log_latent_density(z))`` up to a constant
    (:math:`p_g`; :func:`normal_log_kernel` for a shared scale, the standard normal for
    the flow itself); uniform on ``[0, 1]`` when that posterior is calibrated. With
    ``draws.inside``, of that posterior restricted to the prior's support (a pair with
    no draw inside keeps all of its draws)."""
    return levels_and_log_share(draws, log_latent_density, rows, with_share=False)[0]


def shared_scale_levels(
    draws: LatentDraws, log_scales: Tensor, rows: Tensor | None = None
) -> Tensor:
    r"""The HPD levels ``(G, n)`` of :func:`hpd_levels` under each shared latent scale
    :math:`\log s_g` of ``log_scales (G,)`` (:func:`normal_log_kernel`), for the whole grid
    at once: the squared latent norms are computed once and the grid is evaluated in
    blocks of at most about 4 million numbers."""
    z, base, mixture, inside = draws.z, draws.base, draws.log_mixture, draws.inside
    z_true, base_true = draws.z_true, draws.base_true
    if rows is not None:
        z, base, mixture = z[:, rows], base[:, rows], mixture[:, rows]
        z_true, base_true = z_true[rows], base_true[rows]
        inside = None if inside is None else inside[:, rows]
    dim = z.shape[-1]
    norm2, norm2_true = z.pow(2).sum(-1), z_true.pow(2).sum(-1)  # (K, n), (n,)
    mask = None
    if inside is not None:
        inside = inside.to(z.device)
        mask = ~(inside | ~inside.any(0))  # a pair with no draw inside keeps all of its draws
    log_scales = log_scales.to(z)
    block = max(1, 4_000_000 // max(1, norm2.numel()))
    out = []
    for part in log_scales.split(block):
        g = part[:, None, None]
        log_density = -0.5 * norm2 * torch.exp(-2 * g) - dim * g  # (G, K, n)
        log_weight = log_density - mixture
        if mask is not None:
            log_weight = log_weight.masked_fill(mask, -math.inf)
        weight = torch.softmax(log_weight, 1)
        true = -0.5 * norm2_true * torch.exp(-2 * part[:, None]) - dim * part[:, None]  # (G, n)
        higher = base + log_density > (base_true + true).unsqueeze(1)
        out.append((weight * higher).sum(1))
    return torch.cat(out)
