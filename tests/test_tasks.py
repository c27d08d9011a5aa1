"""Toy simulators: shapes, priors, reproducibility, and that images show what theta says."""

import math

import pytest
import torch

from calib_lightning.tasks import GaussianBlob, Oscillator


@pytest.mark.parametrize("task", [GaussianBlob(size=16), Oscillator(length=40)])
def test_samples_have_documented_shapes_lie_in_the_prior_and_repeat_with_a_seed(task):
    theta, x = task.sample(64, torch.Generator().manual_seed(0))
    again = task.sample(64, torch.Generator().manual_seed(0))
    assert theta.shape == (64, 3)
    assert x.shape == ((64, 1, 16, 16) if isinstance(task, GaussianBlob) else (64, 40))
    low, high = task.box
    assert bool(((theta >= low) & (theta <= high)).all())
    assert torch.equal(theta, again[0])
    assert torch.equal(x, again[1])
    assert torch.isfinite(task.prior().log_prob(theta)).all()


def test_the_blob_peaks_at_its_centre_with_its_width():
    task = GaussianBlob(size=64, noise=1e-6)
    theta = torch.tensor([[0.3, 0.6, math.log(0.1)]])
    image = task.simulate(theta, torch.Generator().manual_seed(0))[0, 0]
    row, col = divmod(int(image.argmax()), 64)
    assert (row + 0.5) / 64 == pytest.approx(0.3, abs=1 / 64)
    assert (col + 0.5) / 64 == pytest.approx(0.6, abs=1 / 64)
    # one width from the centre the blob is exp(-1/2) of its peak
    assert float(image.max()) == pytest.approx(1.0, abs=0.01)
    one_width = image[row + round(0.1 * 64), col]
    assert float(one_width) == pytest.approx(math.exp(-0.5), abs=0.05)


def test_the_oscillator_follows_its_formula_and_the_noise_level():
    task = Oscillator(length=200, noise=0.5)
    theta = torch.tensor([[1.0, 0.2, 1.2]]).expand(2000, 3)
    x = task.simulate(theta, torch.Generator().manual_seed(1))
    t = torch.linspace(0.0, 5.0, 200)
    clean = 1.2 * torch.exp(-0.2 * t) * torch.sin(2 * math.pi * t)
    torch.testing.assert_close(x.mean(0), clean, atol=0.05, rtol=0)  # 5 sd of the mean
    assert float(x.std(0).mean()) == pytest.approx(0.5, rel=0.02)


def test_bad_settings_raise_naming_them():
    with pytest.raises(ValueError, match="size must be an integer >= 2"):
        GaussianBlob(size=1)
    with pytest.raises(ValueError, match="noise must be positive"):
        Oscillator(noise=0.0)


def test_gaussian_linear_uniform_in_any_dimension_with_its_log_likelihood():
    from calib_lightning.tasks import GaussianLinearUniform

    task = GaussianLinearUniform(dim=3, dtype=torch.float64)
    theta, x = task.sample(50, torch.Generator().manual_seed(0))
    assert theta.shape == x.shape == (50, 3)
    assert task.prior().event_shape == (3,)
    expected = torch.distributions.Normal(theta, task.noise_var**0.5).log_prob(x).sum(-1)
    torch.testing.assert_close(task.log_likelihood(theta, x), expected)
    assert GaussianLinearUniform().theta_dim == 10  # sbibm's task by default
    with pytest.raises(ValueError, match="dim must be an integer >= 1, got 0"):
        GaussianLinearUniform(dim=0)
