r"""Figures of L-C2ST: PP-plots with the null band, classifier probabilities on samples.

* :func:`plot_pp`: for each reference observation, the empirical CDF of the
  classifier's outputs :math:`d(\theta_j, x_o)` at the evaluation points, against the
  band of the null classifiers. A consistent posterior keeps the curve inside the
  band; the further it leaves it, the better the classifier tells the estimator's
  samples from the true posterior's.
* :func:`plot_probability_map`: 1-D and 2-D marginal histograms of posterior samples
  at :math:`x_o`, each bin coloured by the mean classifier output of its samples. Since
  :math:`d = P(\text{true posterior} \mid \theta, x_o)`, bins with :math:`d < 1/2` (red)
  are where the estimator puts too much mass, :math:`d > 1/2` (blue) too little, white
  consistent; bins without draws are hatched grey, and contours draw the posterior's
  50 % and 90 % highest-density regions.

:func:`plot_pp` takes the :class:`~calib_lightning.metrics.lc2st.LC2STResult` of
:meth:`calib_lightning.LC2STNF.compute` / :meth:`calib_lightning.LC2ST.compute`,
:func:`plot_probability_map` the tensors of one observation of
``LC2STNF.probability_map``; both return a :class:`matplotlib.figure.Figure`.

References:
    Linhart, Gramfort, Rodrigues. "L-C2ST: Local Diagnostics for Posterior
    Approximations in Simulation-Based Inference." NeurIPS 2023 (Figure 4, Appendix D).
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Sequence
from typing import Any

import numpy as np
from matplotlib import colormaps
from matplotlib.axes import Axes
from matplotlib.cm import ScalarMappable
from matplotlib.colors import Normalize
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch, Rectangle
from scipy import stats
from torch import Tensor

from calib_lightning._utils.validation import check_positive
from calib_lightning.plots._format import format_p_value
from calib_lightning.plots._grid import MAX_COLUMNS, select_parameters

__all__ = [
    "DEFAULT_MAP_PARAMETERS",
    "HPD_MASSES",
    "MAX_MAP_PARAMETERS",
    "plot_pp",
    "plot_probability_map",
]

DEFAULT_MAP_PARAMETERS = 4  # parameters of a probability map by default: 4 x 4 panels
MAX_MAP_PARAMETERS = 6  # at most 6 x 6 panels, whatever D

_CMAP = "RdBu"  # low d (estimator has too much mass) red, high d (too little) blue
_NULL_COLOR, _CURVE_COLOR = "0.8", "C0"
#: the highest-density regions of the draws drawn as contours on the 2-D panels
HPD_MASSES = (0.5, 0.9)
_CONTOUR_STYLES = {0.5: "-", 0.9: ":"}
_CONTOUR_COLOR = "0.1"
_CONTOUR_GRID, _KDE_POINTS = 60, 2000  # grid per axis, draws kept for the density
_EMPTY_COLOR, _HATCH_COLOR, _HATCH = "0.86", "0.6", "////"  # bins without draws
_CROSSHAIR = {"color": "k", "ls": "-.", "lw": 0.8}


def _get(result: Any, *names: str) -> list[np.ndarray]:
    missing = [n for n in names if not isinstance(getattr(result, n, None), Tensor)]
    if missing:
        raise ValueError(
            f"result must be the LC2STResult of LC2STNF/LC2ST.compute(); missing {missing}"
        )
    return [getattr(result, n).detach().cpu().double().numpy() for n in names]


def _pp_axes(ax: Axes, grid: np.ndarray, ecdf: np.ndarray, band: np.ndarray, title: str) -> None:
    ax.fill_between(
        grid,
        band[0],
        band[1],
        step="post",
        color=_NULL_COLOR,
        lw=0,
        label="null classifiers (band)",
    )
    ax.step(
        [0, 0.5, 0.5, 1],
        [0, 0, 1, 1],
        where="post",
        color="k",
        ls="--",
        lw=0.9,
        label="chance: all d = 1/2",
    )
    ax.step(grid, ecdf, where="post", color=_CURVE_COLOR, lw=1.6, label="this posterior")
    ax.set(xlim=(0, 1), ylim=(0, 1), xlabel="level α", ylabel="ECDF of d at x_o", title=title)
    ax.grid(alpha=0.3, lw=0.5)


def plot_pp(
    result: Any,
    *,
    observations: Sequence[int] | None = None,
    names: Sequence[str] | None = None,
    level: float = 0.05,
    test: str | None = None,
    adjusted_p_values: Sequence[float] | None = None,
    correction: str = "Holm",
    panel_size: tuple[float, float] = (3.2, 3.0),
) -> Figure:
    r"""PP-plot per reference observation: ECDF of :math:`d(\theta_j, x_o)` and the null band.

    Each panel's title names the test of its p-value (``"L-C2ST-NF p = 0.01"``), the
    figure's title the combination of all of them (``global_p_value``).

    Arguments:
        result: the :class:`~calib_lightning.metrics.lc2st.LC2STResult` of ``compute()``
            (fields ``pp_grid``, ``pp_ecdf``, ``pp_band``, ``statistic``, ``p_value`` and
            ``global_p_value``).
        observations: indices of the observations to draw (default: all).
        names: a title per drawn observation.
        level: test level at which a panel is marked "rejected" (``p < level``; each
            observation's test alone, or its adjusted p-value when given) and at which the
            title judges ``global_p_value``, the verdict over all observations.
        test: the test's name in titles; default ``"L-C2ST"`` for a result with
            evaluation ``samples`` (:class:`~calib_lightning.LC2ST`), else ``"L-C2ST-NF"``.
        adjusted_p_values: multiplicity-adjusted p-values ``(O,)`` (e.g. Holm's, as the
            verdict of :func:`calib_lightning.diagnose` uses): each panel is judged by its
            adjusted p-value and shows both.
        correction: the name of the adjustment, for the titles.
        panel_size: inches per panel.
    """
    grid, ecdf, band, stat, p = _get(
        result, "pp_grid", "pp_ecdf", "pp_band", "statistic", "p_value"
    )
    if test is None:
        test = "L-C2ST" if getattr(result, "samples", None) is not None else "L-C2ST-NF"
    num_obs = ecdf.shape[0]
    picks = list(range(num_obs)) if observations is None else list(observations)
    if not picks or any(not -num_obs <= i < num_obs for i in picks):
        raise ValueError(
            f"observations must be a non-empty list of indices into the {num_obs} observations, "
            f"got {picks}"
        )
    if adjusted_p_values is not None and len(adjusted_p_values) != num_obs:
        raise ValueError(
            f"adjusted_p_values must have one entry per observation ({num_obs}), "
            f"got {len(adjusted_p_values)}"
        )
    if names is not None and len(names) != len(picks):
        raise ValueError(
            f"names must have one entry per observation ({len(picks)}), got {len(names)}"
        )
    cols = min(len(picks), MAX_COLUMNS)
    rows = math.ceil(len(picks) / cols)
    fig = Figure(figsize=(panel_size[0] * cols, panel_size[1] * rows + 0.6), layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False).ravel()
    for ax, i, k in zip(axes, picks, range(len(picks)), strict=False):
        judged = p[i] if adjusted_p_values is None else adjusted_p_values[i]
        verdict = "rejected" if judged < level else "not rejected"
        name = names[k] if names is not None else f"observation {i}"
        p_text = format_p_value(p[i], 3, name=f"{test} p")
        if adjusted_p_values is not None:
            p_text += f",\n{correction}-adjusted {format_p_value(judged, 3)}"
        title = f"{name}: {verdict}\nT = {stat[i]:.2g}, {p_text}"
        _pp_axes(ax, grid, ecdf[i], band[:, i], title)
    for ax in axes[len(picks) :]:
        ax.set_visible(False)
    axes[0].legend(loc="best", fontsize=7, framealpha=0.8)
    title = "Local PP-plots: a consistent posterior stays inside the grey band"
    global_p_value = getattr(result, "global_p_value", None)
    if global_p_value is not None and num_obs > 1:  # one observation: its p is the verdict
        global_p = float(global_p_value)
        verdict = "rejected" if global_p < level else "not rejected"
        panels = (
            "one observation's test alone"
            if adjusted_p_values is None
            else f"judged by its {correction}-adjusted p-value"
        )
        title += (
            f"\nall observations together: global {test} "
            f"{format_p_value(global_p, 3)}, {verdict} (the verdict; each panel is "
            f"{panels})"
        )
    # wrap to the figure's width (about 0.075 inch per character at 10 pt)
    width = max(30, int(fig.get_figwidth() / 0.075))
    fig.suptitle("\n".join(textwrap.fill(line, width) for line in title.split("\n")), fontsize=10)
    return fig


def _bin_means(
    values: np.ndarray, edges: list[np.ndarray], coords: np.ndarray, min_count: int
) -> tuple[np.ndarray, np.ndarray]:
    """Counts and mean of ``values`` per histogram bin (``nan`` below ``min_count``)."""
    counts, _ = np.histogramdd(coords, bins=edges)
    sums, _ = np.histogramdd(coords, bins=edges, weights=values)
    with np.errstate(invalid="ignore", divide="ignore"):
        means = np.where(counts >= min_count, sums / counts, np.nan)
    return counts, means


def _hpd_contours(ax: Axes, points: np.ndarray, low: np.ndarray, high: np.ndarray) -> bool:
    """Draw the 50 % and 90 % HPD contours of ``points`` ``(S, 2)`` (x, y) from a Gaussian
    KDE; the density level of a region of mass ``m`` is the ``1 - m`` quantile of the KDE
    at the points themselves. Returns whether they were drawn (not for fewer than ten
    points or a degenerate cloud)."""
    if points.shape[0] < 10:
        return False
    points = points[:: max(1, points.shape[0] // _KDE_POINTS)]  # bounded cost
    try:
        kde = stats.gaussian_kde(points.T)
    except (np.linalg.LinAlgError, ValueError):  # all draws on a line: no 2-D density
        return False
    grid_x, grid_y = (np.linspace(low[k], high[k], _CONTOUR_GRID) for k in (0, 1))
    mesh_x, mesh_y = np.meshgrid(grid_x, grid_y)
    density = kde(np.vstack([mesh_x.ravel(), mesh_y.ravel()])).reshape(mesh_x.shape)
    levels = np.quantile(kde(points.T), [1 - m for m in HPD_MASSES[::-1]])  # ascending
    if not np.all(np.diff(levels) > 0):
        return False
    ax.contour(
        mesh_x,
        mesh_y,
        density,
        levels=levels,
        colors=_CONTOUR_COLOR,
        linestyles=[_CONTOUR_STYLES[m] for m in HPD_MASSES[::-1]],
        linewidths=0.9,
    )
    return True


def plot_probability_map(
    samples: Tensor,
    probabilities: Tensor,
    *,
    labels: Sequence[str] | None = None,
    parameters: Sequence[int] | None = None,
    truth: Tensor | None = None,
    bins: int = 20,
    min_count: int = 5,
    pp: tuple[Tensor, Tensor, Tensor] | None = None,
    title: str | None = None,
    color_range: float = 0.5,
    range_quantile: float = 0.005,
    panel_size: float = 2.4,
) -> Figure:
    r"""Corner plot of posterior samples at :math:`x_o`, bins coloured by the classifier.

    Drawn for a few parameters only (``parameters``; default the first four, at most
    six), so the figure is at most six by six panels whatever ``D``; a ``D x D`` grid at
    ``D = 50`` would be 2,500 panels. The title names the drawn parameters when they
    are not all of them.

    Diagonal: 1-D histograms; below it: 2-D histograms. Each bin's colour is the mean of
    :math:`d` over its samples: red (:math:`d < 1/2`) where the estimator puts too much
    mass relative to the true posterior, blue (:math:`d > 1/2`) too little, white where
    the classifier is at chance (consistent). Bins with fewer than ``min_count`` samples
    (where the estimator puts no mass, so the classifier was not asked) are hatched grey,
    never white. The colour scale is fixed, :math:`[1/2 - r, 1/2 + r]` with ``r =
    color_range`` (default the whole :math:`[0, 1]`), whatever the data: maps of two
    epochs, two observations or a callback and the report compare colour for colour.
    Each 2-D panel draws the posterior's shape: the 50 % (solid) and 90 % (dotted)
    highest-density regions of the samples, from a Gaussian kernel density estimate.
    With ``truth``, a dash-dotted crosshair and a star mark the true parameter (the one
    that generated :math:`x_o`). A legend under the panels names the hatching, the
    contours and the crosshair.

    Arguments:
        samples: posterior samples :math:`\theta_s \sim q(\cdot \mid x_o)`, ``(S, D)``.
        probabilities: :math:`d(\theta_s, x_o)`, ``(S,)`` (for L-C2ST-NF, evaluated at the
            samples' latents: ``LC2STNF.probability_map``).
        labels: names of all ``D`` parameters.
        parameters: indices of the parameters whose 1-D and pairwise 2-D marginals are
            drawn, in order (default the first ``min(D, 4)``; at most
            :data:`MAX_MAP_PARAMETERS`).
        truth: the parameter that generated :math:`x_o`, ``(D,)``, drawn as a crosshair
            (the axes reach it).
        bins: bins per axis.
        min_count: samples a bin needs to be coloured.
        pp: ``(pp_grid, pp_ecdf[o], pp_band[:, o])`` to draw the PP-plot in the free corner.
        title: figure title.
        color_range: half-width :math:`r` of the fixed colour scale around 1/2, in
            ``(0, 0.5]``; bin means beyond it take the end colours (the colour bar's
            arrows say so).
        range_quantile: axes span the ``range_quantile`` to ``1 - range_quantile``
            quantiles of each parameter and 5 % of that span on each side, so that a few
            outliers do not squeeze the bulk and a mode at the edge is drawn whole.
        panel_size: inches per panel.
    """
    theta = samples.detach().cpu().double().numpy()
    d_values = probabilities.detach().cpu().double().numpy()
    if theta.ndim != 2 or d_values.shape != (theta.shape[0],):
        raise ValueError(
            f"samples must have shape (S, D) and probabilities (S,), got {tuple(samples.shape)} "
            f"and {tuple(probabilities.shape)}"
        )
    num_dims = theta.shape[1]
    if parameters is None:
        parameters = range(min(num_dims, DEFAULT_MAP_PARAMETERS))
    chosen, names = select_parameters(num_dims, parameters, labels, max_count=MAX_MAP_PARAMETERS)
    check_positive("bins", bins, integer=True)
    if truth is not None and tuple(np.shape(truth)) != (num_dims,):
        raise ValueError(f"truth must have shape ({num_dims},), got {tuple(np.shape(truth))}")
    if not 0 < color_range <= 0.5:
        raise ValueError(f"color_range must lie in (0, 0.5], got {color_range!r}")
    if not 0 <= range_quantile < 0.5:
        raise ValueError(f"range_quantile must lie in [0, 0.5), got {range_quantile!r}")
    theta, dim = theta[:, chosen], len(chosen)
    truth = None if truth is None else np.array([float(truth[i]) for i in chosen])
    labels = names
    low, high = np.quantile(theta, [range_quantile, 1 - range_quantile], axis=0)
    margin = 0.05 * np.maximum(high - low, 1e-12)  # a mode at the edge is drawn whole
    low, high = low - margin, high + margin
    if truth is not None:  # the crosshair inside the axes
        low, high = np.minimum(low, truth - margin), np.maximum(high, truth + margin)
    edges = [np.linspace(low[i], high[i] + 1e-12, bins + 1) for i in range(dim)]
    panels = {  # (i, j) -> (counts, bin means) of the 1-D (i == j) and 2-D histograms
        (i, j): _bin_means(
            d_values,
            [edges[j], edges[i]] if i != j else [edges[i]],
            theta[:, [j, i]] if i != j else theta[:, [i]],
            min_count,
        )
        for i in range(dim)
        for j in range(i + 1)
    }
    half = float(color_range)  # fixed: the same colours at every check and in the report
    norm, cmap = Normalize(0.5 - half, 0.5 + half), colormaps[_CMAP]

    side = max(dim, 2)
    fig = Figure(figsize=(panel_size * side + 1.4, panel_size * side + 0.9), layout="constrained")
    axes = fig.subplots(side, side, squeeze=False)
    contoured = False
    for i in range(side):
        for j in range(side):
            ax = axes[i, j]
            if i >= dim or j > i:
                ax.set_axis_off()
                continue
            counts, means = panels[i, j]
            if i == j:
                width = np.diff(edges[i])
                density = counts / max(counts.sum(), 1) / width
                colors = [cmap(norm(m)) if np.isfinite(m) else _EMPTY_COLOR for m in means]
                hatches = ["" if np.isfinite(m) else _HATCH for m in means]
                ax.bar(
                    edges[i][:-1],
                    density,
                    width=width,
                    align="edge",
                    color=colors,
                    edgecolor="0.4",
                    lw=0.3,
                    hatch=hatches,
                )
                ax.set_xlim(edges[i][0], edges[i][-1])
                ax.set_yticks([])
            else:
                ax.add_patch(
                    Rectangle(
                        (0, 0),
                        1,
                        1,
                        transform=ax.transAxes,
                        zorder=0,
                        facecolor=_EMPTY_COLOR,
                        edgecolor=_HATCH_COLOR,
                        hatch=_HATCH,
                        lw=0,
                    )
                )
                ax.pcolormesh(
                    edges[j],
                    edges[i],
                    np.ma.masked_invalid(means.T),
                    cmap=cmap,
                    norm=norm,
                    zorder=1,
                )
                contoured |= _hpd_contours(ax, theta[:, [j, i]], low[[j, i]], high[[j, i]])
                ax.set_ylabel(labels[i] if j == 0 else "")
                if truth is not None:
                    ax.axhline(truth[i], **_CROSSHAIR)
                    ax.plot(
                        truth[j],
                        truth[i],
                        marker="*",
                        ms=9,
                        color="k",
                        mec="white",
                        mew=0.6,
                        zorder=4,
                    )
            if truth is not None:
                ax.axvline(truth[j], **_CROSSHAIR)
            ax.set_xlabel(labels[j] if i == dim - 1 else "")
            ax.tick_params(labelsize=7)
    if pp is not None:
        grid, ecdf, band = (t.detach().cpu().double().numpy() for t in pp)
        _pp_axes(axes[0, side - 1], grid, ecdf, band, "PP-plot")
        axes[0, side - 1].set_axis_on()
        axes[0, side - 1].legend(loc="best", fontsize=6, framealpha=0.8)
    bar = fig.colorbar(
        ScalarMappable(norm, cmap),
        ax=axes,
        shrink=0.8,
        aspect=30,
        extend="neither" if half >= 0.5 else "both",
    )
    bar.set_ticks(np.linspace(0.5 - half, 0.5 + half, 5))
    bar.set_ticklabels(
        [
            f"{0.5 - half:.2g}\nestimator:\ntoo much mass",
            "",
            "0.5\nchance:\nconsistent",
            "",
            f"{0.5 + half:.2g}\nestimator:\ntoo little mass",
        ],
        fontsize=7,
    )
    bar.set_label(
        "mean classifier output in the bin, d(θ, x_o) = P(true posterior | θ, x_o)", fontsize=8
    )
    _map_legend(fig, min_count, contoured, truth is not None)
    heading = title or "Where the estimator puts too much (red) or too little (blue) mass"
    if dim < num_dims:
        heading += f"\n{', '.join(names)} of D = {num_dims} parameters (parameters= picks others)"
    fig.suptitle(heading, fontsize=10)
    return fig


def _map_legend(fig: Figure, min_count: int, contoured: bool, truth: bool) -> None:
    """The legend under a probability map: white, hatched, contours, crosshair."""
    handles = [
        Patch(facecolor="white", edgecolor="0.4", lw=0.5, label="d ≈ 0.5: consistent"),
        Patch(
            facecolor=_EMPTY_COLOR,
            edgecolor=_HATCH_COLOR,
            hatch=_HATCH,
            lw=0,
            label=f"fewer than {min_count} draws: no posterior mass, not tested",
        ),
    ]
    if contoured:
        handles += [
            Line2D(
                [],
                [],
                color=_CONTOUR_COLOR,
                ls=_CONTOUR_STYLES[m],
                lw=0.9,
                label=f"{m:.0%} HPD region of the draws",
            )
            for m in HPD_MASSES
        ]
    if truth:
        handles.append(
            Line2D(
                [],
                [],
                marker="*",
                ms=9,
                color="k",
                mec="white",
                mew=0.6,
                **{k: v for k, v in _CROSSHAIR.items() if k != "color"},
                label="true parameter (generated x_o)",
            )
        )
    fig.legend(handles=handles, loc="outside lower center", ncols=2, fontsize=7, frameon=False)
