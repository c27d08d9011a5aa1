"""Streaming simulation-based calibration (marginal and energy ranks) as a ``Metric``."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor
from torchmetrics.utilities.data import dim_zero_cat

from calib_lightning._utils.validation import (
    check_choice,
    check_pairs,
    check_positive,
    check_probability,
)
from calib_lightning.evaluation import check_event_size, draw_chunks
from calib_lightning.functional._moments import (
    merge_moments,
    moment_state_size,
    moments,
    variance_from_moments,
)
from calib_lightning.functional.bands import P_VALUE_FLOOR
from calib_lightning.functional.combine import COMBINATION_METHODS, combine_p_values
from calib_lightning.functional.ranks import (
    MOMENT_DRAWS,
    PosteriorDraws,
    rank_chunks,
    rank_histogram,
)
from calib_lightning.functional.sbc import (
    RankCalibrationResult,
    sharpness,
    statistic_tests,
    summarize_ranks,
)
from calib_lightning.metrics._lazy import LazyDimension
from calib_lightning.posteriors import (
    Posterior,
    as_posterior,
    density_draws,
    supports,
    unsupported,
)

__all__ = ["RankCalibration", "posterior_ranks"]


def posterior_ranks(
    posterior: Posterior | object,
    theta: Tensor,
    x: Tensor,
    num_posterior_samples: int,
    *,
    max_chunk_elements: int | None = None,
    generator: torch.Generator | None = None,
    statistics: Sequence[Callable[[Tensor], Tensor]] = (),
    names: Sequence[str] | None = None,
    log_densities: bool | None = None,
) -> PosteriorDraws:
    r"""Draw ``M`` posterior samples per pair in chunks
    (:func:`calib_lightning.evaluation.draw_chunks`: one chunk at a time, sized from the
    memory budget or ``max_chunk_elements``) and reduce them to ranks and moments
    (:func:`~calib_lightning.functional.ranks.rank_chunks`).

    Arguments:
        posterior: anything :func:`calib_lightning.as_posterior` accepts.
        theta: true parameters ``(N, D)``.
        x: observations ``(N, *X)``.
        num_posterior_samples: ``M >= 2``.
        max_chunk_elements: bound on ``samples_per_chunk * pairs_per_chunk * D``;
            ``None``: chunks sized from the memory budget.
        generator: for tie-breaking (sampling uses the posterior's own randomness).
        statistics: ``Q`` test quantities ``(..., D) -> (...)``; their ranks
            (:func:`~calib_lightning.functional.ranks.statistic_ranks`) follow the joint
            rank as the last ``Q`` columns of ``ranks``.
        names: their names, for error messages.
        log_densities: rank jointly by the energy (``True``) or the distance rank
            (``False``, no log-densities drawn); ``None``: the energy when the posterior
            computes log-densities cheaply
            (:func:`~calib_lightning.posteriors.density_draws`).

    Returns:
        :class:`~calib_lightning.functional.ranks.PosteriorDraws` (``ranks`` of shape
        ``(N, D + 1 + Q)``).

    Raises:
        ValueError: for bad shapes, non-finite ``theta``/``x``, or non-finite posterior
            samples/log-densities (naming how many pairs were affected).
    """
    chunks = draw_chunks(
        posterior,
        theta,
        x,
        num_posterior_samples,
        max_chunk_elements=max_chunk_elements,
        log_densities=log_densities,
    )
    return rank_chunks(
        chunks,
        theta.shape[0],
        num_posterior_samples,
        generator=generator,
        statistics=statistics,
        names=names,
    )


class RankCalibration(LazyDimension):
    r"""Simulation-based calibration with marginal and joint (energy) ranks, and sharpness.

    ``update(posterior, theta, x)`` draws ``M = num_posterior_samples`` samples per pair
    with their log-densities (one ``sample_and_log_prob`` pass, in chunks), ranks each
    true parameter among them per dimension and by energy
    :math:`e = -\log q(\theta \mid x)`, and adds the ranks to histograms.
    ``compute()`` tests them for discrete uniformity and returns the curves to plot.

    A posterior known through its samples only (:class:`~calib_lightning.SamplePosterior`)
    has no energy: its joint rank is the distance rank
    (:mod:`~calib_lightning.functional.distance_rank`, exact level by exchangeability),
    and the result's ``joint_statistic`` says ``"distance"``. So, by default
    (``joint="auto"``), does a posterior whose log-density costs many times its sampling
    (an ODE's trace: sbi's ``FMPE`` and ``NPSE``, a zuko ``CNF``; its ``costly``), so that
    the check costs what sampling costs. One metric accumulates one kind of joint rank:
    mixing the two in one histogram raises a ``ValueError``.

    Which test: ``p_value`` (joint) and ``marginal_p_values`` are chi-square tests
    against the *discrete* uniform on ``0..M``, with the rank values grouped into
    ``num_bins`` contiguous bins of exactly known probability (valid for any ``N``
    and ``M``, unlike comparing integer ranks with a continuous uniform).
    ``ecdf_p_values`` (dims, then joint) are exact p-values of the simultaneous ECDF
    band test of Säilynoja et al. (2022): a curve leaves the plotted band exactly
    when its p-value falls below ``level``. ``global_p_value`` combines all
    ``2 (D + 1)`` of them, ``2 (D + 1 + Q)`` with ``statistics`` (Cauchy combination by
    default, ``global_method="holm"`` for Holm's bound) into one p-value for "calibrated
    everywhere tested" that keeps its level although the tests share data: judge the
    check by it, and read the individual p-values to see *where* it fails (see
    :mod:`calib_lightning.functional.sbc`, "Global p-value"). p-values are never
    exactly 0 (floored at about ``2.2e-308``).

    Sign of ``coverage_error`` (signed area between the expected-coverage curve and
    the diagonal): **negative = over-confident** (HPD credible regions cover the truth
    less often than their level), **positive = under-confident**; the package's one
    convention, stated in :mod:`calib_lightning.functional.sbc` ("Reading the sign").

    Sharpness, so that a calibrated but useless posterior (the prior) shows as such:
    ``contraction`` :math:`= 1 - \overline{\mathrm{Var}_q} / \mathrm{Var}_{\mathrm{prior}}`
    per dimension (prior variance estimated from the calibration ``theta``; 0 for the
    prior, near 1 for a sharp posterior) and ``mean_squared_error`` of the posterior
    mean (corrected for its Monte Carlo error), both from the first
    ``min(M, 256)`` draws of each pair.

    States (many small updates equal one big update, and DDP equals one process):
    ``histogram`` ``(D + 1, M + 1)`` int64 rank counts and ``posterior_sums`` ``(2, D)``
    float64 sums of the per-pair posterior variance and squared mean error, both
    sum-reduced; ``theta_moments`` ``(1 + 3 D,)``, the count, an anchor, the mean about it
    and the centred sum of squares of :math:`\theta`
    (:mod:`calib_lightning.functional._moments`), merged with Chan et al.'s formula so the
    prior variance stays exact far from the origin (e.g.
    :math:`\theta = 10^9 + 0.01 z`). Memory is constant in the number of updates;
    ``update`` needs one chunk of draws, sized so that sampling it peaks near the memory
    budget (:func:`calib_lightning.set_memory_budget`, 256 MiB by default), and scratch
    arrays for ranking it (on the CPU about 4 MiB; on a GPU two of the chunk's size).

    Arguments:
        num_posterior_samples: ``M >= 2`` draws per pair.
        num_dims: ``D``; if given, states are allocated at construction; otherwise at
            the first update (under DDP a process that saw no data takes the others'
            ``D`` when the states are synced).
        level: test level of the bands and of ``outside_band``.
        num_bins: chi-square bins; default ``min(M + 1, 20, max(2, N // 5))``.
        num_ecdf_points: levels ``K`` of the ECDF curves (at most ``M``).
        max_chunk_elements: numbers per chunk of ``update`` instead of the memory
            budget (see :func:`posterior_ranks`); ``None``: the budget.
        global_method: ``"cauchy"`` (default) or ``"holm"``: how ``global_p_value``
            combines the tests.
        statistics: test quantities, name -> callable ``theta (..., N, D) -> (..., N)``
            (a norm, a sum, a physical quantity): each adds the rank of
            :math:`f(\theta^*)` among :math:`f(\theta_k)`, tested like a marginal
            (chi-square and ECDF band) and included in ``global_p_value``; results in
            ``statistic_p_values`` and ``statistic_ecdf_p_values`` ``(Q,)``, in the
            order given. They see errors the marginals miss (e.g. a wrong correlation
            shows in the rank of the sum). State: ``statistic_histogram`` ``(Q, M + 1)``.
        max_pairs: per-process bound on the pairs whose truth, posterior mean and
            variance are kept (``3 D`` float64 each) for the recovery plots; the first
            ones are kept, the ranks always use every pair. ``0`` keeps none.
        joint: the joint rank: ``"energy"`` (needs ``log_prob``), ``"distance"`` (any
            posterior, no log-density drawn) or ``"auto"`` (default): the energy when the
            posterior computes log-densities cheaply, else the distance.

    Example:
        >>> from calib_lightning.tasks import GaussianToy
        >>> toy = GaussianToy(dim=2)
        >>> metric = RankCalibration(num_posterior_samples=99)
        >>> _ = torch.manual_seed(0)
        >>> for seed in range(4):
        ...     theta, x = toy.sample(250, torch.Generator().manual_seed(seed))
        ...     metric.update(toy.posterior(), theta, x)
        >>> out = metric.compute()
        >>> int(out.num_pairs), out.histogram.shape
        (1000, torch.Size([3, 100]))
        >>> bool(out.global_p_value > 0.01), round(float(out.contraction.mean()), 1)
        (True, 0.8)

    References:
        Talts et al. "Validating Bayesian inference algorithms with simulation-based
        calibration." arXiv:1804.06788 (2018). Säilynoja, Bürkner, Vehtari. "Graphical
        test for discrete uniformity and its applications in goodness-of-fit evaluation
        and multiple sample comparison." Statistics and Computing 32 (2022).
    """

    is_differentiable = False
    higher_is_better = None  # a dict of mixed quantities (p-values, errors, contraction)
    full_state_update = False

    lazy_states: ClassVar[tuple[str, ...]] = ("histogram", "theta_moments", "posterior_sums")
    list_states: ClassVar[tuple[str, ...]] = ("pair_moments",)
    histogram: Tensor
    theta_moments: Tensor
    posterior_sums: Tensor

    def __init__(
        self,
        num_posterior_samples: int = 1000,
        num_dims: int | None = None,
        level: float = 0.05,
        num_bins: int | None = None,
        num_ecdf_points: int | None = 100,
        max_chunk_elements: int | None = None,
        global_method: str = "cauchy",
        max_pairs: int = 10_000,
        statistics: Mapping[str, Callable[[Tensor], Tensor]] | None = None,
        joint: str = "auto",
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        check_positive("num_posterior_samples", num_posterior_samples, integer=True)
        if num_posterior_samples < 2:
            raise ValueError(f"num_posterior_samples must be >= 2, got {num_posterior_samples}")
        if num_dims is not None:
            check_positive("num_dims", num_dims, integer=True)
        check_probability("level", level)
        if num_bins is not None:
            check_positive("num_bins", num_bins, integer=True)
            if num_bins < 2:
                raise ValueError(f"num_bins must be >= 2, got {num_bins}")
        if num_ecdf_points is not None:
            check_positive("num_ecdf_points", num_ecdf_points, integer=True)
        if max_chunk_elements is not None:
            check_positive("max_chunk_elements", max_chunk_elements, integer=True)
        check_choice("global_method", global_method, COMBINATION_METHODS)
        check_choice("joint", joint, ("auto", "energy", "distance"))
        self.joint = joint
        if isinstance(max_pairs, bool) or not isinstance(max_pairs, int) or max_pairs < 0:
            raise ValueError(f"max_pairs must be a non-negative integer, got {max_pairs!r}")
        if statistics is not None and not (
            isinstance(statistics, Mapping)
            and all(isinstance(k, str) and callable(f) for k, f in statistics.items())
        ):
            raise ValueError(
                "statistics must be a dict name -> callable theta (..., N, D) -> (..., N), "
                f"got {statistics!r}"
            )
        self.statistics = dict(statistics or {})
        self.max_pairs = max_pairs
        self.global_method = global_method
        self.num_posterior_samples, self.num_dims = num_posterior_samples, num_dims
        self.level, self.num_bins, self.num_ecdf_points = level, num_bins, num_ecdf_points
        self.max_chunk_elements = max_chunk_elements
        self.joint_statistic: str | None = None  # "energy" or "distance", set by update
        histogram, theta_moments, posterior_sums = self._zero_states(num_dims or 0)
        self.add_state("histogram", histogram, dist_reduce_fx="sum")
        self.add_state("theta_moments", theta_moments, dist_reduce_fx=merge_moments)
        self.add_state("posterior_sums", posterior_sums, dist_reduce_fx="sum")
        self.add_state("pair_moments", [], dist_reduce_fx="cat")  # (n, 3 D) float64
        self.add_state(
            "statistic_histogram",
            torch.zeros(len(self.statistics), num_posterior_samples + 1, dtype=torch.long),
            dist_reduce_fx="sum",
        )

    def _zero_states(
        self, d: int, device: torch.device | None = None
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Zero ``histogram`` ``(D + 1, M + 1)``, ``theta_moments`` ``(1 + 3 D,)`` and
        ``posterior_sums`` ``(2, D)``; empty (count 0 only) if ``D = 0``."""
        rows = d + 1 if d else 0
        histogram = torch.zeros(
            rows, self.num_posterior_samples + 1, dtype=torch.long, device=device
        )
        theta_moments = torch.zeros(moment_state_size(d), dtype=torch.float64, device=device)
        return histogram, theta_moments, torch.zeros(2, d, dtype=torch.float64, device=device)

    def _dims(self) -> int:
        return self.theta_moments.shape[0] // 3  # L = 1 + 3 D

    def update(self, posterior: Posterior | object, theta: Tensor, x: Tensor) -> None:
        """Rank the true parameters ``theta (N, D)`` among posterior draws at ``x (N, *X)``."""
        check_pairs(theta, x)
        post = as_posterior(posterior)
        joint = self.joint
        if joint == "auto":
            joint = "energy" if density_draws(post) else "distance"
        elif joint == "energy" and not supports(post, "log_prob"):
            raise unsupported(post, "log_prob")
        if self.joint_statistic not in (None, joint):
            raise ValueError(
                f"this RankCalibration holds {self.joint_statistic} ranks; this posterior "
                f"gives {joint} ranks (joint='auto': the energy for a posterior with a "
                "cheap log_prob): use one metric per kind of posterior, pass joint="
                f"'{self.joint_statistic}', or reset it"
            )
        check_event_size(post, theta, x)  # theta against the posterior first
        self._allocate(theta.shape[1])
        draws = posterior_ranks(
            post,
            theta,
            x,
            self.num_posterior_samples,
            max_chunk_elements=self.max_chunk_elements,
            statistics=list(self.statistics.values()),
            names=list(self.statistics),
            log_densities=joint == "energy",
        )
        hist = rank_histogram(draws.ranks, self.num_posterior_samples)
        d = theta.shape[1]
        self.histogram += hist[: d + 1].to(self.histogram.device)
        self.statistic_histogram += hist[d + 1 :].to(self.statistic_histogram.device)
        batch = moments(theta).to(self.theta_moments.device)
        self.theta_moments = merge_moments(torch.stack([self.theta_moments, batch]))
        sums = torch.stack([draws.variance.sum(0), (draws.mean_error**2).sum(0)])
        self.posterior_sums += sums.to(self.posterior_sums.device)
        room = self.max_pairs - sum(t.shape[0] for t in self.pair_moments)
        if room > 0:
            rows = torch.cat([theta.double(), draws.mean_error, draws.variance], -1)[:room]
            self.pair_moments.append(rows.to(self.histogram.device))
        self.joint_statistic = joint

    def reset(self) -> None:
        """Zero the states and forget the kind of joint rank."""
        super().reset()
        self.joint_statistic = None

    def compute(self) -> RankCalibrationResult:
        """p-values, coverage error, sharpness and the curves (see the class docstring).

        Returns:
            :class:`~calib_lightning.functional.sbc.RankCalibrationResult`: the fields of
            :func:`~calib_lightning.functional.sbc.summarize_ranks` (among them
            ``global_p_value`` ``()``, the verdict, and ``marginal_p_values`` ``(D,)``,
            ``ecdf_p_values`` ``(D + 1,)``, also for ``D = 1``), ``outside_band``
            ``(D + 1,)`` (the ECDF leaves the simultaneous band), and ``contraction``,
            ``mean_squared_error``, ``posterior_variance``, ``prior_variance`` ``(D,)``.
        """
        n = int(self.histogram[0].sum()) if self.histogram.numel() else 0
        if n < 2:
            raise ValueError(
                f"RankCalibration.compute() needs at least N >= 2 calibration pairs, got N = {n}"
            )
        summary = summarize_ranks(
            self.histogram,
            level=self.level,
            num_bins=self.num_bins,
            num_ecdf_points=self.num_ecdf_points,
            global_method=self.global_method,
        )
        variance, error_sq = self.posterior_sums
        prior_variance = variance_from_moments(self.theta_moments)[1]
        draws = min(self.num_posterior_samples, MOMENT_DRAWS)
        sharp = sharpness(error_sq / n, variance / n, prior_variance, draws)
        pairs: dict[str, Any] = {}
        stored = self.pair_moments
        rows = dim_zero_cat(stored) if isinstance(stored, list) and stored else stored
        if isinstance(rows, Tensor) and rows.numel():
            d = prior_variance.shape[-1]
            theta, error, var = rows[:, :d], rows[:, d : 2 * d], rows[:, 2 * d :]
            pairs = {"pair_theta": theta, "pair_mean": theta + error, "pair_variance": var}
        if self.statistics:
            summary, quantities = self._with_statistics(summary)
            pairs.update(quantities)
        pairs["joint_statistic"] = self.joint_statistic or "energy"
        return RankCalibrationResult.from_summary(summary, sharp, **pairs)

    def _with_statistics(self, summary: Any) -> tuple[Any, dict[str, Any]]:
        """The summary with the test quantities' tests in ``global_p_value``, and their fields."""
        p_values, ecdf_p_values, ecdf = statistic_tests(
            self.statistic_histogram,
            num_bins=self.num_bins,
            num_ecdf_points=self.num_ecdf_points,
        )
        every = torch.cat(
            [
                summary.marginal_p_values,
                summary.p_value[None],
                summary.ecdf_p_values.to(p_values),
                p_values,
                ecdf_p_values,
            ]
        )
        combined = combine_p_values(every, method=self.global_method).clamp_min(P_VALUE_FLOOR)
        fields = {
            "statistic_names": tuple(self.statistics),
            "statistic_p_values": p_values,
            "statistic_ecdf_p_values": ecdf_p_values,
            "statistic_ecdf": ecdf,
            "statistic_histogram": self.statistic_histogram,
        }
        return dataclasses.replace(summary, global_p_value=combined), fields
