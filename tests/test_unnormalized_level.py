"""Level of the checks of unnormalized posteriors through the public classes, as a user
runs them: ``cl.KCCSD()`` and ``cl.ImportanceCoverage()`` at their default arguments, one
fresh dataset of 100 pairs per repetition, 400 repetitions per cell. The exact posterior
``exp f(theta, x) p(theta)`` with ``x ~ N(theta, 0.5^2 I)`` and a box or Gaussian prior,
D = 1, 2, 5. The whole table, with power against tempered and shifted likelihoods, is
``examples/benchmarks/results/unnormalized_level.md``."""

import pytest
import torch
from scipy import stats
from torch.distributions import Independent, Normal, Uniform

import calib_lightning as cl

SIGMA, PAIRS, REPS = 0.5, 100, 400


def _prior(kind, d):
    if kind == "box":
        return Independent(Uniform(-2 * torch.ones(d), 2 * torch.ones(d)), 1)
    return Independent(Normal(torch.zeros(d), torch.ones(d)), 1)


def _log_lik(theta, x):
    return -0.5 * (((x - theta) / SIGMA) ** 2).sum(-1)


def _band(reps):
    low, high = stats.binom.interval(0.99, reps, 0.05)
    return low / reps, high / reps


def _rejections(kind, d, seed, metric_of):
    prior = _prior(kind, d)
    post = cl.UnnormalizedPosterior(_log_lik, prior=prior)
    torch.manual_seed(seed)
    p_values = []
    for _ in range(REPS):
        theta = prior.sample((PAIRS,))
        x = theta + SIGMA * torch.randn_like(theta)
        metric, read = metric_of()
        metric.update(post, theta, x)
        p_values.append(read(metric.compute()))
    return p_values


@pytest.mark.parametrize("d", [1, 2, 5])
@pytest.mark.parametrize("kind", ["box", "gaussian"])
def test_kccsd_at_its_defaults_holds_its_level(kind, d):
    p = _rejections(kind, d, 10 * d, lambda: (cl.KCCSD(), lambda r: float(r.p_value)))
    rate = sum(v <= 0.05 for v in p) / REPS
    low, high = _band(REPS)
    assert low <= rate <= high, f"{kind} D={d}: {rate:.3f} outside [{low:.3f}, {high:.3f}]"


@pytest.mark.parametrize("d", [1, 2])
@pytest.mark.parametrize("kind", ["box", "gaussian"])
def test_importance_coverage_at_its_defaults_holds_its_level(kind, d):
    def metric_of():
        return cl.ImportanceCoverage(), lambda r: (r.cannot_judge, float(r.global_p_value))

    out = _rejections(kind, d, 100 + 10 * d, metric_of)
    assert all(reason is None for reason, _ in out)  # the prior proposal suffices here
    rate = sum(p <= 0.05 for _, p in out) / REPS
    low, high = _band(REPS)
    assert low <= rate <= high, f"{kind} D={d}: {rate:.3f} outside [{low:.3f}, {high:.3f}]"


def test_importance_coverage_in_d5_cannot_judge_with_the_prior_and_holds_with_a_proposal():
    """D = 5 with the prior as proposal: a median ESS of a few draws, so no p-value (the
    reason names the ESS); a Gaussian proposal N(x, 1) around the posterior: the level."""
    prior = _prior("gaussian", 5)
    post = cl.UnnormalizedPosterior(_log_lik, prior=prior)
    torch.manual_seed(5)
    theta = prior.sample((PAIRS,))
    x = theta + SIGMA * torch.randn_like(theta)
    metric = cl.ImportanceCoverage()
    metric.update(post, theta, x)
    out = metric.compute()
    assert out.cannot_judge is not None
    assert "effective sample size" in out.cannot_judge
    assert torch.isnan(out.global_p_value)

    def metric_of():
        proposal = cl.ImportanceCoverage(
            proposal=lambda x: Independent(Normal(x, torch.ones_like(x)), 1))
        return proposal, lambda r: (r.cannot_judge, float(r.global_p_value))

    p = _rejections("gaussian", 5, 500, metric_of)
    assert all(reason is None for reason, _ in p)
    rate = sum(v <= 0.05 for _, v in p) / REPS
    low, high = _band(REPS)
    assert low <= rate <= high, rate
