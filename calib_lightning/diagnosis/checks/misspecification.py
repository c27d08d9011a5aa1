"""The misspecification test in ``cl.diagnose``: does an observation look like the
simulator's outputs? (Needs no posterior; Holm-corrected over the observations.)"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from calib_lightning.diagnosis._check import (
    Check,
    Direction,
    FigureInputs,
    Inputs,
    ObservationList,
    Outcome,
    observation_list,
    observations_phrase,
)
from calib_lightning.misspecification import misspecification_test
from calib_lightning.posteriors.base import Posterior

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["MisspecificationCheck"]


class MisspecificationCheck(Check):
    """:func:`~calib_lightning.misspecification_test` of the observations against the
    calibration ``x``, with Holm's correction (its row and its list agree)."""

    name = "misspecification"
    title = "Misspecification (observation vs simulations)"
    words = "the misspecification test"
    figure_words = "the misspecification figure"
    stream = 7
    at_observations = True
    posteriors = "any"
    in_overall = False
    gated_by_overall = False

    def skip_reason(self, posterior: Posterior, inputs: Inputs, by_default: bool) -> str | None:
        return None  # it reads the observations and x only

    def run(self, posterior: Posterior, inputs: Inputs, common: Any, outcome: Outcome) -> Any:
        assert inputs.observations is not None
        return misspecification_test(
            inputs.observations,
            inputs.x,
            embedding=inputs.embedding,
            seed=inputs.seed,
            global_method="holm",
        )

    def observation_list(self, result: Any, level: float, gate: bool) -> ObservationList:
        return observation_list(self.name, result, level, gate)

    def tail(
        self, observations: ObservationList, level: float, cannot_reject: bool
    ) -> tuple[str, str]:
        """``(phrase, note)`` after the verdict's head: the observations outside the
        simulator, or why none can be named."""
        if observations.named:
            verb = "looks" if len(observations.named) == 1 else "look"
            smallest = min(observations.adjusted_p_value[o] for o in observations.named)
            sign = "=" if len(observations.named) == 1 else ">="
            return (
                f"{observations_phrase(observations.named)} {verb} outside the simulator "
                f"(Holm-adjusted p {sign} {smallest:.2g})"
            ), ""
        if not cannot_reject and not observations.can_reject:
            return "", (
                f"no single observation can be called outside the simulator with "
                f"{len(observations.p_value)} observations (smallest Holm-adjusted "
                f"p-value {observations.smallest_adjusted:.2g})"
            )
        return "", ""

    def cannot_reject(self, result: Any, smallest: float, level: float) -> str:
        single, count = float(result.smallest_p_value), result.p_value.numel()
        size = (
            f"{self.words} cannot reject with {result.num_simulations} simulations "
            f"({result.num_calibration} for calibration)"
        )
        if smallest > single:  # Holm over the observations
            return (
                f"{size} and {count} observations: smallest p-value "
                f"1/{result.num_calibration + 1} = {single:.2g}, {smallest:.2g} after "
                f"Holm's correction, not below {level:g}"
            )
        return (
            f"{size}: smallest p-value 1/{result.num_calibration + 1} = {single:.2g}, not "
            f"below {level:g}"
        )

    def size(self, result: Any, directions: Sequence[Direction], level: float) -> str:
        return (
            f"smallest p {float(result.p_value.min()):.3g} over {result.p_value.shape[0]} "
            f"observations (attainable: {result.smallest_p_value:.2g})"
        )

    def figures(self, result: Any, inputs: FigureInputs) -> dict[str, Figure]:
        from calib_lightning.plots.misspecification import plot_misspecification

        return {"misspecification_scores": plot_misspecification(result, level=inputs.level)}

    def caption(self, key: str) -> str | None:
        return "Misspecification: scores" if key == "misspecification_scores" else None
