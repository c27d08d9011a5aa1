"""One verdict per check: ``global_p_value`` of rank calibration, p-value floors, D = 1 shapes.

What must hold: on calibrated models (independent and correlated parameters, D = 5)
the global p-value of :class:`calib_lightning.RankCalibration`, with its default
arguments and a fresh dataset per repetition, rejects at 0.05 inside the 99 % binomial
band and is close to uniform; it rejects over-confident, under-confident and shifted
posteriors with the right sign of ``coverage_error``; it equals the documented
combination of the reported tests; analytic p-values never underflow to 0.
"""

import math
from types import SimpleNamespace

import pytest
import torch
from scipy import stats
from torch.distributions import MultivariateNormal

import calib_lightning as cl
from calib_lightning.functional import combine_p_values, summarize_ranks, uniformity_test
from calib_lightning.functional.bands import P_VALUE_FLOOR, ecdf_levels, ecdf_test, rank_ecdf
from calib_lightning.plots import plot_history, plot_rank_ecdf, plot_rank_histograms
from calib_lightning.tasks import GaussianToy

DIM, PAIRS = 5, 200  # N = 200 pairs per dataset: 20 chi-square bins of 10 expected counts
REPS = 300  # datasets per calibrated model


class CorrelatedToy:
    r"""Conjugate toy with correlated parameters: :math:`\theta \sim N(0, \Sigma)`,
    :math:`\Sigma_{ij} = 0.8^{|i - j|}`, :math:`x = \theta + N(0, 0.5^2 I)`; exact posterior
    :math:`N(C x / s^2, C)`, :math:`C = (\Sigma^{-1} + I / s^2)^{-1}`."""

    def __init__(self, dim=DIM, rho=0.8, noise_std=0.5):
        i = torch.arange(dim, dtype=torch.float64)
        self.prior = rho ** (i[:, None] - i[None, :]).abs()
        self.noise_var = noise_std**2
        self.cov = torch.linalg.inv(torch.linalg.inv(self.prior) + torch.eye(dim) / self.noise_var)
        self.chol = torch.linalg.cholesky(self.prior)

    def sample(self, n, generator):
        theta = torch.randn(n, len(self.prior), generator=generator, dtype=torch.float64)
        theta = theta @ self.chol.T
        x = theta + self.noise_var**0.5 * torch.randn(theta.shape, generator=generator,
                                                       dtype=torch.float64)  # fmt: skip
        return theta.float(), x.float()

    def posterior(self, x):
        mean = x.double() @ self.cov.T / self.noise_var
        return MultivariateNormal(mean.float(), self.cov.float())


def _global_p_values(model, posterior, reps, seed, **kwargs):
    """``RankCalibration(**kwargs)`` on ``reps`` fresh datasets: the result of each check."""
    generator = torch.Generator().manual_seed(seed)
    metric = cl.RankCalibration(**kwargs)
    results = []
    for _ in range(reps):
        theta, x = model.sample(PAIRS, generator)
        metric.reset()
        metric.update(posterior, theta, x)
        results.append(metric.compute())
    keys = ("global_p_value", "p_value", "marginal_p_values", "ecdf_p_values", "coverage_error")
    return SimpleNamespace(**{key: torch.stack([getattr(r, key) for r in results]) for key in keys})


def _assert_level(p_values, level=0.05):
    reps = p_values.numel()
    low, high = stats.binom.ppf([0.005, 0.995], reps, level) / reps
    rate = float((p_values < level).double().mean())
    assert low <= rate <= high, f"rejection rate {rate} outside [{low}, {high}] over {reps}"


@pytest.mark.parametrize("name", ["independent", "correlated"])
def test_global_p_value_holds_its_level_on_calibrated_models(name):
    toy = GaussianToy(dim=DIM)
    model, posterior = {
        "independent": (toy, toy.posterior()),
        "correlated": (CorrelatedToy(), CorrelatedToy().posterior),
    }[name]
    torch.manual_seed(0)  # the posterior draws
    out = _global_p_values(model, posterior, reps=REPS, seed=2)  # default arguments
    p = out.global_p_value
    _assert_level(p)
    ks = stats.kstest(p.numpy(), "uniform")
    assert ks.pvalue > 1e-3, f"global p-values far from uniform: KS {ks.statistic:.3f}"
    # Holm on the same tests: valid too (conservative)
    tests = torch.cat([out.marginal_p_values, out.p_value[:, None], out.ecdf_p_values], 1)
    holm = combine_p_values(tests, method="holm")
    assert float((holm < 0.05).double().mean()) <= stats.binom.ppf(0.995, REPS, 0.05) / REPS
    # judged one by one, the 12 tests flag a calibrated model far more often
    assert float((tests < 0.05).any(1).double().mean()) > 0.2


@pytest.mark.parametrize(
    ("variance_scale", "shift", "sign"),
    [(0.7, 0.0, -1), (1.4, 0.0, 1), (1.0, 0.15, -1)],
    ids=["over-confident", "under-confident", "shifted"],
)
def test_global_p_value_rejects_miscalibration_with_the_right_sign(variance_scale, shift, sign):
    toy = GaussianToy(dim=DIM)
    torch.manual_seed(2)
    post = toy.posterior(variance_scale=variance_scale, shift=shift)
    out = _global_p_values(toy, post, reps=20, seed=3)
    assert float((out.global_p_value < 0.05).double().mean()) >= 0.9
    assert sign * float(out.coverage_error.mean()) > 0.01


def test_global_p_value_is_the_documented_combination_in_float64():
    counts = torch.tensor([[[30, 20, 10, 40], [25, 25, 25, 25], [10, 30, 30, 30]]])
    out = summarize_ranks(counts.repeat(2, 1, 1), num_bins=4)  # batch of 2, D = 2, N = 100
    tests = torch.cat([out.marginal_p_values, out.p_value[:, None], out.ecdf_p_values], 1)
    assert tests.shape == (2, 6)
    p = tests[0].double().clamp(max=1 - 1e-3)  # the documented cap (flat row: p = 1)
    cauchy = 0.5 - math.atan(float(torch.tan((0.5 - p) * math.pi).mean())) / math.pi
    assert float(out.global_p_value[0]) == pytest.approx(cauchy, rel=1e-9)
    holm = summarize_ranks(counts, num_bins=4, global_method="holm").global_p_value
    assert float(holm[0]) == pytest.approx(min(1.0, 6 * float(p.min())), rel=1e-12)
    metric = cl.RankCalibration(num_posterior_samples=50, global_method="holm")
    with pytest.raises(ValueError, match="global_method must be one of"):
        cl.RankCalibration(global_method="fisher")
    with pytest.raises(ValueError, match="global_method must be one of"):
        summarize_ranks(counts, global_method="min")
    toy = GaussianToy(dim=2)
    theta, x = toy.sample(300, torch.Generator().manual_seed(4))
    torch.manual_seed(5)
    metric.update(toy.posterior(), theta, x)
    out = metric.compute()
    tests = torch.cat([out.marginal_p_values, out.p_value[None], out.ecdf_p_values])
    assert float(out.global_p_value) == pytest.approx(min(1.0, 6 * float(tests.min())))


def test_analytic_p_values_never_underflow_to_zero():
    counts = torch.zeros(2, 1001, dtype=torch.long)
    counts[:, 0] = 10_000  # every truth below every draw: chi-square ~ 2e5, tail ~ 1e-40000
    _, p = uniformity_test(counts)
    assert bool((p == P_VALUE_FLOOR).all())
    levels, ecdf = rank_ecdf(counts, ecdf_levels(1000))
    _, p_ecdf = ecdf_test(ecdf, levels, 10_000)
    assert bool((p_ecdf == P_VALUE_FLOOR).all())
    out = summarize_ranks(counts)
    for key in ("p_value", "marginal_p_values", "ecdf_p_values", "global_p_value"):
        assert bool((out[key] > 0).all()), key
    assert bool((out.global_p_value <= 2 * 2 * P_VALUE_FLOOR).all())
    # figures say so instead of printing 0
    assert "p < 2.2e-308" in plot_rank_histograms(out).axes[0].get_title()
    assert "global p < 2.2e-308" in plot_rank_ecdf(out)._suptitle.get_text()
    fig = plot_history([0, 1, 2], {"global_p_value": [0.5, 1e-9, P_VALUE_FLOOR]})
    (ax,) = fig.axes
    assert any(t.get_text() == "<2e-308" for t in ax.texts)  # an upper bound, written
    floored = [line for line in ax.lines if line.get_marker() == "v"]  # below the axis
    assert len(floored) == 1
    assert list(floored[0].get_xdata()) == [2]


def test_one_dimensional_outputs_keep_their_shapes():
    toy = GaussianToy(dim=1)
    theta, x = toy.sample(100, torch.Generator().manual_seed(6))
    metric = cl.RankCalibration(num_posterior_samples=30)
    torch.manual_seed(7)
    metric.update(toy.posterior(), theta, x)
    out = metric.compute()
    assert out.marginal_p_values.shape == (1,)
    assert out.marginal_statistics.shape == (1,)
    assert out.ecdf_p_values.shape == (2,)
    for key in ("global_p_value", "p_value", "coverage_error"):
        assert out[key].shape == (), key
    for key in ("contraction", "mean_squared_error", "posterior_variance", "prior_variance"):
        assert out[key].shape == (1,), key
    tarp = cl.TARP(num_posterior_samples=30)
    tarp.update(toy.posterior(), theta, x)
    result = tarp.compute()
    for key in ("statistic", "p_value", "coverage_error"):
        assert result[key].shape == (), key


@pytest.mark.parametrize(("variance_scale", "sign", "word"),
                         [(0.5, -1, "over"), (2.0, 1, "under")])  # fmt: skip
def test_figures_and_numbers_read_one_sign_convention(variance_scale, sign, word):
    from calib_lightning.plots import plot_expected_coverage, plot_tarp

    toy = GaussianToy(dim=2)
    theta, x = toy.sample(500, torch.Generator().manual_seed(8))
    post = toy.posterior(variance_scale=variance_scale)
    torch.manual_seed(9)
    ranks = cl.RankCalibration()  # defaults
    ranks.update(post, theta, x)
    out = ranks.compute()
    assert sign * float(out.coverage_error) > 0.05
    joint = out.ecdf[-1] - out.levels  # the joint curve is coverage minus level
    assert sign * float(joint.mean()) > 0.05
    assert f"{word}-confident" in plot_expected_coverage(out).axes[0].get_title()
    tarp = cl.TARP()
    tarp.update(post, theta, x)
    result = tarp.compute()
    upper = result.credibility > 0.5
    assert sign * float(result.coverage_error) > 0
    assert sign * float((result.coverage - result.credibility)[upper].mean()) > 0
    note = " ".join(t.get_text() for t in plot_tarp(result).axes[0].texts)
    assert "below = over-confident" in note
