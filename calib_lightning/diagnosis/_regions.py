"""Conformal credible regions in a diagnosis: the calibrated level at each observation.

``cl.diagnose(..., region=cl.ConformalRegion(posterior).fit(theta_val, x_val))`` adds,
for each observation, the credibility at which the posterior's HPD region covers
:data:`REGION_LEVEL` of new pairs (the nominal level, when the posterior is calibrated
there) and, with reference samples, the share of them inside the posterior's own HPD
region at that nominal level and inside the calibrated region: how far each is from
:data:`REGION_LEVEL` at that observation. The report draws both regions
(:func:`~calib_lightning.plots.plot_conformal_region`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch import Tensor

from calib_lightning.diagnosis._html import table

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["REGION_LEVEL", "RegionSummary", "summarize_region"]

#: the nominal coverage of the regions a diagnosis reports
REGION_LEVEL = 0.9


@dataclass
class RegionSummary:
    """What a diagnosis reports of a :class:`~calib_lightning.ConformalRegion`.

    Attributes:
        region: the fitted region.
        observations: ``(O, *X)``.
        reference_samples: ``(S_ref, O, D)`` or ``None``.
        calibrated_level: the calibrated credibility at each observation, ``(O,)``.
        nominal_coverage: share of the reference samples in the posterior's own HPD
            region at :data:`REGION_LEVEL`, ``(O,)``; ``None`` without reference samples.
        calibrated_coverage: the same for the calibrated region; ``None`` without them.
        dim: ``D``; with one parameter there are no region figures.
    """

    region: Any
    observations: Tensor
    reference_samples: Tensor | None
    calibrated_level: list[float]
    nominal_coverage: list[float] | None
    calibrated_coverage: list[float] | None
    dim: int = 2

    def rows(self) -> list[dict[str, Any]]:
        """One JSON-ready dict per observation."""
        out = []
        for o, value in enumerate(self.calibrated_level):
            row: dict[str, Any] = {
                "observation": o,
                "nominal_level": REGION_LEVEL,
                "calibrated_level": value,
            }
            if self.nominal_coverage is not None and self.calibrated_coverage is not None:
                row["reference_in_nominal_region"] = self.nominal_coverage[o]
                row["reference_in_calibrated_region"] = self.calibrated_coverage[o]
            out.append(row)
        return out

    def html(self) -> str:
        """The report's section: a table per observation and how to read it."""
        reference = self.nominal_coverage is not None
        header = ["observation", f"calibrated credibility of the {REGION_LEVEL:.0%} region"]
        if reference:
            header += [
                f"reference in the nominal {REGION_LEVEL:.0%} HPD region",
                "reference in the calibrated region",
            ]
        cells = []
        for row in self.rows():
            cell = [str(row["observation"]), f"{row['calibrated_level']:.3f}"]
            if reference:
                cell += [
                    f"{row['reference_in_nominal_region']:.3f}",
                    f"{row['reference_in_calibrated_region']:.3f}",
                ]
            cells.append(cell)
        n = 0 if self.region.scores is None else self.region.scores.numel()
        exact = (
            "With reference samples, the last two columns are the exact posterior mass of "
            f"each region at the observation ({REGION_LEVEL:g} is right)."
            if reference
            else ""
        )
        return f"""<h2>Calibrated credible regions</h2>
<p class="note">A conformal region ({self.kind()}, calibrated on {n} held-out pairs) takes the
posterior's HPD region at the credibility below, instead of {REGION_LEVEL:g}: it covers the
true parameter of new pairs with probability at least {REGION_LEVEL:g} (marginally over x).
Above {REGION_LEVEL:g}: the posterior is over-confident there; below: under-confident.
{exact}</p>
{table(header, cells)}"""

    def kind(self) -> str:
        """How the region sets its levels: one for all x, or per leaf of which tree."""
        region = self.region
        if not region.local:
            return "one level for all x"
        over = "a summary of the posterior at x" if region.embedding == "posterior" else "x"
        if region.partition == "regression":
            return f"a level from a linear location-scale regression of the scores on {over}"
        grown = int(region.tree.tree_.n_node_samples[0])  # the pairs the tree was fitted on
        return f"one level per leaf of a tree over {over}, grown on {grown} other pairs"

    def figures(
        self, parameters: Sequence[int] | None = None, labels: Sequence[str] | None = None
    ) -> dict[str, Figure]:
        """``conformal_region_<o>``: both regions at each observation (the first two of
        ``parameters`` when ``D > 2``, axes named by ``labels``); none when ``D = 1``."""
        from calib_lightning.plots.conformal import plot_conformal_region

        if self.dim < 2:
            return {}
        chosen = (0, 1) if parameters is None or len(parameters) < 2 else tuple(parameters[:2])
        out = {}
        for o in range(self.observations.shape[0]):
            reference = None if self.reference_samples is None else self.reference_samples[:, o]
            out[f"conformal_region_{o}"] = plot_conformal_region(
                self.region,
                self.observations[o : o + 1],
                level=REGION_LEVEL,
                reference=reference,
                parameters=chosen,
                labels=labels,
            )
        return out


def summarize_region(
    region: Any, observations: Tensor | None, reference_samples: Tensor | None, dim: int
) -> RegionSummary:
    """The :class:`RegionSummary` of a fitted ``region`` at the observations; a
    ``ValueError`` names ``region`` when it is not a fitted ``ConformalRegion`` of ``dim``
    parameters or there are no observations."""
    from calib_lightning.recalibration.conformal import ConformalRegion

    if not isinstance(region, ConformalRegion):
        raise ValueError(f"region must be a fitted cl.ConformalRegion, got {type(region).__name__}")
    if region.scores is None:
        raise ValueError(
            "region must be fitted (ConformalRegion(...).fit(theta_val, x_val)) "
            "before diagnose reports it, got an unfitted region"
        )
    if observations is None:
        raise ValueError("region needs observations to report its levels at, got observations=None")
    x = observations
    level = region.calibrated_level(REGION_LEVEL, x)  # (O,): a credibility at each x
    nominal = calibrated = None
    if reference_samples is not None:
        reference = reference_samples.to(x.device)
        credibility = region.credibility(reference, x)  # (S_ref, O)
        nominal = (credibility < REGION_LEVEL).double().mean(0).tolist()
        inside = (
            region.contains(reference, x, REGION_LEVEL)
            if region.conformity == "log_density"
            else credibility < level.to(credibility)
        )  # (exact there)
        calibrated = inside.double().mean(0).tolist()
    return RegionSummary(
        region, x, reference_samples, level.double().tolist(), nominal, calibrated, dim
    )
