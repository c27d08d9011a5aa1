"""torchmetrics ``Metric`` classes: state and accumulation over the functional core."""

from calib_lightning.metrics.kccsd import KCCSD
from calib_lightning.metrics.ranks import RankCalibration

__all__ = ["KCCSD", "RankCalibration"]
