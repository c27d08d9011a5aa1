"""Kernels: closed forms against autograd, naive sums and Monte Carlo, in float64."""

import itertools

import pytest
import torch

from calib_lightning import kernels


@pytest.fixture(autouse=True)
def float64():
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _l(kernel, y, y2, ell):
    q = ((y - y2) ** 2).sum()
    if kernel == "rbf":
        return torch.exp(-q / (2 * ell**2))
    return (1 + q / ell**2) ** -0.5


def _stein_by_autograd(kernel, y1, s1, y2, s2, ell):
    """h from its definition, every derivative of l by autograd, one pair at a time."""
    y1 = y1.clone().requires_grad_(True)
    y2 = y2.clone().requires_grad_(True)
    value = _l(kernel, y1, y2, ell)
    g1, g2 = torch.autograd.grad(value, (y1, y2), create_graph=True)
    trace = sum(torch.autograd.grad(g1[a], y2, retain_graph=True)[0][a] for a in range(y1.shape[0]))
    return value * (s1 @ s2) + s1 @ g2 + s2 @ g1 + trace


@pytest.mark.parametrize("kernel", ["rbf", "imq"])
def test_stein_kernel_equals_autograd_of_definition(kernel):
    g = _gen(0)
    y1, s1 = torch.randn(4, 3, generator=g), torch.randn(4, 3, generator=g)
    y2, s2 = torch.randn(5, 3, generator=g) + 10.0, torch.randn(5, 3, generator=g)
    y1 = y1 + 10.0  # an offset: the centering inside must not change anything
    ell = 1.3
    h = kernels.stein_kernel(y1, s1, y2, s2, kernel, ell)
    expected = torch.stack(
        [
            torch.stack(
                [_stein_by_autograd(kernel, y1[i], s1[i], y2[j], s2[j], ell) for j in range(5)]
            )
            for i in range(4)
        ]
    )
    torch.testing.assert_close(h, expected, rtol=1e-10, atol=1e-12)


def test_stein_kernel_batched_bandwidth_matches_loop():
    g = _gen(1)
    y, s = torch.randn(3, 6, 2, generator=g), torch.randn(3, 6, 2, generator=g)
    ell = torch.tensor([0.5, 1.0, 2.0])
    batched = kernels.stein_kernel(y, s, y, s, "imq", ell)
    for b in range(3):
        torch.testing.assert_close(
            batched[b], kernels.stein_kernel(y[b], s[b], y[b], s[b], "imq", float(ell[b]))
        )


def test_unknown_kernel_is_rejected():
    y = torch.zeros(2, 1)
    with pytest.raises(ValueError, match="kernel must be one of"):
        kernels.stein_kernel(y, y, y, y, "laplace", 1.0)


def _isotropic_scores(z, mean, var):
    """Scores of N(mean_i, var_i I) at base points z: (n, m, D)."""
    return -(z[None] - mean[:, None]) / var[:, None, None]


def test_gfd_between_isotropic_gaussians_equals_closed_form():
    """s_i - s_j = a z + b with a = 1/v_j - 1/v_i, b = mu_i/v_i - mu_j/v_j, so
    GFD_hat = a^2 mean|z|^2 + 2 a b . mean(z) + |b|^2 for the given base points, and
    GFD = a^2 (tr S + |m|^2) + 2 a b . m + |b|^2 under nu = N(m, S)."""
    g = _gen(2)
    n, d = 5, 3
    mean, var = torch.randn(n, d, generator=g), torch.rand(n, generator=g) + 0.5
    nu_mean, nu_std = torch.tensor([0.5, -1.0, 2.0]), torch.tensor([1.0, 2.0, 0.5])
    a = 1 / var[None, :] - 1 / var[:, None]
    b = (mean / var[:, None])[:, None] - (mean / var[:, None])[None, :]

    z = nu_mean + nu_std * torch.randn(64, d, generator=g)
    gfd = kernels.gfd_sq_distances(_isotropic_scores(z, mean, var))
    exact = a**2 * (z**2).sum(-1).mean() + 2 * a * (b @ z.mean(0)) + (b**2).sum(-1)
    torch.testing.assert_close(gfd, exact, rtol=1e-10, atol=1e-10)

    z = nu_mean + nu_std * torch.randn(400_000, d, generator=g)
    gfd = kernels.gfd_sq_distances(_isotropic_scores(z, mean, var))
    population = a**2 * ((nu_std**2).sum() + (nu_mean**2).sum()) + 2 * a * (b @ nu_mean)
    population = population + (b**2).sum(-1)
    torch.testing.assert_close(gfd, population, rtol=1e-2, atol=1e-2)


def test_kgfd_equals_naive_double_sum():
    g = _gen(3)
    n, m, d = 4, 6, 2
    features, base = torch.randn(n, m, d, generator=g), torch.randn(m, d, generator=g)
    bw = 0.9
    kgfd = kernels.kgfd_sq_distances(features, base, bw)
    gram = torch.exp(-((base[:, None] - base[None]) ** 2).sum(-1) / (2 * bw**2))
    expected = torch.zeros(n, n)
    for i in range(n):
        for j in range(n):
            delta = features[i] - features[j]
            pairs = itertools.product(range(m), repeat=2)
            expected[i, j] = sum(gram[k, k2] * (delta[k] @ delta[k2]) for k, k2 in pairs) / m**2
    torch.testing.assert_close(kgfd, expected, rtol=1e-10, atol=1e-10)
    with pytest.raises(ValueError, match="base_points must be given"):
        kernels.score_embedding(features, "kgfd")


def test_gaussian_expected_kernel_matches_monte_carlo():
    g = _gen(4)
    mean1, var1 = torch.tensor([0.3, -1.0]), torch.tensor([0.5, 2.0])
    mean2, var2 = torch.tensor([1.0, 0.0]), torch.tensor([1.5, 0.2])
    ell = 1.2
    z1 = mean1 + var1.sqrt() * torch.randn(1_000_000, 2, generator=g)
    z2 = mean2 + var2.sqrt() * torch.randn(1_000_000, 2, generator=g)
    mc = torch.exp(-((z1 - z2) ** 2).sum(-1) / (2 * ell**2)).mean()
    exact = kernels.gaussian_expected_kernel(mean1, var1, mean2, var2, ell)
    torch.testing.assert_close(exact, mc, rtol=5e-3, atol=5e-3)
    # zero variances give the kernel itself
    point = kernels.gaussian_expected_kernel(mean1, torch.zeros(2), mean2, torch.zeros(2), ell)
    torch.testing.assert_close(point, torch.exp(-((mean1 - mean2) ** 2).sum() / (2 * ell**2)))


def test_median_bandwidth():
    points = torch.tensor([[0.0], [1.0], [3.0]])  # distances 1, 2, 3
    assert float(kernels.median_bandwidth(points)) == pytest.approx(2.0)
    # bounded subsample, detached, and positive even for identical points
    big = torch.randn(5000, 2, generator=_gen(5), requires_grad=True)
    bw = kernels.median_bandwidth(big, max_points=300)
    assert not bw.requires_grad
    assert 1.5 < float(bw) < 2.0  # median distance of N(0, I_2) pairs is about 1.67
    assert float(kernels.median_bandwidth(torch.ones(4, 2))) == 1.0
