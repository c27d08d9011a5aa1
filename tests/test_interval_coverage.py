"""The central credible intervals' coverage test: exact under calibration, and the sign.

The interval between the order statistics ``k`` and ``M + 1 - k`` of ``M`` draws holds the
truth with probability ``(M + 1 - 2 k) / (M + 1)`` exactly when the truth's rank is
uniform; the count over ``N`` pairs is binomial, so the test holds its level at any ``N``.
"""

import pytest
import torch
from scipy import stats

import calib_lightning as cl
from calib_lightning.functional.interval_coverage import (
    interval_counts,
    interval_coverage,
    interval_ranks,
)
from calib_lightning.tasks import GaussianToy

TOY = GaussianToy(dim=2)


@pytest.mark.parametrize("m", [9, 99, 1000])
def test_the_rank_window_is_the_interval_between_order_statistics(m):
    """Brute force in float64: the truth lies in (theta_(k), theta_(M + 1 - k)] of the
    sorted draws exactly when its rank lies in k..M - k, and the window's probability
    under a uniform rank is its share of 0..M."""
    g = torch.Generator().manual_seed(m)
    levels = torch.tensor([0.5, 0.8, 0.9], dtype=torch.float64)
    draws = torch.randn(m, 400, 1, generator=g, dtype=torch.float64)
    theta = 1.3 * torch.randn(400, 1, generator=g, dtype=torch.float64)
    ranks = (draws < theta).sum(0)
    k, probability = interval_ranks(levels, m)
    ordered = draws.sort(0).values
    for level, (low, p) in enumerate(zip(k.tolist(), probability.tolist(), strict=True)):
        lower = ordered[low - 1] if low > 0 else torch.full_like(theta, -torch.inf)
        upper = ordered[m - low] if m - low < m else torch.full_like(theta, torch.inf)
        inside = ((theta > lower) & (theta <= upper)).sum(0)
        assert int(interval_counts(ranks, m, levels)[level, 0]) == int(inside)
        assert p == pytest.approx((m + 1 - 2 * low) / (m + 1), abs=1e-15)
        assert abs(p - float(levels[level])) <= 1 / (m + 1)


def test_each_test_is_exact_on_uniform_ranks_vectorized_over_datasets():
    """20,000 calibration sets of uniform ranks (N = 50, M = 99, D = 3): each level's
    binomial test rejects at most as often as its level allows (discrete: conservative),
    and the Holm-combined verdict too."""
    g = torch.Generator().manual_seed(0)
    levels = torch.tensor([0.5, 0.9])
    ranks = torch.randint(0, 100, (20_000, 50, 3), generator=g)
    out = interval_coverage(interval_counts(ranks, 99, levels), 50, 99, levels)
    assert out.p_values.shape == (20_000, 2, 3)
    bound = stats.binom.ppf(0.999, 20_000, 0.05) / 20_000
    assert float((out.p_values < 0.05).double().mean(0).max()) <= bound
    assert float((out.global_p_value < 0.05).double().mean()) <= bound
    # and not far below the level: the binomial test's size at N = 50, p = 0.9
    assert float((out.p_values[:, 1] < 0.05).double().mean()) > 0.02


def test_the_metric_holds_its_level_over_fresh_datasets():
    """``cl.IntervalCoverage()`` at its defaults, the exact posterior, 200 fresh datasets of
    200 pairs: rejections at 0.05 within the 99 % binomial band's upper end."""
    rejected = 0
    for seed in range(200):
        theta, x = TOY.sample(200, torch.Generator().manual_seed(1000 + seed))
        metric = cl.IntervalCoverage()
        metric.update(TOY.posterior(), theta, x)
        rejected += float(metric.compute().global_p_value) < 0.05
    assert rejected <= stats.binom.ppf(0.99, 200, 0.05)


@pytest.mark.parametrize(("scale", "sign"), [(0.5, -1), (2.0, 1)])
def test_too_narrow_and_too_wide_are_found_with_their_sign(scale, sign):
    theta, x = TOY.sample(500, torch.Generator().manual_seed(7))
    metric = cl.IntervalCoverage(levels=(0.5, 0.8, 0.95))
    torch.manual_seed(0)
    metric.update(TOY.posterior(variance_scale=scale), theta, x)
    out = metric.compute()
    assert float(out.global_p_value) < 1e-4
    assert bool((out.coverage_error.sign() == sign).all())
    assert out.coverage.shape == (3, 2)


def test_batches_add_up_and_bad_input_is_named():
    theta, x = TOY.sample(300, torch.Generator().manual_seed(3))
    whole, parts = cl.IntervalCoverage(), cl.IntervalCoverage()
    torch.manual_seed(1)
    whole.update(TOY.posterior(), theta, x)
    torch.manual_seed(1)
    parts.update(TOY.posterior(), theta[:150], x[:150])
    parts.update(TOY.posterior(), theta[150:], x[150:])
    assert int(whole.histogram.sum()) == int(parts.histogram.sum()) == 600
    with pytest.raises(ValueError, match=r"levels must be numbers in \(0, 1\)"):
        cl.IntervalCoverage(levels=(0.5, 1.0))
    with pytest.raises(ValueError, match="needs at least N >= 2"):
        cl.IntervalCoverage().compute()
    with pytest.raises(ValueError, match="theta must have D = 2 columns"):
        cl.IntervalCoverage().update(TOY.posterior(), theta[:, :1], x)
