"""A plain-text table of what the calibration callbacks found, for scripts and logs."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from calib_lightning.callbacks._scalars import is_p_value
from calib_lightning.callbacks.base import CalibrationCallback
from calib_lightning.functional.combine import combine_p_values
from calib_lightning.plots._format import format_p_value

__all__ = ["summary_table"]


def summary_table(callbacks: Iterable[object], level: float | None = None) -> str:
    """Tabulate each calibration callback's headline scalars at its first and latest check.

    Rows are the history entries named in each callback's ``history_keys`` (e.g.
    ``p_value`` and ``statistic`` for KCCSD, one row per entry of vector outputs).
    Each check gets **one verdict**, on the row of its
    :meth:`~calib_lightning.callbacks.CalibrationCallback.verdict_key`:
    ``global_p_value`` when the metric runs several tests (rank calibration: marginal
    and joint; L-C2ST: one test per observation), combined so that the verdict keeps
    its level, else the single ``p_value``. (A callback that logs several
    ``p_value/<i>`` and no global one gets their Cauchy combination, computed here.)
    The verdict says whether the test rejects :math:`H_0` ("the posterior is
    calibrated") at ``level`` (default: each callback's own level) at the latest
    check; "not rejected" is no evidence of miscalibration, not a proof of
    calibration. The other p-values say *where* a rejected check fails; judged one by
    one at ``level`` they would flag a calibrated model far more often than ``level``.

    p-values print from the float64 history, however small (``1e-100``); those at the
    analytic floor print as ``< 2.2e-308``, never as 0; a check that
    failed (``on_error="warn"``) shows ``nan`` and the verdict "check failed".

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
        test_level = callback.level if level is None else level
        history = {key: callback.history[key] for key in callback.headline_keys()}
        verdict_key = callback.verdict_key()
        if verdict_key is None:
            vector = [v for k, v in history.items() if k.split("/")[0] == "p_value"]
            if vector:
                combined = combine_p_values(torch.tensor(vector, dtype=torch.float64), dim=0)
                verdict_key = "global_p_value"
                history = {verdict_key: combined.tolist(), **history}
        for key, values in history.items():
            first, last = values[0], values[-1]
            verdict = ""
            if key == verdict_key:
                if math.isnan(last):
                    verdict = "check failed" if callback.errors else ""
                else:
                    verdict = "rejected" if last < test_level else "not rejected"
            rows.append((callback.tag_name, key, _format(key, first), _format(key, last), verdict))
    epochs = [c.epochs for c in callbacks if c.epochs]
    if epochs and all(e[0] == epochs[0][0] and e[-1] == epochs[0][-1] for e in epochs):
        first_epoch, last_epoch = epochs[0][0], epochs[0][-1]
        alphas = {c.level if level is None else level for c in callbacks}
        rows[0] = (
            "check",
            "quantity",
            f"first (epoch {first_epoch})",
            f"last (epoch {last_epoch})",
            "H0: calibrated" + (f", level {alphas.pop():g}" if len(alphas) == 1 else ""),
        )
    widths = [max(len(row[i]) for row in rows) for i in range(5)]
    align = ["<", "<", "^", "^", "<"]
    lines = [
        "  ".join(f"{cell:{a}{w}}" for cell, a, w in zip(row, align, widths, strict=True)).rstrip()
        for row in rows
    ]
    return "\n".join(lines)


def _format(key: str, value: float) -> str:
    if is_p_value(key):  # global_p_value, p_value/0, marginal_p_values/1, ...
        return format_p_value(value, digits=4, name="")
    return f"{value:.4g}"
