"""Parameters far from the origin give the numbers they give at the origin.

Issue 12: raw moments (sum x^2 - n mean^2) and uncentred squared distances
(|a|^2 + |b|^2 - 2ab) lose every digit of a small spread at a large offset. Each
statistic below is computed on points ``offset + spread * z`` and compared with the same
points at offset 0: float64 at offsets 1e6 and 1.1e9 (a GPS time), float32 at offset 100.
"""

import pytest
import torch
from torch.distributions import Independent, Normal

import calib_lightning as cl
from calib_lightning.functional import frechet_distance, gaussian_base_points, mmd
from calib_lightning.functional.tarp import tarp_fit_scale
from calib_lightning.kernels import median_bandwidth, sq_distances
from calib_lightning.metrics import FrechetDistance

F32, F64 = torch.float32, torch.float64


def gen(seed):
    return torch.Generator().manual_seed(seed)


def _posterior(offset, spread):
    """Exact posterior of theta = offset + spread z, z ~ N(0, I), x = z + N(0, I):
    z | x ~ N(x / 2, 1 / 2), so the contraction is exactly 1 / 2."""
    return lambda x: Independent(Normal(offset + spread * x / 2, spread * 0.5**0.5), 1)


def _contraction(offset, spread, dtype):
    g = gen(0)
    z = torch.randn(2000, 2, generator=g, dtype=F64)
    x = (z + torch.randn(2000, 2, generator=g, dtype=F64)).to(dtype)
    theta = (offset + spread * z).to(dtype)
    torch.manual_seed(1)
    metric = cl.RankCalibration(100)
    for start in range(0, 2000, 500):  # several updates: the moments are merged
        metric.update(_posterior(offset, spread), theta[start : start + 500],
                      x[start : start + 500])
    out = metric.compute()
    exact_prior = ((theta.double() - theta.double()[0]).var(0))  # exact for these points
    return out.contraction, out.prior_variance, exact_prior


@pytest.mark.parametrize(
    ("offset", "spread", "dtype", "tolerance"),
    [(1e6, 0.01, F64, 1e-7), (100.0, 0.1, F32, 3e-3), (1.1e9, 0.01, F64, 2e-2)],
)
def test_contraction_does_not_depend_on_the_offset(offset, spread, dtype, tolerance):
    at_zero, _, _ = _contraction(0.0, spread, dtype)
    far, prior_variance, exact_prior = _contraction(offset, spread, dtype)
    # (before: 1.40 and 0.60 at 1e6, -inf at 1.1e9; at 1.1e9 float64 rounds theta to
    # 2.4e-7, which creates rank ties whose random breaking changes the draws: hence the
    # looser tolerance there, while the prior variance itself stays exact; float32 at 100:
    # 1e-4 with fixed chunks of 2**20 numbers, 2.1e-3 with chunks sized from the memory
    # budget, whose draw order differs: cause not isolated, see the issue 24 note)
    torch.testing.assert_close(far, at_zero, rtol=0, atol=tolerance)
    torch.testing.assert_close(prior_variance, exact_prior, rtol=1e-9, atol=0)
    torch.testing.assert_close(far, torch.full_like(far, 0.5), rtol=0, atol=0.05)


@pytest.mark.parametrize(("offset", "dtype", "rtol"), [(1e6, F64, 1e-6), (100.0, F32, 1e-3)])
def test_frechet_distance_does_not_depend_on_the_offset(offset, dtype, rtol):
    g = gen(2)
    spread = 0.01 if dtype == F64 else 0.1
    a = spread * torch.randn(4000, 2, generator=g, dtype=F64)
    b = spread * (1.2 * torch.randn(4000, 2, generator=g, dtype=F64) + 0.05)
    results = []
    for shift in (0.0, offset):
        samples, reference = (shift + a).to(dtype), (shift + b).to(dtype)
        metric = FrechetDistance(dim=2)
        for start in range(0, 4000, 1000):
            metric.update(samples=samples[start : start + 1000],
                          reference=reference[start : start + 1000])
        streamed = metric.compute().frechet_distance
        functional = frechet_distance(samples, reference).double()  # returned in dtype
        torch.testing.assert_close(streamed, functional, rtol=1e-9 if dtype == F64 else 1e-6,
                                   atol=0)
        results.append(streamed)
    # before: 0 instead of 4.8e-7 for the stream at 1e6
    assert float(results[0]) > 0
    torch.testing.assert_close(results[1], results[0], rtol=rtol, atol=0)


@pytest.mark.parametrize(("offset", "dtype", "rtol"), [(1e6, F64, 1e-6), (100.0, F32, 5e-3)])
def test_bandwidths_and_distances_do_not_depend_on_the_offset(offset, dtype, rtol):
    points = 0.01 * torch.randn(3, 300, 2, generator=gen(3), dtype=F64)
    near, far = points.to(dtype), (offset + points).to(dtype)
    # before: 0.14 instead of 0.023 at offset 100 in float32
    torch.testing.assert_close(median_bandwidth(far), median_bandwidth(near), rtol=rtol, atol=0)
    torch.testing.assert_close(sq_distances(far[0], far[1]), sq_distances(near[0], near[1]),
                               rtol=0, atol=rtol * 1e-4 * 20)
    base_near = gaussian_base_points(near[0], 8, gen(4))
    base_far = gaussian_base_points(far[0], 8, gen(4))
    torch.testing.assert_close((base_far.double() - offset), base_near.double(),
                               rtol=0, atol=rtol * 0.01)


@pytest.mark.parametrize(("offset", "dtype", "rtol"), [(1e6, F64, 1e-7), (100.0, F32, 2e-3)])
def test_tarp_scale_does_not_depend_on_the_offset(offset, dtype, rtol):
    z = 0.01 * torch.randn(400, 2, generator=gen(5), dtype=F64)
    scales = []
    for shift in (0.0, offset):
        theta = (shift + z).to(dtype)
        metric = cl.TARP(num_posterior_samples=10, num_null=20)
        for start in (0, 150):
            rows = slice(start, start + 150 if start == 0 else 400)
            samples = theta[rows].expand(10, -1, -1)
            metric.update(samples, theta[rows], torch.zeros(theta[rows].shape[0], 1, dtype=dtype))
        metric.compute()
        pooled = theta.expand(11, -1, -1).reshape(-1, 2)  # each pair's truth and 10 draws
        torch.testing.assert_close(metric.scale.double(), tarp_fit_scale(pooled).double(),
                                   rtol=1e-6, atol=0)
        scales.append(metric.scale.double())
    torch.testing.assert_close(scales[1], scales[0], rtol=rtol, atol=0)
    torch.testing.assert_close(scales[0], z.repeat(11, 1).std(0), rtol=1e-6, atol=0)


def test_mmd_power_and_level_do_not_depend_on_the_offset():
    """A doubled spread (0.01 -> 0.02) in float32 at offset 100: power stays 1 (it was 0)
    and the level stays at most about 0.05 for equal distributions."""
    g = gen(6)
    y = 0.01 * torch.randn(100, 60, 2, generator=g)
    x = 0.01 * torch.randn(100, 60, 2, generator=g)
    same = 0.01 * torch.randn(100, 60, 2, generator=g)
    for offset in (0.0, 100.0):
        power = mmd(offset + 2.0 * y, offset + x, num_permutations=100, generator=gen(7))
        level = mmd(offset + same, offset + x, num_permutations=100, generator=gen(8))
        assert float((power["p_value"] <= 0.05).float().mean()) >= 0.95
        assert float((level["p_value"] <= 0.05).float().mean()) <= 0.12
        torch.testing.assert_close(power["bandwidth"], mmd(2.0 * y, x, num_permutations=0)[
            "bandwidth"], rtol=5e-3, atol=0)
