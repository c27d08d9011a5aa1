r"""ECDF of ranks, its pointwise and simultaneous confidence bands, and the ECDF test.

For ``N`` ranks :math:`r_i \in \{0, \dots, M\}` the ECDF is evaluated at ``K`` levels
:math:`z_k = c_k / (M + 1)`, :math:`c_k \in \{1, \dots, M\}`:

.. math::
    F(z_k) = \frac{1}{N} \#\{i : r_i \le c_k - 1\}.

If the ranks are uniform on :math:`\{0, \dots, M\}` (calibration),
:math:`N F(z_k) \sim \mathrm{Bin}(N, z_k)` *exactly*, and the counts form a Markov chain:
:math:`N F(z_k) - N F(z_{k-1}) \mid N F(z_{k-1}) = n \sim
\mathrm{Bin}(N - n, (z_k - z_{k-1}) / (1 - z_{k-1}))`. Everything here is exact for
discrete ranks because the levels sit on the rank grid; no continuous uniform is
ever compared with integer ranks.

* :func:`pointwise_band`: :math:`F(t) - t \pm z_{1-\alpha/2} \sqrt{t (1 - t) / N}`
  (the Brownian-bridge band): each point is inside with probability about
  :math:`1 - \alpha`, the whole curve much less often.
* :func:`simultaneous_band`: binomial quantile bands at a per-point level
  :math:`\gamma` chosen so that the whole curve stays inside with probability
  :math:`1 - \alpha` (at least, and as close as the discreteness allows), the
  probability computed exactly by the Markov recursion (Säilynoja et al., 2022).
* :func:`ecdf_test`: the test the simultaneous band draws: the statistic is the
  smallest pointwise two-sided binomial tail probability along the curve, its
  p-value is exact by the same recursion, and ``p < level`` exactly when the curve
  leaves the simultaneous band.

References:
    Säilynoja, Bürkner, Vehtari. "Graphical test for discrete uniformity and its
    applications in goodness-of-fit evaluation and multiple sample comparison."
    Statistics and Computing 32, 32 (2022).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from numpy.lib.stride_tricks import as_strided
from scipy import special, stats
from threadpoolctl import threadpool_limits
from torch import Tensor

from calib_lightning._utils.validation import check_finite, check_positive, check_probability
from calib_lightning.functional.ranks import _check_counts

__all__ = [
    "P_VALUE_FLOOR",
    "band_coverage",
    "ecdf_levels",
    "ecdf_test",
    "pointwise_band",
    "rank_ecdf",
    "simultaneous_band",
]

#: Smallest p-value an analytic test reports: the smallest normal float64, about
#: ``2.2e-308``. A tail probability that underflows below it is reported as this value,
#: an upper bound on the exact p-value (so still a valid p-value), never as exactly 0.
P_VALUE_FLOOR: float = float(torch.finfo(torch.float64).tiny)

_CANDIDATES = 32  # band levels tried per pass of the recursion
_PRECISION = 1e-3  # relative width of the final bracket on gamma
_TINY_P_VALUE = 1e-6  # below this, ecdf_test returns the Bonferroni bound (see there)


def ecdf_levels(num_posterior_samples: int, num_points: int | None = 100) -> Tensor:
    r"""The ``K`` rank cut-offs at which rank ECDFs are evaluated.

    Arguments:
        num_posterior_samples: ``M``; ranks take values ``0..M``.
        num_points: ``K`` (at most ``M``: the levels are distinct points of the rank
            grid, spread evenly); ``None`` for all ``M``.

    Returns:
        ``(K,)`` integer counts :math:`c_k \in \{1..M\}` of rank values at or below
        each cut-off; the levels are ``c / (M + 1)``.

    Example:
        >>> ecdf_levels(9, 3)
        tensor([2, 5, 8])
        >>> ecdf_levels(3, None)
        tensor([1, 2, 3])
    """
    check_positive("num_posterior_samples", num_posterior_samples, integer=True)
    m = num_posterior_samples
    k = m if num_points is None else num_points
    check_positive("num_points", k, integer=True)
    k = min(k, m)
    cuts = torch.arange(1, k + 1, dtype=torch.float64) * (m + 1) / (k + 1)
    return cuts.round().long().clamp(1, m).unique()


def _check_levels(levels: Tensor, *, increasing: bool = True) -> Tensor:
    """``levels`` as a CPU float64 tensor; raise unless it is ``(K,)`` in ``(0, 1)``
    (and strictly increasing)."""
    z = levels.double().cpu()
    ok = z.ndim == 1 and z.numel() > 0 and bool(((z > 0) & (z < 1)).all())
    if not ok or (increasing and bool((z.diff() <= 0).any())):
        order = " increasing" if increasing else ""
        raise ValueError(f"levels must be a (K,){order} sequence in (0, 1), got {z[:5]}...")
    return z


def rank_ecdf(histogram: Tensor, cuts: Tensor) -> tuple[Tensor, Tensor]:
    r"""ECDF of ranks at the levels ``z = cuts / (M + 1)``.

    Arguments:
        histogram: rank counts ``(*, M + 1)``.
        cuts: ``(K,)`` from :func:`ecdf_levels`.

    Returns:
        ``(z, ecdf)``: levels ``(K,)`` float64 and ECDF values ``(*, K)`` float64.
    """
    _check_counts("histogram", histogram)
    m1 = histogram.shape[-1]
    if cuts.ndim != 1 or cuts.is_floating_point() or not bool(((cuts >= 1) & (cuts < m1)).all()):
        raise ValueError(f"cuts must be (K,) integers in 1..M = 1..{m1 - 1}, got {cuts[:5]}...")
    cumulative = histogram.to(torch.float64).cumsum(-1)
    total = cumulative[..., -1:]
    ecdf = cumulative[..., cuts.to(histogram.device) - 1] / total
    return cuts.to(torch.float64) / m1, ecdf


def pointwise_band(levels: Tensor, num_ranks: int, level: float = 0.05) -> Tensor:
    r"""Half-width of the pointwise band of :math:`F(t) - t`:
    :math:`z_{1 - \alpha/2} \sqrt{t (1 - t) / N}`.

    Each point is inside with probability about :math:`1 - \alpha`; the whole curve
    of a calibrated model leaves it far more often than :math:`\alpha`.

    Arguments:
        levels: ``(K,)`` in ``(0, 1)``.
        num_ranks: ``N``.
        level: test level :math:`\alpha`; each point is covered w.p. ``1 - level``.

    Returns:
        ``(K,)`` half-widths.

    Example:
        >>> pointwise_band(torch.tensor([0.5]), 100, 0.05)
        tensor([0.0980])
    """
    check_positive("num_ranks", num_ranks, integer=True)
    check_probability("level", level)
    _check_levels(levels, increasing=False)
    quantile = stats.norm.ppf(1 - level / 2)
    return quantile * torch.sqrt(levels * (1 - levels) / num_ranks)


def _count_band(levels: Sequence[float], n: int, low_q: Any, high_q: Any) -> tuple:
    """Binomial quantile bounds on the counts, broadcast over ``low_q``/``high_q`` ``(C, 1)``."""
    z = np.asarray(levels)
    lower = stats.binom.ppf(low_q, n, z)
    upper = stats.binom.ppf(high_q, n, z)
    return torch.as_tensor(lower).long(), torch.as_tensor(upper).long()


def band_coverage(levels: Tensor, lower: Tensor, upper: Tensor, num_ranks: int) -> Tensor:
    r"""Exact probability that a calibrated ECDF stays within count bounds at every level.

    Computes :math:`P(L_k \le N F(z_k) \le U_k \ \forall k)` for ``N`` ranks uniform on
    the rank grid (or continuous uniform) by the forward recursion over the Markov
    chain of counts, for ``C`` bands at once (the transition matrices are shared over
    the union of the bands); cost :math:`O(K w^2 + C K w^2)` in time with ``w`` the
    widest band's width in counts.

    Arguments:
        levels: ``(K,)`` increasing levels in ``(0, 1)``.
        lower: ``(*, K)`` integer lower bounds :math:`L_k` on the counts.
        upper: ``(*, K)`` integer upper bounds :math:`U_k`.
        num_ranks: ``N``.

    Returns:
        ``(*)`` float64 probabilities.

    References:
        Säilynoja, Bürkner, Vehtari (2022), section 3 (the "optimization" method).
    """
    check_positive("num_ranks", num_ranks, integer=True)
    z = _check_levels(levels)
    if lower.shape[-1:] != z.shape or upper.shape != lower.shape:
        raise ValueError(
            f"lower and upper must both have shape (*, K) with K = {z.numel()}, "
            f"got {tuple(lower.shape)} and {tuple(upper.shape)}"
        )
    n = num_ranks
    shape = lower.shape[:-1]
    low = lower.reshape(-1, lower.shape[-1]).clamp(0, n).numpy()
    high = upper.reshape(-1, upper.shape[-1]).clamp(0, n).numpy()
    # One BLAS thread: the products are small, and threads waiting on each other on a
    # busy machine make them 10-30x slower.
    with threadpool_limits(1, user_api="blas"):
        prob = _forward(z.tolist(), low, high, n)
    if prob is None:
        return torch.zeros(shape, dtype=torch.float64)
    return torch.as_tensor(prob.sum(-1)).clamp(0.0, 1.0).reshape(shape)


def _forward(levels: list[float], low: np.ndarray, high: np.ndarray, n: int) -> Any:
    """Forward recursion of :func:`band_coverage`: ``(C, w)`` final state probabilities."""
    # numpy, not torch: K small matrix products, where torch's thread pool only adds overhead.
    # log P(j | k) = a_k + b_j - log (j - k)!, with log (j - k)! = +inf for j < k.
    log_fact = special.gammaln(np.arange(n + 1, dtype=np.float64) + 1)
    log_fact_ext = np.concatenate([np.full(n + 1, np.inf), log_fact])  # index d + n + 1
    prob = np.ones((low.shape[0], 1))
    prev_lo, prev_hi, prev_z = 0, 0, 0.0
    for i, z in enumerate(levels):
        lo, hi = max(int(low[:, i].min()), prev_lo), int(high[:, i].max())
        if hi < lo:
            return None
        q = (z - prev_z) / (1.0 - prev_z)
        k = np.arange(prev_lo, prev_hi + 1)
        j = np.arange(lo, hi + 1)
        a = log_fact[n - k] - k * math.log(q)
        b = j * math.log(q) + (n - j) * math.log1p(-q) - log_fact[n - j]
        # Toeplitz view: row r (k = prev_lo + r) holds log (j - k)! for every j
        diagonals = log_fact_ext[lo - prev_hi + n + 1 : hi - prev_lo + n + 2]
        step = diagonals.strides[0]
        toeplitz = as_strided(diagonals[k.size - 1 :], (k.size, j.size), (-step, step))
        log_p = np.subtract(a[:, None], toeplitz)
        log_p += b
        prob = prob @ np.exp(log_p, out=log_p)
        prob *= (j >= low[:, i, None]) & (j <= high[:, i, None])
        prev_lo, prev_hi, prev_z = lo, hi, z
    return prob


@functools.lru_cache(maxsize=64)
def _adjusted_gamma(levels: tuple[float, ...], n: int, level: float) -> tuple[float, float]:
    """Largest pointwise level gamma whose band holds the whole curve w.p. >= 1 - level.

    Coverage decreases in gamma (the bands are nested); try ``_CANDIDATES`` values at
    once on a log grid between the Bonferroni ``level / K`` and ``level``, then refine
    inside the bracket until both ends give the same integer band (finer steps cannot
    change the band) or the bracket is narrower than a factor ``1 + _PRECISION``.
    """
    z = torch.tensor(levels, dtype=torch.float64)
    lo, hi = level / len(levels), level  # coverage(lo) >= 1 - level by Bonferroni
    while True:
        gammas = np.geomspace(lo, hi, _CANDIDATES)[:, None]
        lower, upper = _count_band(levels, n, gammas / 2, 1 - gammas / 2)
        coverage = band_coverage(z, lower, upper, n)
        ok = (coverage >= 1 - level).nonzero().flatten()
        last = int(ok[-1]) if ok.numel() else 0
        if last == _CANDIDATES - 1 or hi / lo < 1 + _PRECISION:
            return float(gammas[last, 0]), float(coverage[last])
        if torch.equal(lower[last], lower[last + 1]) and torch.equal(upper[last], upper[last + 1]):
            return float(gammas[last, 0]), float(coverage[last])
        lo, hi = float(gammas[last, 0]), float(gammas[last + 1, 0])


def simultaneous_band(
    levels: Tensor, num_ranks: int, level: float = 0.05
) -> tuple[Tensor, Tensor, float]:
    r"""Simultaneous :math:`1 - \alpha` band for :math:`F(z_k) - z_k` of ``N`` uniform ranks.

    The band is :math:`[\mathrm{Bin}^{-1}(\gamma/2; N, z_k),
    \mathrm{Bin}^{-1}(1 - \gamma/2; N, z_k)] / N - z_k` with the pointwise level
    :math:`\gamma` adjusted so that the exact probability
    (:func:`band_coverage`) that a calibrated curve stays inside at all ``K`` levels is
    at least :math:`1 - \alpha`; :math:`\gamma` is searched between the Bonferroni
    :math:`\alpha / K` and :math:`\alpha` on log grids, 32 candidates per recursion.
    Results are cached per ``(levels, N, level)``.

    Arguments:
        levels: ``(K,)`` increasing levels in ``(0, 1)`` (exact for ranks on ``0..M``
            when ``levels = c / (M + 1)``, see :func:`ecdf_levels`).
        num_ranks: ``N``.
        level: test level :math:`\alpha`; the band covers the whole curve w.p.
            ``>= 1 - level``.

    Returns:
        ``(lower, upper, coverage)``: bounds ``(K,)`` of :math:`F - z` and the exact
        simultaneous coverage achieved (``>= 1 - level``).

    Example:
        >>> z = torch.arange(1, 10, dtype=torch.float64) / 10
        >>> lower, upper, coverage = simultaneous_band(z, 50, 0.05)
        >>> bool((lower < 0).all() and (upper > 0).all()), 0.95 <= coverage < 0.97
        (True, True)

    References:
        Säilynoja, Bürkner, Vehtari. "Graphical test for discrete uniformity and its
        applications in goodness-of-fit evaluation and multiple sample comparison."
        Statistics and Computing 32, 32 (2022).
    """
    check_positive("num_ranks", num_ranks, integer=True)
    check_probability("level", level)
    z = _check_levels(levels)
    key = tuple(z.tolist())
    gamma, coverage = _adjusted_gamma(key, num_ranks, float(level))
    lower, upper = _count_band(key, num_ranks, gamma / 2, 1 - gamma / 2)
    return lower.double() / num_ranks - z, upper.double() / num_ranks - z, coverage


def ecdf_test(ecdf: Tensor, levels: Tensor, num_ranks: int) -> tuple[Tensor, Tensor]:
    r"""Exact test of uniformity from the ECDF at ``K`` levels (the simultaneous-band test).

    Statistic: :math:`T = \min_k \min\{1, 2 P(B_k \le n_k), 2 P(B_k \ge n_k)\}` with
    :math:`n_k = N F(z_k)` and :math:`B_k \sim \mathrm{Bin}(N, z_k)`; small values
    reject. p-value: :math:`P_{H_0}(T \le t) = 1 - P(\text{all } n_k \text{ inside the
    band at level } t)`, exact by :func:`band_coverage`. When
    :math:`K t < 10^{-6}` the p-value is reported as the Bonferroni bound
    :math:`\min(1, K t)` (an upper bound; the exact recursion would need the full
    ``N``-wide band), floored at :data:`P_VALUE_FLOOR`.

    Arguments:
        ecdf: ``(*, K)`` ECDF values (multiples of ``1 / N``).
        levels: ``(K,)`` increasing levels in ``(0, 1)``.
        num_ranks: ``N``.

    Returns:
        ``(statistic, p_value)``, each ``(*)``.

    References:
        Säilynoja, Bürkner, Vehtari (2022).
    """
    check_positive("num_ranks", num_ranks, integer=True)
    z = _check_levels(levels)
    check_finite("ecdf", ecdf)
    if ecdf.ndim < 1 or ecdf.shape[-1:] != z.shape:
        raise ValueError(
            f"ecdf must have shape (*, K) with K = {z.numel()}, got {tuple(ecdf.shape)}"
        )
    n = num_ranks
    counts = (ecdf.double().cpu() * n).round()
    below = stats.binom.cdf(counts.numpy(), n, z.numpy())
    above = stats.binom.sf(counts.numpy() - 1, n, z.numpy())
    tails = torch.as_tensor(2 * below.clip(max=0.5)).minimum(torch.as_tensor(2 * above))
    statistic = tails.clamp_max(1.0).amin(-1)
    flat = statistic.flatten()
    k = z.numel()
    p_value = (k * flat).clamp_max(1.0)  # Bonferroni bound, kept for tiny statistics
    exact = (k * flat >= _TINY_P_VALUE).nonzero().flatten()
    if exact.numel():
        t = flat[exact].numpy()[:, None] / 2
        zs = z.numpy()
        # inside iff P(B <= n) > t/2 and P(B >= n) > t/2
        lower = stats.binom.ppf(t, n, zs)
        lower += stats.binom.cdf(lower, n, zs) <= t
        upper = stats.binom.isf(t, n, zs)
        upper -= stats.binom.sf(upper - 1, n, zs) <= t
        inside = band_coverage(z, torch.as_tensor(lower).long(), torch.as_tensor(upper).long(), n)
        p_value[exact] = 1.0 - inside
    p_value = p_value.reshape(statistic.shape)
    return statistic.to(ecdf.device), p_value.clamp(P_VALUE_FLOOR, 1.0).to(ecdf.device)
