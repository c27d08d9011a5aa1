"""Lightning callback testing the balance of a ratio estimator while it trains."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from lightning.pytorch import LightningModule, Trainer
from torch import Tensor

from calib_lightning.callbacks._plumbing import eval_mode
from calib_lightning.callbacks.base import CalibrationCallback
from calib_lightning.evaluation import log_ratio_matrix
from calib_lightning.metrics.balance import RatioBalance
from calib_lightning.results import Result

__all__ = ["RatioBalanceCallback"]


class RatioBalanceCallback(CalibrationCallback):
    r"""Test the balancing condition of a ratio estimator every ``every_n_epochs`` epochs.

    Logs, under ``{prefix}/balance/``, the ``logged`` fields of
    :class:`~calib_lightning.functional.RatioBalanceResult`: ``statistic`` (the balance
    :math:`\hat B = \bar d_{\text{joint}} + \bar d_{\text{marginal}} - 1`, 0 for the exact
    ratio), ``p_value`` (two-sided test of :math:`B = 0`), ``standard_error``, ``lower``
    and ``upper`` (the interval) and ``joint`` and ``marginal`` (the classifier's mean
    output on each kind of pair). The figure ``{prefix}/balance/history`` plots the
    p-value and the balance against the epoch.

    The estimator (``estimator=``, an attribute name or a function of the module, as for
    every callback) is used as it is, not through :func:`calib_lightning.as_posterior`:
    a callable ``(theta (M, D), x (M, *X)) -> log r (M,)``, an sbi ``RatioEstimator``, or
    a :class:`~calib_lightning.UnnormalizedPosterior` built from one
    (:class:`calib_lightning.RatioBalance`).

    Arguments:
        theta: calibration parameters ``(N, D)``, drawn from the prior, never trained on.
        x: their observations ``(N, *X)``.
        metric: a configured :class:`calib_lightning.RatioBalance`; default
            ``RatioBalance()``.
        **kwargs: :class:`~calib_lightning.callbacks.CalibrationCallback` arguments
            (``dataloader``, ``every_n_epochs``, ``estimator``, ``prefix``, ...).

    Example:
        >>> theta, x = torch.randn(256, 2), torch.randn(256, 2)
        >>> callback = RatioBalanceCallback(theta, x, estimator="ratio", every_n_epochs=2)
        >>> callback.state_key
        "RatioBalanceCallback{'prefix': 'calibration', 'name': 'balance'}"

    References:
        Delaunoy, Hermans, Rozet, Wehenkel, Louppe. "Towards Reliable Simulation-Based
        Inference with Balanced Neural Ratio Estimation." NeurIPS 2022.
    """

    name: ClassVar[str] = "balance"
    history_keys: ClassVar[tuple[str, ...]] = ("p_value", "statistic")
    history_titles: ClassVar[dict[str, str]] = {
        "p_value": "balance test (t, all pairs)",
        "statistic": "balance B̂",
    }
    metric_type: ClassVar[type] = RatioBalance

    def __init__(
        self,
        theta: Tensor | None = None,
        x: Tensor | None = None,
        *,
        metric: RatioBalance | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(metric if metric is not None else RatioBalance(), theta, x, **kwargs)

    def check_setup(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Raise now if the first two pairs do not fit the ratio estimator (its
        ``ValueError``, whatever ``on_error``); other errors are left to the check."""
        estimator = self._find_estimator(pl_module)
        batch = next(iter(self._local_batches(trainer, pl_module.device, pl_module.dtype)), None)
        if batch is None:
            return
        theta, x = batch[0][:2], batch[1][:2]
        with eval_mode(pl_module, estimator):
            try:
                log_ratio_matrix(estimator, theta, x)
            except ValueError:
                raise
            except Exception:
                return

    def _compute(
        self, trainer: Trainer, pl_module: LightningModule
    ) -> tuple[Result | dict[str, Tensor], dict[str, Tensor]]:
        estimator = self._find_estimator(pl_module)
        device = pl_module.device
        with eval_mode(pl_module, estimator), torch.inference_mode(False), torch.no_grad():
            self.metric.to(device)
            self.metric.reset()
            for theta, x in self._local_batches(trainer, device, pl_module.dtype):
                self.metric.update(estimator, theta, x)
            return self.metric.compute(), {}
