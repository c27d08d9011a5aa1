"""cl.diagnose(..., before=...): before and after a recalibration, side by side."""

from __future__ import annotations

import json
import re

import pytest
import torch
from torch.distributions import Independent, Normal

import calib_lightning as cl
from calib_lightning.tasks import GaussianToy

TOY = GaussianToy(dim=2)
CHECKS = ("kccsd", "ranks", "tarp", "recovery")


@pytest.fixture(scope="module")
def fixed_and_wrong():
    """A too-narrow posterior (variance x 0.25), its scale recalibration on 400 held-out
    pairs, and 400 fresh pairs to diagnose both on."""
    generator = torch.Generator().manual_seed(0)
    theta_val, x_val = TOY.sample(400, generator)
    theta, x = TOY.sample(400, generator)
    wrong = TOY.posterior(variance_scale=0.25)
    return cl.recalibrate(wrong, theta_val, x_val, method="scale"), wrong, theta, x


def test_the_report_shows_before_and_after_side_by_side(fixed_and_wrong, tmp_path):
    fixed, wrong, theta, x = fixed_and_wrong
    report = cl.diagnose(fixed, theta, x, checks=CHECKS, labels=["a", "b"], before=wrong)
    assert report.verdict.startswith("calibrated"), report.verdict
    assert report.before.verdict.startswith("miscalibrated: over-confident"), report.before
    assert "before=" in repr(report)
    rows = {row["check"]: row for row in report.comparison.rows()}
    assert set(rows) == set(CHECKS)
    assert rows["ranks"]["before_p_value"] < 1e-10 < 0.05 < rows["ranks"]["after_p_value"]
    assert rows["ranks"]["before_verdict"] == "rejected"
    assert rows["ranks"]["after_verdict"] == "not rejected"
    errors = {row["quantity"]: row for row in report.comparison.coverage_rows()}
    assert errors["hpd_signed_area"]["before"] < -0.2  # over-confident
    assert abs(errors["hpd_signed_area"]["after"]) < 0.03
    assert errors["hpd_largest_gap"]["after"] < errors["hpd_largest_gap"]["before"]
    text = report.comparison.table()
    assert text.splitlines()[0].split() == ["before", "after"]
    assert "ranks" in text
    assert "hpd_signed_area" in text

    page = report.save(tmp_path / "report")
    html = page.read_text()
    for words in ("before and after", "p-value before", "p-value after", "verdict before",
                  "verdict after", "Coverage errors", "Over-confident", "No evidence"):  # fmt: skip
        assert words.lower() in html.lower(), words
    figure = r'<figure id="([^"]+)"><figcaption>[^<]*</figcaption>'
    pairs = re.findall(figure + r'<div class="pair[^"]*">(.*?)</div></figure>', html, flags=re.S)
    assert {key for key, _ in pairs} == set(report.figures)  # every figure, before and after
    assert len(pairs) == len(report.figures) >= 6
    for _, pair in pairs:
        assert len(re.findall(r'src="data:image/png;base64,', pair)) == 2
    assert 'id="ranks_expected_coverage_before_after"' in html  # both curves, same axes
    assert 'class="pair stacked"' in html  # the wide figures one above the other
    for side in ("before", "after"):  # each posterior's own full report beside
        assert (tmp_path / "report" / side / "report.html").exists()
        assert f'href="{side}/report.html"' in html
    summary = json.loads((tmp_path / "report" / "summary.json").read_text())
    assert summary["before"]["verdict"] == report.before.verdict
    assert summary["after"]["verdict"] == report.verdict
    assert {row["check"] for row in summary["checks"]} == set(CHECKS)


def test_before_as_a_diagnosis_compares_the_two_diagnoses_as_they_are(fixed_and_wrong):
    """A diagnosis passed as ``before`` is shown as it is, beside this posterior's own
    diagnosis (no common random numbers can be shared with it afterwards); a posterior
    passed as ``before`` is diagnosed with this one's random numbers."""
    fixed, wrong, theta, x = fixed_and_wrong
    first = cl.diagnose(wrong, theta, x, checks=CHECKS, seed=3)
    alone = cl.diagnose(fixed, theta, x, checks=CHECKS, seed=3)
    given = cl.diagnose(fixed, theta, x, checks=CHECKS, seed=3, before=first)
    assert given.before is first
    for row in given.comparison.rows():
        check = row["check"]
        for side, diagnosis in (("before", first), ("after", alone)):
            own = next(r for r in diagnosis.rows() if r["check"] == check)
            assert row[f"{side}_p_value"] == (own["global_p_value"] if own["global_p_value"]
                                              is not None else own["p_value"])  # fmt: skip
    paired = cl.diagnose(fixed, theta, x, checks=CHECKS, seed=3, before=wrong)
    assert paired.comparison.rows()[0]["check"] == "kccsd"
    assert paired.checks["kccsd"].p_value == alone.checks["kccsd"].p_value  # no draws


def test_a_report_without_before_is_unchanged(fixed_and_wrong, tmp_path):
    fixed, _, theta, x = fixed_and_wrong
    report = cl.diagnose(fixed, theta, x, checks=("ranks",))
    assert report.before is None
    assert report.comparison is None
    html = report.save(tmp_path).read_text()
    assert "before and after" not in html
    assert 'class="pair"' not in html


def test_a_before_that_does_not_fit_names_the_argument(fixed_and_wrong):
    fixed, _, theta, x = fixed_and_wrong

    def three_parameters(x):  # an estimator of another event size D = 3
        return Independent(Normal(torch.zeros(x.shape[0], 3), torch.ones(x.shape[0], 3)), 1)

    with pytest.raises(ValueError, match=r"^before must be a posterior of the same parameters"):
        cl.diagnose(fixed, theta, x, checks=CHECKS, before=three_parameters)
    other = cl.diagnose(fixed, theta[:100], x[:100], checks=("ranks",))
    with pytest.raises(ValueError, match=r"^before must be a diagnosis of the same N = 400"):
        cl.diagnose(fixed, theta, x, checks=("ranks",), before=other)
    with pytest.raises(ValueError, match=r"^before must be diagnosed at the same level"):
        cl.diagnosis.Comparison(other, cl.diagnose(fixed, theta, x, checks=("ranks",)))


def test_the_same_posterior_before_and_after_changes_no_decision_at_any_seed():
    """Common random numbers: the posterior compared with itself gives the same numbers in
    both columns at every one of 20 seeds (an over-confident posterior whose TARP and
    joint-classifier p-values move with the seed), and the report says nothing changed."""
    generator = torch.Generator().manual_seed(11)
    theta, x = TOY.sample(300, generator)
    wrong = TOY.posterior(variance_scale=0.7)
    for seed in range(20):
        report = cl.diagnose(wrong, theta, x, seed=seed, before=wrong,
                             checks=("kccsd", "ranks", "tarp", "joint_c2st"))  # fmt: skip
        comparison = report.comparison
        assert comparison.changed == [], (seed, comparison.table())
        for row in comparison.rows():
            assert row["before_p_value"] == row["after_p_value"], (seed, row)
        assert "No check changed its decision" in comparison.summary_line()


def test_an_identity_fix_is_reported_as_no_change(tmp_path):
    """A recalibration that fits the identity says so in its own repr, in the comparison's
    result and repr, and in the report; its numbers equal the posterior's (the shared
    draws come from the same latents)."""
    generator = torch.Generator().manual_seed(12)
    theta, x = TOY.sample(300, generator)
    exact = TOY.posterior()
    fixed = cl.recalibrate(exact, theta, x, method="none")
    assert fixed.is_identity
    report = cl.diagnose(fixed, theta, x, before=exact, seed=3,
                         checks=("kccsd", "ranks", "tarp", "joint_c2st"))  # fmt: skip
    assert report.comparison.identity
    assert "no change" in repr(report.comparison)
    assert "no change" in repr(report)
    for row in report.comparison.rows():
        assert row["before_p_value"] == pytest.approx(row["after_p_value"], rel=1e-6), row
    page = report.save(tmp_path).read_text()
    assert "No change: the fix is the identity" in page
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["identity"] is True
    assert summary["change"].startswith("No change")


def test_a_flow_and_its_scale_fix_share_their_latent_draws():
    """Before and after on the same latent draws: the fixed posterior's draws are the
    flow's draws pushed through the fitted latent map, so a small fit moves every draw a
    little instead of redrawing them all."""
    from calib_lightning.diagnosis._check import Inputs
    from calib_lightning.diagnosis._run import shared_draws
    from calib_lightning.evaluation import draws
    from calib_lightning.posteriors import as_posterior

    generator = torch.Generator().manual_seed(13)
    theta_val, x_val = TOY.sample(300, generator)
    theta, x = TOY.sample(200, generator)
    wrong = as_posterior(TOY.posterior(variance_scale=0.5))
    fixed = cl.recalibrate(wrong, theta_val, x_val, method="scale")
    inputs = Inputs(theta=theta, x=x, observations=None, reference_samples=None, prior=None,
                    level=0.05, seed=0, num_posterior_samples=30, embedding=None, devices=[])
    after, before = shared_draws([fixed, wrong], inputs)
    z_after = fixed.to_latent(draws(after, x, 30), x)
    z_before = wrong.to_latent(draws(before, x, 30), x)
    torch.testing.assert_close(z_after, z_before, rtol=1e-4, atol=1e-4)
