"""cl.diagnose: verdicts on exact and miscalibrated posteriors, the report, the command line."""

from __future__ import annotations

import base64
import dataclasses
import json
import re
import textwrap

import pytest
import torch

import calib_lightning as cl
from calib_lightning.__main__ import main
from calib_lightning.diagnosis._verdict import verdict, verdict_sentence
from calib_lightning.functional.combine import combine_p_values
from calib_lightning.metrics.lc2st import LC2STResult
from calib_lightning.misspecification import MisspecificationResult
from calib_lightning.tasks import GaussianToy
from calib_lightning.tasks._common import normal

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
                 reference_samples=reference, prior=TOY.prior())  # fmt: skip
    # L-C2ST runs only in L-C2ST-NF's place (a posterior without latents)
    assert set(report.checks) == {*cl.diagnosis.CHECKS, "reference"} - {
        "lc2st", "coverage_is", "balance", "interval_coverage"}  # a flow; the last runs if named
    assert float(report.checks["support"].p_value) == 1.0  # a normal prior: no draw outside
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
    assert len(images) == len(report.figures) >= 8 + 3
    for o in range(3):  # L-C2ST-NF shows where: a probability map and PP-plot per observation
        assert f'id="lc2st_probability_map_{o}"' in text
    assert report.probability_maps.probabilities.shape == (3, 2000)
    assert "Per observation" in text
    assert "Holm" in text
    assert "Directions" in text
    assert all(base64.b64decode(i)[:8] == b"\x89PNG\r\n\x1a\n" for i in images)
    assert sorted(p.stem for p in (tmp_path / "report" / "figures").glob("*.png")) == sorted(
        report.figures
    )
    summary = json.loads((tmp_path / "report" / "summary.json").read_text())
    assert summary["verdict"] == report.verdict
    assert [row["check"] for row in summary["checks"]] == list(report.checks)
    assert "When checks disagree" in text
    # the shared posterior draws are timed once, outside every check's seconds
    assert summary["draw_seconds"] == report.seconds["draws"] > 0
    assert f"drawn once in {report.seconds['draws']:.1f} s" in text


def test_the_overall_verdict_keeps_its_level_on_exact_posteriors():
    """One fresh dataset per repetition, default arguments and seed, as a user runs it."""
    rejected, directions = [], []
    for rep in range(100):
        theta, x = pairs(200, seed=1000 + rep)
        torch.manual_seed(rep)
        report = cl.diagnose(TOY.posterior(), theta, x, checks=("kccsd", "ranks", "tarp"),
                             num_posterior_samples=50)  # fmt: skip
        rejected.append(report.overall_p_value < 0.05)
        directions.append(any(d.named for d in report.findings.directions))
    rate = sum(rejected) / len(rejected)
    assert 0.01 <= rate <= 0.11, rate  # 99% binomial band around 0.05 for 100 datasets
    # gated and Holm-corrected: no more often than the level (the same band's upper end)
    assert sum(directions) <= 11, sum(directions)


class BiasedInFirst:
    """The exact posterior with its first coordinate's mean moved up by 0.5 (1.1 sd)."""

    def __call__(self, x: torch.Tensor) -> torch.distributions.Distribution:
        exact = TOY.posterior()
        return normal(exact.weight * x + torch.tensor([0.5, 0.0]), exact.std)


@pytest.mark.parametrize(
    ("posterior", "words", "absent"),
    [
        (TOY.posterior(variance_scale=0.7), "over-confident", ("under-confident", "biased")),
        (TOY.posterior(variance_scale=2.0), "under-confident",
         ("over-confident", "too rarely", "biased")),
        (BiasedInFirst(), "biased in a: posterior too high", ("biased in b", "under-confident")),
    ],
)  # fmt: skip
def test_miscalibrated_posteriors_get_only_the_directions_a_test_found(posterior, words, absent):
    """Over-confident by 30 % (variance x 0.7), under-confident (variance x 2), biased in
    one parameter. Two datasets each (seeds 1, 2; with seed 0 the *data* happen to put
    parameter a's mean rank 2.5 standard errors off under the exact posterior, and Holm
    names that bias beside the real direction: a chance error Holm allows in at most 5 %
    of datasets, measured in examples/benchmarks/results/verdict_directions.md)."""
    for seed in (1, 2):
        theta, x = pairs(seed=seed)
        report = run(posterior, theta, x, checks=("ranks", "tarp"), labels=["a", "b"])
        assert report.verdict.startswith("miscalibrated"), report.verdict
        assert words in report.verdict, report.verdict
        for word in absent:
            assert word not in report.verdict, report.verdict
        named = [d for d in report.findings.directions if d.named]
        assert named
        assert all(d.adjusted_p_value < 0.05 for d in named)


def test_a_size_is_given_beside_each_direction():
    theta, x = pairs(seed=1)
    report = run(TOY.posterior(variance_scale=0.7), theta, x, checks=("ranks",))
    match = re.search(r"over-confident \(coverage error (-0\.\d+) ± (0\.\d+)\)", report.verdict)
    assert match, report.verdict
    error, half = float(match[1]), float(match[2])
    assert error == pytest.approx(float(report.checks["ranks"].coverage_error), abs=1e-3)
    assert 0.02 < half < 0.04  # about 1.96 / sqrt(12 N) at N = 400
    assert "coverage error" in report.table()


def test_a_chance_rejection_of_a_non_directional_check_names_no_direction():
    """The exact posterior, with KCCSD and TARP rejecting (by chance, as they do in 5 %
    of datasets): miscalibrated by the overall test, but no direction is named, since
    no directional test rejects; the sentence names the checks and their figures."""
    theta, x = pairs(seed=1)
    report = run(TOY.posterior(), theta, x, checks=SAMPLING)
    assert report.verdict.startswith("calibrated"), report.verdict
    checks = dict(report.checks)
    checks["kccsd"] = dataclasses.replace(checks["kccsd"], p_value=torch.tensor(1e-4))
    checks["tarp"] = dataclasses.replace(checks["tarp"], p_value=torch.tensor(1e-3))
    assert float(checks["ranks"].coverage_error) != 0  # the old rule read its sign
    sentence = verdict_sentence(checks, 0.05, ["a", "b"])
    assert sentence.startswith("miscalibrated: KCCSD (p = 0.0001) and TARP (p = 0.001) reject")
    assert "no directional test does" in sentence
    assert "TARP coverage figure" in sentence
    for word in ("confident", "biased", "too rarely", "too often"):
        assert word not in sentence, sentence


def test_a_lone_rejection_the_overall_test_does_not_confirm_is_said_not_hidden():
    """The KCCSD row says "rejected" (p = 0.04) while the Cauchy combination of the four
    checks does not: the sentence says both, so it does not contradict the table."""
    theta, x = pairs(seed=1)
    report = run(TOY.posterior(), theta, x, checks=SAMPLING)
    checks = dict(report.checks)
    checks["kccsd"] = dataclasses.replace(checks["kccsd"], p_value=torch.tensor(0.04))
    found = verdict(checks, 0.05)
    assert found.overall_p_value >= 0.05
    assert found.sentence.startswith("calibrated: no evidence of miscalibration at level 0.05 "
                                     "(overall p = ")  # fmt: skip
    assert "KCCSD (p = 0.04) alone rejects, which the combination of the 3 checks" in (
        found.sentence)


def misspecification(p_values: list[float]) -> MisspecificationResult:
    p = torch.tensor(p_values, dtype=torch.float64)
    return MisspecificationResult(
        p_value=p, global_p_value=combine_p_values(p, method="holm"), score=torch.zeros_like(p),
        calibration_scores=torch.zeros(999), num_simulations=2000, num_fit=1001, k=5,
        global_method="holm",
    )  # fmt: skip


def lc2st(p_values: list[float], num_null: int = 100) -> LC2STResult:
    p = torch.tensor(p_values)
    o, grid = p.shape[0], torch.linspace(0, 1, 101)
    return LC2STResult(
        statistic=torch.linspace(0.05, 0.01, o), p_value=p,
        global_p_value=combine_p_values(p).float(), probabilities=torch.full((o, 10), 0.5),
        null_statistics=torch.full((num_null, o), 0.004), pp_grid=grid,
        pp_ecdf=grid.expand(o, -1), pp_band=grid.expand(2, o, -1),
    )  # fmt: skip


def test_per_observation_lists_are_holm_corrected():
    # raw p < 0.05 at observations 0 and 1, Holm-adjusted 0.09 and 0.08: none named
    found = verdict({"misspecification": misspecification([0.03, 0.04, 0.6])}, 0.05)
    assert found.observations["misspecification"].named == []
    assert "outside the simulator" not in found.sentence
    # the reverse: Bonferroni would keep 0.03 * 2 = 0.06, Holm's step-down names both
    found = verdict({"misspecification": misspecification([0.001, 0.03])}, 0.05)
    assert found.observations["misspecification"].adjusted_p_value == pytest.approx([0.002, 0.03])
    assert "observations 0 and 1 look outside the simulator" in found.sentence
    # L-C2ST-NF: 0.0099 * 4 = 0.0396 is named, 0.02 (Holm 0.06) is not
    found = verdict({"lc2st_nf": lc2st([0.0099, 0.02, 0.03, 0.5])}, 0.05)
    assert found.observations["lc2st_nf"].named == [0]
    assert "wrong at observation 0 (L-C2ST statistic 0.05; null 95% quantile" in found.sentence
    # six observations and 100 null classifiers: no observation can be named
    found = verdict({"lc2st_nf": lc2st([0.0099] * 6)}, 0.05)
    assert found.sentence.startswith("miscalibrated: L-C2ST-NF rejects over the observations "
                                     "together, at no single one after Holm's correction; "
                                     "with 6 observations the smallest Holm-adjusted p-value "
                                     "is 0.059")  # fmt: skip


def test_per_observation_lists_never_contradict_their_row():
    """Holm names observation 0 (adjusted 0.04), but the L-C2ST-NF row's Cauchy global
    p-value does not reject: the sentence names no observation."""
    result = lc2st([0.02, 0.999])
    assert float(result.global_p_value) >= 0.05
    found = verdict({"lc2st_nf": result}, 0.05)
    assert found.sentence.startswith("calibrated")
    assert found.observations["lc2st_nf"].named == []


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


def prior():
    return torch.distributions.MultivariateNormal(torch.zeros(2), torch.eye(2))
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
    # every check but the support check, which needs the prior, L-C2ST (latents here) and
    # those of a posterior known up to its constant
    assert {row["check"] for row in summary["checks"]} == set(cl.diagnosis.CHECKS) - {
        "support", "lc2st", "coverage_is", "balance", "interval_coverage"}
    assert summary["verdict"].split(":")[0] in ("calibrated", "miscalibrated")
    with pytest.raises(ValueError, match="--module must be"):
        main(["diagnose", "--module", "toy_npe", "--checkpoint", "x", "--data", "y"])
    # --prior: a function of the user's module that returns the prior adds the support check
    code = main([
        "diagnose", "--module", "toy_npe:ToyNPE", "--checkpoint", str(tmp_path / "last.ckpt"),
        "--data", str(tmp_path / "cal.pt"), "--out", str(tmp_path / "support"),
        "--num-posterior-samples", "20", "--checks", "support", "--prior", "toy_npe:prior",
    ])  # fmt: skip
    assert code == 0
    summary = json.loads((tmp_path / "support" / "summary.json").read_text())
    assert [row["check"] for row in summary["checks"]] == ["support"]
    assert summary["checks"][0]["p_value"] == 1.0  # a normal prior: nothing outside
    with pytest.raises(ValueError, match="--prior: toy_npe has no attribute 'box'"):
        main(["diagnose", "--module", "toy_npe:ToyNPE", "--checkpoint",
              str(tmp_path / "last.ckpt"), "--data", str(tmp_path / "cal.pt"),
              "--prior", "toy_npe:box"])  # fmt: skip


def test_command_line_diagnoses_the_recalibrated_posterior_beside_the_flow(
    tmp_path, monkeypatch, capsys
):
    """Issue 25: ``--recalibrated`` reads the map a RecalibrationCallback saved in the
    checkpoint and writes one report of the posterior before and after it."""
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    (tmp_path / "toy_npe_recal.py").write_text(textwrap.dedent(MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    from toy_npe_recal import ToyNPE

    theta, x = pairs(512, seed=1)
    theta_val, x_val = pairs(200, seed=3)
    torch.manual_seed(4)  # the flow's initialization
    callback = cl.RecalibrationCallback(theta_val, x_val, method="scale")
    trainer = L.Trainer(max_epochs=2, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=tmp_path,
                        callbacks=[callback])  # fmt: skip
    trainer.fit(ToyNPE(), DataLoader(TensorDataset(theta, x), batch_size=128))
    trainer.save_checkpoint(tmp_path / "last.ckpt")
    cal_theta, cal_x = pairs(200, seed=2)
    torch.save({"theta": cal_theta, "x": cal_x}, tmp_path / "cal.pt")
    command = ["diagnose", "--module", "toy_npe_recal:ToyNPE", "--data",
               str(tmp_path / "cal.pt"), "--num-posterior-samples", "50",
               "--checks", "ranks,tarp", "--recalibrated"]  # fmt: skip
    code = main([*command, "--checkpoint", str(tmp_path / "last.ckpt"),
                 "--out", str(tmp_path / "out")])  # fmt: skip
    assert code == 0
    assert "report:" in capsys.readouterr().out
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert set(summary) >= {"before", "after", "checks"}
    assert (tmp_path / "out" / "before" / "report.html").exists()
    # the after column is the callback's posterior, diagnosed beside the flow with common
    # random numbers: the same call in Python gives the same verdicts
    flow = trainer.lightning_module.flow
    with torch.no_grad():
        fixed = cl.diagnose(callback.posterior(flow), cal_theta, cal_x, before=flow,
                            checks=("ranks", "tarp"), num_posterior_samples=50)  # fmt: skip
    assert summary["after"]["verdict"] == fixed.verdict
    assert summary["before"]["verdict"] == fixed.before.verdict
    # a checkpoint without the callback's map: a ValueError naming the option
    plain = L.Trainer(max_epochs=1, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, default_root_dir=tmp_path)  # fmt: skip
    plain.fit(ToyNPE(), DataLoader(TensorDataset(theta, x), batch_size=128))
    plain.save_checkpoint(tmp_path / "plain.ckpt")
    with pytest.raises(ValueError, match="--recalibrated needs the checkpoint"):
        main([*command, "--checkpoint", str(tmp_path / "plain.ckpt")])


def test_diagnose_gives_the_local_test_enough_null_classifiers_to_name_an_observation():
    from calib_lightning.diagnosis.checks import local_num_null

    for num_obs in (1, 3, 6, 10, 40):
        h = local_num_null(num_obs, 0.05)
        assert h >= 100
        assert num_obs / (1 + h) <= 0.05 / 2  # the smallest Holm-adjusted p-value
    assert local_num_null(3, 0.05) == 120
    assert local_num_null(2, 0.05) == 100


def test_a_verdict_inside_its_monte_carlo_error_says_so():
    """A randomized check whose p-value lies within twice its Monte Carlo error of the
    level is named as one another seed may reverse, in the sentence, the table and the
    summary; one far from the level is not."""
    import dataclasses

    from calib_lightning.diagnosis._verdict import verdict
    from calib_lightning.functional.tarp import tarp

    theta, x = pairs(300, seed=7)
    samples = TOY.posterior()(x).sample((50,))
    result = tarp(samples, theta, generator=torch.Generator().manual_seed(0))
    near = dataclasses.replace(result, p_value=torch.tensor(0.045, dtype=torch.float64),
                               p_value_error=torch.tensor(0.01, dtype=torch.float64))
    far = dataclasses.replace(near, p_value=torch.tensor(0.001, dtype=torch.float64),
                              p_value_error=torch.tensor(0.001, dtype=torch.float64))
    found = verdict({"tarp": near}, 0.05)
    assert found.unsettled == {"tarp": (0.045, 0.01)}
    assert "TARP (p = 0.045, another seed 0.025-0.065) within twice its Monte Carlo" in (
        found.sentence
    )
    assert verdict({"tarp": far}, 0.05).unsettled == {}
    # an error larger than the p-value: the range stops at 0, never "p = 0.053 ± 0.1"
    wide = dataclasses.replace(near, p_value=torch.tensor(0.053, dtype=torch.float64),
                               p_value_error=torch.tensor(0.1, dtype=torch.float64))
    sentence = verdict({"tarp": wide}, 0.05).sentence
    assert "(p = 0.053, another seed 0-0.25)" in sentence
    assert "±" not in sentence
    report = cl.diagnosis.Diagnosis({"tarp": near}, level=0.05)
    row = next(r for r in report.rows() if r["check"] == "tarp")
    assert row["verdict"] == "rejected (within Monte Carlo error)"
    assert row["p_value_error"] == 0.01
    assert report.summary()["unsettled"] == {"tarp": {"p_value": 0.045, "p_value_error": 0.01}}


def test_a_wrong_theta_is_named_as_theta_not_as_a_prior_that_does_not_fit_it():
    """theta with a column too many: the message names theta and its full shape (the
    prior was checked first and blamed: 'prior must have event shape (D,) = (3,)')."""
    from torch.distributions import Independent, Uniform

    theta, x = pairs(50, seed=8)
    prior = Independent(Uniform(-5 * torch.ones(2), 5 * torch.ones(2)), 1)
    wide = torch.cat([theta, theta[:, :1]], 1)
    with pytest.raises(ValueError, match=r"theta must have D = 2 columns.*got shape \(50, 3\)"):
        cl.diagnose(TOY.posterior(), wide, x, prior=prior)
