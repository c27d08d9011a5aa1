"""Neural posterior estimation with a calibration regularizer, in Lightning.

``loss = nll + weight * regularizer(flow, theta, x)`` on every training batch, the two
terms logged separately (``train/nll``, ``train/regularizer``, ``train/loss``), early
stopping on the validation NLL. The regularizer is :class:`calib_lightning.KCCSDLoss`
(or :class:`calib_lightning.CoverageLoss`); both are plain ``nn.Module`` losses, so
adding one to an existing NPE ``LightningModule`` is three lines::

    self.regularizer = cl.KCCSDLoss()                        # in __init__
    reg = self.regularizer(self.flow, theta, x)              # in training_step
    self.log("train/regularizer", reg); loss = nll + self.weight * reg

:func:`regularized_loss` below also shares the flow's forward pass between the NLL and
the latent KCCSD (``latent=``) or the coverage loss (``log_prob=``), which is what
keeps the KCCSD's cost near one extra backward pass.

Run (about a minute on one core)::

    PYTHONPATH=. python examples/npe_regularized.py --weight 10
    tensorboard --logdir lightning_logs

It trains plain NPE and the regularized one on the same simulations (Two Moons,
1,000 by default) and prints the held-out NLL, expected-coverage error and joint-rank
p-value (``cl.RankCalibration``) of both.
"""

from __future__ import annotations

import argparse

import lightning as L
import torch
import zuko
from torch import Tensor, nn
from torch.distributions.transforms import AffineTransform
from torch.utils.data import DataLoader, TensorDataset
from zuko.distributions import NormalizingFlow
from zuko.transforms import ComposedTransform

import calib_lightning as cl
from calib_lightning.losses import CoverageLoss, KCCSDLoss
from calib_lightning.tasks import TwoMoons


class StandardizedFlow(nn.Module):
    """A zuko flow on standardized ``theta`` and ``x``, exposed in raw units.

    ``self(x)`` is a :class:`zuko.distributions.NormalizingFlow` whose transform first
    standardizes ``theta`` (so densities, samples and ``to_latent`` are in raw units).
    """

    def __init__(self, flow: nn.Module, theta: Tensor, x: Tensor) -> None:
        super().__init__()
        self.flow = flow
        self.register_buffer("theta_mean", theta.mean(0))
        self.register_buffer("theta_std", theta.std(0).clamp_min(1e-6))
        self.register_buffer("x_mean", x.mean(0))
        self.register_buffer("x_std", x.std(0).clamp_min(1e-6))

    def forward(self, x: Tensor) -> NormalizingFlow:
        inner = self.flow((x - self.x_mean) / self.x_std)
        scale = 1.0 / self.theta_std
        standardize = AffineTransform(-self.theta_mean * scale, scale, event_dim=1)
        return NormalizingFlow(ComposedTransform(standardize, inner.transform), inner.base)


def build_flow(theta: Tensor, x: Tensor, hidden: int = 64, transforms: int = 3) -> nn.Module:
    """Neural spline flow (coupling layers, as sbi's ``nsf``) standardized on ``theta, x``."""
    flow = zuko.flows.NSF(
        theta.shape[1], x.shape[1], transforms=transforms, passes=2,
        hidden_features=(hidden, hidden),
    )  # fmt: skip
    return StandardizedFlow(flow, theta, x)


def regularized_loss(
    flow: nn.Module, regularizer: nn.Module | None, weight: float, theta: Tensor, x: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """``(nll + weight * regularizer, nll, regularizer)`` on a batch, one flow pass shared."""
    dist = flow(x)
    latent, ladj = dist.transform.call_and_ladj(theta)
    log_prob = dist.base.log_prob(latent) + ladj
    nll = -log_prob.mean()
    if regularizer is None or weight == 0:
        return nll, nll, torch.zeros_like(nll)
    if isinstance(regularizer, KCCSDLoss) and regularizer.space == "latent":
        reg = regularizer(flow, theta, x, latent=latent)
    elif isinstance(regularizer, CoverageLoss):
        reg = regularizer(flow, theta, x, log_prob=log_prob)
    else:
        reg = regularizer(flow, theta, x)
    return nll + weight * reg, nll, reg


class RegularizedNPE(L.LightningModule):
    """NPE whose loss is ``nll + weight * regularizer``; ``weight = 0`` is plain NPE.

    Arguments:
        flow: conditional flow, ``flow(x)`` a distribution over ``theta``.
        regularizer: :class:`~calib_lightning.KCCSDLoss`, :class:`~calib_lightning.CoverageLoss`
            or ``None``.
        weight: the regularizer's weight :math:`\\lambda`.
        lr: Adam learning rate.
    """

    def __init__(
        self, flow: nn.Module, regularizer: nn.Module | None = None, weight: float = 0.0,
        lr: float = 1e-3,
    ) -> None:  # fmt: skip
        super().__init__()
        self.flow, self.regularizer, self.weight, self.lr = flow, regularizer, weight, lr

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        theta, x = batch
        loss, nll, reg = regularized_loss(self.flow, self.regularizer, self.weight, theta, x)
        self.log("train/nll", nll, on_step=False, on_epoch=True)
        self.log("train/regularizer", reg, on_step=False, on_epoch=True)
        self.log("train/loss", loss, on_step=False, on_epoch=True, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        theta, x = batch
        self.log("val/nll", -self.flow(x).log_prob(theta).mean(), prog_bar=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.flow.parameters(), lr=self.lr)


def train(
    theta: Tensor, x: Tensor, regularizer: nn.Module | None, weight: float, seed: int,
    max_epochs: int = 200, patience: int = 20,
) -> nn.Module:  # fmt: skip
    """Fit a standardized NSF with early stopping on a 10% validation split."""
    L.seed_everything(seed, verbose=False)
    order = torch.randperm(len(theta))
    n_val = len(theta) // 10
    val, fit = order[:n_val], order[n_val:]
    flow = build_flow(theta[fit], x[fit])
    model = RegularizedNPE(flow, regularizer, weight)
    stop = L.pytorch.callbacks.EarlyStopping("val/nll", patience=patience)
    best = L.pytorch.callbacks.ModelCheckpoint(monitor="val/nll", save_weights_only=True)
    trainer = L.Trainer(
        max_epochs=max_epochs, callbacks=[stop, best], enable_progress_bar=False,
        enable_model_summary=False, gradient_clip_val=5.0, log_every_n_steps=1,
        logger=L.pytorch.loggers.TensorBoardLogger("lightning_logs", name="npe_regularized"),
    )  # fmt: skip
    trainer.fit(
        model,
        DataLoader(TensorDataset(theta[fit], x[fit]), batch_size=128, shuffle=True),
        DataLoader(TensorDataset(theta[val], x[val]), batch_size=len(val)),
    )
    state = torch.load(best.best_model_path, weights_only=True)["state_dict"]
    model.load_state_dict(state)
    return model.flow.eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-simulations", type=int, default=1000)
    parser.add_argument("--weight", type=float, default=10.0)
    parser.add_argument("--max-epochs", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    task = TwoMoons()
    theta, x = task.sample(args.num_simulations, torch.Generator().manual_seed(args.seed))
    theta_test, x_test = task.sample(1000, torch.Generator().manual_seed(10_000 + args.seed))
    for name, regularizer, weight in [
        ("plain NPE", None, 0.0),
        (f"NPE + {args.weight:g} * KCCSD", KCCSDLoss(), args.weight),
    ]:
        flow = train(theta, x, regularizer, weight, args.seed, args.max_epochs)
        with torch.no_grad():
            nll = -flow(x_test).log_prob(theta_test).mean()
        ranks = cl.RankCalibration(num_posterior_samples=200)
        ranks.update(flow, theta_test, x_test)
        out = ranks.compute()
        print(
            f"{name:24s} held-out NLL {float(nll):7.3f}   coverage error "
            f"{float(out['coverage_error']):+.3f} (< 0: over-confident)   "
            f"joint-rank p-value {float(out['p_value']):.3f}"
        )


if __name__ == "__main__":
    main()
