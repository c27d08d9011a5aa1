r"""TARP's coverage curve, its statistic, and the exact test of one reference set.

The pieces of :mod:`calib_lightning.functional.tarp` that see one rank per pair: the
TARP rank of the truth under a reference (:func:`tarp_ranks`), the histogram of ranks
(:func:`tarp_counts`), the expected-coverage curve and its sup-deviation statistic and
signed upper-half area, the typed result, and the Monte Carlo test of one reference set
per pair (:func:`tarp_test`): with references fixed independently of the truths, the
rank histogram is :math:`\mathrm{Multinomial}(N, 1/(S+1))` under :math:`H_0`, so ``B``
independent histograms give its null exactly. :func:`~calib_lightning.functional.tarp`
averages the curve over several references per pair and tests it by permutation.

References:
    Lemos, Coogan, Hezaveh, Perreault-Levasseur. "Sampling-Based Accuracy Testing of
    Posterior Estimators for General Inference." ICML 2023.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from calib_lightning._checks import (
    check_choice,
    check_finite,
    check_points,
    check_positive,
    check_probability,
)
from calib_lightning._chunks import pair_blocks
from calib_lightning.functional._multinomial import uniform_multinomial
from calib_lightning.functional.combine import monte_carlo_p_value
from calib_lightning.functional.ranks import _check_counts, rank_histogram
from calib_lightning.results import Result

__all__ = [
    "DISTANCES",
    "TARPResult",
    "expected_coverage",
    "tarp_counts",
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
        return torch.cat([tarp_ranks(samples[:, rows], theta[rows], references[rows],
                                     scale=scale, distance=distance) for rows in blocks])
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
    credibility = torch.linspace(0.0, 1.0, num_bins + 1, dtype=torch.float64,
                                 device=counts.device)  # fmt: skip
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
