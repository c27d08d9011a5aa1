"""An NPE for image observations: a small CNN embedding trained with a zuko flow.

:class:`EmbeddedFlow` is what users of embedding networks build: ``self.embedding`` maps
an image ``(N, 1, H, W)`` to ``F`` features, ``self.flow`` is a conditional zuko NSF on
them, and ``forward(x)`` returns the posterior distribution, so
:func:`calib_lightning.as_posterior` and every callback take it as it is, and the
classifier tests can reuse ``self.embedding``.
"""

from __future__ import annotations

import lightning as L
import torch
import zuko
from torch import Tensor, nn
from torch.distributions import Distribution
from torch.utils.data import DataLoader, TensorDataset

__all__ = ["CNN", "EmbeddedFlow", "train_image_npe"]


class CNN(nn.Module):
    """Two strided convolutions and a linear layer: ``(N, 1, H, W) -> (N, features)``."""

    def __init__(self, size: int = 32, features: int = 16) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(1, 8, 5, stride=2, padding=1), nn.ReLU(),
            nn.Conv2d(8, 16, 5, stride=2, padding=2), nn.ReLU(),
            nn.Flatten(), nn.LazyLinear(features),
        )  # fmt: skip
        self.net(torch.zeros(1, 1, size, size))  # materialize the lazy layer

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)


class EmbeddedFlow(nn.Module):
    """``x -> q(theta | embedding(x))``: a CNN embedding and a conditional zuko NSF."""

    def __init__(self, theta_dim: int = 3, size: int = 32, features: int = 16) -> None:
        super().__init__()
        self.embedding = CNN(size, features)
        self.flow = zuko.flows.NSF(theta_dim, features, transforms=3, hidden_features=(64, 64))

    def forward(self, x: Tensor) -> Distribution:
        return self.flow(self.embedding(x))


class _Module(L.LightningModule):
    def __init__(self, model: EmbeddedFlow) -> None:
        super().__init__()
        self.model = model

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        theta, x = batch
        return -self.model(x).log_prob(theta).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def train_image_npe(theta: Tensor, x: Tensor, epochs: int, seed: int = 0) -> EmbeddedFlow:
    """Train an :class:`EmbeddedFlow` on ``(theta, x)`` by maximum likelihood."""
    L.seed_everything(seed, verbose=False)
    model = EmbeddedFlow(theta.shape[1], x.shape[-1])
    module = _Module(model)
    trainer = L.Trainer(max_epochs=epochs, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    trainer.fit(module, DataLoader(TensorDataset(theta, x), batch_size=256, shuffle=True))
    return model.eval()
