"""Baselines the benchmarks compare against, kept apart from the user-facing tests.

* :mod:`~calib_lightning.baselines.skce`: the SKCE calibration test (Widmann et al.),
  the predecessor of KCCSD, on Gaussian predictions or on samples.
* :mod:`~calib_lightning.baselines.c2st`: the oracle C2ST, a classifier two-sample
  test between posterior draws and reference draws at the same observation (needs a
  reference posterior, as in sbibm).
"""

from calib_lightning.baselines.c2st import CONVERGED_MLP, OracleC2ST, oracle_c2st
from calib_lightning.baselines.skce import (
    SKCETest,
    gaussian_mmd_sq,
    sample_mmd_sq,
    skce_matrix_gaussian,
    skce_matrix_samples,
    skce_test,
    wasserstein_sq_gaussian,
)

__all__ = [
    "CONVERGED_MLP",
    "OracleC2ST",
    "SKCETest",
    "gaussian_mmd_sq",
    "oracle_c2st",
    "sample_mmd_sq",
    "skce_matrix_gaussian",
    "skce_matrix_samples",
    "skce_test",
    "wasserstein_sq_gaussian",
]
