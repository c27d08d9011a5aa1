r"""The adaptive proposal of :class:`~calib_lightning.ImportanceCoverage`: a Gaussian fitted to
the target per pair, mixed with the prior.

For each pair, given only ``x`` (never the true ``theta``, so the credibility stays exact):

1. ``M / 8`` prior draws, weighted by the target over the prior; their weighted mean and
   covariance, widened 2x in scale, give a first Gaussian;
2. three more stages of ``M / 8`` draws from the mixture
   ``alpha * prior + (1 - alpha) * Gaussian``, weighted by the target over that mixture,
   each refitting the Gaussian (widened 2x, then 1.5x);
3. the last ``M / 2`` draws from the last mixture are the importance sample.

The prior's share ``alpha = 0.1`` keeps every weight below ``likelihood / alpha`` (a
defensive mixture, Hesterberg 1995), so a poor fit costs effective sample size, never
validity. Only the last stage's draws are returned: the earlier ones chose the proposal.
How often the check can judge with it (median ESS at least ``min_ess``):
``examples/benchmarks/results/unnormalized_level_adaptive.md``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor
from torch.distributions import MultivariateNormal

__all__ = ["FIT_SHARES", "PRIOR_SHARE", "RIDGE", "WIDEN", "adaptive_blocks"]

#: shares of ``M`` drawn by the four fitting stages; the rest is the sample
FIT_SHARES = (0.125, 0.125, 0.125, 0.125)
#: scale widening of the Gaussian after each fitting stage
WIDEN = (2.0, 2.0, 1.5, 1.5)
#: the prior's share of the mixture
PRIOR_SHARE = 0.1
#: ridge on the fitted covariance, as a fraction of the prior's variance per coordinate
RIDGE = 1e-3


def _fit(draws: Tensor, log_w: Tensor, prior_var: Tensor, widen: float) -> MultivariateNormal:
    """Gaussian of the weighted mean and widened covariance of ``draws (m, n, D)``, batch
    shape ``(n,)``."""
    log_w = torch.nan_to_num(log_w, nan=-math.inf, posinf=-math.inf)
    empty = torch.isneginf(log_w).all(0)  # no draw in the target's support: the prior's moments
    w = torch.softmax(torch.where(empty[None], torch.zeros_like(log_w), log_w), 0)
    mean = torch.einsum("mn,mnd->nd", w, draws)
    diff = draws - mean
    cov = torch.einsum("mn,mni,mnj->nij", w, diff, diff)
    cov = widen**2 * cov + torch.diag_embed(RIDGE * prior_var).expand_as(cov)
    return MultivariateNormal(mean, scale_tril=torch.linalg.cholesky(cov), validate_args=False)


def adaptive_blocks(
    target: Any,
    theta: Tensor,
    x: Tensor,
    m: int,
    rows: Iterator[slice],
    seeded: Callable[[Callable[[], Tensor]], Tensor],
) -> Iterator[tuple[Tensor, Tensor, Tensor, Tensor]]:
    """Per block of pairs: target and proposal log-densities of the last stage's draws
    ``(M_s, n)`` and of the truths ``(n,)``, as the metric's other proposals yield them."""
    d = theta.shape[1]

    def log_mixture(t: Tensor, gauss: MultivariateNormal) -> Tensor:
        log_q = gauss.log_prob(t)
        return torch.logaddexp(
            math.log(PRIOR_SHARE) + target.log_prior(t).to(log_q), math.log1p(-PRIOR_SHARE) + log_q
        )

    def draw(size: int, gauss: MultivariateNormal) -> Tensor:
        fitted = gauss.sample((size,))  # (size, n, D)
        from_prior = torch.rand(fitted.shape[:2]) < PRIOR_SHARE
        prior = target.prior.sample(fitted.shape[:2]).reshape(fitted.shape).to(fitted)
        return torch.where(from_prior[..., None], prior, fitted)

    sizes = [max(1, int(share * m)) for share in FIT_SHARES]
    final = max(1, m - sum(sizes))
    for block in rows:
        n, xb = block.stop - block.start, x[block]
        draws = seeded(lambda n=n: target.prior.sample((sizes[0], n))).reshape(sizes[0], n, d)
        draws = draws.to(theta)
        log_t = target.unnormalized_log_prob(draws, xb)
        log_g = target.log_prior(draws.to(log_t.dtype)).to(log_t)
        prior_var = draws.reshape(-1, d).var(0).to(log_t).clamp_min(torch.finfo(log_t.dtype).tiny)
        gauss = _fit(draws.to(log_t), log_t - log_g, prior_var, WIDEN[0])

        for stage, size in enumerate((*sizes[1:], final)):
            draws = seeded(lambda size=size, gauss=gauss: draw(size, gauss))
            log_t = target.unnormalized_log_prob(draws.to(theta.dtype), xb)
            log_g = log_mixture(draws, gauss).to(log_t)
            if stage + 1 < len(sizes):
                gauss = _fit(draws, log_t - log_g, prior_var, WIDEN[stage + 1])
                continue
            truth = theta[block].to(gauss.loc.dtype)
            log_t0 = target.unnormalized_log_prob(theta[block], xb)
            yield log_t, log_g, log_t0, log_mixture(truth, gauss).to(log_t0)
