"""The checks of ``cl.diagnose``, one module each, and the registry that orders them.

Every part of a diagnosis (the plan, the random streams, the verdict sentence, the table,
the figures, the HTML report, the before/after comparison) loops over :data:`REGISTRY`;
nothing outside a check's module names it. Adding a diagnostic is one module here and one
line below (``CONTRIBUTING.md``, "Add a diagnostic").
"""

from __future__ import annotations

from calib_lightning.diagnosis._check import Check
from calib_lightning.diagnosis.checks.balance import BalanceCheck
from calib_lightning.diagnosis.checks.coverage_is import COVERAGE_IS_SAMPLES, CoverageISCheck
from calib_lightning.diagnosis.checks.interval_coverage import IntervalCoverageCheck
from calib_lightning.diagnosis.checks.joint_c2st import JointC2STCheck
from calib_lightning.diagnosis.checks.kccsd import KCCSDCheck
from calib_lightning.diagnosis.checks.local import (
    MAP_NUM_POSTERIOR_SAMPLES,
    LC2STCheck,
    LC2STNFCheck,
    local_num_null,
)
from calib_lightning.diagnosis.checks.misspecification import MisspecificationCheck
from calib_lightning.diagnosis.checks.ranks import RanksCheck
from calib_lightning.diagnosis.checks.recovery import RecoveryCheck
from calib_lightning.diagnosis.checks.reference import ReferenceCheck
from calib_lightning.diagnosis.checks.support import SupportCheck
from calib_lightning.diagnosis.checks.tarp import TARPCheck

__all__ = [
    "CHECKS",
    "COVERAGE_IS_SAMPLES",
    "DRAWS_STREAM",
    "MAP_NUM_POSTERIOR_SAMPLES",
    "REGION_STREAM",
    "REGISTRY",
    "by_name",
    "local_num_null",
]

#: every check, in the order of the report
REGISTRY: tuple[Check, ...] = (
    KCCSDCheck(),
    RanksCheck(),
    TARPCheck(),
    JointC2STCheck(),
    RecoveryCheck(),
    LC2STNFCheck(),
    LC2STCheck(),
    MisspecificationCheck(),
    SupportCheck(),
    CoverageISCheck(),
    BalanceCheck(),
    IntervalCoverageCheck(),
    ReferenceCheck(),
)

#: the names ``cl.diagnose(..., checks=...)`` takes, in the order of the report
CHECKS = tuple(check.name for check in REGISTRY if check.selectable)

#: the random streams of the shared draws and of the conformal region's summary (each
#: check has its own: ``Check.stream``)
DRAWS_STREAM, REGION_STREAM = 1, 10


def by_name(name: str) -> Check:
    """The registered check called ``name`` (a ``KeyError`` if none is)."""
    for check in REGISTRY:
        if check.name == name:
            return check
    raise KeyError(name)


_streams = [DRAWS_STREAM, REGION_STREAM, *(check.stream for check in REGISTRY)]
if len(set(_streams)) != len(_streams):  # pragma: no cover - a registration mistake
    raise RuntimeError(f"every check needs its own random stream, got {_streams}")
