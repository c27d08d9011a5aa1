"""torchmetrics ``Metric`` classes: state and accumulation over the functional core."""

from calib_lightning.metrics.kccsd import KCCSD
from calib_lightning.metrics.ranks import RankCalibration
from calib_lightning.metrics.samples import DensityCoverage, FrechetDistance
from calib_lightning.metrics.tarp import TARP

__all__ = ["KCCSD", "TARP", "DensityCoverage", "FrechetDistance", "RankCalibration"]
