"""torchmetrics ``Metric`` classes: state and accumulation over the functional core."""

from calib_lightning.metrics.kccsd import KCCSD

__all__ = ["KCCSD"]
