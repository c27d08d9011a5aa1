"""Lightning callback running the KCCSD calibration test while a posterior estimator trains."""

from __future__ import annotations

from typing import Any, ClassVar

from torch import Tensor

from calib_lightning.callbacks.base import CalibrationCallback
from calib_lightning.metrics.kccsd import KCCSD

__all__ = ["KCCSDCallback"]


class KCCSDCallback(CalibrationCallback):
    r"""Test calibration of the estimator with KCCSD every ``every_n_epochs`` epochs.

    Logs, under ``{prefix}/kccsd/``: ``statistic`` (the U-statistic
    :math:`\hat C`, about 0 for a calibrated model, larger when it is not),
    ``p_value`` (wild-bootstrap p-value of :math:`H_0`: calibrated), ``bandwidth`` and
    ``distribution_bandwidth`` (the kernels' bandwidths, median heuristic unless fixed)
    and ``num_pairs`` (calibration pairs used, all processes together): the
    ``logged`` fields of :class:`~calib_lightning.metrics.kccsd.KCCSDResult`. The figure
    ``{prefix}/kccsd/history`` plots the p-value and the statistic against the epoch.

    The metric's base points are drawn at the first check and kept (they are saved
    with the checkpoint), so every check uses the same kernel between models.

    Arguments:
        theta: calibration parameters ``(N, D)``.
        x: calibration observations ``(N, *X)``.
        metric: a configured :class:`calib_lightning.KCCSD`; default ``KCCSD()``.
        **kwargs: :class:`~calib_lightning.callbacks.CalibrationCallback` arguments
            (``dataloader``, ``every_n_epochs``, ``estimator``, ``prefix``, ...).

    Example:
        >>> import torch
        >>> from calib_lightning.tasks import TwoMoons
        >>> theta, x = TwoMoons().sample(256, torch.Generator().manual_seed(0))
        >>> callback = KCCSDCallback(theta, x, every_n_epochs=2, metric=KCCSD(num_null=200))
        >>> callback.state_key
        "KCCSDCallback{'prefix': 'calibration', 'name': 'kccsd'}"

    References:
        Glaser, Widmann, Lindsten, Gretton. "Fast and Scalable Score-Based Kernel
        Calibration Tests." UAI 2023.
    """

    name: ClassVar[str] = "kccsd"
    history_keys: ClassVar[tuple[str, ...]] = ("p_value", "statistic")
    history_titles: ClassVar[dict[str, str]] = {
        "p_value": "KCCSD test (wild bootstrap)",
        "statistic": "KCCSD statistic Ĉ",
    }
    metric_type: ClassVar[type] = KCCSD
    needs: ClassVar[tuple[str, ...]] = ("score",)

    def __init__(
        self,
        theta: Tensor | None = None,
        x: Tensor | None = None,
        *,
        metric: KCCSD | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(metric if metric is not None else KCCSD(), theta, x, **kwargs)
