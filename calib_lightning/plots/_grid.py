"""Grids of per-parameter panels that stay readable and bounded at many parameters.

Every per-parameter figure of the package draws its panels with :func:`panel_grid`: at
most :data:`MAX_COLUMNS` panels to a row, rows as needed, each panel of a fixed size, so
that a figure of ``D = 50`` parameters is about 18 inches wide and at most
:data:`MAX_ROWS` rows high, whatever ``D``. :func:`select_parameters` reads the
``parameters=`` (indices) and ``labels=`` (names of all ``D``) arguments the same way
for every figure; :func:`worst_first` picks the parameters with the smallest p-values
when a figure has room for fewer panels than parameters.
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Sequence

import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

__all__ = [
    "MAX_COLUMNS",
    "MAX_ROWS",
    "as_indices",
    "check_max_columns",
    "columns",
    "heading_and_note",
    "outer_labels",
    "panel_grid",
    "parameter_names",
    "select_parameters",
    "worst_first",
]

MAX_COLUMNS = 6  # panels side by side: a 6-wide grid of 3-inch panels is 18 inches
MAX_ROWS = 10  # rows of panels at most; more parameters: the worst ones, or pick them


def parameter_names(labels: Sequence[str] | None, d: int) -> list[str]:
    """The names of all ``d`` parameters: ``labels``, or ``θ1 .. θd``."""
    if labels is None:
        return [f"θ{i + 1}" for i in range(d)]
    if isinstance(labels, str) or len(labels) != d:
        got = "a string" if isinstance(labels, str) else f"{len(labels)} labels"
        raise ValueError(f"labels must name all D = {d} parameters, got {got}")
    return [str(name) for name in labels]


def as_indices(parameters: Sequence[int] | None) -> list[int] | None:
    """``parameters`` as a list of integers (``None`` stays ``None``), before ``D`` is known."""
    if parameters is None:
        return None
    if isinstance(parameters, (str, bytes)) or not hasattr(parameters, "__iter__"):
        raise ValueError(f"parameters must be a list of indices or None, got {parameters!r}")
    chosen = list(parameters)
    if not chosen or any(
        isinstance(i, bool) or not isinstance(i, (int, np.integer)) for i in chosen
    ):
        raise ValueError(f"parameters must be a non-empty list of integer indices, got {chosen}")
    return [int(i) for i in chosen]


def select_parameters(
    d: int,
    parameters: Sequence[int] | None,
    labels: Sequence[str] | None,
    *,
    max_count: int | None = None,
) -> tuple[list[int], list[str]]:
    """Indices and names of the parameters to draw, in the order given.

    Arguments:
        d: number of parameters ``D``.
        parameters: indices into ``range(D)`` (negative ones count from the end), or
            ``None`` for all.
        labels: names of all ``D`` parameters, or ``None``.
        max_count: most indices a figure accepts; more raise ``ValueError``.

    Example:
        >>> select_parameters(3, [2, 0], ["a", "b", "c"])
        ([2, 0], ['c', 'a'])
    """
    names = parameter_names(labels, d)
    try:
        chosen = list(range(d)) if parameters is None else as_indices(parameters)
    except ValueError:
        chosen = []
    if not chosen or any(not -d <= i < d for i in chosen):
        raise ValueError(
            f"parameters must be a non-empty list of indices in [0, {d}), got {parameters}"
        )
    chosen = [int(i) % d for i in chosen]
    if max_count is not None and len(chosen) > max_count:
        raise ValueError(
            f"parameters must hold at most {max_count} indices for this figure, got {len(chosen)}"
        )
    return chosen, [names[i] for i in chosen]


def worst_first(p_values: Sequence[float], count: int) -> list[int]:
    """Indices of the ``count`` smallest p-values, in index order (ties: lower index)."""
    order = np.argsort(np.asarray(p_values, dtype=float), kind="stable")
    return sorted(int(i) for i in order[:count])


def check_max_columns(max_columns: int) -> None:
    """``ValueError`` unless ``max_columns`` is a positive integer."""
    if isinstance(max_columns, bool) or not isinstance(max_columns, int) or max_columns < 1:
        raise ValueError(f"max_columns must be a positive integer, got {max_columns!r}")


def columns(count: int, max_columns: int) -> int:
    """Panels per row of :func:`panel_grid`."""
    return math.ceil(count / math.ceil(count / max_columns))


def panel_grid(
    count: int,
    panel_size: tuple[float, float],
    *,
    max_columns: int = MAX_COLUMNS,
    min_width: float = 5.0,
    extra_height: float = 1.0,
) -> tuple[Figure, list[Axes]]:
    """A constrained-layout figure with ``count`` panels, at most ``max_columns`` to a row.

    Rows are filled evenly (``ceil(count / rows)`` columns), so no row is left with a
    single panel when the one above is full.

    Arguments:
        count: panels.
        panel_size: ``(width, height)`` of one panel in inches.
        max_columns: panels per row.
        min_width: narrowest figure in inches (room for titles and notes).
        extra_height: inches added for the title and notes.

    Returns:
        The figure and its ``count`` visible axes, row by row (``columns(count,
        max_columns)`` to a row).
    """
    check_max_columns(max_columns)
    rows = math.ceil(count / max_columns)
    cols = math.ceil(count / rows)  # balanced: 7 panels as 4 + 3, not 6 + 1
    width = max(panel_size[0] * cols, min_width)
    fig = Figure(figsize=(width, panel_size[1] * rows + extra_height), layout="constrained")
    axes = list(fig.subplots(rows, cols, squeeze=False).ravel())
    for ax in axes[count:]:
        ax.set_visible(False)
    return fig, axes[:count]


def outer_labels(
    axes: list[Axes],
    max_columns: int,
    xlabel: str,
    ylabel: str,
    *,
    fontsize: float = 8.0,
    locate: bool = True,
) -> None:
    """Axis labels on the left column and the bottom panel of each column only, for the
    axes of :func:`panel_grid` with the same ``max_columns``."""
    cols = columns(len(axes), max_columns)
    rows = math.ceil(len(axes) / cols)
    for k, ax in enumerate(axes):
        if k % cols == 0:
            ax.set_ylabel(ylabel, fontsize=fontsize)
        if k // cols == rows - 1 or k + cols >= len(axes):
            ax.set_xlabel(xlabel, fontsize=fontsize)
        ax.tick_params(labelsize=7)
        if locate:  # few round labels: readable, and a grid of 50 lays out faster
            for axis in (ax.xaxis, ax.yaxis):
                axis.set_major_locator(MaxNLocator(4, steps=[1, 2, 5, 10]))


def heading_and_note(fig: Figure, heading: str, note: str, *, fontsize: float = 8.0) -> int:
    """``heading`` on top; the reading ``note`` at the bottom, wrapped to the figure's width.
    Returns the number of lines of the wrapped note."""
    fig.suptitle(heading, fontsize=fontsize + 2)
    width = int(fig.get_figwidth() * 14)  # ~14 characters per inch at 8 pt
    wrapped = "\n".join(textwrap.fill(line, width=width) for line in note.split("\n"))
    fig.supxlabel(wrapped, fontsize=fontsize, color="0.2")
    return wrapped.count("\n") + 1
