"""Lightning callback running the TARP coverage test while a posterior estimator trains."""

from __future__ import annotations

from typing import Any, ClassVar

from matplotlib.figure import Figure
from torch import Tensor

from calib_lightning.callbacks.base import CalibrationCallback
from calib_lightning.metrics.tarp import TARP, TARPResult
from calib_lightning.plots.tarp import plot_tarp

__all__ = ["TARPCallback"]


class TARPCallback(CalibrationCallback):
    r"""TARP expected coverage with its exact Monte Carlo test, every ``every_n_epochs`` epochs.

    Logs, under ``{prefix}/tarp/``, the ``logged`` fields of
    :class:`~calib_lightning.functional.tarp.TARPResult`: ``p_value`` (the verdict: small
    = the expected-coverage curve leaves its null band, miscalibrated),
    ``coverage_error`` (area between the curve and the diagonal on its upper half:
    **negative = over-confident**, positive = under-confident; "Reading the sign" in
    :mod:`calib_lightning.functional.sbc`), ``statistic`` (the curve's largest deviation)
    and ``num_pairs``. Figures: ``coverage`` (the curve with its band,
    :func:`~calib_lightning.plots.tarp.plot_tarp`) and ``history``.

    The metric fits its coordinates (scale and reference box) at the first check, on one
    value per calibration pair picked among its ``theta`` and posterior samples (not on
    the tested ``theta``: that broke the level at high ``D``), and keeps them, so every
    check measures coverage in the same units; pass ``scale`` and ``reference_bounds``
    (e.g. the prior's range) to a configured metric for coordinates fixed in advance.
    With a :class:`RankCalibrationCallback` (or any other sampling callback) checking in
    the same epoch, both use one set of posterior draws at the calibration ``x``
    (docs/callbacks.md, "Shared draws").

    Arguments:
        theta: calibration parameters ``(N, D)``.
        x: calibration observations ``(N, *X)``.
        metric: a configured :class:`calib_lightning.TARP`; default
            ``TARP(num_posterior_samples=100)``.
        **kwargs: :class:`~calib_lightning.callbacks.CalibrationCallback` arguments.

    Example:
        >>> import torch
        >>> from calib_lightning.tasks import TwoMoons
        >>> theta, x = TwoMoons().sample(256, torch.Generator().manual_seed(0))
        >>> callback = TARPCallback(theta, x, every_n_epochs=5)
        >>> callback.metric.num_posterior_samples, callback.state_key
        (100, "TARPCallback{'prefix': 'calibration', 'name': 'tarp'}")

    References:
        Lemos, Coogan, Hezaveh, Perreault-Levasseur. "Sampling-Based Accuracy Testing of
        Posterior Estimators for General Inference." ICML 2023.
    """

    name: ClassVar[str] = "tarp"
    history_keys: ClassVar[tuple[str, ...]] = ("p_value", "coverage_error")
    history_titles: ClassVar[dict[str, str]] = {
        "p_value": "TARP test (Monte Carlo band)",
        "coverage_error": "TARP coverage error",
    }
    metric_type: ClassVar[type] = TARP
    needs: ClassVar[tuple[str, ...]] = ("sample",)

    def __init__(
        self,
        theta: Tensor | None = None,
        x: Tensor | None = None,
        *,
        metric: TARP | None = None,
        **kwargs: Any,
    ) -> None:
        metric = metric if metric is not None else TARP(num_posterior_samples=100)
        super().__init__(metric, theta, x, **kwargs)

    def figures(self, result: TARPResult) -> dict[str, Figure]:
        figures = super().figures(result)
        figures["coverage"] = plot_tarp(result, title=f"{self.tag_name}: expected coverage")
        return figures
