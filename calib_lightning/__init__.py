"""Calibration diagnostics for neural posterior estimators, for PyTorch Lightning.

Metrics (torchmetrics), their functional cores, and Lightning callbacks that check
a conditional normalizing flow while it trains.
"""

from calib_lightning import classifiers, functional, kernels, tasks
from calib_lightning.metrics import KCCSD, LC2ST, LC2STNF
from calib_lightning.posteriors import Posterior, as_posterior

__all__ = [
    "KCCSD",
    "LC2ST",
    "LC2STNF",
    "Posterior",
    "as_posterior",
    "classifiers",
    "functional",
    "kernels",
    "tasks",
]

__version__ = "0.1.0"
