"""Calibration losses: algebra, gradients, degenerate batches, and that training on them
repairs a miscalibrated model (measured on held-out data, not with the loss)."""

import math

import pytest
import torch
import zuko
from scipy.stats import chi2
from torch.distributions import Independent, Normal

import calib_lightning as cl
from calib_lightning.functional import kccsd_matrix, u_statistic
from calib_lightning.losses import CoverageLoss, KCCSDLoss, kccsd_loss, latent_kccsd_loss
from calib_lightning.tasks import GaussianToy

F64 = torch.float64
KCCSD_VARIANTS = [
    {},
    {"condition": "x"},
    {"space": "parameter"},
    {"space": "parameter", "condition": "gfd", "num_base_points": 4},
    {"space": "parameter", "kernel": "imq"},
]

# every KCCSD variant and the coverage loss, one test case each
EVERY_LOSS = pytest.mark.parametrize(
    "loss",
    [KCCSDLoss(**kwargs) for kwargs in KCCSD_VARIANTS] + [CoverageLoss(num_posterior_samples=4)],
    ids=lambda m: repr(m),
)


def _gen(seed):
    return torch.Generator().manual_seed(seed)


class GaussianModel(torch.nn.Module):
    """N(w x + shift, exp(2 log_sd) I) with a learnable shift and log-sd."""

    def __init__(self, weight, sd, shift=0.0, dtype=torch.float32):
        super().__init__()
        self.weight = weight
        self.shift = torch.nn.Parameter(torch.tensor(shift, dtype=dtype))
        self.log_sd = torch.nn.Parameter(torch.tensor(math.log(sd), dtype=dtype))

    def forward(self, x):
        return Independent(Normal(self.weight * x + self.shift, self.log_sd.exp().expand_as(x)), 1)


def _toy_model(toy, sd_factor=1.0, shift=0.0):
    sd = math.sqrt(toy.weight) * toy.noise_std
    return GaussianModel(toy.weight, sd * sd_factor, shift * sd, dtype=toy.dtype)


def _held_out_coverage_error(model, toy, n=4000, seed=123):
    """Mean |ECDF - identity| of the exact HPD levels chi2_D(|z|^2) on held-out pairs."""
    theta, x = toy.sample(n, _gen(seed))
    with torch.no_grad():
        z = cl.as_posterior(model).to_latent(theta, x)
    levels = torch.as_tensor(chi2.cdf((z**2).sum(-1).numpy(), toy.dim))
    grid = torch.linspace(0, 1, 101, dtype=levels.dtype)
    return float(((levels[None] <= grid[:, None]).double().mean(1) - grid).abs().mean())


# -- algebra ------------------------------------------------------------------------------


def test_unnormalized_statistic_matches_the_kccsd_statistic():
    g = _gen(0)
    theta, score = (
        torch.randn(40, 3, generator=g, dtype=F64),
        torch.randn(40, 3, generator=g, dtype=F64),
    )
    reference = u_statistic(kccsd_matrix(theta, score, distribution_kernel=None, bandwidth=0.9))
    value = kccsd_loss(theta, score, bandwidth=0.9, normalize=False)
    assert torch.allclose(value, reference, rtol=1e-12, atol=1e-14)
    v_value = kccsd_loss(theta, score, bandwidth=0.9, estimator="v", normalize=False)
    diagonal = (score**2).sum(-1) + 3 / 0.9**2  # h_ii = |s_i|^2 + D / l^2 for the RBF
    assert torch.allclose(v_value, (reference * 40 * 39 + diagonal.sum()) / 40**2, rtol=1e-12)


def test_normalized_statistic_is_bounded_and_reaches_one_for_identical_pairs():
    g = _gen(1)
    points = torch.randn(200, 16, 2, generator=g, dtype=F64)
    scores = 5 * torch.randn(200, 16, 2, generator=g, dtype=F64)
    values = torch.stack([kccsd_loss(p, s) for p, s in zip(points, scores, strict=True)])
    assert bool((values >= -1 / 15 - 1e-12).all())
    assert bool((values <= 1).all())
    same = torch.ones(8, 2, dtype=F64)
    assert float(kccsd_loss(same, 3 * same, bandwidth=1.0)) == pytest.approx(1.0, abs=1e-12)


def test_gradcheck_of_the_statistic():
    g = _gen(2)
    points = torch.randn(7, 2, generator=g, dtype=F64, requires_grad=True)
    score = torch.randn(7, 2, generator=g, dtype=F64, requires_grad=True)
    condition = torch.rand(7, 7, generator=g, dtype=F64)
    condition = condition @ condition.T
    for estimator in ("u", "v"):  # normalize=False: the normalizer is detached by design
        assert torch.autograd.gradcheck(
            lambda p, s, e=estimator: kccsd_loss(
                p, s, bandwidth=0.8, condition=condition, estimator=e, normalize=False
            ),
            (points, score),
        )


def test_parameter_space_loss_is_invariant_to_the_units_of_theta():
    """theta -> a theta + b with the model moved along: the same value (standardization)."""
    toy = GaussianToy(dim=3, noise_std=0.5, dtype=F64)
    theta, x = toy.sample(64, _gen(3))
    values = []
    for a, b in ((1.0, 0.0), (30.0, -7.0), (0.01, 2.0)):

        def model(c, a=a, b=b):  # the posterior N(0.8 x + 0.1, 0.3^2) in the new units
            return Independent(Normal(0.8 * c + b + 0.1 * a, a * 0.3 * torch.ones_like(c)), 1)

        for condition in (None, "x"):
            loss = KCCSDLoss(space="parameter", condition=condition)
            values.append(float(loss(model, a * theta + b, a * x).detach()))
    assert values[0::2] == pytest.approx([values[0]] * 3, rel=1e-9)
    assert values[1::2] == pytest.approx([values[1]] * 3, rel=1e-9)


# -- behaviour of the statistic --------------------------------------------------------


@pytest.mark.parametrize("space", ["latent", "parameter"])
def test_sign_near_zero_when_calibrated_positive_when_not(space):
    toy = GaussianToy(dim=2, noise_std=0.3, dtype=F64)
    batches = [toy.sample(128, _gen(10 + i)) for i in range(30)]
    loss = KCCSDLoss(space=space)

    def values(sd_factor, shift):
        model = _toy_model(toy, sd_factor, shift)
        return torch.stack([loss(model, t, x).detach() for t, x in batches])

    null = values(1.0, 0.0)
    se = null.std() / math.sqrt(len(null))
    assert abs(float(null.mean())) < 3 * float(se)
    assert float(values(1.0, 0.5).mean()) > 10 * float(se)  # mean off by half an sd
    if space == "latent":  # the parameter-space statistic hardly sees the width
        for sd_factor in (0.6, 1.6):
            assert float(values(sd_factor, 0.0).mean()) > 10 * float(se)


def test_u_statistic_gradient_vanishes_at_the_truth_v_statistic_inflates_the_variance():
    """d loss / d log-sd at the calibrated model, one value per batch, 1000 batches at once."""
    g = _gen(100)
    z = torch.randn(1000, 64, 2, generator=g, dtype=F64)  # latents of the true posterior

    def mean_and_se(estimator):
        log_sd = torch.zeros(1000, dtype=F64, requires_grad=True)
        latent = z / log_sd.exp()[:, None, None]  # model sd = exp(log_sd) x the truth
        (grads,) = torch.autograd.grad(latent_kccsd_loss(latent, estimator=estimator).sum(),
                                       log_sd)  # fmt: skip
        return float(grads.mean()), float(grads.std() / math.sqrt(len(grads)))

    mean, se = mean_and_se("u")
    assert abs(mean) < 3 * se
    mean, se = mean_and_se("v")
    assert mean < -6 * se  # descending it widens a calibrated posterior


def test_latent_loss_of_a_flow_is_the_latent_statistic_of_its_latents():
    torch.manual_seed(0)
    flow = zuko.flows.NSF(2, 3, transforms=2, hidden_features=(16, 16))
    theta, x = torch.randn(32, 2, generator=_gen(14)), torch.randn(32, 3, generator=_gen(15))
    latent = cl.as_posterior(flow).to_latent(theta, x)
    for kwargs in ({}, {"estimator": "v"}, {"normalize": False}, {"bandwidth": 0.7}):
        assert torch.allclose(
            KCCSDLoss(**kwargs)(flow, theta, x), latent_kccsd_loss(latent, **kwargs)
        )


# -- gradients reach the flow -----------------------------------------------------------


@EVERY_LOSS
def test_gradients_reach_every_flow_parameter(loss):
    torch.manual_seed(0)
    flow = zuko.flows.NSF(2, 3, transforms=2, hidden_features=(16, 16))
    theta, x = torch.randn(32, 2, generator=_gen(4)), torch.randn(32, 3, generator=_gen(5))
    value = loss(flow, theta, x)
    assert value.ndim == 0
    assert torch.isfinite(value)
    value.backward()
    grads = [p.grad for p in flow.parameters()]
    assert all(g is not None and bool(torch.isfinite(g).all()) for g in grads)
    assert sum(bool((g != 0).any()) for g in grads) >= len(grads) - 1  # the base's buffers aside


@pytest.mark.parametrize("space", ["latent", "parameter"])
def test_gradients_reach_an_nflows_flow(space):
    from nflows.distributions import StandardNormal
    from nflows.flows import Flow
    from nflows.transforms import MaskedAffineAutoregressiveTransform

    torch.manual_seed(0)
    flow = Flow(MaskedAffineAutoregressiveTransform(2, 8, context_features=3), StandardNormal([2]))
    theta, x = torch.randn(16, 2, generator=_gen(6)), torch.randn(16, 3, generator=_gen(7))
    KCCSDLoss(space=space)(flow, theta, x).backward()
    grads = [p.grad for p in flow.parameters()]
    assert all(g is not None and bool(torch.isfinite(g).all()) for g in grads)
    assert any(bool((g != 0).any()) for g in grads)


def test_shared_latent_gives_the_same_loss_and_gradient():
    torch.manual_seed(0)
    flow = zuko.flows.NSF(2, 3, transforms=2, hidden_features=(16, 16))
    theta, x = torch.randn(32, 2, generator=_gen(8)), torch.randn(32, 3, generator=_gen(9))
    latent, _ = flow(x).transform.call_and_ladj(theta)
    shared = KCCSDLoss()(flow, theta, x, latent=latent)
    own = KCCSDLoss()(flow, theta, x)
    assert torch.allclose(shared, own)
    first = torch.autograd.grad(shared, list(flow.parameters()), allow_unused=True)
    second = torch.autograd.grad(own, list(flow.parameters()), allow_unused=True)
    for a, b in zip(first, second, strict=True):
        assert (a is None and b is None) or torch.allclose(a, b, atol=1e-6)


# -- degenerate batches and bad input ---------------------------------------------------


@EVERY_LOSS
def test_degenerate_batches_give_finite_values_and_gradients(loss):
    torch.manual_seed(0)
    flow = zuko.flows.NSF(2, 3, transforms=2, hidden_features=(16, 16))
    cases = {
        "identical pairs": (torch.ones(16, 2), torch.ones(16, 3)),
        "identical thetas": (torch.ones(16, 2), torch.randn(16, 3, generator=_gen(10))),
        "two pairs": (torch.randn(2, 2, generator=_gen(11)), torch.randn(2, 3, generator=_gen(12))),
    }
    for name, (theta, x) in cases.items():
        flow.zero_grad()
        value = loss(flow, theta, x)
        assert torch.isfinite(value), name
        value.backward()
        assert all(p.grad is None or bool(torch.isfinite(p.grad).all())
                   for p in flow.parameters()), name  # fmt: skip


@pytest.mark.parametrize("loss", [KCCSDLoss(), KCCSDLoss(space="parameter"), CoverageLoss()])
def test_bad_input_raises_clear_errors(loss):
    flow = zuko.flows.NSF(2, 3, transforms=1, hidden_features=(8,))
    theta, x = torch.randn(8, 2), torch.randn(8, 3)
    with pytest.raises(ValueError, match=r"theta must have at least 2 rows"):
        loss(flow, theta[:1], x[:1])
    with pytest.raises(ValueError, match="x must have the same number of rows"):
        loss(flow, theta, x[:5])
    bad = theta.clone()
    bad[3, 1] = float("nan")
    with pytest.raises(ValueError, match="theta must be finite"):
        loss(flow, bad, x)


def test_constructor_and_option_errors():
    with pytest.raises(ValueError, match="space must be one of"):
        KCCSDLoss(space="z")
    with pytest.raises(ValueError, match="condition must be one of"):
        KCCSDLoss(condition="mmd")
    with pytest.raises(ValueError, match="estimator must be one of"):
        KCCSDLoss(estimator="w")
    with pytest.raises(ValueError, match="num_posterior_samples must be a positive integer"):
        CoverageLoss(num_posterior_samples=0)
    flow = zuko.flows.NSF(2, 3, transforms=1, hidden_features=(8,))
    theta, x = torch.randn(8, 2), torch.randn(8, 3)
    with pytest.raises(ValueError, match="latent is only used with space='latent'"):
        KCCSDLoss(space="parameter")(flow, theta, x, latent=theta)
    with pytest.raises(ValueError, match="latent must have the shape of theta"):
        KCCSDLoss()(flow, theta, x, latent=theta[:, :1])
    with pytest.raises(ValueError, match="log_prob must have shape"):
        CoverageLoss()(flow, theta, x, log_prob=torch.zeros(8, 1))


@pytest.mark.parametrize("loss", [KCCSDLoss(), KCCSDLoss(space="parameter"), CoverageLoss()])
def test_losses_check_theta_against_the_event_size(loss):
    """The losses evaluate the model through calib_lightning.evaluation: its checks apply."""
    flow = zuko.flows.NSF(2, 3, transforms=1, hidden_features=(8,))
    with pytest.raises(ValueError, match=r"theta must have D = 2 columns"):
        loss(flow, torch.randn(8, 3), torch.randn(8, 3))


def test_coverage_loss_needs_reparameterized_samples():
    from nflows.distributions import StandardNormal
    from nflows.flows import Flow
    from nflows.transforms import MaskedAffineAutoregressiveTransform

    flow = Flow(MaskedAffineAutoregressiveTransform(2, 8, context_features=3), StandardNormal([2]))
    with pytest.raises(ValueError, match="reparameterized draws need a zuko flow or a callable"):
        CoverageLoss()(flow, torch.randn(8, 2), torch.randn(8, 3))


# -- the coverage regularizer ------------------------------------------------------------


def test_coverage_loss_levels_signs_and_gradient_direction():
    toy = GaussianToy(dim=2, noise_std=0.5, dtype=F64)
    theta, x = toy.sample(2000, _gen(13))
    torch.manual_seed(0)
    loss, conservative = CoverageLoss(), CoverageLoss(conservative=True)
    def value(regularizer, sd_factor=1.0):
        with torch.no_grad():
            return float(regularizer(_toy_model(toy, sd_factor), theta, x))

    calibrated = value(loss)
    assert calibrated < 2e-3  # sorted uniforms vs their quantiles: O(1 / n)
    for sd_factor in (0.5, 2.0):
        assert value(loss, sd_factor) > 20 * calibrated
    assert value(conservative, 2.0) < calibrated
    assert value(conservative, 0.5) > 20 * calibrated
    for sd_factor, sign in ((0.5, -1), (2.0, 1)):  # descent widens / narrows
        model = _toy_model(toy, sd_factor)
        loss(model, theta, x).backward()
        assert sign * float(model.log_sd.grad) > 0


# -- a few optimizer steps repair an over-confident model -------------------------------


@pytest.mark.parametrize(
    ("loss", "steps"),
    [
        (KCCSDLoss(), 60),
        (KCCSDLoss(condition="x"), 60),
        (KCCSDLoss(space="parameter"), 150),
        (CoverageLoss(), 60),
    ],
    ids=["kccsd-latent", "kccsd-latent-x", "kccsd-parameter", "coverage"],
)
def test_optimizer_steps_reduce_held_out_miscalibration(loss, steps):
    """Over-confident (sd 0.4x) and shifted (0.5 sd) Gaussian model, trained on the
    regularizer alone; held-out expected-coverage error must fall well below its start."""
    toy = GaussianToy(dim=2, noise_std=0.5)
    model = _toy_model(toy, sd_factor=0.4, shift=0.5)
    before = _held_out_coverage_error(model, toy)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    torch.manual_seed(0)
    for step in range(steps):
        theta, x = toy.sample(256, _gen(1000 + step))
        optimizer.zero_grad()
        loss(model, theta, x).backward()
        optimizer.step()
    after = _held_out_coverage_error(model, toy)
    assert before > 0.2
    assert after < 0.25 * before, (before, after)
