"""Lightning callbacks: check a posterior estimator's calibration while it trains.

Each diagnostic is a short subclass of :class:`CalibrationCallback`, which decides
when to check, feeds the held-out pairs to the metric, logs scalars (for
``EarlyStopping`` and ``ModelCheckpoint``) and writes figures to TensorBoard.
"""

from calib_lightning.callbacks.base import CalibrationCallback
from calib_lightning.callbacks.importance import ImportanceCoverageCallback
from calib_lightning.callbacks.interval_coverage import IntervalCoverageCallback
from calib_lightning.callbacks.kccsd import KCCSDCallback
from calib_lightning.callbacks.latent import LatentCalibrationCallback
from calib_lightning.callbacks.lc2st import LC2STNFCallback
from calib_lightning.callbacks.ranks import RankCalibrationCallback
from calib_lightning.callbacks.ratio_balance import RatioBalanceCallback
from calib_lightning.callbacks.recalibration import RecalibrationCallback
from calib_lightning.callbacks.summary import summary_table
from calib_lightning.callbacks.support import PriorSupportCallback
from calib_lightning.callbacks.tarp import TARPCallback

__all__ = [
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
    "summary_table",
]
