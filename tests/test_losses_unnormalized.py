"""KCCSDLoss on unnormalized posteriors (ratio and likelihood estimators): the score in the
unconstrained space of a box prior in closed form, finite-difference gradients, mean zero
on the exact ratio and a positive value on a tempered one, and why the transform matters."""

import math

import pytest
import torch
from torch.distributions import Independent, Normal, Uniform

import calib_lightning as cl
from calib_lightning.kernels import exponentiated, median_from_sq_distances, sq_distances
from calib_lightning.losses import KCCSDLoss, kccsd_loss
from calib_lightning.posteriors import UnsupportedError

F64 = torch.float64
NOISE_VAR = 0.1  # x ~ N(theta, 0.1 I)


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _box(d=2):
    return Independent(Uniform(-torch.ones(d, dtype=F64), torch.ones(d, dtype=F64)), 1)


def _gaussian(d=2):
    return Independent(Normal(torch.zeros(d, dtype=F64), torch.ones(d, dtype=F64)), 1)


PRIORS = {"box": _box, "gaussian": _gaussian}


def _log_ratio(tau=1.0):
    """tau times the exact log-likelihood of x ~ N(theta, 0.1 I), up to a function of x."""
    return lambda theta, x: -0.5 * tau * ((x - theta) ** 2).sum(-1) / NOISE_VAR


def _batches(prior, num_batches, n, seed):
    """``num_batches`` independent batches of ``n`` joint pairs, ``(B, n, D)`` each."""
    g = _gen(seed)
    d = prior.event_shape[0]
    if isinstance(prior.base_dist, Uniform):
        theta = -1 + 2 * torch.rand(num_batches, n, d, generator=g, dtype=F64)
    else:
        theta = torch.randn(num_batches, n, d, generator=g, dtype=F64)
    return theta, theta + math.sqrt(NOISE_VAR) * torch.randn(theta.shape, generator=g, dtype=F64)


class QuadraticRatio(torch.nn.Module):
    """log r = -a/2 |x - b theta|^2 with learnable a, b: its score is known in closed form."""

    def __init__(self, a=8.0, b=0.9):
        super().__init__()
        self.a = torch.nn.Parameter(torch.tensor(a, dtype=F64))
        self.b = torch.nn.Parameter(torch.tensor(b, dtype=F64))

    def forward(self, theta, x):
        return -0.5 * self.a * ((x - self.b * theta) ** 2).sum(-1)


# -- closed forms and gradients -------------------------------------------------------------


def test_box_prior_loss_is_the_statistic_of_the_closed_form_unconstrained_score():
    """theta = -1 + 2 sigmoid(u): d/du [f + log|dtheta/du|] = f'(theta) 2 s (1 - s) + 1 - 2 s,
    on u standardized by the batch (scores times its std)."""
    ratio, prior = QuadraticRatio(), _box()
    theta, x = (t[0] for t in _batches(prior, 1, 7, seed=0))
    s = (theta + 1) / 2
    u = torch.log(s / (1 - s))
    score_theta = ratio.a * ratio.b * (x - ratio.b * theta)
    score_u = score_theta * 2 * s * (1 - s) + 1 - 2 * s
    std = u.std(0)
    expected = kccsd_loss((u - u.mean(0)) / std, score_u * std)
    for loss in (KCCSDLoss(prior=prior), KCCSDLoss(space="parameter")):
        post = ratio if loss.prior is not None else cl.UnnormalizedPosterior(ratio, prior=prior)
        torch.testing.assert_close(loss(post, theta, x), expected, rtol=1e-10, atol=1e-12)


def test_gaussian_prior_loss_stays_in_theta_space():
    ratio, prior = QuadraticRatio(), _gaussian()
    theta, x = (t[0] for t in _batches(prior, 1, 7, seed=1))
    score = ratio.a * ratio.b * (x - ratio.b * theta) - theta
    std = theta.std(0)
    expected = kccsd_loss((theta - theta.mean(0)) / std, score * std)
    torch.testing.assert_close(KCCSDLoss(prior=prior)(ratio, theta, x), expected, rtol=1e-10,
                               atol=1e-12)  # fmt: skip


@pytest.mark.parametrize("prior_name", list(PRIORS))
@pytest.mark.parametrize("condition", [None, "x"])
def test_gradient_in_the_ratios_parameters_matches_finite_differences(prior_name, condition):
    """gradcheck in float64; normalize=False, since the normalizer is detached on purpose
    (as is the median bandwidth of condition="gfd", which depends on the scores)."""
    prior = PRIORS[prior_name]()
    theta, x = (t[0] for t in _batches(prior, 1, 9, seed=2))
    loss = KCCSDLoss(prior=prior, condition=condition, normalize=False)

    def value(a, b):
        return loss(lambda t, y: -0.5 * a * ((y - b * t) ** 2).sum(-1), theta, x)

    a = torch.tensor(8.0, dtype=F64, requires_grad=True)
    b = torch.tensor(0.9, dtype=F64, requires_grad=True)
    assert torch.autograd.gradcheck(value, (a, b))


def test_gradients_reach_every_parameter_of_a_ratio_network():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.SiLU(), torch.nn.Linear(16, 1))
    prior = Independent(Uniform(-torch.ones(2), torch.ones(2)), 1)
    theta = prior.sample((32,))
    x = theta + 0.3 * torch.randn(32, 2)
    loss = KCCSDLoss(prior=prior, condition="x")(
        lambda t, y: net(torch.cat([t, y], -1))[:, 0], theta, x
    )
    loss.backward()
    for name, parameter in net.named_parameters():
        if name != "2.bias":  # a constant shift of log r has no score
            assert parameter.grad is not None, name
            assert bool(parameter.grad.abs().sum() > 0), name


# -- behaviour: zero mean on the exact ratio, positive when tempered ---------------------------


@pytest.mark.parametrize("prior_name", list(PRIORS))
def test_exact_ratio_has_mean_zero_tempered_ratios_are_positive(prior_name):
    prior = PRIORS[prior_name]()
    theta, x = _batches(prior, 200, 128, seed=3)
    loss = KCCSDLoss(prior=prior, condition="x")

    def values(tau):
        pairs = zip(theta, x, strict=True)
        return torch.stack([loss(_log_ratio(tau), t, y).detach() for t, y in pairs])

    null = values(1.0)
    se = float(null.std()) / math.sqrt(len(null))
    assert abs(float(null.mean())) < 3 * se
    for tau in (0.5, 2.0):  # under- and over-confident
        assert float(values(tau).mean()) > 5 * se, tau


def test_without_the_transform_the_exact_box_posterior_looks_miscalibrated():
    """The same statistic on theta itself (the truncated posterior does not vanish at the
    box's edge, so Stein's identity fails): far from zero on the exact ratio."""
    prior = _box()
    theta, x = _batches(prior, 60, 128, seed=3)
    post = cl.UnnormalizedPosterior(_log_ratio(), prior=prior)
    raw = []
    for t, y in zip(theta, x, strict=True):
        std, features = t.std(0), (y - y.mean(0)) / y.std(0)
        sq = sq_distances(features, features)
        condition = exponentiated(sq, median_from_sq_distances(sq))
        raw.append(kccsd_loss((t - t.mean(0)) / std, post.score(t, y) * std, condition=condition))
    raw = torch.stack(raw)
    assert float(raw.mean()) > 10 * float(raw.std()) / math.sqrt(len(raw))


# -- arguments --------------------------------------------------------------------------------


def test_latent_space_refuses_an_unnormalized_posterior_and_says_what_to_use():
    post = cl.UnnormalizedPosterior(_log_ratio(), prior=_box())
    theta, x = (t[0] for t in _batches(_box(), 1, 8, seed=4))
    with pytest.raises(UnsupportedError, match="space='parameter', condition='x'"):
        KCCSDLoss()(post, theta, x)
    with pytest.raises(ValueError, match="space must be 'parameter' with a prior"):
        KCCSDLoss(space="latent", prior=_box())
    with pytest.raises(ValueError, match="prior"):
        KCCSDLoss(prior=object())
    assert KCCSDLoss(prior=_box()).space == "parameter"
    assert KCCSDLoss().space == "latent"


def test_theta_outside_the_box_is_a_value_error():
    theta, x = (t[0] for t in _batches(_box(), 1, 8, seed=5))
    theta[0, 0] = 1.5
    with pytest.raises(ValueError, match="inside the prior's support"):
        KCCSDLoss(prior=_box())(_log_ratio(), theta, x)
