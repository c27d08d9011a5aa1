"""The sampling-free latent coverage loss, the balancing loss, the held-out latent scale and
the one-pass NLL + latent evaluation they share with the NLL."""

import math

import pytest
import torch
import zuko
from scipy.stats import chi2

import calib_lightning as cl
from calib_lightning.losses import (
    BalancingLoss,
    LatentCoverageLoss,
    latent_coverage_levels,
    latent_coverage_loss,
    log_prob_and_latent,
)
from calib_lightning.recalibration import LatentScale
from calib_lightning.tasks import GaussianToy
from tests.test_losses import _gen, _held_out_coverage_error, _toy_model

F64 = torch.float64


def _flow(dim=2, context=3):
    torch.manual_seed(0)
    return zuko.flows.NSF(dim, context, transforms=2, hidden_features=(16, 16))


# -- closed forms -----------------------------------------------------------------------


@pytest.mark.parametrize("dim", [1, 3, 50])
def test_levels_are_the_chi2_cdfs_of_the_latent(dim):
    z = torch.randn(200, dim, generator=_gen(0), dtype=F64) * 1.3
    levels = latent_coverage_levels(z)
    joint = chi2.cdf((z**2).sum(1).numpy(), dim)
    assert torch.allclose(levels[:, 0], torch.as_tensor(joint), atol=1e-10)
    if dim > 1:
        marginal = chi2.cdf((z**2).numpy(), 1)
        assert levels.shape == (200, 1 + dim)
        assert torch.allclose(levels[:, 1:], torch.as_tensor(marginal), atol=1e-12)
    assert latent_coverage_levels(z, marginal=False).shape == (200, 1)


def test_loss_is_the_squared_gap_to_the_uniform_quantiles():
    n, dim = 8, 2
    quantiles = (torch.arange(n, dtype=F64) + 0.5) / n
    # latents whose joint levels are exactly the uniform quantiles: loss of that curve 0
    radius2 = torch.as_tensor(chi2.ppf(quantiles.numpy(), dim))
    z = torch.stack([radius2.sqrt(), torch.zeros(n, dtype=F64)], 1)
    assert float(latent_coverage_loss(z, marginal=False)) < 1e-20
    # a hand-made case: every level 0.9 -> mean of (0.9 - q_k)^2
    z = torch.full((n, 1), float(chi2.ppf(0.9, 1)) ** 0.5, dtype=F64)
    expected = float(((0.9 - quantiles) ** 2).mean())
    assert math.isclose(float(latent_coverage_loss(z)), expected, rel_tol=1e-9)
    conservative = float(((0.9 - quantiles).clamp_min(0) ** 2).mean())
    assert math.isclose(float(latent_coverage_loss(z, conservative=True)), conservative,
                        rel_tol=1e-9)  # fmt: skip


def test_sign_calibrated_small_over_confident_large_conservative_ignores_under_confidence():
    z = torch.randn(4000, 5, generator=_gen(1), dtype=F64)
    calibrated = float(latent_coverage_loss(z))
    assert calibrated < 2e-4
    assert float(latent_coverage_loss(1.5 * z)) > 50 * calibrated  # over-confident model
    assert float(latent_coverage_loss(0.6 * z)) > 50 * calibrated  # under-confident model
    assert float(latent_coverage_loss(0.6 * z, conservative=True)) < 1e-8
    assert float(latent_coverage_loss(1.5 * z, conservative=True)) > 50 * calibrated


def test_gradient_is_zero_mean_on_an_exact_posterior():
    """d loss / d log-sd at the calibrated model, one value per batch of 128, 2000 batches at
    once; and its sign away from calibration."""
    z = torch.randn(2000, 128, 3, generator=_gen(2), dtype=F64)

    def gradients(factor, **kwargs):
        log_sd = torch.full((2000,), math.log(factor), dtype=F64, requires_grad=True)
        values = torch.stack([
            latent_coverage_loss(z[i] / log_sd[i].exp(), **kwargs) for i in range(2000)
        ])  # fmt: skip
        (grads,) = torch.autograd.grad(values.sum(), log_sd)
        return float(grads.mean()), float(grads.std() / math.sqrt(len(grads)))

    mean, se = gradients(1.0)
    assert abs(mean) < 3 * se, (mean, se)
    mean, se = gradients(0.7)  # over-confident: descending widens (log-sd up)
    assert mean < -10 * se
    mean, se = gradients(1.4)  # under-confident: descending narrows
    assert mean > 10 * se
    # the one-sided form pushes an over-confident model wider and leaves an
    # under-confident one (almost) alone
    mean, se = gradients(0.7, conservative=True)
    assert mean < -10 * se
    two_sided, _ = gradients(1.4)
    one_sided, _ = gradients(1.4, conservative=True)
    assert abs(one_sided) < 0.02 * two_sided


# -- gradients reach the flow; one pass ----------------------------------------------------


@pytest.mark.parametrize("loss", [LatentCoverageLoss(), LatentCoverageLoss(conservative=True),
                                  BalancingLoss(lambda t: -0.5 * (t**2).sum(-1))],
                         ids=["latent", "latent-conservative", "balancing"])  # fmt: skip
def test_gradients_reach_every_flow_parameter(loss):
    flow = _flow()
    theta, x = torch.randn(64, 2, generator=_gen(4)) * 2, torch.randn(64, 3, generator=_gen(5))
    value = loss(flow, theta, x)
    assert value.ndim == 0
    assert torch.isfinite(value)
    value.backward()
    grads = [p.grad for p in flow.parameters()]
    assert all(g is not None and bool(torch.isfinite(g).all()) for g in grads)
    assert sum(bool((g != 0).any()) for g in grads) >= len(grads) - 1


def test_one_pass_gives_the_separate_log_prob_and_latent_and_runs_the_flow_once():
    flow = _flow()
    theta, x = torch.randn(32, 2, generator=_gen(6)), torch.randn(32, 3, generator=_gen(7))
    calls = []
    flow.register_forward_hook(lambda *_: calls.append(1))
    log_q, z = log_prob_and_latent(flow, theta, x)
    assert len(calls) == 1
    posterior = cl.as_posterior(flow)
    assert torch.allclose(log_q, posterior.log_prob(theta, x), atol=1e-5)
    assert torch.allclose(z, posterior.to_latent(theta, x), atol=1e-5)
    # the shared latent and log-density give the regularizers' own values
    shared = LatentCoverageLoss()(flow, theta, x, latent=z)
    assert torch.allclose(shared, LatentCoverageLoss()(flow, theta, x))
    balance = BalancingLoss(lambda t: -0.5 * (t**2).sum(-1))
    assert torch.allclose(balance(flow, theta, x, log_prob=log_q), balance(flow, theta, x))


def test_one_pass_works_for_gaussians_and_nflows():
    from nflows.distributions import StandardNormal
    from nflows.flows import Flow
    from nflows.transforms import MaskedAffineAutoregressiveTransform

    toy = GaussianToy(dim=3)
    theta, x = toy.sample(16, _gen(8))
    torch.manual_seed(0)
    nflow = Flow(MaskedAffineAutoregressiveTransform(3, 8, context_features=3),
                 StandardNormal([3]))  # fmt: skip
    for model in (toy.posterior(0.5), nflow):
        log_q, z = log_prob_and_latent(model, theta, x)
        posterior = cl.as_posterior(model)
        assert torch.allclose(log_q, posterior.log_prob(theta, x), atol=1e-5)
        assert torch.allclose(z, posterior.to_latent(theta, x), atol=1e-5)


# -- optimizer steps and the held-out scale ------------------------------------------------


def _train(model, loss, toy, steps, seed):
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    for step in range(steps):
        theta, x = toy.sample(256, _gen(seed + step))
        optimizer.zero_grad()
        loss(model, theta, x).backward()
        optimizer.step()
    return model


def test_optimizer_steps_reduce_held_out_miscalibration():
    """Over-confident (sd 0.4x) Gaussian model trained on the regularizer alone."""
    toy = GaussianToy(dim=2, noise_std=0.5)
    model = _toy_model(toy, sd_factor=0.4)
    before = _held_out_coverage_error(model, toy)
    after = _held_out_coverage_error(_train(model, LatentCoverageLoss(), toy, 40, 1000), toy)
    assert before > 0.2
    assert after < 0.25 * before, (before, after)


def test_balancing_loss_widens_an_over_confident_model():
    toy = GaussianToy(dim=2, noise_std=0.5)
    model = _toy_model(toy, sd_factor=0.4)
    loss = BalancingLoss(toy.prior())
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    start = float(model.log_sd.detach())
    for step in range(30):
        theta, x = toy.sample(256, _gen(2000 + step))
        optimizer.zero_grad()
        loss(model, theta, x).backward()
        optimizer.step()
    assert float(model.log_sd.detach()) > start + 0.3


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("sd_factor", [0.5, 1.0, 1.6])
def test_latent_scale_fitted_on_held_out_pairs_calibrates_new_pairs(sd_factor, shared):
    toy = GaussianToy(dim=3, noise_std=0.5)
    model = _toy_model(toy, sd_factor=sd_factor)
    theta, x = toy.sample(500, _gen(3000))  # a validation split
    scaled = LatentScale(model, shared=shared).fit(theta, x)
    assert torch.allclose(scaled.scale, torch.full((3,), 1 / sd_factor), rtol=0.12)
    if shared:
        assert torch.equal(scaled.scale, scaled.scale[:1].expand(3))
    before, after = _held_out_coverage_error(model, toy), _held_out_coverage_error(scaled, toy)
    if sd_factor != 1.0:
        assert after < 0.3 * before, (before, after)
    assert after < 0.03


def test_hpd_target_finds_the_scale_that_calibrates_highest_density_regions():
    toy = GaussianToy(dim=2, noise_std=0.5)
    for sd_factor in (0.6, 1.5):
        model = _toy_model(toy, sd_factor=sd_factor)
        theta, x = toy.sample(300, _gen(3100))
        scaled = LatentScale(model).fit(theta, x, target="hpd", num_posterior_samples=50,
                                        num_scales=21)  # fmt: skip
        assert abs(math.log(float(scaled.scale[0]) * sd_factor)) < 0.15
        assert _held_out_coverage_error(scaled, toy) < 0.3 * _held_out_coverage_error(model, toy)


def test_latent_scale_wraps_a_zuko_flow_and_round_trips_its_state():
    flow = _flow(dim=2)
    theta, x = torch.randn(200, 2, generator=_gen(9)) * 3, torch.randn(200, 3, generator=_gen(10))
    scaled = LatentScale(flow)
    assert torch.equal(scaled(x).log_prob(theta), flow(x).log_prob(theta))  # before fit
    scaled.fit(theta, x)
    z = cl.as_posterior(flow).to_latent(theta, x)
    assert torch.allclose(cl.as_posterior(scaled).to_latent(theta, x), z / scaled.scale,
                          atol=1e-5)  # fmt: skip
    # log q_s = log q + log N(z / s) - log N(z) - sum log s
    correction = (-0.5 * (z / scaled.scale) ** 2 + 0.5 * z**2 - scaled.scale.log()).sum(1)
    expected = flow(x).log_prob(theta) + correction
    assert torch.allclose(scaled(x).log_prob(theta), expected, atol=1e-4)
    assert scaled(x).sample((4,)).shape == (4, 200, 2)
    assert "log_scale" not in dict(scaled.named_parameters())  # the NLL never trains it
    fresh = LatentScale(_flow(dim=2))
    fresh.load_state_dict(scaled.state_dict())
    assert torch.equal(fresh.scale, scaled.scale)


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_latent_scale_with_offsets_and_fifty_parameters(dtype):
    toy = GaussianToy(dim=50, noise_std=0.5, dtype=dtype)
    model = _toy_model(toy, sd_factor=0.7)
    theta, x = toy.sample(400, _gen(11))
    offset = 1e6 if dtype == F64 else 0.0  # a shifted problem: same latents

    def shifted(obs):
        dist = model(obs - offset)
        return torch.distributions.Independent(
            torch.distributions.Normal(dist.base_dist.loc + offset, dist.base_dist.scale), 1)

    scaled = LatentScale(shifted).fit(theta + offset, x + offset)
    assert torch.allclose(scaled.scale.double(), torch.full((50,), 1 / 0.7, dtype=F64), rtol=0.2)


# -- bad input --------------------------------------------------------------------------


def test_bad_input_raises_clear_errors():
    flow = _flow()
    theta, x = torch.randn(8, 2), torch.randn(8, 3)
    with pytest.raises(ValueError, match="latent must have shape"):
        latent_coverage_loss(torch.randn(1, 2))
    with pytest.raises(ValueError, match="latent must have the shape of theta"):
        LatentCoverageLoss()(flow, theta, x, latent=torch.randn(8, 3))
    with pytest.raises(ValueError, match="prior must be a torch Distribution"):
        BalancingLoss(3.0)
    with pytest.raises(ValueError, match=r"log_prob must have shape \(8,\)"):
        BalancingLoss(lambda t: t.sum(-1))(flow, theta, x, log_prob=torch.zeros(7))
    with pytest.raises(ValueError, match="flow must be callable"):
        LatentScale(3)
    with pytest.raises(ValueError, match="steps"):
        LatentScale(flow).fit(theta, x, steps=0)
    with pytest.raises(ValueError, match="target must be 'latent' or 'hpd', got 'ranks'"):
        LatentScale(flow).fit(theta, x, target="ranks")
    uniform = LatentScale(lambda obs: torch.distributions.Independent(
        torch.distributions.Uniform(obs[:, :2] - 1, obs[:, :2] + 1), 1))  # fmt: skip
    uniform.log_scale = torch.zeros(2)
    with pytest.raises(ValueError, match="LatentScale needs a zuko flow"):
        uniform(x)
