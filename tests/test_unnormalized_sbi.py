"""sbi's ratio and likelihood estimators and MCMC posteriors: refused as posteriors
without their prior (they are not posteriors), checked by KCCSD through their scores
with it."""

import pytest
import torch

import calib_lightning as cl

sbi = pytest.importorskip("sbi")
from sbi.inference import BNRE, NLE, NRE_A, NRE_B, NRE_C  # noqa: E402
from sbi.utils import BoxUniform  # noqa: E402

S = 0.3


def _task(n, seed):
    g = torch.Generator().manual_seed(seed)
    theta = torch.rand(n, 2, generator=g) * 4 - 2
    return theta, theta + S * torch.randn(n, 2, generator=g)


@pytest.fixture(scope="module")
def prior():
    return BoxUniform(-2 * torch.ones(2), 2 * torch.ones(2))


def _train(trainer_class, prior, epochs=2):
    torch.manual_seed(0)
    trainer = trainer_class(prior, show_progress_bars=False)
    theta, x = _task(1000, 0)
    estimator = trainer.append_simulations(theta, x).train(
        max_num_epochs=epochs, show_train_summary=False
    )
    return trainer, estimator


@pytest.fixture(scope="module")
def nle(prior):
    return _train(NLE, prior)


def test_a_likelihood_estimator_is_refused_as_a_posterior(nle, prior):
    """Before: cl.as_posterior(nle_estimator) was an SbiPosterior, and KCCSD checked
    q(x | theta) as if it were q(theta | x) (p = 0.012 in issue 43): a silent number."""
    _, estimator = nle
    theta, x = _task(200, 1)
    with pytest.raises(ValueError, match=r"likelihood estimator q\(x \| theta\).*prior=prior"):
        cl.as_posterior(estimator)
    with pytest.raises(ValueError, match="likelihood estimator"):
        cl.KCCSD().update(estimator, theta, x)
    post = cl.as_posterior(estimator, prior=prior)
    assert isinstance(post, cl.UnnormalizedPosterior)
    metric = cl.KCCSD()
    metric.update(post, theta, x)
    out = metric.compute()
    assert out.space == "unconstrained"
    assert 0.0 <= float(out.p_value) <= 1.0


@pytest.mark.parametrize("trainer_class", [NRE_A, NRE_B, NRE_C, BNRE])
def test_a_ratio_estimator_is_refused_as_a_posterior(trainer_class, prior):
    """Before: a DistributionPosterior, then a raw TypeError from unnormalized_log_ratio."""
    _, estimator = _train(trainer_class, prior, epochs=1)
    theta, x = _task(100, 2)
    with pytest.raises(ValueError, match=r"ratio estimator r\(theta, x\).*prior=prior"):
        cl.as_posterior(estimator)
    post = cl.as_posterior(estimator, prior=prior)
    # log r + log p by autograd, against the estimator's own log-ratio
    leaf = theta.clone().requires_grad_(True)
    (expected,) = torch.autograd.grad(estimator.unnormalized_log_ratio(leaf, x).sum(), leaf)
    torch.testing.assert_close(post.score(theta, x), expected)


def test_likelihood_score_and_mcmc_posterior_agree(nle, prior):
    """The likelihood adapter is log q(x_i | theta_i) + log p(theta_i) pair by pair (sbi's
    shapes: x (1, N, X), condition theta (N, D)); an MCMCPosterior goes through its
    potential's estimator and prior to the same scores."""
    trainer, estimator = nle
    theta, x = _task(50, 3)
    post = cl.as_posterior(estimator, prior=prior)
    leaf = theta.clone().requires_grad_(True)
    log_q = torch.stack([estimator.log_prob(x[i : i + 1][None], condition=leaf[i : i + 1])[0, 0]
                         for i in range(50)])  # fmt: skip
    (expected,) = torch.autograd.grad(log_q.sum(), leaf)
    torch.testing.assert_close(post.score(theta, x), expected)
    mcmc = cl.as_posterior(trainer.build_posterior(estimator))
    assert isinstance(mcmc, cl.UnnormalizedPosterior)
    torch.testing.assert_close(mcmc.score(theta, x), expected)
    metric = cl.KCCSD()
    metric.update(trainer.build_posterior(estimator), theta, x)  # raw: adapted by the metric
    assert metric.compute().space == "unconstrained"


def test_a_potential_of_the_users_is_used_as_it_is(nle, prior):
    """Before: an MCMCPosterior over a subclass of sbi's potential (here tempered,
    tau log q + log p) was checked through the potential's estimator, as if it were
    untempered: the user's change was silently dropped."""
    from sbi.inference import MCMCPosterior

    trainer, estimator = nle
    built = trainer.build_posterior(estimator)
    base = type(built.potential_fn)

    class Tempered(base):
        def __call__(self, theta, track_gradients=True):
            out = base.__call__(self, theta, track_gradients)
            log_p = self.prior.log_prob(theta)
            return 1.5 * (out - log_p) + log_p

    tempered = Tempered(estimator, prior, x_o=None)
    theta, x = _task(40, 4)
    untempered = cl.as_posterior(estimator, prior=prior)
    post = cl.as_posterior(MCMCPosterior(tempered, proposal=prior))
    assert isinstance(post, cl.UnnormalizedPosterior)
    with torch.no_grad():
        expected = 1.5 * untempered.log_likelihood(theta, x)
        torch.testing.assert_close(post.log_likelihood(theta, x), expected)
    # the box prior's log-density is flat inside: the score is the tempered likelihood's
    torch.testing.assert_close(post.score(theta, x), 1.5 * untempered.score(theta, x))
