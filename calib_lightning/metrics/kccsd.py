"""Streaming KCCSD calibration test as a torchmetrics ``Metric``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor
from torchmetrics import Metric
from torchmetrics.utilities.data import dim_zero_cat

from calib_lightning import evaluation
from calib_lightning._utils.distributed import (
    canonical_order,
    gather_rows,
    room_for_rows,
    shape_empty_list_states,
)
from calib_lightning._utils.validation import (
    check_choice,
    check_matrix,
    check_pairs,
    check_positive,
)
from calib_lightning.functional.kccsd import gaussian_base_points, kccsd
from calib_lightning.kernels import DISTRIBUTION_KERNELS, KERNELS
from calib_lightning.posteriors import Posterior
from calib_lightning.posteriors.base import UnsupportedError
from calib_lightning.posteriors.unnormalized import in_testing_space
from calib_lightning.results import Result

__all__ = ["KCCSD", "KCCSDResult"]


@dataclass(eq=False)
class KCCSDResult(Result):
    r"""What :meth:`KCCSD.compute` (and :meth:`KCCSD.forward`, for its batch) returns.

    Attributes:
        statistic: the U-statistic :math:`\hat C`, ``()``: about 0 for a calibrated
            model, larger when it is not (with its autograd graph from ``forward``).
        p_value: wild-bootstrap p-value of :math:`H_0`: calibrated, ``()``.
        bandwidth: :math:`\ell` of the kernel on parameters, ``()``.
        distribution_bandwidth: :math:`\sigma` of the kernel between models, ``()``; NaN
            without a distribution kernel.
        num_pairs: calibration pairs used (all processes together), ``()`` int64.
        p_value_error: ``()`` Monte Carlo standard error of ``p_value`` from the ``B``
            bootstrap draws, :math:`\sqrt{p (1 - p) / B}` (the spread over seeds, base
            points included: ``examples/benchmarks/results/seed_stability.md``).
        space: ``None`` when the test ran on ``theta`` itself; ``"unconstrained"`` when it
            ran on :math:`u = T^{-1}(\theta)`, :math:`T` mapping :math:`\mathbb{R}^D` onto
            the support of the prior of an
            :class:`~calib_lightning.posteriors.UnnormalizedPosterior` whose support is
            bounded (the Stein identity needs a density that vanishes at the support's
            edge, which a posterior truncated to a box does not). Calibration is the same
            property in either space: :math:`T` is a bijection applied to the truths and
            the posteriors alike.
    """

    logged: ClassVar[tuple[str, ...]] = (
        "statistic",
        "p_value",
        "bandwidth",
        "distribution_bandwidth",
        "num_pairs",
    )
    verdict: ClassVar[str | None] = "p_value"

    statistic: Tensor
    p_value: Tensor
    bandwidth: Tensor
    distribution_bandwidth: Tensor
    num_pairs: Tensor
    p_value_error: Tensor | None = None
    space: str | None = None


class KCCSD(Metric):
    r"""Kernel calibration-conditional Stein discrepancy with a wild-bootstrap test.

    ``update(posterior, theta, x)`` evaluates the posterior's score at each true
    parameter and at ``m`` base points shared by all pairs, and stores them;
    ``compute()`` returns a :class:`KCCSDResult`: the U-statistic and its p-value
    under :math:`H_0`: "the posterior is calibrated" (small p-values reject). The
    scores come from the model-evaluation layer
    (:func:`calib_lightning.evaluation.pair_and_base_scores`), the test from
    :func:`calib_lightning.functional.kccsd`.

    ``forward`` additionally returns the statistic of the batch *with its autograd
    graph*, so it can be backpropagated into the posterior's parameters.

    Unnormalized posteriors (:class:`~calib_lightning.posteriors.UnnormalizedPosterior`:
    ratio and likelihood estimators with their prior) need only their scores. When the
    prior's support is bounded (a box), the test runs in the unconstrained space
    :math:`u = T^{-1}(\theta)` of
    :meth:`~calib_lightning.posteriors.UnnormalizedPosterior.unconstrained`: the true
    parameters are mapped there, the scores are those of the posterior of :math:`u`
    (log-Jacobian included), the base points are fitted to the :math:`u` and the result
    says ``space="unconstrained"``. Other posteriors are tested on ``theta`` as given.

    Memory: each process keeps at most ``max_pairs`` pairs, i.e.
    ``max_pairs * (m + 2) * D`` numbers; further pairs are ignored with a warning.
    Until the base points are fitted (see ``base_points``), a pair's scores at them
    cannot be evaluated, so ``update`` also keeps a reference to the pair's ``x`` and
    to the posterior (``max_pairs * X`` more numbers at most) and ``compute``
    evaluates them. ``compute`` needs ``O(block_size^2 + n * num_null)`` memory,
    not ``O(n^2)``. Under DDP the pairs of all processes are gathered and put in a
    canonical order, so the result does not depend on how the data was split.

    DDP: ``update`` makes no collective call, so a process that receives no batch
    cannot stall the others; all communication happens in ``compute``, which every
    process calls.

    Arguments:
        kernel: ``"rbf"`` or ``"imq"`` kernel on parameters.
        bandwidth: its bandwidth; ``None``: median heuristic.
        distribution_kernel: ``"gfd"``, ``"kgfd"`` or ``None`` (no conditioning on the
            model; then the test only checks the marginal fit).
        distribution_bandwidth: bandwidth of the kernel between models; ``None``: median
            heuristic.
        base_points: ``(m, D)`` tensor fixed by the user, an int ``m``, or ``None``
            (32). Drawn points come from a Gaussian fitted, in the first ``compute``,
            to all the thetas of the updates before it (pooled over processes, in a
            canonical order), so the base measure covers the data in its own units;
            they are then kept (also across ``reset`` and in the ``state_dict``). The
            scores of the pairs of those first updates at the base points are
            evaluated in that ``compute``, with the posterior each was given.
        num_null: wild-bootstrap replicates ``B``.
        max_pairs: the per-process bound on stored pairs.
        seed: seeds the base points and the bootstrap multipliers.
        block_size: side of the blocks of the kernel matrix computed at once.
        score_chunk_size: ``score_chunk_size * N`` posterior evaluations per call at
            the base points; ``None`` (default): blocks of pairs and base points sized
            from the memory budget (:func:`calib_lightning.set_memory_budget`); with
            ``forward``'s gradient, 16 base points at all pairs.

    Example:
        >>> from calib_lightning.tasks import MGM
        >>> model = MGM(delta=0.0)
        >>> metric = KCCSD()
        >>> for seed in range(4):
        ...     theta, x = model.sample(100, torch.Generator().manual_seed(seed))
        ...     metric.update(model, theta, x)
        >>> out = metric.compute()
        >>> sorted(out)  # doctest: +NORMALIZE_WHITESPACE
        ['bandwidth', 'distribution_bandwidth', 'num_pairs', 'p_value', 'p_value_error',
         'statistic']
        >>> int(out.num_pairs), bool(out.p_value > 0.05)
        (400, True)

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
        num_null: int = 500,
        max_pairs: int = 4096,
        seed: int = 0,
        block_size: int = 1024,
        score_chunk_size: int | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        check_choice("kernel", kernel, KERNELS)
        check_choice("distribution_kernel", distribution_kernel, (*DISTRIBUTION_KERNELS, None))
        for name, value in (
            ("bandwidth", bandwidth),
            ("distribution_bandwidth", distribution_bandwidth),
        ):
            if value is not None:
                check_positive(name, value)
        check_positive("num_null", num_null, integer=True)
        check_positive("max_pairs", max_pairs, integer=True)
        check_positive("block_size", block_size, integer=True)
        if score_chunk_size is not None:
            check_positive("score_chunk_size", score_chunk_size, integer=True)
        self.kernel, self.bandwidth = kernel, bandwidth
        self.distribution_kernel = distribution_kernel
        self.distribution_bandwidth = distribution_bandwidth
        self.num_null, self.max_pairs, self.seed = num_null, max_pairs, seed
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
        # pairs updated before the base points were fitted: scores at the base points
        # pending, evaluated in compute from (posterior, x) kept on this process
        self.add_state("pending_theta", default=[], dist_reduce_fx="cat")
        self.add_state("pending_score", default=[], dist_reduce_fx="cat")
        self._pending: list[tuple[Posterior | object, Tensor]] = []
        self._warned = False
        self._forward_grad: bool | None = None  # set while forward() runs update()
        self._last_batch: tuple[Tensor, Tensor, Tensor | None, Tensor | None] | None = None
        self._space: str | None = None
        self._space_set = False  # whether the updates (or the fitted base points) chose it

    # -- base measure -------------------------------------------------------------
    def _base_points_for(self, theta: Tensor) -> Tensor:
        """:func:`~calib_lightning.functional.kccsd.gaussian_base_points` ``(m, D)`` of
        ``theta``, its rows in canonical order and in float64 (so that the points depend
        neither on how the rows arrived nor on their dtype); no communication."""
        _check_enough_pairs(theta.shape[0])
        generator = torch.Generator().manual_seed(self.seed)
        ordered = theta[canonical_order(theta)].double()
        return gaussian_base_points(ordered, self.num_base_points, generator).to(theta)

    def _load_from_state_dict(self, state_dict: dict, prefix: str, *args: Any) -> None:
        key = prefix + "base_points"
        if key in state_dict:
            self.base_points = torch.empty_like(state_dict[key])
        super()._load_from_state_dict(state_dict, prefix, *args)

    # -- accumulation ---------------------------------------------------------------
    def update(self, posterior: Posterior | object, theta: Tensor, x: Tensor) -> None:
        """Score the posterior at the calibration pairs ``theta (N, D)``, ``x (N, *X)``."""
        check_pairs(theta, x)
        posterior, theta = self._testing_space(posterior, theta)
        base = None
        fitted = self.base_points.numel() > 0
        if self.distribution_kernel is not None and fitted:
            if self.base_points.shape[1] != theta.shape[1]:
                raise ValueError(
                    f"theta must have D = {self.base_points.shape[1]} columns like base_points, "
                    f"got shape {tuple(theta.shape)}"
                )
            base = self.base_points.to(device=theta.device, dtype=theta.dtype)
        score, base_scores = evaluation.pair_and_base_scores(
            posterior,
            theta,
            x,
            base,
            create_graph=bool(self._forward_grad),
            chunk_size=self.score_chunk_size,
        )
        if self._forward_grad is not None:
            if self.distribution_kernel is not None and not fitted:
                # the batch's own test: base points fitted to the batch, not stored
                batch_base = self._base_points_for(theta.detach())
                base_scores = evaluation.base_scores(
                    posterior,
                    x,
                    batch_base,
                    create_graph=bool(self._forward_grad),
                    chunk_size=self.score_chunk_size,
                )
                self._last_batch = (theta, score, base_scores, batch_base)
            else:
                self._last_batch = (theta, score, base_scores, None)
        room = room_for_rows(self, theta.shape[0], self.theta, self.pending_theta)
        if room == 0:
            return
        keep = slice(0, room)
        if self.distribution_kernel is not None and not fitted:
            self.pending_theta.append(theta[keep].detach())
            self.pending_score.append(score[keep].detach())
            self._pending.append((posterior, x[keep].detach()))
            return
        self.theta.append(theta[keep].detach())
        self.score.append(score[keep].detach())
        if base_scores is not None:
            self.base_scores.append(base_scores[keep].detach())

    def _testing_space(
        self, posterior: Posterior | object, theta: Tensor
    ) -> tuple[Posterior | object, Tensor]:
        """The posterior and ``theta`` in the space the test runs in (see the class
        docstring); the same space for every update until the base points are refitted."""
        post, theta, space = in_testing_space(posterior, theta)
        if self._space_set and space != self._space:
            raise ValueError(
                f"posterior must be tested in one space across updates: the first was tested "
                f"in {self._space or 'theta'} space, this one ({post!r}) in "
                f"{space or 'theta'} space"
            )
        self._space, self._space_set = space, True
        return post, theta

    def reset(self) -> None:
        super().reset()
        self._pending = []
        self._warned = False
        if self.base_points.numel() == 0:  # no base points fitted in the old space
            self._space, self._space_set = None, False

    def sync(
        self,
        dist_sync_fn: Any = None,
        process_group: Any = None,
        should_sync: bool = True,
        distributed_available: Any = None,
    ) -> None:
        """torchmetrics' ``sync``; first, when it will gather, a process without data
        shapes its empty list states ``(0, *trailing)`` with the right dtype (the public
        ``dist_sync_fn`` hook sees tensors only, never an empty list)."""
        available = distributed_available or self.distributed_available_fn
        if should_sync and callable(available) and available():
            shape_empty_list_states(self, _LIST_STATES, process_group or self.process_group)
        super().sync(dist_sync_fn, process_group, should_sync, distributed_available)

    def _test(
        self,
        theta: Tensor,
        score: Tensor,
        base_scores: Tensor | None,
        base: Tensor | None = None,
    ) -> KCCSDResult:
        n = theta.shape[0]
        _check_enough_pairs(n)
        if base_scores is None:
            base = None
        elif base is None:
            base = self.base_points
        if base is not None:
            base = base.to(device=theta.device, dtype=theta.dtype)
        out = kccsd(
            theta,
            score,
            base_scores,
            base,
            kernel=self.kernel,
            bandwidth=self.bandwidth,
            distribution_kernel=self.distribution_kernel,
            distribution_bandwidth=self.distribution_bandwidth,
            num_null=self.num_null,
            generator=torch.Generator().manual_seed(self.seed + 1),
            block_size=self.block_size,
        )
        if not torch.isfinite(out.statistic).all():  # cl.diagnose lists kccsd as skipped, why
            at_base = ""
            if base_scores is not None:
                largest = base_scores.detach().abs().max().item()
                at_base = f", at the base points as large as {largest:.3g}"
            raise UnsupportedError(
                f"KCCSD's statistic is {out.statistic.detach().tolist()} on N = {n} pairs whose "
                f"scores are finite but as large as {score.detach().abs().max().item():.3g}"
                f"{at_base} (theta up to {theta.detach().abs().max().item():.3g}, kernel "
                f"bandwidth {float(out.bandwidth):.3g}, between models "
                f"{float(out.distribution_bandwidth):.3g}): the kernel sums are not finite in "
                f"{theta.dtype}. "
                "Pass theta and the posterior in float64, or parameters in a scale where the "
                "scores are moderate (standardized parameters)"
            )
        p = out.p_value.detach().double()
        return KCCSDResult(
            **out._asdict(),
            num_pairs=torch.tensor(n, device=theta.device),
            p_value_error=(p * (1 - p) / self.num_null).sqrt(),
            space=self._space,
        )

    def _pending_pairs(self) -> tuple[Tensor, Tensor, Tensor] | None:
        """``(theta, score, base_scores)`` of the pairs updated before the base points were
        fitted (all processes' when synced); fits the base points on their ``theta`` if
        needed. Every process runs the same collectives here."""
        theta = _rows(self.pending_theta)
        if theta is None:
            return None
        if self.base_points.numel() == 0:
            self.base_points = self._base_points_for(theta)
        base = self.base_points.to(device=theta.device, dtype=theta.dtype)
        local = [
            evaluation.base_scores(posterior, x, base, chunk_size=self.score_chunk_size)
            for posterior, x in self._pending
        ]
        base_scores = torch.cat(local) if local else theta.new_zeros(0, *base.shape)
        if _synced(self.pending_theta):  # gathered: gather these in the same rank order
            base_scores = gather_rows(base_scores.to(theta), self.process_group)
        return theta, _rows(self.pending_score), base_scores.to(theta)

    def compute(self) -> KCCSDResult:
        """Statistic, p-value, bandwidths and the number of pairs used."""
        parts = [p for p in (self._pending_pairs(), self._scored_pairs()) if p is not None]
        if not parts:
            raise ValueError("KCCSD.compute() needs at least one update, got none")
        theta = torch.cat([p[0] for p in parts])
        score = torch.cat([p[1] for p in parts])
        base_scores = None
        if self.distribution_kernel is not None:
            base_scores = torch.cat([p[2] for p in parts])
        order = canonical_order(theta)
        theta, score = theta[order], score[order]
        if base_scores is not None:
            base_scores = base_scores[order]
        return self._test(theta, score, base_scores)

    def _scored_pairs(self) -> tuple[Tensor, Tensor, Tensor | None] | None:
        theta = _rows(self.theta)
        if theta is None:
            return None
        base_scores = _rows(self.base_scores) if self.distribution_kernel else None
        return theta, _rows(self.score), base_scores

    def forward(self, posterior: Posterior | object, theta: Tensor, x: Tensor) -> KCCSDResult:
        """Accumulate the batch and return its own test, with the statistic's graph kept."""
        if _synced(self.theta) or _synced(self.pending_theta):
            raise ValueError("KCCSD.forward() cannot run on synced states; call unsync() first")
        grad = torch.is_grad_enabled()
        self._forward_grad = grad
        try:
            self.update(posterior, theta, x)
        finally:
            self._forward_grad = None
        batch, self._last_batch = self._last_batch, None
        with torch.set_grad_enabled(grad):
            return self._test(*batch)


_LIST_STATES = ("theta", "score", "base_scores", "pending_theta", "pending_score")


def _check_enough_pairs(n: int) -> None:
    if n < 2:
        raise ValueError(f"KCCSD needs at least N >= 2 calibration pairs, got N = {n}")


def _synced(state: list[Tensor] | Tensor) -> bool:
    """Whether a ``cat`` state was gathered across processes: torchmetrics' sync turns
    the list into one tensor (a sync outside DDP is a no-op and leaves the list)."""
    return isinstance(state, Tensor)


def _rows(state: list[Tensor] | Tensor) -> Tensor | None:
    """A ``cat`` state (a list, or a tensor once synced) as one tensor; ``None`` if empty."""
    if isinstance(state, list):
        return dim_zero_cat(state) if state else None
    return state if state.numel() else None
