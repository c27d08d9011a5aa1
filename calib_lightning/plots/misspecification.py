r"""Misspecification figure: where each observation's score falls among the simulations'.

The histogram is the null distribution of the nonconformity score (the calibration
simulations' distance to their ``k``-th nearest fit simulation); a vertical line marks
each observation's score, its conformal p-value in the legend. Lines inside the bulk
are observations the simulator could have produced; lines in the shaded right tail
are rejected at the level.

References:
    Vovk, Gammerman, Shafer. "Algorithmic Learning in a Random World." Springer (2005).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np
from matplotlib.figure import Figure

from calib_lightning._utils.validation import check_positive, check_probability
from calib_lightning.plots._format import format_p_value

if TYPE_CHECKING:
    from calib_lightning.misspecification import MisspecificationResult

__all__ = ["plot_misspecification"]

_COLORS = ("C0", "C1", "C2", "C4", "C5", "C6", "C8", "C9")  # no red (rejection), no grey (rest)
_SPAN_FOR_LOG = 100.0  # log x-axis when the positive scores span at least two decades


def _rejection_threshold(calibration: np.ndarray, level: float) -> float | None:
    """The score above which ``p < level``, or ``None`` when no score can reach it.

    ``p = (1 + c) / (1 + n)`` with ``c`` the calibration scores at least as large, so
    ``p < level`` iff ``c <= m``, ``m`` the largest integer below ``level (n + 1) - 1``:
    iff the score exceeds the ``(m + 1)``-th largest calibration score.
    """
    n = calibration.size
    m = math.ceil(level * (n + 1) - 1) - 1
    if m < 0:
        return None
    return float(np.sort(calibration)[::-1][min(m, n - 1)])


def plot_misspecification(
    result: MisspecificationResult,
    *,
    level: float = 0.05,
    max_legend: int = 8,
    title: str | None = "Misspecification: observation scores vs simulations",
    figsize: tuple[float, float] = (6.4, 3.8),
) -> Figure:
    r"""Histogram of the calibration scores with one vertical line per observation.

    A score is the distance from a point to its ``k``-th nearest fit simulation
    (standardized features); the conformal p-value of an observation is the share
    of calibration scores at least as large, :math:`(1 + \#\{s_i \ge s\}) / (1 + n)`,
    so a line far right of the histogram is an observation unlike the simulations.
    The shaded tail is where ``p < level``. The x-axis is logarithmic when the scores
    span two decades or more (an observation far outside the simulations' range).

    Arguments:
        result: a :class:`~calib_lightning.MisspecificationResult` (or a mapping with
            its ``score`` ``(O,)``, ``p_value`` ``(O,)`` and ``calibration_scores``
            ``(n,)``; ``global_p_value`` is shown when present).
        level: test level of the shaded rejection region.
        max_legend: observations named in the legend: those with the smallest
            p-values, in that order; the rest are drawn as thin grey lines and
            counted in the legend.
        title: figure title (``None``: none).
        figsize: figure size in inches.

    Returns:
        A :class:`matplotlib.figure.Figure` (never shown; log it or save it).
    """
    for key in ("score", "p_value", "calibration_scores"):
        if key not in result:
            raise ValueError(f"result must contain {key!r}, got keys {sorted(result)}")
    check_probability("level", level)
    check_positive("max_legend", max_legend, integer=True)
    score, p_value, calibration = (
        getattr(result, key).detach().cpu().double().numpy().reshape(-1)
        for key in ("score", "p_value", "calibration_scores")
    )
    if score.shape != p_value.shape:
        raise ValueError(
            f"result['score'] and result['p_value'] must both have shape (O,), got "
            f"{score.shape} and {p_value.shape}"
        )
    everything = np.concatenate([calibration, score])
    positive = everything[everything > 0]
    log = positive.size > 0 and positive.max() / positive.min() >= _SPAN_FOR_LOG
    low, high = (positive.min(), positive.max()) if log else (everything.min(), everything.max())
    if high <= low:
        low, high = low - 0.5, high + 0.5
    bins = np.geomspace(low, high, 41) if log else np.linspace(low, high, 41)
    plotted = np.clip(calibration, low, None) if log else calibration

    fig = Figure(figsize=figsize)
    ax = fig.add_subplot(1, 1, 1)
    ax.hist(
        plotted,
        bins=bins,
        color="0.75",
        edgecolor="0.55",
        lw=0.5,
        label=f"simulations (n = {calibration.size})",
    )
    right = high * 1.4 if log else high + 0.08 * (high - low)  # room for a line at the top
    threshold = _rejection_threshold(calibration, level)
    if threshold is not None and threshold < right:
        ax.axvspan(
            threshold, right, color="tab:red", alpha=0.1, lw=0, label=f"conformal p < {level:g}"
        )
    order = np.argsort(p_value, kind="stable")  # the most suspicious observations first
    for rank, o in enumerate(order):
        position = max(score[o], low) if log else score[o]
        if rank < max_legend:
            label = f"$x_o$ {o}: {format_p_value(p_value[o], name='conformal p')}"
            ax.axvline(position, color=_COLORS[rank % len(_COLORS)], lw=1.6, label=label)
        else:
            ax.axvline(position, color="0.35", lw=0.8, alpha=0.7)
    if score.size > max_legend:
        ax.plot([], [], color="0.35", lw=0.8, label=f"{score.size - max_legend} more (grey)")
    if log:
        ax.set_xscale("log")
    ax.set_xlim(low / 1.15 if log else low - 0.04 * (high - low), right)
    heading = None
    if getattr(result, "global_p_value", None) is not None and score.size > 1:
        heading = format_p_value(float(result.global_p_value), name="combined conformal p")
    ax.set_xlabel("score: distance to k-th nearest simulation" + (" (log)" if log else ""))
    ax.set_ylabel("simulations")
    ax.legend(loc="upper right", fontsize=7, title=heading, title_fontsize=8, framealpha=0.9)
    if title:
        ax.set_title(title, fontsize=10)
    fig.tight_layout()
    return fig
