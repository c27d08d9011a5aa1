"""Pure functions behind the metrics: statistics, tests and their building blocks."""

from calib_lightning.functional.bands import (
    band_coverage,
    ecdf_levels,
    ecdf_test,
    pointwise_band,
    rank_ecdf,
    simultaneous_band,
)
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
from calib_lightning.functional.ranks import (
    PosteriorDraws,
    energy_ranks,
    marginal_ranks,
    posterior_ranks,
    rank_histogram,
    sbc_ranks,
)
from calib_lightning.functional.sbc import (
    coverage_error,
    default_num_bins,
    rank_calibration,
    sharpness,
    summarize_ranks,
    uniformity_test,
)

__all__ = [
    "PosteriorDraws",
    "band_coverage",
    "bootstrap_p_value",
    "coverage_error",
    "default_num_bins",
    "ecdf_levels",
    "ecdf_test",
    "energy_ranks",
    "gaussian_base_points",
    "kccsd",
    "kccsd_matrix",
    "kccsd_test",
    "marginal_ranks",
    "pointwise_band",
    "posterior_ranks",
    "posterior_scores",
    "rademacher",
    "rank_calibration",
    "rank_ecdf",
    "rank_histogram",
    "sbc_ranks",
    "sharpness",
    "simultaneous_band",
    "summarize_ranks",
    "u_statistic",
    "uniformity_test",
    "wild_bootstrap",
]
