"""A plain-text table of what the calibration callbacks found, for scripts and logs."""

from __future__ import annotations

import math
from collections.abc import Iterable

from calib_lightning.callbacks.base import CalibrationCallback

__all__ = ["summary_table"]


def summary_table(callbacks: Iterable[object], level: float | None = None) -> str:
    """Tabulate each calibration callback's headline scalars at its first and latest check.

    Rows are the history entries named in each callback's ``history_keys`` (e.g.
    ``p_value`` and ``statistic`` for KCCSD, one row per entry of vector outputs).
    For p-values the last column says whether the test rejects :math:`H_0` ("the
    posterior is calibrated") at ``level`` (default: each callback's own level) at
    the latest check; "not rejected" is no evidence of miscalibration, not a proof
    of calibration.

    Arguments:
        callbacks: callbacks, e.g. ``trainer.callbacks``; those that are not
            :class:`CalibrationCallback` are skipped.
        level: test level for the verdict; ``None`` uses each callback's ``level``.

    Returns:
        The table as a string, one line per row.

    Example:
        >>> import torch
        >>> from calib_lightning.callbacks import KCCSDCallback
        >>> callback = KCCSDCallback(torch.zeros(4, 1), torch.zeros(4, 1))
        >>> callback.history, callback.epochs = {"p_value": [0.01, 0.3]}, [0, 9]
        >>> print(summary_table([callback]))
        check  quantity  first (epoch 0)  last (epoch 9)  H0: calibrated, level 0.05
        kccsd  p_value          0.01           0.3        not rejected
    """
    callbacks = [c for c in callbacks if isinstance(c, CalibrationCallback)]
    rows = [("check", "quantity", "first", "last", "H0: calibrated")]
    for callback in callbacks:
        if not callback.epochs:
            rows.append((callback.tag_name, "(no check ran)", "", "", ""))
            continue
        alpha = callback.level if level is None else level
        for key in callback.headline_keys():
            values = callback.history[key]
            first, last = values[0], values[-1]
            verdict = ""
            if key.split("/")[0].endswith("p_value") and not math.isnan(last):
                verdict = "rejected" if last < alpha else "not rejected"
            rows.append((callback.tag_name, key, f"{first:.4g}", f"{last:.4g}", verdict))
    epochs = [c.epochs for c in callbacks if c.epochs]
    if epochs and all(e[0] == epochs[0][0] and e[-1] == epochs[0][-1] for e in epochs):
        first_epoch, last_epoch = epochs[0][0], epochs[0][-1]
        alphas = {c.level if level is None else level for c in callbacks}
        rows[0] = (
            "check", "quantity", f"first (epoch {first_epoch})", f"last (epoch {last_epoch})",
            "H0: calibrated" + (f", level {alphas.pop():g}" if len(alphas) == 1 else ""),
        )  # fmt: skip
    widths = [max(len(row[i]) for row in rows) for i in range(5)]
    align = ["<", "<", "^", "^", "<"]
    lines = [
        "  ".join(f"{cell:{a}{w}}" for cell, a, w in zip(row, align, widths, strict=True)).rstrip()
        for row in rows
    ]
    return "\n".join(lines)
