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

import math

import lightning as L
import torch
from _common import fit_and_report, parse_arguments, simulate
from nflows.distributions import StandardNormal
from nflows.flows import Flow
from nflows.transforms import (
    CompositeTransform,
    MaskedAffineAutoregressiveTransform,
    PointwiseAffineTransform,
    RandomPermutation,
)
from torch import nn

import calib_lightning as cl
from calib_lightning.callbacks import (
    CalibrationCallback,
    KCCSDCallback,
    LC2STNFCallback,
    RankCalibrationCallback,
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
            MaskedAffineAutoregressiveTransform(
                theta_dim, hidden_features=64, context_features=x_mean.shape[0], num_blocks=2
            ),
            RandomPermutation(theta_dim),
        ]
    return Flow(
        CompositeTransform(transforms),
        StandardNormal([theta_dim]),
        embedding_net=Standardize(x_mean, x_std),
    )


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


def calibration_callbacks(
    theta_cal, x_cal, every_n_epochs: int, theta_o, x_o
) -> list[CalibrationCallback]:
    """The calibration checks; each one logs under calibration/<name>/. SLCP has no
    tractable posterior, so L-C2ST-NF runs without reference samples."""
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
            labels=LABELS,
        ),
    ]


def main() -> None:
    args = parse_arguments(__doc__.split("\n")[0], num_observations=2)
    task = SLCP()
    data, _ = simulate(task, args)
    low, high = task.prior_bounds
    flow = masked_autoregressive_flow(
        task.theta_dim,
        data.x.mean(0),
        data.x.std(0),
        torch.full((task.theta_dim,), low),
        torch.full((task.theta_dim,), high),
    )
    checks = calibration_callbacks(
        data.theta_cal, data.x_cal, args.every_n_epochs, data.theta_o, data.x_o
    )
    fit_and_report(NPE(flow, epochs=args.epochs), checks, data, args, "npe_slcp_nflows", "slcp")


if __name__ == "__main__":
    main()
