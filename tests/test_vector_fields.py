"""sbi's vector-field estimators (FMPE's flow matching, NPSE's score estimator) behind
``cl.as_posterior``: shapes, dtypes, argument checks, latents of the ODE's own samples
standard normal, log-densities equal to sbi's, the score (the network's at the smallest
time for NPSE, the gradient of the ODE's log-density for FMPE), and every metric and
``cl.diagnose`` runs, and every callback; an over-confident ODE is rejected with the right
sign, an under-trained FMPE by L-C2ST-NF on its latents; ranks, TARP and L-C2ST-NF hold
their level on the exact posterior as a samples-only callable and as a Distribution.

The estimators are trained briefly (seconds) on ``GaussianToy(dim=2)``.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch.distributions import MultivariateNormal

import calib_lightning as cl
from calib_lightning.posteriors import VectorFieldPosterior, supports
from calib_lightning.tasks import GaussianToy

pytest.importorskip("sbi")

TOY = GaussianToy(dim=2)


def _train(method: str) -> tuple[object, object]:
    """``(estimator, sbi's VectorFieldPosterior)`` after a brief training, seeded."""
    from sbi.inference import FMPE, NPSE

    torch.manual_seed(0)
    theta, x = TOY.sample(1000, torch.Generator().manual_seed(0))
    prior = MultivariateNormal(torch.zeros(2), torch.eye(2))
    inference = {"fmpe": FMPE, "npse": NPSE}[method](prior=prior, show_progress_bars=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        estimator = inference.append_simulations(theta, x).train(
            max_num_epochs=20, training_batch_size=200
        )
        return estimator, inference.build_posterior()


@pytest.fixture(scope="module", params=["fmpe", "npse"])
def trained(request: pytest.FixtureRequest) -> tuple[str, object, object]:
    return (request.param, *_train(request.param))


def test_as_posterior_wraps_the_estimator_and_sbis_posterior(trained):
    method, estimator, posterior = trained
    for obj, inner in ((estimator, estimator), (posterior, posterior.vector_field_estimator)):
        post = cl.as_posterior(obj)  # (sbi's posterior holds a copy of the estimator)
        assert isinstance(post, VectorFieldPosterior)
        assert post.estimator is inner
        assert post.event_size() == 2
        assert post.context_shape() == (2,)
    sampler = {"fmpe": "ode", "npse": "sde"}[method]  # sbi's defaults, kept
    assert cl.as_posterior(posterior).sample_with == sampler
    assert cl.as_posterior(estimator).sample_with == "ode"
    assert supports(cl.as_posterior(estimator), "score")


def test_shapes_dtypes_and_argument_checks(trained):
    _, estimator, posterior = trained
    theta, x = TOY.sample(6, torch.Generator().manual_seed(1))
    torch.manual_seed(1)
    for obj in (estimator, posterior):
        post = cl.as_posterior(obj)
        assert post.sample(x, 3).shape == (3, 6, 2)
        assert post.sample(x.double(), 3).dtype == torch.float64
        with torch.no_grad():
            assert post.log_prob(theta, x).shape == (6,)
            assert post.log_prob(theta.expand(2, 6, 2), x).shape == (2, 6)
            latent = post.to_latent(theta.double(), x)
        assert latent.shape == (6, 2)
        assert latent.dtype == torch.float64
        with pytest.raises(ValueError, match=r"theta must have D = 2 columns"):
            post.log_prob(torch.zeros(6, 3), x)
        with pytest.raises(ValueError, match=r"x must have shape \(N, 2\)"):
            post.to_latent(theta, torch.zeros(6, 3))
        with pytest.raises(ValueError, match="num_posterior_samples"):
            post.sample(x, 0)
    with pytest.raises(ValueError, match="module must be an sbi FlowMatchingEstimator"):
        VectorFieldPosterior(TOY.posterior())


def test_latents_of_the_odes_own_samples_are_standard_normal(trained):
    _, estimator, _ = trained
    post = cl.as_posterior(estimator)  # the ODE sampler: z is the inverse of the draw
    _, x = TOY.sample(400, torch.Generator().manual_seed(2))
    torch.manual_seed(2)
    theta = post.sample(x, 1)[0]
    with torch.no_grad():
        z = post.to_latent(theta, x).double()
    assert z.mean(0).abs().max() < 4 / 400**0.5
    assert (torch.cov(z.T) - torch.eye(2, dtype=z.dtype)).abs().max() < 5 * (2 / 400) ** 0.5


def test_log_prob_is_sbis_probability_flow_density(trained):
    _, _, posterior = trained
    theta, x = TOY.sample(3, torch.Generator().manual_seed(3))
    with torch.no_grad():
        ours = cl.as_posterior(posterior).log_prob(theta, x)
        theirs = torch.stack([posterior.log_prob(theta[i : i + 1], x=x[i : i + 1])[0]
                              for i in range(3)])  # fmt: skip
    torch.testing.assert_close(ours, theirs, atol=1e-3, rtol=1e-4)


def test_score_is_the_networks_at_the_smallest_time_or_the_odes(trained):
    method, estimator, _ = trained
    post = cl.as_posterior(estimator)
    theta, x = TOY.sample(4, torch.Generator().manual_seed(4))
    if method == "fmpe":  # the gradient of the ODE's log-density: central differences
        score = post.score(theta.double(), x)
        assert score.dtype == torch.float64
        step = 1e-2 * torch.eye(2)
        with torch.no_grad():
            differences = torch.stack([
                (post.log_prob(theta + h, x) - post.log_prob(theta - h, x)) / 2e-2
                for h in step
            ], -1)  # fmt: skip
        torch.testing.assert_close(score.float(), differences, atol=0.05, rtol=0.02)
        with pytest.raises(ValueError, match="calibration losses do not apply to FMPE"):
            post.score(theta, x, create_graph=True)
        return
    score = post.score(theta.double(), x)
    assert score.shape == (4, 2)
    assert score.dtype == torch.float64
    expected = estimator.score(theta, x, torch.tensor(estimator.t_min))
    torch.testing.assert_close(score.float(), expected.detach())
    assert post.score(theta, x, create_graph=True).requires_grad


def test_every_supported_metric_and_diagnose_run(trained):
    _, _, posterior = trained
    post = cl.as_posterior(posterior)
    theta, x = TOY.sample(60, torch.Generator().manual_seed(5))
    torch.manual_seed(5)
    metrics = [cl.LatentCalibration(), cl.RankCalibration(num_posterior_samples=9),
               cl.TARP(num_posterior_samples=9), cl.LC2STNF(observations=x[:1], num_null=5),
               cl.KCCSD(num_null=50)]
    for metric in metrics:
        metric.update(post, theta, x)
        out = metric.compute()
        p = out.global_p_value if getattr(out, "global_p_value", None) is not None else out.p_value
        assert bool(((p > 0) & (p <= 1)).all()), type(metric).__name__
    report = cl.diagnose(post, theta, x, checks=("kccsd", "ranks", "tarp"),
                         num_posterior_samples=9, seed=0)  # fmt: skip
    assert set(report.checks) == {"kccsd", "ranks", "tarp"}
    assert report.skipped == {}
    by_default = cl.diagnose(post, theta, x, num_posterior_samples=9, seed=0)
    if post.flow_matching:  # its score differentiates the ODE: asked for only
        assert "kccsd" not in by_default.checks
        assert "checks with 'kccsd'" in by_default.skipped["kccsd"]
    else:  # NPSE's score is its network's
        assert "kccsd" in by_default.checks
    assert by_default.checks["ranks"].joint_statistic == "distance"


def test_an_over_confident_ode_is_rejected_with_the_right_sign(trained):
    """The trained FMPE with its base standard deviation cut to 0.6 after training: the ODE
    maps a narrower base onto a narrower posterior. The latent check and TARP reject it,
    coverage error negative (over-confident)."""
    method, estimator, _ = trained
    if method != "fmpe":
        pytest.skip("one estimator suffices; NPSE's ODE is 4x slower")
    narrow = copy.deepcopy(estimator)
    narrow._std_base.mul_(0.6)  # sbi keeps the base's std in this buffer
    post = cl.as_posterior(narrow)
    theta, x = TOY.sample(300, torch.Generator().manual_seed(6))
    torch.manual_seed(6)
    latent = cl.LatentCalibration()
    latent.update(post, theta, x)
    out = latent.compute()
    assert float(out.global_p_value) < 1e-6
    assert float(out.coverage_error) < -0.1
    tarp = cl.TARP(num_posterior_samples=30)
    tarp.update(post, theta, x)
    result = tarp.compute()
    assert float(result.p_value) < 0.01
    assert float(result.coverage_error) < 0


def test_composed_standardization_is_composed_into_the_flow():
    """sbi's opt-in ``compose_standardization``: the ODE runs on (theta - shift) / scale."""
    from sbi.inference import FMPE
    from sbi.neural_nets import posterior_flow_nn

    theta, x = TOY.sample(1000, torch.Generator().manual_seed(7))
    theta = 3.0 * theta + 5.0  # far from standardized
    prior = MultivariateNormal(torch.full((2,), 5.0), 9.0 * torch.eye(2))
    torch.manual_seed(7)
    builder = posterior_flow_nn(model="mlp", compose_standardization=True)
    inference = FMPE(prior=prior, vf_estimator=builder, show_progress_bars=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        inference.append_simulations(theta, x).train(max_num_epochs=20)
        posterior = inference.build_posterior()
    assert posterior.vector_field_estimator.compose_enabled
    post = cl.as_posterior(posterior)
    with torch.no_grad():
        ours = post.log_prob(theta[:3], x[:3])
        theirs = torch.stack([posterior.log_prob(theta[i : i + 1], x=x[i : i + 1])[0]
                              for i in range(3)])  # fmt: skip
    torch.testing.assert_close(ours, theirs, atol=1e-3, rtol=1e-4)
    _, x_new = TOY.sample(400, torch.Generator().manual_seed(8))
    torch.manual_seed(8)
    draws = post.sample(x_new, 1)[0]
    with torch.no_grad():
        z = post.to_latent(draws, x_new).double()
    assert z.mean(0).abs().max() < 4 / 400**0.5
    assert (torch.cov(z.T) - torch.eye(2, dtype=z.dtype)).abs().max() < 5 * (2 / 400) ** 0.5
    assert post.score(theta[:4], x[:4]).shape == (4, 2)


# -- issue 24's must-show: callbacks, level on exact posteriors, power on an under-trained FMPE


def test_every_supported_check_runs_through_its_callback(trained, tmp_path):
    """A LightningModule holding sbi's posterior: the rank, TARP, latent, L-C2ST-NF and KCCSD
    callbacks each check it once, without error, in one ``fit``."""
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    from calib_lightning.callbacks import (
        KCCSDCallback,
        LatentCalibrationCallback,
        LC2STNFCallback,
        RankCalibrationCallback,
        TARPCallback,
    )

    _, _, posterior = trained

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(()))
            self.posterior = posterior

        def training_step(self, batch, batch_idx):
            return (self.weight - 1.0) ** 2

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    theta, x = TOY.sample(40, torch.Generator().manual_seed(7))
    kwargs = {"estimator": "posterior", "log_figures": False, "on_error": "raise"}
    callbacks = [
        RankCalibrationCallback(theta, x, metric=cl.RankCalibration(9), **kwargs),
        TARPCallback(theta, x, metric=cl.TARP(9, num_null=50), **kwargs),
        LatentCalibrationCallback(theta, x, **kwargs),
        LC2STNFCallback(theta, x, metric=cl.LC2STNF(observations=x[:1], num_null=5,
                                                     num_posterior_samples=50),
                        misspecification=False, **kwargs),
        KCCSDCallback(theta, x, metric=cl.KCCSD(num_null=50), **kwargs),
    ]  # fmt: skip
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False, callbacks=callbacks,
                        default_root_dir=tmp_path)  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the cost warning: these checks dwarf the epoch
        trainer.fit(Module(), DataLoader(TensorDataset(theta, x), batch_size=40))
    for callback in callbacks:
        assert callback.epochs == [0], type(callback).__name__
        assert not callback.errors
        p = callback.history.get("global_p_value", callback.history.get("p_value"))
        assert 0 < p[0] <= 1, type(callback).__name__


def _samples_only_exact():
    return cl.SamplePosterior(lambda x, s: TOY.posterior()(x).sample((s,)), num_dims=2)


def test_ranks_and_tarp_hold_their_level_on_the_exact_posterior_both_ways():
    """40 fresh datasets, default arguments: the exact posterior as a samples-only callable
    (distance rank) and as an ODE-free Distribution (energy rank)."""
    torch.manual_seed(0)
    rejected = {(kind, check): 0 for kind in ("samples", "distribution")
                for check in ("ranks", "tarp")}  # fmt: skip
    for seed in range(40):
        theta, x = TOY.sample(100, torch.Generator().manual_seed(200 + seed))
        for kind, posterior in (("samples", _samples_only_exact()),
                                ("distribution", TOY.posterior())):  # fmt: skip
            ranks, tarp = cl.RankCalibration(), cl.TARP(seed=seed)
            ranks.update(posterior, theta, x)
            tarp.update(posterior, theta, x)
            rejected[kind, "ranks"] += bool(ranks.compute().global_p_value < 0.05)
            rejected[kind, "tarp"] += bool(tarp.compute().p_value < 0.05)
    # Binomial(40, 0.05): P(X > 6) = 0.014
    assert all(count <= 6 for count in rejected.values()), rejected


def test_lc2stnf_holds_its_level_on_the_exact_posterior_as_a_distribution():
    """20 fresh datasets, default arguments. A samples-only posterior has no latents: the
    check says so (its UnsupportedError) rather than testing something else."""
    from calib_lightning.posteriors import UnsupportedError

    torch.manual_seed(1)
    rejected = 0
    for seed in range(20):
        theta, x = TOY.sample(200, torch.Generator().manual_seed(300 + seed))
        metric = cl.LC2STNF(observations=x[:1], seed=seed)
        metric.update(TOY.posterior(), theta, x)
        rejected += bool(metric.compute().global_p_value < 0.05)
    assert rejected <= 4, rejected  # Binomial(20, 0.05): P(X > 4) = 0.016
    with pytest.raises(UnsupportedError, match="to_latent"):
        cl.LC2STNF(observations=x[:1]).update(_samples_only_exact(), theta, x)


def test_an_under_trained_fmpe_is_rejected_by_lc2stnf_on_its_latents():
    """FMPE after one epoch of 5 steps is still close to the prior, N(0, I), where the
    posterior is N(0.8 x, 0.2 I). The prior is calibrated on average over x, so ranks, TARP
    and the latent check cannot see it (their power here is that of any test on pairs);
    L-C2ST-NF, local at one observation, on the ODE's latents, rejects it. Ranks and TARP
    reject an over-confident ODE (the test above and the one below)."""
    from sbi.inference import FMPE

    torch.manual_seed(0)
    theta, x = TOY.sample(1000, torch.Generator().manual_seed(0))
    prior = MultivariateNormal(torch.zeros(2), torch.eye(2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        estimator = FMPE(prior=prior, show_progress_bars=False).append_simulations(
            theta, x).train(max_num_epochs=1, training_batch_size=200)  # fmt: skip
    post = cl.as_posterior(estimator)
    theta, x = TOY.sample(100, torch.Generator().manual_seed(8))
    torch.manual_seed(8)
    local = cl.LC2STNF(observations=x[:1], num_null=50, num_posterior_samples=200)
    local.update(post, theta, x)
    assert float(local.compute().global_p_value) < 0.05  # the floor is 1 / 51


def test_ranks_reject_an_over_confident_ode(trained):
    """The trained FMPE with its base narrowed to 0.6: the rank check rejects it."""
    method, estimator, _ = trained
    if method != "fmpe":
        pytest.skip("one estimator suffices; NPSE's ODE is 4x slower")
    narrow = copy.deepcopy(estimator)
    narrow._std_base.mul_(0.6)
    theta, x = TOY.sample(150, torch.Generator().manual_seed(9))
    torch.manual_seed(9)
    ranks = cl.RankCalibration(20)
    ranks.update(cl.as_posterior(narrow), theta, x)
    result = ranks.compute()
    assert result.joint_statistic == "distance"  # no trace along the ODE: sampling's cost
    assert float(result.global_p_value) < 1e-3
    assert float(result.coverage_error) < 0  # over-confident, by the distance rank too
