"""Analytic p-values are exact in float64 down to its smallest normal number, never 0.

Closed forms against scipy (float64) at ordinary and extreme statistics: the normal
two-sided tail, the chi-square test of the rank histograms, the rank-mean t-tests and
the Cauchy combination, whose terms overflow float64 when several p-values sit at the
floor.
"""

import math

import pytest
import torch
from scipy import stats

from calib_lightning.functional import combine_p_values, rank_mean_test, uniformity_test
from calib_lightning.functional._tails import (
    P_VALUE_FLOOR,
    chi2_sf,
    normal_two_sided_p_value,
    student_t_cdf,
)
from calib_lightning.functional.bands import P_VALUE_FLOOR as BANDS_FLOOR
from calib_lightning.plots._format import format_p_value


def test_the_floor_is_the_smallest_normal_float64():
    assert P_VALUE_FLOOR == BANDS_FLOOR == 2.2250738585072014e-308


def test_normal_two_sided_p_value_matches_scipy_down_to_the_floor():
    z = torch.tensor([0.0, 0.5, 1.96, -3.0, 8.5, -15.8, 20.0, 30.0, 37.0, 37.5],
                     dtype=torch.float64)  # fmt: skip
    expected = torch.as_tensor(2 * stats.norm.sf(z.abs().numpy()))
    got = normal_two_sided_p_value(z)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=0)
    # the joint classifier's Z = 15.8 of the issue: 3.1e-56, where ndtr gives 0
    assert float(torch.special.ndtr(torch.tensor(-15.8, dtype=torch.float64))) == 0.0
    assert got[5] == pytest.approx(3.1111657379e-56, rel=1e-9)
    # beyond float64: the floor, an upper bound; NaN passes through
    beyond = normal_two_sided_p_value(torch.tensor([38.5, -40.0, 1e3, math.inf, math.nan]))
    assert beyond[:4].tolist() == [P_VALUE_FLOOR] * 4
    assert math.isnan(beyond[4])


@pytest.mark.parametrize(
    ("statistic", "df"),
    [(0.5, 1), (118.8, 99), (250.6, 199), (62.2, 49), (1000.0, 99), (1500.0, 99),
     (1400.0, 19), (40.0, 1), (3000.0, 999)],
)  # fmt: skip
def test_chi2_sf_matches_scipy(statistic, df):
    expected = stats.chi2.sf(statistic, df)
    assert expected > P_VALUE_FLOOR  # representable: must come out exact, not 0
    got = float(chi2_sf(torch.tensor(statistic, dtype=torch.float64), df))
    assert got == pytest.approx(expected, rel=1e-12)


def test_uniformity_test_is_the_exact_chi_square_tail():
    """Histograms of 100 bins (99 degrees of freedom), N = 10,000 pairs, from flat to far
    from uniform: the p-value is scipy's chi-square tail at the returned statistic, to
    1e-12 relative (torch's gammaincc was 1e-9 off in the bulk, e.g. at 118.8); at
    X^2 = 1000, p = 7e-149 is representable, so it is that, not the floor."""
    rows = []
    for shift, bins in ((0, 0), (10, 25), (15, 26), (15, 50), (20, 50), (30, 50)):
        row = torch.full((100,), 100, dtype=torch.long)  # X^2 = 2 bins shift^2 / 100
        row[:bins] -= shift
        row[100 - bins :] += shift
        rows.append(row)
    far = torch.full((100,), 100, dtype=torch.long)
    far[0] += 315  # X^2 = (315^2 + 35 * 9^2 + ...) / 100, about 1000
    far[1:36] -= 9
    rows.append(far)
    statistic, p = uniformity_test(torch.stack(rows), num_bins=100)
    expected = torch.as_tensor(stats.chi2.sf(statistic.numpy(), 99))
    assert bool((expected > P_VALUE_FLOOR).all())
    torch.testing.assert_close(p, expected, rtol=1e-12, atol=0)
    assert statistic[:-1].tolist() == [0.0, 50.0, 117.0, 225.0, 400.0, 900.0]
    assert 950 < float(statistic[-1]) < 1100
    assert 1e-160 < float(p[-1]) < 1e-130


def test_rank_mean_test_p_values_match_scipy_at_extreme_statistics():
    counts = torch.zeros(3, 11, dtype=torch.long)
    counts[0] = 10  # flat: t = 0
    counts[1, 0], counts[1, 10] = 900, 100  # truths mostly low: t about -27
    counts[2, 9], counts[2, 10] = 990, 10  # all high, tiny spread: t about 1600
    out = rank_mean_test(counts)
    t, df = out.statistic.numpy(), (out.num_pairs - 1).numpy()
    for got, expected in ((out.p_less, stats.t.cdf(t, df)), (out.p_greater, stats.t.sf(t, df))):
        expected = torch.as_tensor(expected).clamp_min(P_VALUE_FLOOR)
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=0)
    assert float(out.p_greater[2]) == P_VALUE_FLOOR  # far below float64: the floor, not 0
    assert float(student_t_cdf(torch.tensor(-40.0), 999)) == pytest.approx(
        stats.t.cdf(-40.0, 999), rel=1e-12
    )


def test_cauchy_combination_of_a_tiny_and_an_ordinary_p_value():
    # T = (tan((1/2 - 1e-200) pi) + tan(0)) / 2 = 1 / (2e-200 pi) to float64 precision,
    # p = 1/2 - arctan(T) / pi = arctan(1 / T) / pi = 2e-200
    p = combine_p_values(torch.tensor([1e-200, 0.5], dtype=torch.float64))
    assert float(p) == pytest.approx(2e-200, rel=1e-12)
    # weighted: T = w1 / (1e-200 pi) + w2 * 0, p = 1e-200 / w1
    w = torch.tensor([0.25, 0.75])
    p = combine_p_values(torch.tensor([1e-200, 0.5], dtype=torch.float64), weights=w)
    assert float(p) == pytest.approx(4e-200, rel=1e-12)


@pytest.mark.parametrize("count", [13, 100, 1000])
def test_cauchy_combination_of_many_p_values_at_the_floor_does_not_overflow(count):
    """Each term is 1 / (p pi) = 1.4e307 at the floor: their sum overflowed to inf and the
    combined p-value to exactly 0. The combination of K equal p-values is that p-value."""
    for value in (P_VALUE_FLOOR, 1e-306):
        p = torch.full((count,), value, dtype=torch.float64)
        assert float(combine_p_values(p)) == pytest.approx(value, rel=1e-12)
    mixed = torch.cat([torch.full((count,), 1e-300, dtype=torch.float64),
                       torch.tensor([0.3, 0.999, math.nan], dtype=torch.float64)])  # fmt: skip
    # T = (count / (1e-300 pi) + tan(0.2 pi) + tan(-0.499 pi)) / (count + 2)
    expected = 1e-300 * (count + 2) / count
    assert float(combine_p_values(mixed)) == pytest.approx(expected, rel=1e-12)


def test_combined_p_values_are_never_zero():
    """p-values of exactly 0 (from outside the package) combine to the floor, not 0."""
    p = torch.tensor([[0.0, 0.5], [0.0, 0.0]], dtype=torch.float64)
    for method in ("cauchy", "holm"):
        out = combine_p_values(p, method=method)
        assert bool((out >= P_VALUE_FLOOR).all()), (method, out)
        assert bool((out < 1e-300).all()), (method, out)
    assert combine_p_values(p[1], method="holm").item() == P_VALUE_FLOOR


def test_format_p_value_prints_exact_tails_and_the_floor_as_a_bound():
    assert format_p_value(float(normal_two_sided_p_value(torch.tensor(15.8)))) == "p = 3.1e-56"
    assert format_p_value(P_VALUE_FLOOR) == "p < 2.2e-308"
    assert format_p_value(float(combine_p_values(torch.zeros(3)))) == "p < 2.2e-308"
