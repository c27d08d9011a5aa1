"""Pure functions behind the metrics: statistics, tests and their building blocks."""

from calib_lightning.functional.kccsd import (
    bootstrap_p_value,
    gaussian_base_points,
    kccsd,
    kccsd_matrix,
    kccsd_test,
    posterior_scores,
    rademacher,
    u_statistic,
    wild_bootstrap,
)
from calib_lightning.functional.skce import (
    gaussian_mmd_sq,
    sample_mmd_sq,
    skce_matrix_gaussian,
    skce_matrix_samples,
    skce_test,
    wasserstein_sq_gaussian,
)

__all__ = [
    "bootstrap_p_value",
    "gaussian_base_points",
    "gaussian_mmd_sq",
    "kccsd",
    "kccsd_matrix",
    "kccsd_test",
    "posterior_scores",
    "rademacher",
    "sample_mmd_sq",
    "skce_matrix_gaussian",
    "skce_matrix_samples",
    "skce_test",
    "u_statistic",
    "wasserstein_sq_gaussian",
    "wild_bootstrap",
]
