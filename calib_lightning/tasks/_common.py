"""Shared pieces of the toy simulators."""

from __future__ import annotations

import torch
from torch import Tensor
from torch.distributions import Distribution, Independent, Normal

__all__ = ["normal"]


def normal(loc: Tensor, scale: Tensor | float) -> Distribution:
    scale = torch.as_tensor(scale, dtype=loc.dtype, device=loc.device).expand_as(loc)
    return Independent(Normal(loc, scale), 1)
