"""The support check: posterior draws outside the prior's support, an exact test.

On the Gaussian linear task with a uniform prior (sbibm's Gaussian Linear Uniform), the
exact posterior is the likelihood's normal truncated to the box, so it never leaks, and
the untruncated normal leaks exactly its mass outside the box, a closed form.
"""

import math
from pathlib import Path

import pytest
import torch
from torch.distributions import Independent, Normal

import calib_lightning as cl
from calib_lightning.callbacks import PriorSupportCallback
from calib_lightning.diagnosis._verdict import combine_verdicts
from calib_lightning.functional.support import support_leakage
from calib_lightning.tasks import GaussianLinearUniform

TASK = GaussianLinearUniform(dtype=torch.float64)
STD = math.sqrt(TASK.noise_var)


def untruncated(x: torch.Tensor) -> Independent:
    """The likelihood's normal at ``x``: the posterior as a flow on R^D that ignored the box."""
    return Independent(Normal(x, STD), 1)


def outside_mass(x: torch.Tensor) -> torch.Tensor:
    """Closed form: the untruncated normal's mass outside the box ``[-1, 1]^D``, ``(N,)``."""
    normal = Normal(x.double(), STD)
    inside = normal.cdf(torch.tensor(1.0)) - normal.cdf(torch.tensor(-1.0))
    return 1 - inside.prod(-1)


def test_support_leakage_counts_draws_and_rejects_on_one():
    outside = torch.zeros(4, 3, dtype=torch.bool)
    out = support_leakage(outside)
    assert float(out.p_value) == 1.0
    assert float(out.statistic) == 0.0
    outside[2, 1] = True
    out = support_leakage(outside, torch.tensor([[True, False], [False, False]]))
    assert float(out.p_value) == 0.0
    assert int(out.num_outside) == 1
    assert int(out.num_draws) == 12
    torch.testing.assert_close(out.leakage, torch.tensor([0.0, 0.25, 0.0]))
    torch.testing.assert_close(out.statistic, torch.tensor(1 / 12))
    torch.testing.assert_close(out.observation_leakage, torch.tensor([0.5, 0.0]))
    with pytest.raises(ValueError, match=r"outside must be a bool tensor of shape \(S, N\)"):
        support_leakage(torch.zeros(4, 3))


def test_the_exact_posterior_never_leaks_and_an_untruncated_one_leaks_its_closed_form():
    """Through ``cl.diagnose`` with its default draws: the exact (truncated) posterior has
    no draw outside the box (p-value 1, verdict calibrated); the untruncated normal is
    rejected with certainty, the sentence gives its share, and the leakage per pair and
    at each observation is the closed form within Monte Carlo error."""
    g = torch.Generator().manual_seed(0)
    theta, x = TASK.sample(300, g)
    observations = TASK.sample(4, g)[1]
    exact = cl.SamplePosterior(
        lambda x, s: TASK.reference_posterior_samples(x, s, torch.Generator().manual_seed(1)),
        num_dims=10,
    )
    report = cl.diagnose(exact, theta, x, observations, checks=("support",),
                         prior=TASK.prior())  # fmt: skip
    result = report.checks["support"]
    assert float(result.p_value) == 1.0
    assert int(result.num_outside) == 0
    assert report.verdict.startswith("calibrated"), report.verdict

    report = cl.diagnose(untruncated, theta, x, observations, checks=("support",),
                         prior=TASK.prior())  # fmt: skip
    result = report.checks["support"]
    draws = int(result.num_draws) // theta.shape[0]  # the default: 100 per pair
    assert float(result.p_value) == 0.0
    assert report.overall_p_value == 0.0
    expected = outside_mass(x)
    error = (result.leakage.double() - expected).mean()  # the pairs' errors are independent
    spread = (expected * (1 - expected) / draws).mean().sqrt() / theta.shape[0] ** 0.5
    assert abs(float(error)) < 4 * float(spread)
    assert report.verdict.startswith(
        f"miscalibrated: {float(result.statistic):.1%} of its draws at the calibration x lie "
        "outside the prior's support"
    ), report.verdict
    at = outside_mass(observations)
    half = 4 * (at * (1 - at) / draws).sqrt() + 1e-12
    assert ((result.observation_leakage.double() - at).abs() <= half).all()
    assert "draws outside the prior's support" in report.table()
    page = report._html([])
    assert "cl.recalibrate(posterior, theta_val, x_val, prior=prior)" in page
    fixed = cl.recalibrate(untruncated, theta, x, method="none", prior=TASK.prior())
    assert "prior=prior" not in cl.diagnose(fixed, theta[:50], x[:50], checks=("support",),
                                            prior=TASK.prior())._html([])  # fmt: skip


def test_the_support_check_takes_no_share_of_the_level():
    """p = 1 leaves the others' combination as it is; p = 0 makes the overall p-value 0."""
    others = {"ranks": 0.03, "tarp": 0.2, "kccsd": 0.5}
    assert combine_verdicts({**others, "support": 1.0}) == combine_verdicts(others)
    assert combine_verdicts({**others, "support": 0.0}) == 0.0
    assert combine_verdicts({"support": 1.0}) == 1.0
    assert math.isnan(combine_verdicts({}))


def test_bad_priors_raise_naming_prior():
    theta, x = TASK.sample(20, torch.Generator().manual_seed(2))
    with pytest.raises(ValueError, match=r"checks \['support'\] need the prior"):
        cl.diagnose(untruncated, theta, x, checks=("support",))
    narrow = Independent(torch.distributions.Uniform(torch.full((10,), -0.5, dtype=torch.float64),
                                                     torch.full((10,), 0.5, dtype=torch.float64)),
                         1)  # fmt: skip
    with pytest.raises(ValueError, match="prior must be the prior theta were drawn from"):
        cl.diagnose(untruncated, theta, x, checks=("support",), prior=narrow)
    with pytest.raises(ValueError, match="prior must be a torch Distribution or have log_prob"):
        cl.diagnose(untruncated, theta, x, checks=("support",), prior=object())
    with pytest.raises(ValueError, match=r"prior must have event shape \(D,\) = \(10,\)"):
        cl.diagnose(untruncated, theta, x, checks=("support",),
                    prior=Normal(torch.zeros(3, 10), 1.0))  # fmt: skip


def test_a_prior_with_log_prob_only_is_read_by_its_log_density():
    """No ``support``: outside where ``log_prob`` is not finite (an sbi-style custom prior)."""

    class BoxLogProb:
        def log_prob(self, theta: torch.Tensor) -> torch.Tensor:
            inside = (theta.abs() <= 1).all(-1)
            return torch.where(inside, 0.0, -math.inf).to(theta.dtype)

    theta, x = TASK.sample(100, torch.Generator().manual_seed(3))
    with_support = cl.diagnose(untruncated, theta, x, checks=("support",), prior=TASK.prior())
    by_density = cl.diagnose(untruncated, theta, x, checks=("support",), prior=BoxLogProb())
    assert torch.equal(with_support.checks["support"].leakage, by_density.checks["support"].leakage)


def test_the_prior_support_metric_streams_counts_as_diagnose_reads_them():
    """``cl.PriorSupport`` over two batches: counts add, shares concatenate, the share of
    the untruncated normal is its closed form; the exact posterior stays inside."""
    theta, x = TASK.sample(400, torch.Generator().manual_seed(4))
    metric = cl.PriorSupport(TASK.prior())
    torch.manual_seed(0)
    for rows in (slice(0, 150), slice(150, 400)):
        metric.update(untruncated, theta[rows], x[rows])
    out = metric.compute()
    assert out.leakage.shape == (400,)
    assert int(out.num_draws) == 400 * 100
    assert float(out.p_value) == 0.0
    torch.testing.assert_close(out.statistic, out.num_outside / out.num_draws)
    expected = outside_mass(x)
    spread = (expected * (1 - expected) / 100).mean().sqrt() / 400**0.5
    assert abs(float((out.leakage.double() - expected).mean())) < 4 * float(spread)
    exact = cl.SamplePosterior(
        lambda x, s: TASK.reference_posterior_samples(x, s, torch.Generator().manual_seed(5)),
        num_dims=10,
    )
    metric.reset()
    metric.update(exact, theta, x)
    assert float(metric.compute().p_value) == 1.0
    metric.reset()
    with pytest.raises(ValueError, match="needs at least one update"):
        metric.compute()
    with pytest.raises(ValueError, match="prior must be the prior theta were drawn from"):
        cl.PriorSupport(None)
    with pytest.raises(ValueError, match="calibration theta lie outside its support"):
        metric.update(untruncated, 3 * theta, x)


def test_the_callback_logs_the_share_outside_while_training(tmp_path):
    """``cl.PriorSupportCallback`` in ``Trainer.fit``: the share outside and the exact
    p-value reach the logger every check, and the summary gives the verdict."""
    import lightning as L
    from lightning.pytorch.loggers import CSVLogger
    from torch.utils.data import DataLoader, TensorDataset

    from calib_lightning.callbacks import summary_table

    class Untruncated(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.dummy = torch.nn.Parameter(torch.zeros((), dtype=torch.float64))
            self.flow = untruncated

        def training_step(self, batch, batch_idx):
            return self.dummy**2

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    theta, x = TASK.sample(200, torch.Generator().manual_seed(6))
    callback = PriorSupportCallback(theta, x, prior=TASK.prior())
    logger = CSVLogger(tmp_path, name="csv", version=0)
    train = DataLoader(TensorDataset(theta[:32], x[:32]), batch_size=16)
    L.Trainer(max_epochs=2, logger=logger, callbacks=[callback], enable_progress_bar=False,
              enable_model_summary=False, enable_checkpointing=False,
              default_root_dir=tmp_path).fit(Untruncated().double(), train)  # fmt: skip
    assert callback.epochs == [0, 1]
    shares = callback.history["statistic"]
    assert all(abs(s - float(outside_mass(x).mean())) < 0.05 for s in shares), shares
    text = (Path(logger.log_dir) / "metrics.csv").read_text()
    assert "calibration/support/statistic" in text
    row = next(line for line in summary_table([callback]).splitlines() if "p_value" in line)
    assert row.endswith(" rejected")
    assert sorted(p.name for p in (Path(logger.log_dir) / "calibration" / "support" /
                                   "history").glob("*.png")) == ["epoch=0000.png",
                                                                 "epoch=0001.png"]  # fmt: skip
    with pytest.raises(ValueError, match="needs exactly one of prior and metric"):
        PriorSupportCallback(theta, x)
