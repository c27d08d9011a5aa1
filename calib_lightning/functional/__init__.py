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

__all__ = [
    "bootstrap_p_value",
    "gaussian_base_points",
    "kccsd",
    "kccsd_matrix",
    "kccsd_test",
    "posterior_scores",
    "rademacher",
    "u_statistic",
    "wild_bootstrap",
]
