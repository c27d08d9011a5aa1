"""Recovery, posterior z-scores and contraction: closed forms, calibration, offsets, figures.

Statistical tests put independent replicates in the parameter axis: ``GaussianToy``'s
coordinates are independent, so ``D`` columns are ``D`` replicates of a one-parameter
check, and every tolerance below is a multiple of the computed sampling error of an
average over them.
"""

import math

import pytest
import torch

from calib_lightning.functional import (
    Recovery,
    calibrated_z_score_std,
    recovery,
    recovery_from_moments,
)
from calib_lightning.functional._moments import merge_moments, moments, variance_from_moments
from calib_lightning.plots import plot_recovery, plot_z_score_contraction
from calib_lightning.tasks import GaussianToy

F64 = torch.float64
SIGMAS = 5.0  # tolerances: this many standard errors (two-sided, ~6e-7 per check)


def _hand_case():
    """Two parameters, four pairs; every number below is worked out by hand."""
    theta = torch.tensor([[0.0, 1.0], [1.0, -1.0], [2.0, 1.0], [3.0, -1.0]], dtype=F64)
    mean = torch.tensor([[0.5, 0.0], [1.5, 0.0], [2.5, 0.0], [3.5, 0.0]], dtype=F64)
    variance = torch.tensor([[0.25, 1.0], [0.25, 1.0], [0.25, 4.0], [0.25, 4.0]], dtype=F64)
    return theta, mean, variance


def test_closed_form_from_moments():
    theta, mean, variance = _hand_case()
    out = recovery_from_moments(mean, variance, theta, torch.tensor([2.0, 2.0], dtype=F64))
    # column 0: every mean 0.5 above the truth, sd 0.5 -> z = 1 each
    # column 1: errors (-1, 1, -1, 1), sds (1, 1, 2, 2) -> z = (-1, 1, -0.5, 0.5)
    z = torch.tensor([[1.0, -1.0], [1.0, 1.0], [1.0, -0.5], [1.0, 0.5]], dtype=F64)
    torch.testing.assert_close(out.z_scores, z, rtol=0, atol=1e-12)
    torch.testing.assert_close(out.z_score_mean, torch.tensor([1.0, 0.0], dtype=F64))
    # sd of (-1, 1, -0.5, 0.5) with N - 1 = 3: sqrt(2.5 / 3)
    torch.testing.assert_close(out.z_score_std, torch.tensor([0.0, math.sqrt(2.5 / 3)], dtype=F64))
    # SSE = 4 * 0.25 = 1, SST = 5 -> 0.8; SSE = 4, SST = 4 -> 0
    torch.testing.assert_close(out.r_squared, torch.tensor([0.8, 0.0], dtype=F64))
    torch.testing.assert_close(out.rmse, torch.tensor([0.5, 1.0], dtype=F64))
    # 1 - 0.25 / 2 = 0.875; 1 - (1, 1, 4, 4) / 2 = (0.5, 0.5, -1, -1), mean -0.25
    torch.testing.assert_close(out.contraction, torch.tensor([0.875, -0.25], dtype=F64))
    torch.testing.assert_close(out.contractions[:, 1], torch.tensor([0.5, 0.5, -1, -1], dtype=F64))
    torch.testing.assert_close(out.posterior_std, variance.sqrt())
    assert out.num_posterior_samples is None
    assert isinstance(out, Recovery)
    assert sorted(out.scalars()) == sorted(
        f"{name}/{i}" for name in Recovery.logged for i in range(2)
    )


def test_default_prior_variance_is_that_of_theta():
    theta, mean, variance = _hand_case()
    out = recovery_from_moments(mean, variance, theta)
    # unbiased variances of (0, 1, 2, 3) and (1, -1, 1, -1): 5/3 and 4/3
    torch.testing.assert_close(out.prior_variance, torch.tensor([5 / 3, 4 / 3], dtype=F64))
    torch.testing.assert_close(out.contraction[0], torch.tensor(1 - 0.25 * 3 / 5, dtype=F64))


def test_closed_form_from_two_draws():
    theta, mean, variance = _hand_case()
    # two draws mean -/+ d have mean `mean` and unbiased variance 2 d^2 = variance
    half_width = (variance / 2).sqrt()
    samples = torch.stack([mean - half_width, mean + half_width])
    out = recovery(samples, theta)
    torch.testing.assert_close(out.posterior_mean, mean)
    torch.testing.assert_close(out.posterior_std**2, variance)
    assert out.num_posterior_samples == 2


def test_samples_path_equals_moments_path_and_streaming():
    g = torch.Generator().manual_seed(0)
    theta = torch.randn(30, 3, generator=g, dtype=F64)
    samples = theta + 0.3 + 0.7 * torch.randn(7, 30, 3, generator=g, dtype=F64)
    direct = recovery(samples, theta)
    from_moments = recovery_from_moments(
        samples.mean(0), samples.var(0), theta, num_posterior_samples=7
    )
    # a metric that sees the draws in chunks keeps only per-pair moment states
    states = torch.stack([moments(chunk.transpose(0, 1)) for chunk in samples.split([3, 1, 3])])
    streamed = recovery_from_moments(*variance_from_moments(merge_moments(states)), theta)
    for other in (from_moments, streamed):
        for name in direct:
            if name != "num_posterior_samples":
                torch.testing.assert_close(other[name], direct[name], rtol=1e-12, atol=1e-12)
    assert from_moments.num_posterior_samples == 7
    assert streamed.num_posterior_samples is None


def _toy(n, d, seed, variance_scale=1.0, shift=0.0):
    """Pairs of the conjugate toy and the exact (or distorted) posterior's moments."""
    toy = GaussianToy(dim=d, noise_std=0.5, dtype=F64)  # posterior N(0.8 x, 0.2)
    theta, x = toy.sample(n, torch.Generator().manual_seed(seed))
    posterior = toy.posterior(variance_scale=variance_scale, shift=shift)(x)
    return theta, posterior


N, D = 500, 200  # 200 independent one-parameter replicates of 500 pairs


def test_exact_posterior_is_calibrated():
    theta, posterior = _toy(N, D, seed=1)
    out = recovery_from_moments(posterior.mean, posterior.variance, theta, torch.ones(D, dtype=F64))
    # z ~ N(0, 1) iid: each column's mean z ~ N(0, 1/N), its sd has sd ~ 1/sqrt(2(N-1))
    assert abs(float(out.z_score_mean.mean())) < SIGMAS / math.sqrt(N * D)
    spread = float(out.z_score_mean.var() * N)  # ~ chi2_{D-1} / (D-1)
    assert abs(spread - 1) < SIGMAS * math.sqrt(2 / (D - 1))
    assert abs(float(out.z_score_std.mean()) - 1) < SIGMAS / math.sqrt(2 * (N - 1) * D)
    # exact prior variance 1 and posterior variance 0.2: contraction exactly 0.8
    torch.testing.assert_close(out.contraction, torch.full((D,), 0.8, dtype=F64))
    # R^2 -> 1 - 0.2 / 1; sd of SSE/SST <= 0.2 sqrt(2/N) + 0.2 sqrt(2/N)
    assert abs(float(out.r_squared.mean()) - 0.8) < SIGMAS * 0.4 * math.sqrt(2 / N / D)
    # RMSE^2 -> 0.2, the posterior variance; sd of the MSE 0.2 sqrt(2/N)
    assert abs(float((out.rmse**2).mean()) - 0.2) < SIGMAS * 0.2 * math.sqrt(2 / N / D)


@pytest.mark.parametrize(("scale", "expected"), [(0.5, math.sqrt(2)), (2.0, math.sqrt(0.5))])
def test_dispersion_errors_move_the_z_score_std(scale, expected):
    # over-confident (variance halved): z sd sqrt(2) > 1; under-confident: sqrt(1/2) < 1
    theta, posterior = _toy(N, D, seed=2, variance_scale=scale)
    out = recovery_from_moments(posterior.mean, posterior.variance, theta, torch.ones(D, dtype=F64))
    error = expected / math.sqrt(2 * (N - 1))  # of one column's z sd
    assert abs(float(out.z_score_std.mean()) - expected) < SIGMAS * error / math.sqrt(D)
    if scale < 1:  # every single column is clearly on its side of 1
        assert bool((out.z_score_std > 1 + SIGMAS * error).all())
    else:
        assert bool((out.z_score_std < 1 - SIGMAS * error).all())
    assert abs(float(out.z_score_mean.mean())) < SIGMAS * expected / math.sqrt(N * D)
    torch.testing.assert_close(out.contraction, torch.full((D,), 1 - 0.2 * scale, dtype=F64))


@pytest.mark.parametrize("shift", [0.3, -0.3])
def test_bias_moves_the_mean_z_score_with_its_sign(shift):
    theta, posterior = _toy(N, D, seed=3, shift=shift)
    out = recovery_from_moments(posterior.mean, posterior.variance, theta)
    expected = shift / math.sqrt(0.2)  # a posterior too high (shift > 0) gives z > 0
    assert abs(float(out.z_score_mean.mean()) - expected) < SIGMAS / math.sqrt(N * D)
    assert bool((out.z_score_mean * math.copysign(1, shift) > SIGMAS / math.sqrt(N)).all())
    assert abs(float(out.z_score_std.mean()) - 1) < SIGMAS / math.sqrt(2 * (N - 1) * D)


def test_draws_inflate_the_z_score_std_as_predicted():
    # S = 10 draws of the exact posterior: z = sqrt(1 + 1/S) t_{S-1}, sd 1.189, not 1
    s, n, d = 10, 400, 50
    theta, posterior = _toy(n, d, seed=4)
    samples = posterior.sample((s,))
    out = recovery(samples, theta)
    expected = calibrated_z_score_std(s)
    assert expected == pytest.approx(math.sqrt(1.1 * 9 / 7))
    # sd of one column's z sd: (sigma / 2) sqrt((2 + excess kurtosis 6 / (S - 5)) / N)
    error = expected / 2 * math.sqrt((2 + 6 / (s - 5)) / n)
    assert abs(float(out.z_score_std.mean()) - expected) < SIGMAS * error / math.sqrt(d)
    assert out.num_posterior_samples == s
    assert calibrated_z_score_std(None) == 1.0
    with pytest.raises(ValueError, match="num_posterior_samples must be at least 4"):
        calibrated_z_score_std(3)


def test_offset_1e6_in_float32():
    g = torch.Generator().manual_seed(5)
    theta = 3 * torch.randn(300, 3, generator=g, dtype=F64)
    mu = theta + torch.randn(300, 3, generator=g, dtype=F64)
    samples = mu + torch.randn(64, 300, 3, generator=g, dtype=F64)
    reference = recovery(samples, theta)
    far = recovery((1e6 + samples).float(), (1e6 + theta).float())
    # float32 spacing at 1e6 is 1/16: each input moves by <= 1/32, so a posterior mean
    # minus truth by <= 1/16 and a posterior sd (about 1) by <= 1/32 * sqrt(S / (S - 1))
    torch.testing.assert_close(far.z_scores, reference.z_scores, rtol=0, atol=0.15)
    for name, atol in [("z_score_mean", 0.07), ("z_score_std", 0.07), ("r_squared", 0.02),
                       ("contraction", 0.02), ("rmse", 0.07)]:  # fmt: skip
        torch.testing.assert_close(far[name], reference[name], rtol=0, atol=atol)
    moment_path = recovery_from_moments(
        (1e6 + samples.mean(0)).float(), samples.var(0).float(), (1e6 + theta).float()
    )
    torch.testing.assert_close(moment_path.z_score_std, reference.z_score_std, rtol=0, atol=0.07)
    torch.testing.assert_close(moment_path.r_squared, reference.r_squared, rtol=0, atol=0.02)


@pytest.mark.parametrize("d", [1, 50])
def test_shapes_for_one_and_fifty_parameters(d):
    g = torch.Generator().manual_seed(6)
    theta = torch.randn(20, d, generator=g)
    out = recovery(theta + torch.randn(8, 20, d, generator=g), theta)
    for name in ("posterior_mean", "posterior_std", "theta", "z_scores", "contractions"):
        assert out[name].shape == (20, d)
        assert out[name].dtype == F64
    for name in (*Recovery.logged, "prior_variance"):
        assert out[name].shape == (d,)
    assert len(out.scalars()) == len(Recovery.logged) * d
    assert "(20, " in repr(out)  # shapes, not values


def _first(tensor, value):
    """A copy of ``tensor`` with its first entry set to ``value``."""
    out = tensor.clone()
    out.view(-1)[0] = value
    return out


def _good():
    g = torch.Generator().manual_seed(7)
    theta = torch.randn(5, 2, generator=g)
    return theta + torch.randn(4, 5, 2, generator=g), theta


@pytest.mark.parametrize(
    ("change", "pattern"),
    [
        (lambda s, t: (s[0], t), r"samples must have shape \(S, N, D\), got \(5, 2\)"),
        (lambda s, t: (s[:1], t), r"samples .* \(S, N, D\) with S >= 2 draws, got \(1, 5, 2\)"),
        (lambda s, t: (s[:, :4], t), r"samples .* = \(S, 5, 2\) to match theta, got \(4, 4, 2\)"),
        (lambda s, t: (s, t[0]), r"theta must have shape \(N, D\), got \(2,\)"),
        (lambda s, t: (s[:, :1], t[:1]), r"theta .* \(N, D\) with N >= 2 pairs .* got \(1, 2\)"),
        (lambda s, t: (_first(s, math.nan), t), "samples must be finite, got 1 NaN"),
        (lambda s, t: (s, t.long()), "theta must have a floating dtype"),
        (lambda s, t: (s.numpy(), t), r"samples must be a torch.Tensor of shape \(S, N, D\)"),
        (lambda s, t: (s[:1].expand(3, 5, 2), t), "samples must vary across the S draws of every"),
    ],
)
def test_sample_input_errors(change, pattern):
    with pytest.raises(ValueError, match=pattern):
        recovery(*change(*_good()))


def test_moment_and_prior_input_errors():
    samples, theta = _good()
    mean, variance = samples.mean(0), samples.var(0)
    with pytest.raises(ValueError, match=r"mean must have shape \(N, D\) = \(5, 2\), got \(5, 3\)"):
        recovery_from_moments(torch.zeros(5, 3), variance, theta)
    with pytest.raises(ValueError, match=r"variance must have shape \(N, D\) = \(5, 2\), got \(5,"):
        recovery_from_moments(mean, variance[:, 0], theta)
    with pytest.raises(ValueError, match="variance must be positive, got 1 entries <= 0"):
        recovery_from_moments(mean, _first(variance, 0.0), theta)
    with pytest.raises(ValueError, match=r"prior_variance .* \(D,\) = \(2,\), got \(3,\)"):
        recovery(samples, theta, torch.ones(3))
    with pytest.raises(ValueError, match="prior_variance must be positive in every entry"):
        recovery(samples, theta, torch.tensor([1.0, -1.0]))
    constant = theta.clone()
    constant[:, 1] = 2.0
    with pytest.raises(ValueError, match=r"theta must vary in every column.* columns \[1\]"):
        recovery(samples, constant)
    # with the prior variance given, a constant column is fine; its R^2 is undefined
    out = recovery(samples, constant, torch.ones(2))
    assert math.isnan(float(out.r_squared[1]))
    assert math.isfinite(float(out.r_squared[0]))


def test_figures_stay_bounded_at_fifty_parameters():
    g = torch.Generator().manual_seed(8)
    theta = torch.randn(40, 50, generator=g)
    out = recovery(theta + 0.5 * torch.randn(10, 40, 50, generator=g), theta)
    for plot in (plot_recovery, plot_z_score_contraction):
        fig = plot(out)
        width, height = fig.get_size_inches()
        assert width <= 6 * 2.5 + 1e-9  # max_columns panels of 2.5 inches
        assert height <= math.ceil(50 / 6) * 2.5 + 1.0 + 1e-9  # 9 rows and the titles
        visible = [ax for ax in fig.axes if ax.get_visible()]
        assert len(visible) == 50
        assert len({round(ax.get_position().x0, 3) for ax in visible}) == 6  # six columns
    few = plot_recovery(out, max_columns=4, parameters=range(10))
    assert few.get_size_inches()[0] <= 4 * 2.5 + 1e-9
    assert len({round(ax.get_position().x0, 3) for ax in few.axes if ax.get_visible()}) == 4


def test_figures_select_and_name_parameters():
    samples, theta = _good()
    names = ["mass", "rate"]
    fig = plot_recovery((samples, theta), labels=names, parameters=[1])
    (ax,) = fig.axes
    assert ax.get_title().startswith("rate   R² =")
    fig = plot_z_score_contraction(recovery(samples, theta), labels=names, parameters=[1, 0])
    assert [ax.get_title().split()[0] for ax in fig.axes] == ["rate", "mass"]
    assert all(ax.get_ylabel() in ("posterior z-score", "") for ax in fig.axes)
    fig.savefig(__import__("io").BytesIO(), format="png", dpi=40)  # draws without error
    with pytest.raises(ValueError, match=r"parameters must be a non-empty list of .* \[0, 2\)"):
        plot_recovery((samples, theta), parameters=[2])
    with pytest.raises(ValueError, match="labels must name all D = 2 parameters, got 1"):
        plot_z_score_contraction((samples, theta), labels=["mass"])
    with pytest.raises(ValueError, match="max_columns must be a positive integer"):
        plot_recovery((samples, theta), max_columns=0)
    with pytest.raises(ValueError, match="result_or_tensors must be a Recovery"):
        plot_recovery(samples)


def test_recovery_figure_states_a_large_offset():
    g = torch.Generator().manual_seed(9)
    theta = 1e6 + 3 * torch.randn(50, 1, generator=g, dtype=F64)
    fig = plot_recovery((theta + torch.randn(16, 50, 1, generator=g, dtype=F64), theta))
    texts = [t.get_text() for t in fig.axes[0].texts]
    assert texts == ["both axes − 1e+06"]
