"""Pure functions behind the metrics: statistics, tests and their building blocks."""

from calib_lightning.functional.c2st import oracle_c2st
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
from calib_lightning.functional.lc2st import (
    lc2st_nf_null,
    lc2st_nf_train,
    lc2st_p_value,
    lc2st_probabilities,
    lc2st_statistic,
    lc2st_train,
    pp_band,
    pp_ecdf,
)

__all__ = [
    "bootstrap_p_value",
    "gaussian_base_points",
    "kccsd",
    "kccsd_matrix",
    "kccsd_test",
    "lc2st_nf_null",
    "lc2st_nf_train",
    "lc2st_p_value",
    "lc2st_probabilities",
    "lc2st_statistic",
    "lc2st_train",
    "oracle_c2st",
    "posterior_scores",
    "pp_band",
    "pp_ecdf",
    "rademacher",
    "u_statistic",
    "wild_bootstrap",
]
