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

from calib_lightning.functional.distance_rank import distance_log_prob

__all__ = ["SummaryAccumulator", "check_log_prob", "posterior_summary", "score_statistics"]


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
