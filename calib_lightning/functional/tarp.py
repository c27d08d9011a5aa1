r"""TARP: expected coverage of random-reference credible balls, averaged over references.

For each calibration pair :math:`(\theta^*_i, x_i)`, draw :math:`S` samples
:math:`\theta_{ik} \sim q(\cdot \mid x_i)` and a reference point :math:`\theta^r`
(independent of which value is :math:`\theta^*_i`, given :math:`x_i`). The TARP rank is

.. math::
    r_i = \#\{k : d(\theta_{ik}, \theta^r) < d(\theta^*_i, \theta^r)\} \in \{0, \dots, S\},

the number of samples inside the ball around the reference that just reaches the true
value. :math:`c_i = (r_i + 1/2) / (S + 1)` is the credibility level of the smallest such
ball (Lemos et al. 2023, eq. 3-4, with the half-count of a discrete rank), and the
expected coverage probability at credibility :math:`c` is
:math:`\mathrm{ECP}(c) = \frac{1}{N} \sum_i 1[c_i \le c]`, about :math:`c` when
:math:`q = p`.

**References.** Each pair gets ``R`` references
:math:`\theta^{r}_{i1}, \dots, \theta^{r}_{iR}` and the curve is the average
:math:`\overline{\mathrm{ECP}}(c) = \frac{1}{NR} \sum_{i, j} 1[c_{ij} \le c]` (why
several: ``docs/design.md``, "TARP: several references per pair, a permutation null").

**The test is a permutation test, exact at every** ``N``, ``S``, ``R``, ``D``. Under
:math:`H_0: q = p` the :math:`S + 1` values :math:`\{\theta^*_i, \theta_{i1}, \dots,
\theta_{iS}\}` are exchangeable given :math:`x_i`: given the unordered set of values of
every pair (and the references, drawn from it), the position :math:`J_i` of the true
value among them is uniform on :math:`\{0, \dots, S\}` and independent across pairs.
The rank table of every value (:func:`tarp_rank_table`: the ranks the statistic would
see had value ``j`` been the true one) gives the null exactly: ``B`` draws of :math:`J`
uniform, the statistic recomputed from the table each time, and
:math:`p = (1 + \#\{T_b \ge T\}) / (1 + B)` (:func:`tarp_permutation_test`). The first
``K`` values of each pair (the truth and ``K - 1`` i.i.d. draws) keep the test exact
with a table of ``K`` columns (``positions``: bounded memory for a large ``S``).

**Coordinates** must not depend on which value is the true one: the box the references
are drawn in and the scale of the distances are fitted on the *pooled* values of all
pairs (:math:`N (S + 1)` points), a function of the unordered sets. The box spans the
:math:`1 / (N + 1)` and :math:`N / (N + 1)` quantiles of each coordinate, the scale is
the pooled standard deviation (:func:`tarp_box`, :func:`tarp_fit_scale`). References and
a scale fixed in advance (e.g. from the prior) are exact too, and two posteriors
compared on the same pairs may share references fitted on both posteriors' pooled
values.

The statistic is the largest deviation of the averaged curve from the diagonal,
:math:`T = \sup_{c \in [0, 1]} |\overline{\mathrm{ECP}}(c) - c|` (a KS distance), and
the ``1 - level`` quantile of the :math:`T_b` is a simultaneous band around the diagonal,
drawn by :func:`calib_lightning.plots.plot_tarp`. With ``R = 1``, :func:`tarp_test` is
the exact multinomial test of one reference set.

The summary ``coverage_error`` is the signed area of the *upper half* of the curve,
:math:`\int_{1/2}^{1} (\overline{\mathrm{ECP}}(c) - c)\, dc` (the ATC of Lemos et al.):
positive for a conservative (too wide) posterior, negative for an over-confident
(too narrow) one. Read its sign for dispersion only (a bias can leave it near zero).
See ``docs/calibration.md`` (TARP) for how this differs from sbi's implementation.

References:
    Lemos, Coogan, Hezaveh, Perreault-Levasseur. "Sampling-Based Accuracy Testing of
    Posterior Estimators for General Inference." ICML 2023.

    Hemerik, Goeman. "Exact testing with random permutations." TEST 27 (2018).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from calib_lightning._utils.chunks import pair_blocks
from calib_lightning._utils.validation import (
    check_choice,
    check_finite,
    check_matrix,
    check_points,
    check_positive,
    check_probability,
)
from calib_lightning.functional._multinomial import uniform_multinomial
from calib_lightning.functional._tarp_coordinates import (
    NUM_REFERENCES,
    check_scale,
    pooled_values,
    tarp_box,
    tarp_fit_scale,
    tarp_references,
)
from calib_lightning.functional.combine import monte_carlo_p_value
from calib_lightning.functional.ranks import _check_counts, rank_histogram
from calib_lightning.results import Result

__all__ = [
    "DISTANCES",
    "TARPResult",
    "expected_coverage",
    "tarp",
    "tarp_counts",
    "tarp_permutation_test",
    "tarp_rank_table",
    "tarp_ranks",
    "tarp_test",
]


DISTANCES = ("l2", "l1")


@dataclass(eq=False)
class TARPResult(Result):
    """The TARP test and its curve (:func:`tarp_test`, ``TARP.compute()``).

    ``*`` is the leading batch shape of the rank histogram, ``A = num_bins + 1``.

    Attributes:
        statistic: ``(*)`` sup deviation of the coverage curve from the diagonal.
        p_value: ``(*)`` Monte Carlo p-value (the verdict), at least ``1 / (B + 1)``.
        coverage_error: ``(*)`` signed area of the upper half (``c > 1/2``) of the curve
            (the ATC): negative = over-confident, positive = under-confident.
        band: ``(*)`` half-width of the simultaneous band (``1 - level`` null quantile).
        level: ``()`` test level of the band.
        credibility: ``(A,)`` credibility levels from 0 to 1.
        coverage: ``(*, A)`` expected coverage at each credibility level.
        num_pairs: ``(*)`` calibration pairs counted.
        p_value_error: ``(*)`` Monte Carlo standard error of ``p_value``: the binomial error
            of ``B`` null draws, with (from :func:`tarp_permutation_test`) the jackknife
            spread over the references mapped through the null distribution; what another
            seed could move the p-value by. ``None`` where not estimated.
    """

    verdict = "p_value"
    logged = ("p_value", "coverage_error", "statistic", "num_pairs")

    statistic: Tensor
    p_value: Tensor
    coverage_error: Tensor
    band: Tensor
    level: Tensor
    credibility: Tensor
    coverage: Tensor
    num_pairs: Tensor
    p_value_error: Tensor | None = None


def _distance(diff: Tensor, distance: str) -> Tensor:
    return diff.pow(2).sum(-1) if distance == "l2" else diff.abs().sum(-1)


def tarp_ranks(
    samples: Tensor,
    theta: Tensor,
    references: Tensor,
    *,
    scale: Tensor | None = None,
    distance: str = "l2",
) -> Tensor:
    r"""TARP ranks :math:`r_i = \#\{k : d(\theta_{ik}, \theta^r_i) < d(\theta^*_i, \theta^r_i)\}`.

    Arguments:
        samples: posterior samples ``(S, *, N, D)`` (the layout of ``Posterior.sample``).
        theta: true parameters ``(*, N, D)``.
        references: reference points ``(*, N, D)``.
        scale: per-dimension scale ``(D,)`` or ``(*, D)``; distances are computed on
            ``theta / scale``. ``None``: unscaled.
        distance: ``"l2"`` (Euclidean) or ``"l1"``.

    Returns:
        ``(*, N)`` int64 ranks in ``{0, ..., S}``.
    """
    check_choice("distance", distance, DISTANCES)
    check_points("theta", theta)
    if samples.ndim != theta.ndim + 1 or samples.shape[1:] != theta.shape:
        raise ValueError(
            f"samples must have shape (S, {', '.join(map(str, theta.shape))}) like theta "
            f"with a leading sample axis, got {tuple(samples.shape)}"
        )
    if references.shape != theta.shape:
        raise ValueError(
            f"references must have the shape of theta {tuple(theta.shape)}, "
            f"got {tuple(references.shape)}"
        )
    blocks = pair_blocks(theta.shape[0], samples.shape[0] * theta.shape[-1])
    if theta.ndim == 2 and len(blocks) > 1:  # by blocks of pairs: bounded scratch
        return torch.cat(
            [
                tarp_ranks(
                    samples[:, rows], theta[rows], references[rows], scale=scale, distance=distance
                )
                for rows in blocks
            ]
        )
    inverse = 1.0 if scale is None else 1.0 / scale.unsqueeze(-2)
    d_true = _distance((theta - references) * inverse, distance)
    d_samples = _distance((samples - references) * inverse, distance)
    return (d_samples < d_true).sum(0)


def tarp_counts(ranks: Tensor, num_posterior_samples: int) -> Tensor:
    """Histogram of ranks ``(*, N)`` over ``{0, ..., S}``: ``(*, S + 1)`` int64 counts."""
    return rank_histogram(ranks.unsqueeze(-1), num_posterior_samples).squeeze(-2)


def _midpoints(cells: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    return (torch.arange(cells, dtype=dtype, device=device) + 0.5) / cells


def expected_coverage(counts: Tensor, credibility: Tensor) -> Tensor:
    r"""Expected coverage :math:`\mathrm{ECP}(c) = \frac{1}{N} \#\{i : c_i \le c\}`.

    Arguments:
        counts: rank histogram ``(*, S + 1)``.
        credibility: credibility levels ``c``, ``(A,)`` in :math:`[0, 1]`.

    Returns:
        ``(*, A)`` in float64.
    """
    check_finite("credibility", credibility)
    counts = counts.double()
    cells = counts.shape[-1]
    cdf = torch.cat([torch.zeros_like(counts[..., :1]), counts.cumsum(-1)], -1)
    cdf = cdf / counts.sum(-1, keepdim=True).clamp_min(1.0)
    mids = _midpoints(cells, torch.float64, counts.device)
    index = torch.searchsorted(mids, credibility.double().to(counts.device), right=True)
    return cdf[..., index]


def _ks_coverage_error(counts: Tensor) -> tuple[Tensor, Tensor]:
    """Exact sup-deviation of the ECP step function from the diagonal, and the signed
    area of its upper half (``coverage_error``)."""
    counts = counts.double()
    cells = counts.shape[-1]
    total = counts.sum(-1, keepdim=True).clamp_min(1.0)
    upper = counts.cumsum(-1) / total  # ECP just after each jump
    lower = upper - counts / total  # ECP just before it
    mids = _midpoints(cells, torch.float64, counts.device)
    statistic = torch.maximum((upper - mids).amax(-1), (mids - lower).amax(-1))
    error = (counts * (1.0 - mids.clamp_min(0.5))).sum(-1) / total.squeeze(-1) - 0.375
    return statistic, error


def tarp_test(
    counts: Tensor,
    *,
    num_null: int = 1000,
    level: float = 0.05,
    num_bins: int = 100,
    generator: torch.Generator | None = None,
) -> TARPResult:
    r"""Monte Carlo test of uniform ranks, coverage error and the curve from a rank histogram.

    Arguments:
        counts: rank histogram ``(*, S + 1)`` (:func:`tarp_counts`).
        num_null: ``B`` null histograms drawn per test.
        level: the band is the ``1 - level`` quantile of the null statistics.
        num_bins: the curve is returned on ``num_bins + 1`` credibility levels in [0, 1].
        generator: random generator for the null draws.

    Returns:
        :class:`TARPResult`.
    """
    check_positive("num_null", num_null, integer=True)
    check_positive("num_bins", num_bins, integer=True)
    check_probability("level", level)
    if counts.ndim < 1 or counts.shape[-1] < 2:
        raise ValueError(
            f"counts must have shape (*, S + 1) with S >= 1, got {tuple(counts.shape)}"
        )
    _check_counts("counts", counts, unit="calibration pair")
    total = counts.sum(-1)
    statistic, error = _ks_coverage_error(counts)
    null = uniform_multinomial(total.cpu(), counts.shape[-1], num_null, generator)
    null_statistic = _ks_coverage_error(null)[0].to(counts.device)
    p_value = monte_carlo_p_value(statistic, null_statistic, tolerance=1e-12, dtype=torch.float64)
    credibility = torch.linspace(0.0, 1.0, num_bins + 1, dtype=torch.float64, device=counts.device)
    return TARPResult(
        statistic=statistic,
        p_value=p_value,
        coverage_error=error,
        band=torch.quantile(null_statistic, 1.0 - level, dim=-1),
        level=torch.tensor(level, dtype=torch.float64),
        credibility=credibility,
        coverage=expected_coverage(counts, credibility),
        num_pairs=total,
    )


#: null draws of the permutation test per block (bounded scratch: block x N x R ranks)
_NULL_BLOCK_NUMBERS = 2**21


def tarp_rank_table(
    samples: Tensor,
    theta: Tensor,
    references: Tensor,
    *,
    scale: Tensor | None = None,
    distance: str = "l2",
    positions: int | None = None,
) -> Tensor:
    r"""The TARP rank of each of a pair's first ``K`` values, under each of its references.

    Entry ``[i, j, r]`` is the number of pair ``i``'s :math:`S + 1` values (``theta`` first,
    then its samples) strictly closer to reference ``r`` than value ``j``: the rank the
    statistic would see had value ``j`` been the true one. Column ``j = 0`` holds the
    true parameters' ranks (:func:`tarp_ranks` for each reference set).

    Arguments:
        samples: posterior samples ``(S, N, D)``.
        theta: true parameters ``(N, D)``.
        references: ``(R, N, D)`` in parameter units.
        scale: per-dimension scale ``(D,)``; distances are computed on ``theta / scale``.
            ``None``: unscaled.
        distance: ``"l2"`` or ``"l1"``.
        positions: ``K``, the values ranked per pair (``theta`` and the first ``K - 1``
            samples); ``None``: all :math:`S + 1`.

    Returns:
        ``(N, K, R)`` ranks in ``{0, ..., S}``, int16 (int32 when ``S`` needs it).
    """
    check_choice("distance", distance, DISTANCES)
    check_matrix("theta", theta)
    (n, d), s = theta.shape, samples.shape[0]
    if samples.ndim != 3 or samples.shape[1:] != theta.shape:
        raise ValueError(f"samples must have shape (S, {n}, {d}), got {tuple(samples.shape)}")
    if references.ndim != 3 or references.shape[1:] != theta.shape:
        raise ValueError(f"references must have shape (R, {n}, {d}), got {tuple(references.shape)}")
    k = s + 1 if positions is None else positions
    if not 1 <= k <= s + 1:
        raise ValueError(f"positions must lie in [1, S + 1 = {s + 1}], got {positions}")
    num_refs = references.shape[0]
    dtype = torch.int16 if s < 2**15 - 1 else torch.int32
    out = torch.empty(n, k, num_refs, dtype=dtype, device=theta.device)
    inverse = 1.0 if scale is None else 1.0 / scale.to(theta)
    for rows in pair_blocks(n, (s + 1) * (d + num_refs + 2)):
        values = torch.cat([theta[rows].unsqueeze(0), samples[:, rows].to(theta)])  # (S+1, n, D)
        refs = references[:, rows].to(theta)  # (R, n, D)
        if distance == "l2":
            # |v - r|^2 = |v - c|^2 - 2 (v - c).(r - c) + |r - c|^2: the last term is the same
            # for all of a pair's values, so it does not change their ranks. c is the mean of
            # the pair's values (symmetric in them); float64 keeps the difference exact.
            center = values.double().mean(0)  # (n, D)
            v = ((values.double() - center) * inverse).transpose(0, 1)  # (n, S+1, D)
            r = ((refs.double() - center) * inverse).permute(1, 2, 0)  # (n, D, R)
            dist = (v.square().sum(-1, keepdim=True) - 2 * torch.bmm(v, r)).transpose(1, 2)
        else:
            dist = _distance((values.unsqueeze(1) - refs) * inverse, distance).permute(2, 1, 0)
        dist = dist.contiguous()  # (n, R, S+1)
        ordered = dist.sort(-1).values
        ranks = torch.searchsorted(ordered, dist[..., :k].contiguous())  # strictly closer
        out[rows] = ranks.transpose(1, 2).to(dtype)
    return out


def tarp_permutation_test(
    table: Tensor,
    num_posterior_samples: int,
    *,
    num_null: int = 1000,
    level: float = 0.05,
    num_bins: int = 100,
    generator: torch.Generator | None = None,
) -> TARPResult:
    r"""TARP's test on the curve averaged over references, with its exact permutation null.

    The observed curve counts the true parameters' ranks (column 0 of ``table``) under
    every reference; each of the ``B`` null curves counts, for every pair, the column of
    a position drawn uniformly among the ``K`` (module docstring: under :math:`H_0` the
    true value's position is uniform and independent across pairs).

    Arguments:
        table: :func:`tarp_rank_table` ``(*, N, K, R)``: ``*`` independent calibration sets,
            tested at once.
        num_posterior_samples: ``S`` (the ranks lie in ``{0, ..., S}``).
        num_null: ``B`` permutations.
        level: the band is the ``1 - level`` quantile of the null statistics.
        num_bins: the curve is returned on ``num_bins + 1`` credibility levels in [0, 1].
        generator: random generator for the permutations (on the CPU).

    Returns:
        :class:`TARPResult` with leading shape ``*`` (``num_pairs`` is ``N``).
    """
    check_positive("num_posterior_samples", num_posterior_samples, integer=True)
    check_positive("num_null", num_null, integer=True)
    check_positive("num_bins", num_bins, integer=True)
    check_probability("level", level)
    if table.ndim < 3 or table.shape[-3] < 1 or table.is_floating_point():
        raise ValueError(
            f"table must be integer ranks of shape (*, N, K, R) with N >= 1, got "
            f"{tuple(table.shape)} {table.dtype}"
        )
    lead, (n, k, num_refs) = table.shape[:-3], table.shape[-3:]
    cells = num_posterior_samples + 1
    if table.numel() and (int(table.min()) < 0 or int(table.max()) >= cells):
        raise ValueError(
            f"table must hold ranks in [0, {num_posterior_samples}], got "
            f"[{int(table.min())}, {int(table.max())}]"
        )
    device = table.device
    table = table.cpu().long().reshape(-1, n, k, num_refs)  # (T, N, K, R)
    sets = table.shape[0]
    offsets = (torch.arange(sets) * cells).view(sets, 1, 1)
    by_reference = table[:, :, 0] + (
        offsets.view(sets, 1) * num_refs + torch.arange(num_refs) * cells
    ).unsqueeze(1)  # (T, N, R): one histogram each
    by_reference = torch.bincount(by_reference.flatten(), minlength=sets * num_refs * cells)
    by_reference = by_reference.view(sets, num_refs, cells)
    counts = by_reference.sum(1)  # (T, S + 1)
    statistic, error = _ks_coverage_error(counts)  # (T,)
    rows = torch.arange(n)
    block = max(1, _NULL_BLOCK_NUMBERS // max(sets * n * num_refs, 1))
    null = []
    for start in range(0, num_null, block):
        size = min(block, num_null - start)
        picks = torch.randint(0, k, (sets, size, n), generator=generator)
        ranks = table[torch.arange(sets).view(sets, 1, 1), rows, picks]  # (T, size, N, R)
        ranks = ranks + (torch.arange(sets * size) * cells).view(sets, size, 1, 1)
        null_counts = torch.bincount(ranks.flatten(), minlength=sets * size * cells)
        null.append(_ks_coverage_error(null_counts.view(sets, size, cells))[0])
    null_statistic = torch.cat(null, -1)  # (T, B)
    p_value = monte_carlo_p_value(statistic, null_statistic, tolerance=1e-12, dtype=torch.float64)
    p_error = _p_value_error(p_value, statistic, null_statistic, counts, by_reference)
    credibility = torch.linspace(0.0, 1.0, num_bins + 1, dtype=torch.float64)

    def shaped(value: Tensor) -> Tensor:
        return value.reshape(tuple(lead) + tuple(value.shape[1:])).to(device)

    return TARPResult(
        statistic=shaped(statistic),
        p_value=shaped(p_value),
        coverage_error=shaped(error),
        band=shaped(torch.quantile(null_statistic, 1.0 - level, dim=-1)),
        level=torch.tensor(level, dtype=torch.float64),
        credibility=credibility.to(device),
        coverage=shaped(expected_coverage(counts, credibility)),
        num_pairs=torch.full(lead, n, device=device),
        p_value_error=shaped(p_error),
    )


def _p_value_error(
    p_value: Tensor, statistic: Tensor, null: Tensor, counts: Tensor, by_reference: Tensor
) -> Tensor:
    """Monte Carlo standard error of the permutation p-value ``(T,)``: the binomial error
    of the ``B`` permutations and the jackknife error over the ``R`` references (the
    statistic without each reference's histogram), carried to the p-value through the
    null statistics, added in quadrature."""
    draws = null.shape[-1]
    binomial = (p_value * (1 - p_value) / draws).sqrt()
    num_refs = by_reference.shape[1]
    if num_refs < 2:
        return binomial
    left_out = _ks_coverage_error(counts.unsqueeze(1) - by_reference)[0]  # (T, R)
    spread = (
        (num_refs - 1) / num_refs * (left_out - left_out.mean(1, keepdim=True)).square().sum(1)
    ).sqrt()
    low = monte_carlo_p_value(statistic - spread, null, dtype=torch.float64)
    high = monte_carlo_p_value(statistic + spread, null, dtype=torch.float64)
    return (binomial.square() + ((low - high) / 2).square()).sqrt()


def tarp(
    samples: Tensor,
    theta: Tensor,
    *,
    references: Tensor | None = None,
    scale: Tensor | None = None,
    num_references: int = NUM_REFERENCES,
    distance: str = "l2",
    num_null: int = 1000,
    level: float = 0.05,
    num_bins: int = 100,
    generator: torch.Generator | None = None,
) -> TARPResult:
    r"""TARP coverage test from posterior samples at calibration pairs (module docstring).

    Arguments:
        samples: posterior samples ``(S, N, D)``, ``S`` drawn at each pair's ``x_i``
            (e.g. :func:`calib_lightning.evaluation.draws`).
        theta: true parameters ``(N, D)``, ``N >= 2``.
        references: reference points ``(R, N, D)`` (or ``(N, D)``, one each) in parameter
            units, independent of which of a pair's values is ``theta``; ``None``:
            ``num_references`` per pair, uniform on :func:`tarp_box` of the pooled values.
        scale: per-dimension scale ``(D,)`` of the standardized coordinates, with the same
            independence; ``None``: standard deviation of the pooled values
            (:func:`tarp_fit_scale`).
        num_references: ``R`` when ``references`` is ``None``.
        distance: ``"l2"`` or ``"l1"``.
        num_null: as in :func:`tarp_permutation_test`.
        level: as in :func:`tarp_permutation_test`.
        num_bins: as in :func:`tarp_permutation_test`.
        generator: random generator for the references and the permutations.

    Returns:
        :class:`TARPResult`.

    Example:
        >>> from calib_lightning.tasks import GaussianToy
        >>> toy, g = GaussianToy(dim=2), torch.Generator().manual_seed(0)
        >>> theta, x = toy.sample(1000, g)
        >>> _ = torch.manual_seed(0)
        >>> samples = toy.posterior()(x).sample((100,))
        >>> tarp(samples, theta, generator=g).p_value > 0.05  # exact
        tensor(True)
        >>> out = tarp(toy.posterior(variance_scale=2.0)(x).sample((100,)), theta, generator=g)
        >>> out.p_value, out.coverage_error > 0  # too wide: rejected, positive error
        (tensor(0.0010, dtype=torch.float64), tensor(True))
    """
    check_matrix("theta", theta, min_rows=2)
    check_choice("distance", distance, DISTANCES)
    check_positive("num_references", num_references, integer=True)
    n, d = theta.shape
    if samples.ndim != 3 or samples.shape[1:] != theta.shape:
        raise ValueError(f"samples must have shape (S, {n}, {d}), got {tuple(samples.shape)}")
    check_finite("posterior samples", samples.transpose(0, 1))
    values = None
    if references is None or scale is None:
        values = pooled_values(samples, theta)
    if references is None:
        low, high = tarp_box(values, n)
        references = tarp_references(low, high, n, num_references, generator=generator)
    else:
        if references.shape == theta.shape:
            references = references.unsqueeze(0)
        if references.ndim != 3 or references.shape[1:] != theta.shape:
            raise ValueError(
                f"references must have shape (R, {n}, {d}) or ({n}, {d}) like "
                f"theta, got {tuple(references.shape)}"
            )
        check_finite("references", references)
    scale = tarp_fit_scale(values) if scale is None else check_scale(scale, d)
    table = tarp_rank_table(samples, theta, references, scale=scale, distance=distance)
    return tarp_permutation_test(
        table,
        samples.shape[0],
        num_null=num_null,
        level=level,
        num_bins=num_bins,
        generator=generator,
    )
