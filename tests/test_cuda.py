"""The checks on a CUDA device: the memory budget read from CUDA's allocator, every check
on CUDA tensors, and data on another device than the model.

Skipped without a GPU (CI has none). On one: ``python -m pytest tests/test_cuda.py``.
"""

import csv
import math

import pytest
import torch
import zuko

import calib_lightning as cl
from calib_lightning.evaluation import _memory
from calib_lightning.tasks import GaussianToy

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
CUDA = torch.device("cuda")


def _pairs(n: int, seed: int, dim: int = 3) -> tuple[GaussianToy, torch.Tensor, torch.Tensor]:
    toy = GaussianToy(dim=dim)
    theta, x = toy.sample(n, torch.Generator().manual_seed(seed))
    return toy, theta.to(CUDA), x.to(CUDA)


def test_every_check_runs_on_cuda_with_level_and_power():
    """The exact posterior on CUDA is not rejected, a 0.5x variance is, with the sign."""
    toy, theta, x = _pairs(600, seed=0)
    torch.manual_seed(0)
    for posterior, calibrated in ((toy.posterior(), True), (toy.posterior(0.5), False)):
        checks = [cl.RankCalibration(num_posterior_samples=99), cl.TARP(num_posterior_samples=99),
                  cl.LatentCalibration(), cl.KCCSD()]  # fmt: skip
        for metric in checks:
            metric.update(posterior, theta, x)
            out = metric.compute()
            p = getattr(out, "global_p_value", None)
            p = out.p_value if p is None else p
            name = type(metric).__name__
            # KCCSD's bootstrap floor is 1 / 501
            assert (float(p) > 0.01) if calibrated else (float(p) < 0.01), (name, float(p))
            error = getattr(out, "coverage_error", None)
            if not calibrated and error is not None:
                assert float(error) < 0, name  # over-confident: negative
        report = cl.diagnose(posterior, theta, x, observations=x[:2], seed=0)
        assert report.verdict.startswith("calibrated" if calibrated else "miscalibrated"), (
            report.verdict)  # fmt: skip


def test_the_budget_bounds_a_chunk_on_cuda():
    """A zuko spline flow on CUDA under a 32 MiB budget: the chunks are sized from the
    allocator's measured peak, and the check's peak above what was allocated before stays
    near the budget, where one unchunked call takes many times more."""
    torch.manual_seed(0)
    flow = zuko.flows.NSF(5, 5).to(CUDA)
    theta, x = torch.randn(400, 5, device=CUDA), torch.randn(400, 5, device=CUDA)
    budget = 32 * 2**20

    def peak(run) -> int:
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        run()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before

    with cl.set_memory_budget(budget):
        metric = cl.RankCalibration(num_posterior_samples=500)
        chunked = peak(lambda: metric.update(flow, theta, x))
    one_call = cl.RankCalibration(num_posterior_samples=500, max_chunk_elements=400 * 500 * 5)
    unchunked = peak(lambda: one_call.update(flow, theta, x))
    assert chunked <= 1.5 * budget, chunked / 2**20
    assert unchunked > 4 * chunked, (unchunked / 2**20, chunked / 2**20)
    assert _memory.DEFAULT_MEMORY_BUDGET == 256 * 2**20


def test_data_on_another_device_than_the_model_is_a_value_error():
    torch.manual_seed(0)
    flow = zuko.flows.NSF(3, 3).to(CUDA)
    _, theta, x = _pairs(50, seed=1)
    metric = cl.RankCalibration(num_posterior_samples=9)
    with pytest.raises(ValueError, match="device"):
        metric.update(flow, theta.cpu(), x.cpu())


def test_the_callbacks_check_a_model_training_on_cuda(tmp_path):
    """A zuko flow trained on the GPU: every callback checks it on CUDA, logs its scalars
    and writes its figures (a CSV logger: PNG files), and the report saves its figures."""
    import lightning as L
    from lightning.pytorch.loggers import CSVLogger
    from torch.utils.data import DataLoader, TensorDataset

    from calib_lightning.callbacks import (
        KCCSDCallback,
        LatentCalibrationCallback,
        LC2STNFCallback,
        RankCalibrationCallback,
        TARPCallback,
    )

    class NPE(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.flow = zuko.flows.MAF(2, 2, transforms=2, hidden_features=(32, 32))

        def training_step(self, batch, batch_idx):
            theta, x = batch
            return -self.flow(x).log_prob(theta).mean()

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-3)

    toy = GaussianToy(dim=2)
    theta, x = toy.sample(300, torch.Generator().manual_seed(1))
    train = DataLoader(TensorDataset(*toy.sample(512, torch.Generator().manual_seed(2))),
                       batch_size=128, shuffle=True)  # fmt: skip
    callbacks = [
        KCCSDCallback(theta, x), RankCalibrationCallback(theta, x), TARPCallback(theta, x),
        LatentCalibrationCallback(theta, x),
        LC2STNFCallback(theta, x, metric=cl.LC2STNF(observations=x[:2], num_null=20, seed=1)),
    ]  # fmt: skip
    logger = CSVLogger(tmp_path, name="csv", version=0)
    model = NPE()
    L.Trainer(accelerator="gpu", devices=1, max_epochs=2, logger=logger, callbacks=callbacks,
              enable_progress_bar=False, enable_checkpointing=False).fit(model, train)  # fmt: skip
    root = tmp_path / "csv" / "version_0" / "calibration"
    for name in ("kccsd", "ranks", "tarp", "latent", "lc2st_nf"):
        assert list((root / name).rglob("*.png")), name
    with open(tmp_path / "csv" / "version_0" / "metrics.csv") as table:
        rows = list(csv.DictReader(table))
    for name in ("kccsd", "ranks", "tarp", "latent", "lc2st_nf"):  # every check ran: no NaN
        values = [float(r[k]) for r in rows for k in r if k.startswith(f"calibration/{name}/")
                  and k.endswith("p_value") and r[k]]  # fmt: skip
        assert values, name
        assert all(math.isfinite(v) for v in values), name
    model.to(CUDA)  # Lightning moves the model back to the CPU after fit
    report = cl.diagnose(model.flow, theta.to(CUDA), x.to(CUDA), observations=x[:2].to(CUDA))
    report.save(tmp_path / "report")
    assert len(list((tmp_path / "report").rglob("*.png"))) >= 5


@pytest.mark.parametrize("local", [False, True, "regression"])
def test_conformal_regions_run_on_cuda(local):
    """A region fitted on CUDA pairs of an over-confident posterior (the posterior summary
    as features when local) covers 0.9 of fresh CUDA pairs, where the posterior's own 90 %
    region covers far less; memberships come back on the pairs' device."""
    toy, theta, x = _pairs(1000, seed=3, dim=2)
    _, theta_new, x_new = _pairs(2000, seed=4, dim=2)
    torch.manual_seed(3)
    narrow = toy.posterior(variance_scale=0.5)
    region = cl.ConformalRegion(narrow, local=local, num_posterior_samples=200,
                                embedding="posterior" if local else None)  # fmt: skip
    region.fit(theta, x)
    inside = region.contains(theta_new, x_new)
    assert inside.device == region.calibrated_level(0.9, x_new).device == x_new.device
    cover = float(inside.double().mean())
    assert abs(cover - 0.9) < 4 * (0.09 / 2000) ** 0.5 + 1 / 501, cover
    with torch.no_grad():
        own = cl.as_posterior(narrow).log_prob(theta_new, x_new) >= region.threshold(
            x_new, calibrated=False)  # fmt: skip
    assert float(own.double().mean()) < 0.75
    assert abs(float(region.coverage_error(theta_new, x_new))) < 0.03


def test_the_support_check_reads_a_cpu_prior_with_cuda_draws():
    """A prior built on the CPU (sbi's ``BoxUniform`` by default) and a posterior and pairs
    on CUDA: the support check reads it, on the CPU, and reports on the pairs' device."""
    toy, theta, x = _pairs(200, seed=5, dim=2)
    bound = float(theta.abs().max()) + 1e-3
    box = torch.distributions.Independent(
        torch.distributions.Uniform(torch.full((2,), -bound), torch.full((2,), bound)), 1)
    report = cl.diagnose(toy.posterior(variance_scale=4.0), theta, x, checks=("support",),
                         prior=box)  # fmt: skip
    result = report.checks["support"]
    assert result.leakage.device.type == "cuda"
    assert float(result.p_value) == 0.0  # four times the variance overflows the box


def test_a_posterior_restricted_to_a_cpu_prior_samples_and_scores_on_cuda():
    """``cl.recalibrate(..., prior=...)`` with the pairs and the flow on CUDA and the prior
    on the CPU: draws inside the box and log-densities on CUDA, the HPD scale fitted on
    the restricted posterior's levels, the support check passing it; ``"auto"`` scores
    its candidates' restricted NLL from the CUDA draws."""
    toy, theta, x = _pairs(200, seed=6, dim=2)
    bound = float(theta.abs().max()) + 1e-3
    box = torch.distributions.Independent(
        torch.distributions.Uniform(torch.full((2,), -bound), torch.full((2,), bound)), 1)
    fixed = cl.recalibrate(toy.posterior(variance_scale=4.0), theta, x, method="scale",
                           scale_target="hpd", prior=box)  # fmt: skip
    draws, log_q = fixed.sample_and_log_prob(x[:20], 50)
    assert draws.device.type == "cuda"
    assert log_q.device.type == "cuda"
    assert bool((draws.abs() <= bound).all())
    assert fixed.log_prob(theta, x).device.type == "cuda"
    report = cl.diagnose(fixed, theta, x, checks=("support",), prior=box)
    assert float(report.checks["support"].p_value) == 1.0
    auto = cl.recalibrate(toy.posterior(variance_scale=4.0), theta, x, method="auto",
                          prior=box)  # the candidates' restricted NLL from CUDA draws
    assert all(math.isfinite(s["nll"]) for s in auto.selection.values())
    assert auto.sample(x[:5], 10).device.type == "cuda"


def test_diagnose_tests_a_restricted_posterior_at_cuda_observations_with_lc2st():
    """A posterior without latents on CUDA (restricted to a CPU box): ``cl.diagnose`` runs
    L-C2ST at the observations in L-C2ST-NF's place, on CUDA draws, and finds a shifted
    posterior at every observation; an observation with no mass inside skips it with the
    x named. The rejection rounds draw in chunks of CUDA's budget."""
    toy, theta, x = _pairs(500, seed=7, dim=2)
    bound = float(theta.abs().max()) + 1e-3
    box = torch.distributions.Independent(
        torch.distributions.Uniform(torch.full((2,), -bound), torch.full((2,), bound)), 1)
    restricted = cl.TruncatedPosterior(toy.posterior(shift=0.5), box)
    report = cl.diagnose(restricted, theta, x, observations=x[:3], seed=0)
    local = report.checks["lc2st"]
    assert local.samples.device.type == "cuda"
    assert float(local.global_p_value) < 0.05
    assert report.findings.observations["lc2st"].named == [0, 1, 2]
    far = torch.full((1, 2), 50.0, device=CUDA)
    report = cl.diagnose(restricted, theta, x, observations=far, checks=("lc2st",), seed=0)
    assert "at x = [50, 50]" in report.skipped["lc2st"]
