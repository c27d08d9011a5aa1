"""lampe's estimators through cl.as_posterior: NPE and FMPE as posteriors, NRE as an
unnormalized posterior given its prior, AMNRE refused (each failed before: a lampe
estimator is a callable of (theta, x) and was taken for a callable x -> Distribution)."""

import pytest
import torch
from torch.distributions import Independent, Normal, Uniform

import calib_lightning as cl

inference = pytest.importorskip("lampe.inference")


def _box(d: int = 2) -> Independent:
    return Independent(Uniform(-3 * torch.ones(d), 3 * torch.ones(d)), 1)


def test_npe_is_its_flow() -> None:
    torch.manual_seed(0)
    npe = inference.NPE(2, 3)
    post = cl.as_posterior(npe)
    theta, x = torch.randn(5, 2), torch.randn(5, 3)
    torch.testing.assert_close(post.log_prob(theta, x), npe(theta, x))
    assert post.sample(x, 7).shape == (7, 5, 2)
    assert {"sample", "log_prob", "score", "to_latent"} <= post.capabilities
    z = post.to_latent(theta, x)
    torch.testing.assert_close(z, npe.flow(x).transform(theta))


def test_fmpe_samples_and_is_costly() -> None:
    torch.manual_seed(0)
    fmpe = inference.FMPE(2, 3)
    post = cl.as_posterior(fmpe)
    assert post.sample(torch.randn(4, 3), 6).shape == (6, 4, 2)
    assert post.costly == frozenset({"log_prob", "score"})


def test_nre_needs_its_prior() -> None:
    nre = inference.NRE(2, 3)
    with pytest.raises(ValueError, match=r"lampe NRE .*prior=prior"):
        cl.as_posterior(nre)
    with pytest.raises(ValueError, match="prior must be given only"):
        cl.as_posterior(inference.NPE(2, 3), prior=_box())
    with pytest.raises(ValueError, match="lampe NPE"):
        cl.UnnormalizedPosterior(inference.NPE(2, 3), prior=_box())
    with pytest.raises(ValueError, match=r"AMNRE.*fix its mask"):
        cl.as_posterior(inference.AMNRE(2, 3), prior=_box())


def test_nre_score_is_log_ratio_plus_log_prior() -> None:
    torch.manual_seed(0)
    nre, prior = inference.NRE(2, 3), Independent(Normal(torch.zeros(2), torch.ones(2)), 1)
    post = cl.as_posterior(nre, prior=prior)
    assert isinstance(post, cl.UnnormalizedPosterior)
    theta, x = torch.randn(6, 2, requires_grad=True), torch.randn(6, 3)
    (expected,) = torch.autograd.grad((nre(theta, x) + prior.log_prob(theta)).sum(), theta)
    torch.testing.assert_close(post.score(theta.detach(), x), expected)


def test_trained_nre_through_kccsd_on_a_box() -> None:
    """A lampe NRE trained a few steps (its own loss) on x ~ N(theta, 0.5^2) with a box
    prior: KCCSD runs from scores in the unconstrained space and gives a p-value."""
    gen = torch.Generator().manual_seed(0)
    prior = _box()
    torch.manual_seed(0)
    nre = inference.NRE(2, 2)
    loss_fn, opt = inference.NRELoss(nre), torch.optim.Adam(nre.parameters(), 1e-3)
    for _ in range(50):
        theta = prior.sample((256,))
        loss = loss_fn(theta, theta + 0.5 * torch.randn(256, 2))
        opt.zero_grad()
        loss.backward()
        opt.step()
    theta = 6 * torch.rand(200, 2, generator=gen) - 3
    x = theta + 0.5 * torch.randn(200, 2, generator=gen)
    metric = cl.KCCSD()
    metric.update(cl.as_posterior(nre, prior=prior), theta, x)
    result = metric.compute()
    assert result.space == "unconstrained"
    assert 0.0 <= float(result.p_value) <= 1.0
