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
from calib_lightning.functional.reference import compare_to_reference
from calib_lightning.functional.samples import (
    ball_counts,
    density_coverage,
    frechet_distance,
    frechet_distance_from_moments,
    gaussian_moments,
    knn_sq_radii,
    mmd,
    vendi_score,
)
from calib_lightning.functional.tarp import (
    expected_coverage,
    tarp,
    tarp_counts,
    tarp_fit_scale,
    tarp_ranks,
    tarp_references,
    tarp_test,
    uniform_multinomial,
)

__all__ = [
    "ball_counts",
    "bootstrap_p_value",
    "compare_to_reference",
    "density_coverage",
    "expected_coverage",
    "frechet_distance",
    "frechet_distance_from_moments",
    "gaussian_base_points",
    "gaussian_moments",
    "kccsd",
    "kccsd_matrix",
    "kccsd_test",
    "knn_sq_radii",
    "mmd",
    "posterior_scores",
    "rademacher",
    "tarp",
    "tarp_counts",
    "tarp_fit_scale",
    "tarp_ranks",
    "tarp_references",
    "tarp_test",
    "u_statistic",
    "uniform_multinomial",
    "vendi_score",
    "wild_bootstrap",
]
