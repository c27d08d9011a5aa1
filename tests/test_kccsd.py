"""KCCSD: signs (Stein identity), exact algebra, bootstrap moments, level, power, gradients."""

import itertools
import math

import numpy as np
import pytest
import torch
from torch.distributions import Independent, MultivariateNormal, Normal

import calib_lightning as cl
from calib_lightning import evaluation, kernels
from calib_lightning.functional import (
    bootstrap_p_value,
    gaussian_base_points,
    kccsd,
    kccsd_matrix,
    rademacher,
    u_statistic,
    wild_bootstrap,
)
from calib_lightning.tasks import HGM, LGM, MGM, QGM, NPTGaussian

F64 = torch.float64


def _gen(seed):
    return torch.Generator().manual_seed(seed)


# -- signs and algebra ---------------------------------------------------------------


@pytest.mark.parametrize("kernel", ["rbf", "imq"])
def test_stein_identity_holds_under_the_model_and_fails_off_it(kernel):
    """E_{Y~P} h((P, Y), (P', y')) = 0 for fixed (P', y'): every sign and argument
    order of the Stein kernel matters here. Under Y ~ Q != P it must not vanish."""
    g = _gen(0)
    d, n = 2, 400_000
    chol = torch.tensor([[1.0, 0.0], [0.6, 0.8]], dtype=F64)
    p = MultivariateNormal(torch.tensor([0.5, -0.3], dtype=F64), scale_tril=chol)
    p_other = MultivariateNormal(torch.tensor([1.0, 1.0], dtype=F64), 0.5 * torch.eye(d, dtype=F64))
    y_fixed = torch.tensor([[0.2, 0.7]], dtype=F64)
    s_fixed = cl.as_posterior(lambda x: p_other.expand((1,))).score(y_fixed, y_fixed)

    def mean_and_se(y):
        s = cl.as_posterior(lambda x: p.expand((len(x),))).score(y, y)
        h = kernels.stein_kernel(y, s, y_fixed, s_fixed, kernel, 1.1)[:, 0]
        return float(h.mean()), float(h.std() / n**0.5)

    y = p.mean + torch.randn(n, d, generator=g, dtype=F64) @ chol.T
    mean, se = mean_and_se(y)
    assert abs(mean) < 4 * se
    mean, se = mean_and_se(y + torch.tensor([0.8, 0.0], dtype=F64))  # Y ~ Q, shifted
    assert abs(mean) > 10 * se


def _naive_statistic(theta, score, base_scores, ell, sigma):
    """2 / (n (n-1)) sum_{i<j} k(P_i, P_j) h_ij with every term written out."""
    n, d = theta.shape
    m = base_scores.shape[1]
    total = 0.0
    for i in range(n):
        for j in range(i + 1, n):
            r = theta[i] - theta[j]
            q = float(r @ r)
            lij = np.exp(-q / (2 * ell**2))
            grad_i = -r / ell**2 * lij  # grad_{y_i} l
            grad_j = r / ell**2 * lij  # grad_{y_j} l
            trace = lij * (d / ell**2 - q / ell**4)
            h = lij * float(score[i] @ score[j]) + float(score[i] @ grad_j)
            h = h + float(score[j] @ grad_i) + trace
            gfd = sum(float(((base_scores[i, k] - base_scores[j, k]) ** 2).sum()) for k in range(m))
            total += np.exp(-gfd / m / (2 * sigma**2)) * h
    return 2 * total / (n * (n - 1))


def test_vectorized_statistic_equals_naive_double_loop():
    g = _gen(1)
    n, m, d = 9, 5, 3
    theta, score = (
        torch.randn(n, d, generator=g, dtype=F64),
        torch.randn(n, d, generator=g, dtype=F64),
    )
    base_scores = torch.randn(n, m, d, generator=g, dtype=F64)
    ell, sigma = 1.7, 2.3
    naive = _naive_statistic(theta, score, base_scores, ell, sigma)
    kwargs = {"bandwidth": ell, "distribution_bandwidth": sigma}
    matrix = kccsd_matrix(theta, score, base_scores, **kwargs)
    assert torch.equal(torch.diagonal(matrix), torch.zeros(n, dtype=F64))
    torch.testing.assert_close(u_statistic(matrix), torch.tensor(naive, dtype=F64))
    # the block-wise test (upper-triangular blocks of a symmetric H) gives the same
    # statistic and, with the same multipliers, the same p-value whatever the block size
    p_values = []
    for block_size in (1, 4, 100):
        out = kccsd(
            theta, score, base_scores, num_null=200, block_size=block_size,
            generator=_gen(9), **kwargs,
        )  # fmt: skip
        torch.testing.assert_close(out.statistic, torch.tensor(naive, dtype=F64))
        p_values.append(float(out.p_value))
    draws = wild_bootstrap(matrix, weights=rademacher((n, 200), _gen(9), F64))
    expected = float(bootstrap_p_value(u_statistic(matrix), draws))
    # at n = 9 the multipliers +-1 (probability 2 / 2^9 per draw) reproduce the statistic
    # exactly, and summation order can flip that tie: allow one draw of difference
    assert p_values == pytest.approx([expected] * 3, abs=1 / 201 + 1e-12)


def test_bootstrap_draws_have_exact_mean_and_variance_by_enumeration():
    g = _gen(2)
    n = 8
    a = torch.randn(n, n, generator=g, dtype=F64)
    matrix = (a + a.T).fill_diagonal_(0.0)
    signs = torch.tensor(list(itertools.product([-1.0, 1.0], repeat=n)), dtype=F64).T  # (n, 2^n)
    draws = wild_bootstrap(matrix, weights=signs)
    assert draws.shape == (2**n,)
    assert abs(float(draws.mean())) < 1e-12
    expected_var = 2 * float((matrix**2).sum()) / (n * (n - 1)) ** 2
    assert float(draws.var(unbiased=False)) == pytest.approx(expected_var, rel=1e-12)
    # and random multipliers are signs, shaped (*, B)
    random_draws = wild_bootstrap(matrix.expand(3, n, n), 1000, _gen(3))
    assert random_draws.shape == (3, 1000)


@pytest.mark.parametrize("distribution_kernel", ["gfd", "kgfd"])
def test_float32_scores_that_are_huge_at_the_base_points_give_the_float64_answer(
    distribution_kernel,
):
    """A sharp posterior has moderate scores at its truths but huge ones at base points far
    from it (up to 7.5e21 for the Jansen-Rit flow): their squared differences overflow
    float32 (3.4e38), which made the statistic NaN. The divergences between models are
    computed in float64, so float32 input gives the float64 statistic and p-value."""
    g = _gen(0)
    mean = torch.randn(200, 2, generator=g, dtype=F64)
    theta = mean + torch.randn(200, 2, generator=g, dtype=F64)
    base = gaussian_base_points(theta, 16, g)
    score = -(theta - mean)
    base_scores = -(base - mean[:, None]) * 1e21
    results = {
        dtype: kccsd(
            theta.to(dtype),
            score.to(dtype),
            base_scores.to(dtype),
            base.to(dtype),
            distribution_kernel=distribution_kernel,
            generator=_gen(1),
        )
        for dtype in (F64, torch.float32)
    }
    exact, single = results[F64], results[torch.float32]
    assert single.statistic.dtype == torch.float32
    assert torch.isfinite(single.statistic)
    assert float(single.statistic) == pytest.approx(float(exact.statistic), rel=1e-4)
    assert float(single.p_value) == pytest.approx(float(exact.p_value), abs=1 / 501 + 1e-6)
    assert float(single.distribution_bandwidth) == pytest.approx(
        float(exact.distribution_bandwidth), rel=1e-5
    )


def test_scores_are_widened_only_where_float32_would_overflow():
    """Moderate float32 scores keep float32 (its speed); huge ones go to float64;
    float64 is left alone."""
    from calib_lightning.kernels import _widened

    moderate = torch.randn(10, 32, 5)
    assert _widened(moderate) is moderate
    assert _widened(moderate * 1e15).dtype == torch.float32
    assert _widened(moderate * 1e19).dtype == F64
    wide = moderate.double() * 1e100
    assert _widened(wide) is wide


def test_bootstrap_p_value_formula():
    draws = torch.tensor([[0.1, 0.2, 0.3, 0.4], [1.0, 2.0, 3.0, 4.0]])
    p = bootstrap_p_value(torch.tensor([0.25, 5.0]), draws)
    torch.testing.assert_close(p, torch.tensor([(1 + 2) / 5, 1 / 5]))


# -- level and power, vectorized over datasets -------------------------------------------


def _batched_test(model, truth, n, reps, seed, kernel="rbf", distribution_kernel="gfd"):
    """p-values of `reps` independent datasets of size n, tested in one batched call."""
    g = _gen(seed)
    theta, x = truth.sample(n * reps, g)
    base = gaussian_base_points(theta, 32, g)
    score, at_base = evaluation.pair_and_base_scores(model, theta, x, base)
    d = theta.shape[1]
    out = kccsd(
        theta.reshape(reps, n, d),
        score.reshape(reps, n, d),
        at_base.reshape(reps, n, -1, d),
        base,
        kernel=kernel,
        distribution_kernel=distribution_kernel,
        num_null=500,
        generator=g,
        block_size=256,
    )
    return out.p_value.numpy()


def _max_excess(p_values):
    alphas = np.linspace(0.01, 1.0, 100)
    ecdf = (p_values[None, :] <= alphas[:, None]).mean(1)
    return float((ecdf - alphas).max())


@pytest.mark.parametrize(
    ("model", "kernel", "distribution_kernel"),
    [
        (MGM(0.0, dtype=F64), "rbf", "gfd"),
        (MGM(0.0, dtype=F64), "imq", "kgfd"),
        (LGM(0.0, dtype=F64), "rbf", "gfd"),
        (LGM(0.0, dtype=F64), "imq", "kgfd"),
    ],
    ids=["MGM-rbf-gfd", "MGM-imq-kgfd", "LGM-rbf-gfd", "LGM-imq-kgfd"],
)
def test_level_on_calibrated_models(model, kernel, distribution_kernel):
    p = _batched_test(model, model, n=100, reps=200, seed=10, kernel=kernel,
                      distribution_kernel=distribution_kernel)  # fmt: skip
    assert _max_excess(p) < 0.1
    assert 0.01 <= (p <= 0.05).mean() <= 0.10


def test_the_public_class_holds_its_level_at_d50_n1000():
    """``cl.KCCSD()`` at its defaults, a fresh dataset per repetition, on the exact
    posterior of the NPT Gaussian at D = 50 (float32, x of 100 features) with N = 1,000:
    the size of issue 23's power curves, where 11 of 100 datasets were rejected (1,000
    datasets then gave 0.049)."""
    task = NPTGaussian(dim=50)
    truth, exact = task.case("covariance", 0.0)
    p = []
    for rep in range(200):
        theta, x = task.sample(1000, truth, _gen(5_000 + rep))
        metric = cl.KCCSD()
        metric.update(exact, theta, x)
        p.append(float(metric.compute().p_value))
    p = np.asarray(p)
    # the ECDF above the uniform's by at most the 99 % DKW bound for 200 p-values (0.115)
    assert _max_excess(p) < math.sqrt(math.log(2 / 0.01) / (2 * len(p)))
    assert 0.02 <= (p <= 0.05).mean() <= 0.09, (p <= 0.05).mean()  # 99 % binomial band


@pytest.mark.parametrize(
    ("truth", "model"),
    [(HGM(0.0), HGM(1.0)), (QGM(0.0), QGM(1.0)), (MGM(0.0), MGM(0.1))],
    ids=["HGM", "QGM", "MGM-shift-0.1"],
)
def test_power_grows_with_n(truth, model):
    rates = [
        float((_batched_test(model, truth, n=n, reps=100, seed=20 + n) <= 0.05).mean())
        for n in (32, 128, 512)
    ]
    assert rates[0] < rates[1] < rates[2] or rates[1] == rates[2] == 1.0, rates
    assert rates[2] >= 0.6, rates


# -- differentiability ------------------------------------------------------------------


class LinearGaussian(torch.nn.Module):
    def __init__(self, d=2, x_dim=2):
        super().__init__()
        g = _gen(4)
        self.weight = torch.nn.Parameter(torch.randn(d, x_dim, generator=g, dtype=F64))
        self.bias = torch.nn.Parameter(0.1 * torch.randn(d, generator=g, dtype=F64))
        self.log_scale = torch.nn.Parameter(0.2 * torch.randn(d, generator=g, dtype=F64))

    def forward(self, x):
        return Independent(Normal(x @ self.weight.T + self.bias, self.log_scale.exp()), 1)


def test_gradcheck_of_statistic_with_respect_to_model_parameters():
    g = _gen(5)
    module = LinearGaussian()
    theta = torch.randn(6, 2, generator=g, dtype=F64)
    x = torch.randn(6, 2, generator=g, dtype=F64)
    base = torch.randn(4, 2, generator=g, dtype=F64)
    params = tuple(module.parameters())

    def statistic(weight, bias, log_scale):
        def model(x):
            return Independent(Normal(x @ weight.T + bias, log_scale.exp()), 1)

        score, at_base = evaluation.pair_and_base_scores(model, theta, x, base, create_graph=True)
        out = kccsd(theta, score, at_base, base, bandwidth=1.0, distribution_bandwidth=1.5,
                    num_null=1)  # fmt: skip
        return out.statistic

    assert torch.autograd.gradcheck(statistic, params, eps=1e-6, atol=1e-7)


# -- the metric ---------------------------------------------------------------------------


def _data(n=120, seed=6, model=None):
    model = model or MGM(0.0, dtype=F64)
    theta, x = model.sample(n, _gen(seed))
    return model, theta, x


def test_metric_many_small_updates_equal_one_big_update():
    model, theta, x = _data()
    one = cl.KCCSD()
    one.update(model, theta, x)
    many = cl.KCCSD()
    for start in range(0, 120, 25):
        many.update(model, theta[start : start + 25], x[start : start + 25])
    # the base measure is fitted in compute on all the pairs (in a canonical order), so
    # the split into updates does not change it nor the result
    first, second = one.compute(), many.compute()
    assert torch.equal(one.base_points, many.base_points)
    for key in ("statistic", "p_value", "bandwidth", "distribution_bandwidth"):
        torch.testing.assert_close(getattr(first, key), getattr(second, key))
    many_fixed, one_fixed = (
        cl.KCCSD(base_points=one.base_points),
        cl.KCCSD(base_points=one.base_points),
    )
    one_fixed.update(model, theta, x)
    for start in range(0, 120, 25):
        many_fixed.update(model, theta[start : start + 25], x[start : start + 25])
    a, b = one_fixed.compute(), many_fixed.compute()
    for key in ("statistic", "p_value", "bandwidth", "distribution_bandwidth"):
        torch.testing.assert_close(getattr(a, key), getattr(b, key))
    assert int(many.compute().num_pairs) == 120


def test_metric_result_does_not_depend_on_data_order():
    model, theta, x = _data()
    perm = torch.randperm(120, generator=_gen(7))
    base = gaussian_base_points(theta, 16, _gen(8))
    a, b = cl.KCCSD(base_points=base), cl.KCCSD(base_points=base)
    a.update(model, theta, x)
    b.update(model, theta[perm], x[perm])
    torch.testing.assert_close(a.compute().p_value, b.compute().p_value)
    torch.testing.assert_close(a.compute().statistic, b.compute().statistic)


@pytest.mark.forks
def test_metric_two_process_ddp_equals_one_process():
    from calib_lightning.testing import run_distributed

    model, theta, x = _data(n=160)

    def rank_fn(rank, world_size):
        metric = cl.KCCSD(distribution_kernel="kgfd")
        rows = slice(rank, None, world_size)  # interleaved split, unequal batches
        metric.update(model, theta[rows][:50], x[rows][:50])
        metric.update(model, theta[rows][50:], x[rows][50:])
        return metric.compute()

    results = run_distributed(rank_fn, world_size=2)
    # the base measure is fitted in compute on the pairs of all ranks, in a canonical
    # order: the one-process reference fits the same base points
    reference = cl.KCCSD(distribution_kernel="kgfd")
    reference.update(model, theta, x)
    expected = reference.compute()
    for result in results:
        for key in ("statistic", "p_value", "num_pairs"):
            torch.testing.assert_close(getattr(result, key), getattr(expected, key))


def test_forward_returns_a_differentiable_batch_statistic_and_accumulates():
    module = LinearGaussian()
    g = _gen(9)
    theta, x = (
        torch.randn(40, 2, generator=g, dtype=F64),
        torch.randn(40, 2, generator=g, dtype=F64),
    )
    metric = cl.KCCSD(num_null=50)
    out = metric(module, theta[:20], x[:20])
    assert isinstance(out, cl.metrics.kccsd.KCCSDResult)
    assert out.statistic.requires_grad
    out.statistic.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in module.parameters())
    metric(module, theta[20:], x[20:])
    assert int(metric.compute().num_pairs) == 40
    # stored states hold no graph (the pairs wait for the base points fitted in compute)
    stored = [*metric.theta, *metric.score, *metric.pending_theta, *metric.pending_score]
    assert len(stored) == 4
    assert not any(t.requires_grad for t in stored)
    with torch.no_grad():
        assert not metric(module, theta[:5], x[:5]).statistic.requires_grad


def test_state_dict_round_trip_keeps_the_base_points():
    model, theta, x = _data()
    metric = cl.KCCSD()
    metric.update(model, theta[:60], x[:60])
    restored = cl.KCCSD()
    restored.load_state_dict(metric.state_dict())
    torch.testing.assert_close(restored.base_points, metric.base_points)
    metric.update(model, theta[60:], x[60:])
    restored.update(model, theta, x)
    torch.testing.assert_close(restored.compute().p_value, metric.compute().p_value)


def test_memory_bound_warns_and_keeps_max_pairs():
    model, theta, x = _data()
    metric = cl.KCCSD(max_pairs=100)
    metric.update(model, theta[:80], x[:80])
    with pytest.warns(UserWarning, match="at most max_pairs=100"):
        metric.update(model, theta[80:], x[80:])
    assert int(metric.compute().num_pairs) == 100


def test_without_distribution_kernel():
    model, theta, x = _data()
    score = evaluation.scores(model, theta, x)
    out = kccsd(theta, score, distribution_kernel=None, generator=_gen(1))
    assert torch.isnan(out.distribution_bandwidth)
    assert 0 < float(out.p_value) <= 1


# -- bad input ------------------------------------------------------------------------------


def test_bad_input_raises_value_errors_naming_the_argument():
    model, theta, x = _data(n=10)
    metric = cl.KCCSD()
    with (
        pytest.raises(ValueError, match="needs at least one update"),
        pytest.warns(UserWarning, match="called before the ``update``"),
    ):
        metric.compute()
    bad = theta.clone()
    bad[3, 1] = float("nan")
    with pytest.raises(ValueError, match=r"theta must be finite, got 1 NaN/inf entries in 1 of 10"):
        metric.update(model, bad, x)
    with pytest.raises(ValueError, match=r"theta must have shape \(N, D\), got \(10,\)"):
        metric.update(model, theta[:, 0], x)
    with pytest.raises(ValueError, match=r"x must have the same number of rows as theta \(10\)"):
        metric.update(model, theta, x[:5])
    with pytest.raises(ValueError, match=r"x must have the same dtype as theta"):
        metric.update(model, theta, x.float())
    metric.update(model, theta[:1], x[:1])
    with pytest.raises(ValueError, match=r"at least N >= 2 calibration pairs, got N = 1"):
        metric.compute()
    with pytest.raises(ValueError, match="kernel must be one of"):
        cl.KCCSD(kernel="gauss")
    with pytest.raises(ValueError, match="distribution_kernel must be one of"):
        cl.KCCSD(distribution_kernel="mmd")
    with pytest.raises(ValueError, match="num_null must be a positive integer"):
        cl.KCCSD(num_null=0)
    fixed = cl.KCCSD(base_points=torch.zeros(4, 3, dtype=F64))
    with pytest.raises(ValueError, match="theta must have D = 3 columns like base_points"):
        fixed.update(model, theta, x)
    with pytest.raises(ValueError, match="N >= 2"):
        kccsd(theta[:1], evaluation.scores(model, theta[:1], x[:1]))


def test_non_finite_scores_are_reported():
    def broken(x):
        loc = torch.zeros_like(x)
        loc[0] = float("nan")
        return Independent(Normal(loc, 1.0, validate_args=False), 1)

    g = _gen(3)
    theta, x = torch.randn(6, 2, generator=g), torch.randn(6, 2, generator=g)
    match = r"score at theta must be finite, got NaN for 1 of 6 calibration pairs \(rows of theta"
    with pytest.raises(ValueError, match=match):
        evaluation.pair_and_base_scores(broken, theta, x, gaussian_base_points(theta, 32))
    with pytest.raises(
        ValueError, match=r"score at the base points must be finite, got NaN for 1 of 6 calib"
    ):
        evaluation.base_scores(broken, x, gaussian_base_points(theta, 32))
