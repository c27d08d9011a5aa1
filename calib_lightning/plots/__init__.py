"""Matplotlib figures for TensorBoard and files, one module per diagnostic.

Every function returns a :class:`matplotlib.figure.Figure` and never calls
``plt.show``, so callbacks can hand it to ``SummaryWriter.add_figure``.
"""

from calib_lightning.plots.conformal import plot_conformal_region
from calib_lightning.plots.history import plot_history
from calib_lightning.plots.importance import plot_importance_coverage
from calib_lightning.plots.lc2st import plot_pp, plot_probability_map
from calib_lightning.plots.misspecification import plot_misspecification
from calib_lightning.plots.ranks import (
    plot_expected_coverage,
    plot_rank_ecdf,
    plot_rank_histograms,
)
from calib_lightning.plots.recovery import plot_recovery, plot_z_score_contraction
from calib_lightning.plots.tarp import plot_tarp

__all__ = [
    "plot_conformal_region",
    "plot_expected_coverage",
    "plot_history",
    "plot_importance_coverage",
    "plot_misspecification",
    "plot_pp",
    "plot_probability_map",
    "plot_rank_ecdf",
    "plot_rank_histograms",
    "plot_recovery",
    "plot_tarp",
    "plot_z_score_contraction",
]
