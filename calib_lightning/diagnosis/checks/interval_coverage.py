"""Central credible intervals in ``cl.diagnose``: does each parameter's 50 % and 90 %
interval cover the truth as often as it claims? (Runs when named in ``checks``.)"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from calib_lightning.diagnosis._check import Check, Direction, Inputs, Outcome
from calib_lightning.metrics.interval_coverage import IntervalCoverage
from calib_lightning.posteriors.base import Posterior

__all__ = ["IntervalCoverageCheck"]


class IntervalCoverageCheck(Check):
    """:class:`~calib_lightning.IntervalCoverage` on the shared draws: an exact binomial
    test per level and parameter, Holm-combined."""

    name = "interval_coverage"
    title = "Interval coverage (central credible intervals, per parameter)"
    words = "the interval-coverage test"
    stream = 15
    draws = True
    default = False

    def run(self, posterior: Posterior, inputs: Inputs, common: Any, outcome: Outcome) -> Any:
        metric = IntervalCoverage(num_posterior_samples=inputs.num_posterior_samples)
        metric.update(posterior, inputs.theta, inputs.x)
        return metric.compute()

    def size(self, result: Any, directions: Sequence[Direction], level: float) -> str:
        """The level and parameter whose coverage is furthest from what it should be."""
        gap = result.coverage_error.abs()
        row, column = divmod(int(gap.argmax()), gap.shape[1])
        return (
            f"largest gap: parameter {column}'s {float(result.levels[row]):.0%} intervals "
            f"cover {float(result.coverage[row, column]):.3f} of the truths (expected "
            f"{float(result.expected[row]):.3f}, exact with these draws)"
        )
