"""Calibration diagnostics for neural posterior estimators, for PyTorch Lightning.

Metrics (torchmetrics), their functional cores, and Lightning callbacks that check
a conditional normalizing flow while it trains.
"""

import importlib as _importlib
from typing import Any as _Any

from calib_lightning import (
    baselines,
    classifiers,
    evaluation,
    functional,
    kernels,
    losses,
    recalibration,
    tasks,
)
from calib_lightning.evaluation._memory import get_memory_budget, set_memory_budget
from calib_lightning.losses import (
    BalancingLoss,
    CoverageLoss,
    KCCSDLoss,
    LatentCoverageLoss,
)
from calib_lightning.metrics import (
    KCCSD,
    LC2ST,
    LC2STNF,
    TARP,
    DensityCoverage,
    FrechetDistance,
    ImportanceCoverage,
    IntervalCoverage,
    JointC2ST,
    LatentCalibration,
    PriorSupport,
    RankCalibration,
    RatioBalance,
)
from calib_lightning.misspecification import MisspecificationResult, misspecification_test
from calib_lightning.posteriors import (
    Posterior,
    SamplePosterior,
    UnnormalizedPosterior,
    as_posterior,
)
from calib_lightning.recalibration import (
    ConformalRegion,
    LatentScale,
    RecalibratedPosterior,
    TruncatedPosterior,
    recalibrate,
)

# Lightning and matplotlib load on first use, so `import calib_lightning` stays light.
_LAZY_MODULES = ("callbacks", "diagnosis", "plots")
_LAZY_DIAGNOSIS = ("Diagnosis", "diagnose")
_LAZY_CALLBACKS = (
    "CalibrationCallback",
    "ImportanceCoverageCallback",
    "IntervalCoverageCallback",
    "KCCSDCallback",
    "LC2STNFCallback",
    "LatentCalibrationCallback",
    "PriorSupportCallback",
    "RankCalibrationCallback",
    "RatioBalanceCallback",
    "RecalibrationCallback",
    "TARPCallback",
)

__all__ = [
    "KCCSD",
    "LC2ST",
    "LC2STNF",
    "TARP",
    "BalancingLoss",
    "CalibrationCallback",
    "ConformalRegion",
    "CoverageLoss",
    "DensityCoverage",
    "Diagnosis",
    "FrechetDistance",
    "ImportanceCoverage",
    "ImportanceCoverageCallback",
    "IntervalCoverage",
    "IntervalCoverageCallback",
    "JointC2ST",
    "KCCSDCallback",
    "KCCSDLoss",
    "LC2STNFCallback",
    "LatentCalibration",
    "LatentCalibrationCallback",
    "LatentCoverageLoss",
    "LatentScale",
    "MisspecificationResult",
    "Posterior",
    "PriorSupport",
    "PriorSupportCallback",
    "RankCalibration",
    "RankCalibrationCallback",
    "RatioBalance",
    "RatioBalanceCallback",
    "RecalibratedPosterior",
    "RecalibrationCallback",
    "SamplePosterior",
    "TARPCallback",
    "TruncatedPosterior",
    "UnnormalizedPosterior",
    "as_posterior",
    "baselines",
    "callbacks",
    "classifiers",
    "diagnose",
    "diagnosis",
    "evaluation",
    "functional",
    "get_memory_budget",
    "kernels",
    "losses",
    "misspecification_test",
    "plots",
    "recalibrate",
    "recalibration",
    "set_memory_budget",
    "tasks",
]

__version__ = "0.1.0"


def __getattr__(name: str) -> _Any:
    if name in _LAZY_MODULES:
        return _importlib.import_module(f"calib_lightning.{name}")
    if name in _LAZY_DIAGNOSIS:
        return getattr(_importlib.import_module("calib_lightning.diagnosis"), name)
    if name in _LAZY_CALLBACKS:
        return getattr(_importlib.import_module("calib_lightning.callbacks"), name)
    raise AttributeError(f"module 'calib_lightning' has no attribute {name!r}")
