"""KCCSD in ``cl.diagnose``: the kernel calibration test on scores, no sampling."""

from __future__ import annotations

from typing import Any

from calib_lightning.diagnosis._check import Check, Inputs, Outcome
from calib_lightning.metrics import KCCSD
from calib_lightning.posteriors.base import Posterior

__all__ = ["KCCSDCheck"]


class KCCSDCheck(Check):
    """:class:`~calib_lightning.KCCSD` at its defaults with the diagnosis seed (its base
    points come from ``theta``'s moments: common to every posterior diagnosed)."""

    name = "kccsd"
    title = "KCCSD (kernel calibration test, scores only)"
    words = "KCCSD"
    stream = 2
    needs = "score"
    posteriors = "any"

    def skip_reason(self, posterior: Posterior, inputs: Inputs, by_default: bool) -> str | None:
        reason = super().skip_reason(posterior, inputs, by_default)
        if reason is None and by_default and "score" in posterior.costly:
            return (
                f"left out by default: the score of this {type(posterior).__name__} "
                "differentiates an ODE solve at every point (minutes at N = 1,000 on a CPU); "
                "pass checks with 'kccsd' to run it"
            )
        return reason

    def run(self, posterior: Posterior, inputs: Inputs, common: Any, outcome: Outcome) -> Any:
        metric = KCCSD(seed=inputs.seed)
        metric.update(posterior, inputs.theta, inputs.x)
        return metric.compute()
