"""The posterior restricted to the prior's support (``cl.TruncatedPosterior``).

A box prior [-1, 1]^2 and a normal likelihood x = theta + 0.3 eps: the exact posterior is
the normal N(x, 0.09 I) truncated to the box, so truncating the untruncated normal (a flow
that ignored the box) gives the exact posterior, a closed form.
"""

import math

import pytest
import torch
from torch.distributions import Independent, Normal, Uniform

import calib_lightning as cl
from calib_lightning.recalibration.truncation import MIN_INSIDE, NoMassInsideError

D, STD = 2, 0.3
BOX = Independent(Uniform(-torch.ones(D, dtype=torch.float64), torch.ones(D, dtype=torch.float64)),
                  1)  # fmt: skip


def simulate(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    theta = 2 * torch.rand(n, D, generator=g, dtype=torch.float64) - 1
    return theta, theta + STD * torch.randn(n, D, generator=g, dtype=torch.float64)


def untruncated(x: torch.Tensor) -> Independent:
    return Independent(Normal(x, STD), 1)


def log_mass_inside(x: torch.Tensor) -> torch.Tensor:
    """Closed form: log of the untruncated normal's mass inside the box, ``(N,)``."""
    normal = Normal(x.double(), STD)
    return (normal.cdf(torch.tensor(1.0)) - normal.cdf(torch.tensor(-1.0))).log().sum(-1)


def test_the_truncated_normal_is_the_exact_posterior_in_closed_form():
    """The log-density is the normal's minus the closed-form log-mass inside, within the
    normalizer's Monte Carlo error (at least 1,000 draws and 100 inside per row); draws lie
    in the box and follow the truncated normal (per-coordinate KS test against it)."""
    from scipy import stats

    theta, x = simulate(300, seed=0)
    post = cl.TruncatedPosterior(untruncated, BOX)
    torch.manual_seed(1)
    log_q = post.log_prob(theta, x)
    exact = untruncated(x).log_prob(theta) - log_mass_inside(x)
    z = log_mass_inside(x).exp()
    m = torch.maximum(torch.full_like(z, 1000.0), MIN_INSIDE / z)  # draws at each row, about
    se = ((1 - z) / (z * m)).sqrt()  # of log Z-hat, by the delta method
    assert ((log_q - exact).abs() <= 5 * se + 1e-12).all()
    draws = post.sample(x[:3], 4000)
    assert draws.shape == (4000, 3, D)
    assert bool((draws.abs() <= 1).all())
    for i in range(3):
        for d in range(D):
            a, b = (-1 - float(x[i, d])) / STD, (1 - float(x[i, d])) / STD
            truth = stats.truncnorm(a, b, loc=float(x[i, d]), scale=STD).cdf
            assert stats.kstest(draws[:, i, d].numpy(), truth).pvalue > 1e-3


def test_truncation_lowers_the_held_out_nll_by_minus_the_mean_log_normalizer():
    """The guarantee: the true posterior lives in the support, so on fresh pairs the NLL of
    the truncated posterior is the flow's plus the mean log-normalizer, lower; here for a
    flow that is too wide and shifted (a miscalibrated estimator)."""
    theta, x = simulate(2000, seed=2)

    def wrong(x):
        return Independent(Normal(x + 0.2, 2 * STD), 1)

    post = cl.TruncatedPosterior(wrong, BOX)
    torch.manual_seed(3)
    nll = float(-post.log_prob(theta, x).mean())
    nll_flow = float(-cl.as_posterior(wrong).log_prob(theta, x).mean())
    gain = float(-post.log_normalizer(x).mean())
    assert gain > 0.3
    assert nll == pytest.approx(nll_flow - gain, rel=1e-9)


def test_an_exact_posterior_inside_the_support_is_unchanged():
    """No draw falls outside: the normalizer is exactly 1 and the density the flow's."""

    def inside(x):  # a logistic-normal on (0, 1)^2, inside the box [-1, 1]^2
        base = Independent(Normal(0.5 * x, torch.ones_like(x)), 1)
        return torch.distributions.TransformedDistribution(
            base, [torch.distributions.SigmoidTransform()])

    _theta, x = simulate(50, seed=4)
    post = cl.TruncatedPosterior(inside, BOX)
    torch.manual_seed(5)
    draws = post.sample(x, 10)
    assert torch.equal(post.log_normalizer(x), torch.zeros(50, dtype=torch.float64))
    torch.testing.assert_close(post.log_prob(draws, x), cl.as_posterior(inside).log_prob(draws, x))


def test_ranks_hold_the_level_on_the_truncated_posterior():
    """Through ``cl.RankCalibration`` with its default arguments, a fresh dataset per
    repetition: the truncated normal (the exact posterior) is rejected at about the level.
    On the last dataset ``cl.diagnose``'s support check passes it and rejects the
    untruncated normal (which the ranks alone do not resolve: 3 of 40 rejected when this
    test was written)."""
    post = cl.TruncatedPosterior(untruncated, BOX)
    rejected, repetitions = 0, 40
    for rep in range(repetitions):
        theta, x = simulate(300, seed=100 + rep)
        metric = cl.RankCalibration()
        torch.manual_seed(rep)
        metric.update(post, theta, x)
        rejected += float(metric.compute().p_value) <= 0.05
    assert rejected <= 5, rejected  # 0.05 level: P(>= 6 of 40 | p = 0.05) = 0.014
    for model, p_value in ((post, 1.0), (untruncated, 0.0)):
        report = cl.diagnose(model, theta, x, checks=("support",), prior=BOX)
        assert float(report.checks["support"].p_value) == p_value


def test_recalibrate_with_a_prior_truncates_after_the_latent_map():
    theta, x = simulate(200, seed=6)
    fixed = cl.recalibrate(untruncated, theta, x, method="scale", prior=BOX)
    assert isinstance(fixed, cl.TruncatedPosterior)
    assert isinstance(fixed.inner, cl.RecalibratedPosterior)
    assert fixed.method == "scale+support"
    assert "to_latent" not in fixed.capabilities
    torch.manual_seed(7)
    assert bool((fixed.sample(x[:5], 100).abs() <= 1).all())
    auto = cl.recalibrate(untruncated, theta, x, prior=BOX)
    assert auto.selection is auto.inner.selection is not None
    assert auto.method == auto.inner.method + "+support"
    with pytest.raises(ValueError, match="to_latent"):
        auto.to_latent(theta, x)
    outside = theta.clone()
    outside[0, 0] = 1.5
    with pytest.raises(ValueError, match="prior must be the prior theta were drawn from"):
        cl.recalibrate(untruncated, outside, x, method="none", prior=BOX)


def test_the_normalizer_is_shared_by_every_call_at_the_same_observation():
    """Cached by each row's values: log_prob of the parameters and of the draws at the same
    x use one normalizer, whether x comes whole, in halves or in another order."""
    theta, x = simulate(40, seed=8)
    post = cl.TruncatedPosterior(untruncated, BOX)
    torch.manual_seed(9)
    whole = post.log_prob(theta, x)
    halves = torch.cat([post.log_prob(theta[:20], x[:20]), post.log_prob(theta[20:], x[20:])])
    assert torch.equal(whole, halves)
    flipped = post.log_prob(theta.flip(0), x.flip(0))
    assert torch.equal(flipped, whole.flip(0))
    draws, log_q = post.sample_and_log_prob(x, 7)
    assert draws.shape == (7, 40, D)
    assert log_q.shape == (7, 40)
    torch.testing.assert_close(log_q, post.log_prob(draws, x))
    torch.testing.assert_close(post.score(theta, x), cl.as_posterior(untruncated).score(theta, x))
    point = theta.clone()
    point[:, 0] = 1.5
    assert bool(torch.isneginf(post.log_prob(point, x)).all())


def test_bad_input_raises_naming_the_argument():
    with pytest.raises(ValueError, match="prior must be a torch Distribution"):
        cl.TruncatedPosterior(untruncated, None)
    with pytest.raises(ValueError, match="min_acceptance must be in"):
        cl.TruncatedPosterior(untruncated, BOX, min_acceptance=0.0)
    with pytest.raises(ValueError, match="num_normalizer_samples"):
        cl.TruncatedPosterior(untruncated, BOX, num_normalizer_samples=0)
    far = cl.TruncatedPosterior(untruncated, BOX, min_acceptance=1e-2)
    x = torch.tensor([[0.0, 0.0], [2.2, 0.0]], dtype=torch.float64)  # inside: 3.3e-5
    with pytest.raises(NoMassInsideError, match=r"0.01 .* at x = \[2.2, 0\]$"):
        far.sample(x, 10)
    assert issubclass(NoMassInsideError, ValueError)
    noisy = cl.SamplePosterior(lambda x, s: x + torch.randn(s, *x.shape))
    samples_only = cl.TruncatedPosterior(noisy, BOX)
    assert samples_only.sample(x[:1], 5).shape == (5, 1, D)
    with pytest.raises(ValueError, match="does not provide log_prob"):
        samples_only.log_prob(x[:1], x[:1])
    assert math.isfinite(float(cl.TruncatedPosterior(untruncated, BOX).log_normalizer(x)[1]))


def test_the_recalibration_callback_restricts_to_the_prior_and_logs_what_it_removed(tmp_path):
    """``RecalibrationCallback(..., prior=...)`` at the end of fit: the recalibrated
    posterior is restricted to the support; it logs the mass removed and the NLL gain at
    the held-out x beside the map's scores; the checkpoint's map, reloaded into a callback
    given the prior again, gives the same restricted posterior."""
    import lightning as L
    import zuko
    from lightning.pytorch.loggers import CSVLogger
    from torch.utils.data import DataLoader, TensorDataset

    from calib_lightning.callbacks import RecalibrationCallback

    class NPE(L.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.flow = zuko.flows.MAF(D, D, transforms=1, hidden_features=(16, 16))

        def training_step(self, batch, batch_idx):
            return -self.flow(batch[1]).log_prob(batch[0]).mean()

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-2)

    theta, x = (t.float() for t in simulate(400, seed=10))
    theta_val, x_val = (t.float() for t in simulate(100, seed=11))
    box = Independent(Uniform(-torch.ones(D), torch.ones(D)), 1)
    callback = RecalibrationCallback(theta_val, x_val, method="scale", prior=box)
    trainer = L.Trainer(max_epochs=3, logger=CSVLogger(tmp_path), callbacks=[callback],
                        enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False)  # fmt: skip
    module = NPE()
    trainer.fit(module, DataLoader(TensorDataset(theta, x), batch_size=50))
    fixed = callback.recalibrated
    assert isinstance(fixed, cl.TruncatedPosterior)
    assert fixed.method == "scale+support"
    outside, gain = callback.scores["support_mass_outside"], callback.scores["support_nll_gain"]
    assert 0 < outside < 1
    assert gain > 0
    logged = (tmp_path / "lightning_logs" / "version_0" / "metrics.csv").read_text()
    for key in ("support_mass_outside", "support_nll_gain", "nll_before", "nll_after"):
        assert f"calibration/recalibration/{key}" in logged
    reloaded = RecalibrationCallback(theta_val, x_val, method="scale", prior=box)
    reloaded.load_state_dict(callback.state_dict())
    post = reloaded.posterior(module.flow)
    assert isinstance(post, cl.TruncatedPosterior)
    with torch.no_grad():
        torch.testing.assert_close(post.inner.log_prob(theta_val, x_val),
                                   fixed.inner.log_prob(theta_val, x_val))  # fmt: skip
    with pytest.raises(ValueError, match="prior must be the prior theta were drawn from"):
        RecalibrationCallback(theta_val + 2, x_val, prior=box)


def test_the_hpd_scale_with_a_prior_calibrates_the_restricted_posterior():
    """``method="scale", scale_target="hpd", prior=...`` fits the shared scale on the HPD
    levels of the restricted posterior: a flow 1.3 times too wide whose truncation would
    be exact at the right width gets the scale 1 / 1.3 back (within the grid's step and
    the fit's noise), and on fresh pairs the result's HPD coverage error is small;
    ``"auto"`` scores its candidates the same way."""

    def wide(x):
        return Independent(Normal(x, 1.3 * STD), 1)

    theta, x = simulate(600, seed=12)
    fixed = cl.recalibrate(wide, theta, x, method="scale", scale_target="hpd", prior=BOX)
    scale = float(fixed.inner.latent_map.log_scale.exp()[0])
    assert abs(scale - 1 / 1.3) < 0.06, scale
    theta_new, x_new = simulate(1000, seed=13)
    metric = cl.RankCalibration()
    torch.manual_seed(14)
    metric.update(fixed, theta_new, x_new)
    assert abs(float(metric.compute().coverage_error)) < 0.03
    auto = cl.recalibrate(wide, theta, x, prior=BOX)
    assert auto.inner.method in ("scale", "scale+radial", "radial")
    assert abs(auto.selection[auto.inner.method]["hpd_coverage_error"]) < 0.03
    assert abs(auto.selection["none"]["hpd_coverage_error"]) > 0.05


def test_hpd_levels_with_a_prior_count_only_the_draws_inside():
    """The shared-draw HPD level of each true parameter, restricted to the support: the
    importance-weighted share of the draws inside with a higher density, by hand; a pair
    with no draw inside keeps all of its draws."""
    from calib_lightning.recalibration._hpd import LatentDraws, hpd_levels, normal_log_kernel

    g = torch.Generator().manual_seed(15)
    k, n = 50, 4
    draws = LatentDraws(z_true=torch.randn(n, D, generator=g, dtype=torch.float64),
                        base_true=torch.randn(n, generator=g, dtype=torch.float64),
                        z=torch.randn(k, n, D, generator=g, dtype=torch.float64),
                        base=torch.randn(k, n, generator=g, dtype=torch.float64),
                        log_mixture=torch.randn(k, n, generator=g, dtype=torch.float64),
                        inside=torch.rand(k, n, generator=g) < 0.6)  # fmt: skip
    draws.inside[:, 3] = False
    density = lambda z: normal_log_kernel(z, 0.2)  # noqa: E731
    levels = hpd_levels(draws, density)
    for i in range(n):
        keep = draws.inside[:, i] if i < 3 else torch.ones(k, dtype=torch.bool)
        w = (density(draws.z[:, i]) - draws.log_mixture[:, i]).exp() * keep
        higher = draws.base[:, i] + density(draws.z[:, i]) > (
            draws.base_true[i] + density(draws.z_true[i:i + 1])[0])
        assert float(levels[i]) == pytest.approx(float((w * higher).sum() / w.sum()), rel=1e-12)
    assert torch.equal(hpd_levels(draws, density, rows=torch.tensor([2, 0])), levels[[2, 0]])


def test_a_rejection_round_keeps_the_flow_within_the_memory_budget():
    """A round of rejection sampling can ask for a million candidates at one x; the
    wrapped flow draws them in calls sized by the memory budget, so its activations stay
    bounded: here 39 MiB at an 8 MiB budget (the round's own candidates, mask and order
    make the rest), 1,253 MiB before, in one call; an NSF at an observation outside a box
    took 24 GB and was killed. The row with no mass inside is given up."""
    import zuko

    from calib_lightning.evaluation._memory import TensorPeak

    torch.manual_seed(0)
    flow = zuko.flows.NSF(2, 2, transforms=2, hidden_features=[64, 64])
    far = Independent(Uniform(torch.full((2,), 8.0), torch.full((2,), 9.0)), 1)
    restricted = cl.TruncatedPosterior(flow, far, min_acceptance=1e-4)
    budget = 8 * 2**20
    refused = pytest.raises(NoMassInsideError, match=r"at x = \[0, 0\]")
    with cl.set_memory_budget(budget), TensorPeak() as tracker, refused:
        restricted.sample(torch.zeros(1, 2), 100)
    assert tracker.peak < 8 * budget, tracker.peak / 2**20



def test_auto_scores_its_candidates_as_restricted_posteriors():
    """With a prior, ``method="auto"`` compares the candidates' held-out NLL as restricted
    posteriors: minus the log of each candidate's mass inside, estimated from the shared
    draws. The estimate agrees with the closed form for scale maps of 0.7 to 2.5 times
    the flow (mean absolute error in the mass 0.011-0.043 here with 300 weighted draws a
    pair; the mean masses differ by up to 0.24 between these scales), is 0 without a prior,
    and moves the identity's cross-fitted NLL by the mean closed-form log-mass."""
    from calib_lightning.recalibration._hpd import inside_log_share, latent_draws
    from calib_lightning.recalibration.cross_fit import _map_log_density
    from calib_lightning.recalibration.radial import LatentMap

    torch.manual_seed(0)
    theta, x = simulate(300, 3)
    post = cl.as_posterior(untruncated)
    draws = latent_draws(post, theta, x, 100, prior=BOX)
    for scale in (0.7, 1.0, 1.5, 2.5):
        latent_map = LatentMap(D, log_scale=torch.full((D,), math.log(scale), dtype=torch.float64))
        estimate = inside_log_share(draws, _map_log_density(latent_map))
        normal = Normal(x, STD * scale)
        exact = (normal.cdf(torch.tensor(1.0)) - normal.cdf(torch.tensor(-1.0))).log().sum(-1)
        assert float((estimate.exp() - exact.exp()).abs().mean()) < 0.06, scale
        assert abs(float((estimate - exact).mean())) < 0.03, scale
    free = latent_draws(post, theta, x, 100)
    assert float(inside_log_share(free, _map_log_density(LatentMap(D))).abs().max()) == 0.0
    with_prior = cl.recalibrate(post, theta, x, method="auto", prior=BOX).selection
    without = cl.recalibrate(post, theta, x, method="auto").selection
    shift = with_prior["none"]["nll"] - without["none"]["nll"]
    assert shift == pytest.approx(float(log_mass_inside(x).mean()), abs=0.02)
