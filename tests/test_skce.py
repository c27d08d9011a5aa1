"""SKCE baseline: closed forms against Monte Carlo and quadrature, level and power."""

import numpy as np
import pytest
import torch
from scipy import integrate, stats

from calib_lightning.baselines.skce import (
    gaussian_mmd_sq,
    sample_mmd_sq,
    skce_matrix_gaussian,
    skce_matrix_samples,
    skce_test,
    wasserstein_sq_gaussian,
)
from calib_lightning.tasks import HGM, MGM

F64 = torch.float64


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _gaussians(n, d, seed):
    g = _gen(seed)
    mean = torch.randn(n, d, generator=g, dtype=F64)
    var = 0.3 + torch.rand(n, d, generator=g, dtype=F64)
    theta = mean + var.sqrt() * torch.randn(n, d, generator=g, dtype=F64)
    return theta, mean, var


def test_monte_carlo_matrix_converges_to_closed_form():
    theta, mean, var = _gaussians(5, 2, 0)
    samples = mean[:, None] + var.sqrt()[:, None] * torch.randn(
        5, 40_000, 2, generator=_gen(1), dtype=F64
    )
    exact = skce_matrix_gaussian(theta, mean, var, bandwidth=0.8, distribution_kernel=None)
    mc = skce_matrix_samples(theta, samples, bandwidth=0.8, distribution_kernel=None)
    torch.testing.assert_close(mc, exact, atol=5e-3, rtol=0)


def test_mmd_from_few_samples_is_unbiased():
    """With S = 4 draws per model a biased (V-statistic) estimate would be off by about
    2 (1 - E l(z, z')) / S; averaging 20000 independent replicates must hit the closed form."""
    _, mean, var = _gaussians(4, 2, 2)
    noise = torch.randn(20_000, 4, 4, 2, generator=_gen(3), dtype=F64)
    samples = mean[:, None] + var.sqrt()[:, None] * noise
    estimate = sample_mmd_sq(samples, 1.0)
    torch.testing.assert_close(estimate.mean(0), gaussian_mmd_sq(mean, var, 1.0), atol=0.01, rtol=0)
    assert torch.equal(torch.diagonal(estimate[0]), torch.zeros(4, dtype=F64))


def test_wasserstein_equals_quantile_function_distance_in_one_dimension():
    """W2^2 = int_0^1 (F1^-1(u) - F2^-1(u))^2 du; for Gaussians (mu1-mu2)^2 + (s1-s2)^2."""
    mean = torch.tensor([[0.3], [-1.2]], dtype=F64)
    var = torch.tensor([[0.25], [2.0]], dtype=F64)
    q1, q2 = stats.norm(0.3, 0.5), stats.norm(-1.2, np.sqrt(2.0))
    value, _ = integrate.quad(lambda u: (q1.ppf(u) - q2.ppf(u)) ** 2, 0, 1, limit=200)
    assert float(wasserstein_sq_gaussian(mean, var)[0, 1]) == pytest.approx(value, rel=1e-6)


@pytest.mark.parametrize("distribution_kernel", ["wasserstein", "mmd"])
def test_level_and_power_of_the_closed_form_test(distribution_kernel):
    def p_values(truth, model, n, reps, seed):
        theta, x = truth.sample(n * reps, _gen(seed))
        dist = model(x)
        d = theta.shape[1]
        matrix = skce_matrix_gaussian(
            theta.reshape(reps, n, d),
            dist.mean.reshape(reps, n, d),
            dist.variance.reshape(reps, n, d),
            distribution_kernel=distribution_kernel,
        )
        return skce_test(matrix, 500, _gen(seed + 1)).p_value.numpy()

    calibrated = p_values(MGM(0.0, dtype=F64), MGM(0.0, dtype=F64), 100, 200, 4)
    alphas = np.linspace(0.01, 1, 100)
    assert ((calibrated[None] <= alphas[:, None]).mean(1) - alphas).max() < 0.1
    assert 0.01 <= (calibrated <= 0.05).mean() <= 0.10
    rates = [
        (p_values(HGM(0.0, dtype=F64), HGM(1.0, dtype=F64), n, 50, 5) <= 0.05).mean()
        for n in (32, 256)
    ]
    assert rates[0] < rates[1]
    assert rates[1] >= 0.8


def test_bad_input():
    theta, mean, var = _gaussians(4, 2, 6)
    with pytest.raises(ValueError, match=r"mean must have shape \(4, 2\)"):
        skce_matrix_gaussian(theta, mean[:3], var)
    with pytest.raises(ValueError, match="var must be non-negative"):
        skce_matrix_gaussian(theta, mean, -var)
    with pytest.raises(ValueError, match="S >= 2"):
        sample_mmd_sq(mean[:, None], 1.0)
    with pytest.raises(ValueError, match="distribution_kernel must be one of"):
        skce_matrix_samples(theta, mean[:, None].expand(4, 3, 2), distribution_kernel="wasserstein")
