r"""Simulation-based calibration ranks: marginal and joint (energy), with sharpness.

For a calibration pair :math:`(\theta^*, x)` and ``M`` draws
:math:`\theta_k \sim q(\cdot \mid x)`:

* marginal rank of dimension ``a``: :math:`r_a = \#\{k : \theta_{k,a} < \theta^*_a\}`;
* joint energy rank: :math:`r = \#\{k : e(\theta_k) < e(\theta^*)\}` with the energy
  (surprisal) :math:`e(\theta) = -\log q(\theta \mid x)`. The truth has a high
  energy rank when it lies outside the regions where ``q`` puts its mass: this is
  the HPD / expected-coverage rank, one number for the whole vector. Without a density
  (samples only), the distance rank (:mod:`~calib_lightning.functional.distance_rank`).

Ties (samples equal to the truth) are broken at random: the rank is the number of
strictly smaller values plus a uniform integer in ``[0, #ties]``. If ``q`` is the true
posterior, every rank is exactly uniform on :math:`\{0, \dots, M\}`.

Sharpness (calibrated does not mean accurate: the prior is calibrated): per pair,
the Monte Carlo posterior mean error :math:`\hat\mu - \theta^*` and variance
:math:`\hat v`, reduced by :func:`~calib_lightning.functional.sbc.sharpness` to the
contraction
:math:`1 - \overline{v} / \mathrm{Var}_{\mathrm{prior}}` and the squared error of
the posterior mean.

References:
    Talts, Betancourt, Simpson, Vehtari, Gelman. "Validating Bayesian inference
    algorithms with simulation-based calibration." arXiv:1804.06788 (2018).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from calib_lightning._utils.validation import NonFinitePairs, PairAudit, check_positive
from calib_lightning.functional._draw_problems import (
    check_draws,
    check_log_prob_theta,
    draw_problems,
    raise_pairs,
)
from calib_lightning.functional.distance_rank import distance_log_prob

__all__ = [
    "BLOCK_NUMBERS",
    "MOMENT_DRAWS",
    "PosteriorDraws",
    "RankSums",
    "RankWorkspace",
    "break_ties",
    "chunk_numpy",
    "chunk_torch",
    "count_below",
    "count_signs",
    "draw_moments",
    "energy_ranks",
    "marginal_ranks",
    "rank_chunks",
    "rank_draw_chunk",
    "rank_histogram",
    "sbc_ranks",
    "statistic_ranks",
]


#: numbers per block of draws that
#: :func:`~calib_lightning.functional.ranks.rank_draw_chunk` compares at once on the CPU:
#: the scratch arrays stay in the cache (a 512 KiB mask), where scratch arrays of a whole
#: chunk were fresh pages at every update
BLOCK_NUMBERS = 2**19


class RankWorkspace:
    """Reusable scratch tensors for a loop of
    :func:`~calib_lightning.functional.ranks.rank_draw_chunk` calls.

    Fresh multi-megabyte temporaries per chunk cost more in page faults than the
    arithmetic on them (glibc returns large blocks to the system); reusing buffers keeps
    the check's overhead over sampling small.
    """

    def __init__(self) -> None:
        self._buffers: dict[str, Tensor] = {}

    def __call__(self, name: str, like: Tensor, dtype: torch.dtype | None = None) -> Tensor:
        dtype = like.dtype if dtype is None else dtype
        buffer = self._buffers.get(name)
        if (
            buffer is None
            or buffer.numel() < like.numel()
            or buffer.dtype != dtype
            or buffer.device != like.device
        ):
            buffer = torch.empty(like.numel(), dtype=dtype, device=like.device)
            self._buffers[name] = buffer
        return buffer[: like.numel()].view(like.shape)


def count_signs(diff: Tensor) -> tuple[Tensor, Tensor]:
    """``#{k : diff_k < 0}`` and ``#{k : diff_k = 0}`` over the first dimension of ``diff``
    ``(M, *)``, int64 ``(*)`` each; ``diff`` is scratch (overwritten by its sign).

    Two sums of ``s = sign(diff)`` give both counts: ``sum(s) = above - below`` and
    ``sum(|s|) = above + below``. A NaN counts as a tie (``sign(nan) = 0``), which the
    caller rules out.
    """
    m = diff.shape[0]
    exact = torch.float64 if m >= 2**24 or diff.dtype == torch.float64 else torch.float32
    sign = torch.sign(diff, out=diff)
    excess = sign.sum(0, dtype=exact)
    nonzero = sign.abs_().sum(0, dtype=exact)
    return ((nonzero - excess) / 2).round().long(), m - nonzero.round().long()


def break_ties(
    below: Tensor, ties: Tensor, generator: torch.Generator | None
) -> tuple[Tensor, bool]:
    """``below`` plus a uniform integer in ``[0, ties]`` per entry (the rank of a truth
    among draws equal to it, at random), and whether there was any tie."""
    if not bool(ties.any()):
        return below, False
    u = torch.rand(ties.shape, generator=generator, dtype=torch.float64)
    return below + (u.to(ties.device) * (ties + 1)).floor().long().clamp_max(ties), True


def count_below(diff: Tensor, generator: torch.Generator | None) -> tuple[Tensor, bool]:
    """``#{k : diff_k < 0}`` plus a uniform integer in ``[0, #{k : diff_k = 0}]`` over the
    first dimension of the scratch ``diff`` ``(M, *)``, and whether any ``diff_k`` was 0:
    a tie, or a NaN, which the caller rules out."""
    return break_ties(*count_signs(diff), generator)


def chunk_numpy(
    samples: Tensor,
    theta: Tensor,
    log_prob: Tensor,
    log_prob_theta: Tensor,
    head: int,
    work: RankWorkspace,
) -> tuple[Tensor, Tensor, Tensor, Tensor, bool]:
    """:func:`~calib_lightning.functional.ranks.rank_draw_chunk`'s counts
    ``(n, D + 1)`` (marginal, then joint: strictly below the truth, ties apart), moment
    sums ``(n, D)``, ties ``(n, D + 1)`` and whether the log-densities are all finite
    (their sum is), by numpy comparisons on CPU tensors (a NaN compares neither way: it
    counts as a tie).

    The draws go by blocks of at most :data:`BLOCK_NUMBERS` numbers: contiguous reads,
    and scratch arrays that stay in the cache instead of fresh pages of the chunk's size.
    The moments add the squares of the differences in their dtype (float32: a relative
    error of ``6e-8`` per term) in float64.
    """
    s, t = samples.detach().numpy(), theta.detach().numpy()
    lp, lpt = log_prob.detach().numpy(), log_prob_theta.detach().numpy()
    m, n, d = s.shape
    step = min(m, max(1, BLOCK_NUMBERS // max(n * d, 1)))
    # counts of a block in the smallest exact integer type (bytes: no conversion)
    count = np.uint8 if step < 2**8 else np.uint16 if step < 2**16 else np.int64
    below = np.zeros((2, n, d), dtype=np.int64)  # strictly below, strictly above
    energy = np.zeros((2, n), dtype=np.int64)
    total = np.zeros((n, d), dtype=np.float64)
    total_sq = np.zeros((n, d), dtype=np.float64)
    mask = work("mask", samples[:step], torch.bool).numpy()
    lp_mask = work("lp_mask", log_prob[:step], torch.bool).numpy()
    diff = work("diff", samples[: min(step, head)], torch.promote_types(samples.dtype, theta.dtype))
    lp_sum = 0.0
    for k in range(0, m, step):
        block, lp_block = s[k : k + step], lp[k : k + step]
        rows = block.shape[0]
        below[0] += _counted(np.less, block, t, mask[:rows], count)
        below[1] += _counted(np.greater, block, t, mask[:rows], count)
        # energy rank: #{k : -log q(theta_k) < -log q(theta*)}, i.e. log q(theta_k) > ...
        energy[0] += _counted(np.greater, lp_block, lpt, lp_mask[:rows], count)
        energy[1] += _counted(np.less, lp_block, lpt, lp_mask[:rows], count)
        lp_sum += float(lp_block.sum())  # the block is in the cache: a cheap pass
        if k < head:  # moments from the first draws
            first = np.subtract(s[k : min(k + step, head)], t, out=diff.numpy()[: head - k])
            total += np.add.reduce(first, 0, dtype=np.float64)
            total_sq += np.add.reduce(np.square(first, out=first), 0, dtype=np.float64)
    counts = torch.from_numpy(np.concatenate([below, energy[..., None]], -1))  # (2, n, D + 1)
    ties = m - counts[0] - counts[1]
    return (
        counts[0],
        torch.from_numpy(total),
        torch.from_numpy(total_sq),
        ties,
        math.isfinite(lp_sum),
    )


def _counted(
    compare: np.ufunc, a: np.ndarray, b: np.ndarray, mask: np.ndarray, count: type
) -> np.ndarray:
    """``compare(a, b)`` (``(k, *)`` against ``(*)``) counted over the first axis in the
    integer type ``count``, through the boolean scratch ``mask``."""
    return compare(a, b, out=mask).view(np.uint8).sum(0, dtype=count)


def chunk_torch(
    samples: Tensor,
    theta: Tensor,
    log_prob: Tensor,
    log_prob_theta: Tensor,
    head: int,
    work: RankWorkspace,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """:func:`chunk_numpy` in torch (any device and dtype): from the signs of the
    differences to the truth (:func:`count_signs`)."""
    n, d = theta.shape
    total = torch.zeros(n, d, dtype=torch.float64, device=theta.device)
    total_sq = torch.zeros_like(total)
    dtype = torch.promote_types(samples.dtype, theta.dtype)
    diff = torch.sub(samples, theta, out=work("diff", samples, dtype))
    if head:  # moments from the first draws, in float64
        first = work("head64", diff[:head], torch.float64).copy_(diff[:head])
        total += first.sum(0)
        total_sq += first.square_().sum(0)
    marginal, ties = count_signs(diff)  # overwrites diff
    dtype = torch.promote_types(log_prob.dtype, log_prob_theta.dtype)
    energy = torch.sub(log_prob_theta, log_prob, out=work("energy", log_prob, dtype))
    joint, joint_ties = count_signs(energy)
    return (
        torch.cat([marginal, joint[:, None]], -1),
        total,
        total_sq,
        torch.cat([ties, joint_ties[:, None]], -1),
    )


MOMENT_DRAWS = 256
"""Draws per pair used for the sharpness moments (posterior mean and variance):
contraction and mean error are averages over ``N`` pairs, so a few hundred draws per
pair make their Monte Carlo error negligible; using all ``M`` would make the moments,
not the ranks, the main cost of the check when ``M`` is large."""


def marginal_ranks(
    samples: Tensor, theta: Tensor, *, generator: torch.Generator | None = None
) -> Tensor:
    r"""Marginal SBC ranks :math:`r_a = \#\{k : \theta_{k,a} < \theta^*_a\}`, ties at random.

    Arguments:
        samples: posterior draws ``(M, *, D)``.
        theta: true parameters ``(*, D)``.
        generator: for tie-breaking (CPU).

    Returns:
        ``(*, D)`` integer ranks in ``0..M``.

    Example:
        >>> samples = torch.tensor([[[0.0]], [[1.0]], [[2.0]]])  # M = 3, N = 1, D = 1
        >>> marginal_ranks(samples, torch.tensor([[1.5]]))
        tensor([[2]])
    """
    if samples.ndim < 2 or samples.shape[1:] != theta.shape:
        raise ValueError(
            f"samples must have shape (M, *theta.shape) = (M, {', '.join(map(str, theta.shape))}),"
            f" got {tuple(samples.shape)}"
        )
    ranks, zeros = count_below(samples - theta, generator)
    if zeros:  # ties, or NaN
        bad = (samples.isnan().any(0) | theta.isnan()).any(-1).flatten()
        raise_pairs("samples and theta must not be NaN", bad, 0)
    return ranks


def energy_ranks(
    log_prob_samples: Tensor, log_prob_theta: Tensor, *, generator: torch.Generator | None = None
) -> Tensor:
    r"""Joint energy ranks :math:`r = \#\{k : -\log q(\theta_k) < -\log q(\theta^*)\}`.

    A truth with zero density (``log_prob_theta = -inf``) gets rank ``M``.

    Arguments:
        log_prob_samples: :math:`\log q(\theta_k \mid x)`, ``(M, *)``.
        log_prob_theta: :math:`\log q(\theta^* \mid x)`, ``(*)``.
        generator: for tie-breaking (CPU).

    Returns:
        ``(*)`` integer ranks in ``0..M``.

    Example:
        >>> energy_ranks(torch.tensor([[-1.0], [-2.0], [-3.0]]), torch.tensor([-2.5]))
        tensor([2])
    """
    if log_prob_samples.ndim < 1 or log_prob_samples.shape[1:] != log_prob_theta.shape:
        raise ValueError(
            "log_prob_samples must have shape (M, *log_prob_theta.shape) = "
            f"(M, {', '.join(map(str, log_prob_theta.shape))}), "
            f"got {tuple(log_prob_samples.shape)}"
        )
    ranks, zeros = count_below(log_prob_theta - log_prob_samples, generator)
    if zeros:  # ties, or NaN (also from inf - inf)
        diff = log_prob_theta - log_prob_samples
        bad = diff.isnan().any(0).flatten()
        raise_pairs("log-densities must not be NaN (nor equal infinities)", bad, 0)
    return ranks


def sbc_ranks(
    samples: Tensor,
    log_prob_samples: Tensor | None,
    theta: Tensor,
    log_prob_theta: Tensor | None,
    *,
    generator: torch.Generator | None = None,
) -> Tensor:
    r"""Marginal ranks of every dimension and the joint energy rank, side by side.

    Arguments:
        samples: posterior draws ``(M, *, D)``.
        log_prob_samples: their log-densities ``(M, *)``; ``None`` (both) for the
            density-free distance rank (:mod:`~calib_lightning.functional.distance_rank`).
        theta: true parameters ``(*, D)``.
        log_prob_theta: their log-densities ``(*)``; ``-inf`` is allowed (rank ``M``).
        generator: for tie-breaking.

    Returns:
        ``(*, D + 1)`` ranks: columns ``0..D-1`` marginal, column ``D`` joint.

    Raises:
        ValueError: if samples or their log-densities are not finite, or
            ``log_prob_theta`` is NaN or ``+inf``; the message counts the pairs.
    """
    if log_prob_samples is None or log_prob_theta is None:
        log_prob_samples, log_prob_theta = distance_log_prob(samples, theta)
    check_draws(samples, log_prob_samples, log_prob_theta)
    joint = energy_ranks(log_prob_samples, log_prob_theta, generator=generator)
    return torch.cat([marginal_ranks(samples, theta, generator=generator), joint[..., None]], -1)


class RankSums(NamedTuple):
    r"""What :func:`rank_draw_chunk` keeps of one chunk of draws, per pair.

    Attributes:
        below: ``(n, D + 1)`` int64 ranks counted in the chunk: marginal, then joint.
        total: ``(n, D)`` float64 sum of :math:`\theta_k - \theta^*` over the chunk's
            draws among the first ``moment_draws``.
        total_sq: ``(n, D)`` float64 sum of its squares.
    """

    below: Tensor
    total: Tensor
    total_sq: Tensor


class PosteriorDraws(NamedTuple):
    """What rank calibration keeps of the ``M`` draws per pair (:func:`draw_moments`).

    Attributes:
        ranks: ``(N, D + 1)`` marginal ranks and the joint energy rank (last column).
        mean_error: ``(N, D)`` float64, Monte Carlo posterior mean minus the truth.
        variance: ``(N, D)`` float64, unbiased Monte Carlo posterior variance.

    The moments use the first ``min(M, MOMENT_DRAWS)`` draws of each pair.
    """

    ranks: Tensor
    mean_error: Tensor
    variance: Tensor


def rank_draw_chunk(
    theta: Tensor,
    log_prob_theta: Tensor | None,
    samples: Tensor,
    log_prob: Tensor | None,
    *,
    first_draw: int = 0,
    moment_draws: int = MOMENT_DRAWS,
    offset: int = 0,
    generator: torch.Generator | None = None,
    workspace: RankWorkspace | None = None,
) -> RankSums:
    r"""Reduce one chunk of posterior draws of ``n`` pairs to rank counts and moment sums.

    The streaming form of :func:`sbc_ranks`: ranks and sums of chunks of draws of the
    same pairs add up. Besides the draws, the cost is a few passes over them: on the
    CPU (float32 and float64), two comparisons with the truth and their counts, in
    numpy; elsewhere, the difference to the truth and two sums of its signs.
    Finiteness is checked lazily (element by element only when a non-finite moment or
    log-density shows; at a tie, which a NaN looks like, on the tied pairs), and a
    failure names the pairs.

    Arguments:
        theta: true parameters ``(n, D)``.
        log_prob_theta: :math:`\log q(\theta^* \mid x)`, ``(n,)``; ``-inf`` allowed.
        samples: draws ``(s, n, D)``.
        log_prob: their log-densities ``(s, n)``; ``None`` (both) for the distance rank
            (:mod:`~calib_lightning.functional.distance_rank`: every draw in this chunk).
        first_draw: index of the chunk's first draw among the pair's ``M``.
        moment_draws: draws with index below it enter the moment sums.
        offset: index of the first pair, for error messages.
        generator: for tie-breaking (CPU).
        workspace: reusable scratch buffers (:class:`RankWorkspace`).

    Returns:
        :class:`RankSums`.
    """
    work = RankWorkspace() if workspace is None else workspace
    if log_prob is None or log_prob_theta is None:
        if first_draw:
            raise ValueError(f"the distance rank needs all draws in one chunk, got {first_draw=}")
        log_prob, log_prob_theta = distance_log_prob(samples, theta)
    if first_draw == 0:
        check_log_prob_theta(log_prob_theta, offset)
    head = min(max(moment_draws - first_draw, 0), samples.shape[0])  # draws in the moments
    tensors = (samples, theta, log_prob, log_prob_theta)
    if all(t.device.type == "cpu" and t.dtype in (torch.float32, torch.float64) for t in tensors):
        counts, total, total_sq, ties, finite = chunk_numpy(*tensors, head, work)
    else:
        counts, total, total_sq, ties = chunk_torch(*tensors, head, work)
        finite = bool(log_prob.sum(0).isfinite().all())
    below, tied = break_ties(counts, ties, generator)
    # An infinite draw shows in the moments or its log-density, a NaN one also as a tie.
    # A float32 draw equal to the truth is no rarity (the 10^7 draws of a N = 5,000,
    # M = 1,000 check held one in about a third of the runs), so at a tie only the tied
    # pairs are checked; everything only when something shows, to name the pairs.
    if finite and tied:
        rows = (ties > 0).any(-1).nonzero().flatten().to(samples.device)
        if 2 * rows.numel() > samples.shape[1]:  # ties at most pairs: a discrete posterior
            finite = not draw_problems(samples, log_prob, log_prob_theta)
        else:
            finite = not draw_problems(samples[:, rows], log_prob[:, rows], log_prob_theta[rows])
    if not (finite and bool(total_sq.isfinite().all())):
        check_draws(samples, log_prob, log_prob_theta, offset)
    return RankSums(below, total, total_sq)


def draw_moments(
    total: Tensor, total_sq: Tensor, num_posterior_samples: int
) -> tuple[Tensor, Tensor]:
    """Mean error and unbiased variance ``(n, D)`` from the sums of :class:`RankSums`
    over ``num_posterior_samples >= 2`` draws."""
    m = num_posterior_samples
    mean_error = total / m
    variance = ((total_sq - m * mean_error**2) / (m - 1)).clamp_min(0.0)
    return mean_error, variance


def rank_histogram(ranks: Tensor, num_posterior_samples: int) -> Tensor:
    r"""Counts of each rank value: ``(*, N, C)`` ranks in ``0..M`` -> ``(*, C, M + 1)``.

    Arguments:
        ranks: integer ranks ``(*, N, C)`` (``C = D + 1`` for :func:`sbc_ranks`).
        num_posterior_samples: ``M``.

    Returns:
        ``(*, C, M + 1)`` int64 counts.

    Example:
        >>> rank_histogram(torch.tensor([[0, 2], [2, 2]]), 2)
        tensor([[1, 0, 1],
                [0, 0, 2]])
    """
    check_positive("num_posterior_samples", num_posterior_samples, integer=True)
    m1 = num_posterior_samples + 1
    if ranks.ndim < 2:
        raise ValueError(f"ranks must have shape (*, N, C), got {tuple(ranks.shape)}")
    if ranks.is_floating_point() or ranks.is_complex():
        raise ValueError(f"ranks must have an integer dtype, got {ranks.dtype}")
    if ranks.numel() and (int(ranks.min()) < 0 or int(ranks.max()) >= m1):
        raise ValueError(
            f"ranks must lie in [0, {num_posterior_samples}], got "
            f"[{int(ranks.min())}, {int(ranks.max())}]"
        )
    lead, c = ranks.shape[:-2], ranks.shape[-1]
    flat = ranks.long().movedim(-2, -1).reshape(-1, ranks.shape[-2])  # (B * C, N)
    offsets = torch.arange(flat.shape[0], device=ranks.device)[:, None] * m1
    counts = torch.bincount((flat + offsets).flatten(), minlength=flat.shape[0] * m1)
    return counts.reshape(*lead, c, m1)


def _check_counts(name: str, counts: Tensor, unit: str = "rank") -> None:
    """Raise unless ``counts`` ``(*, C)`` is a histogram: finite, non-negative, no empty row."""
    if not bool((torch.isfinite(counts) & (counts >= 0)).all()):
        raise ValueError(
            f"{name} must hold finite non-negative counts, got {counts.flatten()[:8].tolist()}..."
        )
    if bool((counts.sum(-1) <= 0).any()):
        raise ValueError(f"{name} must hold at least one {unit} per row, got an empty row")


def statistic_ranks(
    samples: Tensor,
    theta: Tensor,
    statistics: Sequence[Callable[[Tensor], Tensor]],
    *,
    names: Sequence[str] | None = None,
    generator: torch.Generator | None = None,
) -> Tensor:
    r"""Ranks of test quantities: :math:`r_q = \#\{k : f_q(\theta_k) < f_q(\theta^*)\}`.

    For any function :math:`f_q` of the parameters (a norm, a sum, a physical quantity),
    :math:`f_q(\theta^*)` is exactly uniform among :math:`f_q(\theta_k)` when ``q`` is the
    true posterior: SBC with a custom test quantity (Talts et al. 2018; Modrák et al.
    2023). Ties are broken at random, as in :func:`marginal_ranks`.

    Arguments:
        samples: posterior draws ``(M, *, D)``.
        theta: true parameters ``(*, D)``.
        statistics: ``Q`` callables ``(..., D) -> (...)``.
        names: their names, for error messages.
        generator: for tie-breaking (CPU).

    Returns:
        ``(*, Q)`` integer ranks in ``0..M``.

    Example:
        >>> samples = torch.tensor([[[0.0, 1.0]], [[2.0, 2.0]], [[3.0, 3.0]]])  # M = 3
        >>> statistic_ranks(samples, torch.tensor([[2.0, 1.0]]), [lambda t: t.sum(-1)])
        tensor([[1]])
    """
    names = [str(q) for q in range(len(statistics))] if names is None else list(names)
    columns = []
    for name, statistic in zip(names, statistics, strict=True):
        at_theta, at_samples = statistic(theta), statistic(samples)
        if at_theta.shape != theta.shape[:-1] or at_samples.shape != samples.shape[:-1]:
            raise ValueError(
                f"statistics[{name!r}] must map theta (..., N, D) to (..., N), got "
                f"{tuple(theta.shape)} -> {tuple(at_theta.shape)} and "
                f"{tuple(samples.shape)} -> {tuple(at_samples.shape)}"
            )
        ranks, zeros = count_below(at_samples - at_theta, generator)
        if zeros:  # ties, or NaN
            bad = (at_samples.isnan().any(0) | at_theta.isnan()).flatten()
            raise_pairs(f"statistics[{name!r}] must not be NaN", bad, 0)
        columns.append(ranks)
    return torch.stack(columns, -1)


#: one chunk of draws: ``(start, theta (n, D), log_prob_theta (n,) | None, samples (s, n, D),
#: log_prob (s, n) | None, first_draw)``, as ``calib_lightning.evaluation.draw_chunks``
#: yields them
Chunk = tuple[int, Tensor, "Tensor | None", Tensor, "Tensor | None", int]


def rank_chunks(
    chunks: Iterable[Chunk],
    num_pairs: int,
    num_posterior_samples: int,
    *,
    generator: torch.Generator | None = None,
    statistics: Sequence[Callable[[Tensor], Tensor]] = (),
    names: Sequence[str] | None = None,
) -> PosteriorDraws:
    r"""The ranks and moments of ``M`` draws per pair, reduced chunk by chunk: the one rank
    loop of the package (:class:`~calib_lightning.RankCalibration` feeds it the evaluation
    layer's chunks, :func:`~calib_lightning.functional.rank_calibration` blocks of the
    draws it is given).

    Each chunk is reduced by :func:`rank_draw_chunk`; the sums of one block of pairs
    (its chunks arrive together, ``first_draw = 0`` first) add up. The sharpness moments
    use the first ``min(M, MOMENT_DRAWS)`` draws of each pair. A non-finite value is
    counted over every pair before the error names them.

    Arguments:
        chunks: the chunks of the ``N`` pairs, in order.
        num_pairs: ``N``.
        num_posterior_samples: ``M >= 2``.
        generator: for tie-breaking.
        statistics: ``Q`` test quantities ``(..., D) -> (...)``; their ranks
            (:func:`statistic_ranks`) follow the joint rank as the last ``Q`` columns.
        names: their names, for error messages.

    Returns:
        :class:`PosteriorDraws` (``ranks`` of shape ``(N, D + 1 + Q)``).
    """
    if num_posterior_samples < 2:
        raise ValueError(f"num_posterior_samples must be >= 2, got {num_posterior_samples}")
    head = min(num_posterior_samples, MOMENT_DRAWS)
    work = RankWorkspace()
    blocks: list[list[Tensor]] = []
    audit: tuple[PairAudit, NonFinitePairs] | None = None
    for chunk in chunks:
        start, theta, log_prob_theta, samples, log_prob, first_draw = chunk
        if audit is None:
            try:
                sums = rank_draw_chunk(
                    theta,
                    log_prob_theta,
                    samples,
                    log_prob,
                    first_draw=first_draw,
                    moment_draws=head,
                    offset=start,
                    generator=generator,
                    workspace=work,
                )
                if statistics:
                    quantities = statistic_ranks(
                        samples, theta, statistics, names=names, generator=generator
                    )
                    sums = RankSums(torch.cat([sums.below, quantities], -1), *sums[1:])
            except NonFinitePairs as error:  # count over every pair, not this chunk's
                audit = (PairAudit(num_pairs), error)
        if audit is not None:
            audit[0].add(start, _chunk_problems(chunk, statistics, names))
            continue
        if first_draw == 0:
            blocks.append(list(sums))
        else:
            blocks[-1] = [a + b for a, b in zip(blocks[-1], sums, strict=True)]
    if audit is not None:
        raise audit[0].error() or audit[1]
    ranks, total, total_sq = (torch.cat(parts) for parts in zip(*blocks, strict=True))
    return PosteriorDraws(ranks, *draw_moments(total, total_sq, head))


def _chunk_problems(
    chunk: Chunk, statistics: Sequence[Callable[[Tensor], Tensor]], names: Sequence[str] | None
) -> dict[str, dict[str, Tensor]]:
    """The non-finite values of one chunk, per pair (its share of the audit)."""
    _, theta, log_prob_theta, samples, log_prob, first_draw = chunk
    problems = draw_problems(samples, log_prob, log_prob_theta if first_draw == 0 else None)
    names = [str(q) for q in range(len(statistics))] if names is None else list(names)
    for name, statistic in zip(names, statistics, strict=True):
        values = torch.cat([statistic(theta)[None], statistic(samples)])
        kinds = {"NaN": values.isnan().any(0).cpu()}
        if bool(kinds["NaN"].any()):
            problems[f"statistics[{name!r}] must not be NaN"] = kinds
    return problems
