"""Lightning callback running simulation-based calibration (SBC ranks) while a posterior trains."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from matplotlib.figure import Figure
from torch import Tensor

from calib_lightning.callbacks.base import CalibrationCallback
from calib_lightning.functional.combine import holm_adjust
from calib_lightning.functional.ranks import MOMENT_DRAWS
from calib_lightning.functional.recovery import recovery_from_moments
from calib_lightning.metrics.ranks import RankCalibration, RankCalibrationResult
from calib_lightning.plots._grid import as_indices, select_parameters
from calib_lightning.plots.ranks import (
    plot_expected_coverage,
    plot_rank_ecdf,
    plot_rank_histograms,
)
from calib_lightning.plots.recovery import plot_recovery, plot_z_score_contraction

__all__ = ["PER_PARAMETER_FIELDS", "RankCalibrationCallback", "parameter_scalars"]

#: result fields with one entry per parameter (``ecdf_p_values``: then the joint rank)
PER_PARAMETER_FIELDS = ("marginal_p_values", "ecdf_p_values", "contraction", "mean_squared_error")
AUTO_MAX_DIMS = 6  # per_parameter="auto": every per-parameter tag up to this many parameters


def _holm_rejections(p_values: Tensor, level: float) -> Tensor:
    """How many of the hypotheses Holm's step-down procedure rejects at ``level``."""
    return (holm_adjust(p_values.double()) <= level).sum()


def parameter_scalars(
    scalars: dict[str, Tensor], result: Any, *, per_parameter: bool | str, level: float
) -> dict[str, Tensor]:
    """Replace the per-parameter tags of a rank-type result by their summary.

    With ``per_parameter`` true (or ``"auto"`` and ``D <= 6``) ``scalars`` is returned
    as it is. Otherwise every ``{field}/<d>`` of :data:`PER_PARAMETER_FIELDS` is
    dropped and these are added, for the fields ``result`` has (1-d, ``(D,)``; for
    ``ecdf_p_values`` ``(D + 1,)``, the last entry the joint rank):

    * ``marginal_p_values/min``, ``ecdf_p_values/min``: the smallest p-value over the
      ``D`` parameters;
    * ``marginal_p_values/num_rejected``, ``ecdf_p_values/num_rejected``: how many
      parameters Holm's procedure rejects at ``level`` (under calibration all are 0
      with probability at least ``1 - level``, whatever ``D``);
    * ``ecdf_p_values/joint``: the joint rank's ECDF test;
    * ``contraction/mean``, ``contraction/min`` (the least-learned parameter);
    * ``mean_squared_error/mean``, ``mean_squared_error/max``.

    Example:
        >>> from types import SimpleNamespace
        >>> result = SimpleNamespace(marginal_p_values=torch.tensor([0.001, 0.3] + [0.5] * 8))
        >>> scalars = {f"marginal_p_values/{d}": p for d, p in enumerate(result.marginal_p_values)}
        >>> out = parameter_scalars(scalars, result, per_parameter="auto", level=0.05)
        >>> {k: round(float(v), 3) for k, v in out.items()}
        {'marginal_p_values/min': 0.001, 'marginal_p_values/num_rejected': 1.0}
    """
    if not (per_parameter is True or per_parameter is False or per_parameter == "auto"):
        raise ValueError(f"per_parameter must be True, False or 'auto', got {per_parameter!r}")
    fields = {name: getattr(result, name, None) for name in PER_PARAMETER_FIELDS}
    fields = {k: v for k, v in fields.items() if isinstance(v, Tensor) and v.ndim == 1}
    if not fields:
        return scalars
    num_dims = max(v.numel() - (k == "ecdf_p_values") for k, v in fields.items())
    if per_parameter is True or (per_parameter == "auto" and num_dims <= AUTO_MAX_DIMS):
        return scalars
    out = {k: v for k, v in scalars.items() if k.split("/")[0] not in fields}
    for name, values in fields.items():
        values = values.detach()
        if name.endswith("p_values"):
            marginal = values[:-1] if name == "ecdf_p_values" else values
            out[f"{name}/min"] = marginal.min()
            out[f"{name}/num_rejected"] = _holm_rejections(marginal, level).to(values.dtype)
            if name == "ecdf_p_values":
                out[f"{name}/joint"] = values[-1]
        elif name == "contraction":
            out[f"{name}/mean"], out[f"{name}/min"] = values.mean(), values.min()
        else:
            out[f"{name}/mean"], out[f"{name}/max"] = values.mean(), values.max()
    return out


class RankCalibrationCallback(CalibrationCallback):
    r"""Streaming SBC every ``every_n_epochs`` epochs: marginal and energy ranks, coverage.

    Logs, under ``{prefix}/ranks/``, the ``logged`` fields of
    :class:`~calib_lightning.functional.sbc.RankCalibrationResult`: ``global_p_value``
    (the verdict: every marginal and joint test combined into one p-value that keeps
    its level; small means miscalibrated somewhere), ``p_value`` (joint energy-rank uniformity),
    ``coverage_error`` (signed area of the expected-coverage curve:
    **negative = over-confident**, positive = under-confident; the convention of
    :mod:`calib_lightning.functional.sbc`),
    and per parameter ``d``: ``marginal_p_values/<d>`` and ``ecdf_p_values/<d>`` (the
    last ``ecdf_p_values`` entry is the joint rank), ``contraction/<d>`` (1 - posterior
    variance / prior variance: 0 for a posterior no sharper than the prior) and
    ``mean_squared_error/<d>`` of the posterior mean. Beyond six parameters
    (``per_parameter="auto"``) these ``4 D + 1`` tags are summarized instead
    (:func:`parameter_scalars`): ``marginal_p_values/min`` and ``/num_rejected`` (Holm
    at ``level``), the same for ``ecdf_p_values`` with ``ecdf_p_values/joint``,
    ``contraction/mean`` and ``/min``, ``mean_squared_error/mean`` and ``/max``.
    Figures: ``ecdf`` (ECDF - t with simultaneous and pointwise bands; beyond six
    parameters the five worst in colour), ``rank_histograms`` (a grid of at most six
    columns), ``expected_coverage``, ``recovery`` (posterior mean against the truth,
    with R^2) and ``z_score_contraction`` (posterior z-score against contraction; both
    from the first ``metric.max_pairs`` pairs), and ``history``; histograms
    ``rank/<d>`` (the per-parameter tags' parameters) and ``rank/joint`` of the raw
    ranks.

    Arguments:
        theta: calibration parameters ``(N, D)``.
        x: calibration observations ``(N, *X)``.
        metric: a configured :class:`calib_lightning.RankCalibration`; default
            ``RankCalibration(num_posterior_samples=100, num_dims=D)``.
        labels: names of all ``D`` parameters, for the figures.
        parameters: indices of the parameters the figures draw (default all; the ECDF
            figure colours at most ten of them).
        per_parameter: log ``{field}/<d>`` for every parameter (``True``), a summary
            (``False``), or ``"auto"``: every tag when ``D <= 6``, the summary beyond.
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
    history_titles: ClassVar[dict[str, str]] = {
        "global_p_value": "all rank tests combined (verdict)",
        "p_value": "joint energy rank: chi-square",
        "coverage_error": "HPD coverage error",
    }
    metric_type: ClassVar[type] = RankCalibration
    needs: ClassVar[tuple[str, ...]] = ("sample",)

    def __init__(
        self,
        theta: Tensor | None = None,
        x: Tensor | None = None,
        *,
        metric: RankCalibration | None = None,
        labels: Sequence[str] | None = None,
        parameters: Sequence[int] | None = None,
        per_parameter: bool | str = "auto",
        **kwargs: Any,
    ) -> None:
        num_dims = theta.shape[-1] if isinstance(theta, Tensor) and theta.ndim == 2 else None
        if metric is None:
            metric = RankCalibration(num_posterior_samples=100, num_dims=num_dims)
        super().__init__(metric, theta, x, **kwargs)
        num_dims = num_dims or getattr(metric, "num_dims", None)
        if num_dims is not None:  # else the figures check them at the first check
            select_parameters(num_dims, parameters, labels)
        parameter_scalars({}, None, per_parameter=per_parameter, level=self.level)  # checks it
        self.labels = list(labels) if labels is not None else None
        self.parameters = as_indices(parameters)
        self.per_parameter = per_parameter

    def scalars(self, result: RankCalibrationResult) -> dict[str, Tensor]:
        """The result's ``logged`` fields, per-parameter ones summarized unless
        ``per_parameter`` (:func:`parameter_scalars`)."""
        return parameter_scalars(
            super().scalars(result), result, per_parameter=self.per_parameter, level=self.level
        )

    def figures(self, result: RankCalibrationResult) -> dict[str, Figure]:
        figures = super().figures(result)
        chosen = {"labels": self.labels, "parameters": self.parameters}
        figures["ecdf"] = plot_rank_ecdf(result, **chosen)
        figures["rank_histograms"] = plot_rank_histograms(result, **chosen)
        figures["expected_coverage"] = plot_expected_coverage(result)
        if result.pair_theta is not None:  # the first pairs' posterior moments
            recovered = recovery_from_moments(
                result.pair_mean,
                result.pair_variance,
                result.pair_theta,
                result.prior_variance,
                num_posterior_samples=min(self.metric.num_posterior_samples, MOMENT_DRAWS),
            )
            figures["recovery"] = plot_recovery(recovered, **chosen)
            figures["z_score_contraction"] = plot_z_score_contraction(
                recovered,
                **chosen,
                level=self.level,
                calibration_tests={"the rank tests combined": float(result.global_p_value)},
            )
        return figures

    def histograms(self, result: RankCalibrationResult) -> dict[str, Tensor]:
        """Raw ranks, expanded from the histogram counts: ``rank/joint`` and ``rank/<d>``
        for the parameters whose tags are logged one by one (all, or ``parameters``)."""
        counts = result.histogram
        values = torch.arange(counts.shape[1], dtype=torch.float32)
        num_dims = counts.shape[0] - 1
        summarized = "marginal_p_values/min" in self.scalars(result)
        dims = (self.parameters or []) if summarized else range(num_dims)
        rows = {str(d % num_dims): counts[d] for d in dims}
        rows["joint"] = counts[num_dims]
        return {
            f"rank/{name}": values.repeat_interleave(row.to(torch.long))
            for name, row in rows.items()
        }
