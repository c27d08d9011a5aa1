"""cl.diagnose: verdicts on exact and miscalibrated posteriors, the report, the command line."""

from __future__ import annotations

import base64
import json
import re
import textwrap

import pytest
import torch

import calib_lightning as cl
from calib_lightning.__main__ import main
from calib_lightning.tasks import GaussianToy

TOY = GaussianToy(dim=2)
SAMPLING = ("kccsd", "ranks", "tarp", "recovery")


def pairs(n: int = 400, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    return TOY.sample(n, torch.Generator().manual_seed(seed))


def run(posterior, theta, x, **kwargs):
    torch.manual_seed(0)  # the toy posteriors sample with the global generator
    return cl.diagnose(posterior, theta, x, **kwargs)


def test_the_report_has_every_check_table_figure_and_summary(tmp_path):
    theta, x = pairs()
    observations = TOY.sample(3, torch.Generator().manual_seed(5))[1]
    with torch.random.fork_rng():
        torch.manual_seed(9)
        reference = TOY.posterior()(observations).sample((300,))  # exact posterior samples
    report = run(TOY.posterior(), theta, x, observations=observations, labels=["a", "b"],
                 reference_samples=reference)  # fmt: skip
    assert set(report.checks) == {*cl.diagnosis.CHECKS, "reference"}
    assert report.checks["reference"].mmd_p_value.shape == (3,)
    assert float(report.checks["reference"].mmd_p_value.min()) > 0.01  # the same posterior
    calibrated = report.overall_p_value >= 0.05
    assert report.verdict.startswith("calibrated") == calibrated, report.verdict
    assert report.checks["lc2st_nf"].p_value.shape == (3,)
    table = report.table()
    for name in report.checks:
        assert name in table
    page = report.save(tmp_path / "report")
    text = page.read_text()
    images = re.findall(r'src="data:image/png;base64,([^"]+)"', text)
    assert len(images) == len(report.figures) >= 8
    assert all(base64.b64decode(i)[:8] == b"\x89PNG\r\n\x1a\n" for i in images)
    assert sorted(p.stem for p in (tmp_path / "report" / "figures").glob("*.png")) == sorted(
        report.figures
    )
    summary = json.loads((tmp_path / "report" / "summary.json").read_text())
    assert summary["verdict"] == report.verdict
    assert [row["check"] for row in summary["checks"]] == list(report.checks)
    assert "When checks disagree" in text


def test_the_overall_verdict_keeps_its_level_on_exact_posteriors():
    """One fresh dataset per repetition, default arguments and seed, as a user runs it."""
    rejected = []
    for rep in range(100):
        theta, x = pairs(200, seed=1000 + rep)
        torch.manual_seed(rep)
        report = cl.diagnose(TOY.posterior(), theta, x, checks=("kccsd", "ranks", "tarp"),
                             num_posterior_samples=50)  # fmt: skip
        rejected.append(report.overall_p_value < 0.05)
    rate = sum(rejected) / len(rejected)
    assert 0.01 <= rate <= 0.11, rate  # 99% binomial band around 0.05 for 100 datasets


@pytest.mark.parametrize(
    ("posterior", "words"),
    [
        (TOY.posterior(variance_scale=0.4), "over-confident"),
        (TOY.posterior(variance_scale=2.5), "under-confident"),
        (TOY.posterior(shift=0.5), "biased in parameter 0 (posterior mean too high)"),
    ],
)
def test_miscalibrated_posteriors_get_the_right_sentence(posterior, words):
    theta, x = pairs()
    report = run(posterior, theta, x, checks=SAMPLING)
    assert report.verdict.startswith("miscalibrated"), report.verdict
    assert words in report.verdict
    assert report.overall_p_value < 1e-3


def test_an_offset_observation_is_flagged_outside_the_simulator():
    theta, x = pairs()
    observations = torch.stack([x[0] * 0, torch.full((2,), 12.0)])
    report = run(TOY.posterior(), theta, x, observations=observations,
                 checks=("misspecification",))  # fmt: skip
    assert "observation 1 looks outside the simulator" in report.verdict
    assert "observation 0" not in report.verdict


def test_bad_arguments_raise_naming_them():
    theta, x = pairs(20)
    with pytest.raises(ValueError, match="checks must be among"):
        cl.diagnose(TOY.posterior(), theta, x, checks=("sbc",))
    with pytest.raises(ValueError, match="need observations"):
        cl.diagnose(TOY.posterior(), theta, x, checks=("lc2st_nf",))
    with pytest.raises(ValueError, match="reference_samples must have shape"):
        cl.diagnose(TOY.posterior(), theta, x, reference_samples=torch.zeros(5, 2, 2))
    with pytest.raises(ValueError, match="labels must name the D = 2"):
        cl.diagnose(TOY.posterior(), theta, x, labels=["a"])


MODULE = '''
import lightning as L
import torch
import zuko


class ToyNPE(L.LightningModule):
    def __init__(self, features: int = 2):
        super().__init__()
        self.save_hyperparameters()
        self.flow = zuko.flows.MAF(features, features, transforms=2, hidden_features=(16,))

    def training_step(self, batch, batch_idx):
        theta, x = batch
        return -self.flow(x).log_prob(theta).mean()

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)
'''


def test_command_line_diagnoses_a_checkpoint(tmp_path, monkeypatch, capsys):
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    (tmp_path / "toy_npe.py").write_text(textwrap.dedent(MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    from toy_npe import ToyNPE  # the module a user would have

    theta, x = pairs(512, seed=1)
    trainer = L.Trainer(max_epochs=2, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=tmp_path)  # fmt: skip
    trainer.fit(ToyNPE(), DataLoader(TensorDataset(theta, x), batch_size=128))
    trainer.save_checkpoint(tmp_path / "last.ckpt")
    cal_theta, cal_x = pairs(200, seed=2)
    torch.save({"theta": cal_theta, "x": cal_x, "observations": cal_x[:2]}, tmp_path / "cal.pt")
    code = main([
        "diagnose", "--module", "toy_npe:ToyNPE", "--checkpoint", str(tmp_path / "last.ckpt"),
        "--data", str(tmp_path / "cal.pt"), "--out", str(tmp_path / "out"),
        "--num-posterior-samples", "50", "--labels", "a,b",
    ])  # fmt: skip
    assert code == 0
    printed = capsys.readouterr().out
    assert "report:" in printed
    assert (tmp_path / "out" / "report.html").exists()
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert {row["check"] for row in summary["checks"]} == set(cl.diagnosis.CHECKS)
    assert summary["verdict"].split(":")[0] in ("calibrated", "miscalibrated")
    with pytest.raises(ValueError, match="--module must be"):
        main(["diagnose", "--module", "toy_npe", "--checkpoint", "x", "--data", "y"])
