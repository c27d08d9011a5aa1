"""The prior-support check in ``cl.diagnose``: posterior draws outside the prior's support,
where the true posterior puts none (exact: one draw outside rejects)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from calib_lightning._utils.prior import outside_support
from calib_lightning.diagnosis._check import Check, Direction, Inputs, ObservationList, Outcome
from calib_lightning.evaluation import draws
from calib_lightning.metrics import PriorSupport
from calib_lightning.posteriors.base import Posterior

__all__ = ["SupportCheck"]


class SupportCheck(Check):
    """:class:`~calib_lightning.PriorSupport` on the shared draws; the leakage at each
    observation beside it (not part of the verdict: observations need not be simulator
    outputs)."""

    name = "support"
    title = "Prior support (posterior draws outside it; none if exact)"
    words = "the prior-support check"
    stream = 11
    draws = True
    needs_prior = True
    exact = True
    remedy = (
        "The draws outside the support can be removed: "
        "<code>cl.recalibrate(posterior, theta_val, x_val, prior=prior)</code> restricts the "
        "posterior to the prior's support and renormalizes it "
        "(<code>cl.TruncatedPosterior</code>); the true posterior has no mass outside, so its "
        "expected NLL can only fall."
    )

    def run(self, posterior: Posterior, inputs: Inputs, common: Any, outcome: Outcome) -> Any:
        m = inputs.num_posterior_samples
        metric = PriorSupport(inputs.prior, num_posterior_samples=m)
        metric.update(posterior, inputs.theta, inputs.x)
        result = metric.compute()
        if inputs.observations is None:
            return result
        at = outside_support(inputs.prior, draws(posterior, inputs.observations, m))
        return dataclasses.replace(result, observation_leakage=at.float().mean(0))

    def finding(self, result: Any, observations: ObservationList | None, level: float) -> str:
        return (
            f"{float(result.statistic):.1%} of its draws at the calibration x lie outside "
            "the prior's support, where the true posterior puts none"
        )

    def size(self, result: Any, directions: Sequence[Direction], level: float) -> str:
        text = (
            f"{float(result.statistic):.2%} of {int(result.num_draws)} draws outside the "
            f"prior's support (at most {float(result.leakage.max()):.0%} of a pair's)"
        )
        at = result.observation_leakage
        if at is not None:
            text += f"; at the observations {float(at.min()):.0%}-{float(at.max()):.0%}"
        return text
