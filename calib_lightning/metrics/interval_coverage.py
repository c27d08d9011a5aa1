"""Central credible intervals' coverage as a torchmetrics metric, accumulated over batches."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor

from calib_lightning._utils.validation import check_pairs, check_positive
from calib_lightning.evaluation import check_event_size, draws
from calib_lightning.functional.interval_coverage import (
    INTERVAL_LEVELS,
    IntervalCoverageResult,
    interval_coverage,
    interval_mask,
)
from calib_lightning.functional.ranks import marginal_ranks
from calib_lightning.metrics._lazy import LazyDimension
from calib_lightning.posteriors import Posterior

__all__ = ["IntervalCoverage"]


class IntervalCoverage(LazyDimension):
    r"""Do the central credible intervals of each parameter cover the truth as often as
    they claim? An exact binomial test per level and parameter
    (:mod:`calib_lightning.functional.interval_coverage`).

    ``update(posterior, theta, x)`` draws ``num_posterior_samples`` parameters per pair and
    adds the marginal ranks of the true ``theta`` to a histogram ``(D, M + 1)`` (summed
    over batches and processes: constant memory, exact under DDP); ``compute()`` counts
    the truths inside each level's interval and returns an
    :class:`~calib_lightning.functional.interval_coverage.IntervalCoverageResult`.

    Arguments:
        num_posterior_samples: ``M``, draws per pair.
        levels: nominal levels of the central intervals, each in ``(0, 1)``.
        num_dims: ``D``, to allocate the states before the first update (a DDP process
            that may see no pairs needs it); otherwise the first update sets it.
        **kwargs: torchmetrics ``Metric`` arguments.

    Example:
        >>> from calib_lightning.tasks import GaussianToy
        >>> toy = GaussianToy(dim=2)
        >>> theta, x = toy.sample(500, torch.Generator().manual_seed(0))
        >>> metric = IntervalCoverage()
        >>> _ = torch.manual_seed(0)
        >>> metric.update(toy.posterior(variance_scale=0.5), theta, x)  # too narrow
        >>> out = metric.compute()
        >>> bool(out.global_p_value < 0.01), bool((out.coverage_error < 0).all())
        (True, True)
    """

    is_differentiable = False
    higher_is_better = None
    full_state_update = False

    lazy_states: ClassVar[tuple[str, ...]] = ("histogram",)
    extra_rows: ClassVar[int] = 0
    histogram: Tensor

    def __init__(
        self,
        num_posterior_samples: int = 100,
        levels: Sequence[float] = INTERVAL_LEVELS,
        num_dims: int | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        check_positive("num_posterior_samples", num_posterior_samples, integer=True)
        levels = tuple(float(level) for level in levels)
        if not levels or not all(0 < level < 1 for level in levels):
            raise ValueError(f"levels must be numbers in (0, 1), got {levels}")
        if num_dims is not None:
            check_positive("num_dims", num_dims, integer=True)
        self.num_posterior_samples, self.levels = num_posterior_samples, levels
        self.num_dims = num_dims
        (histogram,) = self._zero_states(num_dims or 0)
        self.add_state("histogram", histogram, dist_reduce_fx="sum")

    def _zero_states(self, d: int, device: torch.device | None = None) -> tuple[Tensor]:
        """Zero marginal rank counts ``(D, M + 1)``."""
        return (torch.zeros(d, self.num_posterior_samples + 1, dtype=torch.long, device=device),)

    def _dims(self) -> int:
        return self.histogram.shape[0]

    def update(self, posterior: Posterior | object, theta: Tensor, x: Tensor) -> None:
        """Rank each true ``theta (N, D)`` among posterior draws at ``x (N, *X)``, per
        parameter."""
        theta, x = check_pairs(theta, x)
        check_event_size(posterior, theta, x)
        self._allocate(theta.shape[1])
        ranks = marginal_ranks(draws(posterior, x, self.num_posterior_samples).to(theta), theta)
        rows = ranks.T.to(self.histogram.device)  # (D, N)
        self.histogram.scatter_add_(1, rows, torch.ones_like(rows))

    def compute(self) -> IntervalCoverageResult:
        """Coverage of each level's central intervals and their exact binomial tests."""
        n = int(self.histogram[0].sum()) if self.histogram.numel() else 0
        if n < 2:
            raise ValueError(
                f"IntervalCoverage.compute() needs at least N >= 2 calibration pairs, got N = {n}"
            )
        levels = torch.tensor(self.levels, dtype=torch.float64)
        mask = interval_mask(levels, self.num_posterior_samples).to(self.histogram)  # (L, M + 1)
        inside = mask @ self.histogram.T  # (L, D): the pairs whose rank lies in each window
        return interval_coverage(inside.cpu(), n, self.num_posterior_samples, levels)
