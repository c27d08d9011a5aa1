"""Streaming KCCSD calibration test as a torchmetrics ``Metric``."""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torchmetrics import Metric
from torchmetrics.utilities.data import dim_zero_cat

from calib_lightning._checks import (
    check_choice,
    check_matrix,
    check_pairs,
    check_positive,
)
from calib_lightning._moments import merge_moments, moments
from calib_lightning.functional.kccsd import (
    base_points_from_moments,
    kccsd_test,
    posterior_scores,
)
from calib_lightning.kernels import DISTRIBUTION_KERNELS, KERNELS
from calib_lightning.posteriors import Posterior

__all__ = ["KCCSD"]


class KCCSD(Metric):
    r"""Kernel calibration-conditional Stein discrepancy with a wild-bootstrap test.

    ``update(posterior, theta, x)`` evaluates the posterior's score at each true
    parameter and at ``m`` base points shared by all pairs, and stores them;
    ``compute()`` returns the U-statistic and its p-value under
    :math:`H_0`: "the posterior is calibrated" (small p-values reject).

    ``forward`` additionally returns the statistic of the batch *with its autograd
    graph*, so it can be backpropagated into the posterior's parameters.

    Memory: each process keeps at most ``max_samples`` pairs, i.e.
    ``max_samples * (m + 2) * D`` numbers; further pairs are ignored with a warning.
    ``compute`` needs ``O(block_size^2 + n * num_bootstrap)`` memory, not
    ``O(n^2)``. Under DDP the pairs of all processes are gathered and put in a
    canonical order, so the result does not depend on how the data was split.

    Arguments:
        kernel: ``"rbf"`` or ``"imq"`` kernel on parameters.
        bandwidth: its bandwidth; ``None``: median heuristic.
        distribution_kernel: ``"gfd"``, ``"kgfd"`` or ``None`` (no conditioning on the
            model; then the test only checks the marginal fit).
        distribution_bandwidth: bandwidth of the kernel between models; ``None``: median
            heuristic.
        base_points: ``(m, D)`` tensor fixed by the user, an int ``m``, or ``None``
            (32). Drawn points come from a Gaussian fitted to the thetas of the first
            ``update`` (pooled over processes), so the base measure covers the data
            in its own units.
        num_bootstrap: wild-bootstrap draws ``B``.
        max_samples: the per-process bound on stored pairs.
        seed: seeds the base points and the bootstrap multipliers.
        block_size: side of the blocks of the kernel matrix computed at once.
        score_chunk_size: base points per posterior evaluation in ``update``.

    Example:
        >>> from calib_lightning.tasks import MGM
        >>> model = MGM(delta=0.0)
        >>> metric = KCCSD()
        >>> for seed in range(4):
        ...     theta, x = model.sample(100, torch.Generator().manual_seed(seed))
        ...     metric.update(model, theta, x)
        >>> out = metric.compute()
        >>> sorted(out)
        ['bandwidth', 'distribution_bandwidth', 'num_samples', 'p_value', 'statistic']
        >>> int(out["num_samples"])
        400

    References:
        Glaser, Widmann, Lindsten, Gretton. "Fast and Scalable Score-Based Kernel
        Calibration Tests." UAI 2023.
    """

    is_differentiable = True
    higher_is_better = False
    full_state_update = False

    theta: list[Tensor]
    score: list[Tensor]
    base_scores: list[Tensor]

    def __init__(
        self,
        kernel: str = "rbf",
        bandwidth: float | None = None,
        distribution_kernel: str | None = "gfd",
        distribution_bandwidth: float | None = None,
        base_points: Tensor | int | None = None,
        num_bootstrap: int = 500,
        max_samples: int = 4096,
        seed: int = 0,
        block_size: int = 1024,
        score_chunk_size: int = 16,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        check_choice("kernel", kernel, KERNELS)
        check_choice("distribution_kernel", distribution_kernel, (*DISTRIBUTION_KERNELS, None))
        for name, value in (("bandwidth", bandwidth), ("distribution_bandwidth",
                                                         distribution_bandwidth)):
            if value is not None:
                check_positive(name, value)
        check_positive("num_bootstrap", num_bootstrap, integer=True)
        check_positive("max_samples", max_samples, integer=True)
        check_positive("block_size", block_size, integer=True)
        check_positive("score_chunk_size", score_chunk_size, integer=True)
        self.kernel, self.bandwidth = kernel, bandwidth
        self.distribution_kernel = distribution_kernel
        self.distribution_bandwidth = distribution_bandwidth
        self.num_bootstrap, self.max_samples, self.seed = num_bootstrap, max_samples, seed
        self.block_size, self.score_chunk_size = block_size, score_chunk_size

        self.num_base_points = 32
        fixed = torch.empty(0, 0)
        if isinstance(base_points, Tensor):
            fixed = check_matrix("base_points", base_points, min_rows=1).detach().clone()
        elif base_points is not None:
            check_positive("base_points", base_points, integer=True)
            self.num_base_points = base_points
        self.register_buffer("base_points", fixed, persistent=True)

        self.add_state("theta", default=[], dist_reduce_fx="cat")
        self.add_state("score", default=[], dist_reduce_fx="cat")
        self.add_state("base_scores", default=[], dist_reduce_fx="cat")
        self._warned = False
        self._forward_grad: bool | None = None  # set while forward() runs update()
        self._last_batch: tuple[Tensor, Tensor, Tensor | None] | None = None

    # -- base measure -------------------------------------------------------------
    def _fit_base_points(self, theta: Tensor) -> None:
        """Draw base points from a Gaussian fitted to ``theta`` (pooled over processes)."""
        state = moments(theta)
        if dist.is_available() and dist.is_initialized():
            states = torch.zeros(dist.get_world_size(self.process_group), *state.shape,
                                 dtype=state.dtype)
            dist.all_gather(list(states.unbind(0)), state, group=self.process_group)
            state = merge_moments(states)
        generator = torch.Generator().manual_seed(self.seed)
        points = base_points_from_moments(state, self.num_base_points, generator)
        self.base_points = points.to(theta.dtype)

    def _load_from_state_dict(self, state_dict: dict, prefix: str, *args: Any) -> None:
        key = prefix + "base_points"
        if key in state_dict:
            self.base_points = torch.empty_like(state_dict[key])
        super()._load_from_state_dict(state_dict, prefix, *args)

    # -- accumulation ---------------------------------------------------------------
    def update(self, posterior: Posterior | object, theta: Tensor, x: Tensor) -> None:
        """Score the posterior at the calibration pairs ``theta (N, D)``, ``x (N, *X)``."""
        check_pairs(theta, x)
        base = None
        if self.distribution_kernel is not None:
            if self.base_points.numel() == 0:
                self._fit_base_points(theta)
            if self.base_points.shape[1] != theta.shape[1]:
                raise ValueError(
                    f"theta must have D = {self.base_points.shape[1]} columns like base_points, "
                    f"got shape {tuple(theta.shape)}"
                )
            base = self.base_points.to(device=theta.device, dtype=theta.dtype)
        score, base_scores = posterior_scores(
            posterior, theta, x, base,
            create_graph=bool(self._forward_grad),
            chunk_size=self.score_chunk_size,
        )  # fmt: skip
        if self._forward_grad is not None:
            self._last_batch = (theta, score, base_scores)
        room = self.max_samples - sum(t.shape[0] for t in self.theta)
        if room < theta.shape[0] and not self._warned:
            warnings.warn(
                f"KCCSD keeps at most max_samples={self.max_samples} pairs per process; "
                f"{theta.shape[0] - max(room, 0)} further pairs are ignored",
                stacklevel=2,
            )
            self._warned = True
        if room <= 0:
            return
        keep = slice(0, room)
        self.theta.append(theta[keep].detach())
        self.score.append(score[keep].detach())
        if base_scores is not None:
            self.base_scores.append(base_scores[keep].detach())

    def reset(self) -> None:
        super().reset()
        self._warned = False

    def _test(
        self, theta: Tensor, score: Tensor, base_scores: Tensor | None
    ) -> dict[str, Tensor]:
        n = theta.shape[0]
        if n < 2:
            raise ValueError(f"KCCSD needs at least N >= 2 calibration pairs, got N = {n}")
        base = self.base_points if base_scores is not None else None
        if base is not None:
            base = base.to(device=theta.device, dtype=theta.dtype)
        out = kccsd_test(
            theta, score, base_scores, base,
            kernel=self.kernel, bandwidth=self.bandwidth,
            distribution_kernel=self.distribution_kernel,
            distribution_bandwidth=self.distribution_bandwidth,
            num_bootstrap=self.num_bootstrap,
            generator=torch.Generator().manual_seed(self.seed + 1),
            block_size=self.block_size,
        )  # fmt: skip
        out["num_samples"] = torch.tensor(n, device=theta.device)
        return out

    def compute(self) -> dict[str, Tensor]:
        """Statistic, p-value, bandwidths and the number of pairs used."""
        if isinstance(self.theta, list) and not self.theta:
            raise ValueError("KCCSD.compute() needs at least one update, got none")
        theta, score = dim_zero_cat(self.theta), dim_zero_cat(self.score)
        base_scores = dim_zero_cat(self.base_scores) if self.distribution_kernel else None
        order = _canonical_order(theta)
        theta, score = theta[order], score[order]
        if base_scores is not None:
            base_scores = base_scores[order]
        return self._test(theta, score, base_scores)

    def forward(self, posterior: Posterior | object, theta: Tensor, x: Tensor) -> dict[str, Tensor]:
        """Accumulate the batch and return its own test, with the statistic's graph kept."""
        if self._is_synced:
            raise ValueError("KCCSD.forward() cannot run on synced states; call unsync() first")
        grad = torch.is_grad_enabled()
        self._forward_grad = grad
        try:
            self.update(posterior, theta, x)
        finally:
            self._forward_grad = None
        batch, self._last_batch = self._last_batch, None
        with torch.set_grad_enabled(grad):
            self._forward_cache = self._test(*batch)
        return self._forward_cache


def _canonical_order(theta: Tensor) -> Tensor:
    """Row order sorting ``theta`` lexicographically (stable), independent of arrival order."""
    order = torch.arange(theta.shape[0], device=theta.device)
    for column in reversed(range(theta.shape[1])):
        key = theta[order, column]
        order = order[torch.sort(key, stable=True).indices]
    return order
