"""Post-hoc recalibration: the radial map's guarantee and density, ``cl.recalibrate`` on
every adapter, its input errors, ``method="auto"``, the HPD scale and the callback.

What must hold: latent balls of the recalibrated posterior cover fresh exchangeable pairs
at their level within ``band / (n + 1)`` (the proved bound, checked over repetitions);
the recalibrated density integrates to 1 (D = 1, 2 quadrature); an exact posterior is left
alone up to sampling noise; the map round-trips on zuko, nflows, sbi and torch flows.
"""

import logging
import math
import warnings

import lightning as L
import pytest
import torch
import zuko
from lightning.pytorch.loggers import CSVLogger
from nflows.distributions.normal import ConditionalDiagonalNormal, StandardNormal
from nflows.flows.base import Flow
from nflows.transforms import CompositeTransform, MaskedAffineAutoregressiveTransform
from torch import nn
from torch.distributions import (
    AffineTransform,
    ExpTransform,
    Independent,
    Normal,
    TransformedDistribution,
)
from torch.utils.data import DataLoader, Subset, TensorDataset

import calib_lightning as cl
from calib_lightning.callbacks import RecalibrationCallback
from calib_lightning.functional.radial import chi_quantile, latent_ball_levels, radial_knots
from calib_lightning.recalibration import LatentMap, RecalibratedPosterior
from calib_lightning.recalibration.scale import hpd_log_scale
from calib_lightning.tasks import GaussianToy

LEVELS = torch.tensor([0.1, 0.25, 0.5, 0.75, 0.9, 0.95])


def toy_pairs(n, seed, dim=2):
    return GaussianToy(dim=dim).sample(n, torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("band", [1, 3])
def test_latent_balls_cover_fresh_pairs_within_the_bound(band):
    """Over 300 repetitions with fresh calibration pairs (n = 39) and 200 fresh test pairs
    each, the coverage of every recalibrated latent ball is within band/(n+1) + 3 standard
    errors of its level; the flow before recalibration (variance x 0.3, over-confident,
    heavier misfit than the bound) is far outside it."""
    toy, n, reps, fresh = GaussianToy(dim=3), 39, 300, 200
    wrong = toy.posterior(variance_scale=0.3)
    g = torch.Generator().manual_seed(1)
    after, before = torch.empty(reps, len(LEVELS)), torch.empty(reps, len(LEVELS))
    for rep in range(reps):
        theta, x = toy.sample(n + fresh, g)
        fixed = cl.recalibrate(wrong, theta[:n], x[:n], method="radial", band=band)
        levels = latent_ball_levels(fixed.to_latent(theta[n:], x[n:]))
        after[rep] = (levels[:, None] <= LEVELS).double().mean(0)
        raw = latent_ball_levels(cl.as_posterior(wrong).to_latent(theta[n:], x[n:]))
        before[rep] = (raw[:, None] <= LEVELS).double().mean(0)
    coverage, se = after.mean(0), after.std(0) / math.sqrt(reps)
    slack = band / (n + 1)
    assert bool((coverage >= LEVELS - slack - 3 * se).all()), (coverage, LEVELS)
    assert bool((coverage <= LEVELS + slack + 3 * se).all()), (coverage, LEVELS)
    assert bool((before.mean(0)[1:] < LEVELS[1:] - slack - 0.1).all())  # the test has teeth


def test_band_bound_holds_at_the_order_statistics():
    """The fitted map stays inside its band at every held-out norm (what the proof uses)."""
    for band, dim in ((1, 1), (2, 4), (5, 2)):
        norms = 1.7 * torch.randn(200, dim, generator=torch.Generator().manual_seed(dim)).norm(
            dim=-1
        )
        latent_map = LatentMap(dim, None, radial_knots(norms, dim, band))
        ranks = torch.arange(1, 201, dtype=torch.float64)
        e1 = torch.zeros(200, dim, dtype=torch.float64)
        e1[:, 0] = norms.double().sort().values
        r = latent_map(e1)[0].norm(dim=-1)
        low = chi_quantile((ranks - band).clamp_min(0) / 201, dim)
        high = chi_quantile((ranks + band - 1).clamp_max(201) / 201, dim)
        assert bool((r >= low * (1 - 1e-9)).all() and (r <= high * (1 + 1e-9)).all())


@pytest.mark.parametrize("dim", [1, 2])
def test_recalibrated_density_integrates_to_one(dim):
    """Quadrature of q'(theta | x) over a grid, for the toy posterior recalibrated by scales
    and the radial map fitted on norms of a misfit (variance x 0.4)."""
    toy = GaussianToy(dim=dim)
    theta, x = toy.sample(300, torch.Generator().manual_seed(dim))
    fixed = cl.recalibrate(toy.posterior(variance_scale=0.4), theta, x, method="scale+radial")
    assert fixed.latent_map.radial
    x0 = x[:1]
    torch.manual_seed(dim)  # the grid's centre (a Riemann sum's error moves with it by 1e-3)
    mean = cl.as_posterior(toy.posterior()).sample(x0, 2000).mean(0)[0].double()
    step = 0.01 if dim == 1 else 0.04
    axis = torch.arange(-9.0, 9.0, step, dtype=torch.float64)
    grid = torch.stack(torch.meshgrid(*[axis] * dim, indexing="ij"), -1).reshape(-1, dim) + mean
    log_q = torch.cat([fixed.log_prob(part[:, None, :], x0.double())
                       for part in grid.split(40_000)])  # fmt: skip
    total = float(log_q.exp().sum() * step**dim)
    assert abs(total - 1.0) < 2e-3, total


def test_exact_posterior_is_left_alone_up_to_sampling_noise():
    """On the exact posterior (n = 400): the radial map's chi-CDF moves by less than the DKW
    band at level 1e-3 plus its own slack, the scales by less than 4 standard errors, and
    the held-out density by a few hundredths of a nat."""
    toy, n = GaussianToy(dim=3), 400
    theta, x = toy.sample(n, torch.Generator().manual_seed(5))
    exact = toy.posterior()
    for method in ("radial", "scale", "scale+radial"):
        fixed = cl.recalibrate(exact, theta, x, method=method)
        latent_map = fixed.latent_map
        scale = latent_map.log_scale.exp()
        assert bool(((scale - 1).abs() < 4 / math.sqrt(2 * n)).all()), (method, scale)
        if latent_map.radial:
            t = torch.linspace(0.05, 5.0, 500, dtype=torch.float64)
            point = torch.zeros(500, 3, dtype=torch.float64)
            point[:, 0] = t
            moved = latent_ball_levels(latent_map(point * scale.double())[0])
            dkw = math.sqrt(math.log(2 / 1e-3) / (2 * n)) + (
                cl.recalibration.api.default_band(n) + 1
            ) / (n + 1)
            assert float((moved - latent_ball_levels(point)).abs().max()) < dkw
        fresh_theta, fresh_x = toy.sample(2000, torch.Generator().manual_seed(6))
        change = fixed.log_prob(fresh_theta, fresh_x) - cl.as_posterior(exact).log_prob(
            fresh_theta, fresh_x
        )
        assert abs(float(change.mean())) < 0.05, (method, float(change.mean()))


def _nflows(conditional_base):
    torch.manual_seed(0)
    transform = CompositeTransform(
        [MaskedAffineAutoregressiveTransform(2, hidden_features=16, context_features=2)
         for _ in range(2)]
    )  # fmt: skip
    base = (
        ConditionalDiagonalNormal([2], context_encoder=nn.Linear(2, 4))
        if conditional_base
        else StandardNormal([2])
    )
    return Flow(transform, base)


def _sbi(model):
    from sbi.neural_nets import posterior_nn

    theta, x = toy_pairs(200, 0)
    torch.manual_seed(0)
    estimator = posterior_nn(model=model, hidden_features=16, num_transforms=2)(theta, x)
    return cl.as_posterior(estimator, kind="posterior")  # dim theta = dim x: declared


def _transformed(x):
    base = Independent(Normal(torch.zeros_like(x), torch.ones_like(x)), 1)
    return TransformedDistribution(base, [AffineTransform(0.5 * x, 0.7, event_dim=1)])


ADAPTERS = {
    "zuko_nsf": lambda: zuko.flows.NSF(2, 2, transforms=2, hidden_features=(16, 16)),
    "nflows": lambda: _nflows(False),
    "nflows_conditional_base": lambda: _nflows(True),
    "sbi_nsf": lambda: _sbi("nsf"),
    "sbi_zuko_maf": lambda: _sbi("zuko_maf"),
    "transformed": lambda: _transformed,
}


@pytest.mark.parametrize("name", list(ADAPTERS))
def test_every_adapter_round_trips(name):
    """to_latent and from_latent invert each other; the recalibrated posterior's samples
    have the latents it drew; its log_prob is the change of variables; the metrics take it."""
    torch.manual_seed(0)
    estimator = ADAPTERS[name]()
    post = cl.as_posterior(estimator)
    theta, x = toy_pairs(60, 1)
    with torch.no_grad():
        z = post.to_latent(theta, x)
        assert torch.allclose(post.from_latent(z, x), theta, atol=1e-4)
        fixed = cl.recalibrate(estimator, theta, x, method="scale+radial", band=2)
        u = torch.randn(3, 60, 2)
        back = fixed.to_latent(fixed.from_latent(u, x), x)
        assert torch.allclose(back, u, atol=1e-3)
        draws = fixed.sample(x, 4)
        assert draws.shape == (4, 60, 2)
        assert bool(torch.isfinite(draws).all())
        u_theta, log_det = fixed.latent_map(z)
        expected = post.log_prob(theta, x) + log_det - 0.5 * (u_theta.pow(2) - z.pow(2)).sum(-1)
        assert torch.allclose(fixed.log_prob(theta, x), expected, atol=1e-4)
    metric = cl.LatentCalibration()
    metric.update(fixed, theta, x)
    assert math.isfinite(float(metric.compute().coverage_error))


def test_bad_input_raises_a_clear_value_error():
    toy = GaussianToy(dim=2)
    theta, x = toy_pairs(60, 2)
    with pytest.raises(ValueError, match="theta_val must have at least 20"):
        cl.recalibrate(toy.posterior(), theta[:10], x[:10], method="radial")
    with pytest.raises(ValueError, match="theta_val must have at least 40"):
        cl.recalibrate(toy.posterior(), theta[:30], x[:30])
    with pytest.raises(ValueError, match="method must be"):
        cl.recalibrate(toy.posterior(), theta, x, method="isotonic")
    with pytest.raises(ValueError, match="band"):
        cl.recalibrate(toy.posterior(), theta, x, method="radial", band=0)

    def positive(x):  # log-normal: negative theta has no latent
        base = Independent(Normal(torch.zeros_like(x), torch.ones_like(x)), 1)
        return TransformedDistribution(base, [ExpTransform()])

    with pytest.raises(ValueError, match="theta_val must have finite latents"):
        cl.recalibrate(positive, theta, x, method="radial")
    samples_only = cl.SamplePosterior(lambda x, s: torch.randn(s, x.shape[0], 2))
    with pytest.raises(ValueError, match="posterior must map theta to its latent"):
        cl.recalibrate(samples_only, theta, x, method="radial")


def test_auto_picks_by_held_out_hpd_coverage_and_says_so(caplog):
    toy = GaussianToy(dim=2)
    theta, x = toy_pairs(300, 3)
    with caplog.at_level(logging.INFO, logger="calib_lightning.recalibration.api"):
        fixed = cl.recalibrate(toy.posterior(variance_scale=0.25), theta, x)
    assert fixed.method == "scale"
    assert "picked by 'auto'" in repr(fixed)
    assert set(fixed.selection) == {
        "none",
        "scale",
        "radial",
        "scale+radial",
        "marginal",
        "marginal+radial",
    }
    for scores in fixed.selection.values():
        assert {"hpd_coverage_error", "hpd_se", "hpd_difference_se", "nll",
                "latent_coverage_error", "kept_by_nll"} <= set(scores)  # fmt: skip
    assert fixed.selection["none"]["hpd_coverage_error"] < -0.2  # too narrow: over-confident
    assert abs(fixed.selection["scale"]["hpd_coverage_error"]) < 0.03
    assert any("picked 'scale'" in record.message for record in caplog.records)


@pytest.mark.parametrize(("variance_scale", "right"), [(1.0, "none"), (0.25, "scale")])
def test_auto_picks_the_right_fix_on_repeated_draws(variance_scale, right):
    """Exact posterior: "none"; a variance error, which a latent scale fixes: "scale"
    (the radial maps fix it too but are not simpler). 6 seeded repetitions at n = 100
    held-out pairs; in 20 (examples/benchmarks/results/auto_selection.md) "none" 19 of 20
    on the exact posterior, "scale" 19 of 20 on the narrow one (the radial map 1)."""
    toy = GaussianToy(dim=2)
    picks = [
        cl.recalibrate(toy.posterior(variance_scale=variance_scale), *toy_pairs(100, 100 + rep),
                       seed=rep).method
        for rep in range(6)
    ]  # fmt: skip
    assert picks.count(right) >= 5, picks


def test_auto_rule_guards_the_nll_and_prefers_the_simpler_map():
    """The rule of ``choose`` on given held-out levels and NLLs: a candidate whose NLL is
    worse than the identity's by more than 1 % (plus 2 standard errors) is out however
    well calibrated; of the calibrated ones (within 2 bootstrap SE of the best) the
    simplest within 2 SE of the lowest NLL wins; a map equal to a simpler one gives way."""
    from calib_lightning.recalibration.api import choose

    n = 400
    uniform = (torch.arange(n, dtype=torch.float64) + 0.5) / n
    noise = torch.randn(n, generator=torch.Generator().manual_seed(0), dtype=torch.float64)

    def run(cases, same=None):  # name -> (power of the levels, per-pair NLL shift)
        levels = {name: uniform.pow(power) for name, (power, _) in cases.items()}
        changes = {name: -shift + 0.1 * noise for name, (_, shift) in cases.items()}
        scores = {}
        for name in cases:
            gaps = cl.recalibration.api.coverage_gaps(levels[name])
            diff = changes["none"] - changes[name]
            scores[name] = {"calibration_error": float(gaps.abs().mean()),
                            "hpd_coverage_error": float(0.5 - levels[name].mean()),
                            "max_gap": float(gaps.abs().max()),
                            "nll": 10.0 - float(changes[name].mean()),
                            "nll_difference_se": float(diff.std() / math.sqrt(n))}  # fmt: skip
        same = same or dict.fromkeys(cases)
        return choose(scores, levels, changes, same)

    chosen, table = run({"none": (2.0, 0.0), "scale": (1.0, 0.3), "radial": (1.05, 0.0),
                         "scale+radial": (1.0, 0.0)})  # fmt: skip
    assert chosen == "radial", table  # scale: +3 % NLL, out; radial as good as scale+radial
    assert table["scale"]["kept_by_nll"] == 0.0
    assert "beyond the guard" in next(r.why for r in table.rows if r.method == "scale")
    chosen, table = run({"none": (2.0, 0.0), "scale": (1.0, 0.0), "radial": (1.0, -0.2),
                         "scale+radial": (1.0, -0.2)})  # fmt: skip
    assert chosen == "radial", table  # as calibrated as scale, 0.2 nats sharper
    assert "NLL +0.2000" in next(r.why for r in table.rows if r.method == "scale")
    chosen, table = run({"none": (1.02, 0.0), "scale": (1.0, 0.0), "radial": (1.0, 0.0),
                         "scale+radial": (1.0, 0.0)})  # fmt: skip
    assert chosen == "none", table  # a 2 % warp of the levels: no evidence at n = 400
    chosen, table = run({"none": (2.0, 0.0), "scale": (1.0, 0.0), "radial": (1.0, 0.0),
                         "scale+radial": (1.0, 0.0)}, same={"none": None, "scale": "none",
                                                            "radial": None,
                                                            "scale+radial": None})  # fmt: skip
    assert chosen == "none", table  # scale won, but its map is the identity
    assert "same map as 'none'" in next(r.why for r in table.rows if r.method == "scale")


def test_hpd_scale_finds_the_variance_error_from_shared_draws():
    """Variance x 0.25 (std x 0.5): the HPD-targeted shared scale is near 2."""
    toy = GaussianToy(dim=2)
    theta, x = toy_pairs(400, 4)
    scale = float(hpd_log_scale(toy.posterior(variance_scale=0.25), theta, x).exp())
    assert abs(scale - 2.0) < 0.2, scale
    fitted = cl.LatentScale(toy.posterior(variance_scale=0.25)).fit(theta, x, target="hpd")
    assert bool(((fitted.scale - 2.0).abs() < 0.2).all())


def test_latent_map_state_dict_round_trips():
    theta, x = toy_pairs(100, 7)
    fixed = cl.recalibrate(GaussianToy(dim=2).posterior(variance_scale=2.0), theta, x,
                           method="scale+radial")  # fmt: skip
    fresh = LatentMap(2)
    fresh.load_state_dict(fixed.latent_map.state_dict())
    z = torch.randn(50, 2, dtype=torch.float64)
    assert torch.equal(fresh(z)[0], fixed.latent_map(z)[0])


class _NPE(L.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.flow = zuko.flows.MAF(2, 2, transforms=1, hidden_features=(16, 16))

    def training_step(self, batch, batch_idx):
        theta, x = batch
        return -self.flow(x).log_prob(theta).mean()

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


def test_callback_logs_before_after_and_saves_the_map(tmp_path):
    theta, x = toy_pairs(200, 8)
    theta_val, x_val = toy_pairs(100, 9)
    callback = RecalibrationCallback(theta_val, x_val, method="scale+radial")
    trainer = L.Trainer(max_epochs=2, logger=CSVLogger(tmp_path), callbacks=[callback],
                        enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False)  # fmt: skip
    module = _NPE()
    trainer.fit(module, DataLoader(TensorDataset(theta, x), batch_size=50))
    assert isinstance(callback.recalibrated, RecalibratedPosterior)
    logged = (tmp_path / "lightning_logs" / "version_0" / "metrics.csv").read_text()
    for key in ("coverage_error_before", "coverage_error_after", "nll_before", "nll_after"):
        assert f"calibration/recalibration/{key}" in logged
    path = tmp_path / "after_fit.ckpt"
    trainer.save_checkpoint(path)
    saved = torch.load(path, weights_only=False)["callbacks"][callback.state_key]
    reloaded = RecalibrationCallback(theta_val, x_val, method="scale+radial")
    reloaded.load_state_dict(saved)
    module_again = _NPE()
    module_again.load_state_dict(torch.load(path, weights_only=False)["state_dict"])
    post = reloaded.posterior(module_again.flow)
    with torch.no_grad():
        assert torch.allclose(post.log_prob(theta_val, x_val),
                              callback.recalibrated.log_prob(theta_val, x_val))  # fmt: skip


def test_a_registered_method_is_called_with_the_pairs():
    from calib_lightning.recalibration import METHODS, register_method

    seen = {}

    def fit(posterior, theta, x, z, **options):
        seen.update(rows=theta.shape[0], z=z, options=options)
        return posterior

    register_method("identity-test", fit)
    try:
        theta, x = toy_pairs(30, 10)
        post = cl.recalibrate(GaussianToy(dim=2).posterior(), theta, x, "identity-test", level=0.9)
    finally:
        del METHODS["identity-test"]
    assert isinstance(post, cl.Posterior)
    assert seen == {"rows": 30, "z": None, "options": {"level": 0.9}}


class _NPEWithValidation(_NPE):
    def validation_step(self, batch, batch_idx):
        theta, x = batch
        self.log("val/nll", -self.flow(x).log_prob(theta).mean())


@pytest.mark.parametrize("subset", [False, True])
def test_callback_warns_when_its_pairs_chose_the_checkpoint(tmp_path, subset):
    """Pairs that early stopping monitored are not new pairs for the model kept: the callback
    says so when they are the trainer's validation data (a TensorDataset or a Subset of one),
    and stays silent with pairs apart, or with no monitor."""
    theta, x = toy_pairs(200, 8)
    theta_val, x_val = toy_pairs(100, 9)
    data = TensorDataset(torch.cat([theta, theta_val]), torch.cat([x, x_val]))
    validation = Subset(data, range(200, 300)) if subset else TensorDataset(theta_val, x_val)

    def fit(callback, monitor):
        stop = [L.pytorch.callbacks.EarlyStopping("val/nll", patience=1)] if monitor else []
        trainer = L.Trainer(max_epochs=2, logger=False, callbacks=[callback, *stop],
                            enable_progress_bar=False, enable_model_summary=False,
                            enable_checkpointing=False)  # fmt: skip
        trainer.fit(_NPEWithValidation(), DataLoader(TensorDataset(theta, x), batch_size=50),
                    DataLoader(validation, batch_size=100))  # fmt: skip
        return callback

    with pytest.warns(UserWarning, match=r"chose the model kept \(val/nll monitored there\)"):
        assert fit(RecalibrationCallback(theta_val, x_val, method="scale"), True).recalibrated
    theta_apart, x_apart = toy_pairs(100, 10)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="RecalibrationCallback's pairs")
        assert fit(RecalibrationCallback(theta_apart, x_apart, method="scale"), True).recalibrated
        assert fit(RecalibrationCallback(theta_val, x_val, method="scale"), False).recalibrated
