"""Lightning callback running the central-interval coverage test while an estimator trains."""

from __future__ import annotations

from typing import Any, ClassVar

from torch import Tensor

from calib_lightning.callbacks.base import CalibrationCallback
from calib_lightning.metrics.interval_coverage import IntervalCoverage

__all__ = ["IntervalCoverageCallback"]


class IntervalCoverageCallback(CalibrationCallback):
    r"""The coverage of each parameter's central credible intervals, every
    ``every_n_epochs`` epochs.

    Logs, under ``{prefix}/interval_coverage/``, the ``logged`` fields of
    :class:`~calib_lightning.functional.interval_coverage.IntervalCoverageResult`:
    ``global_p_value`` (the verdict: Holm over the exact binomial test of each level and
    parameter) and ``mean_coverage_error/l`` (coverage minus the nominal level, averaged
    over the parameters, one per level: negative = the intervals miss the truth too
    often). Figure: ``history``. With another sampling callback checking in the same
    epoch, both use one set of posterior draws (docs/callbacks.md, "Shared draws").

    Arguments:
        theta: calibration parameters ``(N, D)``.
        x: calibration observations ``(N, *X)``.
        metric: a configured :class:`calib_lightning.IntervalCoverage`; default
            ``IntervalCoverage(num_posterior_samples=100)``.
        **kwargs: :class:`~calib_lightning.callbacks.CalibrationCallback` arguments.

    Example:
        >>> import torch
        >>> from calib_lightning.tasks import TwoMoons
        >>> theta, x = TwoMoons().sample(256, torch.Generator().manual_seed(0))
        >>> IntervalCoverageCallback(theta, x).metric.levels
        (0.5, 0.9)
    """

    name: ClassVar[str] = "interval_coverage"
    history_keys: ClassVar[tuple[str, ...]] = ("global_p_value",)
    history_titles: ClassVar[dict[str, str]] = {
        "global_p_value": "central intervals' coverage (exact binomial tests)",
    }
    metric_type: ClassVar[type] = IntervalCoverage
    needs: ClassVar[tuple[str, ...]] = ("sample",)

    def __init__(
        self,
        theta: Tensor | None = None,
        x: Tensor | None = None,
        *,
        metric: IntervalCoverage | None = None,
        **kwargs: Any,
    ) -> None:
        metric = metric if metric is not None else IntervalCoverage(num_posterior_samples=100)
        super().__init__(metric, theta, x, **kwargs)
