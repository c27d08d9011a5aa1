"""Streaming TARP coverage test as a torchmetrics ``Metric``."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torchmetrics import Metric
from torchmetrics.utilities.data import dim_zero_cat
from torchmetrics.utilities.distributed import gather_all_tensors

from calib_lightning._utils.chunks import row_blocks
from calib_lightning._utils.distributed import (
    canonical_order,
    room_for_rows,
    shape_empty_list_states,
)
from calib_lightning._utils.validation import (
    check_choice,
    check_pairs,
    check_positive,
    check_probability,
)
from calib_lightning.evaluation import check_event_size, checked_samples, draws
from calib_lightning.functional._tarp_coordinates import check_scale
from calib_lightning.functional.tarp import (
    DISTANCES,
    NUM_REFERENCES,
    TARPResult,
    pooled_values,
    tarp_box,
    tarp_fit_scale,
    tarp_permutation_test,
    tarp_rank_table,
    tarp_references,
)
from calib_lightning.posteriors import Posterior

__all__ = ["MAX_POSITIONS", "TARP"]

#: values per pair the metric keeps ranks of (the truth and the first draws): the
#: permutation test is exact over any such subgroup, and memory stays
#: ``N * MAX_POSITIONS * R`` ranks whatever ``S``
MAX_POSITIONS = 101


def _sample_chunks(
    posterior: Posterior | object | Tensor,
    x: Tensor,
    num_posterior_samples: int,
    chunk_size: int | None,
) -> Iterator[tuple[slice, Tensor]]:
    """``(rows, samples)``: finite posterior draws ``(S, rows, D)`` at ``x[rows]``,
    ``chunk_size`` pairs at a time (:func:`calib_lightning.evaluation.draws`); a tensor of
    samples ``(S, N, D)`` is one chunk."""
    if isinstance(posterior, Tensor):
        checked_samples(posterior)
        yield slice(0, x.shape[0]), posterior
        return
    if chunk_size is None:  # calls sized from the memory budget by draws()
        yield slice(0, x.shape[0]), draws(posterior, x, num_posterior_samples)
        return
    for rows in row_blocks(x.shape[0], chunk_size):
        yield rows, draws(posterior, x[rows], num_posterior_samples, chunk_size=chunk_size)


class TARP(Metric):
    r"""TARP expected coverage with an exact permutation test, accumulated over batches.

    ``update(posterior, theta, x)`` draws ``S`` posterior samples per pair and
    ``num_references`` reference points per pair, and stores the pair's rank table (the
    TARP rank of its truth and of its first draws under each reference,
    :func:`~calib_lightning.functional.tarp.tarp_rank_table`); ``compute()`` averages the
    expected-coverage curve over the references and tests it with the exact permutation
    null (:func:`~calib_lightning.functional.tarp.tarp_permutation_test`; the math and why
    the level holds: :mod:`calib_lightning.functional.tarp`). It returns the
    sup-deviation statistic, its p-value under :math:`H_0`: "the posterior is
    calibrated", the coverage error (the ATC of Lemos et al.) and the curve.

    State: ``K = min(S + 1, MAX_POSITIONS)`` values x ``R`` references ranks per pair
    (``6.5`` kB per pair at the defaults), gathered under DDP and put in a canonical
    order: DDP equals one process. At most ``max_pairs`` pairs per process are kept.
    ``update`` samples ``chunk_size`` pairs at a time (by default in calls sized from the
    memory budget).

    Coordinates: distances are measured on ``theta / scale`` and references are drawn
    uniformly in the box ``[low, high]``. Unless given, both are fitted in the first
    ``compute`` on the pooled values (``theta`` and samples) of the pairs updated before
    it (:func:`~calib_lightning.functional.tarp.tarp_box`,
    :func:`~calib_lightning.functional.tarp.tarp_fit_scale`): a function of each pair's
    unordered values (not random), so the test stays exact. Until then
    ``update`` keeps those pairs' ``theta`` and samples (``S * N * D`` numbers per
    process; pass ``scale`` and ``reference_bounds``, e.g. from the prior's range, to
    stream from the start). The coordinates are then kept (also across ``reset``), so
    that every batch and epoch is measured in the same units; a later ``compute`` on the
    *same* pairs (a callback's next epochs) tests them in coordinates fitted on the
    earlier posterior's draws, which are independent of the later test's positions too.
    References of the pending pairs come from a stream seeded by ``seed + 2`` in a
    canonical order of a key symmetric in each pair's values; after fitting each process
    draws its own. ``update`` makes no collective call, so a process that receives no
    batch cannot stall the others.

    Arguments:
        num_posterior_samples: ``S`` samples per pair.
        scale: per-dimension scale ``(D,)``; ``None``: fitted as above.
        reference_bounds: ``(low, high)``, each ``(D,)`` in parameter units (e.g. the
            bounds of a box prior); ``None``: fitted as above.
        num_references: ``R`` reference points per pair.
        distance: ``"l2"`` or ``"l1"``.
        num_null: permutations drawn by ``compute``.
        level: the band in ``compute``'s output is the ``1 - level`` null quantile.
        num_bins: the curve is returned on ``num_bins + 1`` levels in ``[0, 1]``.
        seed: seeds the references and, hashed with the observed ranks, the permutations.
        chunk_size: pairs sampled at once; ``None`` (default): calls sized from the
            memory budget (:func:`calib_lightning.set_memory_budget`), as
            :class:`~calib_lightning.RankCalibration`'s.
        max_pairs: per-process bound on stored pairs.

    ``update`` also accepts, in place of a posterior, a tensor of samples ``(S, N, D)``
    already drawn at ``x`` (from MCMC or another library).

    Example:
        >>> from calib_lightning.tasks import GaussianToy
        >>> toy, g = GaussianToy(dim=2), torch.Generator().manual_seed(0)
        >>> metric = TARP(num_posterior_samples=200)
        >>> _ = torch.manual_seed(0)
        >>> for _ in range(4):
        ...     theta, x = toy.sample(250, g)
        ...     metric.update(toy.posterior(variance_scale=0.5), theta, x)
        >>> out = metric.compute()
        >>> int(out.num_pairs), bool(out.p_value < 0.01), bool(out.coverage_error < 0)
        (1000, True, True)

    References:
        Lemos, Coogan, Hezaveh, Perreault-Levasseur. "Sampling-Based Accuracy Testing of
        Posterior Estimators for General Inference." ICML 2023.
    """

    is_differentiable = False
    higher_is_better = False
    full_state_update = False

    tables: list[Tensor]

    def __init__(
        self,
        num_posterior_samples: int = 1000,
        scale: Tensor | None = None,
        reference_bounds: tuple[Tensor, Tensor] | None = None,
        num_references: int = NUM_REFERENCES,
        distance: str = "l2",
        num_null: int = 1000,
        level: float = 0.05,
        num_bins: int = 100,
        seed: int = 0,
        chunk_size: int | None = None,
        max_pairs: int = 100_000,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        check_positive("num_posterior_samples", num_posterior_samples, integer=True)
        check_positive("num_references", num_references, integer=True)
        check_choice("distance", distance, DISTANCES)
        check_positive("num_null", num_null, integer=True)
        check_probability("level", level)
        check_positive("num_bins", num_bins, integer=True)
        check_positive("max_pairs", max_pairs, integer=True)
        if chunk_size is not None:
            check_positive("chunk_size", chunk_size, integer=True)
        self.num_posterior_samples, self.distance = num_posterior_samples, distance
        self.num_references, self.max_pairs = num_references, max_pairs
        self.num_null, self.level, self.num_bins = num_null, level, num_bins
        self.seed, self.chunk_size = seed, chunk_size
        self.positions = min(num_posterior_samples + 1, MAX_POSITIONS)

        empty = torch.empty(0)
        if scale is not None:
            check_scale(scale)
        low = high = empty
        if reference_bounds is not None:
            low, high = (torch.as_tensor(b).detach().clone() for b in reference_bounds)
            if (
                low.ndim != 1
                or low.shape != high.shape
                or not bool((high >= low).all())
                or not bool(torch.isfinite(high - low).all())
            ):
                raise ValueError(
                    "reference_bounds must be (low, high), two finite tensors of shape (D,) "
                    f"with low <= high, got {low.tolist()} and {high.tolist()}"
                )
        self.register_buffer("scale", empty if scale is None else scale.detach().clone())
        self.register_buffer("low", low)
        self.register_buffer("high", high)
        self.add_state("tables", default=[], dist_reduce_fx="cat")  # (N, K, R) int32
        # pairs updated before the coordinates were fitted, ranked in compute
        self.add_state("pending_theta", default=[], dist_reduce_fx="cat")
        self.add_state("pending_samples", default=[], dist_reduce_fx="cat")  # (N, S, D)
        self._generator: torch.Generator | None = None
        self._warned = False

    # -- coordinates ----------------------------------------------------------------
    def _fitted(self) -> bool:
        return self.scale.numel() > 0 and self.low.numel() > 0

    def _fit(self, samples: Tensor, theta: Tensor) -> None:
        """Fit the missing scale and reference box on the pooled values of the pending
        pairs ``samples (S, N, D)``, ``theta (N, D)``; no communication."""
        if theta.shape[0] < 2 and not self._fitted():
            raise ValueError(
                "TARP fits its coordinates in compute on the pairs updated before it and "
                f"needs N >= 2 pairs there, got N = {theta.shape[0]}; pass scale= and "
                "reference_bounds= to fit nothing"
            )
        values = pooled_values(samples.double(), theta.double())
        if self.scale.numel() == 0:
            self.scale = tarp_fit_scale(values).to(theta.device)
        if self.low.numel() == 0:
            low, high = tarp_box(values, theta.shape[0])
            self.low, self.high = low.to(theta.device), high.to(theta.device)

    def _load_from_state_dict(self, state_dict: dict, prefix: str, *args: Any) -> None:
        for name in ("scale", "low", "high"):
            if prefix + name in state_dict:
                setattr(self, name, torch.empty_like(state_dict[prefix + name]))
        super()._load_from_state_dict(state_dict, prefix, *args)

    def _table(self, samples: Tensor, theta: Tensor, generator: torch.Generator) -> Tensor:
        """Rank table ``(N, K, R)`` of ``theta (N, D)`` and ``samples (S, N, D)`` under
        ``R`` fresh references per pair from ``generator``."""
        references = tarp_references(
            self.low.to(theta.dtype),
            self.high.to(theta.dtype),
            theta.shape[0],
            self.num_references,
            generator,
        )
        scale = self.scale.to(dtype=theta.dtype, device=theta.device)
        return tarp_rank_table(
            samples.to(theta.dtype),
            theta,
            references.to(theta.device),
            scale=scale,
            distance=self.distance,
            positions=self.positions,
        ).to(torch.int32)

    def _process_generator(self) -> torch.Generator:
        if self._generator is None:
            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
            self._generator = torch.Generator().manual_seed(self.seed + 7919 * (rank + 1))
        return self._generator

    # -- accumulation -----------------------------------------------------------------
    def update(self, posterior: Posterior | object | Tensor, theta: Tensor, x: Tensor) -> None:
        """Add the rank tables of the pairs ``theta (N, D)``, ``x (N, *X)`` (or keep the
        pairs until ``compute`` while the coordinates are not fitted)."""
        check_pairs(theta, x)
        check_event_size(posterior, theta, x)
        n, d = theta.shape
        known = [
            (name, getattr(self, name).shape[0])
            for name in ("scale", "low")
            if getattr(self, name).numel()
        ]
        if self.pending_theta:
            known.append(("earlier updates", self.pending_theta[0].shape[1]))
        for name, dim in known:
            if dim != d:
                raise ValueError(
                    f"theta must have D = {dim} columns like {name}, got shape {tuple(theta.shape)}"
                )
        size = self.num_posterior_samples
        if isinstance(posterior, Tensor) and posterior.shape != (size, n, d):
            raise ValueError(
                f"posterior samples must have shape ({size}, {n}, {d}) "
                f"(num_posterior_samples, N, D), got {tuple(posterior.shape)}"
            )
        keep = room_for_rows(self, n, self.tables, self.pending_theta)
        if keep == 0:
            return
        theta, x = theta[:keep], x[:keep]
        if isinstance(posterior, Tensor):
            posterior = posterior[:, :keep]
        for rows, samples in _sample_chunks(posterior, x, size, self.chunk_size):
            if not self._fitted():
                self.pending_theta.append(theta[rows].detach())
                self.pending_samples.append(samples.detach().to(theta.dtype).transpose(0, 1))
            else:
                self.tables.append(
                    self._table(samples, theta[rows].detach(), self._process_generator())
                )

    def reset(self) -> None:
        super().reset()
        self._generator = None
        self._warned = False

    def _sync_dist(self, dist_sync_fn: Any = gather_all_tensors, process_group: Any = None) -> None:
        # a process without pairs must gather (0, ...) tensors of the right dtype;
        # torchmetrics has no public hook before its gather, so this override stays
        shape_empty_list_states(
            self,
            ("tables", "pending_theta", "pending_samples"),
            process_group or self.process_group,
        )
        super()._sync_dist(dist_sync_fn, process_group)

    def _pending_table(self) -> Tensor | None:
        """Rank table of the pending pairs (all processes' when synced), after fitting the
        coordinates on them if needed; ``None`` if there are none."""
        theta = self.pending_theta
        theta = (dim_zero_cat(theta) if theta else None) if isinstance(theta, list) else theta
        if theta is None or theta.numel() == 0:
            return None
        samples = dim_zero_cat(self.pending_samples)  # (N, S, D)
        # canonical order by a key symmetric in each pair's S + 1 values: which seeded
        # references a pair gets does not depend on which of its values is the true one
        order = canonical_order(theta.double() + samples.double().sum(1))
        theta, samples = theta[order], samples[order].transpose(0, 1)
        if not self._fitted():
            self._fit(samples, theta)
        # one stream for all processes' pending pairs (in canonical order): DDP = one process
        return self._table(samples, theta, torch.Generator().manual_seed(self.seed + 2))

    def compute(self) -> TARPResult:
        """Statistic, p-value, coverage error, band, the curve (``credibility``,
        ``coverage``) and ``num_pairs``, as a :class:`~calib_lightning.functional.tarp.TARPResult`.

        TARP runs one test, so ``p_value`` is its verdict (no ``global_p_value``); it is a
        Monte Carlo p-value, never below ``1 / (num_null + 1)``. ``coverage_error`` follows
        the package's sign convention on the upper half of the curve (negative =
        over-confident; ``Reading the sign`` in :mod:`calib_lightning.functional.sbc`).
        """
        parts = []
        tables = self.tables
        if isinstance(tables, list):  # not synced: this process's batches
            tables = dim_zero_cat(tables) if tables else None
        if tables is not None and tables.numel():  # (synced, empty everywhere: a 1-D stub)
            parts.append(tables.long())
        pending = self._pending_table()
        if pending is not None:
            parts.append(pending.long().to(parts[0].device) if parts else pending.long())
        table = torch.cat(parts) if parts else None
        if table is None or table.shape[0] == 0:
            raise ValueError("TARP.compute() needs at least one update with N >= 1 pairs, got none")
        table = table[canonical_order(table.flatten(1).double())]  # DDP = one process
        return tarp_permutation_test(
            table,
            self.num_posterior_samples,
            num_null=self.num_null,
            level=self.level,
            num_bins=self.num_bins,
            generator=torch.Generator().manual_seed(_null_seed(self.seed, table[:, 0])),
        )


def _null_seed(seed: int, ranks: Tensor) -> int:
    """Seed of the permutations: a hash of ``seed`` and the true parameters' ranks.

    One seed for every calibration set would give every set of the same size the same
    ``B`` permutation draws, so that the level over calibration sets is that of one
    null sample; hashing the observed ranks in gives each set its own and keeps the
    p-value reproducible (and equal under DDP, where the table is gathered and ordered
    first).
    """
    data = ranks.detach().cpu().to(torch.int64).numpy().tobytes()
    digest = hashlib.blake2b(data, digest_size=8, key=str(seed).encode()).digest()
    return int.from_bytes(digest, "little") % 2**63
