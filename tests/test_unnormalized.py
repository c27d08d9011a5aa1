"""Unnormalized posteriors exp f(theta, x) p(theta): the adapter's closed-form scores, the
unconstrained space of a bounded prior, the checks that must refuse it, and KCCSD's level
and power on exact unnormalized posteriors (Gaussian likelihood times a box or a
Gaussian prior)."""

import math

import pytest
import torch
from scipy import stats
from torch.distributions import Independent, Normal, Uniform

import calib_lightning as cl
from calib_lightning.functional import gaussian_base_points, kccsd
from calib_lightning.posteriors import UnsupportedError

F64 = torch.float64
S = 0.5  # likelihood scale: x ~ N(theta, S^2 I)


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _box(d, dtype=F64):
    return Independent(Uniform(-2 * torch.ones(d, dtype=dtype), 2 * torch.ones(d, dtype=dtype)), 1)


def _gauss(d, dtype=F64):
    return Independent(Normal(torch.zeros(d, dtype=dtype), torch.ones(d, dtype=dtype)), 1)


def _log_lik(tau=1.0):
    def log_lik(theta, x):
        return -0.5 * tau * ((x - theta) ** 2).sum(-1) / S**2

    return log_lik


# -- the adapter ------------------------------------------------------------------------


def test_score_is_the_closed_form_of_a_gaussian_likelihood_and_prior():
    g = _gen(0)
    theta, x = torch.randn(2, 7, 3, generator=g, dtype=F64)
    post = cl.UnnormalizedPosterior(_log_lik(), prior=_gauss(3))
    expected = (x - theta) / S**2 - theta
    torch.testing.assert_close(post.score(theta, x), expected)
    # leading dimensions (*, N, D), as the base points are scored
    stacked = torch.stack([theta, 2 * theta])
    torch.testing.assert_close(post.score(stacked, x)[1], (x - 2 * theta) / S**2 - 2 * theta)
    assert post.unconstrained() is None  # the prior's support is R^D already


def test_unconstrained_score_of_a_box_is_the_chain_rule_with_the_log_jacobian():
    """theta = a + (b - a) sigmoid(u): s_u = s_theta (b - a) sig (1 - sig) + 1 - 2 sig."""
    g = _gen(1)
    theta = torch.rand(9, 2, generator=g, dtype=F64) * 4 - 2
    x = theta + S * torch.randn(9, 2, generator=g, dtype=F64)
    post = cl.UnnormalizedPosterior(_log_lik(), prior=_box(2))
    u = post.to_unconstrained(theta)
    sig = torch.sigmoid(u)
    torch.testing.assert_close(-2 + 4 * sig, theta)
    expected = (x - theta) / S**2 * 4 * sig * (1 - sig) + 1 - 2 * sig
    torch.testing.assert_close(post.unconstrained().score(u, x), expected)
    # outside the box the density is zero: the score is NaN (no torch validation error)
    outside = torch.full((9, 2), 3.0, dtype=F64)
    assert post.score(outside, x).isnan().all()
    with pytest.raises(ValueError, match="theta must lie inside the prior"):
        post.to_unconstrained(outside)


def test_uniform_with_a_batch_shape_is_a_prior_too():
    prior = Uniform(-2 * torch.ones(2, dtype=F64), 2 * torch.ones(2, dtype=F64))
    post = cl.UnnormalizedPosterior(_log_lik(), prior=prior)
    theta = torch.zeros(4, 2, dtype=F64)
    x = torch.ones(4, 2, dtype=F64)
    torch.testing.assert_close(post.score(theta, x), x / S**2)
    torch.testing.assert_close(post.unconstrained().score(theta, x), x / S**2)  # sig' = 1/4


def test_score_keeps_the_graph_of_the_models_parameters():
    scale = torch.nn.Parameter(torch.tensor(2.0, dtype=F64))

    def log_lik(theta, x):
        return -0.5 * scale * ((x - theta) ** 2).sum(-1)

    post = cl.UnnormalizedPosterior(log_lik, prior=_gauss(2))
    theta, x = torch.zeros(3, 2, dtype=F64), torch.ones(3, 2, dtype=F64)
    score = post.score(theta, x, create_graph=True)
    (grad,) = torch.autograd.grad(score.sum(), scale)
    assert float(grad) == pytest.approx(6.0)  # d/dscale of sum(scale * (x - theta))


def test_bad_inputs_name_the_argument():
    with pytest.raises(ValueError, match="prior must be"):
        cl.UnnormalizedPosterior(_log_lik(), prior=None)
    with pytest.raises(ValueError, match="prior must have event shape"):
        cl.UnnormalizedPosterior(_log_lik(), prior=Normal(torch.zeros(2, 2), 1.0))
    with pytest.raises(ValueError, match="log_likelihood must be a callable"):
        cl.UnnormalizedPosterior(3.0, prior=_gauss(2))
    post = cl.UnnormalizedPosterior(lambda theta, x: theta, prior=_gauss(2))
    with pytest.raises(ValueError, match=r"log_likelihood must return shape \(M,\)"):
        post.score(torch.zeros(3, 2), torch.zeros(3, 2))
    post = cl.UnnormalizedPosterior(_log_lik(), prior=_gauss(2))
    with pytest.raises(ValueError, match="theta must have D = 2 columns"):
        post.score(torch.zeros(3, 4), torch.zeros(3, 2))
    with pytest.raises(ValueError, match="prior must be given only with"):
        cl.as_posterior(lambda x: Independent(Normal(x, 1.0), 1), prior=_gauss(2))


def _update_and_compute(metric, post, theta, x):
    metric.update(post, theta, x)
    return metric.compute()


def test_checks_that_need_samples_latents_or_densities_refuse_it():
    post = cl.UnnormalizedPosterior(_log_lik(), prior=_gauss(2, torch.float32))
    theta = torch.randn(50, 2, generator=_gen(2))
    x = theta + S * torch.randn(50, 2, generator=_gen(3))
    for metric, needs in ((cl.RankCalibration(), "sample"), (cl.TARP(), "sample"),
                          (cl.LC2STNF(x[:2]), "to_latent")):  # fmt: skip
        with pytest.raises(UnsupportedError, match=f"does not provide {needs}"):
            _update_and_compute(metric, post, theta, x)
    with pytest.raises(UnsupportedError, match="does not provide log_prob"):
        post.log_prob(theta, x)
    # cl.diagnose runs what needs no sample and lists the rest as skipped
    report = cl.diagnose(post, theta, x, prior=_gauss(2, torch.float32))
    assert "kccsd" in report.checks
    assert "needs posterior samples" in report.skipped["ranks"]
    out = cl.KCCSD().update(post, theta, x)  # scores only: it runs
    assert out is None


# -- KCCSD's level and power on exact unnormalized posteriors ---------------------------


def _datasets(prior, reps, n, seed):
    """``reps`` fresh calibration sets of ``n`` pairs: theta ~ prior, x ~ N(theta, S^2)."""
    g = _gen(seed)
    d = prior.event_shape[0]
    if isinstance(prior.base_dist, Uniform):
        theta = torch.rand(reps, n, d, generator=g, dtype=F64) * 4 - 2
    else:
        theta = torch.randn(reps, n, d, generator=g, dtype=F64)
    return theta, theta + S * torch.randn(reps, n, d, generator=g, dtype=F64)


def _p_values(post, theta, x, seed=0, transform=True):
    """KCCSD p-values of ``reps`` datasets ``(reps, n, D)`` in one batched call: the
    metric's procedure (its space, 32 base points fitted to each set's own truths, the
    default kernels and 500 bootstrap draws), vectorized over the sets."""
    reps, n, d = theta.shape
    if transform and isinstance(post, cl.UnnormalizedPosterior) and post.unconstrained():
        theta, post = post.to_unconstrained(theta), post.unconstrained()
    flat_t, flat_x = theta.reshape(-1, d), x.reshape(reps * n, -1)
    score = post.score(flat_t, flat_x).reshape(reps, n, d)
    base = torch.stack([gaussian_base_points(t, 32, _gen(seed)) for t in theta])  # (R, m, D)
    z = base[:, :, None].expand(reps, 32, n, d).permute(1, 0, 2, 3).reshape(32, reps * n, d)
    base_scores = post.score(z, flat_x).reshape(32, reps, n, d).permute(1, 2, 0, 3)
    return kccsd(theta, score, base_scores, generator=_gen(seed + 1)).p_value


def _band(reps, alpha=0.05):
    lo, hi = stats.binom.interval(0.99, reps, alpha)
    return lo / reps, hi / reps


@pytest.mark.parametrize("d", [1, 2, 5])
@pytest.mark.parametrize("prior", ["box", "gaussian"])
def test_kccsd_holds_its_level_on_the_exact_unnormalized_posterior(prior, d):
    """400 fresh sets of 100 pairs, the exact posterior N(x, S^2) p(theta), up to a
    constant: rejections at 0.05 inside the 99 % binomial band."""
    p = _box(d) if prior == "box" else _gauss(d)
    post = cl.UnnormalizedPosterior(_log_lik(), prior=p)
    theta, x = _datasets(p, 400, 100, seed=10 + d)
    rate = float((_p_values(post, theta, x) <= 0.05).double().mean())
    lo, hi = _band(400)
    assert lo <= rate <= hi, f"{prior} D={d}: rejection rate {rate:.3f} outside [{lo}, {hi}]"


def test_the_metric_tests_a_box_posterior_in_the_unconstrained_space():
    """The public metric on a few fresh sets: it says where it tested, and its p-values
    are spread like the batched procedure's (level measured above)."""
    p = _box(2)
    post = cl.UnnormalizedPosterior(_log_lik(), prior=p)
    theta, x = _datasets(p, 30, 100, seed=5)
    ps = []
    for t, xx in zip(theta, x, strict=True):
        metric = cl.KCCSD()
        metric.update(post, t, xx)
        out = metric.compute()
        assert out.space == "unconstrained"
        ps.append(float(out.p_value))
    assert stats.kstest(ps, "uniform").pvalue > 0.01
    flow = cl.KCCSD()
    flow.update(lambda x: Independent(Normal(x, S), 1), theta[0], x[0])
    assert flow.compute().space is None  # posteriors without a prior: tested on theta


def test_without_the_transform_the_truncated_posterior_is_rejected():
    """In theta space the score of the box posterior is the untruncated Gaussian's,
    (x - theta) / S^2: the Stein identity misses the boundary term and the test rejects a
    calibrated posterior far above its level (measured: see the report)."""
    p = _box(2)
    theta, x = _datasets(p, 400, 100, seed=7)
    untruncated = cl.as_posterior(lambda x: Independent(Normal(x, S), 1))
    rate = float((_p_values(untruncated, theta, x) <= 0.05).double().mean())
    assert rate > _band(400)[1], rate


@pytest.mark.parametrize(("tau", "reps", "n", "power"), [(1.5, 30, 1000, 0.4), (0.6, 50, 500, 0.7)])
def test_kccsd_rejects_a_tempered_ratio(tau, reps, n, power):
    """tau * log r on a box prior: over-confident (1.5; measured 0.60 of 30 sets of 1,000
    pairs rejected) and under-confident (0.6; 0.92 of 50 sets of 500), against 0.05 at
    the level. Over-confidence by tau = 1.5 (a posterior 0.82 times as wide) is the harder
    one for KCCSD."""
    p = _box(2)
    post = cl.UnnormalizedPosterior(_log_lik(tau), prior=p)
    theta, x = _datasets(p, reps, n, seed=21)
    rate = float((_p_values(post, theta, x) <= 0.05).double().mean())
    assert rate > power, rate


def test_constants_in_x_do_not_change_the_score():
    f = _log_lik()
    post = cl.UnnormalizedPosterior(f, prior=_box(2))
    shifted = cl.UnnormalizedPosterior(lambda t, x: f(t, x) + x.sum(-1) ** 3, prior=_box(2))
    theta = torch.zeros(5, 2, dtype=F64)
    x = torch.randn(5, 2, generator=_gen(4), dtype=F64)
    torch.testing.assert_close(post.score(theta, x), shifted.score(theta, x))
    assert math.isfinite(float(post.unnormalized_log_prob(theta, x).sum()))
