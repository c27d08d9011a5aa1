"""Rank calibration: ranks, level, power with the right sign, joint ranks, streaming, DDP."""

import math

import numpy as np
import pytest
import torch
from scipy import stats
from torch.distributions import Bernoulli, Independent, Normal

import calib_lightning as cl
from calib_lightning.functional import (
    energy_ranks,
    marginal_ranks,
    rank_calibration,
    rank_histogram,
    sbc_ranks,
    summarize_ranks,
    uniformity_test,
)
from calib_lightning.functional._moments import split_moments
from calib_lightning.functional.ranks import rank_draw_chunk, statistic_ranks
from calib_lightning.functional.sbc import statistic_tests
from calib_lightning.metrics.ranks import posterior_ranks
from calib_lightning.plots import plot_expected_coverage, plot_rank_ecdf, plot_rank_histograms
from calib_lightning.posteriors import Posterior
from calib_lightning.tasks import CorrelatedGaussianToy, GaussianToy
from calib_lightning.testing import run_distributed


def _draw(posterior, x, m):
    dist = posterior(x)
    samples = dist.sample((m,))
    return samples, dist.log_prob(samples)


def _batched_check(posterior_of_x, theta, x, reps, m, seed, **kwargs):
    """Draw for ``reps`` datasets at once and run the functional check on all of them."""
    torch.manual_seed(seed)
    samples, log_prob = _draw(posterior_of_x, x, m)
    n, d = theta.shape[0] // reps, theta.shape[1]
    return rank_calibration(
        samples.reshape(m, reps, n, d), log_prob.reshape(m, reps, n),
        theta.reshape(reps, n, d), posterior_of_x(x).log_prob(theta).reshape(reps, n),
        generator=torch.Generator().manual_seed(seed), **kwargs,
    )  # fmt: skip


def _assert_level(p_values, alpha=0.05):
    grid = np.linspace(0, 1, 201)
    p = np.asarray(p_values)
    assert np.max((p[:, None] <= grid).mean(0) - grid) < 0.1
    assert 0.01 <= (p <= alpha).mean() <= 0.10


class _HashedPosterior(Posterior):
    """``N(0.8 x, 0.2 I)`` whose draws for a pair depend only on its ``x``: reproducible
    under any split of the pairs into updates or processes."""

    def __init__(self) -> None:
        super().__init__(None)
        self.std = 0.2**0.5

    def _dist(self, x):
        return Independent(Normal(0.8 * x, self.std), 1)

    def sample_and_log_prob(self, x, num_samples):
        k = torch.arange(1, num_samples + 1, dtype=torch.float64)[:, None, None]
        j = torch.arange(1, x.shape[1] + 1, dtype=torch.float64)
        u = torch.frac(torch.sin(x.double() * 12.9898 + k * 78.233 + j * 37.719) * 43758.5453)
        z = torch.special.ndtri(u.abs().clamp(1e-7, 1 - 1e-7)).to(x.dtype)
        theta = 0.8 * x + self.std * z
        return theta, self._dist(x).log_prob(theta)

    def log_prob(self, theta, x):
        return self._dist(x).log_prob(theta)


# -- ranks ---------------------------------------------------------------------------------


def test_ranks_match_their_definition():
    g = torch.Generator().manual_seed(0)
    samples, theta = torch.randn(7, 5, 3, generator=g), torch.randn(5, 3, generator=g)
    assert torch.equal(marginal_ranks(samples, theta), (samples < theta).sum(0))
    lp, lp_theta = torch.randn(7, 5, generator=g), torch.randn(5, generator=g)
    assert torch.equal(energy_ranks(lp, lp_theta), (-lp < -lp_theta).sum(0))
    # a truth of zero density is less probable than every draw: rank M
    assert int(energy_ranks(lp, torch.full((5,), -float("inf")))[0]) == 7


def test_ties_are_broken_uniformly():
    # all M = 3 draws equal the truth: the rank is uniform on 0..3
    samples, theta = torch.zeros(3, 40000, 1), torch.zeros(40000, 1)
    ranks = marginal_ranks(samples, theta, generator=torch.Generator().manual_seed(1))
    freq = torch.bincount(ranks.flatten(), minlength=4) / 40000
    assert torch.allclose(freq, torch.full((4,), 0.25), atol=0.01)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_cpu_and_the_generic_path_count_alike(monkeypatch, dtype):
    """``rank_draw_chunk`` counts on the CPU with numpy comparisons by blocks of draws,
    elsewhere (a GPU, other dtypes) from torch's sums of signs: the same counts below and
    ties, on draws with ties (a grid) in the marginals and the energies, across block
    boundaries (blocks of 5 draws here), with the same moments; a NaN draw is a tie in
    both, which the lazy check then finds."""
    from calib_lightning.functional import ranks as counting

    g = torch.Generator().manual_seed(21)
    samples = ((torch.randn(300, 40, 3, generator=g) * 2).round() / 2).to(dtype)
    theta = ((torch.randn(40, 3, generator=g) * 2).round() / 2).to(dtype)
    lp, lp_theta = -samples.square().sum(-1).round(), -theta.square().sum(-1).round()
    monkeypatch.setattr(counting, "BLOCK_NUMBERS", 5 * 40 * 3)
    work = counting.RankWorkspace()
    cpu = counting.chunk_numpy(samples, theta, lp, lp_theta, 256, work)
    generic = counting.chunk_torch(samples, theta, lp, lp_theta, 256, work)
    counts, total, total_sq, ties = generic
    assert torch.equal(cpu[0], counts)
    assert torch.equal(cpu[3], ties)
    assert bool(ties[:, :3].sum() > 1000)
    assert bool(ties[:, 3].sum() > 100)
    expected = torch.stack([(samples < theta).sum(0), (samples == theta).sum(0)]).long()
    assert torch.equal(counts[:, :3], expected[0])
    assert torch.equal(ties[:, :3], expected[1])
    assert torch.equal(counts[:, 3], (lp > lp_theta).sum(0))
    torch.testing.assert_close(cpu[1], total, rtol=1e-12, atol=1e-9)
    torch.testing.assert_close(cpu[2], total_sq, rtol=1e-6, atol=1e-9)  # float32 squares
    assert cpu[4]  # finite log-densities
    samples[7, 4, 1] = math.nan
    nan_ties = ((samples == theta) | samples.isnan()).sum(0)
    nan_counted = counting.chunk_numpy(samples, theta, lp, lp_theta, 0, work)
    assert torch.equal(nan_counted[3][:, :3], nan_ties)
    with pytest.raises(ValueError, match=r"samples must be finite, got NaN for 1 of 40 .*\[4\]"):
        rank_draw_chunk(theta, lp_theta, samples, lp)


def test_discrete_posterior_with_ties_keeps_level():
    # theta ~ Bernoulli(1/2)^2, x = theta + N(0, 1): exact posterior Bernoulli(sigmoid(x - 1/2)).
    # Ties everywhere; random tie-breaking keeps the ranks exactly uniform.
    reps, n, m = 200, 200, 9
    g = torch.Generator().manual_seed(2)
    theta = torch.randint(0, 2, (reps * n, 2), generator=g).float()
    x = theta + torch.randn(theta.shape, generator=g)

    def posterior(x):
        return Independent(Bernoulli(logits=x - 0.5), 1)

    out = _batched_check(posterior, theta, x, reps, m, seed=3)
    for p in [*out.marginal_p_values.T, out.p_value]:
        _assert_level(p)
    strict = rank_histogram((_draw(posterior, x, m)[0] < theta).sum(0), m)  # (2, M + 1)
    assert bool((uniformity_test(strict)[1] < 1e-10).all())  # without tie-breaking: skewed


# -- level and power ------------------------------------------------------------------------


def test_level_with_exact_posterior_marginal_and_joint():
    reps, n, m = 200, 200, 99
    toy = GaussianToy(dim=2)
    theta, x = toy.sample(reps * n, torch.Generator().manual_seed(4))
    out = _batched_check(toy.posterior(), theta, x, reps, m, seed=5)
    for p in [*out.marginal_p_values.T, out.p_value, *out.ecdf_p_values.T]:
        _assert_level(p)
    assert abs(out.coverage_error.mean()) < 3 * 0.29 / (reps * n) ** 0.5


def test_level_when_pairs_far_outnumber_rank_values():
    # N = 1000 >> M + 1 = 10: our discrete test keeps its level; a KS test against the
    # continuous uniform (what sbi's check_sbc does) rejects an exact posterior.
    reps, n, m = 200, 1000, 9
    toy = GaussianToy(dim=2)
    theta, x = toy.sample(reps * n, torch.Generator().manual_seed(6))
    out = _batched_check(toy.posterior(), theta, x, reps, m, seed=7)
    _assert_level(out.p_value)
    _assert_level(out.marginal_p_values[:, 0])
    values = np.arange(m + 1)
    ks = [stats.kstest(np.repeat(values, out.histogram[r, -1].numpy()),
                       stats.uniform(0, m).cdf).pvalue for r in range(20)]  # fmt: skip
    assert np.mean(np.asarray(ks) < 0.05) > 0.9


@pytest.mark.parametrize(
    ("variance_scale", "shift", "sign"),
    [(2.0, 0.0, 1), (0.5, 0.0, -1), (1.0, 0.5, -1)],
    ids=["over-dispersed", "under-dispersed", "biased"],
)
def test_power_and_sign_of_coverage_error(variance_scale, shift, sign):
    reps, n, m = 10, 1000, 100
    toy = GaussianToy(dim=2)
    theta, x = toy.sample(reps * n, torch.Generator().manual_seed(8))
    post = toy.posterior(variance_scale=variance_scale, shift=shift)
    out = _batched_check(post, theta, x, reps, m, seed=9)
    assert bool((out.p_value < 1e-3).all())
    assert bool((out.marginal_p_values < 1e-3).all())
    assert bool((sign * out.coverage_error > 0.03).all())
    # the reading printed on the ECDF figure
    deviation = out.ecdf[:, :2] - out.levels
    left, right = deviation[..., out.levels < 0.5], deviation[..., out.levels > 0.5]
    if shift > 0:  # posterior too high: marginal ECDF - t above 0 throughout
        assert bool((deviation.mean(-1) > 0.05).all())
    else:  # too narrow: above 0 on the left, below on the right; too wide: the reverse
        assert bool((sign * left.mean(-1) < -0.02).all())
        assert bool((sign * right.mean(-1) > 0.02).all())
    # the metric reports the same sign on one dataset
    metric = cl.RankCalibration(num_posterior_samples=m)
    torch.manual_seed(10)
    metric.update(post, theta[:n], x[:n])
    result = metric.compute()
    assert sign * float(result.coverage_error) > 0.03
    assert bool(result.outside_band.all())


def test_wrong_correlation_is_caught_only_by_the_joint_rank():
    reps, n, m = 10, 1000, 100
    toy = CorrelatedGaussianToy(correlation=0.95)
    theta, x = toy.sample(reps * n, torch.Generator().manual_seed(11))
    for correlation in (0.0, -toy.posterior_correlation):
        out = _batched_check(toy.posterior(correlation), theta, x, reps, m, seed=12)
        assert (out.p_value < 0.05).float().mean() >= 0.8
        assert (out.ecdf_p_values[:, -1] < 0.05).float().mean() >= 0.9
        assert (out.marginal_p_values < 0.05).float().mean() <= 0.2  # marginals are exact
    assert bool((out.p_value < 1e-3).all())  # opposite correlation: always caught


def test_prior_is_calibrated_but_not_sharp():
    toy = GaussianToy(dim=2)
    theta, x = toy.sample(4000, torch.Generator().manual_seed(13))

    def prior(x):
        return Independent(Normal(torch.zeros_like(x), 1.0), 1)

    torch.manual_seed(14)
    useless, exact = cl.RankCalibration(100), cl.RankCalibration(100)
    useless.update(prior, theta, x)
    exact.update(toy.posterior(), theta, x)
    out, ref = useless.compute(), exact.compute()
    assert float(out.p_value) > 0.01
    assert bool((out.marginal_p_values > 0.01).all())
    assert bool((out.contraction.abs() < 0.08).all())
    assert torch.allclose(ref.contraction, torch.full((2,), 0.8, dtype=torch.float64),
                          atol=0.04)  # fmt: skip
    # calibrated posteriors: MSE of the posterior mean matches the posterior variance
    for result in (out, ref):
        ratio = result.mean_squared_error / result.posterior_variance
        assert torch.allclose(ratio, torch.ones(2, dtype=torch.float64), atol=0.1)


# -- streaming, chunking, DDP ---------------------------------------------------------------


class _Recorder(Posterior):
    """Wraps a posterior and records every chunk of draws it hands out."""

    def __init__(self, inner):
        super().__init__(None)
        self.inner, self.calls = cl.as_posterior(inner), []

    def sample_and_log_prob(self, x, num_samples):
        out = self.inner.sample_and_log_prob(x, num_samples)
        self.calls.append(out)
        return out

    def log_prob(self, theta, x):
        return self.inner.log_prob(theta, x)


def test_chunked_draws_equal_the_unchunked_ranks_and_moments():
    toy = GaussianToy(dim=3)
    theta, x = toy.sample(10, torch.Generator().manual_seed(15))
    recorder = _Recorder(toy.posterior(variance_scale=1.5))
    m = 40
    draws = posterior_ranks(recorder, theta, x, m, max_chunk_elements=3 * 16)  # 16 draws/call
    per_pair = [recorder.calls[i : i + 3] for i in range(0, len(recorder.calls), 3)]
    assert len(per_pair) == 10
    assert all(c[0][0].shape == (16, 1, 3) for c in per_pair)
    samples = torch.cat([torch.cat([s for s, _ in c]) for c in per_pair], 1)
    log_prob = torch.cat([torch.cat([lp for _, lp in c]) for c in per_pair], 1)
    expected = sbc_ranks(samples, log_prob, theta, recorder.log_prob(theta, x))
    assert torch.equal(draws.ranks, expected)
    diff = (samples - theta).double()
    assert torch.allclose(draws.mean_error, diff.mean(0), rtol=1e-6, atol=1e-7)
    assert torch.allclose(draws.variance, diff.var(0), rtol=1e-5, atol=1e-7)


def test_many_small_updates_equal_one_big_update():
    toy = GaussianToy(dim=2)
    theta, x = toy.sample(600, torch.Generator().manual_seed(16))
    post = _HashedPosterior()
    big, small = cl.RankCalibration(50), cl.RankCalibration(50, max_chunk_elements=1000)
    big.update(post, theta, x)
    for start, stop in [(0, 7), (7, 300), (300, 301), (301, 600)]:
        small.update(post, theta[start:stop], x[start:stop])
    assert torch.equal(big.histogram, small.histogram)
    assert torch.allclose(big.posterior_sums, small.posterior_sums, rtol=1e-12, atol=1e-12)
    # count, mean and centred sum of squares (the anchors of the two states may differ)
    for a, b in zip(split_moments(big.theta_moments), split_moments(small.theta_moments),
                    strict=True):
        assert torch.allclose(a, b, rtol=1e-12, atol=1e-12)
    a, b = big.compute(), small.compute()
    for key in ("p_value", "marginal_p_values", "ecdf_p_values", "coverage_error", "ecdf"):
        assert torch.equal(a[key], b[key]), key
    assert torch.allclose(a.contraction, b.contraction, rtol=1e-12)
    # forward: the batch's own result, while the state accumulates; merge_state adds up
    stepped, merged = cl.RankCalibration(50), cl.RankCalibration(50)
    batch = stepped(post, theta[:300], x[:300])
    assert int(batch.num_pairs) == 300
    assert int(stepped(post, theta[300:], x[300:]).num_pairs) == 300
    assert torch.equal(stepped.histogram, big.histogram)
    merged.merge_state(stepped)
    assert torch.equal(merged.histogram, big.histogram)
    big.reset()
    assert big.histogram.numel() == 0


@pytest.mark.forks
def test_two_process_ddp_equals_one_process():
    toy = GaussianToy(dim=2)
    theta, x = toy.sample(400, torch.Generator().manual_seed(17))
    single = cl.RankCalibration(30)
    single.update(_HashedPosterior(), theta, x)
    expected = single.compute()

    def fn(rank, world_size):
        metric = cl.RankCalibration(30, num_dims=2)
        rows = slice(rank * 150, 400) if rank else slice(0, 150)  # uneven split
        metric.update(_HashedPosterior(), theta[rows], x[rows])
        return metric.compute()

    for result in run_distributed(fn, world_size=2):
        assert torch.equal(result.histogram, expected.histogram)
        assert torch.equal(result.p_value, expected.p_value)
        assert torch.allclose(result.contraction, expected.contraction, rtol=1e-12)
        assert torch.allclose(result.mean_squared_error, expected.mean_squared_error,
                              rtol=1e-10)  # fmt: skip


# -- bad input ------------------------------------------------------------------------------


class _Broken(_Recorder):
    """Draws NaN for some pairs."""

    def sample_and_log_prob(self, x, num_samples):
        samples, log_prob = self.inner.sample_and_log_prob(x, num_samples)
        samples[:, [2, 5, 11]] = float("nan")
        return samples, log_prob


def _late_nan(posterior, x, num_samples):
    samples, log_prob = cl.as_posterior(posterior).sample_and_log_prob(x, num_samples)
    samples[300, 7, 0] = float("nan")
    return samples, log_prob


def test_non_finite_draws_name_the_affected_pairs():
    toy = GaussianToy(dim=2)
    theta, x = toy.sample(20, torch.Generator().manual_seed(18))
    broken = _Broken(toy.posterior())
    with pytest.raises(ValueError, match=r"samples must be finite.* 3 of 20 .*\[2, 5, 11\]"):
        posterior_ranks(broken, theta, x, 10)
    with pytest.raises(ValueError, match=r"3 of 20 calibration pairs"):
        cl.RankCalibration(10).update(broken, theta, x)
    # one NaN coordinate among 400 draws, past the draws used for moments, finite log-prob
    late = _Broken(toy.posterior())
    late.sample_and_log_prob = lambda x, s: _late_nan(toy.posterior(), x, s)
    with pytest.raises(ValueError, match=r"samples must be finite.* 1 of 20 .*\[7\]"):
        posterior_ranks(late, theta, x, 400, max_chunk_elements=2**20)  # one chunk
    samples, lp = _draw(toy.posterior(), x, 10)
    lp[3, 4] = float("nan")
    with pytest.raises(ValueError, match=r"log_prob at its samples must be finite.* 1 of 20"):
        sbc_ranks(samples, lp, theta, toy.posterior()(x).log_prob(theta))
    lp_theta = toy.posterior()(x).log_prob(theta)
    lp_theta[0] = float("inf")
    with pytest.raises(ValueError, match=r"at theta must be finite or -inf.* 1 of 20"):
        sbc_ranks(samples, _draw(toy.posterior(), x, 10)[1], theta, lp_theta)


def test_bad_arguments():
    toy = GaussianToy(dim=2)
    theta, x = toy.sample(10, torch.Generator().manual_seed(19))
    with pytest.raises(ValueError, match="num_posterior_samples must be >= 2"):
        cl.RankCalibration(1)
    with pytest.raises(ValueError, match="level"):
        cl.RankCalibration(10, level=0.0)
    metric = cl.RankCalibration(10)
    with (
        pytest.raises(ValueError, match="needs at least N >= 2"),
        pytest.warns(UserWarning, match="before the"),
    ):
        metric.compute()
    with pytest.raises(ValueError, match="theta must have shape"):
        metric.update(toy.posterior(), theta[:, 0], x)
    metric.update(toy.posterior(), theta, x)
    with pytest.raises(ValueError, match="D = 2 columns"):
        metric.update(GaussianToy(dim=3).posterior(), *GaussianToy(dim=3).sample(5))
    with pytest.raises(ValueError, match="same number N"):
        summarize_ranks(torch.tensor([[1, 2], [3, 3]]))
    with pytest.raises(ValueError, match="num_bins must lie in"):
        uniformity_test(torch.tensor([5, 5, 5]), num_bins=4)
    with pytest.raises(ValueError, match=r"samples must have shape .* \(M, 10, 2\)"):
        marginal_ranks(torch.zeros(3, 10, 3), theta)


# -- uniformity test and figures --------------------------------------------------------------


def test_uniformity_test_matches_scipy_with_exact_bin_probabilities():
    counts = torch.randint(0, 30, (4, 23), generator=torch.Generator().manual_seed(20))
    stat, p = uniformity_test(counts, num_bins=5)
    edges = np.arange(6) * 23 // 5
    for row, s, pv in zip(counts.numpy(), stat, p, strict=True):
        observed = np.add.reduceat(row, edges[:-1])
        expected = row.sum() * np.diff(edges) / 23
        ref = stats.chisquare(observed, expected)
        assert float(s) == pytest.approx(ref.statistic, rel=1e-10)
        assert float(pv) == pytest.approx(ref.pvalue, rel=1e-8)


def test_figures_read_without_a_tutorial():
    toy = GaussianToy(dim=2)
    theta, x = toy.sample(300, torch.Generator().manual_seed(21))
    metric = cl.RankCalibration(50)
    torch.manual_seed(22)
    metric.update(toy.posterior(variance_scale=0.5), theta, x)
    out = metric.compute()
    hist = plot_rank_histograms(out, labels=["mu", "sigma"])
    assert [ax.get_title().split(" ")[0] for ax in hist.axes] == ["mu", "sigma", "joint"]
    assert any("over-confident" in t.get_text() for t in hist.texts)
    ecdf = plot_rank_ecdf(out)
    assert len(ecdf.axes) == 2
    assert len(ecdf.axes[0].get_legend().get_texts()) == 4
    assert any("over-confident" in t.get_text() for t in ecdf.axes[0].texts)
    cov = plot_expected_coverage(out)
    assert "over-confident" in cov.axes[0].get_title()
    texts = " ".join(t.get_text() for t in cov.axes[0].texts)
    assert "OVER-CONFIDENT" in texts
    assert "UNDER-CONFIDENT" in texts
    with pytest.raises(ValueError, match="missing fields"):
        plot_expected_coverage({"levels": out.levels})


# -- custom test quantities (statistics=) ----------------------------------------------
QUANTITIES = {"sum": lambda t: t.sum(-1), "norm": lambda t: t.norm(dim=-1)}


def test_statistics_keep_their_level_on_an_exact_posterior():
    """200 fresh datasets, exact correlated posterior: each quantity's chi-square and
    ECDF-band tests and the global p-value with them reject inside the binomial band."""
    toy, reps, level = CorrelatedGaussianToy(correlation=0.8), 200, 0.05
    torch.manual_seed(0)
    rejected = torch.zeros(5)
    for rep in range(reps):
        theta, x = toy.sample(100, torch.Generator().manual_seed(5000 + rep))
        metric = cl.RankCalibration(99, statistics=QUANTITIES)
        metric.update(toy.posterior(), theta, x)
        out = metric.compute()
        p = torch.cat([out.statistic_p_values, out.statistic_ecdf_p_values,
                       out.global_p_value[None]])  # fmt: skip
        rejected += (p < level).double()
    # 99.9% band of Bin(200, 0.05): [2, 21]
    assert bool((rejected >= 2).all() and (rejected <= 21).all()), rejected


def test_the_sum_sees_a_correlation_error_the_marginals_miss():
    """Right marginals, wrong correlation (0 instead of the posterior's): the rank of the
    sum rejects in nearly every dataset, the marginal ranks at their level."""
    toy = CorrelatedGaussianToy(correlation=0.8)
    torch.manual_seed(1)
    statistic, marginal = [], []
    for rep in range(10):
        theta, x = toy.sample(500, torch.Generator().manual_seed(6000 + rep))
        metric = cl.RankCalibration(99, statistics={"sum": QUANTITIES["sum"]})
        metric.update(toy.posterior(correlation=0.0), theta, x)
        out = metric.compute()
        statistic.append(float(out.statistic_ecdf_p_values[0]))
        marginal.extend(out.marginal_p_values.tolist())
    assert sum(p < 0.05 for p in statistic) >= 9, statistic
    assert sum(p < 0.05 for p in marginal) <= 4, marginal  # 20 tests at level 0.05


def test_statistics_closed_form_and_global_p_value():
    # the rank of the sum by hand: draws' sums 1, 4, 6 and the truth's 3 -> rank 1
    samples = torch.tensor([[[0.0, 1.0]], [[2.0, 2.0]], [[3.0, 3.0]]], dtype=torch.float64)
    truth = torch.tensor([[2.0, 1.0]], dtype=torch.float64)
    assert statistic_ranks(samples, truth, [QUANTITIES["sum"]]).tolist() == [[1]]
    # all N = 40 ranks at 0 among M = 3: X^2 = 30^2 / 10 + 3 * 10 = 120 on 3 degrees
    p, _, _ = statistic_tests(torch.tensor([[40, 0, 0, 0]]))
    x2 = torch.tensor(120.0, dtype=torch.float64)
    exact = torch.special.erfc((x2 / 2).sqrt()) + (2 * x2 / math.pi).sqrt() * torch.exp(-x2 / 2)
    assert float(p[0]) == pytest.approx(float(exact), rel=1e-6)
    # global_p_value: the Cauchy combination of all 2 (D + 1) + 2 Q p-values
    toy = CorrelatedGaussianToy()
    theta, x = toy.sample(200, torch.Generator().manual_seed(3))
    metric = cl.RankCalibration(49, statistics=QUANTITIES)
    torch.manual_seed(4)
    metric.update(toy.posterior(), theta, x)
    out = metric.compute()
    every = torch.cat([out.marginal_p_values, out.p_value[None], out.ecdf_p_values,
                       out.statistic_p_values, out.statistic_ecdf_p_values]).double()  # fmt: skip
    t = torch.tan((0.5 - every) * math.pi).mean()
    cauchy = 0.5 - torch.atan(t) / math.pi
    assert float(out.global_p_value) == pytest.approx(float(cauchy), rel=1e-9)
    assert out.statistic_names == ("sum", "norm")
    assert out.statistic_histogram.shape == (2, 50)
    assert set(out.scalars()) >= {"statistic_p_values/sum", "statistic_ecdf_p_values/norm"}


def test_statistics_leave_the_other_ranks_unchanged_and_check_their_input():
    toy = GaussianToy(dim=3)
    theta, x = toy.sample(150, torch.Generator().manual_seed(8))
    results = []
    for statistics in (None, QUANTITIES):
        metric = cl.RankCalibration(30, statistics=statistics)
        torch.manual_seed(9)
        metric.update(toy.posterior(), theta, x)
        results.append(metric.compute())
    plain, with_quantities = results
    assert torch.equal(plain.histogram, with_quantities.histogram)
    assert torch.equal(plain.ecdf_p_values, with_quantities.ecdf_p_values)
    assert plain.statistic_p_values is None
    assert "statistic_p_values/sum" not in plain.scalars()
    with pytest.raises(ValueError, match="statistics must be a dict name -> callable"):
        cl.RankCalibration(10, statistics={"sum": 3})
    metric = cl.RankCalibration(10, statistics={"bad": lambda t: t})
    with pytest.raises(ValueError, match=r"statistics\['bad'\] must map theta"):
        metric.update(toy.posterior(), theta, x)
