"""Conformal credible regions: the finite-sample guarantee, local adaptivity, adapters, errors."""

from __future__ import annotations

import json
import math

import matplotlib
import pytest
import torch
from torch.distributions import Independent, Normal

import calib_lightning as cl
from calib_lightning.functional import (
    conformal_coverage_error,
    conformal_quantile,
    credibility,
    density_threshold,
    leaf_quantiles,
    min_pairs,
)
from calib_lightning.recalibration._draw_stats import negative_log_prob
from calib_lightning.tasks import GaussianToy

matplotlib.use("Agg")

LEVEL = 0.9


def test_conformal_quantile_has_exact_coverage_over_many_repetitions() -> None:
    g = torch.Generator().manual_seed(0)
    n, reps = 19, 40_000
    scores = torch.rand(reps, n + 1, generator=g, dtype=torch.float64)
    covered = (scores[:, n] <= conformal_quantile(scores[:, :n], LEVEL)).double()
    exact = math.ceil((n + 1) * LEVEL) / (n + 1)  # 0.95: between 0.9 and 0.9 + 1/(n+1)
    assert LEVEL <= exact <= LEVEL + 1 / (n + 1)
    se = covered.std() / math.sqrt(reps)
    assert abs(float(covered.mean()) - exact) < 3 * se


def test_leaf_quantiles_match_the_global_quantile_leaf_by_leaf() -> None:
    g = torch.Generator().manual_seed(1)
    scores = torch.rand(300, generator=g, dtype=torch.float64)
    leaves = torch.randint(0, 3, (300,), generator=g)
    per_leaf, counts = leaf_quantiles(scores, leaves, 4, LEVEL, fill=1.0)
    for leaf in range(3):
        assert per_leaf[leaf] == conformal_quantile(scores[leaves == leaf], LEVEL)
    assert counts[3] == 0
    assert per_leaf[3] == 1.0


def test_density_threshold_is_the_membership_rule_of_credibility() -> None:
    g = torch.Generator().manual_seed(2)
    draws, points = torch.randn(50, 7, generator=g), torch.randn(200, 7, generator=g)
    for level in (0.05, 0.5, 0.93, 0.99):
        inside = credibility(draws, points) < level
        assert torch.equal(inside, points >= density_threshold(draws, level))
    assert torch.isinf(density_threshold(draws, 0.999)).all()  # ceil(0.999 * 51) > 50


def _coverage_over_repetitions(
    posterior: object, sample: object, *, local: bool, reps: int, n: int, draws: int,
    seed: int, **kwargs: object,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """Per repetition, on fresh pairs: coverage of the calibrated region (``contains``),
    of the nominal HPD region, of the randomized score (``c <= level``, what the upper
    bound is about), and the upper bound 0.9 + 1 / (n_leaf + 1)."""
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    partition = int(kwargs.pop("partition", 0))  # pairs of fit_partition (none: a split)
    calibrated, nominal, randomized, bound = [], [], [], []
    for rep in range(reps):
        theta, x = sample(n, g)
        region = cl.ConformalRegion(
            posterior, local=local, num_posterior_samples=draws, seed=rep, **kwargs
        )
        if partition:
            region.fit_partition(*sample(partition, g))
        region.fit(theta, x)
        theta_new, x_new = sample(100, g)
        cred = region.credibility(theta_new, x_new)
        nominal.append((cred < LEVEL).double().mean())
        if region.conformity == "log_density":  # exact membership, no ties to break
            calibrated.append(region.contains(theta_new, x_new, LEVEL).double().mean())
            randomized.append(calibrated[-1])
        else:
            level = region.calibrated_level(LEVEL, x_new)
            calibrated.append((cred < level).double().mean())
            noisy = region.credibility(theta_new, x_new, randomized=True)
            randomized.append((noisy <= level).double().mean())
        if region.partition == "tree":
            counts = torch.bincount(region.leaves, minlength=len(region._leaf_index))
            leaf = region._leaf_of(region._features(x_new))
            bound.append(LEVEL + (1.0 / (counts[leaf] + 1)).mean())
        else:
            bound.append(torch.tensor(LEVEL + 1 / (len(region.scores) + 1)))
    stacked = [torch.stack(v).double() for v in (calibrated, nominal, randomized, bound)]
    return stacked[0], stacked[1], torch.stack(stacked[2:])


def _check_guarantee(calibrated: torch.Tensor, upper: torch.Tensor) -> None:
    """``calibrated`` covers at least 0.9; the randomized score ``upper[0]`` at most the
    bound ``upper[1]`` (3 standard errors over repetitions)."""
    se = float(calibrated.std()) / math.sqrt(len(calibrated))
    mean = float(calibrated.mean())
    assert mean >= LEVEL - 3 * se, (mean, se)
    randomized, bound = upper
    se = float(randomized.std()) / math.sqrt(len(randomized))
    assert float(randomized.mean()) <= float(bound.mean()) + 3 * se, (randomized.mean(), se)


@pytest.mark.parametrize("conformity", ["credibility", "log_density"])
@pytest.mark.parametrize("variance_scale", [0.5, 1.0, 2.0])
def test_global_region_covers_at_least_nominal_whatever_the_posterior(
    variance_scale: float, conformity: str
) -> None:
    toy = GaussianToy(dim=2)
    calibrated, nominal, bound = _coverage_over_repetitions(
        toy.posterior(variance_scale=variance_scale), toy.sample, local=False, reps=150,
        n=40, draws=400, seed=3, conformity=conformity,
    )  # fmt: skip
    _check_guarantee(calibrated, bound)
    if variance_scale < 1:  # over-confident: its own 90 % region covers 1 - e^{-2.3 / 2}
        assert float(nominal.mean()) < 0.75
    if variance_scale > 1:  # under-confident: its own region over-covers
        assert float(nominal.mean()) > 0.97


def _heteroscedastic(x: torch.Tensor) -> Independent:
    """Exact mean of GaussianToy, std x0.6 where x_1 > 0 (over-confident), x1.5 elsewhere."""
    std = 0.2**0.5 * torch.where(x[:, :1] > 0, 0.6, 1.5).expand_as(x)
    return Independent(Normal(0.8 * x, std), 1)


@pytest.mark.parametrize(
    ("embedding", "partition", "n", "draws", "seed", "conformity"),
    [(None, 0, 300, 300, 4, "credibility"), ("posterior", 0, 300, 100, 16, "credibility"),
     (None, 150, 150, 100, 21, "credibility"), ("posterior", 150, 150, 100, 21, "credibility"),
     (None, 0, 300, 100, 4, "log_density"), ("posterior", 150, 150, 100, 21, "log_density")],
)  # fmt: skip
def test_local_region_keeps_the_guarantee_per_leaf(
    embedding: str | None, partition: int, n: int, draws: int, seed: int, conformity: str
) -> None:
    """On x or on the posterior summary; the tree from a split of the ``n`` held-out pairs
    or (``partition``) from other pairs, all ``n`` then calibrating (``fit_partition``);
    either score (credibility, or the log-density threshold)."""
    toy = GaussianToy(dim=2)
    calibrated, _nominal, bound = _coverage_over_repetitions(
        _heteroscedastic, toy.sample, local=True, reps=60, n=n, draws=draws, seed=seed,
        min_leaf_size=30, embedding=embedding, partition=partition, conformity=conformity,
    )  # fmt: skip
    _check_guarantee(calibrated, bound)


@pytest.mark.parametrize(
    ("embedding", "partition", "n", "seed", "conformity"),
    [(None, 0, 300, 4, "credibility"), ("posterior", 150, 150, 21, "log_density"),
     ("posterior", 0, 300, 16, "log_density")],
)  # fmt: skip
def test_a_regression_region_keeps_the_guarantee(
    embedding: str | None, partition: int, n: int, seed: int, conformity: str
) -> None:
    """``local="regression"``: the location-scale model fitted on other pairs (a split of
    the held-out ones, or ``fit_partition``), the conformal quantile of the normalized
    residuals: at least 0.9 and at most 0.9 + 1 / (n_cal + 1) on fresh pairs."""
    toy = GaussianToy(dim=2)
    calibrated, _nominal, bound = _coverage_over_repetitions(
        _heteroscedastic, toy.sample, local="regression", reps=60, n=n, draws=100, seed=seed,
        min_leaf_size=30, embedding=embedding, partition=partition, conformity=conformity,
    )  # fmt: skip
    _check_guarantee(calibrated, bound)


def _half_errors(region: cl.ConformalRegion, theta: torch.Tensor, x: torch.Tensor) -> list:
    """|coverage - 0.9| of the region on new pairs where ``_heteroscedastic`` is too narrow
    (``x_1 > 0``) and where it is too wide."""
    inside = region.contains(theta, x, LEVEL).double()
    over = x[:, 0] > 0
    return [abs(float(inside[rows].mean()) - LEVEL) for rows in (over, ~over)]


def test_local_region_adapts_where_the_global_one_cannot() -> None:
    toy = GaussianToy(dim=2)
    g = torch.Generator().manual_seed(5)
    torch.manual_seed(5)
    theta, x = toy.sample(2000, g)
    theta_new, x_new = toy.sample(4000, g)
    errors = {}
    for local in (False, True):
        region = cl.ConformalRegion(_heteroscedastic, local=local).fit(theta, x)
        errors[local] = _half_errors(region, theta_new, x_new)
    assert min(errors[False]) > 0.08  # one level for both halves misses both by 0.1
    assert max(errors[True]) < 0.06  # the tree splits at x_1 = 0 (leaves of ~100 pairs)


def test_a_regression_region_adapts_over_the_posterior_summary() -> None:
    """Over-confident where x_1 > 0, under-confident elsewhere: the posterior's spread (a
    summary feature) tells the halves apart, and the location-scale regression of the
    log-density score on it calibrates both halves, where one level misses both by 0.1;
    its coverage error over all levels on new pairs is near 0."""
    toy = GaussianToy(dim=2)
    g = torch.Generator().manual_seed(25)
    torch.manual_seed(25)
    theta, x = toy.sample(2000, g)
    theta_new, x_new = toy.sample(4000, g)
    region = cl.ConformalRegion(_heteroscedastic, local="regression", embedding="posterior",
                                num_posterior_samples=200).fit(theta, x)  # fmt: skip
    assert (region.partition, region.conformity, len(region.scores)) == (
        "regression", "log_density", 1000)  # fmt: skip
    assert max(_half_errors(region, theta_new, x_new)) < 0.04
    levels = region.calibrated_level(LEVEL, x_new)  # the region's mass under q at each x
    over = x_new[:, 0] > 0
    # q's mass of the region that covers 0.9 of the truth: P(chi2_2 <= 4.61 / 0.6^2) = 0.998
    # where q is too narrow, P(chi2_2 <= 4.61 / 1.5^2) = 0.64 where it is too wide
    assert float(levels[over].mean()) > 0.99
    assert float(levels[~over].mean()) < 0.7
    assert abs(float(region.coverage_error(theta_new, x_new))) < 0.02
    with pytest.raises(ValueError, match="local must be False, True, 'tree' or 'regression', "
                       "got 'forest'"):  # fmt: skip
        cl.ConformalRegion(_heteroscedastic, local="forest")


def test_fit_partition_keeps_its_tree_and_calibrates_each_leaf_with_all_held_out_pairs() -> None:
    toy = GaussianToy(dim=2)
    g = torch.Generator().manual_seed(22)
    torch.manual_seed(22)
    theta_tree, x_tree = toy.sample(1000, g)
    theta, x = toy.sample(1000, g)
    theta_new, x_new = toy.sample(4000, g)
    region = cl.ConformalRegion(_heteroscedastic, local=True)  # 1,000 draws: its level 0.998
    region.fit_partition(theta_tree, x_tree)
    assert region.scores is None  # not calibrated yet
    tree = region.tree
    region.fit(theta, x)
    assert region.tree is tree
    assert len(region.scores) == len(region.leaves) == 1000
    counts = torch.bincount(region.leaves, minlength=len(region._leaf_index))
    assert len(counts) >= 2  # the tree splits where q changes
    assert (counts > 0).all()
    assert max(_half_errors(region, theta_new, x_new)) < 0.06  # (one level: 0.1 off in both)
    # the same leaves and quantiles from given scores: the draws are skipped, not changed
    given = cl.ConformalRegion(_heteroscedastic, local=True)
    given.fit_partition(theta_tree, x_tree, scores=torch.rand(1000, generator=g))
    given.fit(theta, x, scores=region.scores)
    assert torch.equal(given.scores, region.scores)  # all 1,000, in the order given


def test_fit_partition_rejects_a_global_region_and_too_few_pairs() -> None:
    toy = GaussianToy(dim=2)
    theta, x = toy.sample(30, torch.Generator().manual_seed(23))
    with pytest.raises(ValueError, match="local=True"):
        cl.ConformalRegion(toy.posterior()).fit_partition(theta, x)
    region = cl.ConformalRegion(toy.posterior(), local=True, min_leaf_size=50)
    with pytest.raises(ValueError, match="min_leaf_size = 50 pairs, got 30"):
        region.fit_partition(theta, x)
    with pytest.raises(ValueError, match="scores must have shape"):
        region.fit_partition(theta, x, scores=torch.rand(29))


def test_posterior_summary_features_find_where_the_posterior_is_too_narrow() -> None:
    toy = GaussianToy(dim=2)
    g = torch.Generator().manual_seed(17)
    theta, x = toy.sample(2000, g)
    theta_new, x_new = toy.sample(4000, g)
    torch.manual_seed(17)  # the scoring draws (unseeded, they would follow the test order)
    region = cl.ConformalRegion(_heteroscedastic, local=True, num_posterior_samples=300,
                                embedding="posterior").fit(theta, x)  # fmt: skip
    assert max(_half_errors(region, theta_new, x_new)) < 0.06


def test_posterior_summary_features_are_seeded_and_shared_with_the_score() -> None:
    toy = GaussianToy(dim=2)
    theta, x = toy.sample(200, torch.Generator().manual_seed(18))
    region = cl.ConformalRegion(toy.posterior(variance_scale=0.5), local=True, min_leaf_size=20,
                                num_posterior_samples=100, embedding="posterior", seed=4,
                                conformity="credibility")  # fmt: skip
    region.fit(theta, x)
    features = region._features(x[:7])
    assert features.shape == (7, 5)  # means, standard deviations, mean log-density
    torch.manual_seed(0)
    again = region._features(x[:7])
    assert (features == again).all()  # the global generator does not matter
    assert torch.equal(region.calibrated_level(LEVEL, x[:7]), region.calibrated_level(LEVEL, x[:7]))
    inside = region.contains(theta[:7], x[:7], LEVEL)
    separate = region.credibility(theta[:7], x[:7]) < region.calibrated_level(LEVEL, x[:7])
    assert torch.equal(inside, separate)  # one set of seeded draws at the same x
    error = region.coverage_error(theta[:7], x[:7])  # one sampling pass for both
    given = region.coverage_error(theta[:7], x[:7], credibility=region.credibility(theta[:7],
                                                                                  x[:7]))
    assert float(error) == float(given)
    draws = region._draws(x[:7])
    expected = torch.cat([draws.mean(0), draws.std(0, unbiased=False)], 1).double()
    assert torch.allclose(torch.as_tensor(features[:, :4]), expected, atol=1e-5)
    samples_only = cl.SamplePosterior(lambda x, s: torch.randn(s, *x.shape), num_dims=2)
    distance = cl.ConformalRegion(samples_only, local=True, min_leaf_size=20,
                                  num_posterior_samples=50, embedding="posterior").fit(theta, x)
    assert distance._features(x[:3]).shape == (3, 4)  # no log-density without log_prob


def test_samples_only_posterior_uses_the_distance_score_with_the_guarantee() -> None:
    toy = GaussianToy(dim=2)

    def too_narrow(x: torch.Tensor, num_samples: int) -> torch.Tensor:
        return 0.8 * x + 0.5 * 0.2**0.5 * torch.randn(num_samples, *x.shape)

    post = cl.SamplePosterior(too_narrow, num_dims=2)
    default = cl.ConformalRegion(post)
    assert (default.score, default.conformity) == ("distance", "credibility")
    calibrated, nominal, bound = _coverage_over_repetitions(
        post, toy.sample, local=False, reps=100, n=40, draws=200, seed=6
    )
    _check_guarantee(calibrated, bound)
    assert float(nominal.mean()) < 0.75


def test_a_distance_score_is_fitted_with_the_statistic_it_is_used_with() -> None:
    toy = GaussianToy(dim=2)  # log_prob available, distance score asked for
    theta, x = toy.sample(50, torch.Generator().manual_seed(19))
    region = cl.ConformalRegion(toy.posterior(variance_scale=0.5), score="distance",
                                num_posterior_samples=64)  # fmt: skip
    torch.manual_seed(3)
    region.fit(theta, x)
    torch.manual_seed(3)  # the same draws
    ranks = region.credibility(theta, x).double() * 65
    assert torch.equal(torch.floor(region.scores * 65), torch.round(ranks))


def test_contains_agrees_with_the_log_density_threshold() -> None:
    toy = GaussianToy(dim=2)
    theta, x = toy.sample(300, torch.Generator().manual_seed(7))
    post = toy.posterior(variance_scale=0.5)
    region = cl.ConformalRegion(post, num_posterior_samples=500, conformity="credibility")
    region.fit(theta, x)
    points = torch.randn(64, 300, 2, generator=torch.Generator().manual_seed(8))
    torch.manual_seed(9)
    inside = region.contains(points, x, LEVEL)
    torch.manual_seed(9)  # the same draws
    threshold = region.threshold(x, LEVEL)
    assert inside.shape == (64, 300)
    assert torch.equal(inside, cl.as_posterior(post).log_prob(points, x) >= threshold)
    assert float(region.calibrated_level(LEVEL)) > LEVEL  # over-confident: a wider level
    nominal = region.threshold(x, LEVEL, calibrated=False)
    assert bool((nominal >= threshold).all())  # the nominal region is inside


@pytest.mark.parametrize("local", [False, True, "regression"])
def test_the_default_region_holds_its_level_as_users_build_it(local: bool | str) -> None:
    """``ConformalRegion(posterior)`` (``local`` the only argument otherwise) with its
    default seed, conformity and level, on a fresh dataset each repetition: its 90 % region
    covers new pairs at least 0.9 and at most 0.9 + 1 / (n_leaf + 1), up to 3 standard
    errors, for an exact and an over-confident posterior; the over-confident posterior's
    own 90 % HPD region covers far less (the sign the region corrects)."""
    toy = GaussianToy(dim=2)
    g = torch.Generator().manual_seed(40 + [False, True, "regression"].index(local))
    for variance_scale in (1.0, 0.5):
        post = toy.posterior(variance_scale=variance_scale)
        covered, bound, own = [], [], []
        for _ in range(100):
            region = cl.ConformalRegion(post, local=local).fit(*toy.sample(400, g))
            theta_new, x_new = toy.sample(200, g)
            covered.append(region.contains(theta_new, x_new).double().mean())
            tree = region.partition == "tree"
            n_leaf = torch.bincount(region.leaves).min() if tree else len(region.scores)
            bound.append(LEVEL + 1 / (float(n_leaf) + 1))
            with torch.no_grad():  # the posterior's own region: the nominal log-density level
                own.append((region.threshold(x_new, calibrated=False)
                            <= cl.as_posterior(post).log_prob(theta_new, x_new)).double().mean())
        assert region.conformity == "log_density"
        covered_t = torch.stack(covered)
        se = float(covered_t.std()) / math.sqrt(len(covered_t))
        assert float(covered_t.mean()) >= LEVEL - 3 * se, (variance_scale, covered_t.mean(), se)
        assert float(covered_t.mean()) <= max(bound) + 3 * se, (variance_scale, covered_t.mean())
        if variance_scale < 1:
            assert float(torch.stack(own).mean()) < 0.75


def test_a_log_density_region_is_a_log_density_threshold_per_leaf() -> None:
    """``conformity="log_density"``: the region is ``log q >= threshold(x)``, one threshold
    per leaf; its credibility form (``calibrated_level``, for figures and reports) holds it
    and little more of the posterior's mass (about 1 / (S + 1)); its coverage error on
    fresh pairs is near zero from above over repetitions; what it cannot take raises."""
    toy = GaussianToy(dim=2)
    post = toy.posterior(variance_scale=0.5)
    theta, x = toy.sample(400, torch.Generator().manual_seed(30))
    region = cl.ConformalRegion(post, local=True, min_leaf_size=50, conformity="log_density",
                                embedding="posterior", num_posterior_samples=400)  # fmt: skip
    region.fit(theta, x)
    theta_new, x_new = toy.sample(300, torch.Generator().manual_seed(31))
    torch.manual_seed(33)
    points = torch.cat([theta_new[None], cl.as_posterior(post).sample(x_new, 40)])
    inside = region.contains(points, x_new, LEVEL)
    threshold = region.threshold(x_new, LEVEL)
    assert torch.equal(inside, cl.as_posterior(post).log_prob(points, x_new) >= threshold)
    assert len(set(threshold.tolist())) == len(region._leaf_index) > 1  # one per leaf
    level = region.calibrated_level(LEVEL, x_new)
    assert bool(((level > LEVEL) & (level <= 1)).all())  # over-confident: wider
    loose = region.credibility(points, x_new) < level
    assert bool((loose | ~inside).all())
    assert float((loose & ~inside).double().mean()) < 0.01
    one = cl.ConformalRegion(post).fit(theta, x)  # global; the default with log_prob
    assert one.conformity == "log_density"
    assert "conformity='log_density'" in repr(one)
    with pytest.raises(ValueError, match="log_density' needs x"):
        one.calibrated_level()
    from calib_lightning.plots import plot_conformal_region

    legend = plot_conformal_region(one, x_new[:1], grid_size=30).axes[0].get_legend()
    assert any(t.get_text().startswith("calibrated (0.9") for t in legend.get_texts())
    with pytest.raises(ValueError, match="conformity='credibility'"):
        region.coverage_error(theta_new, x_new, credibility=torch.zeros(300))
    with pytest.raises(ValueError, match=r"scores of a conformity='credibility' region"):
        cl.ConformalRegion(post, conformity="credibility").fit(
            theta, x, scores=negative_log_prob(cl.as_posterior(post), theta, x))
    with pytest.raises(ValueError, match="conformity"):
        cl.ConformalRegion(post, conformity="hpd")
    samples_only = cl.SamplePosterior(lambda x, m: post(x).sample((m,)), num_dims=2)
    with pytest.raises(ValueError, match="log_density' needs log_prob"):
        cl.ConformalRegion(samples_only, conformity="log_density")
    g = torch.Generator().manual_seed(32)
    errors = []
    for rep in range(60):
        theta, x = toy.sample(40, g)
        fitted = cl.ConformalRegion(post, conformity="log_density", seed=rep).fit(theta, x)
        errors.append(fitted.coverage_error(*toy.sample(200, g)))
    errors_t = torch.stack(errors)
    mean, se = float(errors_t.mean()), float(errors_t.std()) / math.sqrt(len(errors_t))
    assert -3 * se <= mean <= 1 / (2 * 41) + 3 * se, (mean, se)


def test_zuko_and_nflows_flows_are_accepted() -> None:
    zuko = pytest.importorskip("zuko")
    nflows = pytest.importorskip("nflows.flows")
    from nflows.distributions import StandardNormal
    from nflows.transforms import MaskedAffineAutoregressiveTransform

    torch.manual_seed(10)
    theta, x = torch.randn(60, 2), torch.randn(60, 3)
    flows = [
        zuko.flows.NSF(2, 3, transforms=1, hidden_features=(8,)),
        nflows.Flow(MaskedAffineAutoregressiveTransform(2, 8, context_features=3),
                    StandardNormal([2])),
    ]  # fmt: skip
    for flow in flows:
        region = cl.ConformalRegion(flow, local=True, num_posterior_samples=40, min_leaf_size=10)
        region.fit(theta, x)
        level = region.calibrated_level(LEVEL, x[:5])
        assert level.shape == (5,)
        assert bool(((level > 0) & (level <= 1)).all())
        assert region.contains(theta[:5], x[:5]).dtype == torch.bool


def test_a_local_region_can_reuse_the_scores_of_a_global_one() -> None:
    toy = GaussianToy(dim=2)
    theta, x = toy.sample(400, torch.Generator().manual_seed(13))
    post = toy.posterior(variance_scale=0.5)
    torch.manual_seed(14)
    scored = cl.ConformalRegion(post, local=True, min_leaf_size=50, seed=3).fit(theta, x)
    torch.manual_seed(14)
    shared = cl.ConformalRegion(post, seed=3).fit(theta, x).scores
    reused = cl.ConformalRegion(post, local=True, min_leaf_size=50, seed=3)
    reused.fit(theta, x, scores=shared)
    assert torch.equal(reused.scores, scored.scores)
    assert torch.equal(reused.calibrated_level(LEVEL, x), scored.calibrated_level(LEVEL, x))
    with pytest.raises(ValueError, match="scores"):
        reused.fit(theta, x, scores=shared[:10])


def test_bad_input_raises_value_errors() -> None:
    toy = GaussianToy(dim=2)
    post = toy.posterior()
    theta, x = toy.sample(30, torch.Generator().manual_seed(11))
    region = cl.ConformalRegion(post, num_posterior_samples=50)  # log-density: x needed
    with pytest.raises(ValueError, match="not fitted"):
        region.calibrated_level(LEVEL, x[:2])
    region.fit(theta[:5], x[:5])
    with pytest.raises(ValueError, match="at least 9 held-out pairs"):
        region.calibrated_level(LEVEL, x[:2])
    assert min_pairs(0.95) == 19
    with pytest.raises(ValueError, match="theta"):
        region.fit(theta.clone().fill_(math.nan), x)
    with pytest.raises(ValueError, match="rows"):
        region.fit(theta, x[:20])
    with pytest.raises(ValueError, match="theta"):
        region.fit(theta[:, 0], x)
    with pytest.raises(ValueError, match="level"):
        region.fit(theta, x).calibrated_level(1.5, x[:2])
    with pytest.raises(ValueError, match="score"):
        cl.ConformalRegion(post, score="energy")
    with pytest.raises(ValueError, match="embedding"):
        cl.ConformalRegion(post, local=True, embedding="posteriors")
    box = torch.distributions.Independent(torch.distributions.Uniform(-torch.ones(2), 1.0), 1)
    outside = cl.ConformalRegion(lambda x: box.expand((x.shape[0],)), num_posterior_samples=50)
    outside.fit(theta.clamp(-0.99, 0.99), x)  # a point outside the support: never inside
    assert not outside.contains(torch.full((3, 2), 5.0), x[:3]).any()
    samples_only = cl.SamplePosterior(lambda x, s: torch.randn(s, *x.shape), num_dims=2)
    with pytest.raises(ValueError, match="log_prob"):
        cl.ConformalRegion(samples_only, score="density")
    local = cl.ConformalRegion(post, local=True, min_leaf_size=20)
    with pytest.raises(ValueError, match="min_leaf_size"):
        local.fit(theta, x)  # 15 pairs for the tree
    with pytest.raises(ValueError, match="needs x"):
        cl.ConformalRegion(post, local=True, min_leaf_size=5).fit(theta, x).calibrated_level()


@pytest.mark.parametrize("local", [False, True])
def test_coverage_error_is_the_area_between_the_coverage_curve_and_the_diagonal(
    local: bool,
) -> None:
    toy = GaussianToy(dim=2)
    g = torch.Generator().manual_seed(15)
    torch.manual_seed(15)
    theta, x = toy.sample(120, g)
    region = cl.ConformalRegion(_heteroscedastic, local=local, num_posterior_samples=100,
                                min_leaf_size=20, conformity="credibility").fit(theta, x)
    theta_new, x_new = toy.sample(300, g)
    cred = region.credibility(theta_new, x_new)
    leaves = region._leaf_of(region._features(x_new)) if local else torch.zeros(300).long()
    cells = region.leaves if local else torch.zeros(len(region.scores)).long()
    grid = (torch.arange(4000, dtype=torch.float64) + 0.5) / 4000  # midpoint rule
    curve = []
    for level in grid.tolist():  # the region's level at t, "everything" past the last score
        per_cell, _ = leaf_quantiles(region.scores, cells, int(cells.max()) + 1, level, fill=1.0)
        curve.append((cred < per_cell[leaves]).double().mean())
    area = float((torch.stack(curve) - grid).mean())
    closed = region.coverage_error(theta_new, x_new, credibility=cred)
    assert abs(float(closed) - area) < 1e-3  # steps of the curve: at most 1 / (2 * 4000) off
    if local:
        assert int(cells.max()) >= 1  # a real partition was tested


@pytest.mark.parametrize("variance_scale", [0.5, 1.0])
def test_coverage_error_of_calibrated_regions_is_near_zero_from_above(
    variance_scale: float,
) -> None:
    """Over repetitions on fresh pairs, the calibrated regions' signed error lies within
    [0, 1 / (2 (n + 1)) + 1 / (S + 1)] up to 3 standard errors, whether the posterior is
    exact or over-confident; the over-confident posterior's own regions are far below."""
    toy = GaussianToy(dim=2)
    post = toy.posterior(variance_scale=variance_scale)
    g = torch.Generator().manual_seed(16)
    torch.manual_seed(16)
    n, draws, errors, nominal = 40, 200, [], []
    for rep in range(80):
        theta, x = toy.sample(n, g)
        region = cl.ConformalRegion(post, num_posterior_samples=draws, seed=rep,
                                    conformity="credibility").fit(theta, x)  # fmt: skip
        theta_new, x_new = toy.sample(200, g)
        cred = region.credibility(theta_new, x_new)
        errors.append(region.coverage_error(theta_new, x_new, credibility=cred))
        nominal.append(0.5 - cred.double().mean())  # the posterior's own HPD regions
    errors_t = torch.stack(errors)
    se = float(errors_t.std()) / math.sqrt(len(errors_t))
    mean = float(errors_t.mean())
    assert -3 * se <= mean <= 1 / (2 * (n + 1)) + 1 / (draws + 1) + 3 * se, (mean, se)
    if variance_scale < 1:
        assert float(torch.stack(nominal).mean()) < -0.1
    with pytest.raises(ValueError, match="credibility"):
        region.coverage_error(theta_new, x_new, credibility=cred[:5])
    with pytest.raises(ValueError, match="together"):
        conformal_coverage_error(region.scores, cred.double(), leaves=torch.zeros(n).long())


@pytest.mark.parametrize("dim", [2, 3])
def test_plot_draws_the_calibrated_and_nominal_regions(dim: int) -> None:
    from calib_lightning.plots import plot_conformal_region

    toy = GaussianToy(dim=dim)
    theta, x = toy.sample(200, torch.Generator().manual_seed(12))
    region = cl.ConformalRegion(toy.posterior(variance_scale=0.5), num_posterior_samples=300)
    fig = plot_conformal_region(region.fit(theta, x), x[:1], truth=theta[0], grid_size=40)
    ax = fig.axes[0]
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert any(label.startswith("calibrated (0.9") for label in labels)
    if dim == 2:  # two contour sets: calibrated and nominal
        assert len(ax.collections) >= 3
    with pytest.raises(ValueError, match="x_o"):
        plot_conformal_region(region, x[:2])


def test_diagnose_reports_the_calibrated_region_at_each_observation(tmp_path) -> None:
    """Issue 25: the report gives the conformal region's level at each observation and,
    with reference samples, the exact mass of the nominal and the calibrated region; an
    over-confident posterior's nominal 90 % region holds far less, the calibrated about
    0.9 (the conformal guarantee is marginal: a tolerance of a few standard errors)."""
    toy = GaussianToy(dim=2)
    g = torch.Generator().manual_seed(21)
    theta_val, x_val = toy.sample(500, g)
    theta, x = toy.sample(200, g)
    _, observations = toy.sample(3, g)
    reference = toy.posterior()(observations).sample((2000,))  # (2000, 3, 2)
    narrow = toy.posterior(variance_scale=0.5)
    torch.manual_seed(22)  # the region's draws come from the global generator
    region = cl.ConformalRegion(narrow, num_posterior_samples=500).fit(theta_val, x_val)
    report = cl.diagnose(narrow, theta, x, observations=observations,
                         reference_samples=reference, region=region, checks=("ranks",))
    rows = report.regions.rows()
    assert [row["observation"] for row in rows] == [0, 1, 2]
    for row in rows:
        assert row["calibrated_level"] > 0.95  # a variance halved: its 90 % is its ~99 %
        assert row["reference_in_nominal_region"] < 0.8
        assert abs(row["reference_in_calibrated_region"] - 0.9) < 0.06
    page = report.save(tmp_path).read_text()
    assert "Calibrated credible regions" in page
    assert "one level for all x, calibrated on 500 held-out pairs" in page
    assert 'id="conformal_region_2"' in page
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["regions"] == rows
    with pytest.raises(ValueError, match="region must be fitted"):
        cl.diagnose(narrow, theta, x, observations=observations, checks=("ranks",),
                    region=cl.ConformalRegion(narrow))
    with pytest.raises(ValueError, match="region needs observations"):
        cl.diagnose(narrow, theta, x, checks=("ranks",), region=region)
    with pytest.raises(ValueError, match=r"region must be a fitted cl\.ConformalRegion"):
        cl.diagnose(narrow, theta, x, observations=observations, checks=("ranks",),
                    region=narrow)


def test_region_figure_names_its_axes_and_its_draws_in_the_legend() -> None:
    from calib_lightning.plots import plot_conformal_region

    toy = GaussianToy(dim=3)
    theta, x = toy.sample(200, torch.Generator().manual_seed(13))
    region = cl.ConformalRegion(toy.posterior(variance_scale=0.5), num_posterior_samples=300)
    torch.manual_seed(23)
    region.fit(theta, x)
    fig = plot_conformal_region(region, x[:1], labels=["mass", "spin", "tilt"], parameters=(1, 2))
    ax = fig.axes[0]
    assert (ax.get_xlabel(), ax.get_ylabel()) == ("spin", "tilt")
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert any(text.endswith("draws inside") and text.startswith("nominal") for text in legend)
    with pytest.raises(ValueError, match="labels must name the D = 3 parameters, got 2"):
        plot_conformal_region(region, x[:1], labels=["mass", "spin"])


def test_the_recalibration_studys_noise_floor_is_the_area_of_exact_scores() -> None:
    """The study's floor (vectorized) is ``conformal_coverage_error`` of uniform scores,
    and its size is the normal approximation ``sqrt((1/n + 1/N) / 12) * sqrt(2 / pi)``."""
    from examples.benchmarks.recalibration_study import conformal_floor

    n, num_test, repeats = 100, 1000, 4000
    floor, chance = conformal_floor(n, num_test, seeds=5, repeats=repeats)
    g = torch.Generator().manual_seed(0)  # the draws conformal_floor makes, one by one
    cal = torch.rand(repeats, n, generator=g, dtype=torch.float64)
    new = torch.rand(repeats, num_test, generator=g, dtype=torch.float64)
    looped = [abs(float(conformal_coverage_error(cal[i], new[i]))) for i in range(repeats)]
    assert floor == pytest.approx(sum(looped) / repeats, rel=1e-9)
    normal = math.sqrt((1 / n + 1 / num_test) / 12 * 2 / math.pi)
    assert floor == pytest.approx(normal, rel=0.05)
    assert 0.1 < chance < 0.6  # the mean of 5 such errors at or below 0.02


@pytest.mark.parametrize("partition", [False, True])
def test_the_report_says_which_tree_sets_a_local_region_and_how_many_pairs_calibrate(
    tmp_path, partition: bool
) -> None:
    toy = GaussianToy(dim=2)
    g = torch.Generator().manual_seed(24)
    torch.manual_seed(24)
    theta_val, x_val = toy.sample(400, g)
    theta, x = toy.sample(100, g)
    narrow = toy.posterior(variance_scale=0.5)
    region = cl.ConformalRegion(narrow, local=True, num_posterior_samples=100,
                                embedding="posterior")  # fmt: skip
    if partition:
        region.fit_partition(*toy.sample(300, g))
    region.fit(theta_val, x_val)
    report = cl.diagnose(narrow, theta, x, observations=x[:2], region=region, checks=("ranks",))
    page = report.save(tmp_path).read_text()
    grown, calibrating = (300, 400) if partition else (200, 200)  # else: half and half
    assert (f"one level per leaf of a tree over a summary of the posterior at x, grown on "
            f"{grown} other pairs, calibrated on {calibrating} held-out pairs") in page


def test_the_report_names_a_regression_region(tmp_path) -> None:
    toy = GaussianToy(dim=2)
    g = torch.Generator().manual_seed(26)
    torch.manual_seed(26)
    narrow = toy.posterior(variance_scale=0.5)
    region = cl.ConformalRegion(narrow, local="regression", num_posterior_samples=100,
                                embedding="posterior").fit(*toy.sample(400, g))  # fmt: skip
    theta, x = toy.sample(100, g)
    report = cl.diagnose(narrow, theta, x, observations=x[:2], region=region, checks=("ranks",))
    page = report.save(tmp_path).read_text()
    assert ("a level from a linear location-scale regression of the scores on a summary of "
            "the posterior at x, calibrated on 200 held-out pairs") in page  # (half: the model)
    assert "regression" in repr(region)
