"""The importance-sampled coverage test in ``cl.diagnose``: the coverage question for a
posterior known up to a constant, and the directions its one-sided tests find."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from calib_lightning.diagnosis._check import Check, Direction, FigureInputs, Inputs, Outcome
from calib_lightning.diagnosis.checks.ranks import one_sided
from calib_lightning.functional.direction import credibility_mean_test
from calib_lightning.metrics import ImportanceCoverage
from calib_lightning.posteriors.base import Posterior, UnsupportedError

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["COVERAGE_IS_SAMPLES", "CoverageISCheck"]

#: draws per pair of the importance-sampled coverage (below an ESS of 50 it cannot judge)
COVERAGE_IS_SAMPLES = 4000


class CoverageISCheck(Check):
    """:class:`~calib_lightning.ImportanceCoverage` from the prior, or the adaptive proposal
    where the prior's ESS is too small (the proposal is blind to the true theta: the level
    holds)."""

    name = "coverage_is"
    title = "Importance-sampled coverage (a posterior known up to a constant)"
    words = "the importance-sampled coverage test"
    figure_words = "the expected-coverage figure"
    stream = 13
    posteriors = "unnormalized"

    def run(self, posterior: Posterior, inputs: Inputs, common: Any, outcome: Outcome) -> Any:
        for proposal in (None, "adaptive"):
            metric = ImportanceCoverage(COVERAGE_IS_SAMPLES, proposal, seed=inputs.seed)
            metric.update(posterior, inputs.theta, inputs.x)
            result = metric.compute()
            if result.cannot_judge is None:
                return result
        raise UnsupportedError(
            f"could not judge: with the prior and the adaptive proposal "
            f"({COVERAGE_IS_SAMPLES} draws a pair) the median effective "
            f"sample size is {float(result.ess_median):.1f} < 50"
        )

    def directions(
        self, result: Any, level: float, labels: Sequence[str] | None
    ) -> list[Direction]:
        """The two one-sided tests of the mean credibility: above 1/2 the regions miss the
        truth too often (over-confident, or a shift: it reads the same), below too rarely."""
        if result.cannot_judge is not None or result.credibility.numel() < 2:
            return []
        test = credibility_mean_test(result.credibility)
        p, half = one_sided(test, level)
        words = ("over-confident or biased", "under-confident")
        return [
            Direction(
                words[side],
                None,
                -float(test.offset),
                float(half[0]),
                float(p[0, side]),
                float("nan"),
                False,
                self.name,
            )
            for side in range(2)
        ]

    def size(self, result: Any, directions: Sequence[Direction], level: float) -> str:
        tested = [d for d in directions if d.check == self.name]
        named = [d.words for d in tested if d.named]
        error = f"coverage error {float(result.coverage_error):+.3f}"
        error = tested[0].size() if tested else error
        reading = f" ({named[0]})" if named else ""
        return f"{error}{reading}; median effective sample size {float(result.ess_median):.0f}"

    def figures(self, result: Any, inputs: FigureInputs) -> dict[str, Figure]:
        from calib_lightning.plots.importance import plot_importance_coverage

        return {
            "coverage_is_expected_coverage": plot_importance_coverage(result, level=inputs.level)
        }

    def caption(self, key: str) -> str | None:
        if key == "coverage_is_expected_coverage":
            return "Importance-sampled coverage: expected coverage"
        return None

    def coverage_errors(self, result: Any) -> dict[str, tuple[str, float]]:
        return {
            "is_signed_area": (
                "Importance-sampled coverage: signed area (negative = over-confident)",
                float(result.coverage_error),
            )
        }
