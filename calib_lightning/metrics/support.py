"""Streaming count of posterior draws outside the prior's support, a torchmetrics ``Metric``."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torchmetrics import Metric
from torchmetrics.utilities.data import dim_zero_cat
from torchmetrics.utilities.distributed import gather_all_tensors

from calib_lightning._utils.distributed import shape_empty_list_states
from calib_lightning._utils.prior import check_prior, outside_support
from calib_lightning._utils.validation import check_pairs, check_positive
from calib_lightning.evaluation import check_event_size, draws
from calib_lightning.functional.support import SupportResult
from calib_lightning.posteriors import Posterior

__all__ = ["PriorSupport"]


class PriorSupport(Metric):
    r"""The share of posterior draws outside the prior's support, over calibration pairs.

    At each pair it draws ``num_posterior_samples`` parameters from :math:`q(\cdot \mid x_i)`
    and counts those outside the support of ``prior``, where the true posterior has no mass
    (:mod:`calib_lightning.functional.support`: one draw outside rejects :math:`q = p` with
    certainty; the p-value is 0 or 1). The counts are sums over processes; the per-pair
    shares are concatenated.

    Arguments:
        prior: the prior the calibration ``theta`` were drawn from: a torch
            ``Distribution`` (its ``support``, e.g. sbi's ``BoxUniform``) or any object with
            ``log_prob`` (outside where it is not finite).
        num_posterior_samples: draws per pair.
        **kwargs: torchmetrics ``Metric`` arguments.

    Example:
        >>> from torch.distributions import Independent, Uniform
        >>> from calib_lightning.tasks import GaussianToy
        >>> toy = GaussianToy(dim=2)
        >>> theta, x = toy.sample(200, torch.Generator().manual_seed(0))
        >>> box = Independent(Uniform(torch.full((2,), -5.0), torch.full((2,), 5.0)), 1)
        >>> metric = PriorSupport(box)
        >>> metric.update(toy.posterior(), theta, x)
        >>> float(metric.compute().p_value)  # the exact posterior stays inside
        1.0
    """

    is_differentiable = False
    higher_is_better = False
    full_state_update = False

    num_outside: Tensor
    num_draws: Tensor
    leakage: list[Tensor]

    def __init__(self, prior: Any, num_posterior_samples: int = 100, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if prior is None:
            raise ValueError("prior must be the prior theta were drawn from, got None")
        check_positive("num_posterior_samples", num_posterior_samples, integer=True)
        self.prior, self.num_posterior_samples = prior, num_posterior_samples
        self.add_state("num_outside", default=torch.tensor(0), dist_reduce_fx="sum")
        self.add_state("num_draws", default=torch.tensor(0), dist_reduce_fx="sum")
        self.add_state("leakage", default=[], dist_reduce_fx="cat")

    def update(self, posterior: Posterior | object, theta: Tensor, x: Tensor) -> None:
        """Count the draws outside the support at the pairs ``theta (N, D)``, ``x (N, *X)``."""
        check_pairs(theta, x)
        check_event_size(posterior, theta, x)
        check_prior(self.prior, theta)
        outside = outside_support(self.prior, draws(posterior, x, self.num_posterior_samples))
        self.num_outside += outside.sum().to(self.num_outside)
        self.num_draws += outside.numel()
        self.leakage.append(outside.float().mean(0))

    def compute(self) -> SupportResult:
        """The share of all draws outside, the exact p-value and the share per pair."""
        if int(self.num_draws) == 0:
            raise ValueError("PriorSupport.compute() needs at least one update, got none")
        pairs = (
            sum(int(block.shape[0]) for block in self.leakage)
            if isinstance(self.leakage, list)
            else int(self.leakage.shape[0])
        )
        if pairs < 2:
            raise ValueError(
                f"PriorSupport.compute() needs at least N >= 2 calibration pairs, got N = {pairs}"
            )
        return SupportResult(
            statistic=self.num_outside.float() / self.num_draws.float(),
            p_value=(self.num_outside == 0).float(),
            leakage=dim_zero_cat(self.leakage),
            num_outside=self.num_outside.clone(),
            num_draws=self.num_draws.clone(),
        )

    def _sync_dist(self, dist_sync_fn: Any = gather_all_tensors, process_group: Any = None) -> None:
        # a process without pairs must gather a (0,) tensor of the right dtype
        shape_empty_list_states(self, ("leakage",), process_group or self.process_group)
        super()._sync_dist(dist_sync_fn, process_group)
