"""Rank calibration (SBC) in ``cl.diagnose``: marginal and joint ranks on the shared draws,
and the directions the one-sided rank-mean tests find."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from calib_lightning.diagnosis._check import Check, Direction, FigureInputs, Inputs, Outcome
from calib_lightning.functional.direction import rank_mean_test
from calib_lightning.metrics import RankCalibration
from calib_lightning.posteriors.base import Posterior

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["RanksCheck", "one_sided"]


def one_sided(test: Any, level: float) -> tuple[Any, Any]:
    """``(p, half)``: the one-sided p-values ``(K, 2)`` (mean above 1/2, below) of a
    :class:`~calib_lightning.functional.direction.RankMeanTest` and the half-widths of
    the ``1 - level`` intervals ``(K,)``."""
    import torch
    from scipy import stats

    p = torch.stack([test.p_greater, test.p_less], -1).reshape(-1, 2)
    quantile = stats.t.ppf(1 - level / 2, test.num_pairs.reshape(-1).cpu().numpy() - 1)
    return p, test.standard_error.reshape(-1).cpu().numpy() * quantile


class RanksCheck(Check):
    """:class:`~calib_lightning.RankCalibration` on the shared draws (the energy rank for a
    posterior with a cheap ``log_prob``, else the distance rank)."""

    name = "ranks"
    title = "Rank calibration (SBC, marginal and joint)"
    words = "the rank tests"
    figure_words = "the expected-coverage, rank ECDF and histogram figures"
    stream = 3
    draws = True

    def run(self, posterior: Posterior, inputs: Inputs, common: Any, outcome: Outcome) -> Any:
        metric = RankCalibration(
            num_posterior_samples=inputs.num_posterior_samples, level=inputs.level
        )
        metric.update(posterior, inputs.theta, inputs.x)
        return metric.compute()

    def directions(
        self, result: Any, level: float, labels: Sequence[str] | None
    ) -> list[Direction]:
        """The ``2 (D + 1)`` one-sided rank-mean tests: the joint (HPD) rank for over- or
        under-confidence first, then each marginal rank for a posterior too low or high."""
        test = rank_mean_test(result.histogram)  # each (D + 1,): marginal rows, then joint
        p, half = one_sided(test, level)
        num_dims = p.shape[0] - 1
        out = []
        for row in (num_dims, *range(num_dims)):
            joint = row == num_dims
            for side in range(2):  # 0: mean rank above 1/2, 1: below
                if joint:
                    words = "over-confident" if side == 0 else "under-confident"
                    estimate = -float(test.offset[row])  # the coverage error
                else:
                    name = labels[row] if labels is not None else f"parameter {row}"
                    where = "too low" if side == 0 else "too high"
                    words = f"biased in {name}: posterior {where}"
                    estimate = 0.5 + float(test.offset[row])
                out.append(
                    Direction(
                        words,
                        None if joint else row,
                        estimate,
                        float(half[row]),
                        float(p[row, side]),
                        float("nan"),
                        False,
                        self.name,
                    )
                )
        return out

    def size(self, result: Any, directions: Sequence[Direction], level: float) -> str:
        joint = [d for d in directions if d.check == self.name and d.parameter is None]
        return joint[0].size() if joint else ""

    def figures(self, result: Any, inputs: FigureInputs) -> dict[str, Figure]:
        from calib_lightning.plots.ranks import (
            plot_expected_coverage,
            plot_rank_ecdf,
            plot_rank_histograms,
        )

        chosen = {"labels": inputs.labels, "parameters": inputs.parameters}
        return {
            "ranks_expected_coverage": plot_expected_coverage(result),
            "ranks_ecdf": plot_rank_ecdf(result, **chosen),
            "ranks_rank_histograms": plot_rank_histograms(result, **chosen),
        }

    def caption(self, key: str) -> str | None:
        prefix = "ranks_"
        return (
            f"Rank calibration: {key[len(prefix) :].replace('_', ' ')}"
            if key.startswith(prefix)
            else None
        )

    def coverage_errors(self, result: Any) -> dict[str, tuple[str, float]]:
        return {
            "hpd_signed_area": (
                "HPD expected coverage: signed area (negative = over-confident)",
                float(result.coverage_error),
            ),
            "hpd_largest_gap": (
                "HPD expected coverage: largest gap to the diagonal",
                float((result.coverage - result.levels).abs().max()),
            ),
        }

    def overlay(self, before: Any, after: Any) -> tuple[str, str, Figure] | None:
        from calib_lightning.plots.ranks import plot_expected_coverage

        caption = (
            "Rank calibration: expected coverage, before (dashed) and after (solid) on "
            "the same axes"
        )
        figure = plot_expected_coverage(after, before=before)
        return "ranks_expected_coverage_before_after", caption, figure
