"""The balance test in ``cl.diagnose``: is a ratio estimator's classifier balanced, the
condition that keeps BNRE from over-confidence?"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from calib_lightning.diagnosis._check import Check, Direction, Inputs, Outcome
from calib_lightning.metrics import RatioBalance
from calib_lightning.posteriors.base import Posterior

__all__ = ["BalanceCheck"]


class BalanceCheck(Check):
    """:class:`~calib_lightning.RatioBalance`; by default only for a ratio estimator (sbi's,
    lampe's, or one declared with ``kind="ratio"``)."""

    name = "balance"
    title = "Balance (a ratio estimator's classifier)"
    words = "the balance test"
    stream = 14
    posteriors = "unnormalized"

    def skip_reason(self, posterior: Posterior, inputs: Inputs, by_default: bool) -> str | None:
        reason = super().skip_reason(posterior, inputs, by_default)
        if reason is None and by_default and getattr(posterior, "kind", None) != "ratio":
            return (
                "needs a ratio estimator (sbi's NRE_A/B/C or BNRE, lampe's NRE); for a "
                "log-ratio callable f in cl.UnnormalizedPosterior(f, prior, kind='ratio'), "
                "or name 'balance' in checks"
            )
        return reason

    def run(self, posterior: Posterior, inputs: Inputs, common: Any, outcome: Outcome) -> Any:
        metric = RatioBalance()
        metric.update(posterior, inputs.theta, inputs.x)
        return metric.compute()

    def size(self, result: Any, directions: Sequence[Direction], level: float) -> str:
        return (
            f"balance {float(result.statistic):+.4f}, 95 % "
            f"interval [{float(result.lower):+.4f}, {float(result.upper):+.4f}] "
            "(0 for a balanced classifier)"
        )
