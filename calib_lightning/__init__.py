"""Calibration diagnostics for neural posterior estimators, for PyTorch Lightning.

Metrics (torchmetrics), their functional cores, and Lightning callbacks that check
a conditional normalizing flow while it trains.
"""

from calib_lightning import functional, kernels, tasks
from calib_lightning.metrics import (
    KCCSD,
    TARP,
    DensityCoverage,
    FrechetDistance,
    RankCalibration,
)
from calib_lightning.posteriors import Posterior, as_posterior

__all__ = [
    "KCCSD",
    "TARP",
    "DensityCoverage",
    "FrechetDistance",
    "Posterior",
    "RankCalibration",
    "as_posterior",
    "functional",
    "kernels",
    "tasks",
]

__version__ = "0.1.0"
