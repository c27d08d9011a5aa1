"""ECDF bands and the ECDF test: exact recursion vs enumeration, Monte Carlo coverage, level."""

import itertools
import math

import numpy as np
import pytest
import torch
from scipy import stats

from calib_lightning.functional import (
    band_coverage,
    ecdf_levels,
    ecdf_test,
    pointwise_band,
    rank_ecdf,
    rank_histogram,
    simultaneous_band,
)


def _uniform_rank_ecdfs(reps, n, m, num_points, seed):
    """ECDFs of ``reps`` datasets of ``n`` ranks uniform on 0..m, in one batched call."""
    g = torch.Generator().manual_seed(seed)
    ranks = torch.randint(0, m + 1, (reps, n, 1), generator=g)
    return rank_ecdf(rank_histogram(ranks, m)[:, 0], ecdf_levels(m, num_points))


def test_ecdf_levels_sit_on_the_rank_grid():
    cuts = ecdf_levels(999, 100)
    assert cuts.numel() == 100
    assert int(cuts[0]) >= 1
    assert int(cuts[-1]) <= 999
    assert bool((cuts.diff() > 0).all())
    assert torch.equal(ecdf_levels(5, 100), torch.arange(1, 6))  # K capped at M
    with pytest.raises(ValueError, match="num_points"):
        ecdf_levels(10, 0)


def test_band_coverage_matches_enumeration():
    # N = 4 ranks on 0..4 (5 values), K = 3 levels: enumerate all 5^4 datasets exactly
    n, m = 4, 4
    cuts = torch.tensor([1, 2, 4])
    z = cuts.double() / (m + 1)
    lower, upper = torch.tensor([0, 1, 2]), torch.tensor([2, 3, 4])
    inside = 0
    for ranks in itertools.product(range(m + 1), repeat=n):
        counts = [sum(r <= c - 1 for r in ranks) for c in cuts.tolist()]
        inside += all(lo <= k <= hi for k, lo, hi in zip(counts, lower, upper, strict=True))
    expected = inside / (m + 1) ** n
    assert float(band_coverage(z, lower, upper, n)) == pytest.approx(expected, abs=1e-12)
    # several bands at once: the same numbers as one at a time
    both = band_coverage(z, torch.stack([lower, lower + 1]), torch.stack([upper, upper]), n)
    assert float(both[1]) == pytest.approx(float(band_coverage(z, lower + 1, upper, n)))
    assert float(both[0]) == pytest.approx(expected, abs=1e-12)


def test_pointwise_band_formula():
    t = torch.tensor([0.1, 0.5, 0.9], dtype=torch.float64)
    half = pointwise_band(t, 400, 0.1)
    assert torch.allclose(half, stats.norm.ppf(0.95) * torch.sqrt(t * (1 - t) / 400))


def test_simultaneous_band_covers_at_nominal_level_and_pointwise_does_not():
    n, m, reps, level = 100, 49, 4000, 0.05
    levels, ecdf = _uniform_rank_ecdfs(reps, n, m, None, seed=1)
    lower, upper, exact = simultaneous_band(levels, n, level)
    deviation = ecdf - levels
    inside = ((deviation >= lower - 1e-12) & (deviation <= upper + 1e-12)).all(-1)
    mc = inside.double().mean().item()
    sd = math.sqrt(exact * (1 - exact) / reps)
    assert 1 - level <= exact < 1 - level + 0.02  # as close to nominal as discreteness allows
    assert abs(mc - exact) < 4 * sd  # the exact recursion is right
    half = pointwise_band(levels, n, level)
    pointwise_inside = (deviation.abs() <= half).all(-1).double().mean().item()
    assert pointwise_inside < 0.8  # pointwise band: far below its nominal 0.95 as a whole
    assert mc - pointwise_inside > 0.15


def test_band_is_exact_for_discrete_ranks_with_coarse_grid():
    # few rank values (M = 4) and many pairs: the regime where continuous bands fail
    n, m, reps = 500, 4, 4000
    levels, ecdf = _uniform_rank_ecdfs(reps, n, m, None, seed=2)
    lower, upper, exact = simultaneous_band(levels, n, 0.1)
    inside = ((ecdf - levels >= lower - 1e-12) & (ecdf - levels <= upper + 1e-12)).all(-1)
    assert abs(inside.double().mean().item() - exact) < 4 * math.sqrt(exact * (1 - exact) / reps)


def test_ecdf_test_level_and_agreement_with_band():
    n, m, reps, level = 60, 19, 1000, 0.05
    levels, ecdf = _uniform_rank_ecdfs(reps, n, m, None, seed=3)
    _, p = ecdf_test(ecdf, levels, n)
    p = p.numpy()
    grid = np.linspace(0, 1, 101)
    assert np.max((p[:, None] <= grid).mean(0) - grid) < 0.05  # valid (super-uniform)
    assert 0.025 <= (p <= level).mean() <= 0.075
    lower, upper, _ = simultaneous_band(levels, n, level)
    outside = ((ecdf - levels < lower - 1e-12) | (ecdf - levels > upper + 1e-12)).any(-1)
    assert torch.equal(outside, torch.as_tensor(p < level))  # the band draws the test


def test_ecdf_test_rejects_skewed_ranks_and_reports_tiny_p_values():
    g = torch.Generator().manual_seed(4)
    ranks = torch.rand(2, 300, 1, generator=g) ** torch.tensor([1.0, 3.0])[:, None, None]
    ranks = (ranks * 50).long().clamp_max(49)  # second dataset piles up at low ranks
    levels, ecdf = rank_ecdf(rank_histogram(ranks, 49)[:, 0], ecdf_levels(49, None))
    _, p = ecdf_test(ecdf, levels, 300)
    assert p[0] > 0.01
    assert 0 <= p[1] < 1e-10


def test_band_arguments_are_checked():
    with pytest.raises(ValueError, match="levels must be"):
        simultaneous_band(torch.tensor([0.5, 0.4]), 10)
    with pytest.raises(ValueError, match="level"):
        simultaneous_band(torch.tensor([0.5]), 10, level=1.5)
    with pytest.raises(ValueError, match="num_ranks"):
        pointwise_band(torch.tensor([0.5]), 0)
