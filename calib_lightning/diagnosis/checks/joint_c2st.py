"""The joint classifier test in ``cl.diagnose``: the one global check that sees a posterior
ignoring ``x``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from calib_lightning.diagnosis._check import Check, Direction, Inputs, Outcome
from calib_lightning.metrics import JointC2ST
from calib_lightning.posteriors.base import Posterior

__all__ = ["JointC2STCheck"]


class JointC2STCheck(Check):
    """:class:`~calib_lightning.JointC2ST` on the shared draws with the diagnosis seed."""

    name = "joint_c2st"
    title = "Joint classifier test (theta and x together; sees a posterior ignoring x)"
    words = "the joint classifier test"
    stream = 9
    draws = True

    def skip_reason(self, posterior: Posterior, inputs: Inputs, by_default: bool) -> str | None:
        n, m = inputs.theta.shape[0], inputs.num_posterior_samples
        if n < 4 or m < 2:
            return (
                "the joint classifier test needs N >= 4 pairs and num_posterior_samples "
                f">= 2, got N = {n} and {m}"
            )
        return super().skip_reason(posterior, inputs, by_default)

    def run(self, posterior: Posterior, inputs: Inputs, common: Any, outcome: Outcome) -> Any:
        metric = JointC2ST(num_posterior_samples=inputs.num_posterior_samples, seed=inputs.seed)
        metric.update(posterior, inputs.theta, inputs.x)
        return metric.compute()

    def size(self, result: Any, directions: Sequence[Direction], level: float) -> str:
        return (
            f"mean conformal rank {float(result.mean_rank):.3f} over {result.ranks.numel()} "
            "held-out pairs (0.5 if calibrated)"
        )
