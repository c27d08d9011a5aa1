"""One check, one place (issue 50): every diagnostic of ``cl.diagnose`` is one object in one
module of ``diagnosis/checks``, and ``diagnose`` runs the metric classes a user runs.

* The ranks, TARP, joint classifier and support rows of ``cl.diagnose(..., seed=s)`` are
  the results of ``cl.RankCalibration``, ``cl.TARP``, ``cl.JointC2ST`` and
  ``cl.PriorSupport`` on the same draws with the same seed.
* No module of ``diagnosis/`` but a check's own spells its name as a string.
"""

import ast
import dataclasses
from pathlib import Path

import pytest
import torch
from torch.distributions import Independent, Uniform

import calib_lightning as cl
from calib_lightning.diagnosis.checks import CHECKS, REGISTRY
from calib_lightning.posteriors import DistributionPosterior
from calib_lightning.tasks import GaussianToy

DIAGNOSIS = Path(cl.__file__).parent / "diagnosis"
TOY = GaussianToy(dim=2)
M = 50


class FixedDraws(DistributionPosterior):
    """A Gaussian posterior whose draws are fixed in advance: every call must ask for all
    pairs and all ``M`` draws at once (so that two callers see the same draws)."""

    def __init__(self, x):
        super().__init__(TOY.posterior(variance_scale=0.7))
        self.x = x
        with torch.random.fork_rng():
            torch.manual_seed(5)
            self.fixed = self.module(x).sample((M,))

    def sample(self, x, num_posterior_samples):
        assert num_posterior_samples <= M, "more draws than fixed"
        rows = torch.cdist(x, self.x).argmin(1)  # the pairs asked for, by their x
        assert torch.equal(self.x[rows], x)
        return self.fixed[:num_posterior_samples, rows].clone()

    def sample_and_log_prob(self, x, num_posterior_samples):
        samples = self.sample(x, num_posterior_samples)
        return samples, self.log_prob(samples, x)


def _same(a, b):
    for field in dataclasses.fields(a):
        left, right = getattr(a, field.name), getattr(b, field.name)
        if isinstance(left, torch.Tensor):
            torch.testing.assert_close(left, right, msg=field.name)
        else:
            assert left == right, field.name


@pytest.mark.parametrize("seed", [0, 3])
def test_diagnose_reports_what_the_metric_classes_give_on_the_same_draws(seed):
    theta, x = TOY.sample(200, torch.Generator().manual_seed(seed))
    prior = Independent(Uniform(-9 * torch.ones(2), 9 * torch.ones(2)), 1)
    posterior = FixedDraws(x)
    report = cl.diagnose(posterior, theta, x, checks=("ranks", "tarp", "joint_c2st", "support"),
                         num_posterior_samples=M, seed=seed, prior=prior)  # fmt: skip
    metrics = {
        "ranks": cl.RankCalibration(num_posterior_samples=M),
        "tarp": cl.TARP(num_posterior_samples=M, seed=seed),
        "joint_c2st": cl.JointC2ST(num_posterior_samples=M, seed=seed),
        "support": cl.PriorSupport(prior, num_posterior_samples=M),
    }
    for name, metric in metrics.items():
        metric.update(posterior, theta, x)
        _same(report.checks[name], metric.compute())


def _string_constants(path):
    tree = ast.parse(path.read_text())
    return {node.value for node in ast.walk(tree) if isinstance(node, ast.Constant)
            and isinstance(node.value, str)}  # fmt: skip


def test_no_module_but_its_own_spells_a_checks_name():
    modules = {path: _string_constants(path) for path in DIAGNOSIS.rglob("*.py")}
    for check in REGISTRY:
        spelling = sorted(p.relative_to(DIAGNOSIS).as_posix() for p, s in modules.items()
                          if check.name in s)  # fmt: skip
        assert len(spelling) <= 2, (check.name, spelling)
        own = Path(type(check).__module__.replace(".", "/")).name + ".py"
        assert all(p.endswith(own) or p == "checks/__init__.py" for p in spelling), spelling


def test_every_registered_check_says_what_it_is():
    assert len({c.name for c in REGISTRY}) == len(REGISTRY)
    assert len({c.stream for c in REGISTRY}) == len(REGISTRY)
    for check in REGISTRY:
        assert check.title, check.name
        assert check.words, check.name
        assert check.posteriors in ("normalized", "unnormalized", "any"), check.name
    assert tuple(c.name for c in REGISTRY if c.selectable) == CHECKS


def test_a_check_that_runs_only_when_named():
    """``interval_coverage`` (added through the registry, CONTRIBUTING's example) is not in
    the default plan; named, its row reads the central intervals' coverage."""
    theta, x = TOY.sample(300, torch.Generator().manual_seed(1))
    default = cl.diagnose(TOY.posterior(), theta, x, checks=None)
    assert "interval_coverage" not in default.checks
    narrow = cl.diagnose(TOY.posterior(variance_scale=0.5), theta, x,
                         checks=("interval_coverage",))  # fmt: skip
    row = next(r for r in narrow.rows() if r["check"] == "interval_coverage")
    assert row["verdict"] == "rejected"
    assert "intervals cover" in row["size"]
    assert "the interval-coverage test" in narrow.verdict
