r"""Simulation-based calibration from rank histograms: tests, curves, coverage, sharpness.

:func:`summarize_ranks` turns the rank histogram of
:func:`~calib_lightning.functional.ranks.sbc_ranks` (``D`` marginal rows and the joint energy
row) into p-values (:func:`uniformity_test`, a chi-square test against the *discrete* uniform,
and the exact ECDF-band test), one ``global_p_value`` over all of them, ECDF curves with their
bands, the expected-coverage curve and its signed error; :func:`sharpness` adds contraction and
the error of the posterior mean. It is what :class:`calib_lightning.RankCalibration` computes;
:func:`rank_calibration` does the same in one call for users who already hold posterior samples
and log-densities.

Expected coverage (energy rank ``r`` of the truth among ``M`` draws): the truth lies
in the highest-density credible region of level ``c`` when fewer than a fraction
``c`` of the draws are more probable than it, so the coverage curve is the ECDF of
the joint rank at ``c``. Its signed area to the diagonal, with the randomized
fractional rank :math:`u = (r + U) / (M + 1)`, :math:`U \sim U(0, 1)`, is

.. math::
    \mathrm{coverage\_error} = \int_0^1 (P(u \le c) - c)\, dc
    = \frac{1}{2} - E[u] = \frac{M / 2 - \bar r}{M + 1}.

**Reading the sign** (the one convention of the package; every figure, summary and docstring
that reads a direction refers here). A *coverage curve* is the fraction of truths inside the
credible regions of level ``c`` against ``c``: the joint (energy) rank ECDF and ``coverage``.
Its deviation from the diagonal (``ECDF(t) - t`` of the joint rank, ``coverage_error``) reads

* **below 0 = over-confident**: the regions cover the truth less often than claimed
  (too narrow, or misplaced: a biased posterior also lands here);
* **above 0 = under-confident**: they cover more often than claimed (too wide,
  conservative);
* 0 in expectation under calibration.

A *marginal* rank ECDF is not a coverage curve but the CDF of where the truth falls among the
draws of one parameter (rank = number of draws below the truth), so it is read by its shape:
above 0 on the left and below on the right (a U-shaped histogram) = too narrow, over-confident;
the reverse (a hump) = too wide, under-confident; above 0 throughout = the posterior sits too
high (its draws exceed the truth), below throughout = too low. TARP's ``coverage``
(random-reference balls, :mod:`calib_lightning.functional.tarp`) behaves like a marginal curve
along a random direction: a dispersion error makes it S-shaped, so it is read on its upper half,
:math:`c > 1/2`, where it follows the coverage convention (its ``coverage_error``, the area
there: negative = over-confident, positive = under-confident); on the lower half it mirrors.

**Global p-value.** ``global_p_value`` tests "calibrated everywhere tested": the
intersection of the ``D`` marginal and the joint uniformity hypotheses, combining
*all* ``2 (D + 1)`` p-values the check reports (chi-square and ECDF-band, marginals
and joint) with :func:`~calib_lightning.functional.combine.combine_p_values`: the
Cauchy combination (default) or Holm's smallest adjusted p-value, both valid under the
dependence of tests that share data (why both kinds of test, and why Cauchy:
``docs/design.md``, "One verdict per check").

Analytic p-values are never exactly 0: tail probabilities that underflow are reported
as :data:`~calib_lightning.functional.bands.P_VALUE_FLOOR` (about ``2.2e-308``), an
upper bound on the exact p-value.

References:
    Talts et al. "Validating Bayesian inference algorithms with simulation-based
    calibration." arXiv:1804.06788 (2018). Säilynoja, Bürkner, Vehtari. "Graphical
    test for discrete uniformity ..." Statistics and Computing 32, 32 (2022).
    Liu, Xie. "Cauchy Combination Test: A Powerful Test With Analytic p-Value
    Calculation Under Arbitrary Dependency Structures." JASA 115 (2020).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, NamedTuple

import torch
from torch import Tensor

from calib_lightning._utils.chunks import pair_blocks
from calib_lightning._utils.validation import check_positive, check_probability
from calib_lightning.functional._tails import chi2_sf
from calib_lightning.functional.bands import (
    P_VALUE_FLOOR,
    ecdf_levels,
    ecdf_test,
    pointwise_band,
    rank_ecdf,
    simultaneous_band,
)
from calib_lightning.functional.combine import COMBINATION_METHODS, combine_p_values
from calib_lightning.functional.ranks import (
    MOMENT_DRAWS,
    _check_counts,
    rank_chunks,
    rank_histogram,
)
from calib_lightning.results import Result

__all__ = [
    "RankCalibrationResult",
    "RankSummary",
    "Sharpness",
    "coverage_error",
    "default_num_bins",
    "rank_calibration",
    "sharpness",
    "statistic_tests",
    "summarize_ranks",
    "uniformity_test",
]


class Sharpness(NamedTuple):
    """Sharpness of a posterior (:func:`~calib_lightning.functional.sharpness`), each ``(*, D)``.

    Attributes:
        contraction: :math:`1 - \\overline{v} / \\mathrm{Var}_{\\mathrm{prior}}`.
        mean_squared_error: squared error of the posterior mean, corrected for its Monte
            Carlo error.
        posterior_variance: mean over pairs of the posterior variance.
        prior_variance: variance of the calibration parameters.
    """

    contraction: Tensor
    mean_squared_error: Tensor
    posterior_variance: Tensor
    prior_variance: Tensor


@dataclass(eq=False)
class RankSummary(Result):
    """Tests, curves and coverage from a rank histogram ``(*, D + 1, M + 1)``.

    ``*`` is the histogram's leading batch shape, ``K`` the number of ECDF levels.

    Attributes:
        p_value: ``(*)`` chi-square test of discrete uniformity of the joint rank.
        statistic: ``(*)`` its statistic.
        marginal_p_values: ``(*, D)`` the same test per dimension.
        marginal_statistics: ``(*, D)`` their statistics.
        ecdf_p_values: ``(*, D + 1)`` exact p-values of the simultaneous-band ECDF
            test, dimensions then joint.
        global_p_value: ``(*)`` all ``2 (D + 1)`` p-values combined (the verdict).
        coverage_error: ``(*)`` signed area of the coverage curve to the diagonal:
            negative = over-confident, positive = under-confident.
        levels: ``(K,)`` credibility levels of the curves.
        ecdf: ``(*, D + 1, K)`` rank ECDFs, dimensions then joint.
        coverage: ``(*, K)`` the coverage curve (joint ECDF: coverage of the
            level-``c`` HPD region).
        simultaneous_band: ``(2, K)`` lower and upper bounds of ``ECDF - t``.
        pointwise_band: ``(2, K)`` the same, pointwise.
        band_coverage: ``()`` exact simultaneous coverage of the band.
        histogram: ``(*, D + 1, M + 1)`` the rank counts.
        num_bins: ``()`` chi-square bins.
        num_pairs: ``()`` calibration pairs ``N``.
        level: ``()`` test level of the bands.
    """

    verdict = "global_p_value"
    logged = (
        "global_p_value",
        "p_value",
        "coverage_error",
        "num_pairs",
        "marginal_p_values",
        "ecdf_p_values",
    )

    p_value: Tensor
    statistic: Tensor
    marginal_p_values: Tensor
    marginal_statistics: Tensor
    ecdf_p_values: Tensor
    global_p_value: Tensor
    coverage_error: Tensor
    levels: Tensor
    ecdf: Tensor
    coverage: Tensor
    simultaneous_band: Tensor
    pointwise_band: Tensor
    band_coverage: Tensor
    histogram: Tensor
    num_bins: Tensor
    num_pairs: Tensor
    level: Tensor


@dataclass(eq=False)
class RankCalibrationResult(RankSummary):
    """:class:`RankSummary` with band exits and sharpness (what ``RankCalibration`` returns).

    Attributes:
        outside_band: ``(*, D + 1)`` bool, the ECDF leaves the simultaneous band.
        contraction: ``(*, D)`` 1 - posterior variance / prior variance.
        mean_squared_error: ``(*, D)`` squared error of the posterior mean.
        posterior_variance: ``(*, D)`` mean posterior variance.
        prior_variance: ``(*, D)`` variance of the calibration parameters.
        pair_theta, pair_mean, pair_variance: ``(n, D)`` float64, the truth and the
            Monte Carlo posterior mean and variance of each of the first ``n`` pairs
            (``RankCalibration(max_pairs=...)``; ``None`` when none were kept), for the
            recovery plots (:func:`~calib_lightning.functional.recovery.recovery_from_moments`).
        statistic_names: the names of the ``Q`` test quantities
            (``RankCalibration(statistics=...)``; empty without them).
        statistic_p_values: ``(Q,)`` chi-square p-values of their ranks (``None``
            without test quantities); logged as ``statistic_p_values/<name>``.
        statistic_ecdf_p_values: ``(Q,)`` exact ECDF-band p-values of their ranks;
            logged as ``statistic_ecdf_p_values/<name>``. Both enter ``global_p_value``.
        statistic_ecdf: ``(Q, K)`` their rank ECDFs at ``levels``.
        statistic_histogram: ``(Q, M + 1)`` their rank counts.
        joint_statistic: what the joint rank (``p_value``, the last ECDF, ``coverage``)
            ranks by: ``"energy"`` (minus the log-density) or, for a posterior known
            through its samples only, ``"distance"``
            (:mod:`~calib_lightning.functional.distance_rank`).

    Plus every field of :class:`RankSummary`.
    """

    logged = (*RankSummary.logged, "contraction", "mean_squared_error")

    outside_band: Tensor
    contraction: Tensor
    mean_squared_error: Tensor
    posterior_variance: Tensor
    prior_variance: Tensor
    pair_theta: Tensor | None = None
    pair_mean: Tensor | None = None
    pair_variance: Tensor | None = None
    statistic_names: tuple[str, ...] = ()
    statistic_p_values: Tensor | None = None
    statistic_ecdf_p_values: Tensor | None = None
    statistic_ecdf: Tensor | None = None
    statistic_histogram: Tensor | None = None
    joint_statistic: str = "energy"

    def scalars(self) -> dict[str, Tensor]:
        """The ``logged`` fields, then each test quantity's p-values keyed by its name."""
        out = super().scalars()
        for field in ("statistic_p_values", "statistic_ecdf_p_values"):
            values = getattr(self, field)
            if values is not None:
                pairs = zip(self.statistic_names, values, strict=True)
                out.update({f"{field}/{name}": v for name, v in pairs})
        return out

    @classmethod
    def from_summary(
        cls, summary: RankSummary, sharpness: Sharpness, **pairs: Any
    ) -> RankCalibrationResult:
        """Join a summary and a sharpness (and the per-pair fields, the joint statistic), computing
        ``outside_band``."""
        simultaneous = summary.simultaneous_band.to(summary.ecdf)
        deviation = summary.ecdf - summary.levels
        outside = (
            (deviation < simultaneous[0] - 1e-12) | (deviation > simultaneous[1] + 1e-12)
        ).any(-1)
        parts = {f.name: getattr(summary, f.name) for f in fields(summary)}
        return cls(**parts, outside_band=outside, **sharpness._asdict(), **pairs)


def default_num_bins(num_posterior_samples: int, num_ranks: int) -> int:
    """``min(M + 1, 20, max(2, N // 5))``: at least 5 expected counts per bin."""
    return min(num_posterior_samples + 1, 20, max(2, num_ranks // 5))


def _binned_counts(histogram: Tensor, num_bins: int) -> tuple[Tensor, Tensor]:
    r"""Rank counts ``(*, M + 1)`` summed over ``num_bins`` contiguous bins of
    :math:`\lfloor (b+1)(M+1)/B \rfloor - \lfloor b(M+1)/B \rfloor` rank values:
    ``(*, B)`` float64 counts and the ``(B + 1,)`` bin edges."""
    edges = torch.arange(num_bins + 1, device=histogram.device) * histogram.shape[-1] // num_bins
    cumulative = torch.nn.functional.pad(histogram.double().cumsum(-1), (1, 0))
    return cumulative[..., edges[1:]] - cumulative[..., edges[:-1]], edges


def uniformity_test(histogram: Tensor, num_bins: int | None = None) -> tuple[Tensor, Tensor]:
    r"""Chi-square test that ranks are uniform on the discrete set :math:`\{0, \dots, M\}`.

    The ``M + 1`` rank values are grouped into ``B`` contiguous bins of
    :math:`\lfloor (b+1)(M+1)/B \rfloor - \lfloor b(M+1)/B \rfloor` values each, whose
    probabilities under discrete uniformity are exact, so no integer rank is ever
    compared with a continuous uniform. Statistic
    :math:`X^2 = \sum_b (O_b - E_b)^2 / E_b`, p-value :math:`P(\chi^2_{B-1} \ge X^2)`,
    floored at :data:`~calib_lightning.functional.bands.P_VALUE_FLOOR` where it
    underflows (an upper bound, never exactly 0).

    Arguments:
        histogram: rank counts ``(*, M + 1)``, the same total ``N`` per row.
        num_bins: ``B``; default ``min(M + 1, 20, max(2, N // 5))``.

    Returns:
        ``(statistic, p_value)``, each ``(*)`` float64.

    Example:
        >>> stat, p = uniformity_test(torch.tensor([[5, 5, 5, 5], [20, 0, 0, 0]]), 2)
        >>> stat
        tensor([ 0., 20.], dtype=torch.float64)
    """
    _check_counts("histogram", histogram)
    m1 = histogram.shape[-1]
    n = histogram.double().sum(-1, keepdim=True)
    if num_bins is None:
        num_bins = default_num_bins(m1 - 1, int(n.min()))
    check_positive("num_bins", num_bins, integer=True)
    if not 2 <= num_bins <= m1:
        raise ValueError(f"num_bins must lie in 2..M+1 = 2..{m1}, got {num_bins}")
    observed, edges = _binned_counts(histogram, num_bins)
    expected = n * (edges[1:] - edges[:-1]).double() / m1
    statistic = ((observed - expected) ** 2 / expected).sum(-1)
    return statistic, chi2_sf(statistic, num_bins - 1)


def sharpness(
    mean_error_sq: Tensor, variance: Tensor, prior_variance: Tensor, num_posterior_samples: int
) -> Sharpness:
    r"""Contraction and posterior-mean error from per-dimension averages.

    .. math::
        \mathrm{contraction}_a = 1 - \overline{v}_a / \mathrm{Var}_{\mathrm{prior},a},
        \qquad \mathrm{MSE}_a = \overline{(\hat\mu_a - \theta^*_a)^2} - \overline{v}_a / S

    with ``S`` draws per pair behind :math:`\hat\mu` and :math:`\hat v` (the ``- v / S``
    term removes the Monte Carlo error of :math:`\hat\mu`, so MSE is
    unbiased for the squared error of the exact posterior mean of ``q``). For a
    calibrated ``q``, :math:`\mathrm{MSE}_a \approx \overline{v}_a`; the prior has
    contraction 0, a posterior that pins the parameter down has contraction 1.

    Arguments:
        mean_error_sq: mean over pairs of :math:`(\hat\mu - \theta^*)^2`, ``(D,)``.
        variance: mean over pairs of the posterior variance, ``(D,)``.
        prior_variance: variance of the calibration parameters, ``(D,)``.
        num_posterior_samples: ``S``, the draws per pair behind the moments.

    Returns:
        :class:`Sharpness`: ``contraction``, ``mean_squared_error``,
        ``posterior_variance``, ``prior_variance``, each ``(D,)``.
    """
    return Sharpness(
        contraction=1 - variance / prior_variance,
        mean_squared_error=mean_error_sq - variance / num_posterior_samples,
        posterior_variance=variance,
        prior_variance=prior_variance,
    )


def coverage_error(histogram: Tensor) -> Tensor:
    r"""Signed area between the expected-coverage curve and the diagonal.

    :math:`(M/2 - \bar r) / (M + 1)` from energy-rank counts; **negative means
    over-confident, positive under-confident** ("Reading the sign" in the module
    docstring).

    Arguments:
        histogram: energy-rank counts ``(*, M + 1)``.

    Returns:
        ``(*)`` float64, in :math:`[-\frac12, \frac12]`.

    Example:
        >>> coverage_error(torch.tensor([0, 0, 10]))  # truth always least probable
        tensor(-0.3333, dtype=torch.float64)
    """
    _check_counts("histogram", histogram)
    counts = histogram.double()
    m = counts.shape[-1] - 1
    values = torch.arange(m + 1, dtype=torch.float64, device=counts.device)
    mean_rank = (counts * values).sum(-1) / counts.sum(-1)
    return (m / 2 - mean_rank) / (m + 1)


def summarize_ranks(
    histogram: Tensor,
    *,
    level: float = 0.05,
    num_bins: int | None = None,
    num_ecdf_points: int | None = 100,
    global_method: str = "cauchy",
) -> RankSummary:
    r"""Tests, curves and coverage from rank counts ``(*, D + 1, M + 1)`` (joint row last).

    Arguments:
        histogram: counts of each rank value, the same number ``N`` of pairs in every
            row; rows ``0..D-1`` marginal, row ``D`` the joint energy rank.
        level: test level of the bands.
        num_bins: chi-square bins (default ``min(M + 1, 20, max(2, N // 5))``).
        num_ecdf_points: ``K`` levels of the ECDF curves (at most ``M``).
        global_method: ``"cauchy"`` or ``"holm"``, how ``global_p_value`` combines the
            ``2 (D + 1)`` tests (see the module docstring).

    Returns:
        :class:`RankSummary` (``*`` the leading batch shape): the chi-square tests
        (:func:`uniformity_test`) of the joint rank (``p_value``, ``statistic`` ``(*)``)
        and per dimension (``marginal_p_values``, ``marginal_statistics`` ``(*, D)``),
        the exact band tests (:func:`~calib_lightning.functional.bands.ecdf_test`,
        ``ecdf_p_values`` ``(*, D + 1)``), all ``2 (D + 1)`` combined by
        ``global_method`` (``global_p_value``, the verdict), ``coverage_error``
        (:func:`coverage_error`), the curves and bands, and ``histogram``,
        ``num_bins``, ``num_pairs``, ``level`` for the plots.

    Example:
        >>> counts = torch.full((3, 10), 30)  # D = 2, M = 9, N = 300, perfectly flat
        >>> out = summarize_ranks(counts)
        >>> float(out.p_value), float(out.coverage_error)
        (1.0, 0.0)
    """
    check_probability("level", level)
    if global_method not in COMBINATION_METHODS:
        raise ValueError(
            f"global_method must be one of {COMBINATION_METHODS}, got {global_method!r}"
        )
    if histogram.ndim < 2 or histogram.shape[-2] < 2 or histogram.shape[-1] < 2:
        raise ValueError(
            f"histogram must have shape (*, D + 1, M + 1) with D >= 1, M >= 1, "
            f"got {tuple(histogram.shape)}"
        )
    _check_counts("histogram", histogram)
    totals = histogram.sum(-1)
    n = int(totals.flatten()[0])
    if n < 1 or bool((totals != n).any()):
        raise ValueError(
            f"histogram rows must all count the same number N >= 1 of pairs, got "
            f"{sorted(set(totals.flatten().tolist()))[:5]}"
        )
    m = histogram.shape[-1] - 1
    num_bins = default_num_bins(m, n) if num_bins is None else num_bins
    statistic, p_value = uniformity_test(histogram, num_bins)
    cuts = ecdf_levels(m, num_ecdf_points)
    levels, ecdf = rank_ecdf(histogram, cuts)
    _, ecdf_p = ecdf_test(ecdf, levels, n)
    lower, upper, achieved = simultaneous_band(levels, n, level)
    half = pointwise_band(levels, n, level)
    device = histogram.device
    return RankSummary(
        p_value=p_value[..., -1],
        statistic=statistic[..., -1],
        marginal_p_values=p_value[..., :-1],
        marginal_statistics=statistic[..., :-1],
        ecdf_p_values=ecdf_p,
        global_p_value=combine_p_values(
            torch.cat([p_value, ecdf_p.to(p_value)], -1), method=global_method
        ).clamp_min(P_VALUE_FLOOR),
        coverage_error=coverage_error(histogram[..., -1, :]),
        levels=levels.to(device),
        ecdf=ecdf,
        coverage=ecdf[..., -1, :],
        simultaneous_band=torch.stack([lower, upper]).to(device),
        pointwise_band=torch.stack([-half, half]).to(device),
        band_coverage=torch.tensor(achieved, dtype=torch.float64, device=device),
        histogram=histogram,
        num_bins=torch.tensor(num_bins, device=device),
        num_pairs=torch.tensor(n, device=device),
        level=torch.tensor(level, dtype=torch.float64, device=device),
    )


def statistic_tests(
    histogram: Tensor, *, num_bins: int | None = None, num_ecdf_points: int | None = 100
) -> tuple[Tensor, Tensor, Tensor]:
    """The tests of :func:`summarize_ranks` for the ranks of ``Q`` test quantities.

    Arguments:
        histogram: rank counts ``(Q, M + 1)`` of
            :func:`~calib_lightning.functional.ranks.statistic_ranks`.
        num_bins, num_ecdf_points: as in :func:`summarize_ranks`.

    Returns:
        ``(p_values, ecdf_p_values, ecdf)``: chi-square p-values (:func:`uniformity_test`)
        ``(Q,)``, exact ECDF-band p-values ``(Q,)`` and the ECDFs ``(Q, K)``.

    Example:
        >>> p, ecdf_p, _ = statistic_tests(torch.tensor([[10, 10, 10, 10], [40, 0, 0, 0]]))
        >>> bool(p[0] == 1.0), bool(p[1] < 1e-6), bool(ecdf_p[1] < 1e-6)
        (True, True, True)
    """
    _check_counts("histogram", histogram)
    n, m = int(histogram[0].sum()), histogram.shape[-1] - 1
    num_bins = default_num_bins(m, n) if num_bins is None else num_bins
    _, p_values = uniformity_test(histogram, num_bins)
    levels, ecdf = rank_ecdf(histogram, ecdf_levels(m, num_ecdf_points))
    return p_values, ecdf_test(ecdf, levels, n)[1].to(p_values), ecdf


def rank_calibration(
    samples: Tensor,
    log_prob_samples: Tensor | None,
    theta: Tensor,
    log_prob_theta: Tensor | None,
    *,
    level: float = 0.05,
    num_bins: int | None = None,
    num_ecdf_points: int | None = 100,
    global_method: str = "cauchy",
    generator: torch.Generator | None = None,
) -> RankCalibrationResult:
    r"""Full rank-calibration check from posterior samples the caller already has.

    Arguments:
        samples: posterior draws ``(M, *, N, D)``, ``M >= 2``.
        log_prob_samples: their log-densities ``(M, *, N)``; ``None`` (both) for a
            posterior known through its samples only: the joint rank is then the
            distance rank (:mod:`~calib_lightning.functional.distance_rank`).
        theta: true parameters ``(*, N, D)``.
        log_prob_theta: their log-densities ``(*, N)`` (``-inf`` allowed).
        level: as in :func:`summarize_ranks`.
        num_bins: as in :func:`summarize_ranks`.
        num_ecdf_points: as in :func:`summarize_ranks`.
        global_method: as in :func:`summarize_ranks`.
        generator: for tie-breaking.

    Returns:
        :class:`RankCalibrationResult`: :func:`summarize_ranks`'s fields, where the
        ECDFs leave their band, and the :func:`sharpness` (``contraction``,
        ``mean_squared_error``, ``posterior_variance``, ``prior_variance``, each
        ``(*, D)``; the prior variance is that of ``theta`` over its ``N`` rows).

    Example:
        >>> g = torch.Generator().manual_seed(0)
        >>> theta = torch.randn(500, 2, generator=g)
        >>> prior = torch.distributions.Normal(0.0, 1.0)  # a calibrated, useless posterior
        >>> samples = torch.randn(100, 500, 2, generator=g)
        >>> out = rank_calibration(samples, prior.log_prob(samples).sum(-1),
        ...                        theta, prior.log_prob(theta).sum(-1), generator=g)
        >>> bool(out.p_value > 0.01), bool(out.contraction.abs().max() < 0.2)
        (True, True)
    """
    m = samples.shape[0]
    if m < 2 or theta.ndim < 2 or samples.shape[1:] != theta.shape:
        raise ValueError(
            f"samples must have shape (M, *, N, D) with M >= 2 and (*, N, D) = "
            f"{tuple(theta.shape)}, got {tuple(samples.shape)}"
        )
    if theta.shape[-2] < 2:
        raise ValueError(
            f"theta must have N >= 2 rows in shape (*, N, D), got {tuple(theta.shape)}"
        )
    # the pairs of every calibration set as one list, by blocks of pairs (``(M, n, D)``
    # draws): the scratch copies stay bounded; the one rank loop of the package
    lead, (n, d) = theta.shape[:-2], theta.shape[-2:]
    flat_theta = theta.reshape(-1, d)
    flat_samples = samples.reshape(m, -1, d)
    flat_lp = None if log_prob_samples is None else log_prob_samples.reshape(m, -1)
    flat_lt = None if log_prob_theta is None else log_prob_theta.reshape(-1)
    chunks = (
        (
            rows.start,
            flat_theta[rows],
            None if flat_lt is None else flat_lt[rows],
            flat_samples[:, rows],
            None if flat_lp is None else flat_lp[:, rows],
            0,
        )
        for rows in pair_blocks(flat_theta.shape[0], m * d)
    )
    draws = rank_chunks(chunks, flat_theta.shape[0], m, generator=generator)
    ranks = draws.ranks.reshape(*lead, n, d + 1)
    summary = summarize_ranks(
        rank_histogram(ranks, m),
        level=level,
        num_bins=num_bins,
        num_ecdf_points=num_ecdf_points,
        global_method=global_method,
    )
    prior_variance = theta.double().var(-2)
    mean_error = draws.mean_error.reshape(*lead, n, d)
    variance = draws.variance.reshape(*lead, n, d)
    sharp = sharpness(
        (mean_error**2).mean(-2), variance.mean(-2), prior_variance, min(m, MOMENT_DRAWS)
    )
    joint = "energy" if log_prob_samples is not None and log_prob_theta is not None else "distance"
    return RankCalibrationResult.from_summary(summary, sharp, joint_statistic=joint)
