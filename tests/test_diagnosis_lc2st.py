"""``cl.diagnose`` at observations of a posterior without latents: L-C2ST in L-C2ST-NF's place.

A samples-only estimator, a box-uniform base or a posterior restricted to the prior's support
has no latent space, so L-C2ST-NF cannot run; L-C2ST (the classifier between the true
parameters and one posterior draw per pair, its null retrained on label swaps within pairs)
asks the same question from draws. Level through the public call at its defaults on fresh
datasets, power and the sentence on a shifted sampler, both tests when both are named, and
the before/after report of a flow restricted to its prior.
"""

from __future__ import annotations

import pytest
import torch

import calib_lightning as cl
from calib_lightning.tasks import GaussianToy

TOY = GaussianToy(dim=2)


def sampler(shift: float = 0.0) -> cl.SamplePosterior:
    exact = TOY.posterior(shift=shift)
    return cl.SamplePosterior(lambda x, num_samples: exact(x).sample((num_samples,)))


def test_lc2st_holds_its_level_in_diagnose_on_an_exact_sampler():
    """40 fresh datasets (300 pairs, 3 observations), ``cl.diagnose`` with its default
    checks, seed and null: the L-C2ST verdict p-value's rejections are Binomial(40, <= 0.05);
    P(X >= 7) = 0.003 at exactly 0.05. No observation is named when it does not reject."""
    rejected = 0
    for rep in range(40):
        g = torch.Generator().manual_seed(1000 + rep)
        theta, x = TOY.sample(300, g)
        observations = TOY.sample(3, g)[1]
        torch.manual_seed(rep)
        report = cl.diagnose(sampler(), theta, x, observations=observations)
        p = float(report.checks["lc2st"].global_p_value)
        rejected += p < 0.05
        if p >= 0.05:
            assert report.findings.observations["lc2st"].named == []
            assert "wrong at" not in report.verdict, report.verdict
    assert rejected <= 6, rejected


def test_lc2st_finds_a_shifted_sampler_and_names_the_observations(tmp_path):
    """Power: a sampler whose mean is shifted by 0.5 is rejected on each of 5 fresh
    datasets, every observation named by Holm; the sentence says L-C2ST found it there,
    and the figures and the HTML say L-C2ST, not L-C2ST-NF."""
    for rep in range(5):
        g = torch.Generator().manual_seed(2000 + rep)
        theta, x = TOY.sample(500, g)
        observations = TOY.sample(3, g)[1]
        report = cl.diagnose(sampler(shift=0.5), theta, x, observations=observations, seed=rep)
        assert "lc2st" in report.checks
        assert "lc2st_nf" in report.skipped
        assert float(report.checks["lc2st"].global_p_value) < 0.05
        assert report.findings.observations["lc2st"].named == [0, 1, 2]
        assert "wrong at observations 0, 1 and 2 (L-C2ST statistic" in report.verdict
    figures = report.figures
    assert "lc2st_pp" in figures
    title = figures["lc2st_probability_map_0"].get_suptitle()
    assert title.startswith("L-C2ST at observation 0"), title
    html = report.save(tmp_path / "shifted").read_text()
    assert "wrong here (L-C2ST)" in html
    assert "wrong here (L-C2ST-NF)" not in html
    assert "L-C2ST (local test at each observation, from posterior draws)" in html


def test_a_flow_runs_lc2st_only_when_it_is_named(tmp_path):
    """With latents the default runs L-C2ST-NF alone; naming both runs both, and the report
    gives each its own columns and name."""
    theta, x = TOY.sample(500, torch.Generator().manual_seed(3))
    observations = x[:2]
    default = cl.diagnose(TOY.posterior(shift=0.5), theta, x,
                          observations=observations, seed=0)  # fmt: skip
    assert "lc2st_nf" in default.checks
    assert "lc2st" not in {*default.checks, *default.skipped}
    both = cl.diagnose(TOY.posterior(shift=0.5), theta, x, observations=observations,
                       checks=("lc2st_nf", "lc2st"), seed=0)  # fmt: skip
    assert {"lc2st_nf", "lc2st"} <= set(both.checks)
    for name in ("lc2st_nf", "lc2st"):
        assert float(both.checks[name].global_p_value) < 0.05, name
    html = both.save(tmp_path / "both").read_text()
    assert "L-C2ST-NF: L-C2ST statistic" in html
    assert "L-C2ST: L-C2ST statistic" in html
    assert "wrong here (L-C2ST-NF); wrong here (L-C2ST)" in html


def test_a_restricted_flow_is_tested_at_the_observations_before_and_after():
    """``cl.recalibrate(..., prior=)`` drops the latents: the restricted posterior gets
    L-C2ST at the observations and the flow before it L-C2ST-NF; the comparison shows
    both rows, each on its side, next to each other."""
    prior = torch.distributions.Independent(
        torch.distributions.Uniform(-torch.ones(2) * 3, torch.ones(2) * 3), 1)
    g = torch.Generator().manual_seed(4)
    theta = prior.sample((400,))
    x = theta + 0.5 * torch.randn(400, 2, generator=g)
    flow = cl.as_posterior(lambda x_: torch.distributions.Independent(
        torch.distributions.Normal(x_, 0.8 * torch.ones_like(x_)), 1))  # fmt: skip
    restricted = cl.TruncatedPosterior(flow, prior)
    report = cl.diagnose(restricted, theta, x, observations=x[:2], before=flow, seed=0,
                         prior=prior)  # fmt: skip
    assert "lc2st" in report.checks
    assert "lc2st_nf" in report.skipped
    assert "lc2st_nf" in report.before.checks
    assert "lc2st" not in report.before.checks
    table = report.comparison.table()
    assert "lc2st_nf" in table
    assert "lc2st" in table.replace("lc2st_nf", "")
    names = [row["check"] for row in report.comparison.rows()]  # in the report's order
    assert names.index("lc2st") == names.index("lc2st_nf") + 1


def test_an_observation_outside_the_support_skips_what_samples_there():
    """A posterior restricted to a box cannot be sampled at an observation whose posterior
    mass is all outside it: the checks that draw there (L-C2ST, the support check) are
    skipped with a message naming that x, the others run, and the rejection gives up after
    the round that passes GIVE_UP_COUNT / min_acceptance candidates (before, after
    num / min_acceptance: 1e9 for L-C2ST's 10,000 draws at each observation)."""
    from calib_lightning.recalibration.truncation import (
        GIVE_UP_COUNT,
        ROUND_NUMBERS,
        NoMassInsideError,
    )

    prior = torch.distributions.Independent(
        torch.distributions.Uniform(-torch.ones(2), torch.ones(2)), 1)
    theta = prior.sample((300,))
    x = theta + 0.3 * torch.randn(300, 2)
    flow = cl.as_posterior(lambda x_: torch.distributions.Independent(
        torch.distributions.Normal(x_, 0.3 * torch.ones_like(x_)), 1))  # fmt: skip
    restricted = cl.TruncatedPosterior(flow, prior)
    observations = torch.tensor([[0.2, -0.1], [4.0, -4.0]])  # the second: 3e-24 inside
    report = cl.diagnose(restricted, theta, x, observations=observations, prior=prior, seed=0)
    for name in ("lc2st", "support"):
        assert "at x = [4, -4]" in report.skipped[name], report.skipped[name]
    assert {"ranks", "tarp", "misspecification"} <= set(report.checks)
    assert report.findings.observations["misspecification"].named == [1]
    calls = []
    inner = restricted.inner.sample
    restricted.inner.sample = lambda x_, n: calls.append(n * x_.shape[0]) or inner(x_, n)
    with pytest.raises(NoMassInsideError, match=r"at x = \[4, -4\]"):
        restricted.sample(observations[1:], 10_000)
    bound = GIVE_UP_COUNT / restricted.min_acceptance + ROUND_NUMBERS + 20_000
    assert sum(calls) <= bound, sum(calls)


def test_the_embedding_reaches_the_local_test_too():
    """``diagnose(embedding=)`` was passed to the misspecification test only; L-C2ST-NF's
    classifiers saw raw x (found by the images guide: p = 0.29 in diagnose against 1/31
    from ``cl.LC2STNF(embedding=...)`` on the same model)."""
    toy = GaussianToy(dim=2)
    theta, x = toy.sample(200, torch.Generator().manual_seed(0))
    seen = []

    def embedding(values):
        seen.append(values.shape[0])
        return values

    common = {"observations": x[:2], "embedding": embedding, "seed": 0}
    cl.diagnose(toy.posterior(), theta, x, checks=["misspecification"], **common)
    alone = len(seen)
    seen.clear()
    cl.diagnose(toy.posterior(), theta, x, checks=["lc2st_nf", "misspecification"], **common)
    assert len(seen) > alone  # the local test's classifiers called it as well
