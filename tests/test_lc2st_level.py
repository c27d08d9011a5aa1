"""Level of L-C2ST and L-C2ST-NF as users run them: public classes, default arguments.

Every repetition draws a fresh calibration set and fresh reference observations from a
model whose exact posterior is tested, and runs the metric with its default arguments and
default seed, either as a fresh metric per dataset (one check per model) or as one metric
over many checks (a training run). Only the data generation is seeded. A metric whose
classifier randomness is frozen across checks or datasets (issue 12: 25 % rejections of an
exact posterior at 0.05 for L-C2ST, non-uniform p-values for L-C2ST-NF) fails here; a
level test that reseeds the metric at each repetition would not see it.

Checked at 0.05: the rejection rate inside the 99 % binomial band around 0.05, and the
Kolmogorov-Smirnov test of uniformity of the p-values (p > 0.01), for the p-value of one
observation and for ``global_p_value`` (Cauchy combination over the observations).
"""

import functools
from collections.abc import Callable

import pytest
import torch
from scipy import stats

import calib_lightning as cl
from calib_lightning.metrics.lc2st import LC2STResult
from calib_lightning.posteriors import as_posterior
from calib_lightning.tasks import CorrelatedGaussianToy, GaussianToy

TOY, CORRELATED = GaussianToy(dim=2, noise_std=0.5), CorrelatedGaussianToy(correlation=0.8)
N, NUM_OBS, REPS = 300, 2, 100  # REPS datasets per model and scenario


def _assert_level(p_values: torch.Tensor, global_p: torch.Tensor) -> None:
    """``p_values (R, O)`` and ``global_p (R,)`` of an exact posterior hold the level."""
    reps = len(global_p)
    low, high = stats.binom.ppf([0.005, 0.995], reps, 0.05) / reps
    for name, p in (("p_value[:, 0]", p_values[:, 0]), ("global_p_value", global_p)):
        rate = float((p <= 0.05).double().mean())
        ks = stats.kstest(p.double().numpy(), "uniform").pvalue
        assert low <= rate <= high, f"{name}: rejection rate {rate} outside [{low}, {high}]"
        assert ks > 0.01, f"{name}: KS p = {ks:.2g}, mean p = {float(p.mean()):.3f}"


def _check(metric, model, theta: torch.Tensor, x: torch.Tensor) -> LC2STResult:
    metric.reset()
    metric.update(model.posterior(), theta, x)
    out = metric.compute()
    assert out.p_value.shape == (NUM_OBS,)
    assert out.global_p_value.shape == ()
    return out


def _fresh_metrics(metric_type: Callable, model, g: torch.Generator) -> list[LC2STResult]:
    """A new metric (default arguments and seed) for each of ``REPS`` datasets."""
    out = []
    for _ in range(REPS):
        theta, x = model.sample(N, g)
        out.append(_check(metric_type(observations=model.sample(NUM_OBS, g)[1]), model, theta, x))
    return out


def _stack(results: list[LC2STResult]) -> tuple[torch.Tensor, torch.Tensor]:
    return (
        torch.stack([r.p_value for r in results]),
        torch.stack([r.global_p_value for r in results]),
    )


def test_lc2st_level_fresh_metrics_and_one_metric_over_checks():
    """Fresh metrics for ``REPS`` datasets of the toy; one metric over ``REPS`` checks of the
    correlated model, fresh calibration data at each (the permutation null is valid for any
    fixed observations). Pooled: 200 p-values."""
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)  # L-C2ST's posterior draws use the global generator
    results = _fresh_metrics(cl.LC2ST, TOY, g)
    metric = cl.LC2ST(observations=CORRELATED.sample(NUM_OBS, g)[1])
    results += [_check(metric, CORRELATED, *CORRELATED.sample(N, g)) for _ in range(REPS)]
    assert int(metric.checks) == REPS  # the counter advanced at every check
    _assert_level(*_stack(results))


@pytest.mark.parametrize("norm_feature", [False, True], ids=["latents", "latents+norm"])
def test_lc2stnf_level_fresh_metrics_and_one_metric_over_checks(norm_feature):
    """Fresh metrics for ``REPS`` datasets of the toy; for the correlated model, one metric
    per calibration set over ``REPS / sets`` checks of fresh ``theta ~ p(theta | x)`` (the
    null is trained once on ``x``; each metric's rejection rate is conditional on its own
    null, so several sets make it marginal over nulls). Pooled: 200 p-values. With the
    default arguments, and with ``norm_feature=True`` (otherwise the defaults)."""
    g = torch.Generator().manual_seed(1)
    make = functools.partial(cl.LC2STNF, norm_feature=norm_feature)
    results = _fresh_metrics(make, TOY, g)
    sets = 5
    for s in range(sets):
        _, x = CORRELATED.sample(N, g)
        metric = make(observations=CORRELATED.sample(NUM_OBS, g)[1])
        with torch.random.fork_rng():
            torch.manual_seed(s)
            thetas = as_posterior(CORRELATED.posterior()).sample(x, REPS // sets)
        results += [_check(metric, CORRELATED, theta, x) for theta in thetas]
    _assert_level(*_stack(results))
