"""TARP in ``cl.diagnose``: expected coverage from random references, on the shared draws."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from calib_lightning.diagnosis._check import Check, Direction, FigureInputs, Inputs, Outcome
from calib_lightning.evaluation import draws
from calib_lightning.functional.tarp import pooled_values, tarp_box, tarp_fit_scale
from calib_lightning.metrics import TARP
from calib_lightning.posteriors.base import Posterior

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["TARPCheck"]


class TARPCheck(Check):
    """:class:`~calib_lightning.TARP` with the diagnosis seed; before and after a fix, the
    reference box and scale are fitted on the pooled values of both posteriors (a function
    of each posterior's unordered values, so exact for each), so both get the same
    references."""

    name = "tarp"
    title = "TARP (coverage from random references)"
    words = "TARP"
    figure_words = "the TARP coverage figure"
    stream = 4
    draws = True

    def common(self, inputs: Inputs, posteriors: Sequence[Posterior]) -> Any:
        if len(posteriors) < 2:
            return None  # the metric fits its own box and scale
        m = inputs.num_posterior_samples
        values = torch.cat(
            [
                pooled_values(draws(p, inputs.x, m).double(), inputs.theta.double())
                for p in posteriors
            ]
        )
        return tarp_box(values, inputs.theta.shape[0]), tarp_fit_scale(values)

    def run(self, posterior: Posterior, inputs: Inputs, common: Any, outcome: Outcome) -> Any:
        box, scale = common if common is not None else (None, None)
        metric = TARP(
            num_posterior_samples=inputs.num_posterior_samples,
            level=inputs.level,
            seed=inputs.seed,
            reference_bounds=box,
            scale=scale,
        )
        metric.update(posterior, inputs.theta, inputs.x)
        return metric.compute()

    def size(self, result: Any, directions: Sequence[Direction], level: float) -> str:
        return (
            f"largest coverage gap {float(result.statistic):.3f} (band "
            f"{float(result.band):.3f}); ATC {float(result.coverage_error):+.3f}"
        )

    def figures(self, result: Any, inputs: FigureInputs) -> dict[str, Figure]:
        from calib_lightning.plots.tarp import plot_tarp

        return {"tarp_coverage": plot_tarp(result)}

    def caption(self, key: str) -> str | None:
        return "TARP: coverage" if key == "tarp_coverage" else None

    def coverage_errors(self, result: Any) -> dict[str, tuple[str, float]]:
        return {"tarp_atc": ("TARP: signed area (ATC)", float(result.coverage_error))}
