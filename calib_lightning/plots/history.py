"""Calibration over training: each logged scalar of a diagnostic against the epoch.

Some diagnostics have no natural picture of a single check (KCCSD is one number and
its p-value); what a user watches is how they move while the estimator trains.
:func:`plot_history` draws one panel per scalar: p-values on a log axis from 1 down to
the smallest p-value of the run but no lower than :data:`HISTORY_FLOOR` (1e-10), with
the test level marked, so the level line stays far from a p-value of 1e-5 even when an
early check gave 1e-155 (drawn on the floor, its value written beneath); other scalars
with a line at their value for a calibrated estimator (:data:`CALIBRATED`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import LogLocator, MaxNLocator

from calib_lightning._utils.validation import check_probability
from calib_lightning.functional.bands import P_VALUE_FLOOR
from calib_lightning.plots._grid import MAX_COLUMNS, panel_grid  # wraps many scalars into rows

__all__ = ["CALIBRATED", "HISTORY_FLOOR", "axis_floor", "plot_history"]

#: the value of a scalar (by the first part of its key) for a calibrated estimator, and
#: how its reference line is labelled; scalars not listed get no line
CALIBRATED: dict[str, tuple[float, str]] = {
    "statistic": (0.0, "0: calibrated"),  # KCCSD's C-hat, the L-C2ST statistic T
    "coverage_error": (0.0, "0: calibrated"),
    "oracle_c2st": (0.5, "0.5: chance (indistinguishable)"),  # a classifier's accuracy
    "mmd": (0.0, "0: same distribution"),
    "frechet_distance": (0.0, "0: same distribution"),
    "reference_density": (1.0, "1: same distribution"),
    "density": (1.0, "1: same distribution"),  # reference_density's old tag, until 0.3.0
}
_TOP = 1e-4  # the p-value axis reaches at least this low, so calibrated runs look alike
#: the p-value axis stops at this floor (or at ``level * 1e-4`` if lower): a p-value of
#: 1e-155 would otherwise stretch it over 155 decades and squeeze 0.05 and 1e-5 together.
#: Smaller p-values are drawn on the floor as red triangles, their values written below.
HISTORY_FLOOR = 1e-10
_BAND = 0.25  # share of the axis' height below the floor, for the values of floored points


def _is_p_value(name: str) -> bool:
    # "p_value", "global_p_value", and entries "p_value/0", "marginal_p_values/1", ...
    return name.split("/")[0].endswith(("p_value", "p_values"))


def axis_floor(level: float | None) -> float:
    """The lowest p-value a history panel draws where it is: :data:`HISTORY_FLOOR`, or
    ``level * 1e-4`` for a level below ``1e-6``, so that the level line stays four
    decades above it."""
    return HISTORY_FLOOR if level is None else min(HISTORY_FLOOR, level * 1e-4)


def _short(p: float) -> str:
    """``"2e-150"``; ``"<2e-308"`` at the float64 floor (an upper bound)."""
    return f"<{P_VALUE_FLOOR:.0e}" if p <= P_VALUE_FLOOR else f"{p:.0e}"


def _labelled(floored: list[tuple[int, float]], room: int) -> list[tuple[int, float]]:
    """At most ``room`` of the floored points to write the values of: evenly spread,
    always with the smallest and the last."""
    if len(floored) <= room:
        return floored
    keep = {round(i * (len(floored) - 1) / max(room - 1, 1)) for i in range(room)}
    keep |= {min(range(len(floored)), key=lambda i: floored[i][1]), len(floored) - 1}
    return [floored[i] for i in sorted(keep)]


def _p_value_panel(ax: Axes, epochs: list[int], values: list[float], level: float | None) -> bool:
    """Log axis from 1 down to the run's smallest p-value, at most to :func:`axis_floor`;
    values below the floor as downward triangles on it (they are smaller than drawn),
    each value written below it. Returns whether any value is below the floor."""
    floor = axis_floor(level)
    floored = [(e, v) for e, v in zip(epochs, values, strict=True) if v < floor]
    drawn = [v if math.isnan(v) else min(max(v, floor), 1.0) for v in values]
    finite = [v for v in drawn if not math.isnan(v)]
    low = min([_TOP, *finite] + ([level] if level is not None else []))
    ax.set_yscale("log")
    if floored:  # a band below the floor for the values
        bottom = math.log10(floor) - _BAND / (1 - _BAND) * math.log10(1.25 / floor)
    else:  # a margin of 6 % of the span
        bottom = math.log10(low) - 0.06 * math.log10(1.25 / low)
    ax.set_ylim(10**bottom, 1.25)
    ax.yaxis.set_major_locator(LogLocator(numticks=6))
    if level is not None:
        ax.axhline(level, color="tab:red", ls="--", lw=1)
        ax.annotate(
            f"level {level:g}",
            (0.02, level),
            xycoords=("axes fraction", "data"),
            xytext=(0, 2),
            textcoords="offset points",
            va="bottom",
            fontsize=7,
            color="tab:red",
            bbox={"facecolor": "white", "alpha": 0.7, "lw": 0, "pad": 0.5},
        )
    ax.plot(epochs, drawn, marker="o", ms=3, color="tab:blue")
    if level is not None:  # checks at which the test rejects
        rejected = [(e, v) for e, v in zip(epochs, drawn, strict=True) if v < level]
        if rejected:
            ax.plot(*zip(*rejected, strict=True), ls="none", marker="o", ms=4, color="tab:red")
    if floored:
        ax.axhline(floor, color="0.5", ls="-.", lw=0.8)
        ax.plot(
            [e for e, _ in floored],
            [floor] * len(floored),
            ls="none",
            marker="v",
            ms=6,
            color="tab:red",
        )
        room = max(2, int(ax.get_position().width * ax.figure.get_figwidth() / 0.13))
        for epoch, value in _labelled(floored, room):
            ax.annotate(
                _short(value),
                (epoch, floor),
                xytext=(0, -5),
                textcoords="offset points",
                rotation=90,
                ha="center",
                va="top",
                fontsize=6,
                color="tab:red",
            )
    return bool(floored)


def _scalar_panel(
    ax: Axes, name: str, epochs: list[int], values: list[float], reference: tuple[float, str] | None
) -> None:
    if reference is not None:
        ax.axhline(reference[0], color="0.35", ls=":", lw=1.2, label=reference[1])
    ax.plot(epochs, values, marker="o", ms=3, color="tab:blue")
    shown = [v for v in values if math.isfinite(v)] + ([reference[0]] if reference else [])
    if shown:  # the reference line inside the axes, never on their edge
        low, high = min(shown), max(shown)
        pad = 0.08 * (high - low) if high > low else 0.5 * max(abs(high), 1e-3)
        ax.set_ylim(low - pad, high + pad)
    if reference is not None:  # named beside the line, on the side with more room
        value, label = reference
        above = (value - ax.get_ylim()[0]) < 0.5 * (ax.get_ylim()[1] - ax.get_ylim()[0])
        ax.annotate(
            label,
            (0.02, value),
            xycoords=("axes fraction", "data"),
            xytext=(0, 3 if above else -3),
            textcoords="offset points",
            va="bottom" if above else "top",
            fontsize="small",
            color="0.3",
        )


def plot_history(
    epochs: Sequence[int],
    history: Mapping[str, Sequence[float]],
    *,
    level: float | None = 0.05,
    title: str | None = None,
    titles: Mapping[str, str] | None = None,
    references: Mapping[str, tuple[float, str] | None] | None = None,
    panel_size: tuple[float, float] = (3.2, 2.5),
) -> Figure:
    r"""Plot calibration scalars against the training epoch, one panel per scalar.

    Keys whose first part ends in ``p_value`` or ``p_values`` are drawn on a
    logarithmic axis from 1 down to the smallest p-value of the run (at least down to
    :math:`10^{-4}`, at most down to :func:`axis_floor`, :math:`10^{-10}` at the usual
    levels), with a dashed line at ``level``: points below the line (red) are checks at
    which the test rejects :math:`H_0` ("the posterior is calibrated"). p-values below
    the floor are drawn on it (a dash-dotted line) as red downward triangles with their
    values written beneath (``<2e-308`` for the analytic floor
    :data:`~calib_lightning.functional.bands.P_VALUE_FLOOR`, an upper bound), and a note
    under the panels says so: the axis spans at most about 13.5 decades (a quarter of
    them below the floor, for the values), so the level line and a p-value of
    :math:`10^{-5}` stay a quarter of the panel apart however small the smallest. Other
    scalars are drawn on a linear axis with a dotted line at their value for a calibrated
    estimator (:data:`CALIBRATED`: 0 for statistics and coverage errors, 0.5 for a
    classifier's accuracy); ``coverage_error`` panels say which side is over-confident
    (``Reading the sign`` in :mod:`calib_lightning.functional.sbc`). Missing values
    (``nan``) leave gaps; a panel with no value at all says so.

    Arguments:
        epochs: the epoch of each check, length ``C``.
        history: scalar name -> values, each of length ``C``.
        level: test level marked on p-value panels; ``None`` for no line.
        title: figure title.
        titles: panel titles, by key or by the key's first part (e.g. ``{"p_value":
            "KCCSD (wild bootstrap)"}``): which test each p-value is.
        references: reference lines ``(value, label)`` by the key's first part, or
            ``None`` for no line; added to (and overriding) :data:`CALIBRATED`.
        panel_size: width and height of one panel in inches.

    Returns:
        A :class:`matplotlib.figure.Figure` with ``len(history)`` panels, at most
        :data:`MAX_COLUMNS` to a row.

    Example:
        >>> fig = plot_history([0, 1, 2], {"p_value": [1e-30, 0.03, 0.4],
        ...                                "statistic": [0.2, 0.05, 0.001]})
        >>> [ax.get_ylabel() for ax in fig.axes]
        ['p_value', 'statistic']
        >>> bool(1e-15 < fig.axes[0].get_ylim()[0] < 1e-10)  # 1e-30 is drawn at the floor
        True
        >>> [t.get_text() for t in fig.axes[0].texts]  # the level, the floored value
        ['level 0.05', '1e-30']

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
    lines = {**CALIBRATED, **(references or {})}
    titles = titles or {}
    fig, axes = panel_grid(
        len(history),
        panel_size,
        max_columns=MAX_COLUMNS,
        min_width=0.0,
        extra_height=0.3 if title is not None else 0.0,
    )
    floored = False
    for ax, (name, values) in zip(axes, history.items(), strict=True):
        values = [float(v) for v in values]
        first = name.split("/")[0]
        if _is_p_value(name):
            floored |= _p_value_panel(ax, epochs, values, level)
        else:
            _scalar_panel(ax, name, epochs, values, lines.get(first))
        panel_title = titles.get(name, titles.get(first)) or ""
        if first == "coverage_error":  # the package's sign convention, above the data
            panel_title += "\n< 0: over-, > 0: under-confident"
        if panel_title:
            ax.set_title(panel_title.strip("\n"), fontsize=9)
        if epochs and all(math.isnan(v) for v in values):  # nothing drawn: say why
            ax.set_xlim(min(epochs) - 0.5, max(epochs) + 0.5)
            ax.text(
                0.5,
                0.3,
                "no value at any check\n(failed, or could not judge)",
                transform=ax.transAxes,
                ha="center",
                va="center",
                fontsize=8,
                color="0.3",
            )
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("epoch")
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
    if title is not None:
        fig.suptitle(title)
    if floored:
        floor = axis_floor(level)
        fig.supxlabel(
            f"▼ a p-value below {floor:g}: drawn on the dash-dotted line at "
            f"{floor:g}, its value written beneath",
            fontsize=8,
            color="0.25",
        )
    return fig
