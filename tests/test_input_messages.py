"""Messages about bad input speak of the user's whole input, not of an internal chunk.

The checks draw, score and invert the posterior in chunks of pairs sized by the memory
budget (the first chunk: a few dozen pairs). A wrong width of ``theta`` or ``x``, or
non-finite values from the posterior, must be reported with the user's full shape and
counted over all ``N`` pairs, with rows in the user's numbering. KCCSD, whose scores stay
finite when ``log_prob`` is ``±inf`` or NaN (the gradient of ``log_prob + inf`` is that
of ``log_prob``), must refuse such a posterior instead of returning a p-value.
"""

import math

import pytest
import torch
import zuko
from torch.distributions import Independent, Normal

import calib_lightning as cl
from calib_lightning.functional import rank_calibration
from calib_lightning.tasks import GaussianToy

D, X, N = 3, 2, 200
WEIGHT = torch.randn(D, X, generator=torch.Generator().manual_seed(9))


def zuko_flow():
    torch.manual_seed(0)
    return zuko.flows.NSF(features=D, context=X, transforms=1, hidden_features=(8,))


def closure_gaussian(x):
    """A plain callable: the adapter knows neither its context width nor its event size."""
    return Independent(Normal(x @ WEIGHT.to(x.dtype).T, 0.5), 1)


MODELS = {"zuko": zuko_flow, "callable": lambda: closure_gaussian}
PRIOR = Independent(Normal(torch.zeros(D), 3 * torch.ones(D)), 1)
METRICS = {
    "KCCSD": lambda obs: cl.KCCSD(num_null=20, base_points=8),
    "RankCalibration": lambda obs: cl.RankCalibration(num_posterior_samples=9),
    "LC2STNF": lambda obs: cl.LC2STNF(observations=obs, num_null=3, num_posterior_samples=16),
    "LC2ST": lambda obs: cl.LC2ST(observations=obs, num_null=3, num_posterior_samples=16),
    "TARP": lambda obs: cl.TARP(num_posterior_samples=9, num_null=20),
    "LatentCalibration": lambda obs: cl.LatentCalibration(),
    "JointC2ST": lambda obs: cl.JointC2ST(num_posterior_samples=4),
    "PriorSupport": lambda obs: cl.PriorSupport(PRIOR, num_posterior_samples=10),
}


def pairs(n=N):
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, D, generator=g), torch.randn(n, X, generator=g)


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("metric", list(METRICS))
@pytest.mark.parametrize("argument", ["theta", "x"])
def test_a_wrong_width_is_named_with_the_full_shape(metric, argument, model):
    """``theta`` with 4 columns for a posterior of D = 3, or ``x`` with 1 feature for a
    context of 2: the message names the argument and its shape (200, 4) or (200, 1),
    never the shape of the chunk the posterior was called on."""
    theta, x = pairs()
    if argument == "theta":
        theta = torch.randn(N, D + 1)
        expected = r"theta must have D = 3 columns like the posterior's event shape \(3,\), "
        expected += r"got shape \(200, 4\)"
    else:
        x = x[:, :1]
        expected = (r"x must have shape \(N, 2\) for this posterior's context, got \(200, 1\)"
                    if model == "zuko" else r"x (must|with).* \(200, 1\)")  # fmt: skip
    with pytest.raises(ValueError, match=expected) as info:
        METRICS[metric](pairs()[1][:2]).update(MODELS[model](), theta, x)
    width = theta.shape[1] if argument == "theta" else 1
    shapes = {f"({k}, {width})" for k in range(1, N)}  # no chunk's shape anywhere
    assert not any(shape in str(info.value) for shape in shapes), str(info.value)


class ShiftedNormal(Normal):
    """A Normal whose log_prob adds ``shift`` at the pairs whose ``x`` is marked."""

    def __init__(self, loc, scale, shift):
        super().__init__(loc, scale)
        self.shift = shift  # (n,)

    def log_prob(self, value):
        return super().log_prob(value) + self.shift[..., None]


def broken_posterior(value, rows=None):
    """The exact posterior of ``GaussianToy(dim=3)`` whose log-density is ``value``
    (``inf``, ``-inf``, NaN) added at the pairs ``rows`` of :func:`toy_pairs` (all if
    None), recognized by their ``x``."""
    toy = GaussianToy(dim=D)
    _, x_all = toy_pairs()
    marked = x_all[:, 0] if rows is None else x_all[rows, 0]

    def posterior(x):
        exact = toy.posterior()(x).base_dist
        shift = torch.where(torch.isin(x[:, 0], marked), value, 0.0)
        return Independent(ShiftedNormal(exact.loc, exact.scale, shift), 1)

    return posterior


def toy_pairs(n=N):
    return GaussianToy(dim=D).sample(n, torch.Generator().manual_seed(4))


@pytest.mark.parametrize(("value", "kind"), [(math.inf, r"\+inf"), (-math.inf, "-inf"),
                                             (math.nan, "NaN")])  # fmt: skip
def test_kccsd_refuses_a_non_finite_log_density_everywhere(value, kind):
    theta, x = toy_pairs()
    posterior = broken_posterior(value)
    # the scores are finite: nothing but the log-density shows the problem
    assert bool(cl.as_posterior(posterior).score(theta, x).isfinite().all())
    match = (rf"posterior log_prob at theta must be finite, got {kind} for 200 of 200 "
             r"calibration pairs \(first rows of theta and x: \[0, 1, 2, 3, 4\]\)")  # fmt: skip
    with pytest.raises(ValueError, match=match):
        cl.KCCSD(num_null=20).update(posterior, theta, x)
    with pytest.raises(ValueError, match=match):
        cl.KCCSDLoss(space="parameter")(posterior, theta, x)


def test_kccsd_names_the_few_pairs_with_a_non_finite_log_density():
    theta, x = toy_pairs()
    posterior = broken_posterior(math.inf, rows=[3, 50, 170])
    match = (r"posterior log_prob at theta must be finite, got \+inf for 3 of 200 calibration "
             r"pairs \(rows of theta and x: \[3, 50, 170\]\)")  # fmt: skip
    with pytest.raises(ValueError, match=match):
        cl.KCCSD(num_null=20).update(posterior, theta, x)
    # the same posterior on the other pairs: a p-value, as before
    good = torch.ones(N, dtype=torch.bool)
    good[[3, 50, 170]] = False
    metric = cl.KCCSD(num_null=20)
    metric.update(posterior, theta[good], x[good])
    assert 0 < float(metric.compute().p_value) <= 1


def test_rank_calibration_counts_over_the_whole_input():
    """The issue's case: 50 draws per pair, every log-density +inf. The first chunk holds
    5 pairs; the message counts all 200 (it said "5 of 5")."""
    theta, x = toy_pairs()
    match = (r"posterior log_prob at theta must be finite or -inf \(zero density\), got \+inf "
             r"for 200 of 200 calibration pairs \(first rows of theta and x: "
             r"\[0, 1, 2, 3, 4\]\); posterior log_prob at its samples must be finite, got "
             r"\+inf for 200 of 200")  # fmt: skip
    for chunk in (None, 300):  # the memory budget's chunks, and chunks of 2 pairs
        metric = cl.RankCalibration(num_posterior_samples=50, max_chunk_elements=chunk)
        with pytest.raises(ValueError, match=match):
            metric.update(broken_posterior(math.inf), theta, x)


@pytest.mark.parametrize("chunk", [None, 300])
def test_rank_calibration_names_rows_in_the_users_numbering(chunk):
    theta, x = toy_pairs()
    posterior = broken_posterior(math.nan, rows=[3, 50, 170])
    match = (r"at theta must be finite or -inf \(zero density\), got NaN for 3 of 200 "
             r"calibration pairs \(rows of theta and x: \[3, 50, 170\]\)")  # fmt: skip
    metric = cl.RankCalibration(num_posterior_samples=50, max_chunk_elements=chunk)
    with pytest.raises(ValueError, match=match):
        metric.update(posterior, theta, x)
    # a test quantity that is NaN at the truths of some pairs: counted over all of them
    marked = theta[[20, 120], 0]

    def quantity(t):
        return t.sum(-1) + torch.where(torch.isin(t[..., 0], marked), math.nan, 0.0)

    metric = cl.RankCalibration(num_posterior_samples=50, max_chunk_elements=chunk,
                                statistics={"sum": quantity})  # fmt: skip
    match = (r"statistics\['sum'\] must not be NaN, got NaN for 2 of 200 calibration pairs "
             r"\(rows of theta and x: \[20, 120\]\)")  # fmt: skip
    with pytest.raises(ValueError, match=match):
        metric.update(GaussianToy(dim=D).posterior(), theta, x)


def test_rank_calibration_of_held_samples_counts_over_every_block():
    """``functional.rank_calibration`` (what ``cl.diagnose`` runs) works on blocks of
    pairs; NaN draws at pairs 1700-1702 of 2,000 were "3 of 582 ... [536, 537, 538]"."""
    toy = GaussianToy(dim=D)
    theta, x = toy_pairs(2000)
    q = toy.posterior()(x)
    samples = q.sample((300,))
    log_prob = q.log_prob(samples)
    samples[:, 1700:1703] = math.nan
    match = (r"posterior samples must be finite, got NaN for 3 of 2000 calibration pairs "
             r"\(rows of theta and x: \[1700, 1701, 1702\]\)")  # fmt: skip
    with pytest.raises(ValueError, match=match):
        rank_calibration(samples, log_prob, theta, q.log_prob(theta))


ALL_METRICS = {
    **METRICS,
    "ImportanceCoverage": lambda obs: cl.ImportanceCoverage(num_proposal_samples=50),
    "RatioBalance": lambda obs: cl.RatioBalance(),
    "IntervalCoverage": lambda obs: cl.IntervalCoverage(num_posterior_samples=9),
}


@pytest.mark.parametrize("metric", list(ALL_METRICS))
def test_every_metric_refuses_a_single_pair(metric):
    """``docs/estimators.md``: N < 2 raises, for every metric (before: PriorSupport gave
    p = 1.0 and DensityCoverage density 1.0 from one pair)."""
    theta, x = pairs(1)
    posterior = closure_gaussian
    if metric in ("ImportanceCoverage", "RatioBalance"):
        posterior = cl.UnnormalizedPosterior(
            lambda th, xx: Normal(th @ WEIGHT.to(th.dtype), 0.5).log_prob(xx).sum(-1),
            prior=PRIOR,
        )
    m = ALL_METRICS[metric](x)

    def run():
        m.update(posterior, theta, x)
        return m.compute()

    with pytest.raises(ValueError, match=r"N >= 2|N = 1|at least 2|N >= 4"):
        run()


def test_the_sample_metrics_refuse_a_single_sample():
    reference = torch.randn(30, D, generator=torch.Generator().manual_seed(2))
    density = cl.DensityCoverage(reference)
    density.update(torch.randn(1, D))
    with pytest.raises(ValueError, match=r"needs at least n >= 2 samples, got n = 1"):
        density.compute()


def test_a_kccsd_statistic_that_overflows_is_refused_not_read_as_a_rejection():
    """Finite but huge scores (1e160 in float64) overflow the kernel sums: the functional
    test's statistic is NaN, so its p-value is NaN (a NaN exceeded no bootstrap draw and
    read as p = 1 / (1 + B), a rejection), and the metric raises, naming the scores' size."""
    from calib_lightning.functional.combine import monte_carlo_p_value
    from calib_lightning.functional.kccsd import kccsd

    g = torch.Generator().manual_seed(0)
    theta = torch.randn(50, 2, dtype=torch.float64, generator=g)
    base = torch.randn(4, 2, dtype=torch.float64, generator=g)
    score = 1e160 * torch.randn(50, 2, dtype=torch.float64, generator=g)
    base_scores = 1e160 * torch.randn(50, 4, 2, dtype=torch.float64, generator=g)
    out = kccsd(theta, score, base_scores, base, num_null=99, generator=g)
    assert torch.isnan(out.statistic)
    assert torch.isnan(out.p_value)
    p = monte_carlo_p_value(torch.tensor([float("nan"), 0.25]), torch.tensor([[0.1, 0.3]] * 2))
    assert torch.isnan(p[0])
    assert p[1] == pytest.approx(2 / 3)

    # the posterior N(x, 1e-80^2 I): finite log-densities (about -1e160), scores of 1e160
    def posterior(xx):
        return Independent(Normal(xx, torch.full_like(xx, 1e-80)), 1)

    metric = cl.KCCSD(num_null=99)
    metric.update(
        posterior, theta, theta + torch.randn(theta.shape, dtype=theta.dtype, generator=g)
    )
    with pytest.raises(ValueError, match=r"KCCSD's statistic is .* scores are finite but as large"):
        metric.compute()
    # cl.diagnose runs the other checks and lists KCCSD as skipped, with the reason
    x = theta + torch.randn(theta.shape, dtype=theta.dtype, generator=g)
    result = cl.diagnose(posterior, theta, x, checks=("kccsd", "ranks"))
    assert "kccsd" not in result.checks
    assert "scores are finite but as large" in result.skipped["kccsd"]
    assert "ranks" in result.checks
