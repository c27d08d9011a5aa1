"""Calibration over training: each logged scalar of a diagnostic against the epoch.

Some diagnostics have no natural picture of a single check (KCCSD is one number and
its p-value); what a user watches is how they move while the estimator trains.
:func:`plot_history` draws one panel per scalar, p-values on a log axis with the
test level marked, so the epoch at which calibration is reached (or lost) is visible.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from calib_lightning._checks import check_probability
from calib_lightning.plots._grid import MAX_COLUMNS, panel_grid  # wraps many scalars into rows

__all__ = ["MAX_COLUMNS", "plot_history"]


_FLOOR = 1e-4  # bottom of the p-value axis; smaller values are drawn clipped to it


def plot_history(
    epochs: Sequence[int],
    history: Mapping[str, Sequence[float]],
    *,
    level: float | None = 0.05,
    title: str | None = None,
    panel_size: tuple[float, float] = (3.2, 2.5),
) -> Figure:
    r"""Plot calibration scalars against the training epoch, one panel per scalar.

    Keys ending in ``p_value`` are drawn on a logarithmic axis clipped to
    :math:`[10^{-4}, 1]` with a dashed line at ``level``: points below the line (red)
    are checks at which the test rejects :math:`H_0` ("the posterior is calibrated").
    p-values below :math:`10^{-4}` are drawn as downward triangles on the bottom edge
    and the legend says they are clipped.
    Other scalars (statistics, coverage errors) are drawn on a linear axis with a
    dotted line at zero, their value under perfect calibration; ``coverage_error`` and
    ``atc`` panels say which side is over-confident (``Reading the sign`` in
    :mod:`calib_lightning.functional.sbc`). Missing values
    (``nan``) leave gaps.

    Arguments:
        epochs: the epoch of each check, length ``C``.
        history: scalar name -> values, each of length ``C``.
        level: test level marked on p-value panels; ``None`` for no line.
        title: figure title.
        panel_size: width and height of one panel in inches.

    Returns:
        A :class:`matplotlib.figure.Figure` with ``len(history)`` panels, at most
        :data:`MAX_COLUMNS` to a row.

    Example:
        >>> fig = plot_history([0, 1, 2], {"p_value": [0.001, 0.03, 0.4],
        ...                                "statistic": [0.2, 0.05, 0.001]})
        >>> [ax.get_ylabel() for ax in fig.axes]
        ['p_value', 'statistic']

    References:
        Glaser, Widmann, Lindsten, Gretton. "Fast and Scalable Score-Based Kernel
        Calibration Tests." UAI 2023 (the KCCSD statistic and p-value tracked here).
    """
    epochs = list(epochs)
    if level is not None:
        check_probability("level", level)
    if not history:
        raise ValueError("history must hold at least one scalar, got an empty mapping")
    for name, values in history.items():
        if len(values) != len(epochs):
            raise ValueError(
                f"history[{name!r}] must have one value per epoch ({len(epochs)}), "
                f"got {len(values)}"
            )
    fig, axes = panel_grid(len(history), panel_size, max_columns=MAX_COLUMNS, min_width=0.0,
                           extra_height=0.3 if title is not None else 0.0)  # fmt: skip
    for k, (ax, (name, values)) in enumerate(zip(axes, history.items(), strict=True)):
        values = [float(v) for v in values]
        # "p_value", "global_p_value", and entries "p_value/0", "marginal_p_values/1", ...
        is_p_value = name.split("/")[0].endswith(("p_value", "p_values"))
        if is_p_value:
            clipped = [(e, _FLOOR) for e, v in zip(epochs, values, strict=True) if v < _FLOOR]
            values = [v if math.isnan(v) else min(max(v, _FLOOR), 1.0) for v in values]
            ax.set_yscale("log")
            ax.set_ylim(0.6 * _FLOOR, 1.25)
            if level is not None:
                ax.axhline(level, color="tab:red", ls="--", lw=1, label=f"level {level:g}")
        else:
            ax.axhline(0.0, color="0.6", ls=":", lw=1)
            if name.split("/")[0] in ("coverage_error",):  # the package's sign convention
                ax.text(0.98, 0.04, "< 0: over-confident\n> 0: under-confident",
                        transform=ax.transAxes, ha="right", va="bottom", fontsize="small",
                        color="0.3")  # fmt: skip
        ax.plot(epochs, values, marker="o", ms=3, color="tab:blue")
        if is_p_value and level is not None:  # checks at which the test rejects
            rejected = [(e, v) for e, v in zip(epochs, values, strict=True) if v < level]
            if rejected:
                ax.plot(*zip(*rejected, strict=True), ls="none", marker="o", ms=4,
                        color="tab:red")  # fmt: skip
        if is_p_value:
            if clipped:
                ax.plot(*zip(*clipped, strict=True), ls="none", marker="v", ms=6,
                        color="tab:red", label=f"p < {_FLOOR:g} (clipped)")  # fmt: skip
            if (level is not None and k == 0) or clipped:  # the level line: said once
                ax.legend(loc="lower right", fontsize="small", frameon=False)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("epoch")
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
    if title is not None:
        fig.suptitle(title)
    return fig
