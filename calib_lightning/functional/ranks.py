r"""Simulation-based calibration ranks: marginal and joint (energy), with sharpness.

For a calibration pair :math:`(\theta^*, x)` and ``M`` draws
:math:`\theta_k \sim q(\cdot \mid x)`:

* marginal rank of dimension ``a``: :math:`r_a = \#\{k : \theta_{k,a} < \theta^*_a\}`;
* joint energy rank: :math:`r = \#\{k : e(\theta_k) < e(\theta^*)\}` with the energy
  (surprisal) :math:`e(\theta) = -\log q(\theta \mid x)`. The truth has a high
  energy rank when it lies outside the regions where ``q`` puts its mass: this is
  the HPD / expected-coverage rank, one number for the whole vector.

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
    Handwritten notes "validation of SBI" (seed 004): rank histograms, ECDF - t
    curves, joint calibration through energy ranks, calibrated-but-inaccurate.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from calib_lightning._checks import check_pairs, check_positive
from calib_lightning.posteriors import Posterior, as_posterior

__all__ = [
    "MOMENT_DRAWS",
    "PosteriorDraws",
    "energy_ranks",
    "marginal_ranks",
    "posterior_ranks",
    "rank_histogram",
    "sbc_ranks",
]


MOMENT_DRAWS = 256
"""Draws per pair used for the sharpness moments (posterior mean and variance).

Contraction and mean error are averages over ``N`` pairs, so a few hundred draws per
pair make their Monte Carlo error negligible; using all ``M`` would make the moments,
not the ranks, the main cost of the check when ``M`` is large."""


class _Workspace:
    """Reusable scratch tensors for the chunk loop of :func:`posterior_ranks`.

    Fresh multi-megabyte temporaries per chunk cost more in page faults than the
    arithmetic on them (glibc returns large blocks to the system); reusing buffers keeps
    the check's overhead over sampling small.
    """

    def __init__(self) -> None:
        self._buffers: dict[str, Tensor] = {}

    def __call__(self, name: str, like: Tensor, dtype: torch.dtype | None = None) -> Tensor:
        dtype = like.dtype if dtype is None else dtype
        buffer = self._buffers.get(name)
        if (buffer is None or buffer.numel() < like.numel() or buffer.dtype != dtype
                or buffer.device != like.device):  # fmt: skip
            buffer = torch.empty(like.numel(), dtype=dtype, device=like.device)
            self._buffers[name] = buffer
        return buffer[: like.numel()].view(like.shape)


def _count_below(diff: Tensor, generator: torch.Generator | None) -> tuple[Tensor, bool]:
    """``#{k : diff_k < 0}`` plus a uniform integer in ``[0, #{k : diff_k = 0}]``.

    ``diff`` has shape ``(M, *)``, is scratch (overwritten by its sign) and is counted
    over the first dimension. Two sums of ``s = sign(diff)`` give both counts:
    ``sum(s) = above - below`` and ``sum(|s|) = above + below``. Also returns whether
    any ``s`` was 0: a tie, or a NaN (``sign(nan) = 0``), which the caller rules out.
    """
    m = diff.shape[0]
    exact = torch.float64 if m >= 2**24 or diff.dtype == torch.float64 else torch.float32
    sign = torch.sign(diff, out=diff)
    excess = sign.sum(0, dtype=exact)
    nonzero = sign.abs_().sum(0, dtype=exact)
    below = ((nonzero - excess) / 2).round().long()
    ties = m - nonzero.round().long()
    if not bool(ties.any()):
        return below, False
    u = torch.rand(ties.shape, generator=generator, dtype=torch.float64)
    return below + (u.to(ties.device) * (ties + 1)).floor().long().clamp_max(ties), True


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
    ranks, zeros = _count_below(samples - theta, generator)
    if zeros:  # ties, or NaN
        bad = (samples.isnan().any(0) | theta.isnan()).any(-1).flatten()
        _raise_pairs("samples and theta must not be NaN", bad, 0)
    return ranks


def energy_ranks(
    log_prob_samples: Tensor,
    log_prob_theta: Tensor,
    *,
    generator: torch.Generator | None = None,
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
    ranks, zeros = _count_below(log_prob_theta - log_prob_samples, generator)
    if zeros:  # ties, or NaN (also from inf - inf)
        diff = log_prob_theta - log_prob_samples
        bad = diff.isnan().any(0).flatten()
        _raise_pairs("log-densities must not be NaN (nor equal infinities)", bad, 0)
    return ranks


def _raise_pairs(what: str, bad: Tensor, offset: int) -> None:
    """Raise naming how many of the checked pairs are ``bad`` (flags ``(n,)``) and which."""
    if bool(bad.any()):
        first = (bad.nonzero().flatten()[:5] + offset).tolist()
        raise ValueError(
            f"{what}, got NaN/inf for {int(bad.sum())} of {bad.numel()} calibration pairs "
            f"(pairs {offset}..{offset + bad.numel() - 1}; first affected: {first})"
        )


def _check_log_prob_theta(log_prob_theta: Tensor, offset: int = 0) -> None:
    bad = log_prob_theta.isnan() | (log_prob_theta == float("inf"))
    _raise_pairs("posterior log_prob at theta must be finite or -inf (zero density)",
                 bad.flatten(), offset)  # fmt: skip


def _check_draws(
    samples: Tensor, log_prob_samples: Tensor, log_prob_theta: Tensor, offset: int = 0
) -> None:
    """Raise, counting the affected pairs, on non-finite draws or a NaN/+inf truth density."""
    for name, value in (("samples", samples), ("log_prob", log_prob_samples[..., None])):
        bad = (~torch.isfinite(value)).any(0).any(-1).flatten()  # one flag per pair
        _raise_pairs(f"posterior {name} must be finite", bad, offset)
    _check_log_prob_theta(log_prob_theta, offset)


def sbc_ranks(
    samples: Tensor,
    log_prob_samples: Tensor,
    theta: Tensor,
    log_prob_theta: Tensor,
    *,
    generator: torch.Generator | None = None,
) -> Tensor:
    r"""Marginal ranks of every dimension and the joint energy rank, side by side.

    Arguments:
        samples: posterior draws ``(M, *, D)``.
        log_prob_samples: their log-densities ``(M, *)``.
        theta: true parameters ``(*, D)``.
        log_prob_theta: their log-densities ``(*)``; ``-inf`` is allowed (rank ``M``).
        generator: for tie-breaking.

    Returns:
        ``(*, D + 1)`` ranks: columns ``0..D-1`` marginal, column ``D`` joint.

    Raises:
        ValueError: if samples or their log-densities are not finite, or
            ``log_prob_theta`` is NaN or ``+inf``; the message counts the pairs.
    """
    _check_draws(samples, log_prob_samples, log_prob_theta)
    joint = energy_ranks(log_prob_samples, log_prob_theta, generator=generator)
    return torch.cat([marginal_ranks(samples, theta, generator=generator), joint[..., None]], -1)


class PosteriorDraws(NamedTuple):
    """What :func:`posterior_ranks` keeps of the ``M`` draws per pair.

    Attributes:
        ranks: ``(N, D + 1)`` marginal ranks and the joint energy rank (last column).
        mean_error: ``(N, D)`` float64, Monte Carlo posterior mean minus the truth.
        variance: ``(N, D)`` float64, unbiased Monte Carlo posterior variance.

    The moments use the first ``min(M, MOMENT_DRAWS)`` draws of each pair.
    """

    ranks: Tensor
    mean_error: Tensor
    variance: Tensor


def posterior_ranks(
    posterior: Posterior | object,
    theta: Tensor,
    x: Tensor,
    num_posterior_samples: int,
    *,
    max_chunk_elements: int = 2**20,
    generator: torch.Generator | None = None,
) -> PosteriorDraws:
    r"""Draw ``M`` posterior samples per pair in chunks and reduce them to ranks and moments.

    Samples and their densities come from one ``posterior.sample_and_log_prob`` pass,
    the truth's density from ``posterior.log_prob``. Memory is
    ``O(max_chunk_elements)`` (the draws of one chunk, their log-densities and two
    scratch buffers of the same size) plus the ``(N, D + 1)`` outputs: pairs are taken
    ``max(1, max_chunk_elements // (M D))`` at a time, and if one pair's ``M D``
    exceeds the bound its draws are split too (ranks and sums add up over chunks).
    Besides sampling, the cost is a few passes over the draws (difference to the truth,
    summed signs, a test for ties); the sharpness moments use the first
    ``min(M, MOMENT_DRAWS)`` draws of each pair.

    Arguments:
        posterior: anything :func:`calib_lightning.as_posterior` accepts.
        theta: true parameters ``(N, D)``.
        x: observations ``(N, *X)``.
        num_posterior_samples: ``M >= 2``.
        max_chunk_elements: bound on ``samples_per_chunk * pairs_per_chunk * D``.
        generator: for tie-breaking (sampling uses the posterior's own randomness).

    Returns:
        :class:`PosteriorDraws`.

    Raises:
        ValueError: for bad shapes, non-finite ``theta``/``x``, or non-finite posterior
            samples/log-densities (naming how many pairs were affected).
    """
    posterior = as_posterior(posterior)
    check_pairs(theta, x)
    check_positive("num_posterior_samples", num_posterior_samples, integer=True)
    check_positive("max_chunk_elements", max_chunk_elements, integer=True)
    if num_posterior_samples < 2:
        raise ValueError(f"num_posterior_samples must be >= 2, got {num_posterior_samples}")
    n, d, m = theta.shape[0], theta.shape[1], num_posterior_samples
    rows = max(1, max_chunk_elements // (m * d))
    draws = max(1, min(m, max_chunk_elements // d))
    head = min(m, MOMENT_DRAWS)
    work = _Workspace()
    theta = theta.detach()
    with torch.no_grad():
        chunks = [
            _rank_chunk(
                posterior, theta[s : s + rows], x[s : s + rows], m, draws, head, s, work, generator
            )
            for s in range(0, n, rows)
        ]
    return PosteriorDraws(*(torch.cat(parts) for parts in zip(*chunks, strict=True)))


def _rank_chunk(
    posterior: Posterior,
    th: Tensor,
    xc: Tensor,
    m: int,
    draws: int,
    head: int,
    start: int,
    work: _Workspace,
    generator: torch.Generator | None,
) -> PosteriorDraws:
    """:func:`posterior_ranks` for one chunk of pairs (``start`` is its first index)."""
    n, d = th.shape
    log_prob_theta = posterior.log_prob(th, xc)
    _check_log_prob_theta(log_prob_theta, start)
    below = torch.zeros(n, d + 1, dtype=torch.long, device=th.device)
    total = torch.zeros(n, d, dtype=torch.float64, device=th.device)
    total_sq = torch.zeros_like(total)
    for done in range(0, m, draws):
        take = min(draws, m - done)
        samples, log_prob = posterior.sample_and_log_prob(xc, take)
        if samples.shape != (take, n, d) or log_prob.shape != (take, n):
            raise ValueError(
                f"posterior.sample_and_log_prob must return shapes (S, N, D) = {(take, n, d)} "
                f"and (S, N) = {(take, n)}, got {tuple(samples.shape)} and "
                f"{tuple(log_prob.shape)}"
            )
        dtype = torch.promote_types(samples.dtype, th.dtype)
        diff = torch.sub(samples, th, out=work("diff", samples, dtype))
        if done < head:  # moments from the first `head` draws, in float64
            first = diff[: head - done]
            first = work("head", first, torch.float64).copy_(first)
            total += first.sum(0)
            total_sq += first.square_().sum(0)
        marginal, zeros = _count_below(diff, generator)  # overwrites diff
        dtype = torch.promote_types(log_prob.dtype, log_prob_theta.dtype)
        energy = torch.sub(log_prob_theta, log_prob, out=work("energy", log_prob, dtype))
        joint, energy_zeros = _count_below(energy, generator)
        # A NaN draw looks like a tie to the counts; an infinite one shows in the moments
        # or its log-density. Only then check element by element, to name the pairs.
        if (
            zeros
            or energy_zeros
            or not bool(total_sq.isfinite().all() and log_prob.sum(0).isfinite().all())
        ):
            _check_draws(samples, log_prob, log_prob_theta, start)
        below[:, :d] += marginal
        below[:, d] += joint
    mean_error = total / head
    variance = ((total_sq - head * mean_error**2) / (head - 1)).clamp_min(0.0)
    return PosteriorDraws(below, mean_error, variance)


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
        raise ValueError(f"ranks must lie in [0, {num_posterior_samples}], got "
                         f"[{int(ranks.min())}, {int(ranks.max())}]")  # fmt: skip
    lead, c = ranks.shape[:-2], ranks.shape[-1]
    flat = ranks.long().movedim(-2, -1).reshape(-1, ranks.shape[-2])  # (B * C, N)
    offsets = torch.arange(flat.shape[0], device=ranks.device)[:, None] * m1
    counts = torch.bincount((flat + offsets).flatten(), minlength=flat.shape[0] * m1)
    return counts.reshape(*lead, c, m1)


def _check_counts(name: str, counts: Tensor, unit: str = "rank") -> None:
    """Raise unless ``counts`` ``(*, C)`` is a histogram: finite, non-negative, no empty row."""
    if not bool((torch.isfinite(counts) & (counts >= 0)).all()):
        raise ValueError(f"{name} must hold finite non-negative counts, got "
                         f"{counts.flatten()[:8].tolist()}...")  # fmt: skip
    if bool((counts.sum(-1) <= 0).any()):
        raise ValueError(f"{name} must hold at least one {unit} per row, got an empty row")
