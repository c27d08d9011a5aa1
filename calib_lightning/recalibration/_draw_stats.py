r"""What :class:`~calib_lightning.recalibration.ConformalRegion` computes from a
posterior's draws at each observation: the statistics its credibility score compares
(:func:`score_statistics`, checked by :func:`check_log_prob`) and a summary of the
posterior, its tree's features with ``embedding="posterior"`` (:func:`posterior_summary`).

The summary, per observation :math:`x`, from ``S`` draws
:math:`\theta_s \sim q(\cdot \mid x)`: the mean and the standard deviation of each
coordinate and (when the draws come with log-densities) their mean log-density
:math:`\frac1S \sum_s \log q(\theta_s \mid x)`, minus a Monte Carlo estimate of
:math:`q`'s entropy. They say where :math:`q` sits and how wide it is, in ``2 D (+ 1)``
numbers whatever the size of ``x``. Sums are accumulated in float64, so draws that come
in chunks (several per observation) give the same features as one block.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from calib_lightning import evaluation
from calib_lightning._utils.validation import check_finite, check_pairs
from calib_lightning.functional.distance_rank import distance_log_prob

__all__ = [
    "SummaryAccumulator",
    "check_log_prob",
    "check_points",
    "check_scores",
    "count_above",
    "posterior_summary",
    "score_statistics",
    "seeded_draws",
    "tie_noise",
]


def score_statistics(
    posterior: Any, score: str, samples: Tensor, theta: Tensor, x: Tensor
) -> tuple[Tensor, Tensor]:
    """``(ell(draws) (S, N), ell(theta) (*, N))`` for draws ``(S, N, D)`` at ``x``: the
    log-density (``score="density"``) or the density-free distance statistic; the one at
    ``theta`` checked by :func:`check_log_prob`."""
    if score == "density":
        with torch.no_grad():
            ell_samples, ell_theta = posterior.log_prob(samples, x), posterior.log_prob(theta, x)
    elif theta.ndim == 2:
        ell_samples, ell_theta = distance_log_prob(samples, theta)
    else:
        flat = theta.reshape(-1, *theta.shape[-2:])  # (K, N, D): one statistic per point
        out = [distance_log_prob(samples, point) for point in flat]
        ell_samples = torch.stack([o[0] for o in out], 1)
        ell_theta = torch.stack([o[1] for o in out]).reshape(theta.shape[:-1])
    check_log_prob(ell_theta)
    return ell_samples, ell_theta


def check_log_prob(ell_theta: Tensor) -> None:
    """``-inf`` (outside the posterior's support: least credible) passes; NaN and ``+inf``
    raise, counting the points."""
    bad = torch.isnan(ell_theta) | (ell_theta == torch.inf)
    if bool(bad.any()):
        raise ValueError(
            f"posterior log_prob at theta must not be NaN or +inf, got {int(bad.sum())} such "
            f"values out of {ell_theta.numel()}"
        )


class SummaryAccumulator:
    """Running per-observation sums of draws (and of their log-densities).

    Arguments:
        n: observations.
        dim: ``D``, the parameter dimension.
        log_prob: whether the draws come with log-densities (one more feature).
    """

    def __init__(self, n: int, dim: int, *, log_prob: bool) -> None:
        self.log_prob = bool(log_prob)
        self.sums = torch.zeros(n, 2 * dim + self.log_prob, dtype=torch.float64)
        self.counts = torch.zeros(n, 1, dtype=torch.float64)
        self.dim = dim

    def add(self, rows: slice, samples: Tensor, log_prob: Tensor | None = None) -> None:
        """Add draws ``(s, k, D)`` of the observations ``rows`` (``k`` of them) and their
        log-densities ``(s, k)`` (required iff ``log_prob``)."""
        if self.log_prob and log_prob is None:
            raise ValueError("this summary needs the draws' log-densities, got None")
        draws = samples.detach().double().cpu()
        parts = [draws.sum(0), draws.square().sum(0)]
        if self.log_prob:
            parts.append(log_prob.detach().double().cpu().sum(0)[:, None])
        self.sums[rows] += torch.cat(parts, 1)
        self.counts[rows] += draws.shape[0]

    def features(self) -> Tensor:
        """``(n, 2 D (+ 1))``: per-coordinate means, standard deviations (and the mean
        log-density), float64."""
        d = self.dim
        means = self.sums / self.counts
        std = (means[:, d : 2 * d] - means[:, :d].square()).clamp_min(0.0).sqrt()
        return torch.cat([means[:, :d], std, means[:, 2 * d :]], 1)


def posterior_summary(samples: Tensor, log_prob: Tensor | None = None) -> Tensor:
    """The summary features ``(N, 2 D (+ 1))`` of draws ``(S, N, D)`` (and their
    log-densities ``(S, N)``), float64 on the CPU.

    Example:
        >>> draws = torch.tensor([[[0.0, 1.0]], [[2.0, 1.0]]])  # S = 2, N = 1, D = 2
        >>> posterior_summary(draws, torch.tensor([[-1.0], [-3.0]]))
        tensor([[ 1.,  1.,  1.,  0., -2.]], dtype=torch.float64)
    """
    summary = SummaryAccumulator(samples.shape[1], samples.shape[2], log_prob=log_prob is not None)
    summary.add(slice(None), samples, log_prob)
    return summary.features()


def count_above(
    posterior: Any, score: str, theta: Tensor, x: Tensor, num_samples: int, *, summary: bool
) -> tuple[Tensor, Tensor | None]:
    """For each pair, how many of ``num_samples`` draws at ``x`` score above ``theta``
    ``(n,)`` float64, and (``summary``) the posterior summary ``(n, F)`` of those draws."""
    above = torch.zeros(len(theta), dtype=torch.float64)
    dense = score == "density"
    sums = SummaryAccumulator(len(theta), theta.shape[1], log_prob=dense) if summary else None
    for chunk in evaluation.draw_chunks(posterior, theta, x, num_samples, log_densities=dense):
        rows = slice(chunk.start, chunk.start + chunk.theta.shape[0])
        if chunk.log_prob is None:
            ell_samples, ell_theta = distance_log_prob(chunk.samples, chunk.theta)
        else:
            ell_samples, ell_theta = chunk.log_prob, chunk.log_prob_theta
        evaluation.checked_samples(chunk.samples, ell_samples)
        check_log_prob(ell_theta)
        above[rows] += (ell_samples > ell_theta).sum(0).double().cpu()
        if sums is not None:
            sums.add(rows, chunk.samples, chunk.log_prob)
    return above, None if sums is None else sums.features()


def check_points(theta: Tensor, x: Tensor) -> tuple[Tensor, Tensor]:
    """``theta`` ``(*, N, D)`` and ``x`` ``(N, *X)`` checked (shapes, finite)."""
    if not isinstance(theta, Tensor) or theta.ndim < 2 or not isinstance(x, Tensor):
        raise ValueError(
            f"theta must be a tensor of shape (*, N, D) and x (N, *X), got {theta!r:.60} "
            f"and {x!r:.60}"
        )
    _, x = check_pairs(theta.reshape(-1, theta.shape[-1])[: x.shape[0]], x)
    if theta.shape[-2] != x.shape[0]:
        raise ValueError(
            f"theta must have shape (*, N, D) with N = {x.shape[0]} (the rows of x), "
            f"got {tuple(theta.shape)}"
        )
    check_finite("theta", theta.reshape(-1, theta.shape[-1]))
    return theta, x


def seeded_draws(posterior: Any, x: Tensor, num_samples: int, seed: int | None) -> Tensor:
    """``evaluation.draws`` at ``x``; with a ``seed``, from that seed whatever the global
    generator's state (restored after), so the same ``x`` gets the same draws."""
    if seed is None:
        return evaluation.draws(posterior, x, num_samples)
    with torch.random.fork_rng(devices=[x.device] if x.device.type == "cuda" else []):
        torch.manual_seed(seed)
        return evaluation.draws(posterior, x, num_samples)


def tie_noise(like: Tensor, seed: int) -> Tensor:
    """Uniform noise shaped, typed and placed like ``like``, from ``seed``."""
    generator = torch.Generator(device=like.device).manual_seed(seed)
    return torch.rand(like.shape, generator=generator, dtype=like.dtype, device=like.device)


def check_scores(scores: object, n: int, *, credibility: bool = False) -> None:
    """Given scores must be a finite tensor of shape ``(n,)`` (credibilities: in [0, 1],
    so that a log-density region's scores are not taken for them)."""
    if not isinstance(scores, Tensor) or scores.shape != (n,):
        raise ValueError(f"scores must have shape (n,) = ({n},), got {scores!r:.60}")
    check_finite("scores", scores)
    if credibility and bool(((scores < 0) | (scores > 1)).any()):
        raise ValueError(
            "scores of a conformity='credibility' region must lie in [0, 1], got values in "
            f"[{float(scores.min()):.3g}, {float(scores.max()):.3g}] (a log-density region's?)"
        )


def negative_log_prob(posterior: Any, theta: Tensor, x: Tensor) -> Tensor:
    """``-log q(theta | x)`` (the ``log_density`` conformity score), float64 on the CPU;
    outside the support: the largest float."""
    with torch.no_grad():
        ell = posterior.log_prob(theta, x)
    check_log_prob(ell)
    return (-ell.double().cpu()).clamp_max(torch.finfo(torch.float64).max)
