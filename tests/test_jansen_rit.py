"""The Jansen-Rit task: what the model is known to do, the exact linear step, the summary."""

import math

import numpy as np
import pytest
import torch
from scipy.linalg import solve_continuous_lyapunov
from scipy.signal import welch

from calib_lightning.tasks import JansenRit, LogPSD
from calib_lightning.tasks.jansen_rit import linear_step

DEFAULT = torch.tensor([[135.0, 220.0, 2000.0, 0.0]], dtype=torch.float64)


def drift(rate):
    return np.array([[0.0, 1.0], [-(rate**2), -2.0 * rate]])


def test_the_psd_peaks_in_the_alpha_band_at_the_papers_default_parameters():
    task = JansenRit(dtype=torch.float64)
    x = task.simulate(DEFAULT.expand(32, 4), torch.Generator().manual_seed(0))
    freqs = task.log_psd.frequencies()
    mean = x.mean(0)
    peak = float(freqs[1:][mean[1:].argmax()])
    assert 8.0 <= peak <= 12.0
    # a peak, not a plateau: the alpha bin stands above 4 Hz and 20 Hz by a factor > 5
    at = lambda hz: float(mean[(freqs - hz).abs().argmin()])  # noqa: E731
    assert at(peak) - at(4.0) > math.log10(5)
    assert at(peak) - at(20.0) > math.log10(5)


def test_the_gain_shifts_the_log_psd_by_g_over_5_and_nothing_else():
    # the series is scaled by 10^(g/10), its power by 10^(g/5): log10-PSD + g/5
    task = JansenRit(dtype=torch.float64)
    theta = DEFAULT.repeat(3, 1)
    theta[:, 3] = torch.tensor([0.0, 10.0, -15.0], dtype=torch.float64)
    x = torch.stack([task.simulate(t[None], torch.Generator().manual_seed(3))[0] for t in theta])
    torch.testing.assert_close(x[1] - x[0], torch.full_like(x[0], 2.0), rtol=0, atol=1e-10)
    torch.testing.assert_close(x[2] - x[0], torch.full_like(x[0], -3.0), rtol=0, atol=1e-10)


@pytest.mark.parametrize("rate", [100.0, 50.0])
def test_the_exact_linear_step_matches_the_closed_forms(rate):
    h = 1 / 1024
    transition, covariance = (m.numpy() for m in linear_step(h, rate))
    # e^{Mh} of the critically damped oscillator
    decay = math.exp(-rate * h)
    closed = decay * np.array([[1 + rate * h, h], [-(rate**2) * h, 1 - rate * h]])
    np.testing.assert_allclose(transition, closed, rtol=1e-12)
    # its stationary covariance solves M P + P M^T + e2 e2^T = 0 ...
    unit = np.array([[0.0, 0.0], [0.0, 1.0]])
    stationary = solve_continuous_lyapunov(drift(rate), -unit)
    np.testing.assert_allclose(
        stationary, np.diag([1 / (4 * rate**3), 1 / (4 * rate)]), rtol=1e-10, atol=1e-14
    )
    # ... and is a fixed point of the exact step: P = E P E^T + Q
    np.testing.assert_allclose(
        transition @ stationary @ transition.T + covariance, stationary, rtol=1e-9, atol=1e-16
    )
    # over a step of many time constants the step's covariance is the stationary one
    long_step = linear_step(40.0 / rate, rate)[1].numpy()
    np.testing.assert_allclose(np.diag(long_step), np.diag(stationary), rtol=1e-9)


def test_the_linear_steps_noise_gives_the_stationary_moments():
    # 20,000 chains of the step the simulator takes, started at 0, after 1 s (10 time constants)
    h, rate = 1 / 1024, 100.0
    transition, covariance = linear_step(h, rate)
    chol = torch.linalg.cholesky(covariance)
    gen = torch.Generator().manual_seed(0)
    state = torch.zeros(20_000, 2, dtype=torch.float64)
    for _ in range(1024):
        state = (
            state @ transition.T
            + torch.randn(state.shape, generator=gen, dtype=torch.float64) @ chol.T
        )
    stationary = solve_continuous_lyapunov(drift(rate), -np.array([[0.0, 0.0], [0.0, 1.0]]))
    empirical = np.cov(state.numpy().T)
    std = np.sqrt(np.diag(stationary))
    # the mean within 4 standard errors, the variances within 5 % (their s.e. is 1 %)
    assert np.all(np.abs(state.mean(0).numpy()) < 4 * std / math.sqrt(20_000))
    np.testing.assert_allclose(np.diag(empirical), np.diag(stationary), rtol=0.05)
    assert abs(empirical[0, 1]) / (std[0] * std[1]) < 0.05


def test_the_summary_is_welchs_periodogram_in_log10():
    x = torch.randn(3, 1024, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    ours = LogPSD(33)(x)
    freqs, density = welch(
        x.numpy(), fs=128.0, window="boxcar", nperseg=65, noverlap=33, detrend=False
    )
    np.testing.assert_allclose(LogPSD(33).frequencies().numpy(), freqs)
    # scipy scales by 1 / (fs * 65) and doubles every bin above DC (65 is odd: no Nyquist bin)
    offset = np.log10(density) - ours.numpy()
    np.testing.assert_allclose(offset[:, 1:], math.log10(2 / (128 * 65)), atol=1e-10)
    np.testing.assert_allclose(offset[:, 0], math.log10(1 / (128 * 65)), atol=1e-10)


def test_a_seed_repeats_and_shapes_dtypes_and_prior_are_as_documented():
    task = JansenRit(chunk_size=3)  # two chunks
    theta, x = task.sample(4, torch.Generator().manual_seed(0))
    again_theta, again = task.sample(4, torch.Generator().manual_seed(0))
    other = task.simulate(theta[:2], torch.Generator().manual_seed(1))
    assert torch.equal(theta, again_theta)
    assert torch.equal(x, again)
    assert not torch.equal(x[:2], other)
    assert theta.shape == (4, 4)
    assert x.shape == (4, 33)
    assert x.dtype == torch.float32
    low, high = task.box
    assert bool(((theta >= low) & (theta <= high)).all())
    assert torch.isfinite(task.prior().log_prob(theta)).all()
    assert task.prior().log_prob(torch.tensor([[5.0, 220.0, 2000.0, 0.0]])).item() == -math.inf
    series = JansenRit(summary=False, dtype=torch.float64).simulate(
        theta[:2].double(), torch.Generator().manual_seed(0)
    )
    assert series.shape == (2, 1024)
    assert series.dtype == torch.float64
    torch.testing.assert_close(
        series.mean(-1), torch.zeros(2, dtype=torch.float64), atol=1e-12, rtol=0
    )
    # the summary of the series is what simulate returns with summary=True
    summary = JansenRit(dtype=torch.float64).simulate(
        theta[:2].double(), torch.Generator().manual_seed(0)
    )
    torch.testing.assert_close(LogPSD()(series), summary)
    assert JansenRit().simulate(torch.zeros(0, 4)).shape == (0, 33)


@pytest.mark.parametrize(
    ("theta", "words"),
    [
        (torch.zeros(4), "shape (N, 4)"),
        (torch.zeros(2, 3), "got (2, 3)"),
        (torch.zeros(2, 4, dtype=torch.long), "floating"),
    ],
)
def test_bad_theta_gets_a_clear_value_error(theta, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
        JansenRit().simulate(theta)


def test_bad_arguments_get_clear_value_errors():
    with pytest.raises(ValueError, match="chunk_size must be an integer >= 1, got 0"):
        JansenRit(chunk_size=0)
    with pytest.raises(ValueError, match="nbins must be an integer >= 2"):
        LogPSD(1)
    with pytest.raises(ValueError, match="T >= 65"):
        LogPSD(33)(torch.zeros(2, 10))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_simulation_follows_the_device_of_theta():
    theta = DEFAULT.expand(8, 4).cuda()
    x = JansenRit(dtype=torch.float64).simulate(theta, torch.Generator("cuda").manual_seed(0))
    assert x.device.type == "cuda"
    assert torch.isfinite(x).all()
    freqs = LogPSD().frequencies()
    assert 8.0 <= float(freqs[1:][x.mean(0)[1:].argmax().cpu()]) <= 12.0
