"""The figures of a diagnosis: the package's plots of each check's typed result."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from matplotlib.figure import Figure

from calib_lightning.diagnosis._verdict import LOCAL_TESTS, NAMES
from calib_lightning.plots.importance import plot_importance_coverage
from calib_lightning.plots.lc2st import MAX_MAP_PARAMETERS, plot_pp, plot_probability_map
from calib_lightning.plots.misspecification import plot_misspecification
from calib_lightning.plots.ranks import (
    plot_expected_coverage,
    plot_rank_ecdf,
    plot_rank_histograms,
)
from calib_lightning.plots.recovery import plot_recovery, plot_z_score_contraction
from calib_lightning.plots.tarp import plot_tarp

__all__ = ["draw_figures"]

#: the checks of calibration over all pairs, named beside the z-score figure
_GLOBAL_TESTS = ("kccsd", "ranks", "tarp", "joint_c2st", "support", "coverage_is", "balance")


def draw_figures(
    checks: Mapping[str, Any], level: float, labels: Sequence[str] | None = None,
    parameters: Sequence[int] | None = None, probability_maps: Any = None,
    adjusted_p_values: Sequence[float] | None = None,
) -> dict[str, Figure]:
    """Figure key (``{check}_{figure}``) -> figure, for the checks that ran; ``labels``
    name all ``D`` parameters, ``parameters`` picks those the per-parameter figures draw.

    With ``probability_maps`` (the :class:`~calib_lightning.metrics.lc2st.ProbabilityMap`
    of L-C2ST-NF's classifier) one ``lc2st_probability_map_<o>`` per observation, its
    PP-plot in the corner, titled with its p-value (and ``adjusted_p_values``, Holm's).
    With ``adjusted_p_values`` the PP-plot panels are judged by them, like the verdict.
    """
    chosen = {"labels": labels, "parameters": parameters}
    out: dict[str, Figure] = {}
    ranks = checks.get("ranks")
    if ranks is not None:
        out["ranks_expected_coverage"] = plot_expected_coverage(ranks)
        out["ranks_ecdf"] = plot_rank_ecdf(ranks, **chosen)
        out["ranks_rank_histograms"] = plot_rank_histograms(ranks, **chosen)
    tarp = checks.get("tarp")
    if tarp is not None:
        out["tarp_coverage"] = plot_tarp(tarp)
    recovery = checks.get("recovery")
    if recovery is not None:
        out["recovery_mean_vs_truth"] = plot_recovery(recovery, **chosen)
        tests = {NAMES[n][0]: float(getattr(checks[n], checks[n].verdict))
                 for n in _GLOBAL_TESTS if n in checks}  # what the z-scores are read beside
        out["recovery_z_score_vs_contraction"] = plot_z_score_contraction(
            recovery, **chosen, calibration_tests=tests or None, level=level)  # fmt: skip
    name = next((n for n in LOCAL_TESTS if n in checks), None)  # the one whose maps were drawn
    if name is not None:
        local = checks[name]
        if adjusted_p_values is None:
            out["lc2st_pp"] = plot_pp(local, level=level)
        else:  # each panel's "rejected" must agree with the verdict's Holm-corrected list
            out["lc2st_pp"] = plot_pp(local, level=level, adjusted_p_values=adjusted_p_values)
        if probability_maps is not None:
            chosen_maps = None if parameters is None else list(parameters)[:MAX_MAP_PARAMETERS]
            for o, (samples, probs) in enumerate(zip(
                    probability_maps.samples, probability_maps.probabilities, strict=True)):
                title = f"{NAMES[name][0]} at observation {o}: p = {float(local.p_value[o]):.3g}"
                if adjusted_p_values is not None:
                    title += f", Holm-adjusted p = {adjusted_p_values[o]:.3g}"
                pp = (local.pp_grid, local.pp_ecdf[o], local.pp_band[:, o])
                out[f"lc2st_probability_map_{o}"] = plot_probability_map(
                    samples, probs, labels=labels, parameters=chosen_maps, pp=pp, title=title)
    coverage = checks.get("coverage_is")
    if coverage is not None:
        out["coverage_is_expected_coverage"] = plot_importance_coverage(coverage, level=level)
    misspec = checks.get("misspecification")
    if misspec is not None:
        out["misspecification_scores"] = plot_misspecification(misspec, level=level)
    return out
