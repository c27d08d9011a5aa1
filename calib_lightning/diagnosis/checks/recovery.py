"""Recovery in ``cl.diagnose``: posterior means against the truths, z-scores and contraction
(a picture of accuracy and sharpness, not a calibration test)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from calib_lightning.diagnosis._check import Check, FigureInputs, Inputs, Outcome
from calib_lightning.evaluation import draws
from calib_lightning.functional.recovery import recovery
from calib_lightning.posteriors.base import Posterior

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["RecoveryCheck"]


class RecoveryCheck(Check):
    """:func:`~calib_lightning.functional.recovery` of the shared draws."""

    name = "recovery"
    title = "Recovery (posterior mean vs truth, z-scores)"
    words = "recovery"
    stream = 5
    draws = True
    in_overall = False

    def run(self, posterior: Posterior, inputs: Inputs, common: Any, outcome: Outcome) -> Any:
        return recovery(draws(posterior, inputs.x, inputs.num_posterior_samples), inputs.theta)

    def row(self, row: dict[str, Any], result: Any) -> dict[str, Any]:
        return {**row, "verdict": "see figures"}

    def figures(self, result: Any, inputs: FigureInputs) -> dict[str, Figure]:
        from calib_lightning.plots.recovery import plot_recovery, plot_z_score_contraction

        chosen = {"labels": inputs.labels, "parameters": inputs.parameters}
        tests = dict(inputs.global_tests)  # what the z-scores are read beside
        return {
            "recovery_mean_vs_truth": plot_recovery(result, **chosen),
            "recovery_z_score_vs_contraction": plot_z_score_contraction(
                result, **chosen, calibration_tests=tests or None, level=inputs.level
            ),
        }

    def caption(self, key: str) -> str | None:
        if key == "recovery_z_score_vs_contraction":
            return (
                "Recovery: posterior z-score against contraction (the posterior means' "
                "errors against the posterior widths; not a calibration test)"
            )
        return "Recovery: mean vs truth" if key == "recovery_mean_vs_truth" else None
