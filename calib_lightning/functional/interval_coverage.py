r"""Central credible intervals: do they cover the truth as often as they claim?

With ``M`` posterior draws per pair and the marginal rank :math:`r_{ia}` of the true
parameter among them (:func:`~calib_lightning.functional.marginal_ranks`), the central
interval of parameter ``a`` at level :math:`1 - \alpha` is
:math:`(\theta_{(k)}, \theta_{(M + 1 - k)}]` between order statistics of the draws,
:math:`k = \lfloor \alpha (M + 1) / 2 \rceil`. It holds the truth exactly when
:math:`k \le r_{ia} \le M - k`. Under calibration the rank is uniform on
:math:`\{0, \dots, M\}`, so the interval covers the truth with probability
:math:`p = (M + 1 - 2k) / (M + 1)`, exactly, whatever the posterior's shape; over ``N``
independent pairs the count inside is :math:`\mathrm{Binomial}(N, p)`, and each level and
parameter gets an exact two-sided binomial test. The result reads in the units users
quote: "the 90 % intervals of ``a`` cover 84 % of the truths".

These functions take integer ranks as tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from scipy import stats
from torch import Tensor

from calib_lightning.functional.combine import combine_p_values
from calib_lightning.results import Result

__all__ = [
    "INTERVAL_LEVELS",
    "IntervalCoverageResult",
    "interval_counts",
    "interval_coverage",
    "interval_mask",
    "interval_ranks",
]

#: the nominal levels of the central intervals by default
INTERVAL_LEVELS = (0.5, 0.9)


def interval_ranks(levels: Tensor, num_posterior_samples: int) -> tuple[Tensor, Tensor]:
    r"""The rank window of each level's central interval and its exact coverage.

    Arguments:
        levels: nominal levels :math:`1 - \alpha` ``(L,)`` in ``(0, 1)``.
        num_posterior_samples: ``M``.

    Returns:
        ``(k, probability)``: the interval holds the truth when ``k <= r <= M - k``,
        ``(L,)`` int64; ``(M + 1 - 2 k) / (M + 1)``, ``(L,)`` float64.

    Example:
        >>> k, p = interval_ranks(torch.tensor([0.5, 0.9]), 99)
        >>> k.tolist(), p.tolist()
        ([25, 5], [0.5, 0.9])
    """
    m = num_posterior_samples
    alpha = 1 - levels.double()
    k = torch.round(alpha * (m + 1) / 2).long().clamp(0, m // 2)
    return k, (m + 1 - 2 * k).double() / (m + 1)


def interval_mask(levels: Tensor, num_posterior_samples: int) -> Tensor:
    """Which ranks ``0..M`` put the truth inside each level's central interval.

    Returns:
        ``(L, M + 1)`` bool.

    Example:
        >>> interval_mask(torch.tensor([0.5]), 3).int()
        tensor([[0, 1, 1, 0]], dtype=torch.int32)
    """
    k, _ = interval_ranks(levels, num_posterior_samples)
    ranks = torch.arange(num_posterior_samples + 1)
    return (ranks[None] >= k[:, None]) & (ranks[None] <= num_posterior_samples - k[:, None])


def interval_counts(ranks: Tensor, num_posterior_samples: int, levels: Tensor) -> Tensor:
    """How many truths each level's central interval holds, per parameter.

    Arguments:
        ranks: marginal ranks ``(*, N, D)`` in ``0..M`` (``*``: calibration sets).
        num_posterior_samples: ``M``.
        levels: nominal levels ``(L,)``.

    Returns:
        ``(*, L, D)`` int64 counts.

    Example:
        >>> ranks = torch.tensor([[0], [50], [99]])  # M = 99: a tail, the centre, a tail
        >>> interval_counts(ranks, 99, torch.tensor([0.5, 0.9]))
        tensor([[1],
                [1]])
    """
    if ranks.ndim < 2:
        raise ValueError(f"ranks must have shape (*, N, D), got {tuple(ranks.shape)}")
    mask = interval_mask(levels, num_posterior_samples).to(ranks.device)  # (L, M + 1)
    return mask[:, ranks].sum(-2).movedim(0, -2)  # (L, *, N, D) -> (*, L, D)


@dataclass(eq=False)
class IntervalCoverageResult(Result):
    """Coverage of the central credible intervals (:func:`interval_coverage`).

    Attributes:
        levels: the nominal levels ``(L,)``.
        expected: the exact coverage under calibration with ``M`` draws ``(L,)`` (the
            nominal level, rounded to the draws' grid).
        coverage: the share of truths inside ``(*, L, D)``.
        p_values: exact two-sided binomial p-values ``(*, L, D)``.
        global_p_value: ``(*)`` Holm's combination of the ``L D`` p-values (the verdict).
        coverage_error: ``(*, L, D)`` coverage minus expected: negative = the intervals
            miss the truth too often (over-confident, or biased).
        mean_coverage_error: ``(*, L)`` the coverage error averaged over the parameters
            (logged as ``mean_coverage_error/l``, one per level).
        num_pairs: ``N``.
    """

    verdict = "global_p_value"
    logged = ("global_p_value", "mean_coverage_error")

    levels: Tensor
    expected: Tensor
    coverage: Tensor
    p_values: Tensor
    global_p_value: Tensor
    coverage_error: Tensor
    mean_coverage_error: Tensor
    num_pairs: int


def interval_coverage(
    counts: Tensor, num_pairs: int, num_posterior_samples: int, levels: Tensor
) -> IntervalCoverageResult:
    """The exact binomial tests of the central intervals' coverage (module docstring).

    Arguments:
        counts: truths inside each level's interval ``(*, L, D)`` (:func:`interval_counts`;
            ``*``: calibration sets, each its own test).
        num_pairs: ``N >= 1``.
        num_posterior_samples: ``M``.
        levels: nominal levels ``(L,)``.

    Example:
        >>> g = torch.Generator().manual_seed(0)
        >>> ranks = torch.randint(0, 100, (2000, 2), generator=g)  # uniform: calibrated
        >>> levels = torch.tensor([0.5, 0.9])
        >>> out = interval_coverage(interval_counts(ranks, 99, levels), 2000, 99, levels)
        >>> bool(out.global_p_value > 0.05), out.expected.tolist()
        (True, [0.5, 0.9])
    """
    if num_pairs < 1:
        raise ValueError(f"num_pairs must be >= 1, got {num_pairs}")
    _, expected = interval_ranks(levels, num_posterior_samples)
    k = counts.double().cpu()
    p = expected[:, None].expand_as(k)
    below = torch.as_tensor(stats.binom.cdf(k.numpy(), num_pairs, p.numpy()))
    above = torch.as_tensor(stats.binom.sf(k.numpy() - 1, num_pairs, p.numpy()))
    p_values = (2 * torch.minimum(below, above)).clamp(max=1.0)
    coverage = k / num_pairs
    error = coverage - expected[:, None]
    return IntervalCoverageResult(
        levels=levels.double().cpu(),
        expected=expected,
        coverage=coverage,
        p_values=p_values,
        global_p_value=combine_p_values(p_values.flatten(-2), dim=-1, method="holm"),
        coverage_error=error,
        mean_coverage_error=error.mean(-1),
        num_pairs=num_pairs,
    )
