"""ImportanceCoverage: HPD credibility of an unnormalized posterior by importance sampling.

Level on exact unnormalized posteriors (Gaussian likelihood times a Gaussian or a box
prior: theta ~ prior, x ~ N(theta, 0.5^2 I), so theta is an exact posterior draw given x),
power and sign on tempered likelihoods, the ESS guard, a proposal closer to the posterior,
closed-form credibilities, and argument errors.
"""

import math

import pytest
import torch
from scipy import stats
from torch.distributions import Independent, Normal, Uniform

import calib_lightning as cl
from calib_lightning.functional import importance_coverage, importance_credibility

SIGMA = 0.5


def gaussian_prior(d):
    return Independent(Normal(torch.zeros(d), torch.ones(d)), 1)


def box_prior(d):
    return Independent(Uniform(-2 * torch.ones(d), 2 * torch.ones(d)), 1)


def likelihood(tau=1.0, sigma=SIGMA):
    def log_lik(theta, x):
        return -0.5 * tau * (((x - theta) / sigma) ** 2).sum(-1)

    return log_lik


def simulate(prior, n, seed, sigma=SIGMA):
    torch.manual_seed(seed)
    theta = prior.sample((n,))
    return theta, theta + sigma * torch.randn_like(theta)


def run(post, theta, x, seed, **kwargs):
    metric = cl.ImportanceCoverage(seed=seed, **kwargs)
    metric.update(post, theta, x)
    return metric.compute()


def binomial_band(trials, level=0.05, confidence=0.99):
    low, high = stats.binom.interval(confidence, trials, level)
    return low / trials, high / trials


@pytest.mark.parametrize("prior_kind", ["gaussian", "box"])
def test_level_on_exact_unnormalized_posteriors(prior_kind):
    """D = 1 and 2, 2 x 60 = 120 fresh datasets of 100 pairs per prior (240 in all),
    default arguments: the rejection rate at 0.05 lies in the 99 % binomial band."""
    make = gaussian_prior if prior_kind == "gaussian" else box_prior
    p_values, ess = [], []
    for d in (1, 2):
        post = cl.UnnormalizedPosterior(likelihood(), prior=make(d))
        for rep in range(60):
            theta, x = simulate(make(d), 100, seed=1000 * d + rep)
            out = run(post, theta, x, seed=rep)
            assert out.cannot_judge is None, out.cannot_judge
            p_values.append(float(out.global_p_value))
            ess.append(float(out.ess_median))
    rate = sum(p < 0.05 for p in p_values) / len(p_values)
    low, high = binomial_band(len(p_values))
    assert low <= rate <= high, (rate, (low, high), min(ess))


@pytest.mark.parametrize(("tau", "sign"), [(1.5, -1), (0.6, 1)])
def test_power_and_sign_on_tempered_likelihoods(tau, sign):
    """tau * log-likelihood: 1.5 over-confident (negative coverage error), 0.6
    under-confident (positive); every fresh dataset of 600 pairs is rejected."""
    for d in (1, 2):
        post = cl.UnnormalizedPosterior(likelihood(tau), prior=gaussian_prior(d))
        for rep in range(3):
            theta, x = simulate(gaussian_prior(d), 600, seed=50 + 10 * d + rep)
            out = run(post, theta, x, seed=rep)
            assert float(out.global_p_value) < 0.01, (d, rep, out)
            assert math.copysign(1, float(out.coverage_error)) == sign, (d, rep, out)


def test_ess_guard_on_a_too_narrow_likelihood():
    """sigma = 0.01 in D = 2 with the prior as proposal: ESS of a few draws, so no
    p-value and no coverage error, and the reason names the ESS and the remedies."""
    prior = gaussian_prior(2)
    post = cl.UnnormalizedPosterior(likelihood(sigma=0.01), prior=prior)
    theta, x = simulate(prior, 200, seed=3, sigma=0.01)
    out = run(post, theta, x, seed=0)
    assert float(out.ess_median) < 50
    assert math.isnan(float(out.global_p_value))
    assert math.isnan(float(out.p_value))
    assert math.isnan(float(out.coverage_error))
    assert "effective sample size" in out.cannot_judge
    assert "proposal" in out.cannot_judge
    assert out.credibility.shape == (200,)
    assert out.effective_sample_size.shape == (200,)


def _exact_posterior(x, sigma=SIGMA):
    """N(mu, s^2 I) of a N(0, I) prior and x ~ N(theta, sigma^2 I)."""
    precision = 1 + 1 / sigma**2
    return x / sigma**2 / precision, precision**-0.5


def test_credibility_matches_the_closed_form_with_prior_and_posterior_proposals():
    """Gaussian posterior: the HPD credibility is F_chi2_D(|theta - mu|^2 / s^2). Both
    proposals estimate it per pair (the truth's weight and V add at most 1/ESS); a
    proposal near the posterior (a widened Gaussian posterior, as a flow would give)
    has a far larger ESS and a smaller error."""
    d = 2
    prior = gaussian_prior(d)
    post = cl.UnnormalizedPosterior(likelihood(), prior=prior)
    theta, x = simulate(prior, 400, seed=7)
    mu, s = _exact_posterior(x)
    exact = torch.as_tensor(stats.chi2.cdf((((theta - mu) / s) ** 2).sum(-1).numpy(), d))

    def near(x_):
        m, sd = _exact_posterior(x_)
        return Independent(Normal(m, 1.3 * sd * torch.ones_like(m)), 1)

    by_prior = run(post, theta, x, seed=0)
    by_flow = run(post, theta, x, seed=0, proposal=cl.as_posterior(near))
    for out, spread in ((by_prior, 0.05), (by_flow, 0.02)):
        error = out.credibility - exact  # Monte Carlo sd about 0.5 / sqrt(ESS) per pair
        assert error.abs().mean() < spread, error
        assert abs(float(error.mean())) < 0.01, error
    assert abs(float(by_prior.coverage_error - by_flow.coverage_error)) < 0.02
    assert float(by_flow.ess_median) > 3 * float(by_prior.ess_median)


def test_functional_exact_uniformity_at_tiny_ess():
    """With the truth's own weight, the credibility is exactly U(0, 1) even at M = 3
    draws (ESS about 1): 4000 pairs pass a KS test; the guard then refuses to judge."""
    g = torch.Generator().manual_seed(1)
    n, m = 4000, 3
    theta = torch.randn(n, generator=g, dtype=torch.float64)
    x = theta + 0.05 * torch.randn(n, generator=g, dtype=torch.float64)
    draws = torch.randn(m, n, generator=g, dtype=torch.float64)

    def log_q(t):
        return -0.5 * ((x - t) / 0.05) ** 2 - 0.5 * t**2

    c, ess = importance_credibility(log_q(draws), -0.5 * draws**2, log_q(theta),
                                    -0.5 * theta**2, generator=g)  # fmt: skip
    assert stats.kstest(c.numpy(), "uniform").pvalue > 0.01
    assert float(ess.median()) < 3
    assert importance_coverage(c, ess).cannot_judge is not None


def test_truth_outside_the_proposal_is_an_error():
    prior = box_prior(1)
    post = cl.UnnormalizedPosterior(likelihood(), prior=prior)
    theta = torch.tensor([[0.0], [3.0]])
    with pytest.raises(ValueError, match="log_proposal_theta"):
        run(post, theta, torch.zeros(2, 1), seed=0)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"num_proposal_samples": 0}, "num_proposal_samples"),
        ({"min_ess": -1.0}, "min_ess"),
        ({"num_bins": 1}, "num_bins"),
        ({"num_ecdf_points": 0}, "num_ecdf_points"),
        ({"seed": 1.5}, "seed"),
        ({"max_chunk_elements": 0}, "max_chunk_elements"),
        ({"proposal": "prior"}, "proposal"),
        ({"proposal": "adaptive", "num_proposal_samples": 7}, "num_proposal_samples"),
    ],
)
def test_bad_arguments_name_themselves(kwargs, name):
    with pytest.raises(ValueError, match=name):
        cl.ImportanceCoverage(**kwargs)


def test_bad_inputs_name_themselves():
    prior = gaussian_prior(2)
    post = cl.UnnormalizedPosterior(likelihood(), prior=prior)
    with pytest.raises(ValueError, match="proposal"):
        cl.ImportanceCoverage(proposal=post)  # no sampler
    metric = cl.ImportanceCoverage()
    with pytest.raises(ValueError, match="theta"):
        metric.update(post, torch.zeros(4, 3), torch.zeros(4, 2))
    with pytest.raises(ValueError, match="UnnormalizedPosterior"):
        metric.update(cl.as_posterior(lambda x: prior), torch.zeros(4, 2), torch.zeros(4, 2))
    with pytest.raises(ValueError, match="N >= 2"):
        metric.compute()
    with pytest.raises(ValueError, match="log_target"):
        importance_credibility(torch.zeros(3, 2), torch.zeros(3, 1), torch.zeros(2),
                               torch.zeros(2))  # fmt: skip
    with pytest.raises(ValueError, match="log_target_theta"):
        importance_credibility(torch.zeros(3, 2), torch.zeros(3, 2), torch.zeros(3),
                               torch.zeros(2))  # fmt: skip
    with pytest.raises(ValueError, match="credibility"):
        importance_coverage(torch.tensor([0.5, 1.5]), torch.ones(2))


def test_draws_of_a_pair_split_over_chunks():
    """max_chunk_elements = 50 splits each pair's 400 proposal draws over chunks: the
    credibilities still match the closed form, the ESS that of one block."""
    prior = gaussian_prior(2)
    post = cl.UnnormalizedPosterior(likelihood(), prior=prior)
    theta, x = simulate(prior, 40, seed=11)
    mu, s = _exact_posterior(x)
    exact = torch.as_tensor(stats.chi2.cdf((((theta - mu) / s) ** 2).sum(-1).numpy(), 2))

    def near(x_):
        m, sd = _exact_posterior(x_)
        return Independent(Normal(m, 1.3 * sd * torch.ones_like(m)), 1)

    outs = [
        run(post, theta, x, seed=0, proposal=cl.as_posterior(near), num_proposal_samples=400,
            max_chunk_elements=chunk)
        for chunk in (None, 50)
    ]  # fmt: skip
    for out in outs:
        assert out.credibility.shape == (40,)
        assert (out.credibility - exact).abs().mean() < 0.03
    ratio = outs[1].effective_sample_size / outs[0].effective_sample_size
    assert bool(((ratio > 0.8) & (ratio < 1.25)).all()), ratio


@pytest.mark.parametrize("with_proposal", [False, True, "adaptive"])
def test_a_seed_gives_the_same_result_on_the_same_data(with_proposal):
    """Same data, same seed: the same credibilities whatever torch's global state, with
    the prior or a proposal (before: a proposal's draws came from the global generator,
    so seed= fixed only V). Under DDP each rank has its own stream: rank 1's draws differ
    from rank 0's, which are those of one process."""
    from calib_lightning.metrics import importance

    prior = gaussian_prior(2)
    post = cl.UnnormalizedPosterior(likelihood(), prior=prior)
    theta, x = simulate(prior, 30, seed=12)

    def near(x_):
        m, sd = _exact_posterior(x_)
        return Independent(Normal(m, 1.3 * sd * torch.ones_like(m)), 1)

    kwargs = {"proposal": cl.as_posterior(near)} if with_proposal is True else {}
    kwargs = {"proposal": "adaptive"} if with_proposal == "adaptive" else kwargs
    outs = []
    for global_seed in (1, 2):
        torch.manual_seed(global_seed)
        outs.append(run(post, theta, x, seed=0, num_proposal_samples=300, **kwargs))
    torch.testing.assert_close(outs[0].credibility, outs[1].credibility, rtol=0, atol=0)
    torch.testing.assert_close(outs[0].effective_sample_size, outs[1].effective_sample_size)
    other = run(post, theta, x, seed=1, num_proposal_samples=300, **kwargs)
    assert not torch.equal(outs[0].credibility, other.credibility)

    class Rank1:
        is_available = staticmethod(lambda: True)
        is_initialized = staticmethod(lambda: True)
        get_rank = staticmethod(lambda: 1)

    real = importance.dist
    importance.dist = Rank1
    try:
        on_rank_1 = run(post, theta, x, seed=0, num_proposal_samples=300, **kwargs)
    finally:
        importance.dist = real
    assert not torch.equal(outs[0].credibility, on_rank_1.credibility)


# -- the adaptive proposal ----------------------------------------------------------------
@pytest.mark.parametrize("prior_kind", ["gaussian", "box"])
def test_adaptive_credibilities_are_exactly_uniform_where_the_prior_cannot_judge(prior_kind):
    """D = 5, sigma = 0.5: the prior as proposal leaves a median ESS under 50 (cannot
    judge); the adaptive proposal, fitted from x alone, judges (median ESS > 50) and its
    2,000 credibilities of an exact posterior are uniform (KS at 0.001), with the
    default M = 1,000."""
    d = 5
    prior = (gaussian_prior if prior_kind == "gaussian" else box_prior)(d)
    post = cl.UnnormalizedPosterior(likelihood(), prior=prior)
    theta, x = simulate(prior, 2000, seed=21)
    by_prior = run(post, theta[:200], x[:200], seed=0)
    assert by_prior.cannot_judge is not None
    assert float(by_prior.ess_median) < 50
    adaptive = run(post, theta, x, seed=0, proposal="adaptive")
    assert adaptive.cannot_judge is None
    assert float(adaptive.ess_median) > 50
    assert stats.kstest(adaptive.credibility.numpy(), "uniform").pvalue > 1e-3
    assert float(adaptive.global_p_value) > 1e-3


def test_adaptive_finds_the_tempered_likelihood_and_its_sign():
    """D = 5, Gaussian prior: tau = 1.5 (over-confident) is rejected with a negative
    coverage error, tau = 0.6 with a positive one, N = 300, where the prior as proposal
    cannot judge."""
    d = 5
    prior = gaussian_prior(d)
    theta, x = simulate(prior, 300, seed=22)
    for tau, sign in ((1.5, -1), (0.6, 1)):
        post = cl.UnnormalizedPosterior(likelihood(tau), prior=prior)
        out = run(post, theta, x, seed=0, proposal="adaptive")
        assert float(out.global_p_value) < 0.01, (tau, out.global_p_value)
        assert sign * float(out.coverage_error) > 0, (tau, out.coverage_error)


def test_adaptive_level_over_fresh_datasets():
    """Level through the public class (proposal='adaptive', other arguments at their
    defaults): 100 fresh datasets of 100 pairs at D = 2 and at D = 5 for each prior
    (400 in all), rejection rate at 0.05 in the 99 % binomial band."""
    p_values = []
    for make in (gaussian_prior, box_prior):
        for d in (2, 5):
            post = cl.UnnormalizedPosterior(likelihood(), prior=make(d))
            for rep in range(100):
                theta, x = simulate(make(d), 100, seed=5000 + 100 * d + rep)
                out = run(post, theta, x, seed=rep, proposal="adaptive")
                assert out.cannot_judge is None, out.cannot_judge
                p_values.append(float(out.global_p_value))
    rate = sum(p <= 0.05 for p in p_values) / len(p_values)
    low, high = binomial_band(len(p_values))
    assert low <= rate <= high, rate
