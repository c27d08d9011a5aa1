r"""Simulators whose observations are images or time series, for embedding networks.

:class:`GaussianBlob`: a noisy ``size x size`` image of a Gaussian blob whose position and
width are the parameters; :class:`Oscillator`: a noisy damped oscillation observed at
``length`` times, whose frequency, damping and amplitude are the parameters. Both have
box-uniform priors, so the posteriors are proper and bounded, and are cheap enough to
simulate tens of thousands of pairs on a CPU. Neither posterior is tractable: they are
for costs, embeddings and level/power checks with trained flows, not for closed forms.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from calib_lightning.tasks.sbi import SBITask

__all__ = ["GaussianBlob", "Oscillator"]


class _BoxTask(SBITask):
    """A task whose prior is uniform on the box ``self.box`` (per-coordinate bounds)."""

    @property
    def box(self) -> tuple[Tensor, Tensor]:
        raise NotImplementedError

    def prior(self) -> torch.distributions.Distribution:
        low, high = self.box
        return torch.distributions.Independent(torch.distributions.Uniform(low, high), 1)

    def sample_prior(self, n: int, generator: torch.Generator | None = None) -> Tensor:
        low, high = self.box
        u = torch.rand(n, low.shape[0], generator=generator, dtype=self.dtype)
        return low + (high - low) * u


class GaussianBlob(_BoxTask):
    r"""A Gaussian blob on a ``size x size`` grid with additive Gaussian noise.

    :math:`\theta = (c_1, c_2, \log w)` with the centre :math:`c \in [0.25, 0.75]^2` (in
    units of the image side) and width :math:`w \in [0.05, 0.15]`;
    :math:`x_{ij} = \exp(-\|p_{ij} - c\|^2 / (2 w^2)) + \sigma \varepsilon_{ij}` at pixel
    centres :math:`p_{ij}`, returned as ``(N, 1, size, size)`` images.

    Arguments:
        size: image side in pixels.
        noise: :math:`\sigma`.
        dtype: dtype of parameters and images.

    Example:
        >>> theta, x = GaussianBlob(size=16).sample(4, torch.Generator().manual_seed(0))
        >>> theta.shape, x.shape
        (torch.Size([4, 3]), torch.Size([4, 1, 16, 16]))
    """

    theta_dim = 3

    def __init__(
        self, size: int = 32, noise: float = 0.1, dtype: torch.dtype = torch.float32
    ) -> None:
        super().__init__(dtype)
        if isinstance(size, bool) or not isinstance(size, int) or size < 2:
            raise ValueError(f"size must be an integer >= 2, got {size!r}")
        if not noise > 0:
            raise ValueError(f"noise must be positive, got {noise!r}")
        self.size, self.noise = size, float(noise)
        self.x_dim = size * size

    def __repr__(self) -> str:
        return f"GaussianBlob(size={self.size}, noise={self.noise})"

    @property
    def box(self) -> tuple[Tensor, Tensor]:
        """Lower and upper corners ``(3,)`` of the box-uniform prior."""
        low = torch.tensor([0.25, 0.25, math.log(0.05)], dtype=self.dtype)
        high = torch.tensor([0.75, 0.75, math.log(0.15)], dtype=self.dtype)
        return low, high

    def simulate(self, theta: Tensor, generator: torch.Generator | None = None) -> Tensor:
        """Images ``(N, 1, size, size)`` for parameters ``(N, 3)``."""
        grid = (torch.arange(self.size, dtype=theta.dtype) + 0.5) / self.size
        rows, cols = grid[None, :, None], grid[None, None, :]
        width = theta[:, 2].exp()[:, None, None]
        sq = (rows - theta[:, 0, None, None]) ** 2 + (cols - theta[:, 1, None, None]) ** 2
        image = torch.exp(-sq / (2 * width**2))
        noise = torch.randn(image.shape, generator=generator, dtype=theta.dtype)
        return (image + self.noise * noise).unsqueeze(1)


class Oscillator(_BoxTask):
    r"""A damped oscillation observed at ``length`` regular times with Gaussian noise.

    :math:`\theta = (f, \gamma, a)`: frequency :math:`f \in [0.5, 2]`, damping
    :math:`\gamma \in [0.1, 1]` and amplitude :math:`a \in [0.5, 1.5]`;
    :math:`x_t = a e^{-\gamma t} \sin(2 \pi f t) + \sigma \varepsilon_t` for
    :math:`t \in [0, 5]`, returned as ``(N, length)`` series.

    Example:
        >>> theta, x = Oscillator(length=50).sample(3, torch.Generator().manual_seed(0))
        >>> x.shape
        torch.Size([3, 50])
    """

    theta_dim = 3

    def __init__(
        self, length: int = 100, noise: float = 0.1, dtype: torch.dtype = torch.float32
    ) -> None:
        super().__init__(dtype)
        if isinstance(length, bool) or not isinstance(length, int) or length < 2:
            raise ValueError(f"length must be an integer >= 2, got {length!r}")
        if not noise > 0:
            raise ValueError(f"noise must be positive, got {noise!r}")
        self.length, self.noise = length, float(noise)
        self.x_dim = length

    def __repr__(self) -> str:
        return f"Oscillator(length={self.length}, noise={self.noise})"

    @property
    def box(self) -> tuple[Tensor, Tensor]:
        """Lower and upper corners ``(3,)`` of the box-uniform prior."""
        return (
            torch.tensor([0.5, 0.1, 0.5], dtype=self.dtype),
            torch.tensor([2.0, 1.0, 1.5], dtype=self.dtype),
        )

    def simulate(self, theta: Tensor, generator: torch.Generator | None = None) -> Tensor:
        """Series ``(N, length)`` for parameters ``(N, 3)``."""
        t = torch.linspace(0.0, 5.0, self.length, dtype=theta.dtype)
        f, damping, amplitude = theta[:, :1], theta[:, 1:2], theta[:, 2:]
        clean = amplitude * torch.exp(-damping * t) * torch.sin(2 * math.pi * f * t)
        noise = torch.randn(clean.shape, generator=generator, dtype=theta.dtype)
        return clean + self.noise * noise
