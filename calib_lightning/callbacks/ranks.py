"""Lightning callback running simulation-based calibration (SBC ranks) while a posterior trains."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from matplotlib.figure import Figure
from torch import Tensor

from calib_lightning.callbacks.base import CalibrationCallback
from calib_lightning.functional.ranks import MOMENT_DRAWS
from calib_lightning.functional.recovery import recovery_from_moments
from calib_lightning.metrics.ranks import RankCalibration, RankCalibrationResult
from calib_lightning.plots.ranks import (
    plot_expected_coverage,
    plot_rank_ecdf,
    plot_rank_histograms,
)
from calib_lightning.plots.recovery import plot_recovery, plot_z_score_contraction

__all__ = ["RankCalibrationCallback"]


class RankCalibrationCallback(CalibrationCallback):
    r"""Streaming SBC every ``every_n_epochs`` epochs: marginal and energy ranks, coverage.

    Logs, under ``{prefix}/ranks/``, the ``logged`` fields of
    :class:`~calib_lightning.functional.sbc.RankCalibrationResult`: ``global_p_value``
    (the verdict: every marginal and joint test combined into one p-value that keeps
    its level; small means miscalibrated somewhere), ``p_value`` (joint energy-rank uniformity),
    ``coverage_error`` (signed area of the expected-coverage curve:
    **negative = over-confident**, positive = under-confident; the convention of
    :mod:`calib_lightning.functional.sbc`),
    ``marginal_p_values/<d>`` and ``ecdf_p_values/<d>`` per dimension (the last
    ``ecdf_p_values`` entry is the joint rank), ``contraction/<d>`` (1 - posterior
    variance / prior variance: 0 for a posterior no sharper than the prior) and
    ``mean_squared_error/<d>`` of the posterior mean. Figures: ``ecdf`` (ECDF - t with
    simultaneous and pointwise bands), ``rank_histograms``, ``expected_coverage``,
    ``recovery`` (posterior mean against the truth, with R^2) and
    ``z_score_contraction`` (posterior z-score against contraction; both from the
    first ``metric.max_pairs`` pairs), and ``history``; histograms ``rank/<d>`` and
    ``rank/joint`` of the raw ranks.

    Arguments:
        theta: calibration parameters ``(N, D)``.
        x: calibration observations ``(N, *X)``.
        metric: a configured :class:`calib_lightning.RankCalibration`; default
            ``RankCalibration(num_posterior_samples=100, num_dims=D)``.
        labels: parameter names for the figures.
        **kwargs: :class:`~calib_lightning.callbacks.CalibrationCallback` arguments.

    Example:
        >>> from calib_lightning.tasks import TwoMoons
        >>> theta, x = TwoMoons().sample(256, torch.Generator().manual_seed(0))
        >>> callback = RankCalibrationCallback(theta, x, every_n_epochs=5)
        >>> callback.metric.num_posterior_samples, callback.metric.num_dims
        (100, 2)

    References:
        Talts et al. "Validating Bayesian inference algorithms with simulation-based
        calibration." arXiv:1804.06788 (2018); Säilynoja, Bürkner, Vehtari (2022).
    """

    name: ClassVar[str] = "ranks"
    history_keys: ClassVar[tuple[str, ...]] = ("global_p_value", "p_value", "coverage_error")
    metric_type: ClassVar[type] = RankCalibration

    def __init__(
        self,
        theta: Tensor | None = None,
        x: Tensor | None = None,
        *,
        metric: RankCalibration | None = None,
        labels: list[str] | None = None,
        **kwargs: Any,
    ) -> None:
        if metric is None:
            num_dims = theta.shape[-1] if isinstance(theta, Tensor) and theta.ndim == 2 else None
            metric = RankCalibration(num_posterior_samples=100, num_dims=num_dims)
        super().__init__(metric, theta, x, **kwargs)
        self.labels = labels

    def figures(self, result: RankCalibrationResult) -> dict[str, Figure]:
        figures = super().figures(result)
        figures["ecdf"] = plot_rank_ecdf(result, labels=self.labels)
        figures["rank_histograms"] = plot_rank_histograms(result, labels=self.labels)
        figures["expected_coverage"] = plot_expected_coverage(result)
        if result.pair_theta is not None:  # the first pairs' posterior moments
            recovered = recovery_from_moments(
                result.pair_mean, result.pair_variance, result.pair_theta,
                result.prior_variance,
                num_posterior_samples=min(self.metric.num_posterior_samples, MOMENT_DRAWS),
            )  # fmt: skip
            figures["recovery"] = plot_recovery(recovered, labels=self.labels)
            figures["z_score_contraction"] = plot_z_score_contraction(recovered, labels=self.labels)
        return figures

    def histograms(self, result: RankCalibrationResult) -> dict[str, Tensor]:
        """Raw ranks, expanded from the histogram counts (``D`` marginals, then the joint)."""
        counts = result.histogram
        values = torch.arange(counts.shape[1], dtype=torch.float32)
        names = [str(d) for d in range(counts.shape[0] - 1)] + ["joint"]
        return {
            f"rank/{name}": values.repeat_interleave(row.to(torch.long))
            for name, row in zip(names, counts, strict=True)
        }
