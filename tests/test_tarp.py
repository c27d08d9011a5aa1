"""TARP: ranks, exact null draws, level and power of the test, the streaming metric, the plot."""

import pytest
import torch
from matplotlib.figure import Figure
from scipy import stats
from torchmetrics.utilities.data import dim_zero_cat

import calib_lightning as cl
from calib_lightning._utils.distributed import canonical_order
from calib_lightning.evaluation import draws
from calib_lightning.functional import (
    expected_coverage,
    pooled_values,
    tarp,
    tarp_box,
    tarp_counts,
    tarp_fit_scale,
    tarp_permutation_test,
    tarp_rank_table,
    tarp_ranks,
    tarp_references,
    tarp_test,
    uniform_multinomial,
)
from calib_lightning.functional.tarp import _ks_coverage_error
from calib_lightning.metrics import TARP
from calib_lightning.metrics.tarp import _null_seed
from calib_lightning.plots import plot_tarp
from calib_lightning.tasks import GaussianToy
from calib_lightning.testing import run_distributed

F64 = torch.float64


def gen(seed):
    return torch.Generator().manual_seed(seed)


def toy_samples(reps, n, num_posterior_samples, seed, variance_scale=1.0, shift=0.0, dim=2):
    """``reps`` GaussianToy datasets at once: theta ``(reps, n, D)``, samples
    ``(S, reps, n, D)`` and a generator."""
    g = gen(seed)
    toy = GaussianToy(dim=dim)
    theta = torch.randn(reps, n, dim, generator=g)
    x = theta + toy.noise_std * torch.randn(reps, n, dim, generator=g)
    post_std = (toy.weight * toy.noise_std**2 * variance_scale) ** 0.5
    eps = torch.randn(num_posterior_samples, reps, n, dim, generator=g)
    return theta, toy.weight * x + shift + post_std * eps, g


def toy_datasets(reps, n, num_posterior_samples, seed, variance_scale=1.0, shift=0.0, dim=2):
    """Rank histograms ``(reps, S + 1)`` of one reference set per dataset, drawn in a box and
    a scale fitted on an independent draw of the joint (exact for the multinomial test)."""
    theta, samples, g = toy_samples(reps, n, num_posterior_samples, seed, variance_scale,
                                    shift, dim)  # fmt: skip
    fresh = torch.randn(reps, n, dim, generator=g)  # independent of the tested pairs
    low, high = fresh.amin(1), fresh.amax(1)  # (reps, D)
    u = torch.rand(reps, n, dim, generator=g)
    references = low.unsqueeze(1) + (high - low).unsqueeze(1) * u
    ranks = tarp_ranks(samples, theta, references, scale=fresh.std(1))
    return tarp_counts(ranks, num_posterior_samples), g


def p_values(reps, n, num_posterior_samples, seed, num_null=200, **kwargs):
    """:func:`tarp` at its defaults on ``reps`` fresh toy datasets, batched: each dataset's
    box, scale and 16 references as :func:`tarp` fits them, one permutation test over all
    (``test_batched_test_is_tarp_on_each_dataset`` ties it to :func:`tarp`)."""
    theta, samples, g = toy_samples(reps, n, num_posterior_samples, seed, **kwargs)
    scaled, refs = [], []
    for r in range(reps):
        values = pooled_values(samples[:, r], theta[r])
        scale = tarp_fit_scale(values)
        refs.append(tarp_references(*tarp_box(values, n), n, 16, generator=g) / scale)
        scaled.append((samples[:, r] / scale, theta[r] / scale))
    table = tarp_rank_table(torch.cat([s for s, _ in scaled], 1),
                            torch.cat([t for _, t in scaled]), torch.cat(refs, 1))  # fmt: skip
    out = tarp_permutation_test(table.view(reps, n, *table.shape[1:]), num_posterior_samples,
                                num_null=num_null, generator=g)  # fmt: skip
    return out, (theta, samples, refs, scaled)


def test_batched_test_is_tarp_on_each_dataset():
    out, (theta, _, refs, scaled) = p_values(3, 50, 20, seed=24)
    for r in range(3):
        scale = theta[r].new_ones(2)
        one = tarp(scaled[r][0], scaled[r][1], references=refs[r], scale=scale, generator=gen(0))
        for key in ("statistic", "coverage_error", "coverage"):
            assert torch.equal(getattr(one, key), getattr(out, key)[r]), key


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


def test_rank_table_holds_every_values_rank_and_its_first_column_is_the_truths():
    g = gen(20)
    samples = torch.randn(7, 5, 3, generator=g, dtype=F64)
    theta = torch.randn(5, 3, generator=g, dtype=F64)
    refs = torch.randn(4, 5, 3, generator=g, dtype=F64)
    scale = torch.tensor([1.0, 2.0, 0.5], dtype=F64)
    table = tarp_rank_table(samples, theta, refs, scale=scale)
    assert table.shape == (5, 8, 4)
    values = torch.cat([theta[None], samples])  # (S + 1, N, D)
    for i in range(5):
        for r in range(4):
            dist = ((values[:, i] - refs[r, i]) / scale).pow(2).sum(-1)
            for j in range(8):
                assert int(table[i, j, r]) == int((dist < dist[j]).sum())
    for r in range(4):
        assert torch.equal(table[:, 0, r].long(), tarp_ranks(samples, theta, refs[r], scale=scale))
    assert torch.equal(tarp_rank_table(samples, theta, refs, scale=scale, positions=3),
                       table[:, :3])  # fmt: skip
    # without ties, each pair's column under each reference is a permutation of 0..S
    expected = torch.arange(8).view(1, 8, 1).expand(5, 8, 4).to(table.dtype)
    assert torch.equal(table.sort(1).values, expected)


def test_coordinates_are_a_function_of_each_pairs_unordered_values():
    """Box and scale do not change when a pair's truth is swapped with one of its draws
    (what makes the permutation null exact); the box spans the 1/(N+1) and N/(N+1)
    quantiles of the pooled values, the references fill it uniformly."""
    theta, samples, _ = toy_samples(1, 200, 30, seed=21)
    theta, samples = theta[0], samples[:, 0]
    swapped_theta, swapped = samples[4].clone(), samples.clone()
    swapped[4] = theta
    one, two = pooled_values(samples, theta), pooled_values(swapped, swapped_theta)
    assert one.shape == (31 * 200, 2)
    for fit in (lambda v: tarp_box(v, 200), lambda v: (tarp_fit_scale(v),)):
        for u, v in zip(fit(one), fit(two), strict=True):
            torch.testing.assert_close(u, v, rtol=1e-6, atol=1e-6)
    low, high = tarp_box(one, 200)
    q = torch.tensor([1 / 201, 200 / 201], dtype=F64)
    expected = torch.quantile(one.double(), q, dim=0)
    torch.testing.assert_close(low.double(), expected[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(high.double(), expected[1], rtol=0, atol=1e-6)
    refs = tarp_references(low, high, 200, 50, generator=gen(1))
    assert refs.shape == (50, 200, 2)
    assert bool((refs >= low).all() and (refs <= high).all())
    assert torch.allclose(refs.mean((0, 1)), (low + high) / 2, atol=0.05)


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


def test_multinomial_test_of_one_fixed_reference_set_holds_its_level():
    counts, g = toy_datasets(reps=300, n=1000, num_posterior_samples=30, seed=3)
    out = tarp_test(counts, num_null=400, generator=g)
    p = torch.sort(out.p_value).values
    rate = float((p <= 0.05).double().mean())
    grid = torch.linspace(0, 1, 101, dtype=F64)
    excess = float(((p[None] <= grid[:, None]).double().mean(1) - grid).max())
    assert 0.01 <= rate <= 0.10
    assert excess < 0.1
    assert abs(float(out.coverage_error.mean())) < 0.003


@pytest.mark.parametrize(("dim", "n", "num_posterior_samples"),
                         [(2, 5, 9), (20, 40, 20), (50, 100, 20)])  # fmt: skip
def test_permutation_test_holds_its_level_at_any_size_and_dimension(dim, n, num_posterior_samples):
    """1,000 fresh datasets through :func:`tarp` at its defaults (16 references per pair,
    coordinates on the pooled values): the rejection rate lies in the 99 % binomial band
    [0.035, 0.067] and the p-values are uniform, from N = 5 pairs to D = 50 (where a box
    fitted on the tested theta gave 0.076)."""
    out, _ = p_values(1000, n, num_posterior_samples, seed=100 + dim, dim=dim)
    p = out.p_value
    low, high = (stats.binom.ppf(q, 1000, 0.05) / 1000 for q in (0.005, 0.995))
    assert low <= float((p <= 0.05).double().mean()) <= high
    assert stats.kstest(p.numpy(), "uniform").pvalue > 1e-3
    assert abs(float(out.coverage_error.mean())) < 0.01


def test_more_references_give_the_same_decision_whatever_the_seed():
    """On one fixed calibration set of an over-confident posterior (variance x 0.8,
    N = 500, S = 100), one reference set per seed decides by lottery; sixteen give every
    seed the same decision."""
    theta, samples, _ = toy_samples(1, 500, 100, seed=22, variance_scale=0.8)
    theta, samples = theta[0], samples[:, 0]
    rejected = {}
    for refs in (1, 16):
        p = torch.stack([tarp(samples, theta, num_references=refs, generator=gen(s)).p_value
                         for s in range(12)])  # fmt: skip
        rejected[refs] = float((p < 0.05).double().mean())
    assert 0.1 < rejected[1] < 0.9
    assert rejected[16] == 1.0


def test_p_value_error_is_the_spread_another_seed_gives():
    """On one fixed calibration set, the p-value's standard deviation over 16 seeds and its
    reported Monte Carlo error agree within a factor of 2.5 (where it is near the floor,
    both are below 0.01)."""
    for variance_scale in (1.0, 0.85):
        theta, samples, _ = toy_samples(1, 500, 100, seed=25, variance_scale=variance_scale)
        out = [tarp(samples[:, 0], theta[0], generator=gen(s)) for s in range(16)]
        spread = float(torch.stack([o.p_value for o in out]).std())
        error = float(torch.stack([o.p_value_error for o in out]).mean())
        assert spread / 2.5 <= error <= spread * 2.5 or max(spread, error) < 0.01, (
            variance_scale, spread, error)


@pytest.mark.parametrize(
    ("variance_scale", "shift", "error_sign"),
    [(2.0, 0.0, 1), (0.5, 0.0, -1), (1.0, 0.5, 0)],
    ids=["variance-x2", "variance-x0.5", "shifted"],
)
def test_power_at_n_1000_with_the_documented_error_sign(variance_scale, shift, error_sign):
    out, _ = p_values(20, 1000, 100, seed=4, variance_scale=variance_scale, shift=shift)
    assert float((out.p_value <= 0.05).double().mean()) >= 0.95
    assert bool((out.statistic > out.band).all())  # the curve leaves the band
    if error_sign:
        assert bool((torch.sign(out.coverage_error) == error_sign).all())


@pytest.mark.parametrize("dim", [20, 50])
def test_metric_with_default_arguments_holds_its_level_and_detects_dispersion(dim):
    """The public class, default arguments and seed, on fresh datasets of N = 100 pairs:
    no gross excess under H0 (30 datasets: the rate is measured with 1,000 in
    ``test_permutation_test_holds_its_level_at_any_size_and_dimension`` on the same
    construction, which ``test_metric_streams_exactly_and_equals_the_functional_core``
    ties to this class); a posterior 30 % too narrow or too wide is rejected with the
    documented sign."""
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


def test_functional_tarp_on_drawn_samples_equals_given_samples():
    toy, g = GaussianToy(dim=3), gen(5)
    theta, x = toy.sample(300, g)
    refs = tarp_references(theta.amin(0), theta.amax(0), 300, 4, generator=g)
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
    assert torch.equal(torch.cat(one.tables), torch.cat(many.tables))
    # R = 16 references per pair, uniform in the box, from the metric's seeded stream
    refs = tarp_references(*bounds, 400, 16, generator=torch.Generator().manual_seed(3 + 7919))
    expected = tarp_rank_table(samples, theta, refs, scale=scale)
    assert torch.equal(torch.cat(one.tables), expected.to(torch.int32))
    out, again = one.compute(), many.compute()
    for key in ("statistic", "p_value", "coverage_error", "coverage", "num_pairs"):
        assert torch.equal(getattr(out, key), getattr(again, key)), key
    direct = tarp(samples, theta, references=refs, scale=scale, generator=gen(4))
    for key in ("statistic", "coverage_error", "coverage"):
        assert torch.equal(getattr(out, key), getattr(direct, key)), key
    # fitted coordinates: the box and scale of the pooled values of the pairs updated
    # before the first compute; references for them in a canonical order, from seed + 2
    fitted = TARP(num_posterior_samples=40)
    fitted.update(samples[:, :150], theta[:150], x[:150])
    fitted.update(samples[:, 150:], theta[150:], x[150:])
    out = fitted.compute()
    values = pooled_values(samples.double(), theta.double())
    torch.testing.assert_close(fitted.scale, tarp_fit_scale(values), rtol=1e-12, atol=0)
    for got, want in zip((fitted.low, fitted.high), tarp_box(values, 400), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=0)
    order = canonical_order(theta.double() + samples.double().sum(0))  # symmetric per pair
    refs = tarp_references(fitted.low.float(), fitted.high.float(), 400, 16, generator=gen(2))
    table = tarp_rank_table(samples[:, order], theta[order], refs, scale=fitted.scale.float())
    table = table[canonical_order(table.flatten(1).double())].to(torch.int32)
    again = tarp_permutation_test(table, 40, generator=gen(_null_seed(0, table[:, 0])))
    for key in ("statistic", "p_value", "coverage_error", "coverage"):
        assert torch.equal(getattr(out, key), getattr(again, key)), key
    fitted.reset()
    assert fitted.scale.numel() == 2
    assert not fitted.tables


def test_metric_keeps_a_bounded_table_whatever_the_number_of_draws():
    """With S = 1,000 draws the metric ranks the truth and its first 100 draws (an exact
    subgroup of the permutations): the state is N x 101 x 16 ranks, and the test still
    detects an over-confident posterior and holds under the exact one."""
    toy, g = GaussianToy(dim=2), gen(23)
    theta, x = toy.sample(300, g)
    bounds, scale = (theta.amin(0), theta.amax(0)), theta.std(0)  # streams from the start
    torch.manual_seed(0)
    for variance_scale, rejects in ((1.0, False), (0.6, True)):
        metric = TARP(scale=scale, reference_bounds=bounds, seed=1)
        metric.update(toy.posterior(variance_scale=variance_scale), theta, x)
        assert dim_zero_cat(metric.tables).shape == (300, 101, 16)
        assert bool(metric.compute().p_value < 0.05) == rejects


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
        (lambda: tarp(samples, theta, num_references=0), "num_references must be a positive"),
        (lambda: tarp(samples, theta, references=torch.zeros(2, 9, 2)),
         r"references must have shape \(R, 10, 2\)"),
        (lambda: tarp_rank_table(samples, theta, theta[None], positions=7),
         r"positions must lie in \[1, S \+ 1 = 6\]"),
        (lambda: tarp_permutation_test(torch.zeros(3, 2), 5), "table must be integer ranks"),
        (lambda: tarp_permutation_test(torch.full((3, 2, 1), 6), 5),
         r"table must hold ranks in \[0, 5\]"),
        (lambda: TARP(num_references=0), "num_references must be a positive"),
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
