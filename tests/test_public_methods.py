"""Public methods that otherwise run only in the slow tier, checked fast and for behaviour.

The fast tier (``pytest -m "not slow"``) must call every public function and every public
method of the public classes at least once. These tests cover the ones it missed:
``LC2STNF.probability_map``, ``JointC2ST.reset``, ``CalibrationCallback.load_extra_state``,
``TruncatedPosterior.train`` / ``clear_normalizer_cache`` / ``log_prob_and_latent``,
``RecalibratedPosterior.log_prob_and_latent``, ``LatentCoverageLoss.extra_repr``,
``KCCSDLoss.extra_repr`` and the generic methods of the ``Posterior`` base class. Each is
tiny, seeded and in float64 where a closed form is compared.
"""

import math

import pytest
import torch
import zuko
from torch import nn
from torch.distributions import Independent, Normal, Uniform

import calib_lightning as cl
from calib_lightning.callbacks import RankCalibrationCallback  # imports lightning (seconds)
from calib_lightning.metrics.lc2st import ProbabilityMap
from calib_lightning.posteriors import UnsupportedError
from calib_lightning.recalibration.radial import LatentMap
from calib_lightning.tasks import GaussianToy

TOY = GaussianToy(dim=2, noise_std=0.5)  # exact posterior N(0.8 x, 0.2 I)
SMALL = {"hidden_features": (8, 8)}


# -- LC2STNF.probability_map ------------------------------------------------------------
def test_probability_map_evaluates_the_classifier_at_the_latents_of_posterior_draws():
    """Shapes ``(O, S, D)`` and ``(O, S)``, probabilities in [0, 1], draws from the
    posterior at each observation, and ``d`` read at the draws' latents: two posteriors
    whose draws share their latents (same seed, same standardized noise) get the same
    probabilities at different samples, and a shifted latent gets other ones."""
    g = torch.Generator().manual_seed(0)
    theta, x = TOY.sample(200, g)
    _, x_o = TOY.sample(2, g)
    metric = cl.LC2STNF(observations=x_o, num_null=5, num_posterior_samples=200,
                        classifier_kwargs=SMALL)  # fmt: skip
    wide = TOY.posterior(variance_scale=3.0)
    torch.manual_seed(0)
    metric.update(wide, theta, x)
    metric.compute()
    torch.manual_seed(1)
    drawn = metric.probability_map(wide, num_posterior_samples=400)
    assert isinstance(drawn, ProbabilityMap)
    assert drawn.samples.shape == (2, 400, 2)
    assert drawn.probabilities.shape == (2, 400)
    assert ((drawn.probabilities >= 0) & (drawn.probabilities <= 1)).all()
    assert drawn.probabilities.std() > 0.01  # d varies over the latent space
    # draws of N(0.8 x_o, 0.6 I): mean within 4 standard errors (sqrt(0.6 / 400) = 0.039)
    assert (drawn.samples.mean(1) - 0.8 * x_o).abs().max() < 0.16
    assert ((drawn.samples.var(1) / 0.6 - 1).abs() < 0.3).all()
    torch.manual_seed(1)
    narrow = metric.probability_map(TOY.posterior(variance_scale=0.3), num_posterior_samples=400)
    assert (narrow.samples - drawn.samples).abs().max() > 0.5
    torch.testing.assert_close(narrow.probabilities, drawn.probabilities, atol=1e-5, rtol=0)
    torch.manual_seed(1)
    shifted = metric.probability_map(TOY.posterior(shift=1.0), num_posterior_samples=400)
    torch.testing.assert_close(shifted.probabilities, drawn.probabilities, atol=1e-5, rtol=0)
    torch.manual_seed(2)  # other draws, other latents
    other = metric.probability_map(wide, num_posterior_samples=400)
    assert (other.probabilities - drawn.probabilities).abs().max() > 0.1


# -- JointC2ST.reset --------------------------------------------------------------------
JOINT = {"num_posterior_samples": 4, "folds": 2, "repeats": 1, "classifier_kwargs": SMALL}


@pytest.mark.filterwarnings("ignore:The ``compute`` method")
def test_joint_c2st_reset_forgets_the_pairs_keeps_the_counter_and_rearms_the_warning():
    """After ``reset()`` the metric holds nothing (``compute`` refuses), a check on new
    pairs equals a fresh metric's on them at the same check counter (the counter is not
    a state: it survives the reset), and the ``max_pairs`` warning fires again."""
    g = torch.Generator().manual_seed(0)
    theta, x = TOY.sample(80, g)
    posterior = TOY.posterior()
    metric = cl.JointC2ST(**JOINT)
    torch.manual_seed(0)
    metric.update(posterior, theta[:40], x[:40])
    first = metric.compute()
    metric.reset()
    with pytest.raises(ValueError, match="needs at least one update"):
        metric.compute()
    assert int(metric.checks) == 1
    torch.manual_seed(1)
    metric.update(posterior, theta[40:], x[40:])
    after = metric.compute()
    fresh = cl.JointC2ST(**JOINT)
    fresh.checks.fill_(1)  # the same check counter: the same classifier randomness
    torch.manual_seed(1)
    fresh.update(posterior, theta[40:], x[40:])
    expected = fresh.compute()
    assert after.num_train == expected.num_train == 20  # K = 2 folds of the 40 new pairs
    torch.testing.assert_close(after.ranks, expected.ranks, rtol=0, atol=0)
    assert after.p_value == expected.p_value
    assert not torch.equal(after.ranks, first.ranks)
    # without the reset the old pairs stay: 80 pairs, 40 per fold
    kept = cl.JointC2ST(**JOINT)
    kept.update(posterior, theta[:40], x[:40])
    kept.update(posterior, theta[40:], x[40:])
    assert kept.compute().num_train == 40
    bounded = cl.JointC2ST(**JOINT, max_pairs=30)
    with pytest.warns(UserWarning, match="max_pairs=30"):
        bounded.update(posterior, theta[:40], x[:40])
    bounded.reset()
    with pytest.warns(UserWarning, match="max_pairs=30"):
        bounded.update(posterior, theta[:40], x[:40])


# -- CalibrationCallback.load_extra_state -----------------------------------------------
def test_callback_state_round_trip_restores_the_history_and_hands_over_the_extra_state():
    """``load_state_dict`` restores the record of checks and passes what ``extra_state``
    saved to ``load_extra_state``; the base pair saves nothing and restores nothing."""
    g = torch.Generator().manual_seed(0)
    theta, x = TOY.sample(20, g)
    saved = RankCalibrationCallback(theta=theta, x=x)
    saved.history, saved.epochs, saved.stages = {"p_value": [0.25, 0.5]}, [0, 1], ["fit"] * 2
    state = saved.state_dict()
    assert state["extra"] == {}
    loaded = RankCalibrationCallback(theta=theta, x=x)
    loaded.load_state_dict(state)
    assert loaded.history == {"p_value": [0.25, 0.5]}
    assert loaded.epochs == [0, 1]
    assert loaded.load_extra_state({"anything": 1}) is None
    assert loaded.history == {"p_value": [0.25, 0.5]}

    class WithExtra(RankCalibrationCallback):
        def extra_state(self):
            return {"threshold": 0.1}

        def load_extra_state(self, state):
            self.restored = state

    restored = WithExtra(theta=theta, x=x)
    restored.load_state_dict(WithExtra(theta=theta, x=x).state_dict())
    assert restored.restored == {"threshold": 0.1}


# -- TruncatedPosterior: the normalizer cache, train/eval, state_dict ----------------------
BOX = Independent(Uniform(-torch.ones(2, dtype=torch.float64), torch.ones(2, dtype=torch.float64)),
                  1)  # fmt: skip
STD = 0.5


class _Shifted(nn.Module):
    """``q(theta | x) = N(x + shift, 0.25 I)`` with a trainable ``shift``."""

    def __init__(self, shift: float = 0.0) -> None:
        super().__init__()
        self.shift = nn.Parameter(torch.full((2,), shift, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> Independent:
        return Independent(Normal(x + self.shift, STD), 1)


def _log_mass_inside(x: torch.Tensor, shift: float) -> torch.Tensor:
    """Closed form: log of ``N(x + shift, 0.25 I)``'s mass inside the box, ``(N,)``."""
    normal = Normal(x + shift, STD)
    return (normal.cdf(torch.tensor(1.0)) - normal.cdf(torch.tensor(-1.0))).log().sum(-1)


def _draws_nothing(fn):
    """``fn()``, asserting it consumed no numbers of torch's global generator."""
    before = torch.random.get_rng_state()
    out = fn()
    assert torch.equal(before, torch.random.get_rng_state())
    return out


X_TRUNC = torch.tensor([[0.2, -0.3], [0.6, 0.4]], dtype=torch.float64)


def test_truncated_normalizer_is_cached_until_cleared_then_recomputed():
    """The normalizer is estimated once per ``x`` (a second call draws nothing); after the
    weights change it is stale until ``clear_normalizer_cache()``, which re-estimates it
    at the new weights (the closed form within Monte Carlo error), and re-estimates the
    same value from the same seed."""
    net = _Shifted()
    post = cl.TruncatedPosterior(net, BOX, num_normalizer_samples=4000)
    torch.manual_seed(0)
    first = post.log_normalizer(X_TRUNC)
    # standard errors of log Z from 4,000 draws, here 0.007 to 0.028: 0.08 is about 3 of them
    torch.testing.assert_close(first, _log_mass_inside(X_TRUNC, 0.0), atol=0.08, rtol=0)
    torch.testing.assert_close(_draws_nothing(lambda: post.log_normalizer(X_TRUNC)), first)
    with torch.no_grad():
        net.shift.fill_(0.5)
    assert torch.equal(_draws_nothing(lambda: post.log_normalizer(X_TRUNC)), first)  # stale
    post.clear_normalizer_cache()
    moved = post.log_normalizer(X_TRUNC)
    torch.testing.assert_close(moved, _log_mass_inside(X_TRUNC, 0.5), atol=0.08, rtol=0)
    assert (moved < first - 0.2).all()
    with torch.no_grad():
        net.shift.fill_(0.0)
    post.clear_normalizer_cache()
    torch.manual_seed(0)
    assert torch.equal(post.log_normalizer(X_TRUNC), first)


def test_truncated_train_and_eval_switch_the_wrapped_model_and_clear_the_cache():
    """``train()`` and ``eval()`` (``train(False)``) return the module, set the mode of the
    wrapped estimator, and forget the normalizers (re-estimated from the next draws)."""
    net = _Shifted()
    post = cl.TruncatedPosterior(net, BOX, num_normalizer_samples=1000)
    for mode in (False, True):
        post.clear_normalizer_cache()
        torch.manual_seed(0)
        cached = post.log_normalizer(X_TRUNC)
        torch.manual_seed(5)
        assert torch.equal(_draws_nothing(lambda: post.log_normalizer(X_TRUNC)), cached)
        assert post.train(mode) is post
        assert post.training is mode
        assert net.training is mode
        torch.manual_seed(5)  # forgotten: re-estimated from other draws, another value
        assert not torch.equal(post.log_normalizer(X_TRUNC), cached)
    post.clear_normalizer_cache()
    torch.manual_seed(0)
    cached = post.log_normalizer(X_TRUNC)
    post.eval()
    assert not post.training
    assert not net.training
    torch.manual_seed(0)  # the same draws: the same estimate
    assert torch.equal(post.log_normalizer(X_TRUNC), cached)


def test_truncated_state_dict_round_trip_loads_the_weights_and_drops_stale_normalizers():
    """``state_dict`` is the wrapped estimator's (``estimator.*``, no prior); loading it
    into a posterior built fresh (its cache filled at its old weights) gives the same
    log-densities, its normalizers re-estimated at the loaded weights."""
    post = cl.TruncatedPosterior(_Shifted(0.5), BOX, num_normalizer_samples=4000)
    state = post.state_dict()
    assert list(state) == ["estimator.shift"]
    fresh = cl.TruncatedPosterior(_Shifted(-0.5), BOX, num_normalizer_samples=4000)
    fresh.log_normalizer(X_TRUNC)  # cached at the old weights
    fresh.load_state_dict(state)
    assert torch.equal(fresh.inner.module.shift, post.inner.module.shift)
    theta = torch.tensor([[0.1, 0.1], [0.5, -0.5]], dtype=torch.float64)
    torch.manual_seed(3)
    expected = post.log_prob(theta, X_TRUNC)
    torch.manual_seed(3)
    assert torch.equal(fresh.log_prob(theta, X_TRUNC), expected)
    exact = Independent(Normal(X_TRUNC + 0.5, STD), 1).log_prob(theta) - _log_mass_inside(
        X_TRUNC, 0.5)  # fmt: skip
    torch.testing.assert_close(expected, exact, atol=0.1, rtol=0)  # standard errors <= 0.028


def test_truncated_posterior_has_no_latent_space():
    post = cl.TruncatedPosterior(_Shifted(), BOX)
    theta = torch.zeros(2, 2, dtype=torch.float64)
    assert "to_latent" not in post.capabilities
    for method in (post.log_prob_and_latent, post.to_latent):
        with pytest.raises(UnsupportedError, match="TruncatedPosterior does not provide to_latent"):
            method(theta, X_TRUNC)


# -- RecalibratedPosterior.log_prob_and_latent ------------------------------------------
def test_recalibrated_log_prob_and_latent_is_log_prob_and_to_latent_in_one_pass():
    """One pass gives what ``log_prob`` and ``to_latent`` give apart (float64, a map
    with scales and a radial part, not the identity), with the same gradients to the flow's
    weights; ``from_latent`` inverts the latent."""
    torch.manual_seed(0)
    flow = zuko.flows.MAF(2, 2, transforms=1, hidden_features=(8, 8)).double()
    knots = torch.tensor([[math.log(0.5), 0.0, math.log(2.0)],
                          [math.log(0.6), 0.1, math.log(2.5)]], dtype=torch.float64)  # fmt: skip
    latent_map = LatentMap(2, torch.tensor([0.3, -0.2], dtype=torch.float64), knots)
    post = cl.RecalibratedPosterior(flow, latent_map, method="scale+radial")
    assert not post.is_identity
    g = torch.Generator().manual_seed(1)
    theta = torch.randn(50, 2, generator=g, dtype=torch.float64)
    x = torch.randn(50, 2, generator=g, dtype=torch.float64)
    log_q, latent = post.log_prob_and_latent(theta, x)
    assert log_q.shape == (50,)
    assert latent.shape == (50, 2)
    torch.testing.assert_close(log_q, post.log_prob(theta, x), atol=1e-12, rtol=0)
    torch.testing.assert_close(latent, post.to_latent(theta, x), atol=1e-12, rtol=0)
    torch.testing.assert_close(post.from_latent(latent, x), theta, atol=1e-10, rtol=0)
    # the map changes the density: not the wrapped flow's
    assert (log_q - flow(x).log_prob(theta)).abs().max() > 0.01
    params = list(flow.parameters())
    joint = torch.autograd.grad((log_q.sum() + latent.sum()), params)
    apart = torch.autograd.grad(post.log_prob(theta, x).sum() + post.to_latent(theta, x).sum(),
                                params)  # fmt: skip
    for a, b in zip(joint, apart, strict=True):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=0)


# -- LatentCoverageLoss.extra_repr ------------------------------------------------------
def test_latent_coverage_loss_repr_names_its_arguments():
    assert repr(cl.LatentCoverageLoss()) == "LatentCoverageLoss(conservative=False, marginal=True)"
    assert repr(cl.LatentCoverageLoss(conservative=True, marginal=False)) == (
        "LatentCoverageLoss(conservative=True, marginal=False)")  # fmt: skip



# -- KCCSDLoss.extra_repr ---------------------------------------------------------------
def test_kccsd_loss_repr_names_its_settings_and_the_prior_that_moves_it_to_parameter_space():
    """The repr shows the space, kernel, conditioning, estimator and normalization; with
    ``prior=`` the default space is ``'parameter'`` and the prior's type is named."""
    assert repr(cl.KCCSDLoss()) == (
        "KCCSDLoss(space='latent', kernel='rbf', condition=None, estimator='u', normalize=True)")
    prior = Independent(Normal(torch.zeros(2), torch.ones(2)), 1)
    assert repr(cl.KCCSDLoss(prior=prior, estimator="v", normalize=False)) == (
        "KCCSDLoss(space='parameter', kernel='rbf', condition=None, estimator='v', "
        "normalize=False, prior=Independent)")  # fmt: skip
    assert "condition='x'" in repr(cl.KCCSDLoss(space="parameter", condition="x"))

# -- the Posterior base class -----------------------------------------------------------
class _Gaussian(cl.Posterior):
    """``q(theta | x) = N(x, sigma^2 I)`` with only ``sample``, ``log_prob`` and
    ``to_latent`` written: the base class supplies the rest."""

    def __init__(self, sigma: float) -> None:
        super().__init__(None)
        self.sigma = sigma

    def sample(self, x: torch.Tensor, num_posterior_samples: int) -> torch.Tensor:
        return x + self.sigma * torch.randn(num_posterior_samples, *x.shape, dtype=x.dtype)

    def log_prob(self, theta: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return Normal(x, self.sigma).log_prob(theta).sum(-1)

    def to_latent(self, theta: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return (theta - x) / self.sigma


def test_posterior_base_methods_left_abstract_raise():
    """The base class implements neither ``sample``, ``log_prob`` nor ``to_latent`` (so
    neither the methods built on them), and has no map back from its latent space."""
    base = cl.Posterior(None)
    theta = torch.zeros(3, 2, dtype=torch.float64)
    x = torch.zeros(3, 2, dtype=torch.float64)
    assert repr(base) == "Posterior(NoneType)"
    assert base.dtype is None
    assert base.device is None
    assert base.event_size() is None
    assert base.context_shape() is None
    for call in (lambda: base.sample(x, 4), lambda: base.log_prob(theta, x),
                 lambda: base.to_latent(theta, x), lambda: base.log_prob_and_latent(theta, x),
                 lambda: base.sample_and_log_prob(x, 4), lambda: base.score(theta, x)):  # fmt: skip
        with pytest.raises(NotImplementedError):
            call()
    with pytest.raises(UnsupportedError, match=r"Posterior has no map .* \(from_latent\)"):
        base.from_latent(theta, x)


def test_posterior_base_generic_methods_agree_with_the_closed_forms():
    """From ``sample``, ``log_prob`` and ``to_latent`` alone: ``log_prob_and_latent`` is the
    pair, ``sample_and_log_prob`` the seeded draws with their densities, ``score`` by
    autograd the closed form ``-(theta - x) / sigma^2`` (float64)."""
    post = _Gaussian(0.5)
    g = torch.Generator().manual_seed(0)
    theta = torch.randn(6, 2, generator=g, dtype=torch.float64)
    x = torch.randn(6, 2, generator=g, dtype=torch.float64)
    log_q, latent = post.log_prob_and_latent(theta, x)
    exact = -((theta - x) ** 2).sum(-1) / (2 * 0.25) - 2 * math.log(0.5 * math.sqrt(2 * math.pi))
    torch.testing.assert_close(log_q, exact, atol=1e-12, rtol=0)
    torch.testing.assert_close(latent, (theta - x) / 0.5, atol=1e-12, rtol=0)
    torch.manual_seed(2)
    draws, draw_log_q = post.sample_and_log_prob(x, 5)
    torch.manual_seed(2)
    torch.testing.assert_close(draws, post.sample(x, 5), atol=0, rtol=0)
    assert draws.shape == (5, 6, 2)
    assert draw_log_q.shape == (5, 6)
    assert not draws.requires_grad
    assert not draw_log_q.requires_grad
    torch.testing.assert_close(draw_log_q, post.log_prob(draws, x), atol=1e-12, rtol=0)
    score = post.score(theta, x)
    torch.testing.assert_close(score, -(theta - x) / 0.25, atol=1e-12, rtol=0)
    assert not score.requires_grad
    with pytest.raises(UnsupportedError, match="from_latent"):
        post.from_latent(latent, x)
