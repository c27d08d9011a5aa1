"""torchmetrics ``Metric`` classes: state and accumulation over the functional core.

Each ``compute()`` returns a typed result (:class:`~calib_lightning.results.Result`):
:class:`KCCSDResult`, :class:`RankCalibrationResult`, :class:`TARPResult`,
:class:`LC2STResult`, :class:`JointC2STResult`, :class:`FrechetDistanceResult`,
:class:`DensityCoverageResult`, :class:`SupportResult`, :class:`ImportanceCoverageResult`,
:class:`RatioBalanceResult`, :class:`IntervalCoverageResult`.
"""

from calib_lightning.functional.sbc import RankCalibrationResult
from calib_lightning.functional.tarp import TARPResult
from calib_lightning.metrics._local_c2st import LC2STResult, ProbabilityMap
from calib_lightning.metrics.balance import RatioBalance, RatioBalanceResult
from calib_lightning.metrics.importance import ImportanceCoverage, ImportanceCoverageResult
from calib_lightning.metrics.interval_coverage import IntervalCoverage, IntervalCoverageResult
from calib_lightning.metrics.joint_c2st import JointC2ST, JointC2STResult
from calib_lightning.metrics.kccsd import KCCSD, KCCSDResult
from calib_lightning.metrics.latent import LatentCalibration, LatentCalibrationResult
from calib_lightning.metrics.lc2st import LC2ST, LC2STNF
from calib_lightning.metrics.ranks import RankCalibration
from calib_lightning.metrics.samples import (
    DensityCoverage,
    DensityCoverageResult,
    FrechetDistance,
    FrechetDistanceResult,
)
from calib_lightning.metrics.support import PriorSupport, SupportResult
from calib_lightning.metrics.tarp import TARP

__all__ = [
    "KCCSD",
    "LC2ST",
    "LC2STNF",
    "TARP",
    "DensityCoverage",
    "DensityCoverageResult",
    "FrechetDistance",
    "FrechetDistanceResult",
    "ImportanceCoverage",
    "ImportanceCoverageResult",
    "IntervalCoverage",
    "IntervalCoverageResult",
    "JointC2ST",
    "JointC2STResult",
    "KCCSDResult",
    "LC2STResult",
    "LatentCalibration",
    "LatentCalibrationResult",
    "PriorSupport",
    "ProbabilityMap",
    "RankCalibration",
    "RankCalibrationResult",
    "RatioBalance",
    "RatioBalanceResult",
    "SupportResult",
    "TARPResult",
]
