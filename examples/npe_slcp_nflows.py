"""Neural posterior estimation on SLCP with an nflows masked autoregressive flow.

The same workflow as ``npe_two_moons.py`` with the other flow library: an nflows
``Flow`` (affine MADE layers, conditioned on standardized ``x`` through its
embedding net) is trained on the SLCP task (5 parameters, 8-dimensional
observations, a four-mode posterior) while calibration callbacks check it on
held-out pairs. The callbacks find the flow at ``pl_module.flow`` and wrap it with
:func:`calib_lightning.as_posterior`, which recognizes nflows flows.

Run (about a minute on two CPU cores):

    python examples/npe_slcp_nflows.py
    tensorboard --logdir lightning_logs

Only the public API of calib_lightning is used.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from nflows.distributions import StandardNormal
from nflows.flows import Flow
from nflows.transforms import (
    CompositeTransform,
    MaskedAffineAutoregressiveTransform,
    PointwiseAffineTransform,
    RandomPermutation,
)
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import calib_lightning as cl
from calib_lightning.callbacks import (
    CalibrationCallback,
    KCCSDCallback,
    RankCalibrationCallback,
    summary_table,
)
from calib_lightning.tasks import SLCP

LABELS = [f"theta_{i}" for i in range(1, 6)]


class Standardize(nn.Module):
    """Fixed affine map ``(x - mean) / std`` (an embedding net without parameters)."""

    def __init__(self, mean, std):
        super().__init__()
        self.register_buffer("mean", mean)
        self.register_buffer("std", std)

    def forward(self, x):
        return (x - self.mean) / self.std


def masked_autoregressive_flow(theta_dim, x_mean, x_std, theta_low, theta_high, layers=5):
    """MAF for q(theta | x): theta is standardized to the prior's mean and sd first."""
    theta_mean = (theta_low + theta_high) / 2
    theta_std = (theta_high - theta_low) / math.sqrt(12.0)
    transforms = [PointwiseAffineTransform(-theta_mean / theta_std, 1.0 / theta_std)]
    for _ in range(layers):
        transforms += [
            MaskedAffineAutoregressiveTransform(theta_dim, hidden_features=64,
                                                context_features=x_mean.shape[0], num_blocks=2),
            RandomPermutation(theta_dim),
        ]
    return Flow(CompositeTransform(transforms), StandardNormal([theta_dim]),
                embedding_net=Standardize(x_mean, x_std))


class NPE(L.LightningModule):
    """NPE: maximize log q(theta | x). The calibration callbacks find ``self.flow``."""

    def __init__(self, flow: Flow, lr: float = 1e-3, epochs: int = 20):
        super().__init__()
        self.flow, self.lr, self.epochs = flow, lr, epochs

    def loss(self, batch):
        theta, x = batch
        return -self.flow.log_prob(theta, context=x).mean()

    def training_step(self, batch, batch_idx):
        loss = self.loss(batch)
        self.log("train/nll", loss, on_step=False, on_epoch=True)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val/nll", self.loss(batch))

    def configure_optimizers(self):
        optimizer = torch.optim.Adam(self.parameters(), lr=self.lr)
        schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, self.epochs)
        return [optimizer], [schedule]


def calibration_callbacks(theta_cal, x_cal, every_n_epochs: int) -> list[CalibrationCallback]:
    """The calibration checks; each one logs under calibration/<name>/."""
    return [
        KCCSDCallback(theta_cal, x_cal, every_n_epochs=every_n_epochs,
                      metric=cl.KCCSD(num_bootstrap=500, seed=0)),
        RankCalibrationCallback(theta_cal, x_cal, every_n_epochs=every_n_epochs,
                                labels=LABELS),
        # TODO(issue 4): LC2STNFCallback(theta_cal, x_cal, observations=x_o, every_n_epochs=...)
    ]


class EpochTimer(L.Callback):
    """Wall time of each training epoch (validation included), to put checks in proportion."""

    def __init__(self) -> None:
        self.seconds: list[float] = []

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        self._start = time.perf_counter()

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self.seconds.append(time.perf_counter() - self._start)
        metrics = trainer.callback_metrics
        line = f"epoch {trainer.current_epoch:3d}  {self.seconds[-1]:5.1f} s"
        for key in ("train/nll", "val/nll", "calibration/kccsd/p_value"):
            if key in metrics:
                line += f"  {key} {float(metrics[key]):.4g}"
        print(line, flush=True)


def overhead_table(checks: list[CalibrationCallback], timer: EpochTimer) -> str:
    """Median seconds per check, and as a fraction of the median epoch without checks."""
    per_epoch = statistics.median(
        seconds - sum(c.seconds[c.epochs.index(epoch)] for c in checks if epoch in c.epochs)
        for epoch, seconds in enumerate(timer.seconds)
    )
    lines = [f"{'check':10s} {'checks':>6s} {'s/check':>8s} {'fraction of an epoch':>21s}"]
    for c in checks:
        median = statistics.median(c.seconds) if c.seconds else math.nan
        lines.append(f"{c.tag_name:10s} {len(c.seconds):6d} {median:8.2f} "
                     f"{median / per_epoch:21.1%}")
    lines.append(f"(median epoch without checks: {per_epoch:.2f} s)")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--num-simulations", type=int, default=30_000)
    parser.add_argument("--num-calibration", type=int, default=1_000)
    parser.add_argument("--every-n-epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--save-figures", type=Path, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads; small flows gain nothing from more, and on a "
                             "shared machine extra threads mostly wait for each other")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    L.seed_everything(args.seed, verbose=False)
    task = SLCP()
    generator = torch.Generator().manual_seed(args.seed)
    theta, x = task.sample(args.num_simulations, generator)
    theta_val, x_val = task.sample(2_000, generator)
    theta_cal, x_cal = task.sample(args.num_calibration, generator)  # never trained on

    low, high = task.prior_bounds
    flow = masked_autoregressive_flow(task.theta_dim, x.mean(0), x.std(0),
                                      torch.full((task.theta_dim,), low),
                                      torch.full((task.theta_dim,), high))
    checks = calibration_callbacks(theta_cal, x_cal, args.every_n_epochs)
    timer = EpochTimer()
    trainer = L.Trainer(
        max_epochs=args.epochs,
        accelerator="cpu",
        logger=TensorBoardLogger("lightning_logs", name="npe_slcp_nflows"),
        callbacks=[*checks, timer],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    start = time.perf_counter()
    trainer.fit(
        NPE(flow, epochs=args.epochs),
        DataLoader(TensorDataset(theta, x), batch_size=args.batch_size, shuffle=True),
        DataLoader(TensorDataset(theta_val, x_val), batch_size=2_000),
    )
    total = time.perf_counter() - start

    print("\nCalibration on", args.num_calibration, "held-out pairs")
    print(summary_table(checks))
    print("\nCost of the checks")
    print(overhead_table(checks, timer))
    print(f"\ntraining took {total:.0f} s; TensorBoard: tensorboard --logdir lightning_logs"
          f"  (run {trainer.logger.log_dir})")
    if args.save_figures is not None:
        args.save_figures.mkdir(parents=True, exist_ok=True)
        for check in checks:
            for key, figure in check.figures(check.last_result).items():
                path = args.save_figures / f"slcp_{check.tag_name}_{key}.png"
                figure.savefig(path, dpi=110)
                print("wrote", path)


if __name__ == "__main__":
    main()
