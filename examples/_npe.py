"""The NPE model the examples and benchmarks share: one LightningModule and its flows.

:class:`NPE` maximizes :math:`\\log q(\\theta \\mid x)` of a conditional flow kept at
``self.flow`` (where the calibration callbacks look for it), optionally plus a
calibration regularizer, ``loss = nll + weight * regularizer(flow, theta, x)``. The flow
is built outside: a zuko flow (``flow(x)`` a distribution), :func:`build_flow` (a zuko
NSF on standardized ``theta`` and ``x``) or :func:`masked_autoregressive_flow` (nflows).
Only the public API of calib_lightning is used.
"""

from __future__ import annotations

import math

import lightning as L
import torch
import zuko
from nflows.distributions import StandardNormal
from nflows.flows import Flow
from nflows.transforms import (
    CompositeTransform,
    MaskedAffineAutoregressiveTransform,
    PointwiseAffineTransform,
    RandomPermutation,
)
from torch import Tensor, nn
from torch.distributions.transforms import AffineTransform
from zuko.distributions import NormalizingFlow
from zuko.transforms import ComposedTransform

from calib_lightning.losses import (
    BalancingLoss,
    CoverageLoss,
    KCCSDLoss,
    LatentCoverageLoss,
    log_prob_and_latent,
)

__all__ = [
    "NPE",
    "Standardize",
    "StandardizedFlow",
    "build_flow",
    "log_prob",
    "masked_autoregressive_flow",
    "regularized_loss",
]


def log_prob(flow: nn.Module, theta: Tensor, x: Tensor) -> Tensor:
    """:math:`\\log q(\\theta \\mid x)`, shape ``(N,)``, of a zuko-style flow (``flow(x)`` a
    distribution) or an nflows ``Flow``; ``theta`` ``(N, D)``, ``x`` ``(N, X)``."""
    if isinstance(flow, Flow):
        return flow.log_prob(theta, context=x)
    return flow(x).log_prob(theta)


def regularized_loss(
    flow: nn.Module, regularizer: nn.Module | None, weight: float, theta: Tensor, x: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """``(nll + weight * regularizer, nll, regularizer)`` on a batch.

    The flow runs once: :func:`calib_lightning.losses.log_prob_and_latent` gives the
    log-density for the NLL and the latent, and the regularizer takes whichever of the two
    it uses (``latent=`` for the latent losses, ``log_prob=`` for the coverage and
    balancing losses). Other regularizers evaluate the flow themselves.
    """
    log_q, latent = log_prob_and_latent(flow, theta, x)
    nll = -log_q.mean()
    if regularizer is None or weight == 0:
        return nll, nll, torch.zeros_like(nll)
    if isinstance(regularizer, LatentCoverageLoss) or (
        isinstance(regularizer, KCCSDLoss) and regularizer.space == "latent"
    ):
        reg = regularizer(flow, theta, x, latent=latent)
    elif isinstance(regularizer, CoverageLoss | BalancingLoss):
        reg = regularizer(flow, theta, x, log_prob=log_q)
    else:
        reg = regularizer(flow, theta, x)
    return nll + weight * reg, nll, reg


class NPE(L.LightningModule):
    """NPE: minimize ``nll + weight * regularizer`` over simulated pairs ``(theta, x)``.

    Arguments:
        flow: conditional flow, a zuko flow (``flow(x)`` a distribution over ``theta``)
            or an nflows ``Flow``; kept at ``self.flow``.
        regularizer: :class:`~calib_lightning.KCCSDLoss`,
            :class:`~calib_lightning.CoverageLoss` or ``None`` (plain NPE); with one,
            the flow must be a zuko flow (see :func:`regularized_loss`).
        weight: the regularizer's weight :math:`\\lambda`.
        lr: Adam learning rate.
        epochs: if given, the learning rate follows a cosine schedule over this many
            epochs; otherwise it stays constant.
    """

    def __init__(
        self, flow: nn.Module, regularizer: nn.Module | None = None, weight: float = 0.0,
        lr: float = 1e-3, epochs: int | None = None,
    ) -> None:  # fmt: skip
        super().__init__()
        self.save_hyperparameters(ignore=["flow", "regularizer"])
        self.flow, self.regularizer = flow, regularizer
        self.weight, self.lr, self.epochs = weight, lr, epochs

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        theta, x = batch
        if self.regularizer is None:
            loss = -log_prob(self.flow, theta, x).mean()
            self.log("train/nll", loss, on_step=False, on_epoch=True)
            return loss
        loss, nll, reg = regularized_loss(self.flow, self.regularizer, self.weight, theta, x)
        self.log("train/nll", nll, on_step=False, on_epoch=True)
        self.log("train/regularizer", reg, on_step=False, on_epoch=True)
        self.log("train/loss", loss, on_step=False, on_epoch=True, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        theta, x = batch
        self.log("val/nll", -log_prob(self.flow, theta, x).mean(), prog_bar=True)

    def configure_optimizers(self) -> object:
        optimizer = torch.optim.Adam(self.flow.parameters(), lr=self.lr)
        if self.epochs is None:
            return optimizer
        schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, self.epochs)
        return [optimizer], [schedule]


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


class Standardize(nn.Module):
    """Fixed affine map ``(x - mean) / std`` (an embedding net without parameters)."""

    def __init__(self, mean: Tensor, std: Tensor) -> None:
        super().__init__()
        self.register_buffer("mean", mean)
        self.register_buffer("std", std)

    def forward(self, x: Tensor) -> Tensor:
        return (x - self.mean) / self.std


def masked_autoregressive_flow(
    theta_dim: int, x_mean: Tensor, x_std: Tensor, theta_low: Tensor, theta_high: Tensor,
    layers: int = 5,
) -> Flow:  # fmt: skip
    """nflows MAF for q(theta | x) with a uniform prior on ``[theta_low, theta_high]``:
    theta is standardized to the prior's mean and sd first, x by ``x_mean, x_std``."""
    theta_mean = (theta_low + theta_high) / 2
    theta_std = (theta_high - theta_low) / math.sqrt(12.0)
    steps = [PointwiseAffineTransform(-theta_mean / theta_std, 1.0 / theta_std)]
    for _ in range(layers):
        steps += [
            MaskedAffineAutoregressiveTransform(
                theta_dim, hidden_features=64, context_features=x_mean.shape[0], num_blocks=2
            ),
            RandomPermutation(theta_dim),
        ]
    return Flow(
        CompositeTransform(steps),
        StandardNormal([theta_dim]),
        embedding_net=Standardize(x_mean, x_std),
    )
