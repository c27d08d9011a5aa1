"""torchmetrics ``Metric`` classes: state and accumulation over the functional core."""

from calib_lightning.metrics.kccsd import KCCSD
from calib_lightning.metrics.lc2st import LC2ST, LC2STNF

__all__ = ["KCCSD", "LC2ST", "LC2STNF"]
