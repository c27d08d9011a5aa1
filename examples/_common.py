"""Pieces the NPE examples share: arguments, data, the checks, the training run and its
report. Uses only the public API of calib_lightning.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from torch import Tensor
from torch.utils.data import DataLoader, TensorDataset

import calib_lightning as cl
from calib_lightning.callbacks import (
    CalibrationCallback,
    KCCSDCallback,
    LC2STNFCallback,
    RankCalibrationCallback,
    summary_table,
)
from examples._smoke import add_smoke_argument, output_folder

__all__ = [
    "CHECKS",
    "SMOKE",
    "SMOKE_CHECKS",
    "EpochTimer",
    "calibration_callbacks",
    "fit_and_report",
    "overhead_table",
    "parse_arguments",
    "save_figures",
    "simulate",
]

# sizes of the checks (KCCSD bootstrap draws, L-C2ST-NF null classifiers and evaluation
# points, exact posterior samples at x_o) and of a --smoke run
CHECKS = {
    "kccsd_num_null": 500,
    "lc2st_num_null": 100,
    "num_posterior_samples": 2_000,  # L-C2ST-NF's evaluation points: the metric's default
    "num_reference": 1_000,
}
SMOKE_CHECKS = {
    "kccsd_num_null": 50,
    "lc2st_num_null": 4,
    "num_posterior_samples": 200,
    "num_reference": 100,
}
# --smoke: one epoch, one check with its figures; 2 reference observations
SMOKE = {
    "epochs": 1, "num_simulations": 256, "num_validation": 128, "num_calibration": 64,
    "num_observations": 2, "every_n_epochs": 1, "batch_size": 128,
}  # fmt: skip
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


def parse_arguments(
    description: str, num_observations: int, argv: Sequence[str] | None = None
) -> argparse.Namespace:
    """The examples' command line; sets the torch threads and the seeds. ``--smoke``
    shrinks every size (:data:`SMOKE`) and writes logs and figures to a temporary folder."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--num-simulations", type=int, default=30_000)
    parser.add_argument("--num-calibration", type=int, default=1_000)
    parser.add_argument(
        "--num-observations",
        type=int,
        default=num_observations,
        help="reference observations x_o for the local L-C2ST-NF tests",
    )
    parser.add_argument("--every-n-epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--save-figures", type=Path, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads; small flows gain nothing from more, and on a "
        "shared machine extra threads mostly wait for each other",
    )
    parser.add_argument("--log-dir", type=Path, default=Path("lightning_logs"))
    add_smoke_argument(parser)
    parser.set_defaults(num_validation=2_000, checks=CHECKS)
    args = parser.parse_args(argv)
    if args.smoke:  # the same run at tiny sizes, every output in a temporary folder
        vars(args).update(SMOKE, checks=SMOKE_CHECKS)
        args.log_dir = output_folder(args.log_dir, smoke=True)
        if args.save_figures is not None:
            args.save_figures = args.log_dir / "figures"
    torch.set_num_threads(args.threads)
    L.seed_everything(args.seed, verbose=False)
    return args


def calibration_callbacks(
    theta_cal: Tensor,
    x_cal: Tensor,
    every_n_epochs: int,
    theta_o: Tensor,
    x_o: Tensor,
    labels: Sequence[str],
    reference: Tensor | None = None,
    checks: dict[str, int] = CHECKS,
    log_figures: bool = True,
) -> list[CalibrationCallback]:
    """The calibration checks of the NPE examples; each one logs under calibration/<name>/.

    KCCSD and SBC ranks check calibration on average over x; L-C2ST-NF checks the
    posterior locally, at the reference observations ``x_o`` (with exact posterior
    samples ``reference`` there, shape ``(S, O, D)``, it also logs MMD and the oracle
    C2ST). ``checks`` sets the bootstrap draws, null classifiers and evaluation points;
    ``log_figures=False`` logs scalars only."""
    return [
        KCCSDCallback(
            theta_cal,
            x_cal,
            every_n_epochs=every_n_epochs,
            metric=cl.KCCSD(num_null=checks["kccsd_num_null"], seed=0),
            log_figures=log_figures,
        ),
        RankCalibrationCallback(
            theta_cal,
            x_cal,
            every_n_epochs=every_n_epochs,
            labels=labels,
            log_figures=log_figures,
        ),
        LC2STNFCallback(
            theta_cal,
            x_cal,
            every_n_epochs=every_n_epochs,
            log_figures=log_figures,
            metric=cl.LC2STNF(
                observations=x_o,
                num_null=checks["lc2st_num_null"],
                num_posterior_samples=checks["num_posterior_samples"],
            ),
            truths=theta_o,
            reference_samples=reference,
            # during training the package's torch ensemble is the oracle (about 5x faster
            # per check); the default, sbibm's own c2st protocol, is for benchmarks
            oracle_kwargs={"classifier": "mlp"},
            labels=labels,
        ),
    ]


def simulate(task, args: argparse.Namespace) -> tuple[SimpleNamespace, torch.Generator]:
    """Training, validation (2,000), held-out calibration and "observed" pairs."""
    generator = torch.Generator().manual_seed(args.seed)
    data = SimpleNamespace()
    data.theta, data.x = task.sample(args.num_simulations, generator)
    data.theta_val, data.x_val = task.sample(args.num_validation, generator)
    data.theta_cal, data.x_cal = task.sample(args.num_calibration, generator)  # never trained on
    data.theta_o, data.x_o = task.sample(args.num_observations, generator)
    return data, generator


def fit_and_report(
    model: L.LightningModule,
    checks: Sequence[CalibrationCallback],
    data: SimpleNamespace,
    args: argparse.Namespace,
    name: str,
    figure_prefix: str,
) -> None:
    """Train with the checks, then print the calibration summary and the checks' cost."""
    timer = EpochTimer()
    trainer = L.Trainer(
        max_epochs=args.epochs,
        accelerator="cpu",
        logger=TensorBoardLogger(args.log_dir, name=name),
        callbacks=[*checks, timer],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    start = time.perf_counter()
    trainer.fit(
        model,
        DataLoader(TensorDataset(data.theta, data.x), batch_size=args.batch_size, shuffle=True),
        DataLoader(TensorDataset(data.theta_val, data.x_val), batch_size=2_000),
    )
    total = time.perf_counter() - start

    print("\nCalibration on", args.num_calibration, "held-out pairs")
    print(summary_table(checks))
    print("\nCost of the checks")
    print(overhead_table(checks, timer))
    print(
        f"\ntraining took {total:.0f} s; TensorBoard: tensorboard --logdir {args.log_dir}"
        f"  (run {trainer.logger.log_dir})"
    )
    if args.save_figures is not None:
        save_figures(checks, args.save_figures, figure_prefix)
