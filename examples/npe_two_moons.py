"""Neural posterior estimation on Two Moons, with calibration checked while it trains.

A zuko neural spline flow q(theta | x) is fit by maximum likelihood on simulated
pairs (theta, x). Calibration callbacks test it on held-out pairs every few
epochs, log scalars and figures to TensorBoard, and the script ends with a
calibration summary and the time each check cost.

Run (about a minute on two CPU cores):

    python examples/npe_two_moons.py
    tensorboard --logdir lightning_logs

Options: ``--epochs``, ``--num-simulations``, ``--num-calibration``,
``--every-n-epochs``, ``--save-figures DIR`` (writes each callback's last figures as
PNG), ``--seed``, ``--threads`` (default 1). Only the public API of calib_lightning
is used.
"""

from __future__ import annotations

import lightning as L
import torch
import zuko
from _common import fit_and_report, parse_arguments, simulate

import calib_lightning as cl
from calib_lightning.callbacks import (
    CalibrationCallback,
    KCCSDCallback,
    LC2STNFCallback,
    RankCalibrationCallback,
)
from calib_lightning.tasks import TwoMoons

LABELS = ["theta_1", "theta_2"]


class NPE(L.LightningModule):
    """NPE: maximize log q(theta | x) over simulated pairs. The flow is ``self.flow``,
    where the calibration callbacks look for it by default."""

    def __init__(self, theta_dim: int, x_dim: int, lr: float = 1e-3, epochs: int = 30):
        super().__init__()
        self.save_hyperparameters()
        self.flow = zuko.flows.NSF(theta_dim, x_dim, transforms=3, hidden_features=(64, 64))

    def loss(self, batch):
        theta, x = batch
        return -self.flow(x).log_prob(theta).mean()

    def training_step(self, batch, batch_idx):
        loss = self.loss(batch)
        self.log("train/nll", loss, on_step=False, on_epoch=True)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val/nll", self.loss(batch))

    def configure_optimizers(self):
        optimizer = torch.optim.Adam(self.parameters(), lr=self.hparams.lr)
        schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, self.hparams.epochs)
        return [optimizer], [schedule]


def calibration_callbacks(
    theta_cal, x_cal, every_n_epochs: int, theta_o, x_o, reference
) -> list[CalibrationCallback]:
    """The calibration checks of the demo; each one logs under calibration/<name>/.

    KCCSD and SBC ranks check calibration on average over x; L-C2ST-NF checks the
    posterior locally, at the reference observations ``x_o`` (with the exact Two Moons
    posterior samples ``reference`` it also logs MMD and the oracle C2ST there)."""
    return [
        KCCSDCallback(
            theta_cal,
            x_cal,
            every_n_epochs=every_n_epochs,
            metric=cl.KCCSD(num_bootstrap=500, seed=0),
        ),
        RankCalibrationCallback(theta_cal, x_cal, every_n_epochs=every_n_epochs, labels=LABELS),
        LC2STNFCallback(
            theta_cal,
            x_cal,
            every_n_epochs=every_n_epochs,
            metric=cl.LC2STNF(observations=x_o, num_null=100, num_eval=10_000),
            truths=theta_o,
            reference_samples=reference,
            labels=LABELS,
        ),
    ]


def main() -> None:
    args = parse_arguments(__doc__.split("\n")[0], num_observations=3)
    task = TwoMoons()
    data, generator = simulate(task, args)
    reference = task.reference_posterior_samples(data.x_o, 1_000, generator)  # exact posterior
    checks = calibration_callbacks(
        data.theta_cal, data.x_cal, args.every_n_epochs, data.theta_o, data.x_o, reference
    )
    model = NPE(task.theta_dim, task.x_dim, epochs=args.epochs)
    fit_and_report(model, checks, data, args, "npe_two_moons", "two_moons")


if __name__ == "__main__":
    main()
