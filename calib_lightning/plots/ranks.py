r"""Figures of simulation-based calibration: rank histograms, ECDF - t curves, coverage.

Each function takes the dict of :class:`calib_lightning.RankCalibration` ``.compute()``
(or :func:`calib_lightning.functional.rank_calibration`) and returns a
:class:`matplotlib.figure.Figure`; every figure says on its face how to read it:

* :func:`plot_rank_histograms`: one histogram per dimension and one for the joint
  energy rank, with the band a calibrated posterior's bars stay in;
* :func:`plot_rank_ecdf`: :math:`\mathrm{ECDF}(t) - t` of every dimension and of the
  joint rank, with the simultaneous band (the test) and the pointwise band;
* :func:`plot_expected_coverage`: coverage of the highest-density credible regions
  against their level, with over- and under-confident regions labelled.

Directions are read by the package's one convention (``Reading the sign`` in
:mod:`calib_lightning.functional.sbc`): on the joint curve and the coverage curve,
below 0 / below the diagonal = over-confident, above = under-confident; marginal curves
by their shape. p-values print as ``p < 2.2e-308`` at the analytic floor, never as 0.

References:
    Talts et al. (2018), "Validating Bayesian inference algorithms with
    simulation-based calibration"; Säilynoja, Bürkner, Vehtari (2022), "Graphical
    test for discrete uniformity ..."; seed 004 ("validation of SBI").
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from matplotlib.figure import Figure
from scipy import stats
from torch import Tensor

from calib_lightning._utils.validation import check_positive
from calib_lightning.functional.sbc import RankSummary, _binned_counts
from calib_lightning.plots._format import format_p_value
from calib_lightning.plots._grid import (
    MAX_COLUMNS,
    MAX_ROWS,
    check_max_columns,
    heading_and_note,
    outer_labels,
    panel_grid,
    select_parameters,
    worst_first,
)

__all__ = ["plot_expected_coverage", "plot_rank_ecdf", "plot_rank_histograms"]

#: what the joint rank orders by (``RankCalibrationResult.joint_statistic``): the energy
#: ``-log q`` where the posterior has a density, else the standardized distance to the
#: centre of the pair's points (samples-only posteriors, vector fields)
_REGION = {"energy": "HPD region", "distance": "central region (standardized distance)"}
_BAND_COLOR, _POINTWISE_COLOR = "0.82", "0.35"
_NOTE = {"fontsize": 7.5, "color": "0.2", "va": "top"}
_MAX_COLOURED = 10  # distinct colours of the ECDF figure


def _get(result: RankSummary, *names: str) -> list[Tensor]:
    missing = [n for n in names if not isinstance(getattr(result, n, None), Tensor)]
    if missing:
        raise ValueError(
            "result must be a RankSummary (summarize_ranks, rank_calibration, "
            f"RankCalibration.compute()); missing fields {missing}"
        )
    return [getattr(result, n).detach().cpu() for n in names]


def _joint(result: RankSummary) -> str:
    """``"energy"`` or ``"distance"``: the joint rank's statistic (energy if not said)."""
    return getattr(result, "joint_statistic", None) or "energy"


def _outside(dev: np.ndarray, band: np.ndarray) -> np.ndarray:
    """``(R,)`` bool: the curve ``dev`` ``(R, K)`` leaves the simultaneous band ``(2, K)``."""
    return ((dev < band[0] - 1e-12) | (dev > band[1] + 1e-12)).any(-1)


def plot_rank_histograms(
    result: RankSummary,
    *,
    labels: Sequence[str] | None = None,
    parameters: Sequence[int] | None = None,
    max_columns: int = MAX_COLUMNS,
    panel_size: tuple[float, float] = (3.0, 2.3),
) -> Figure:
    r"""Rank histograms, one panel per dimension and one for the joint energy rank.

    Ranks are grouped into the same ``num_bins`` bins as the chi-square test. The grey
    band holds every bar of a calibrated posterior with probability at least
    :math:`1 - \alpha` (binomial quantiles at level :math:`\alpha / B` per bin,
    Bonferroni over the ``B`` bins). Bars show observed / expected counts (bins may
    differ by one rank value), so calibration is the dashed line at 1. Each panel's
    title names its test: ``"θ1  chi-square p = 0.03"`` (the ECDF figure's legend gives
    the ECDF band test of the same ranks, another test with another p-value).

    Panels wrap into rows of ``max_columns``; at most ten rows are drawn, so the figure
    stays bounded at any ``D`` (about 18 x 24 inches at ``D = 50``): beyond 59
    dimensions, the 59 with the smallest chi-square p-values are drawn (in index order)
    unless ``parameters`` picks them, and the title says so. The joint panel comes last.

    Arguments:
        result: a :class:`~calib_lightning.functional.sbc.RankSummary`, e.g.
            ``RankCalibration.compute()`` (fields ``histogram``, ``num_bins``,
            ``level``, ``p_value``, ``marginal_p_values``).
        labels: names of all ``D`` dimensions.
        parameters: indices of the dimensions to draw, in order (default: all, or the
            59 worst).
        max_columns: panels per row.
        panel_size: inches per panel.

    Returns:
        The figure.

    Example:
        >>> import torch
        >>> from calib_lightning.functional import summarize_ranks
        >>> fig = plot_rank_histograms(summarize_ranks(torch.full((3, 10), 30)))
        >>> [ax.get_title().split(" ")[0] for ax in fig.axes]
        ['θ1', 'θ2', 'joint']
        >>> fig = plot_rank_histograms(summarize_ranks(torch.full((3, 10), 30)),
        ...                            labels=["mu", "sigma"], parameters=[1])
        >>> [ax.get_title().split(" ")[0] for ax in fig.axes]
        ['sigma', 'joint']
    """
    hist, num_bins, test_level, p, marginal_p = _get(
        result, "histogram", "num_bins", "level", "p_value", "marginal_p_values"
    )
    if hist.ndim != 2:
        raise ValueError(f"result.histogram must be (D + 1, M + 1), got {tuple(hist.shape)}")
    d, m1, b = hist.shape[0] - 1, hist.shape[1], int(num_bins)
    check_max_columns(max_columns)
    room = max_columns * MAX_ROWS - 1
    shown = ""
    if parameters is None and d > room:
        parameters = worst_first(marginal_p.tolist(), room)
        shown = f"; the {room} of D = {d} dimensions with the smallest chi-square p-values"
    chosen, names = select_parameters(d, parameters, labels)
    counts, edges = _binned_counts(hist, b)
    n = int(hist[0].sum())
    prob = ((edges[1:] - edges[:-1]) / m1).numpy()
    level = float(test_level) / b
    low, high = stats.binom.ppf(level / 2, n, prob), stats.binom.ppf(1 - level / 2, n, prob)
    left = (edges[:-1] / m1).numpy()
    width = ((edges[1:] - edges[:-1]) / m1).numpy()
    fig, axes = panel_grid(
        len(chosen) + 1, panel_size, max_columns=max_columns, min_width=7.0, extra_height=1.3
    )
    expected = n * prob  # bins may differ by one rank value: plot observed / expected
    rows = [*counts[chosen].numpy(), counts[d].numpy()]
    p_values = [*marginal_p[chosen].tolist(), float(p)]
    joint = _joint(result)
    for ax, name, row, pv in zip(axes, [*names, f"joint ({joint})"], rows, p_values, strict=True):
        ax.fill_between(
            [*left, 1.0],
            [*(low / expected), 1],
            [*(high / expected), 1],
            step="post",
            color=_BAND_COLOR,
            lw=0,
        )
        outside = (row < low) | (row > high)
        colors = ["tab:red" if o else "tab:blue" for o in outside]
        ax.bar(left, row / expected, width=width, align="edge", color=colors, alpha=0.8, lw=0)
        ax.axhline(1.0, color="0.3", ls="--", lw=1)
        ax.set_title(f"{name}  chi-square {format_p_value(pv)}", fontsize=9)
        ax.set_xlim(0, 1)
        ax.set_ylim(bottom=0)
    outer_labels(
        axes, max_columns, "rank of the truth / (M + 1)", "observed / expected", locate=False
    )
    heading_and_note(
        fig,
        f"Rank histograms ({b} bins, N = {n}{shown}): flat at 1 = calibrated; "
        f"each title: the chi-square test of its bins\n"
        f"a calibrated posterior keeps all bars in the grey band with prob. ≥ "
        f"{1 - float(test_level):.0%}; red bars lie outside",
        "Per dimension: ∪-shape = posterior too narrow (over-confident); ∩-shape = too "
        "wide (under-confident); mass piled left = posterior too high, right = too low.\n"
        + (
            "Joint (energy): mass on the right = truth less probable than the posterior's "
            "own draws (over-confident or biased); on the left = under-confident."
            if joint == "energy"
            else "Joint (distance): mass on the right = truth farther from the centre than the "
            "posterior's own draws (over-confident or biased); on the left = under-confident."
        ),
    )
    return fig


def plot_rank_ecdf(
    result: RankSummary,
    *,
    labels: Sequence[str] | None = None,
    parameters: Sequence[int] | None = None,
    max_highlighted: int = 5,
    figsize: tuple[float, float] = (10.0, 5.0),
) -> Figure:
    r"""ECDF of the ranks minus the uniform CDF, for every dimension and the joint rank.

    Left panel: the marginal curves; right panel: the joint energy curve. The grey
    area is the simultaneous :math:`1 - \alpha` band (a calibrated curve stays inside
    everywhere with that probability; leaving it is the test's rejection), the dashed
    lines the pointwise band :math:`\pm z_{1-\alpha/2} \sqrt{t (1 - t) / N}` (each point
    alone; a calibrated curve crosses them often).

    Up to six dimensions, every curve is drawn in colour with the p-value of its ECDF
    band test in the legend (``"θ1: ECDF band p = 0.003"``; the rank histograms' titles
    give the chi-square test of the same ranks, a different test with another p-value).
    Beyond, fifty coloured curves would be unreadable: the ``max_highlighted``
    dimensions with the smallest ECDF p-values (or those ``parameters`` picks) are drawn
    in colour and named, every other dimension as a thin grey line behind them (so a
    shared pattern still shows), and the legend says how many of those stay inside
    the band. The per-dimension picture of every parameter is
    :func:`plot_rank_histograms`.

    Arguments:
        result: a :class:`~calib_lightning.functional.sbc.RankSummary`, e.g.
            ``RankCalibration.compute()`` (fields ``levels``, ``ecdf``,
            ``simultaneous_band``, ``pointwise_band``, ``level``, ``ecdf_p_values``).
        labels: names of all ``D`` dimensions.
        parameters: indices of the dimensions drawn in colour (default all when
            ``D <= 6``, else the ``max_highlighted`` worst); a list of more than ten:
            the ``max_highlighted`` worst of them.
        max_highlighted: coloured curves when ``D > 6`` and ``parameters`` is ``None``
            or longer than ten (at most ten).
        figsize: figure size in inches.

    Returns:
        The figure.
    """
    t, ecdf, simultaneous, pointwise, test_level, ecdf_p = _get(
        result,
        "levels",
        "ecdf",
        "simultaneous_band",
        "pointwise_band",
        "level",
        "ecdf_p_values",
    )
    if ecdf.ndim != 2:
        raise ValueError(f"result.ecdf must be (D + 1, K), got {tuple(ecdf.shape)}")
    d = ecdf.shape[0] - 1
    check_positive("max_highlighted", max_highlighted, integer=True)
    if max_highlighted > _MAX_COLOURED:
        raise ValueError(f"max_highlighted must be at most {_MAX_COLOURED}, got {max_highlighted}")
    worst = parameters is None and d > MAX_COLUMNS
    chosen = list(range(d)) if parameters is None else select_parameters(d, parameters, None)[0]
    if worst or len(chosen) > _MAX_COLOURED:
        worst = True
        chosen = [chosen[k] for k in worst_first(ecdf_p[chosen].tolist(), max_highlighted)]
    chosen, names = select_parameters(d, chosen, labels)
    t, dev = t.numpy(), (ecdf - t).numpy()
    others = [i for i in range(d) if i not in chosen]
    # close the curves at t = 0 and t = 1, where ECDF - t is 0
    tt = [0.0, *t, 1.0]
    fig = Figure(figsize=figsize, layout="constrained")
    axes = fig.subplots(1, 2, sharey=True)
    level = round(100 * (1 - float(test_level)))
    for ax in axes:
        ax.fill_between(
            tt,
            [0, *simultaneous[0].numpy(), 0],
            [0, *simultaneous[1].numpy(), 0],
            color=_BAND_COLOR,
            lw=0,
            label=f"{level}% simultaneous band",
        )
        for bound in pointwise.numpy():
            ax.plot(tt, [0, *bound, 0], color=_POINTWISE_COLOR, ls="--", lw=0.8)
        ax.plot([], [], color=_POINTWISE_COLOR, ls="--", lw=0.8, label=f"{level}% pointwise")
        ax.axhline(0, color="0.3", lw=0.6)
        ax.set_xlim(0, 1)
        ax.set_xlabel("t (fractional rank)", fontsize=8)
        ax.tick_params(labelsize=7)
    if others:
        inside = int((~_outside(dev[others], simultaneous.numpy())).sum())
        for k, i in enumerate(others):
            axes[0].plot(
                tt,
                [0, *dev[i], 0],
                color="0.55",
                lw=0.6,
                alpha=0.6,
                zorder=1.5,
                label=(
                    f"{len(others)} other dimensions, {inside} inside the band" if k == 0 else None
                ),
            )
    for k, (i, name) in enumerate(zip(chosen, names, strict=True)):
        axes[0].plot(
            tt,
            [0, *dev[i], 0],
            color=f"C{k}",
            lw=1.3,
            zorder=3,
            label=f"{name}: ECDF band {format_p_value(ecdf_p[i])}",
        )
    axes[1].plot(
        tt,
        [0, *dev[d], 0],
        color="k",
        lw=1.5,
        label=f"joint ({_joint(result)}): ECDF band {format_p_value(ecdf_p[d])}",
    )
    axes[0].set_ylabel("ECDF(t) − t", fontsize=8)
    if others:
        what = "with the smallest ECDF band p-values" if worst else "chosen"
        axes[0].set_title(
            f"Marginal ranks of D = {d}: in colour the {len(chosen)} {what}", fontsize=9
        )
    else:
        axes[0].set_title("Marginal ranks, one curve per dimension", fontsize=9)
    axes[1].set_title(f"Joint {_joint(result)} rank", fontsize=9)
    for ax in axes:  # below the axes: never over a curve
        entries = len(ax.get_legend_handles_labels()[1])
        ax.legend(
            fontsize=7,
            loc="upper center",
            bbox_to_anchor=(0.5, -0.13),
            ncol=min(2, entries),
            frameon=False,
        )
    axes[0].text(
        0.02,
        0.98,
        "read by shape: above 0 on the left, below on the right: too narrow\n"
        "  (over-confident)\n"
        "below 0 on the left, above on the right: too wide (under-confident)\n"
        "above 0 throughout: posterior too high; below throughout: too low",
        transform=axes[0].transAxes,
        **_NOTE,
    )
    axes[1].text(
        0.02,
        0.98,
        "this curve is the expected coverage minus its level:\n"
        "below 0: over-confident (truth "
        + ("less probable than" if _joint(result) == "energy" else "farther out than")
        + " the draws;\n"
        "  regions too narrow or misplaced, cover too rarely)\n"
        "above 0: under-confident (regions too wide, cover too often)",
        transform=axes[1].transAxes,
        **_NOTE,
    )
    top = max(abs(dev).max(), float(simultaneous.abs().max()))
    axes[0].set_ylim(-1.1 * top, 1.9 * top)
    title = (
        "ECDF − t: inside the grey band everywhere = calibrated (the ECDF band test "
        "rejects where a curve leaves it)"
    )
    global_p_value = getattr(result, "global_p_value", None)
    if global_p_value is not None:
        title += (
            f"\nglobal {format_p_value(global_p_value)}: all chi-square and ECDF "
            "band tests combined (the verdict)"
        )
    fig.suptitle(title, fontsize=10)
    return fig


def plot_expected_coverage(
    result: RankSummary,
    *,
    before: RankSummary | None = None,
    figsize: tuple[float, float] = (4.8, 4.6),
) -> Figure:
    r"""Coverage of highest-density credible regions against their credibility level.

    At level ``c`` the region holds the fraction ``c`` of the posterior's draws with the
    lowest energy (for a distance rank, ``joint_statistic == "distance"``: nearest the
    centre); the curve is the fraction of calibration pairs whose truth lies
    inside (the ECDF of the joint rank). Above the diagonal the regions cover
    more often than claimed (under-confident, conservative); below, less often
    (over-confident), the convention of :mod:`calib_lightning.functional.sbc`. The grey
    band is the simultaneous :math:`1 - \alpha` band; the title says on which side the
    curve leaves it (both sides: the regions are misplaced or misshapen rather than
    uniformly too narrow or too wide).

    Arguments:
        result: a :class:`~calib_lightning.functional.sbc.RankSummary`, e.g.
            ``RankCalibration.compute()`` (fields ``levels``, ``coverage``,
            ``simultaneous_band``, ``coverage_error``, ``level``).
        before: the same of the posterior before a fix (e.g. ``cl.recalibrate``), drawn
            dashed on the same axes; the band and the title are ``result``'s.
        figsize: figure size in inches.

    Returns:
        The figure.
    """
    t, coverage, simultaneous, error, level = _get(
        result, "levels", "coverage", "simultaneous_band", "coverage_error", "level"
    )
    if coverage.ndim != 1:
        raise ValueError(f"result.coverage must be (K,), got {tuple(coverage.shape)}")
    tt = [0.0, *t.numpy(), 1.0]
    fig = Figure(figsize=figsize, layout="constrained")
    ax = fig.subplots()
    ax.fill_between([0, 1], [0, 1], [1, 1], color="tab:blue", alpha=0.06, lw=0)
    ax.fill_between([0, 1], [0, 0], [0, 1], color="tab:red", alpha=0.06, lw=0)
    ax.fill_between(
        tt,
        [0, *(t + simultaneous[0]).numpy(), 1],
        [0, *(t + simultaneous[1]).numpy(), 1],
        color=_BAND_COLOR,
        lw=0,
        label=f"{round(100 * (1 - float(level)))}% band if calibrated",
    )
    ax.plot([0, 1], [0, 1], color="0.3", lw=0.8, ls="--")
    if before is not None:
        t_before, c_before, e_before = _get(before, "levels", "coverage", "coverage_error")
        ax.plot(
            [0.0, *t_before.numpy(), 1.0],
            [0, *c_before.numpy(), 1],
            color="tab:orange",
            lw=1.4,
            ls="--",
            label=f"before (signed area {float(e_before):+.3f})",
        )
    name = "observed" if before is None else "after"
    ax.plot(
        tt,
        [0, *coverage.numpy(), 1],
        color="k",
        lw=1.6,
        label=f"{name} (signed area {float(error):+.3f})",
    )
    ax.text(
        0.04,
        0.96,
        "UNDER-CONFIDENT\n(conservative: regions\ntoo wide, cover too often)",
        color="tab:blue",
        fontsize=8,
        va="top",
        transform=ax.transAxes,
    )
    ax.text(
        0.96,
        0.04,
        "OVER-CONFIDENT\n(regions too narrow or\nmisplaced, cover too rarely)",
        color="tab:red",
        fontsize=8,
        ha="right",
        va="bottom",
        transform=ax.transAxes,
    )
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.set_aspect("equal")
    ax.set_xlabel(f"credibility level of the {_REGION[_joint(result)]}", fontsize=8)
    ax.set_ylabel("fraction of truths inside (coverage)", fontsize=8)
    ax.tick_params(labelsize=7)
    ax.legend(fontsize=7, loc="center right", bbox_to_anchor=(1.0, 0.3))
    deviation = coverage - t
    below = bool((deviation < simultaneous[0] - 1e-12).any())
    above = bool((deviation > simultaneous[1] + 1e-12).any())
    if below and above:
        verdict = "leaves the band on both sides: misplaced or misshapen regions"
    elif below:
        verdict = "leaves the band below: over-confident or biased"
    elif above:
        verdict = "leaves the band above: under-confident"
    else:
        verdict = "inside the band: consistent with calibration"
    prefix = "" if before is None else "after, "
    ax.set_title(f"Expected coverage ({_joint(result)} rank)\n{prefix}{verdict}", fontsize=9)
    return fig
