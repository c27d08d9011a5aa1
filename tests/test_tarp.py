"""TARP: ranks, exact null draws, level and power of the test, the streaming metric, the plot."""

import pytest
import torch
from matplotlib.figure import Figure
from scipy import stats

import calib_lightning as cl
from calib_lightning._distributed import canonical_order
from calib_lightning.evaluation import draws
from calib_lightning.functional import (
    expected_coverage,
    tarp,
    tarp_counts,
    tarp_fit_scale,
    tarp_ranks,
    tarp_references,
    tarp_test,
    uniform_multinomial,
)
from calib_lightning.functional.tarp import _ks_coverage_error, tarp_fit_points
from calib_lightning.metrics import TARP
from calib_lightning.metrics.tarp import _null_seed
from calib_lightning.plots import plot_tarp
from calib_lightning.tasks import GaussianToy
from calib_lightning.testing import run_distributed

F64 = torch.float64


def gen(seed):
    return torch.Generator().manual_seed(seed)


def toy_datasets(reps, n, num_posterior_samples, seed, variance_scale=1.0, shift=0.0, dim=2,
                 box_on_theta=False):
    """``reps`` GaussianToy datasets at once: theta (reps, n, D), samples (S, reps, n, D),
    ranked as ``TARP`` does by default (box and scale on fit points); ``box_on_theta``:
    the construction it replaced. Returns the rank histograms ``(reps, S + 1)``."""
    g = gen(seed)
    toy = GaussianToy(dim=dim)
    theta = torch.randn(reps, n, dim, generator=g)
    x = theta + toy.noise_std * torch.randn(reps, n, dim, generator=g)
    post_std = (toy.weight * toy.noise_std**2 * variance_scale) ** 0.5
    eps = torch.randn(num_posterior_samples, reps, n, dim, generator=g)
    samples = toy.weight * x + shift + post_std * eps
    fit = theta if box_on_theta else tarp_fit_points(samples, theta, generator=g)
    references = tarp_references(fit, generator=g)
    ranks = tarp_ranks(samples, theta, references, scale=tarp_fit_scale(fit))
    return tarp_counts(ranks, num_posterior_samples), g


def test_ranks_equal_naive_definition():
    g = gen(0)
    samples = torch.randn(9, 6, 3, generator=g, dtype=F64)
    theta, refs = torch.randn(6, 3, generator=g, dtype=F64), torch.randn(6, 3, generator=g,
                                                                          dtype=F64)
    scale = torch.tensor([1.0, 2.0, 0.5], dtype=F64)
    for distance, p in (("l2", 2), ("l1", 1)):
        ranks = tarp_ranks(samples, theta, refs, scale=scale, distance=distance)
        for i in range(6):
            d_true = torch.linalg.vector_norm((theta[i] - refs[i]) / scale, ord=p)
            d_samples = torch.linalg.vector_norm((samples[:, i] - refs[i]) / scale, ord=p, dim=-1)
            assert int(ranks[i]) == int((d_samples < d_true).sum())


def test_references_lie_in_the_box_of_the_parameters():
    theta = torch.tensor([[0.0, -3.0], [2.0, 5.0], [1.0, 0.0]])
    refs = tarp_references(theta, 10_000, generator=gen(1))
    assert refs.shape == (10_000, 2)
    assert bool((refs.amin(0) >= theta.amin(0)).all() and (refs.amax(0) <= theta.amax(0)).all())
    assert torch.allclose(refs.mean(0), (theta.amin(0) + theta.amax(0)) / 2, atol=0.1)


@pytest.mark.parametrize("cells", [7, 150], ids=["binary-splitting", "indices"])
def test_uniform_multinomial_has_multinomial_moments(cells):
    total = torch.tensor([1000.0, 37.0])
    draws = uniform_multinomial(total, cells, 40_000, gen(2))
    assert draws.shape == (2, 40_000, cells)
    assert torch.equal(draws.sum(-1), total[:, None].expand(2, 40_000).double())
    p = 1 / cells
    off_diagonal = ~torch.eye(cells, dtype=torch.bool)
    for row, n in enumerate(total.tolist()):
        cov = torch.cov(draws[row].T)
        assert torch.allclose(draws[row].mean(0), torch.full((cells,), n * p, dtype=F64),
                              rtol=0.05)
        assert float(cov.diagonal().mean()) == pytest.approx(n * p * (1 - p), rel=0.02)
        assert float(cov[off_diagonal].mean()) == pytest.approx(-n * p * p, rel=0.05)


def test_statistic_coverage_error_and_curve_are_exact_for_the_step_function():
    counts = torch.tensor([[3, 0, 5, 1, 1], [0, 0, 10, 0, 0]])
    statistic, error = _ks_coverage_error(counts)
    grid = torch.linspace(0, 1, 200_001, dtype=F64)
    coverage = expected_coverage(counts, grid)
    assert torch.allclose(coverage[:, 0], torch.zeros(2, dtype=F64))
    assert torch.allclose(coverage[:, -1], torch.ones(2, dtype=F64))
    dev = (coverage - grid).abs().amax(-1)
    assert bool((statistic >= dev - 1e-12).all())
    assert torch.allclose(statistic, dev, atol=1e-4)
    upper = grid >= 0.5
    area = torch.trapezoid(coverage[:, upper] - grid[upper], grid[upper])
    assert torch.allclose(error, area, atol=1e-4)
    # a histogram concentrated on the middle rank: all c_i = 1/2
    assert float(statistic[1]) == pytest.approx(0.5)
    assert float(error[1]) == pytest.approx(0.5 * 1 - 0.375)


def test_level_holds_over_many_datasets():
    counts, g = toy_datasets(reps=300, n=1000, num_posterior_samples=30, seed=3)
    out = tarp_test(counts, num_null=400, generator=g)
    p = torch.sort(out.p_value).values
    rate = float((p <= 0.05).double().mean())
    grid = torch.linspace(0, 1, 101, dtype=F64)
    excess = float(((p[None] <= grid[:, None]).double().mean(1) - grid).max())
    assert 0.01 <= rate <= 0.10
    assert excess < 0.1
    assert abs(float(out.coverage_error.mean())) < 0.003


@pytest.mark.parametrize(("dim", "n"), [(20, 40), (50, 100)])
def test_ranks_stay_uniform_at_high_dimension_where_a_box_on_theta_bends_them(dim, n):
    """The mechanism of issue 22: a box fitted on the tested theta puts every reference on
    one side of the theta that are a coordinate's extreme (2 D of the N pairs), which
    bends their ranks. Pooled over 400 datasets, the default's ranks are uniform (exact),
    the old construction's are not."""
    pooled = {}
    for box_on_theta in (False, True):
        counts, _ = toy_datasets(reps=400, n=n, num_posterior_samples=9, seed=dim,
                                 dim=dim, box_on_theta=box_on_theta)  # fmt: skip
        total = counts.sum(0).double()
        chi2 = float(((total - total.mean()) ** 2 / total.mean()).sum())
        pooled[box_on_theta] = stats.chi2.sf(chi2, df=total.numel() - 1)
    assert pooled[False] > 1e-3
    assert pooled[True] < 1e-6


@pytest.mark.parametrize(("dim", "n"), [(20, 50), (50, 100)])
def test_level_holds_at_high_dimension(dim, n):
    """1,000 fresh datasets with the default construction (2 D / N of the pairs are a
    coordinate's extreme, as many as at N = 500 for D = 250): the rejection rate lies in
    the 99 % binomial band [0.035, 0.067] (it detects 0.068, the rate the box on theta
    gave at D = 20), and the p-values are uniform."""
    counts, g = toy_datasets(reps=1000, n=n, num_posterior_samples=20, seed=100 + dim, dim=dim)
    p = tarp_test(counts, num_null=500, generator=g).p_value
    low, high = (stats.binom.ppf(q, 1000, 0.05) / 1000 for q in (0.005, 0.995))
    assert low <= float((p <= 0.05).double().mean()) <= high
    assert stats.kstest(p.numpy(), "uniform").pvalue > 1e-3


@pytest.mark.parametrize("dim", [20, 50])
def test_metric_with_default_arguments_holds_its_level_and_detects_dispersion(dim):
    """The public class, default arguments and seed, on fresh datasets of N = 100 pairs:
    no gross excess under H0 (30 datasets: the rate is measured with 1,000 in
    ``test_level_holds_at_high_dimension`` on the same construction, which
    ``test_metric_streams_exactly_and_equals_the_functional_core`` ties to this class);
    a posterior 30 % too narrow or too wide is rejected with the documented sign."""
    toy, g = GaussianToy(dim=dim), gen(200 + dim)
    torch.manual_seed(dim)
    p = []
    for _ in range(30):
        theta, x = toy.sample(100, g)
        metric = cl.TARP()
        metric.update(toy.posterior(), theta, x)
        p.append(float(metric.compute().p_value))
    p = torch.tensor(p)
    assert float((p <= 0.05).double().mean()) <= 0.2  # 99.9 % of Binomial(30, 0.05)
    assert stats.kstest(p.numpy(), "uniform").pvalue > 1e-3
    theta, x = toy.sample(500, g)
    for variance_scale, sign in ((0.7, -1), (1.3, 1)):
        metric = cl.TARP()
        metric.update(toy.posterior(variance_scale=variance_scale), theta, x)
        out = metric.compute()
        assert float(out.p_value) <= 0.05
        assert float(torch.sign(out.coverage_error)) == sign


def test_fit_points_are_one_of_each_pairs_values_picked_uniformly():
    samples = torch.arange(4 * 3 * 2, dtype=F64).reshape(4, 3, 2) + 1.0
    theta = -torch.arange(3 * 2, dtype=F64).reshape(3, 2) - 1.0
    fit = tarp_fit_points(samples.expand(4, 3, 2).unsqueeze(1).expand(4, 10_000, 3, 2),
                          theta.expand(10_000, 3, 2), generator=gen(12))  # fmt: skip
    values = torch.cat([theta[None], samples])  # (S + 1, N, D)
    match = (fit[None] == values[:, None]).all(-1)  # (S + 1, reps, N): which value was picked
    assert bool((match.sum(0) == 1).all())  # a whole row of one value, never a mix
    frequency = match.double().mean(1)  # (S + 1, N)
    assert torch.allclose(frequency, torch.full_like(frequency, 0.2), atol=0.015)


@pytest.mark.parametrize(
    ("variance_scale", "shift", "error_sign"),
    [(2.0, 0.0, 1), (0.5, 0.0, -1), (1.0, 0.5, 0)],
    ids=["variance-x2", "variance-x0.5", "shifted"],
)
def test_power_at_n_1000_with_the_documented_error_sign(variance_scale, shift, error_sign):
    counts, g = toy_datasets(reps=20, n=1000, num_posterior_samples=100, seed=4,
                             variance_scale=variance_scale, shift=shift)
    out = tarp_test(counts, num_null=200, generator=g)
    assert float((out.p_value <= 0.05).double().mean()) >= 0.95
    assert bool((out.statistic > out.band).all())  # the curve leaves the band
    if error_sign:
        assert bool((torch.sign(out.coverage_error) == error_sign).all())


def test_functional_tarp_on_drawn_samples_equals_given_samples():
    toy, g = GaussianToy(dim=3), gen(5)
    theta, x = toy.sample(300, g)
    refs = tarp_references(theta, generator=g)
    torch.manual_seed(0)
    drawn = tarp(draws(toy.posterior(), x, 50, chunk_size=64), theta, references=refs,
                 generator=gen(6))  # fmt: skip
    torch.manual_seed(0)
    samples = torch.cat([toy.posterior()(x[s : s + 64]).sample((50,)) for s in range(0, 300, 64)],
                        1)
    given = tarp(samples, theta, references=refs, generator=gen(6))
    for key in ("statistic", "p_value", "coverage_error", "coverage"):
        assert torch.equal(getattr(drawn, key), getattr(given, key))
    assert int(given.num_pairs) == 300


def test_metric_streams_exactly_and_equals_the_functional_core():
    toy, g = GaussianToy(dim=2), gen(7)
    theta, x = toy.sample(400, g)
    samples = toy.posterior(variance_scale=1.5)(x).sample((40,))
    bounds = (theta.amin(0), theta.amax(0))
    scale = theta.std(0)
    one = TARP(num_posterior_samples=40, scale=scale, reference_bounds=bounds, seed=3)
    one.update(samples, theta, x)
    many = TARP(num_posterior_samples=40, scale=scale, reference_bounds=bounds, seed=3)
    for s in range(0, 400, 75):
        many.update(samples[:, s : s + 75], theta[s : s + 75], x[s : s + 75])
    assert torch.equal(one.counts, many.counts)
    # the references are uniform on the box, drawn from the metric's seeded stream
    u = torch.rand(400, 2, generator=torch.Generator().manual_seed(3 + 7919), dtype=F64)
    refs = (bounds[0].double() + (bounds[1] - bounds[0]).double() * u).float()
    expected = tarp_counts(tarp_ranks(samples, theta, refs, scale=scale), 40)
    assert torch.equal(one.counts, expected)
    out = one.compute()
    assert torch.equal(out.statistic, tarp_test(expected, generator=gen(4)).statistic)
    # fitted coordinates: the scale and box of the fit points of the pairs updated before
    # the first compute (picked in a canonical order of the pairs, from seed + 3)
    fitted = TARP(num_posterior_samples=40)
    fitted.update(samples[:, :150], theta[:150], x[:150])
    fitted.update(samples[:, 150:], theta[150:], x[150:])
    out = fitted.compute()
    order = canonical_order(theta.double() + samples.double().sum(0))  # symmetric per pair
    fit = tarp_fit_points(samples[:, order], theta[order], generator=gen(3))
    torch.testing.assert_close(fitted.scale.float(), tarp_fit_scale(fit), rtol=1e-6, atol=0)
    assert torch.equal(fitted.low.float(), fit.amin(0))
    assert torch.equal(fitted.high.float(), fit.amax(0))
    u = torch.rand(400, 2, generator=gen(2), dtype=F64)
    refs = (fitted.low + (fitted.high - fitted.low) * u).float()
    expected = tarp_counts(tarp_ranks(samples[:, order], theta[order], refs,
                                      scale=fitted.scale.float()), 40)  # fmt: skip
    assert torch.equal(out.coverage, expected_coverage(expected, out.credibility))
    again = tarp_test(expected, generator=gen(_null_seed(0, expected)))
    assert torch.equal(out.p_value, again.p_value)
    fitted.reset()
    assert fitted.scale.numel() == 2
    assert int(fitted.counts.sum()) == 0


@pytest.mark.forks
def test_metric_under_ddp_equals_one_process():
    toy = GaussianToy(dim=2)
    theta, x = toy.sample(600, gen(8))
    samples = toy.posterior(variance_scale=2.0)(x).sample((50,))

    def fn(rank, world_size):
        metric = TARP(num_posterior_samples=50, num_null=300)
        rows = slice(rank * 300, (rank + 1) * 300)
        metric.update(samples[:, rows], theta[rows], x[rows])
        return metric.compute(), metric.scale, metric.low, metric.high

    results = run_distributed(fn, world_size=2)
    # the coordinates are fitted in compute on the pairs of both processes, whose ranks
    # use references drawn in a canonical order: one process fed everything agrees
    single = TARP(num_posterior_samples=50, num_null=300)
    for rows in (slice(0, 100), slice(100, 600)):
        single.update(samples[:, rows], theta[rows], x[rows])
    expected = single.compute()
    for out, scale, low, high in results:
        for key in ("statistic", "p_value", "coverage_error", "coverage", "num_pairs"):
            assert torch.equal(getattr(out, key), getattr(expected, key)), key
        for got, want in ((scale, single.scale), (low, single.low), (high, single.high)):
            assert torch.equal(got, want)
    assert float(expected.p_value) <= 0.05
    assert float(expected.coverage_error) > 0


def _updated(metric, posterior, theta, x):
    metric.update(posterior, theta, x)
    return metric


def test_figure_shows_the_curve_and_band():
    counts, g = toy_datasets(reps=1, n=500, num_posterior_samples=50, seed=9, variance_scale=2.0)
    out = tarp_test(counts, num_null=100, generator=g)
    out = out.apply(lambda v: v[0] if v.ndim and v is not out.credibility else v)
    fig = plot_tarp(out)
    assert isinstance(fig, Figure)
    (ax,) = fig.axes
    assert ax.get_xlabel().startswith("credibility level")
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert "conservative (too wide)" in labels
    assert "expected coverage" in labels
    with pytest.raises(ValueError, match="one curve"):
        plot_tarp(tarp_test(torch.cat([counts, counts]), num_null=10))
    with pytest.raises(ValueError, match="must be a TARPResult"):
        plot_tarp({"credibility": out.credibility, "coverage": out.coverage})


@pytest.mark.filterwarnings("ignore:The ``compute`` method")
def test_bad_input_raises_value_errors_naming_the_argument():
    toy = GaussianToy(dim=2)
    theta, x = toy.sample(10, gen(10))
    samples = torch.randn(5, 10, 2)
    nan = theta.clone()
    nan[2, 0] = float("nan")
    cases = [
        (lambda: tarp_ranks(samples[:, :9], theta, theta), r"samples must have shape \(S, 10, 2\)"),
        (lambda: tarp_ranks(samples, theta, theta[:9]), "references must have the shape"),
        (lambda: tarp_ranks(samples, theta, theta, distance="cos"), "distance must be one of"),
        (lambda: tarp_counts(torch.tensor([0, 6]), 5), r"ranks must lie in \[0, 5\]"),
        (lambda: tarp_test(torch.zeros(4, dtype=torch.long)), "at least one calibration pair"),
        (lambda: tarp_test(torch.ones(4), level=1.5), r"level must lie in \(0, 1\)"),
        (lambda: tarp_test(torch.ones(4), num_null=0), "num_null must be a positive integer"),
        (lambda: tarp(samples, nan), "theta must be finite"),
        (lambda: tarp(samples[:, :1], theta[:1]), "theta must have at least 2 rows"),
        (lambda: TARP().update(toy.posterior(), theta, x[:9]), "x must have the same number"),
        (lambda: tarp(samples[:, :, :1], theta), r"samples must have shape"),
        (lambda: tarp(samples, theta, scale=torch.ones(3)), r"scale must be a tensor"),
        (lambda: tarp(samples, theta, references=theta[:, :1]), "references must"),
        (lambda: TARP(num_posterior_samples=0), "num_posterior_samples must be a positive"),
        (lambda: TARP(scale=-torch.ones(2)), "scale must be a positive tensor"),
        (lambda: TARP(reference_bounds=(torch.ones(2), torch.zeros(2))), "low <= high"),
        (lambda: TARP(num_posterior_samples=5).update(samples[:4], theta, x),
         r"posterior samples must have shape \(5, 10, 2\)"),
        (lambda: _updated(TARP(), toy.posterior(), theta[:1], x[:1]).compute(),
         "needs N >= 2 pairs"),
        (lambda: TARP().compute(), "needs at least one update"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError, match=message):
            call()
    metric = TARP(num_posterior_samples=5)
    metric.update(samples, theta, x)
    with pytest.raises(ValueError, match="theta must have D = 2 columns"):
        metric.update(torch.randn(5, 10, 3), torch.randn(10, 3), x)
    bad = samples.clone()
    bad[0, 3, 1] = float("inf")
    with pytest.raises(ValueError, match="posterior samples must be finite"):
        metric.update(bad, theta, x)
