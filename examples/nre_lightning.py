"""A neural ratio estimator trained with Lightning, its calibration checked without MCMC.

A classifier between joint pairs (theta, x) and shuffled ones learns the
likelihood-to-evidence ratio r(theta, x) (NRE-A, Hermans et al. 2020); its posterior
r(theta, x) p(theta) is known only up to a constant, so no check here draws a posterior
sample. Three callbacks test it on held-out pairs every few epochs and log to TensorBoard:

* KCCSD from the posterior's score (in the unconstrained space of the box prior);
* the expected coverage by importance sampling from the prior;
* the balance of the classifier (Delaunoy et al. 2022; a balanced one is not over-confident).

The task is sbibm's Gaussian linear with a uniform prior, in two dimensions (its
posterior is known). After training, ``cl.diagnose`` runs every check a ratio estimator
supports on fresh pairs (and the misspecification test at three observations), lists the
checks that need posterior samples as skipped, and writes its HTML report.
``--balance-weight 100`` trains a balanced NRE (BNRE) instead.

Run (about a minute on two CPU cores):

    python examples/nre_lightning.py
    tensorboard --logdir lightning_logs

Options: ``--epochs``, ``--num-simulations``, ``--num-calibration``,
``--every-n-epochs``, ``--balance-weight``, ``--seed``, ``--threads`` (default 1),
``--log-dir`` (default ``lightning_logs``), ``--smoke`` (tiny sizes, seconds; logs and the
report in a temporary folder). Only the public API of calib_lightning is used.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

if not __package__:  # run as a file (python examples/x.py): make `examples` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lightning as L
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from torch import Tensor, nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import calib_lightning as cl
from calib_lightning.callbacks import (
    ImportanceCoverageCallback,
    KCCSDCallback,
    RatioBalanceCallback,
    summary_table,
)
from calib_lightning.tasks import GaussianLinearUniform
from examples._smoke import add_smoke_argument, output_folder


class RatioNetwork(nn.Module):
    """``log r(theta, x)``: an MLP on the concatenated pair, ``(M, D), (M, X) -> (M,)``."""

    def __init__(self, theta_dim: int, x_dim: int, hidden: int = 64) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(theta_dim + x_dim, hidden), nn.SiLU(),
            nn.Linear(hidden, hidden), nn.SiLU(),
            nn.Linear(hidden, 1),
        )  # fmt: skip

    def forward(self, theta: Tensor, x: Tensor) -> Tensor:
        return self.net(torch.cat([theta, x], -1)).squeeze(-1)


class NRE(L.LightningModule):
    """NRE-A: logistic regression of joint pairs against pairs with ``theta`` shuffled in
    the batch, on the logit ``log r``; with ``balance_weight > 0`` the balancing penalty
    of BNRE, ``(E_joint[sigmoid] + E_marginal[sigmoid] - 1)^2``."""

    def __init__(self, theta_dim: int, x_dim: int, balance_weight: float = 0.0) -> None:
        super().__init__()
        self.ratio = RatioNetwork(theta_dim, x_dim)  # where the callbacks find it
        self.balance_weight = balance_weight

    def loss(self, theta: Tensor, x: Tensor) -> Tensor:
        joint = self.ratio(theta, x)
        marginal = self.ratio(theta.roll(1, 0), x)
        loss = F.softplus(-joint).mean() + F.softplus(marginal).mean()
        if self.balance_weight > 0:
            balance = torch.sigmoid(joint).mean() + torch.sigmoid(marginal).mean() - 1
            loss = loss + self.balance_weight * balance**2
        return loss

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss = self.loss(*batch)
        self.log("train/loss", loss, prog_bar=False)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self.log("val/loss", self.loss(*batch))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def parse_arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--num-simulations", type=int, default=20_000)
    parser.add_argument("--num-calibration", type=int, default=1_000)
    parser.add_argument("--every-n-epochs", type=int, default=2)
    parser.add_argument("--balance-weight", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--log-dir", type=Path, default=Path("lightning_logs"))
    add_smoke_argument(parser)
    args = parser.parse_args(argv)
    if args.smoke:
        args.epochs, args.num_simulations, args.num_calibration = 2, 1_000, 200
        args.every_n_epochs = 1
        args.log_dir = output_folder(args.log_dir, smoke=True)
    torch.set_num_threads(args.threads)
    L.seed_everything(args.seed, verbose=False)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_arguments(argv)
    task = GaussianLinearUniform(dim=2)
    prior = task.prior()
    generator = torch.Generator().manual_seed(args.seed)
    theta, x = task.sample(args.num_simulations, generator)
    theta_val, x_val = task.sample(2_000, generator)
    theta_cal, x_cal = task.sample(args.num_calibration, generator)  # never trained on
    theta_test, x_test = task.sample(args.num_calibration, generator)  # for cl.diagnose
    x_o = task.sample(3, generator)[1]  # observations to analyse

    every = {"every_n_epochs": args.every_n_epochs, "estimator": "ratio"}
    checks = [
        KCCSDCallback(theta_cal, x_cal, prior=prior, **every),
        ImportanceCoverageCallback(theta_cal, x_cal, prior=prior, **every),
        RatioBalanceCallback(theta_cal, x_cal, **every),
    ]
    model = NRE(task.theta_dim, task.x_dim, balance_weight=args.balance_weight)
    name = "bnre_lightning" if args.balance_weight > 0 else "nre_lightning"
    trainer = L.Trainer(
        max_epochs=args.epochs, accelerator="cpu", callbacks=checks,
        logger=TensorBoardLogger(args.log_dir, name=name), enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False,
    )  # fmt: skip
    start = time.perf_counter()
    trainer.fit(
        model,
        DataLoader(TensorDataset(theta, x), batch_size=256, shuffle=True),
        DataLoader(TensorDataset(theta_val, x_val), batch_size=2_000),
    )
    print(f"\ntraining took {time.perf_counter() - start:.0f} s; TensorBoard: "
          f"tensorboard --logdir {args.log_dir}  (run {trainer.logger.log_dir})")  # fmt: skip
    print("\nCalibration on", args.num_calibration, "held-out pairs, while it trained")
    print(summary_table(checks))

    # After training: every check a ratio estimator supports, one verdict, one report.
    # The log-ratio is a plain network here, so the balance test is named; the checks
    # that need posterior samples are listed as skipped, with the reason.
    posterior = cl.UnnormalizedPosterior(model.ratio.eval(), prior=prior)  # r(theta, x) p(theta)
    diagnosis = cl.diagnose(posterior, theta_test, x_test, observations=x_o,
                            checks=["kccsd", "coverage_is", "balance", "misspecification"])
    print("\nAfter training, on", len(theta_test), "fresh pairs:", diagnosis.verdict)
    print(diagnosis.table())
    print("report:", diagnosis.save(Path(trainer.logger.log_dir) / "diagnosis"))


if __name__ == "__main__":
    main()
