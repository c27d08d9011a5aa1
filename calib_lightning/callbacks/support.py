"""Lightning callback counting posterior draws outside the prior's support while training."""

from __future__ import annotations

from typing import Any, ClassVar

from torch import Tensor

from calib_lightning.callbacks.base import CalibrationCallback
from calib_lightning.metrics.support import PriorSupport

__all__ = ["PriorSupportCallback"]


class PriorSupportCallback(CalibrationCallback):
    r"""The share of posterior draws outside the prior's support, every ``every_n_epochs``.

    Logs, under ``{prefix}/support/``, the ``logged`` fields of
    :class:`~calib_lightning.functional.support.SupportResult`: ``statistic`` (the share of
    the draws at the calibration ``x`` outside the prior's support, 0 for the true
    posterior) and ``p_value`` (exact: 0 when a draw is outside, else 1). The figure
    ``{prefix}/support/history`` plots the share against the epoch. A flow on :math:`R^D`
    trained on a bounded prior leaks there until it learns the bounds (or for good); sbi's
    ``DirectPosterior`` rejects such draws when sampling, the estimator does not. With
    another sampling callback checking in the same epoch, both use one set of posterior
    draws (docs/callbacks.md, "Shared draws").

    Arguments:
        theta: calibration parameters ``(N, D)``, drawn from ``prior``.
        x: calibration observations ``(N, *X)``.
        prior: the prior (a torch ``Distribution`` or anything with ``log_prob``); or
        metric: a configured :class:`calib_lightning.PriorSupport`.
        **kwargs: :class:`~calib_lightning.callbacks.CalibrationCallback` arguments.

    Example:
        >>> import torch
        >>> from calib_lightning.tasks import TwoMoons
        >>> task = TwoMoons()
        >>> theta, x = task.sample(256, torch.Generator().manual_seed(0))
        >>> callback = PriorSupportCallback(theta, x, prior=task.prior(), every_n_epochs=5)
        >>> callback.metric.num_posterior_samples, callback.state_key
        (100, "PriorSupportCallback{'prefix': 'calibration', 'name': 'support'}")
    """

    name: ClassVar[str] = "support"
    history_keys: ClassVar[tuple[str, ...]] = ("statistic", "p_value")
    # the exact p-value (0 or 1, read by the summary) would fill a log axis to the float64
    # floor: the figure draws the share only
    unplotted_keys: ClassVar[tuple[str, ...]] = ("p_value",)
    history_titles: ClassVar[dict[str, str]] = {
        "statistic": "share of draws outside the prior's support",
    }
    metric_type: ClassVar[type] = PriorSupport
    needs: ClassVar[tuple[str, ...]] = ("sample",)

    def __init__(
        self,
        theta: Tensor | None = None,
        x: Tensor | None = None,
        *,
        prior: Any = None,
        metric: PriorSupport | None = None,
        **kwargs: Any,
    ) -> None:
        if (prior is None) == (metric is None):
            raise ValueError(
                "PriorSupportCallback needs exactly one of prior and metric, got "
                f"prior={'None' if prior is None else type(prior).__name__}, "
                f"metric={'None' if metric is None else type(metric).__name__}"
            )
        super().__init__(metric if metric is not None else PriorSupport(prior), theta, x, **kwargs)
