"""Every sbi family that is not a posterior estimator, through every public entry point
at once (issue 43): an sbi NRE_C, BNRE and NLE trained briefly on a known task go through
``cl.as_posterior``, ``cl.KCCSD``, ``cl.ImportanceCoverage``, ``cl.RatioBalance`` (ratio
estimators), the callbacks while a LightningModule holds them, and ``cl.diagnose``. A
defect in one adapter shows here beside the others.

Task: theta ~ U(-2, 2)^2 (sbi's BoxUniform), x ~ N(theta, 0.3^2 I)."""

import math

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import calib_lightning as cl
from calib_lightning.callbacks import (
    ImportanceCoverageCallback,
    KCCSDCallback,
    RankCalibrationCallback,
    RatioBalanceCallback,
)

sbi = pytest.importorskip("sbi")
from sbi.inference import BNRE, NLE, NRE_C  # noqa: E402
from sbi.utils import BoxUniform  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:.*one check took:RuntimeWarning")

S = 0.3
FAMILIES = {"NRE_C": (NRE_C, "ratio"), "BNRE": (BNRE, "ratio"), "NLE": (NLE, "likelihood")}
#: the prior as proposal: ESS of about 40 draws in 1,000 here, so 5,000 draws
COVERAGE = {"num_proposal_samples": 5000, "seed": 0}


def _pairs(n, seed):
    g = torch.Generator().manual_seed(seed)
    theta = torch.rand(n, 2, generator=g) * 4 - 2
    return theta, theta + S * torch.randn(n, 2, generator=g)


@pytest.fixture(scope="module")
def prior():
    return BoxUniform(-2 * torch.ones(2), 2 * torch.ones(2))


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, prior):
    """(name, kind, trainer, estimator): 2,000 simulations, 5 epochs."""
    trainer_class, kind = FAMILIES[request.param]
    torch.manual_seed(0)
    trainer = trainer_class(prior, show_progress_bars=False)
    theta, x = _pairs(2000, 0)
    estimator = trainer.append_simulations(theta, x).train(
        max_num_epochs=5, show_train_summary=False
    )
    return request.param, kind, trainer, estimator


def test_not_a_posterior_without_its_prior(family):
    """Before issue 43 an NLE was read as a posterior (a silent number) and a ratio
    estimator failed with a raw TypeError."""
    _, kind, _, estimator = family
    theta, x = _pairs(100, 1)
    word = "ratio" if kind == "ratio" else "likelihood"
    with pytest.raises(ValueError, match=rf"{word} estimator.*prior=prior"):
        cl.as_posterior(estimator)
    with pytest.raises(ValueError, match=word):
        cl.KCCSD().update(estimator, theta, x)


def test_estimator_and_its_mcmc_posterior_give_the_same_scores(family, prior):
    _, _, trainer, estimator = family
    post = cl.as_posterior(estimator, prior=prior)
    assert isinstance(post, cl.UnnormalizedPosterior)
    mcmc = cl.as_posterior(trainer.build_posterior(estimator))  # its potential's prior
    theta, x = _pairs(50, 2)
    torch.testing.assert_close(post.score(theta, x), mcmc.score(theta, x))


def test_metrics_on_the_trained_estimator(family, prior):
    name, kind, _, estimator = family
    theta, x = _pairs(300, 3)
    post = cl.as_posterior(estimator, prior=prior)
    kccsd = cl.KCCSD()
    kccsd.update(post, theta, x)
    out = kccsd.compute()
    assert out.space == "unconstrained"
    assert 0 < float(out.p_value) <= 1
    coverage = cl.ImportanceCoverage(**COVERAGE)
    coverage.update(post, theta, x)
    cov = coverage.compute()
    assert cov.cannot_judge is None, (name, cov.cannot_judge)
    assert 0 <= float(cov.global_p_value) <= 1
    assert abs(float(cov.coverage_error)) < 0.5
    if kind == "ratio":
        balance = cl.RatioBalance()
        balance.update(estimator, theta, x)
        assert math.isfinite(float(balance.compute().statistic))
    else:
        with pytest.raises(ValueError, match="ratio"):
            cl.RatioBalance().update(post, theta, x)


class _Holder(L.LightningModule):
    """A LightningModule holding the trained estimator (a training step that changes
    nothing), as a user's module holds the network it trains."""

    def __init__(self, estimator):
        super().__init__()
        self.estimator = estimator
        self.dummy = torch.nn.Parameter(torch.zeros(()))

    def training_step(self, batch, batch_idx):
        return self.dummy**2

    def configure_optimizers(self):
        return torch.optim.SGD([self.dummy], lr=0.0)


def test_callbacks_check_the_estimator_while_a_module_holds_it(family, prior, tmp_path):
    _, kind, _, estimator = family
    theta, x = _pairs(300, 4)
    common = {"estimator": "estimator", "every_n_epochs": 1}
    callbacks = [
        KCCSDCallback(theta, x, prior=prior, **common),
        ImportanceCoverageCallback(theta, x, prior=prior,
                                   metric=cl.ImportanceCoverage(**COVERAGE), **common),
    ]  # fmt: skip
    if kind == "ratio":
        callbacks.append(RatioBalanceCallback(theta, x, **common))
    trainer = L.Trainer(max_epochs=1, logger=False, callbacks=callbacks,
                        enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False, default_root_dir=tmp_path)  # fmt: skip
    trainer.fit(_Holder(estimator), DataLoader(TensorDataset(theta[:8], x[:8]), batch_size=8))
    for callback in callbacks:
        key = "global_p_value" if isinstance(callback, ImportanceCoverageCallback) else "p_value"
        assert len(callback.history[key]) == 1
        assert 0 <= callback.history[key][0] <= 1, (type(callback).__name__, callback.history)
    # a check that needs posterior samples refuses it at setup, saying what to use
    ranks = RankCalibrationCallback(theta, x, prior=prior, **common)
    trainer = L.Trainer(max_epochs=1, logger=False, callbacks=[ranks],
                        enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False, default_root_dir=tmp_path)  # fmt: skip
    with pytest.raises(ValueError, match="KCCSDCallback"):
        trainer.fit(_Holder(estimator), DataLoader(TensorDataset(theta[:8], x[:8]), batch_size=8))


def test_diagnose_runs_every_check_the_estimator_supports(family, prior, tmp_path):
    """KCCSD and the importance-sampled coverage on every family, the balance test on the
    ratio estimators; the sample checks listed as skipped; the report renders."""
    _, kind, _, estimator = family
    theta, x = _pairs(300, 5)
    if kind == "likelihood":  # dim theta = dim x: its shapes cannot tell it from an NPE
        with pytest.raises(ValueError, match="must say what it estimates"):
            cl.diagnose(estimator, theta, x, prior=prior)
        declared = cl.as_posterior(estimator, prior=prior, kind="likelihood")
        report = cl.diagnose(declared, theta, x)
    else:
        report = cl.diagnose(estimator, theta, x, prior=prior)
    expected = {"kccsd", "coverage_is"} | ({"balance"} if kind == "ratio" else set())
    assert set(report.checks) | {"coverage_is"} >= expected  # coverage may not judge
    assert ("coverage_is" in report.checks) != ("coverage_is" in report.skipped)
    assert {"ranks", "tarp", "joint_c2st", "recovery"} <= set(report.skipped)
    if kind != "ratio":
        assert "balance" in report.skipped
    assert report.checks["kccsd"].space == "unconstrained"
    assert report.save(tmp_path).exists()
    with pytest.raises(ValueError, match=r"estimator.*prior=prior"):
        cl.diagnose(estimator, theta, x)  # not a posterior without its prior
