"""Pieces the NPE examples share: an epoch timer, the cost table, figure export.

Imported by the example scripts (``python examples/npe_*.py`` puts this folder on the
path); uses only the public API of calib_lightning.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

import lightning as L

from calib_lightning.callbacks import CalibrationCallback

PRINTED = (
    "train/nll", "val/nll", "calibration/kccsd/p_value", "calibration/ranks/p_value",
    "calibration/lc2st_nf/p_value/0",
)  # fmt: skip


class EpochTimer(L.Callback):
    """Wall time of each training epoch (validation and checks included), printed with the
    latest losses and p-values, to put the checks in proportion."""

    def __init__(self) -> None:
        self.seconds: list[float] = []

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._start = time.perf_counter()

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.seconds.append(time.perf_counter() - self._start)
        metrics = trainer.callback_metrics
        line = f"epoch {trainer.current_epoch:3d}  {self.seconds[-1]:5.1f} s"
        for key in PRINTED:
            if key in metrics:
                line += f"  {key} {float(metrics[key]):.4g}"
        print(line, flush=True)


def overhead_table(checks: Sequence[CalibrationCallback], timer: EpochTimer) -> str:
    """Median seconds per check, and as a fraction of the median epoch without checks."""
    per_epoch = statistics.median(
        seconds - sum(c.seconds[c.epochs.index(epoch)] for c in checks if epoch in c.epochs)
        for epoch, seconds in enumerate(timer.seconds)
    )
    lines = [f"{'check':10s} {'checks':>6s} {'s/check':>8s} {'fraction of an epoch':>21s}"]
    for c in checks:
        median = statistics.median(c.seconds) if c.seconds else math.nan
        lines.append(
            f"{c.tag_name:10s} {len(c.seconds):6d} {median:8.2f} {median / per_epoch:21.1%}"
        )
    lines.append(f"(median epoch without checks: {per_epoch:.2f} s)")
    return "\n".join(lines)


def save_figures(checks: Sequence[CalibrationCallback], folder: Path, prefix: str) -> None:
    """Write each check's figures of its last result as PNG files."""
    folder.mkdir(parents=True, exist_ok=True)
    for check in checks:
        for key, figure in check.figures(check.last_result).items():
            path = folder / f"{prefix}_{check.tag_name}_{key.replace('/', '_')}.png"
            figure.savefig(path, dpi=110)
            print("wrote", path)
