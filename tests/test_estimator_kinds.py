"""What an estimator is comes from the estimator (its class, its shapes), never from
which other objects are alive (issue 49).

Every sbi family (NPE, NLE, NRE_A/B/C, BNRE) is trained by chaining
(``NLE(prior).append_simulations(theta, x).train()``, its trainer gone), saved with
``torch.save`` and loaded back, with ``dim theta = dim x`` and ``dim theta != dim x``. Then
every metric, ``cl.diagnose`` and the command line either refuse it with a ``ValueError``
that says what to declare, or, given the prior, check the posterior the likelihood or the
ratio implies. Before, a reloaded or chained NLE was read as a posterior: KCCSD returned
a p-value for q(x | theta) taken as q(theta | x).

Task: theta ~ U(-3, 3)^2 (sbi's BoxUniform); x = theta + 0.5 noise (X = 2), or
(theta_1, theta_2, theta_1 + theta_2) + 0.5 noise (X = 3).
"""

import gc
import io
import json
import textwrap

import pytest
import torch
from torch.distributions import Normal

import calib_lightning as cl
from calib_lightning.__main__ import main

sbi = pytest.importorskip("sbi")
from sbi.inference import BNRE, NLE, NPE, NRE_A, NRE_B, NRE_C  # noqa: E402
from sbi.utils import BoxUniform  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

PRIOR = BoxUniform(-3 * torch.ones(2), 3 * torch.ones(2))
FAMILIES = {
    "NPE": NPE,
    "NLE": NLE,
    "NRE_A": NRE_A,
    "NRE_B": NRE_B,
    "NRE_C": NRE_C,
    "BNRE": BNRE,
}
KIND = {"NPE": "posterior", "NLE": "likelihood"}  # the others: "ratio"


def pairs(n, x_dim, seed):
    g = torch.Generator().manual_seed(seed)
    theta = 6 * torch.rand(n, 2, generator=g) - 3
    mean = theta if x_dim == 2 else torch.cat([theta, theta.sum(1, keepdim=True)], 1)
    return theta, mean + 0.5 * torch.randn(n, x_dim, generator=g)


def chained_and_reloaded(family, x_dim):
    """The estimator as a script gets it (the trainer is a temporary), saved and loaded."""
    torch.manual_seed(0)
    theta, x = pairs(500, x_dim, seed=0)
    estimator = (
        FAMILIES[family](PRIOR, show_progress_bars=False)
        .append_simulations(theta, x)
        .train(max_num_epochs=1, show_train_summary=False)
    )
    buffer = io.BytesIO()
    torch.save(estimator, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


@pytest.fixture(
    scope="module",
    params=[(f, d) for f in FAMILIES for d in (2, 3)],
    ids=lambda p: f"{p[0]}-X{p[1]}",
)
def case(request, tmp_path_factory, monkeypatch_module):
    monkeypatch_module.chdir(tmp_path_factory.mktemp("sbi"))  # sbi writes ./sbi-logs
    family, x_dim = request.param
    estimator = chained_and_reloaded(family, x_dim)
    gc.collect()  # nothing but the estimator is left of the training
    return family, x_dim, estimator


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


def metrics():
    """Every metric that takes ``update(posterior, theta, x)``, given the observations."""
    return {
        "KCCSD": lambda o: cl.KCCSD(num_null=50),
        "RankCalibration": lambda o: cl.RankCalibration(num_posterior_samples=20),
        "TARP": lambda o: cl.TARP(num_posterior_samples=20, num_null=50),
        "LatentCalibration": lambda o: cl.LatentCalibration(),
        "LC2STNF": lambda o: cl.LC2STNF(observations=o, num_null=5),
        "LC2ST": lambda o: cl.LC2ST(observations=o, num_null=5),
        "JointC2ST": lambda o: cl.JointC2ST(num_posterior_samples=10),
        "PriorSupport": lambda o: cl.PriorSupport(PRIOR, num_posterior_samples=20),
        "ImportanceCoverage": lambda o: cl.ImportanceCoverage(num_proposal_samples=100),
    }


def refusal(family, x_dim):
    """What the ValueError of an estimator read without its prior says, or ``None`` where
    it is a posterior estimator whose shapes say so."""
    if family == "NPE" and x_dim == 3:
        return None
    if family in ("NPE", "NLE") and x_dim == 2:
        return r"must say what it estimates.*kind=\"posterior\".*prior=prior"
    if family == "NLE":
        return r"reads as a likelihood estimator q\(x \| theta\).*prior=prior"
    return r"ratio estimator r\(theta, x\).*prior=prior"


def test_every_metric_refuses_or_reads_it_as_what_it_is(case):
    family, x_dim, estimator = case
    theta, x = pairs(40, x_dim, seed=1)
    expected = refusal(family, x_dim)
    for name, make in metrics().items():
        metric = make(x[:2])
        if expected is None:  # a posterior estimator, shaped as one
            if name == "ImportanceCoverage":  # needs a posterior known up to a constant
                with pytest.raises(ValueError, match="must be an UnnormalizedPosterior"):
                    metric.update(estimator, theta, x)
                continue
            metric.update(estimator, theta, x)
            assert torch.isfinite(torch.as_tensor(metric.compute().p_value)).all(), name
        else:
            with pytest.raises(ValueError, match=expected):  # at once, before any number
                metric.update(estimator, theta, x)
    balance = cl.RatioBalance()
    if KIND.get(family, "ratio") == "ratio":  # the classifier's own test needs no prior
        balance.update(estimator, theta, x)
        assert 0.0 <= float(balance.compute().p_value) <= 1.0
    else:
        with pytest.raises(ValueError, match="ratio estimator"):
            balance.update(estimator, theta, x)


def test_with_its_prior_the_posterior_it_implies_is_checked(case):
    """Given the prior, a likelihood or ratio estimator is the posterior f + log p: its
    score is the autograd of the estimator's own log q(x | theta) or log r, plus the
    prior's (flat inside the box)."""
    family, x_dim, estimator = case
    theta, x = pairs(40, x_dim, seed=2)
    if family == "NPE":
        if x_dim == 3:  # a posterior estimator: a prior is refused, not read as a likelihood
            with pytest.raises(ValueError, match=r"posterior estimator.*needs none"):
                cl.as_posterior(estimator, prior=PRIOR)
        post = cl.as_posterior(estimator, kind="posterior")
        assert isinstance(post, cl.posteriors.SbiPosterior)
        return
    post = cl.as_posterior(estimator, prior=PRIOR)
    assert isinstance(post, cl.UnnormalizedPosterior)
    assert post.kind == KIND.get(family, "ratio")
    leaf = theta.clone().requires_grad_(True)
    if family == "NLE":
        own = estimator.log_prob(x[None], condition=leaf)[0]
    else:
        own = estimator.unnormalized_log_ratio(leaf, x)
    (expected,) = torch.autograd.grad(own.sum(), leaf)
    torch.testing.assert_close(post.score(theta, x), expected)
    metric = cl.KCCSD(num_null=50)
    metric.update(post, theta, x)
    assert metric.compute().space == "unconstrained"
    assert cl.UnnormalizedPosterior(estimator, prior=PRIOR).kind == post.kind


def test_diagnose_refuses_or_checks_the_implied_posterior(case):
    family, x_dim, estimator = case
    theta, x = pairs(40, x_dim, seed=3)
    expected = refusal(family, x_dim)
    if expected is None:
        assert "kccsd" in cl.diagnose(estimator, theta, x, checks=("kccsd",)).checks
    else:
        with pytest.raises(ValueError, match=expected):
            cl.diagnose(estimator, theta, x, checks=("kccsd",))
    if family in ("NPE", "NLE") and x_dim == 2:  # the prior may be either's: ask
        with pytest.raises(ValueError, match=r"must say what it estimates.*prior given"):
            cl.diagnose(estimator, theta, x, prior=PRIOR, checks=("kccsd",))
        return
    report = cl.diagnose(estimator, theta, x, prior=PRIOR, checks=("kccsd", "support"))
    if family == "NPE":  # the posterior's prior: the support check runs on its draws
        assert "support" in report.checks
    else:  # the posterior f + log p, tested in the box's unconstrained space; no draws
        assert report.checks["kccsd"].space == "unconstrained"
        assert "support" in report.skipped


SBI_MODULE = '''
import lightning as L
import torch
from sbi.neural_nets import likelihood_nn


class SbiNLE(L.LightningModule):
    """Holds an sbi likelihood estimator, as a user's module would."""

    def __init__(self, x_dim: int = 2):
        super().__init__()
        self.save_hyperparameters()
        build = likelihood_nn("maf", z_score_theta="none", z_score_x="none", num_transforms=1)
        self.estimator = build(torch.zeros(10, 2), torch.zeros(10, x_dim))


def prior():
    from sbi.utils import BoxUniform

    return BoxUniform(-3 * torch.ones(2), 3 * torch.ones(2))
'''


@pytest.mark.parametrize("x_dim", [2, 3])
def test_the_command_line_refuses_or_checks_the_implied_posterior(x_dim, tmp_path, monkeypatch):
    import lightning as L

    (tmp_path / "sbi_nle.py").write_text(textwrap.dedent(SBI_MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    from sbi_nle import SbiNLE

    module = SbiNLE(x_dim)
    checkpoint = tmp_path / "nle.ckpt"
    state = {
        "state_dict": module.state_dict(),
        "hyper_parameters": {"x_dim": x_dim},
        "pytorch-lightning_version": L.__version__,
    }
    torch.save(state, checkpoint)
    theta, x = pairs(60, x_dim, seed=4)
    torch.save({"theta": theta, "x": x}, tmp_path / "cal.pt")
    base = ["diagnose", "--module", "sbi_nle:SbiNLE", "--checkpoint", str(checkpoint)]
    base += ["--data", str(tmp_path / "cal.pt"), "--estimator", "estimator", "--checks", "kccsd"]
    with pytest.raises(ValueError, match="likelihood estimator q\\(x \\| theta\\)"):
        main([*base, "--out", str(tmp_path / "refused")])
    declared = ["--kind", "likelihood"] if x_dim == 2 else []
    code = main([*base, "--out", str(tmp_path / "out"), "--prior", "sbi_nle:prior", *declared])
    assert code == 0
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert [row["check"] for row in summary["checks"]] == ["kccsd"]
    assert 0.0 <= summary["checks"][0]["p_value"] <= 1.0


def test_a_two_argument_callable_is_a_likelihood_and_says_so():
    """Before: ``cl.diagnose(f, theta, x)`` and ``cl.KCCSD().update(f, theta, x)`` called
    ``f(x)`` and raised ``TypeError: <lambda>() missing 1 required positional argument``
    from inside the user's code."""
    theta, x = pairs(60, 2, seed=5)

    def f(th, xx):
        return Normal(th, 0.5).log_prob(xx).sum(-1)

    class LogLikelihood(torch.nn.Module):
        def forward(self, theta, x):
            return f(theta, x)

    for estimator in (f, LogLikelihood(), lambda th, xx: f(th, xx)):
        message = r"two arguments.*log-likelihood or log-ratio.*prior=prior.*SamplePosterior"
        with pytest.raises(ValueError, match=message):
            cl.diagnose(estimator, theta, x)
        with pytest.raises(ValueError, match=message):
            cl.KCCSD().update(estimator, theta, x)
        with pytest.raises(ValueError, match=message):
            cl.as_posterior(estimator)
        post = cl.as_posterior(estimator, prior=PRIOR)
        assert isinstance(post, cl.UnnormalizedPosterior)
        assert post.kind is None
        assert cl.as_posterior(estimator, prior=PRIOR, kind="ratio").kind == "ratio"
        report = cl.diagnose(estimator, theta, x, prior=PRIOR, checks=("kccsd",))
        assert report.checks["kccsd"].space == "unconstrained"  # f + log p on the box
        with pytest.raises(ValueError, match="kind must fit"):
            cl.as_posterior(estimator, kind="posterior")


def test_a_one_argument_callable_with_a_prior_is_refused_by_every_entry_point():
    """The callbacks and ``cl.as_posterior`` read an estimator the same way (before, a
    callback took any callable with ``prior=`` for f(theta, x))."""
    from calib_lightning.callbacks._unnormalized import callback_posterior

    def posterior(x):
        return torch.distributions.Independent(Normal(x, 1.0), 1)

    reads = (
        lambda: cl.as_posterior(posterior, prior=PRIOR),
        lambda: callback_posterior(posterior, PRIOR),
    )
    for read in reads:
        with pytest.raises(ValueError, match="prior must be given only with a ratio"):
            read()

    class LL(torch.nn.Module):
        def ratio(self, theta, x):
            return Normal(theta, 0.5).log_prob(x).sum(-1)

    module = LL()
    reads = (
        lambda: cl.as_posterior(module.ratio, prior=PRIOR),
        lambda: callback_posterior(module.ratio, PRIOR),
    )
    for read in reads:
        assert isinstance(read(), cl.UnnormalizedPosterior)


def test_kind_is_checked():
    def posterior(x):
        return torch.distributions.Independent(Normal(x, 1.0), 1)

    with pytest.raises(ValueError, match=r"kind must be one of \['posterior', 'likelihood'"):
        cl.as_posterior(posterior, kind="flow")
    with pytest.raises(ValueError, match="kind must fit the estimator"):
        cl.as_posterior(posterior, kind="ratio", prior=PRIOR)
    assert isinstance(cl.as_posterior(posterior, kind="posterior"), cl.posteriors.Posterior)
