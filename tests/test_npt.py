"""The NPT perturbation suite (``tasks/npt.py``): exact posterior, closed forms, latents."""

import pytest
import torch
from scipy import stats

from calib_lightning.posteriors import as_posterior
from calib_lightning.tasks import NPT_MODES, MultivariateT, NPTGaussian


def test_the_exact_posterior_is_bayes_rule_of_the_forward_model():
    # theta from the prior, x from theta: the whitened truths are standard normal
    task = NPTGaussian(dim=3, dtype=torch.float64)
    g = torch.Generator().manual_seed(0)
    n = 20_000
    eps = torch.randn(3, n, 3, generator=g, dtype=torch.float64)
    theta = 1.0 + eps[0] @ task.prior_tril.T
    s = 0.5 + torch.rand(n, 3, generator=g, dtype=torch.float64)
    x = torch.cat([theta + s * eps[1], s.log()], -1)
    z = as_posterior(task.case("covariance", 0.0)[1]).to_latent(theta, x)
    assert z.mean(0).abs().max() < 0.03
    assert (torch.cov(z.T) - torch.eye(3, dtype=torch.float64)).abs().max() < 0.04


def test_the_covariance_turns_with_x_and_the_cases_do_what_they_say():
    task = NPTGaussian(dim=3, dtype=torch.float64)
    x = task.sample_x(50, torch.Generator().manual_seed(1))
    mean, cov = task.moments(x)
    first = torch.linalg.eigh(cov).eigenvectors[:, :, 0].abs()
    assert float((first - first[0]).abs().max()) > 0.1  # eigenvectors depend on x
    shifted = task.case("mean_shift", 0.1)[1](x)
    assert torch.allclose(shifted.loc, 1.1 * mean)
    inflated = task.case("covariance", 0.5)[1](x)
    assert torch.allclose(inflated.covariance_matrix, 1.5 * cov)
    wide = task.case("anisotropic", 0.3)[1](x).covariance_matrix - cov
    assert torch.allclose(torch.linalg.eigvalsh(wide)[:, -1], torch.full((50,), 0.3).double())
    truth, estimate = task.case("mode_collapse", 0.2)
    assert torch.allclose(truth(x).mixture_distribution.probs[:, 1], torch.tensor(0.2).double())
    assert torch.allclose(estimate(x).loc, mean)
    assert torch.allclose(task.case("blind_prior")[1](x).loc, torch.ones(50, 3).double())


def test_the_multivariate_t_matches_scipy_and_its_latent_is_standard_normal():
    loc = torch.tensor([[0.5, -1.0]], dtype=torch.float64)
    tril = torch.tensor([[[1.0, 0.0], [0.6, 0.8]]], dtype=torch.float64)
    t = MultivariateT(loc, tril, df=3.0)
    value = torch.tensor([[1.0, 2.0]], dtype=torch.float64)
    reference = stats.multivariate_t(loc[0].numpy(), (tril[0] @ tril[0].T).numpy(), df=3.0)
    assert float(t.log_prob(value)) == pytest.approx(reference.logpdf(value[0].numpy()), abs=1e-10)
    torch.manual_seed(0)
    draws = MultivariateT(loc.expand(4000, 2), tril.expand(4000, 2, 2), df=3.0).sample()
    z = as_posterior(lambda x: MultivariateT(loc.expand(4000, 2), tril.expand(4000, 2, 2), 3.0)
                     ).to_latent(draws, torch.zeros(4000, 1, dtype=torch.float64))  # fmt: skip
    assert stats.kstest(z.flatten().numpy(), "norm").pvalue > 0.01
    assert stats.kstest(z.square().sum(-1).numpy(), "chi2", args=(2,)).pvalue > 0.01
    # the score has a gradient in theta (KCCSD needs it)
    value.requires_grad_(True)
    t.log_prob(value).sum().backward()
    assert torch.isfinite(value.grad).all()


def test_each_mode_gives_distributions_with_samples_and_log_prob():
    task = NPTGaussian(dim=2)
    g = torch.Generator().manual_seed(2)
    for mode in NPT_MODES:
        truth, estimate = task.case(mode, 0.2)
        theta, x = task.sample(30, truth, g)
        assert theta.shape == (30, 2)
        assert x.shape == (30, 4)
        q = estimate(x)
        assert q.sample((3,)).shape == (3, 30, 2)
        assert torch.isfinite(q.log_prob(theta)).all()
    exact = task.case("heavy_tails", 0.0)[1](x)
    assert isinstance(exact, torch.distributions.MultivariateNormal)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"mode": "shift"}, "mode must be one of"), ({"mode": "covariance", "strength": -1.0},
     "strength must be"), ({"mode": "extra_mode", "strength": 1.5}, "at most 1")],
)  # fmt: skip
def test_bad_cases_are_refused_by_name(kwargs, match):
    with pytest.raises(ValueError, match=match):
        NPTGaussian(dim=2).case(**kwargs)
