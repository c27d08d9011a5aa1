"""The balance of a ratio estimator (Delaunoy et al., 2022) as a torchmetrics ``Metric``."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torchmetrics import Metric

from calib_lightning._utils.validation import check_pairs, check_positive, check_probability
from calib_lightning.evaluation import log_ratio_matrix
from calib_lightning.functional.balance import (
    SUMS,
    RatioBalanceResult,
    balance_from_sums,
    balance_sums,
)

__all__ = ["RatioBalance"]


class RatioBalance(Metric):
    r"""Test the balancing condition of a ratio estimator,
    :math:`E_{\text{joint}}[\sigma(\log r)] + E_{\text{marginal}}[\sigma(\log r)] = 1`.

    ``update(estimator, theta, x)`` evaluates :math:`\log r(\theta_j, x_i)` at every pair of
    the batch's rows (:func:`~calib_lightning.evaluation.log_ratio_matrix`: the ``N``
    joint pairs and the :math:`N (N - 1)` marginal pairs, :math:`N^2` evaluations) and adds
    the sums of :func:`~calib_lightning.functional.balance_sums` to its state
    (sum-reduced: constant memory, exact under DDP; each batch is its own U-statistic, so
    larger batches give a tighter test at a quadratic cost). ``compute()`` returns a
    :class:`~calib_lightning.functional.RatioBalanceResult`: the balance :math:`\hat B`
    (0 for the exact ratio), its standard error, the two-sided p-value of :math:`B = 0`,
    a ``confidence`` interval and the mean classifier output on each kind of pair. Level
    and power are measured in ``tests/test_ratio_balance.py``; positive :math:`\hat B` is
    what an over-confident tempered ratio and an upward-shifted one gave there (the
    result's docstring).

    Arguments:
        confidence: level of the interval ``[lower, upper]``.
        max_pairs_per_call: pairs per call of the estimator.
        **kwargs: torchmetrics ``Metric`` arguments.

    The estimator: a batched callable ``f(theta (M, D), x (M, *X)) -> (M,)`` returning
    :math:`\log r(\theta, x)` itself (the condition is not invariant to adding a function
    of ``x``, which leaves the posterior unchanged: an NRE-B ratio, learned up to such a
    function, need not be balanced), an sbi ``RatioEstimator`` (``NRE_A``, ``NRE_C``,
    ``BNRE``), a :class:`~calib_lightning.UnnormalizedPosterior` built from one, or an sbi
    ``MCMCPosterior`` whose potential holds one. Each update needs ``N >= 2`` pairs,
    ``compute`` at least 10 in all.

    Example:
        The exact log-ratio of :math:`x \sim N(\theta, 1)`, :math:`\theta \sim N(0, 1)`:

        >>> from torch.distributions import Normal
        >>> def log_r(theta, x):
        ...     return (Normal(theta, 1.0).log_prob(x) - Normal(0.0, 2**0.5).log_prob(x))[:, 0]
        >>> g = torch.Generator().manual_seed(0)
        >>> theta = torch.randn(2000, 1, generator=g)
        >>> x = theta + torch.randn(2000, 1, generator=g)
        >>> metric = RatioBalance()
        >>> metric.update(lambda t, y: 2 * log_r(t, y), theta[:500], x[:500])  # r^2
        >>> out = metric.compute()
        >>> int(out.num_pairs), bool(out.statistic > 0), bool(out.p_value < 1e-3)
        (500, True, True)

    References:
        Delaunoy, Hermans, Rozet, Wehenkel, Louppe. "Towards Reliable Simulation-Based
        Inference with Balanced Neural Ratio Estimation." NeurIPS 2022.
    """

    is_differentiable = False
    higher_is_better = None
    full_state_update = False

    sums: Tensor

    def __init__(
        self, confidence: float = 0.95, max_pairs_per_call: int = 65536, **kwargs: Any
    ) -> None:
        super().__init__(**kwargs)
        check_probability("confidence", confidence)
        check_positive("max_pairs_per_call", max_pairs_per_call, integer=True)
        self.confidence, self.max_pairs_per_call = confidence, max_pairs_per_call
        self.add_state(
            "sums", default=torch.zeros(len(SUMS), dtype=torch.float64), dist_reduce_fx="sum"
        )

    def update(self, estimator: Any, theta: Tensor, x: Tensor) -> None:
        """Add the pairs ``theta (N, D)``, ``x (N, *X)``, ``N >= 2``, all pairs among them."""
        theta, x = check_pairs(theta, x, min_rows=2)
        matrix = log_ratio_matrix(estimator, theta, x, max_pairs_per_call=self.max_pairs_per_call)
        self.sums += balance_sums(matrix.double()).to(self.sums)

    def compute(self) -> RatioBalanceResult:
        """Balance, standard error, p-value, interval and the two means."""
        if float(self.sums[0]) == 0:
            raise ValueError("RatioBalance.compute() needs at least one update, got none")
        return balance_from_sums(self.sums, self.confidence)
