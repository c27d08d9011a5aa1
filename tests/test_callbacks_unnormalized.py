"""Callbacks on LightningModules that train a ratio or a likelihood estimator (issue 43,
item 5): ``prior=`` makes the estimator an unnormalized posterior, KCCSD and the
importance-sampled coverage check it while it trains, the checks that need samples refuse
it at setup, and the coverage metric syncs under DDP.

Task: theta ~ Uniform([-2, 2]^2) (a box prior), x | theta ~ N(theta, S^2 I); the exact
log-ratio is log N(x; theta, S^2 I) up to a function of x.
"""

import math
import warnings

import lightning as L
import pytest
import torch
import zuko
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn
from torch.distributions import Independent, Uniform
from torch.utils.data import DataLoader, TensorDataset

import calib_lightning as cl
from calib_lightning.callbacks import (
    ImportanceCoverageCallback,
    KCCSDCallback,
    LatentCalibrationCallback,
    LC2STNFCallback,
    RankCalibrationCallback,
    RatioBalanceCallback,
    TARPCallback,
)
from calib_lightning.plots import plot_importance_coverage

pytestmark = pytest.mark.filterwarnings("ignore:.*one check took:RuntimeWarning")

S = 0.7
PRIOR = Independent(Uniform(-2 * torch.ones(2), 2 * torch.ones(2)), 1)


def pairs(n, seed):
    g = torch.Generator().manual_seed(seed)
    theta = torch.rand(n, 2, generator=g) * 4 - 2
    return theta, theta + S * torch.randn(n, 2, generator=g)


def exact_log_ratio(theta, x, tau=1.0):
    """tau * log N(x; theta, S^2 I) up to a function of x (tau > 1: over-confident)."""
    return -0.5 * tau * ((x - theta) ** 2).sum(-1) / S**2


@pytest.fixture(autouse=True)
def _run_in_tmp_path(tmp_path, monkeypatch):
    """Trainers without a logger write figure files under the working directory."""
    monkeypatch.chdir(tmp_path)


def fit(module, callbacks, logger=False, epochs=2, **kwargs):
    trainer = L.Trainer(max_epochs=epochs, logger=logger, callbacks=callbacks,
                        enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False, **kwargs)  # fmt: skip
    theta, x = pairs(512, 0)
    trainer.fit(module, DataLoader(TensorDataset(theta, x), batch_size=128))
    return trainer


class RatioMLP(nn.Module):
    """A classifier logit on (theta, x): log r(theta, x)."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 32), nn.Tanh(), nn.Linear(32, 1))

    def forward(self, theta, x):
        return self.net(torch.cat([theta, x], -1))[:, 0]


class NRE(L.LightningModule):
    """NRE-A: joint pairs (label 1) against shuffled pairs (label 0)."""

    def __init__(self, ratio=None):
        super().__init__()
        torch.manual_seed(0)
        self.ratio = RatioMLP() if ratio is None else ratio

    def log_ratio(self, theta, x):
        if hasattr(self.ratio, "unnormalized_log_ratio"):  # an sbi RatioEstimator
            return self.ratio.unnormalized_log_ratio(theta, x)
        return self.ratio(theta, x)

    def training_step(self, batch, batch_idx):
        theta, x = batch
        joint, marginal = self.log_ratio(theta, x), self.log_ratio(theta.roll(1, 0), x)
        return nn.functional.softplus(-joint).mean() + nn.functional.softplus(marginal).mean()

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=3e-3)


class GaussianLikelihood(nn.Module):
    """log q(x | theta) = log N(x; A theta + b, diag(exp(2 log_scale)))."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(0.5 * torch.eye(2))
        self.bias = nn.Parameter(torch.zeros(2))
        self.log_scale = nn.Parameter(torch.zeros(2))

    def forward(self, theta, x):
        mean = theta @ self.weight.T + self.bias
        normal = torch.distributions.Normal(mean, self.log_scale.exp())
        return normal.log_prob(x).sum(-1)


class NLE(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.likelihood = GaussianLikelihood()

    def training_step(self, batch, batch_idx):
        theta, x = batch
        return -self.likelihood(theta, x).mean()

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=5e-2)


class Fixed(L.LightningModule):
    """A fixed log-ratio (nothing learned: the optimizer moves a dummy parameter only)."""

    def __init__(self, tau=1.0):
        super().__init__()
        self.tau, self.dummy = tau, nn.Parameter(torch.zeros(()))

    def ratio(self, theta, x):
        return exact_log_ratio(theta, x, self.tau)

    def training_step(self, batch, batch_idx):
        return (self.dummy - 1.0) ** 2

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def csv_column(log_dir, tag):
    rows = (log_dir / "metrics.csv").read_text().splitlines()
    header = rows[0].split(",")
    column = header.index(tag)
    return [float(r.split(",")[column]) for r in rows[1:] if r.split(",")[column]]


def callbacks_for(estimator, calibration, balance=True):
    theta, x = calibration
    out = [
        KCCSDCallback(theta, x, estimator=estimator, prior=PRIOR, metric=cl.KCCSD(num_null=200)),
        ImportanceCoverageCallback(theta, x, estimator=estimator, prior=PRIOR),
    ]
    if balance:
        out.append(RatioBalanceCallback(theta, x, estimator=estimator))
    return out


@pytest.mark.parametrize("sbi_ratio", [False, True])
def test_a_ratio_module_is_checked_while_it_trains(tmp_path, sbi_ratio):
    """A plain callable and an sbi RatioEstimator: scalars (finite), histories, figures."""
    if sbi_ratio:
        classifier_nn = pytest.importorskip("sbi.neural_nets").classifier_nn
        torch.manual_seed(0)
        ratio = classifier_nn("mlp", hidden_features=32)(*pairs(64, 9))
    callbacks = callbacks_for("ratio", pairs(300, 1))
    logger = CSVLogger(tmp_path, name="nre", version=0)
    fit(NRE(ratio if sbi_ratio else None), callbacks, logger=logger)
    log_dir = tmp_path / "nre" / "version_0"
    expected = {
        "kccsd": ("statistic", "p_value"),
        "importance_coverage": ("global_p_value", "p_value", "ecdf_p_value", "coverage_error",
                                "ess_min", "ess_median"),
        "balance": ("statistic", "p_value"),
    }  # fmt: skip
    for callback in callbacks:
        assert callback.epochs == [0, 1]
        assert not callback.errors
        for key in expected[callback.tag_name]:
            values = csv_column(log_dir, f"calibration/{callback.tag_name}/{key}")
            assert len(values) == 2, key
            assert all(math.isfinite(v) for v in values), key
            assert callback.history[key] == pytest.approx(values, rel=1e-6)
    assert callbacks[0].last_result.space == "unconstrained"  # the box prior: Stein in u
    for name, figures in (("kccsd", ("history",)),
                          ("importance_coverage", ("history", "expected_coverage"))):  # fmt: skip
        for figure in figures:
            for epoch in (0, 1):
                path = log_dir / "calibration" / name / figure / f"epoch={epoch:04d}.png"
                assert path.stat().st_size > 10_000, path


def test_a_likelihood_module_is_checked_while_it_trains(tmp_path):
    """log q(x | theta) with learnable mean and scale, TensorBoard: tags and images."""
    callbacks = callbacks_for("likelihood", pairs(300, 1), balance=False)
    logger = TensorBoardLogger(tmp_path, name="nle", version=0)
    module = NLE()
    fit(module, callbacks, logger=logger, epochs=3)
    events = EventAccumulator(logger.log_dir, size_guidance={"images": 0, "scalars": 0})
    events.Reload()
    checked = (("statistic", "p_value"), ("global_p_value", "coverage_error", "ess_median"))
    for callback, keys in zip(callbacks, checked, strict=True):
        assert callback.epochs == [0, 1, 2]
        for key in keys:
            values = [e.value for e in events.Scalars(f"calibration/{callback.tag_name}/{key}")]
            assert len(values) == 3, key
            assert all(math.isfinite(v) for v in values), key
    images = set(events.Tags()["images"])
    assert images == {"calibration/kccsd/history", "calibration/importance_coverage/history",
                      "calibration/importance_coverage/expected_coverage"}  # fmt: skip
    # it did train (maximum likelihood moves the scale from 1 towards S = 0.7)
    assert bool((module.likelihood.log_scale < -0.1).all())


@pytest.mark.parametrize("tau", [1.0, 3.0])
def test_the_exact_ratio_passes_and_an_over_confident_one_fails(tau):
    """The exact log-ratio: p-values not tiny; tempered by tau = 3 (posterior variance
    S^2 / 3): KCCSD and the coverage test reject, the coverage error is negative."""
    callbacks = callbacks_for("ratio", pairs(400, 2), balance=False)
    fit(Fixed(tau), callbacks, epochs=1)
    kccsd, coverage = (c.history for c in callbacks)
    assert coverage["ess_median"][0] > 50
    title = plot_importance_coverage(callbacks[1].last_result).axes[0].get_title()
    below = "leaves the band below: over-confident or biased"
    assert ("inside the band" if tau == 1.0 else below) in title
    if tau == 1.0:
        assert kccsd["p_value"][0] > 0.01
        assert coverage["global_p_value"][0] > 0.01
        assert abs(coverage["coverage_error"][0]) < 0.05
    else:
        assert kccsd["p_value"][0] < 0.01
        assert coverage["global_p_value"][0] < 1e-6
        assert coverage["coverage_error"][0] < -0.1  # over-confident


@pytest.mark.parametrize("make", [
    lambda t, x: RankCalibrationCallback(t, x, estimator="ratio", prior=PRIOR),
    lambda t, x: TARPCallback(t, x, estimator="ratio", prior=PRIOR),
    lambda t, x: LC2STNFCallback(t, x, estimator="ratio", prior=PRIOR,
                                 metric=cl.LC2STNF(observations=x[:2], num_null=5)),
    lambda t, x: LatentCalibrationCallback(t, x, estimator="ratio", prior=PRIOR),
])  # fmt: skip
def test_checks_that_need_samples_refuse_a_ratio_at_setup(make):
    callback = make(*pairs(50, 3))
    name = type(callback).__name__
    needs = "to_latent" if name == "LatentCalibrationCallback" else "sample"
    with pytest.raises(ValueError, match=rf"{name} needs a posterior with {needs} .*scores only: "
                                         r"check it with KCCSDCallback\(\.\.\., prior=prior\)"):
        fit(Fixed(), [callback], epochs=1)
    assert callback.epochs == []


def test_setup_errors_say_what_to_pass():
    theta, x = pairs(50, 3)
    flow = lambda m: (lambda x: Independent(torch.distributions.Normal(x, 1.0), 1))  # noqa: E731
    cases = [  # (callback, what the error says)
        (ImportanceCoverageCallback(theta, x, estimator="ratio"),  # f(theta, x), no prior
         r"two arguments, ratio\(theta, x\).*pass the callback prior=prior"),
        (ImportanceCoverageCallback(theta, x, estimator=flow),
         r"ImportanceCoverageCallback checks a ratio or likelihood estimator: pass prior="),
        (KCCSDCallback(theta, x, estimator=lambda m: m.ratio, prior=PRIOR, seed=1),
         None),  # works
        (KCCSDCallback(theta, x, estimator=flow),
         None),  # a posterior x -> Distribution, no prior: works as before
        (ImportanceCoverageCallback(theta, x, estimator=flow, prior=PRIOR),  # x -> Distribution
         r"prior must be given only with a ratio or likelihood estimator.*x -> Distribution"),
        (KCCSDCallback(theta, x, estimator="ratio", prior="box"),
         r"prior must be"),
        (KCCSDCallback(theta, x, estimator=lambda m: zuko.flows.MAF(2, 2), prior=PRIOR),
         r"prior must be given only with a ratio or likelihood estimator.*MAF"),
    ]  # fmt: skip
    for callback, match in cases:
        if match is None:
            fit(Fixed(), [callback], epochs=1)
            assert callback.epochs == [0]
            assert not callback.errors
        else:
            with pytest.raises(ValueError, match=match):
                fit(Fixed(), [callback], epochs=1)


def test_an_sbi_ratio_estimator_without_prior_is_refused_at_setup():
    classifier_nn = pytest.importorskip("sbi.neural_nets").classifier_nn
    ratio = classifier_nn("mlp", hidden_features=8)(*pairs(64, 9))
    callback = KCCSDCallback(*pairs(50, 3), estimator="ratio")
    message = r"sbi RatioEstimator \(a ratio estimator.*pass the callback prior=prior"
    with pytest.raises(ValueError, match=message):
        fit(NRE(ratio), [callback], epochs=1)


def test_metric_arguments_pass_through_and_cannot_judge_warns_once():
    """A configured metric is the one used: M = 20 draws cap the ESS at 20, below
    min_ess = 50, so the p-values are NaN, the ESS is logged and one warning says why."""
    metric = cl.ImportanceCoverage(num_proposal_samples=20, seed=3)
    callback = ImportanceCoverageCallback(*pairs(100, 4), estimator="ratio", prior=PRIOR,
                                          metric=metric)  # fmt: skip
    assert callback.metric is metric
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(Fixed(), [callback], epochs=2)
    said = [w for w in caught if "cannot judge" in str(w.message)]
    assert len(said) == 1
    assert "median effective sample size" in str(said[0].message)
    assert all(math.isnan(p) for p in callback.history["global_p_value"])
    assert all(math.isnan(e) for e in callback.history["coverage_error"])
    assert all(0 < e <= 20 for e in callback.history["ess_median"])
    assert callback.last_result.cannot_judge is not None
    figures = callback.figures(callback.last_result)
    title = figures["expected_coverage"].axes[0].get_title()
    assert "cannot judge: the ESS is below min_ess" in title
    assert "ESS median" in title
    verdict_panel = figures["history"].axes[0]  # every value NaN: the panel says so
    assert verdict_panel.get_xlim() == (-0.5, 1.5)
    assert any("no value at any check" in t.get_text() for t in verdict_panel.texts)


class Recording(ImportanceCoverageCallback):
    """Writes, per rank, the credibilities it fed (its shard) and those of the result."""

    def __init__(self, *args, record_dir, **kwargs):
        super().__init__(*args, **kwargs)
        self.record_dir = record_dir

    def _compute(self, trainer, pl_module):
        result, extras = super()._compute(trainer, pl_module)
        local = self.metric.credibility  # torchmetrics restores the local state after compute
        local = torch.cat(local) if isinstance(local, list) and local else torch.zeros(0)
        torch.save({"local": local.cpu(), "result": result.credibility,
                    "ess": result.effective_sample_size},
                   self.record_dir / f"rank{trainer.global_rank}-epoch{trainer.current_epoch}.pt")
        return result, extras


@pytest.mark.forks
@pytest.mark.parametrize("batch_size", [None, 80])
def test_ddp_shards_the_pairs_and_every_rank_gets_all_credibilities(tmp_path, batch_size):
    """Two processes: each feeds its shard, compute() gathers both (the metric's cat
    states), both ranks log the same numbers; a dataloader of one batch leaves rank 1
    without data, which still syncs."""
    theta, x = pairs(80, 5)
    data = ({"dataloader": DataLoader(TensorDataset(theta, x), batch_size=batch_size)}
            if batch_size else {"theta": theta, "x": x})  # fmt: skip
    callback = Recording(**data, estimator="ratio", prior=PRIOR, record_dir=tmp_path,
                         log_figures=False)  # fmt: skip
    fit(Fixed(), [callback], epochs=1, accelerator="cpu", devices=2, strategy="ddp_fork")
    ranks = [torch.load(tmp_path / f"rank{r}-epoch0.pt") for r in (0, 1)]
    assert [r["local"].numel() for r in ranks] == ([80, 0] if batch_size else [40, 40])
    for r in ranks:
        assert r["result"].shape == (80,)
        torch.testing.assert_close(r["result"], ranks[0]["result"])
        torch.testing.assert_close(r["ess"], ranks[0]["ess"])
    gathered = torch.cat([r["local"].double() for r in ranks])
    torch.testing.assert_close(gathered.sort().values, ranks[0]["result"].sort().values)


def test_an_sbi_mcmc_posterior_needs_no_prior():
    """An sbi MCMCPosterior (what NLE's build_posterior returns) carries its prior: the
    callbacks check it through its likelihood estimator, no prior= and no MCMC run."""
    sbi_inference = pytest.importorskip("sbi.inference")
    from sbi.utils import BoxUniform

    torch.manual_seed(0)
    box = BoxUniform(-2 * torch.ones(2), 2 * torch.ones(2))
    nle = sbi_inference.NLE(box, show_progress_bars=False)
    nle.append_simulations(*pairs(500, 7)).train(max_num_epochs=2, show_train_summary=False)
    posterior = nle.build_posterior()  # an MCMCPosterior
    theta, x = pairs(100, 8)
    callbacks = [KCCSDCallback(theta, x, estimator=lambda m: posterior,
                               metric=cl.KCCSD(num_null=100)),
                 ImportanceCoverageCallback(theta, x, estimator=lambda m: posterior)]  # fmt: skip
    fit(Fixed(), callbacks, epochs=1)
    assert callbacks[0].last_result.space == "unconstrained"
    for callback in callbacks:
        assert not callback.errors
        assert math.isfinite(callback.history["p_value"][0])


def test_the_coverage_figure_refuses_another_result():
    with pytest.raises(ValueError, match="result must be an ImportanceCoverageResult"):
        plot_importance_coverage({"levels": torch.linspace(0.1, 0.9, 9)})


def test_lampe_estimators_with_a_prior():
    """A lampe NRE is a ratio (checked through cl.as_posterior); a lampe NPE's
    forward(theta, x) is a posterior log-density, which prior= must not read as a
    likelihood: refused at setup."""
    inference = pytest.importorskip("lampe.inference")
    theta, x = pairs(100, 8)
    torch.manual_seed(0)
    modules = {"nre": inference.NRE(2, 2), "npe": inference.NPE(2, 2)}

    class Holder(Fixed):
        def __init__(self):
            super().__init__()
            self.nets = nn.ModuleDict(modules)

    kccsd = KCCSDCallback(theta, x, estimator="nets.nre", prior=PRIOR, metric=cl.KCCSD(num_null=50))
    fit(Holder(), [kccsd], epochs=1)
    assert not kccsd.errors
    assert math.isfinite(kccsd.history["p_value"][0])
    refused = KCCSDCallback(theta, x, estimator="nets.npe", prior=PRIOR)
    with pytest.raises(ValueError, match=r"NPE.*a posterior estimator"):
        fit(Holder(), [refused], epochs=1)
