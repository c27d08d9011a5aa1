r"""Expected coverage of an unnormalized posterior by importance sampling, as a ``Metric``."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torchmetrics import Metric
from torchmetrics.utilities.data import dim_zero_cat

from calib_lightning._utils.chunks import row_blocks
from calib_lightning._utils.distributed import shape_empty_list_states
from calib_lightning._utils.validation import check_pairs, check_positive
from calib_lightning.evaluation import draw_chunks
from calib_lightning.functional.importance import (
    MIN_EFFECTIVE_SAMPLE_SIZE,
    ImportanceCoverageResult,
    importance_coverage,
    importance_credibility,
)
from calib_lightning.metrics._adaptive import adaptive_blocks
from calib_lightning.posteriors import UnnormalizedPosterior, as_posterior

__all__ = ["ImportanceCoverage"]

_PRIOR_CHUNK_ELEMENTS = 2**21  # numbers of prior draws per block of pairs


class ImportanceCoverage(Metric):
    r"""Expected coverage of a posterior known up to its normalizing constant, no MCMC.

    ``update(posterior, theta, x)`` takes an :class:`~calib_lightning.UnnormalizedPosterior`
    (or what ``cl.as_posterior(obj, prior=prior)`` makes one of: an sbi ratio or likelihood
    estimator with its prior, an sbi ``MCMCPosterior``), draws ``M =
    num_proposal_samples`` samples per pair from the proposal (the posterior's prior by
    default; any posterior the package can sample with its log-density, e.g. a flow
    trained on the same simulations, as ``proposal=``), and computes the randomized
    highest-density credibility :math:`c` of each true parameter by self-normalized
    importance sampling, with the truth's own weight in the sample
    (:mod:`calib_lightning.functional.importance`): :math:`c` is exactly :math:`U(0, 1)`
    for a calibrated posterior, for any ``M`` and proposal. ``compute()`` tests it
    (chi-square and ECDF band, combined in ``global_p_value``) and returns the
    expected-coverage curve, ``coverage_error`` (**negative = over-confident**, as
    :class:`~calib_lightning.RankCalibration`) and the effective sample size (ESS) per pair.
    The sign does not tell over-confidence from bias: a posterior shifted away from the
    truth also leaves it outside its credible regions too often, and its error is negative
    too (every rejection of a shifted likelihood in
    ``examples/benchmarks/results/unnormalized_level.md``).

    Small ESS: the level holds, but with the weight on a few draws the test cannot see a
    miscalibration. When the median ESS is below ``min_ess`` (default 50), the result's
    p-values and ``coverage_error`` are NaN and ``cannot_judge`` names the ESS and what to
    do (more draws, a proposal closer to the posterior): a conservative default, since
    the level holds at any ESS (``tests/test_importance_coverage.py`` checks it at a
    median ESS below 3).

    States: ``credibility`` and ``effective_sample_size``, ``cat`` list states of one
    float64 per pair each (16 bytes a pair). ``update`` holds the draws of one block of
    pairs, sized from the memory budget (a posterior proposal) or to about ``2**21``
    numbers (the prior).

    Arguments:
        num_proposal_samples: ``M >= 1`` proposal draws per pair.
        proposal: ``None`` (the posterior's prior), ``"adaptive"`` (a Gaussian fitted
            to the target per pair from ``M / 2`` earlier draws, mixed with the prior;
            the last ``M / 2`` draws are the sample: for a posterior much narrower than
            the prior, e.g. ``D >= 3``; :mod:`calib_lightning.metrics._adaptive`) or a
            posterior with ``sample`` and ``log_prob`` (anything
            :func:`calib_lightning.as_posterior` accepts).
        min_ess: median ESS below which the result cannot judge.
        num_bins: chi-square bins; default ``min(20, max(2, N // 5))``.
        num_ecdf_points: ``K`` levels of the curve and of the ECDF test.
        max_chunk_elements: bound on draws per block (``pairs * M * D``) instead of the
            default.
        seed: seed of the proposal's draws and of the randomization :math:`V` (``None``:
            torch's global generator); under DDP each rank draws from its own stream.

    Example:
        >>> from torch.distributions import Independent, Normal
        >>> prior = Independent(Normal(torch.zeros(1), torch.ones(1)), 1)
        >>> post = UnnormalizedPosterior(
        ...     lambda t, x: -0.5 * ((x - t) ** 2).sum(-1) / 0.25, prior=prior)
        >>> g = torch.Generator().manual_seed(0)
        >>> theta = torch.randn(300, 1, generator=g)
        >>> x = theta + 0.5 * torch.randn(300, 1, generator=g)
        >>> metric = ImportanceCoverage(seed=0)
        >>> metric.update(post, theta, x)
        >>> out = metric.compute()
        >>> bool(out.global_p_value > 0.01), out.cannot_judge, float(out.ess_median) > 50
        (True, None, True)

    References:
        Hermans et al. "A trust crisis in simulation-based inference? Your posterior
        approximations can be unfaithful." TMLR (2022).
    """

    is_differentiable = False
    higher_is_better = None
    full_state_update = False

    def __init__(
        self,
        num_proposal_samples: int = 1000,
        proposal: Any = None,
        min_ess: float = MIN_EFFECTIVE_SAMPLE_SIZE,
        num_bins: int | None = None,
        num_ecdf_points: int = 100,
        max_chunk_elements: int | None = None,
        seed: int | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        check_positive("num_proposal_samples", num_proposal_samples, integer=True)
        if isinstance(min_ess, bool) or not isinstance(min_ess, int | float) or min_ess < 0:
            raise ValueError(f"min_ess must be a number >= 0, got {min_ess!r}")
        if num_bins is not None:
            check_positive("num_bins", num_bins, integer=True)
            if num_bins < 2:
                raise ValueError(f"num_bins must be >= 2, got {num_bins}")
        check_positive("num_ecdf_points", num_ecdf_points, integer=True)
        if max_chunk_elements is not None:
            check_positive("max_chunk_elements", max_chunk_elements, integer=True)
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise ValueError(f"seed must be an integer or None, got {seed!r}")
        if isinstance(proposal, str) and proposal != "adaptive":
            raise ValueError(f"proposal must be None, 'adaptive' or a posterior, got {proposal!r}")
        if proposal == "adaptive" and num_proposal_samples < 8:
            raise ValueError(
                f"num_proposal_samples must be >= 8 with proposal='adaptive' (four fitting "
                f"stages and the sample), got {num_proposal_samples}"
            )
        self.proposal = proposal if proposal in (None, "adaptive") else as_posterior(proposal)
        if not isinstance(self.proposal, str | None) and not {"sample", "log_prob"} <= set(
            self.proposal.capabilities
        ):
            raise ValueError(
                f"proposal must be a posterior with sample and log_prob (a flow, an sbi "
                f"DirectPosterior), got {self.proposal!r}"
            )
        self.num_proposal_samples, self.min_ess = num_proposal_samples, min_ess
        self.num_bins, self.num_ecdf_points = num_bins, num_ecdf_points
        self.max_chunk_elements = max_chunk_elements
        self.seed, self._generator = seed, None
        self.add_state("credibility", [], dist_reduce_fx="cat")
        self.add_state("effective_sample_size", [], dist_reduce_fx="cat")

    def update(self, posterior: Any, theta: Tensor, x: Tensor) -> None:
        """Credibility and ESS of each true ``theta (N, D)`` at ``x (N, *X)``."""
        check_pairs(theta, x)
        target = as_posterior(posterior)
        target.check_reading(theta, x)  # data shaped for another reading of the model
        if not isinstance(target, UnnormalizedPosterior):
            raise ValueError(
                "posterior must be an UnnormalizedPosterior (or an sbi ratio/likelihood "
                "estimator with prior=, an sbi MCMCPosterior), got "
                f"{type(posterior).__name__}; for a flow use RankCalibration"
            )
        d = target.event_size()
        if theta.shape[1] != d:
            raise ValueError(f"theta must have shape (N, D) = (N, {d}), got {tuple(theta.shape)}")
        parts = (
            self._prior_blocks
            if self.proposal is None
            else self._adaptive_blocks
            if isinstance(self.proposal, str)
            else self._proposal_blocks
        )
        with torch.no_grad():
            for lt, lp, lt0, lp0 in parts(target, theta, x):
                c, ess = importance_credibility(lt, lp, lt0, lp0, generator=self.generator)
                self.credibility.append(c.to(self.device))
                self.effective_sample_size.append(ess.to(self.device))

    @property
    def generator(self) -> torch.Generator | None:
        """This process's generator: ``seed`` on rank 0, ``seed + 7919 rank`` on the others
        under DDP (the same draws on every rank would tie their pairs' errors)."""
        if self.seed is not None and self._generator is None:
            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
            self._generator = torch.Generator().manual_seed(self.seed + 7919 * rank)
        return self._generator

    def _seeded(self, draw: Any) -> Any:
        """``draw()`` under a seed from this process's generator when there is one."""
        with torch.random.fork_rng(enabled=self.generator is not None):
            if self.generator is not None:
                torch.manual_seed(int(torch.randint(2**62, (), generator=self.generator)))
            return draw()

    def _row_blocks(self, theta: Tensor) -> Any:
        """Blocks of pairs whose ``M`` draws each fit the chunk budget."""
        m, d = self.num_proposal_samples, theta.shape[1]
        size = max(1, (self.max_chunk_elements or _PRIOR_CHUNK_ELEMENTS) // (m * d))
        return row_blocks(theta.shape[0], size)

    def _prior_blocks(self, target: UnnormalizedPosterior, theta: Tensor, x: Tensor) -> Any:
        """Per block of pairs: target and prior log-densities of ``M`` prior draws."""
        m, d = self.num_proposal_samples, theta.shape[1]
        for rows in self._row_blocks(theta):
            n = rows.stop - rows.start
            draws = self._seeded(lambda n=n: target.prior.sample((m, n))).reshape(m, n, d)
            draws = draws.to(theta)
            lt = target.unnormalized_log_prob(draws, x[rows])
            lt0 = target.unnormalized_log_prob(theta[rows], x[rows])
            lp = target.log_prior(draws.to(lt.dtype)).to(lt)
            yield lt, lp, lt0, target.log_prior(theta[rows].to(lt0.dtype)).to(lt0)

    def _adaptive_blocks(self, target: UnnormalizedPosterior, theta: Tensor, x: Tensor) -> Any:
        """Per block of pairs: the last stage's draws of the adaptive proposal
        (:mod:`calib_lightning.metrics._adaptive`)."""
        rows = self._row_blocks(theta)
        yield from adaptive_blocks(target, theta, x, self.num_proposal_samples, rows, self._seeded)

    def _proposal_blocks(self, target: UnnormalizedPosterior, theta: Tensor, x: Tensor) -> Any:
        """Per block of pairs: target and proposal log-densities of all ``M`` draws."""
        m = self.num_proposal_samples
        held: list[tuple[Tensor, Tensor]] = []
        chunks = draw_chunks(
            self.proposal,
            theta,
            x,
            m,
            log_densities=True,
            max_chunk_elements=self.max_chunk_elements,
        )
        while (chunk := self._seeded(lambda: next(chunks, None))) is not None:
            rows = slice(chunk.start, chunk.start + chunk.theta.shape[0])
            lt = target.unnormalized_log_prob(chunk.samples, x[rows])
            held.append((lt, chunk.log_prob.to(lt)))
            if chunk.first_draw + chunk.samples.shape[0] < m:
                continue
            lt_all, lp_all = (torch.cat(p, 0) for p in zip(*held, strict=True))
            held = []
            lt0 = target.unnormalized_log_prob(chunk.theta, x[rows])
            yield lt_all, lp_all, lt0, chunk.log_prob_theta.to(lt0)

    def sync(
        self,
        dist_sync_fn: Any = None,
        process_group: Any = None,
        should_sync: bool = True,
        distributed_available: Any = None,
    ) -> None:
        """torchmetrics' ``sync``; first, when it will gather, a process without pairs gives
        its empty states the dtype of the others' (torchmetrics would send float32 against
        their float64, a collective mismatch)."""
        available = distributed_available or self.distributed_available_fn
        if should_sync and callable(available) and available():
            shape_empty_list_states(
                self, ("credibility", "effective_sample_size"), process_group or self.process_group
            )
        super().sync(dist_sync_fn, process_group, should_sync, distributed_available)

    def compute(self) -> ImportanceCoverageResult:
        """Tests, curve, coverage error and ESS summary (see the class docstring)."""
        c = (
            dim_zero_cat(self.credibility)
            if isinstance(self.credibility, list) and self.credibility
            else self.credibility
        )
        if not isinstance(c, Tensor) or c.numel() < 2:
            n = c.numel() if isinstance(c, Tensor) else 0
            raise ValueError(f"ImportanceCoverage.compute() needs N >= 2 pairs, got N = {n}")
        ess = self.effective_sample_size
        ess = dim_zero_cat(ess) if isinstance(ess, list) else ess
        return importance_coverage(
            c,
            ess,
            min_ess=self.min_ess,
            num_bins=self.num_bins,
            num_ecdf_points=self.num_ecdf_points,
        )
