"""Sample-based comparison: MMD, Frechet distance, density/coverage, Vendi score.

Closed forms in float64, the permutation test's level and power, streaming metrics
equal to the functional core (also under DDP), and bad input.
"""

import math

import numpy as np
import pytest
import scipy.linalg
import torch

from calib_lightning.evaluation import draws
from calib_lightning.functional import (
    compare_to_reference,
    density_coverage,
    frechet_distance,
    frechet_distance_from_moments,
    mmd,
    vendi_score,
)
from calib_lightning.functional.samples import _mmd_from_gram
from calib_lightning.kernels import gaussian_expected_kernel
from calib_lightning.metrics import DensityCoverage, FrechetDistance
from calib_lightning.tasks import GaussianToy
from calib_lightning.testing import run_distributed

F64 = torch.float64


def gen(seed):
    return torch.Generator().manual_seed(seed)


def rejection_summary(p_values, level=0.05):
    p = torch.sort(p_values.flatten().double()).values
    grid = torch.linspace(0.0, 1.0, 101, dtype=F64)
    ecdf = (p.unsqueeze(0) <= grid.unsqueeze(1)).double().mean(1)
    return float((p <= level).double().mean()), float((ecdf - grid).max())


# -- MMD ------------------------------------------------------------------------------
def naive_mmd(x, y, bandwidth):
    def k(a, b):
        return math.exp(-float(((a - b) ** 2).sum()) / (2 * bandwidth**2))

    n, m = len(x), len(y)
    xx = sum(k(x[i], x[j]) for i in range(n) for j in range(n) if i != j) / (n * (n - 1))
    yy = sum(k(y[i], y[j]) for i in range(m) for j in range(m) if i != j) / (m * (m - 1))
    xy = sum(k(x[i], y[j]) for i in range(n) for j in range(m)) / (n * m)
    return xx + yy - 2 * xy


def test_mmd_equals_naive_double_loop_and_median_heuristic():
    g = gen(0)
    x = torch.randn(7, 3, generator=g, dtype=F64)
    y = torch.randn(5, 3, generator=g, dtype=F64) + 0.3
    out = mmd(x, y, bandwidth=0.8, num_permutations=0)
    assert float(out["statistic"]) == pytest.approx(naive_mmd(x, y, 0.8), abs=1e-12)
    assert torch.isnan(out["p_value"])
    pooled = torch.cat([x, y])
    dist = torch.pdist(pooled)
    out = mmd(x, y, num_permutations=0)
    assert float(out["bandwidth"]) == pytest.approx(float(dist.median()), abs=1e-12)
    assert float(out["statistic"]) == pytest.approx(naive_mmd(x, y, float(dist.median())))


def test_mmd_unbiased_for_the_gaussian_closed_form():
    # E MMD^2_u = E k(X,X') + E k(Y,Y') - 2 E k(X,Y): closed form for diagonal Gaussians.
    g, reps, n, m, ell = gen(1), 400, 40, 30, 1.3
    mean1, var1 = torch.tensor([0.0, 0.0], dtype=F64), torch.tensor([1.0, 1.0], dtype=F64)
    mean2, var2 = torch.tensor([0.6, 0.0], dtype=F64), torch.tensor([1.5, 0.7], dtype=F64)
    x = mean1 + var1.sqrt() * torch.randn(reps, n, 2, generator=g, dtype=F64)
    y = mean2 + var2.sqrt() * torch.randn(reps, m, 2, generator=g, dtype=F64)
    stats = mmd(x, y, bandwidth=ell, num_permutations=0)["statistic"]
    closed = (
        gaussian_expected_kernel(mean1, var1, mean1, var1, ell)
        + gaussian_expected_kernel(mean2, var2, mean2, var2, ell)
        - 2 * gaussian_expected_kernel(mean1, var1, mean2, var2, ell)
    )
    assert closed > 0.02  # the two Gaussians differ visibly
    assert abs(float(stats.mean() - closed)) < 4 * float(stats.std()) / reps**0.5
    same = mmd(x, mean1 + torch.randn(reps, m, 2, generator=g, dtype=F64), bandwidth=ell,
               num_permutations=0)["statistic"]
    assert abs(float(same.mean())) < 4 * float(same.std()) / reps**0.5  # unbiased at zero


def test_mmd_permutation_statistics_equal_relabelled_sets():
    g = gen(2)
    x, y = torch.randn(6, 2, generator=g, dtype=F64), torch.randn(4, 2, generator=g, dtype=F64)
    pooled = torch.cat([x, y])
    gram = torch.exp(-torch.cdist(pooled, pooled) ** 2 / 2).fill_diagonal_(0.0)
    perms = torch.stack([torch.randperm(10, generator=g) for _ in range(5)])
    membership = torch.zeros(5, 10, dtype=F64).scatter_(1, perms[:, :6], 1.0).T
    draws = _mmd_from_gram(gram, membership, 6, 4)
    for b in range(5):
        relabelled = mmd(pooled[perms[b, :6]], pooled[perms[b, 6:]], bandwidth=1.0,
                         num_permutations=0)["statistic"]
        assert float(draws[b]) == pytest.approx(float(relabelled), abs=1e-12)


def test_mmd_level_on_identical_distributions():
    g = gen(3)
    x = torch.randn(200, 40, 2, generator=g)
    y = torch.randn(200, 40, 2, generator=g)
    p = mmd(x, y, num_permutations=200, generator=g)["p_value"]
    rate, ecdf_excess = rejection_summary(p)
    assert 0.01 <= rate <= 0.10
    assert ecdf_excess < 0.1
    assert p.min() >= 1 / 201  # p = (1 + #) / (1 + P) is never 0


def test_mmd_detects_variance_x2_at_n_1000():
    g = gen(4)
    y = torch.randn(3, 1000, 2, generator=g)
    x = 2**0.5 * torch.randn(3, 1000, 2, generator=g)  # variance x2
    out = mmd(x, y, num_permutations=200, generator=g)
    assert bool((out["p_value"] <= 0.05).all())
    assert bool((out["statistic"] > 0).all())


def test_mmd_is_differentiable_in_the_samples():
    g = gen(5)
    x = torch.randn(5, 2, generator=g, dtype=F64, requires_grad=True)
    y = torch.randn(4, 2, generator=g, dtype=F64)
    assert torch.autograd.gradcheck(
        lambda a: mmd(a, y, bandwidth=0.9, num_permutations=3, generator=gen(0))["statistic"],
        (x,),
    )


# -- Frechet distance -----------------------------------------------------------------
def scipy_frechet(m1, c1, m2, c2):
    root = scipy.linalg.sqrtm(c1 @ c2)
    return float(((m1 - m2) ** 2).sum() + np.trace(c1 + c2 - 2 * np.real(root)))


def test_frechet_closed_forms():
    # 1-D: (mu1 - mu2)^2 + (sigma1 - sigma2)^2
    d = frechet_distance_from_moments(torch.tensor([1.0]), torch.tensor([[4.0]]),
                                      torch.tensor([-0.5]), torch.tensor([[0.25]]))
    assert float(d) == pytest.approx(1.5**2 + 1.5**2, abs=1e-12)
    # commuting covariances: sum of (sqrt(l1) - sqrt(l2))^2 over eigenvalues
    q = torch.linalg.qr(torch.randn(3, 3, generator=gen(6), dtype=F64))[0]
    l1, l2 = torch.tensor([1.0, 2.0, 5.0], dtype=F64), torch.tensor([3.0, 0.5, 5.0], dtype=F64)
    c1, c2 = q @ torch.diag(l1) @ q.T, q @ torch.diag(l2) @ q.T
    zero = torch.zeros(3, dtype=F64)
    expected = float(((l1.sqrt() - l2.sqrt()) ** 2).sum())
    assert float(frechet_distance_from_moments(zero, c1, zero, c2)) == pytest.approx(expected,
                                                                                   abs=1e-10)
    # general covariances: against scipy's sqrtm of the product, and symmetric
    rng = np.random.default_rng(0)
    a, b = rng.normal(size=(4, 4)), rng.normal(size=(4, 4))
    c1, c2 = a @ a.T + 0.1 * np.eye(4), b @ b.T + 0.1 * np.eye(4)
    m1, m2 = rng.normal(size=4), rng.normal(size=4)
    ours = frechet_distance_from_moments(*map(torch.tensor, (m1, c1, m2, c2)))
    swapped = frechet_distance_from_moments(*map(torch.tensor, (m2, c2, m1, c1)))
    assert float(ours) == pytest.approx(scipy_frechet(m1, c1, m2, c2), rel=1e-9)
    assert float(swapped) == pytest.approx(float(ours), rel=1e-9)


def test_frechet_of_samples_uses_the_unbiased_gaussian_fit():
    g = gen(7)
    x = torch.randn(300, 3, generator=g, dtype=F64) @ torch.randn(3, 3, generator=g, dtype=F64)
    y = torch.randn(200, 3, generator=g, dtype=F64) + 1.0
    expected = scipy_frechet(x.mean(0).numpy(), np.cov(x.T.numpy()),
                             y.mean(0).numpy(), np.cov(y.T.numpy()))
    assert float(frechet_distance(x, y)) == pytest.approx(expected, rel=1e-8)
    assert float(frechet_distance(x, x)) == pytest.approx(0.0, abs=1e-8)


# -- density and coverage -------------------------------------------------------------
def test_density_coverage_equal_naive_definition():
    g = gen(8)
    real = torch.randn(30, 2, generator=g, dtype=F64)
    fake = torch.randn(25, 2, generator=g, dtype=F64) * 0.7
    k = 3
    dist = torch.cdist(real, real)
    radii = torch.sort(dist, 1).values[:, k]  # column 0 is the point itself
    inside = torch.cdist(fake, real) < radii
    out = density_coverage(fake, real, k=k)
    assert float(out["density"]) == pytest.approx(float(inside.sum()) / (k * 25))
    assert float(out["coverage"]) == pytest.approx(float(inside.any(0).double().mean()))


def test_density_coverage_expectations_on_one_distribution():
    # E density = 1; E coverage = 1 - prod_{j=1..k} (m - j) / (m - j + n) (Naeem et al.).
    g, reps, n, m, k = gen(9), 300, 60, 80, 5
    out = density_coverage(torch.randn(reps, n, 3, generator=g, dtype=F64),
                           torch.randn(reps, m, 3, generator=g, dtype=F64), k=k)
    expected_cov = 1 - math.prod((m - j) / (m - j + n) for j in range(1, k + 1))
    for key, expected in (("density", 1.0), ("coverage", expected_cov)):
        values = out[key]
        assert abs(float(values.mean()) - expected) < 4 * float(values.std()) / reps**0.5, key


def test_density_coverage_see_narrow_and_wide_samples():
    g = gen(10)
    real = torch.randn(2000, 2, generator=g)
    same = density_coverage(torch.randn(2000, 2, generator=g), real)
    narrow = density_coverage(0.5 * torch.randn(2000, 2, generator=g), real)
    wide = density_coverage(3.0 * torch.randn(2000, 2, generator=g), real)
    # too narrow: still inside the support (density ~ 1), but the tails are missed
    assert float(narrow["coverage"]) < 0.75 < 0.95 < float(same["coverage"])
    assert 0.8 < float(narrow["density"]) < 1.5
    # too wide: many samples outside the support
    assert float(wide["density"]) < 0.5 < 0.9 < float(same["density"])


# -- Vendi score ----------------------------------------------------------------------
ORDERS = (0.0, 0.5, 1.0, 2.0, math.inf)


@pytest.mark.parametrize("q", ORDERS)
def test_vendi_identical_points_and_separated_clusters(q):
    assert float(vendi_score(torch.ones(40, 3, dtype=F64), 1.0, q=q)) == pytest.approx(1.0)
    g = gen(11)
    centers = 100.0 * torch.randn(4, 2, generator=g, dtype=F64)
    clusters = centers.repeat_interleave(25, 0)
    assert float(vendi_score(clusters, 1.0, q=q)) == pytest.approx(4.0, rel=1e-9)
    if q >= 1:  # tight, not identical, clusters: about k (small q also counts the jitter)
        jitter = 1e-2 * torch.randn(100, 2, generator=g, dtype=F64)
        assert float(vendi_score(clusters + jitter, 1.0, q=q)) == pytest.approx(4.0, abs=0.01)


def test_vendi_orders_on_unequal_clusters_closed_form():
    # two separated clusters of sizes 30 and 10: eigenvalues 3/4 and 1/4
    points = torch.cat([torch.zeros(30, 2), torch.full((10, 2), 50.0)]).double()
    lam = torch.tensor([0.75, 0.25], dtype=F64)
    expected = {
        1.0: math.exp(float(-(lam * lam.log()).sum())),
        2.0: 1 / float((lam**2).sum()),
        0.5: float(lam.sqrt().sum()) ** 2,
        math.inf: 1 / 0.75,
        0.0: 2.0,
    }
    for q, value in expected.items():
        assert float(vendi_score(points, 1.0, q=q)) == pytest.approx(value, rel=1e-9), q


def test_vendi_matches_numpy_eigenvalues_and_decreases_with_q():
    rng = np.random.default_rng(1)
    points = rng.normal(size=(50, 3))
    gram = np.exp(-((points[:, None] - points[None]) ** 2).sum(-1) / (2 * 0.7**2))
    lam = np.clip(np.linalg.eigvalsh(gram / 50), 0, None)
    lam = lam[lam > 0]
    expected = np.exp(-(lam * np.log(lam)).sum())
    tensor = torch.tensor(points)
    assert float(vendi_score(tensor, 0.7)) == pytest.approx(expected, rel=1e-8)
    scores = [float(vendi_score(tensor, 0.7, q=q)) for q in (0.5, 1.0, 2.0, math.inf)]
    assert scores == sorted(scores, reverse=True)
    batched = vendi_score(torch.stack([tensor, 0.01 * tensor]), 0.7)  # shrunk: less diverse
    assert float(batched[0]) == pytest.approx(expected, rel=1e-8)
    assert 1.0 < float(batched[1]) < float(batched[0])


# -- compare_to_reference -------------------------------------------------------------
def test_compare_to_reference_scores_per_observation():
    toy, g = GaussianToy(dim=2), gen(12)
    x_o = toy.sample(2, g)[1]
    reference = toy.posterior()(x_o).sample((300,))
    torch.manual_seed(0)
    exact = compare_to_reference(draws(toy.posterior(), x_o, 300), reference, generator=g)
    wide = compare_to_reference(draws(toy.posterior(variance_scale=2.0), x_o, 300), reference,
                                generator=g)
    assert all(v.shape == (2,) for v in exact.values())
    assert bool((wide["mmd_p_value"] <= 0.05).all())
    assert bool((wide["frechet_distance"] > exact["frechet_distance"]).all())
    assert bool((wide["vendi"] > wide["reference_vendi"]).all())
    assert bool((wide["density"] < exact["density"]).all())
    samples = toy.posterior()(x_o).sample((300,))
    given = compare_to_reference(samples, reference, num_permutations=0, vendi=False)
    one = mmd(samples[:, 1], reference[:, 1], num_permutations=0)["statistic"]
    assert float(given["mmd"][1]) == pytest.approx(float(one))


# -- streaming metrics ----------------------------------------------------------------
def test_frechet_metric_streams_exactly_and_keeps_the_reference():
    g = gen(13)
    x = torch.randn(4, 500, 3, generator=g, dtype=F64) + 2.0  # batch of K = 4 observations
    y = torch.randn(4, 300, 3, generator=g, dtype=F64)
    metric = FrechetDistance(dim=3, batch_shape=(4,), reset_reference=False)
    metric.update(reference=y)
    for chunk in x.split(100, dim=1):
        metric.update(samples=chunk)
    expected = frechet_distance(x, y)
    assert torch.allclose(metric.compute().frechet_distance, expected, rtol=1e-9)
    metric.reset()
    metric.update(samples=x)  # the reference survived reset
    assert torch.allclose(metric.compute().frechet_distance, expected, rtol=1e-9)


def test_density_coverage_metric_streams_exactly():
    g = gen(14)
    real, fake = torch.randn(300, 2, generator=g), 0.8 * torch.randn(700, 2, generator=g)
    metric = DensityCoverage(real, k=4, block_size=64)
    for chunk in fake.split(150):
        metric.update(chunk)
    out, expected = metric.compute(), density_coverage(fake, real, k=4)
    for key in ("density", "coverage"):
        assert float(getattr(out, key)) == pytest.approx(float(expected[key]))


@pytest.mark.forks
def test_sample_metrics_under_ddp_equal_one_process():
    g = gen(15)
    real, fake = torch.randn(200, 2, generator=g), 1.3 * torch.randn(400, 2, generator=g)

    def fn(rank, world_size):
        frechet, dc = FrechetDistance(dim=2), DensityCoverage(real)
        shard = fake[rank::world_size]
        frechet.update(samples=shard, reference=real[rank::world_size])
        dc.update(shard)
        return frechet.compute().frechet_distance, dc.compute()

    results = run_distributed(fn, world_size=2)
    expected = density_coverage(fake, real)
    for frechet, dc in results:
        assert float(frechet) == pytest.approx(float(frechet_distance(fake, real)), rel=1e-6)
        assert float(dc.density) == pytest.approx(float(expected["density"]))
        assert float(dc.coverage) == pytest.approx(float(expected["coverage"]))


# -- bad input ------------------------------------------------------------------------
@pytest.mark.filterwarnings("ignore:The ``compute`` method")
def test_bad_input_raises_value_errors_naming_the_argument():
    x, y = torch.randn(10, 2), torch.randn(12, 2)
    nan = x.clone()
    nan[3, 1] = float("nan")
    cases = [
        (lambda: mmd(nan, y), "samples must be finite"),
        (lambda: mmd(x, torch.randn(12, 3)), r"reference must have shape \(\*, N, 2\)"),
        (lambda: mmd(x[:1], y), "samples must have at least 2"),
        (lambda: mmd(x, y.double()), "reference must have the same dtype"),
        (lambda: mmd(x.expand(2, 10, 2), y), "reference must have the batch shape"),
        (lambda: mmd(x, y, num_permutations=-1), "num_permutations must be a positive"),
        (lambda: mmd(x, y, bandwidth=0.0), "bandwidth must be a positive"),
        (lambda: mmd(x[0], y), r"samples must have shape \(\*, N, D\)"),
        (lambda: frechet_distance(x, y[:1]), "reference must have at least 2"),
        (lambda: density_coverage(x, y, k=12), "reference must have at least 13"),
        (lambda: density_coverage(x, y, k=0), "k must be a positive integer"),
        (lambda: vendi_score(x, -1.0), "bandwidth must be a positive"),
        (lambda: vendi_score(x, 1.0, q=-0.5), r"q must be a number in \[0, inf\]"),
        (lambda: vendi_score(x.long(), 1.0), "samples must have a floating dtype"),
        (lambda: FrechetDistance(dim=3).update(samples=x), r"samples must have shape \(\*, N, 3\)"),
        (lambda: FrechetDistance(dim=2).update(), "update needs samples or reference"),
        (lambda: FrechetDistance(dim=2, batch_shape=(3,)).update(samples=x), "batch_shape"),
        (lambda: DensityCoverage(y, k=3).update(torch.randn(5, 3)), r"samples must have shape"),
        (lambda: DensityCoverage(y).compute(), r"needs at least n >= 2 samples, got n = 0"),
        (lambda: compare_to_reference(torch.randn(5, 12, 2), torch.randn(5, 3, 2)),
         r"samples must have shape \(S, 3, 2\) like reference_samples"),
        (lambda: compare_to_reference(torch.randn(5, 12, 2), y),
         r"reference_samples must have shape \(S_ref, O, D\)"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError, match=message):
            call()
    metric = FrechetDistance(dim=2)
    metric.update(samples=x)
    with pytest.raises(ValueError, match="needs at least 2 reference points"):
        metric.compute()
