"""A posterior built on another one: the base of the recalibrated posteriors."""

from __future__ import annotations

from typing import Any

import torch

from calib_lightning.posteriors._adapt import as_posterior
from calib_lightning.posteriors.base import Posterior

__all__ = ["WrappedPosterior"]


class WrappedPosterior(Posterior):
    """A posterior built on another one (``inner``, any :func:`~calib_lightning.as_posterior`
    input) whose model, dtype, device, shapes, capabilities and costs it keeps unless a
    subclass says otherwise: the base of the recalibrated posteriors."""

    def __init__(self, inner: Any) -> None:
        self.inner = as_posterior(inner)
        super().__init__(self.inner.module)

    @property
    def capabilities(self) -> frozenset[str]:  # type: ignore[override]
        return self.inner.capabilities

    @property
    def costly(self) -> frozenset[str]:  # type: ignore[override]
        return self.inner.costly

    @property
    def dtype(self) -> torch.dtype | None:
        return self.inner.dtype

    @property
    def device(self) -> torch.device | None:
        return self.inner.device

    def event_size(self) -> int | None:
        return self.inner.event_size()

    def context_shape(self) -> tuple[int, ...] | None:
        return self.inner.context_shape()
