"""Typed results of rank calibration (:mod:`calib_lightning.functional.sbc`).

:class:`RankSummary` is what :func:`~calib_lightning.functional.summarize_ranks` returns
from a rank histogram; :class:`RankCalibrationResult` adds where the curves leave their
band and the sharpness, and is what :func:`~calib_lightning.functional.rank_calibration`
and :class:`calib_lightning.RankCalibration` return.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, NamedTuple

from torch import Tensor

from calib_lightning.results import Result

__all__ = ["RankCalibrationResult", "RankSummary", "Sharpness"]


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
    logged = ("global_p_value", "p_value", "coverage_error", "num_pairs",
              "marginal_p_values", "ecdf_p_values")  # fmt: skip

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
        outside = ((deviation < simultaneous[0] - 1e-12)
                   | (deviation > simultaneous[1] + 1e-12)).any(-1)  # fmt: skip
        parts = {f.name: getattr(summary, f.name) for f in fields(summary)}
        return cls(**parts, outside_band=outside, **sharpness._asdict(), **pairs)
