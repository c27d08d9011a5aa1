r"""Toy simulators with known posteriors, for tests, benchmarks and examples.

Two families live here:

* the synthetic calibration models of Glaser et al. (2023, section 6): MGM, LGM,
  HGM and QGM, where a Gaussian predictive model :math:`P_{|x}` is calibrated for
  ``delta = 0`` and miscalibrated otherwise;
* :class:`GaussianToy`, the conjugate toy :math:`\theta \sim N(0, I)`,
  :math:`x = \theta + N(0, s^2 I)` whose exact posterior is Gaussian, with knobs to
  inflate, shrink or shift it.

Each model is callable ``x -> Distribution``, so :func:`calib_lightning.as_posterior`
accepts it directly.

References:
    Glaser, Widmann, Lindsten, Gretton. "Fast and Scalable Score-Based Kernel
    Calibration Tests." UAI 2023.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor
from torch.distributions import Distribution, Independent, Normal

__all__ = ["HGM", "LGM", "MGM", "QGM", "GaussianToy", "SyntheticModel"]


def _normal(loc: Tensor, scale: Tensor | float) -> Distribution:
    scale = torch.as_tensor(scale, dtype=loc.dtype, device=loc.device).expand_as(loc)
    return Independent(Normal(loc, scale), 1)


class SyntheticModel:
    r"""A joint :math:`P(X)\,P(Y \mid X)` with a Gaussian predictive model :math:`P_{|x}`.

    Subclasses define :meth:`sample_x`, :meth:`true_mean_scale` and
    :meth:`model_mean_scale` (diagonal Gaussians). ``model(x)`` is the predictive
    distribution :math:`P_{|x}` to be tested.

    Arguments:
        delta: degree of miscalibration; ``0`` means calibrated.
        dtype: floating dtype of the sampled tensors.
    """

    x_dim: int
    theta_dim: int

    def __init__(self, delta: float = 0.0, dtype: torch.dtype = torch.float32) -> None:
        self.delta = float(delta)
        self.dtype = dtype

    def __repr__(self) -> str:
        return f"{type(self).__name__}(delta={self.delta})"

    def sample_x(self, n: int, generator: torch.Generator | None) -> Tensor:
        raise NotImplementedError

    def true_mean_scale(self, x: Tensor) -> tuple[Tensor, Tensor]:
        raise NotImplementedError

    def model_mean_scale(self, x: Tensor) -> tuple[Tensor, Tensor]:
        raise NotImplementedError

    def sample(
        self, n: int, generator: torch.Generator | None = None
    ) -> tuple[Tensor, Tensor]:
        """Draw ``n`` pairs: ``theta`` of shape ``(n, D)`` and ``x`` of shape ``(n, X)``."""
        x = self.sample_x(n, generator)
        mean, scale = self.true_mean_scale(x)
        noise = torch.randn(mean.shape, generator=generator, dtype=self.dtype)
        return mean + scale * noise, x

    def __call__(self, x: Tensor) -> Distribution:
        mean, scale = self.model_mean_scale(x)
        return _normal(mean, scale)


class MGM(SyntheticModel):
    r"""Mean Gaussian model: :math:`X \sim N(0, I_5)`, :math:`Y \mid x \sim N(x, I_5)`,
    :math:`P_{|x} = N(x + \delta c, I_5)` with ``c`` all ones or ``e_1``.

    Arguments:
        delta: mean shift of the model.
        shift: ``"all"`` (``c = 1``) or ``"first"`` (``c = e_1``).
        dim: dimension (5 in the paper).
    """

    def __init__(
        self,
        delta: float = 0.0,
        shift: str = "all",
        dim: int = 5,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__(delta, dtype)
        if shift not in ("all", "first"):
            raise ValueError(f"shift must be 'all' or 'first', got {shift!r}")
        self.shift, self.x_dim, self.theta_dim = shift, dim, dim

    def sample_x(self, n: int, generator: torch.Generator | None) -> Tensor:
        return torch.randn(n, self.x_dim, generator=generator, dtype=self.dtype)

    def true_mean_scale(self, x: Tensor) -> tuple[Tensor, Tensor]:
        return x, torch.ones_like(x)

    def model_mean_scale(self, x: Tensor) -> tuple[Tensor, Tensor]:
        c = torch.ones(self.theta_dim, dtype=x.dtype, device=x.device)
        if self.shift == "first":
            c[1:] = 0.0
        return x + self.delta * c, torch.ones_like(x)


class LGM(SyntheticModel):
    r"""Linear Gaussian model: :math:`X \sim N(0, I_5)`,
    :math:`Y \mid x \sim N(\sum_i i x_i, 1)`, :math:`P_{|x} = N(\delta + \sum_i i x_i, 1)`.
    """

    x_dim, theta_dim = 5, 1

    def sample_x(self, n: int, generator: torch.Generator | None) -> Tensor:
        return torch.randn(n, self.x_dim, generator=generator, dtype=self.dtype)

    def _mean(self, x: Tensor) -> Tensor:
        weights = torch.arange(1, self.x_dim + 1, dtype=x.dtype, device=x.device)
        return (x * weights).sum(-1, keepdim=True)

    def true_mean_scale(self, x: Tensor) -> tuple[Tensor, Tensor]:
        mean = self._mean(x)
        return mean, torch.ones_like(mean)

    def model_mean_scale(self, x: Tensor) -> tuple[Tensor, Tensor]:
        mean = self._mean(x)
        return mean + self.delta, torch.ones_like(mean)


class HGM(SyntheticModel):
    r"""Heteroscedastic Gaussian model: :math:`X \sim N(0, I_3)`,
    :math:`Y \mid x \sim N(\sum_i x_i, 1)`, :math:`P_{|x} = N(\sum_i x_i, \sigma^2(x))` with
    :math:`\sigma^2(x) = 1 + 10 \delta \exp(-\|x - c\|^2 / (2 \cdot 0.8^2))`,
    :math:`c = \tfrac{2}{3} 1_3`.
    """

    x_dim, theta_dim = 3, 1

    def sample_x(self, n: int, generator: torch.Generator | None) -> Tensor:
        return torch.randn(n, self.x_dim, generator=generator, dtype=self.dtype)

    def true_mean_scale(self, x: Tensor) -> tuple[Tensor, Tensor]:
        mean = x.sum(-1, keepdim=True)
        return mean, torch.ones_like(mean)

    def model_mean_scale(self, x: Tensor) -> tuple[Tensor, Tensor]:
        mean = x.sum(-1, keepdim=True)
        dist2 = ((x - 2.0 / 3.0) ** 2).sum(-1, keepdim=True)
        var = 1.0 + 10.0 * self.delta * torch.exp(-dist2 / (2 * 0.8**2))
        return mean, var.sqrt()


class QGM(SyntheticModel):
    r"""Quadratic Gaussian model: :math:`X \sim U(-2, 2)`,
    :math:`Y \mid x \sim N(0.1 x^2 + x + 1, 1)`,
    :math:`P_{|x} = N(0.1 (1 - \delta) x^2 + x + 1, 1)`.
    """

    x_dim, theta_dim = 1, 1

    def sample_x(self, n: int, generator: torch.Generator | None) -> Tensor:
        return 4.0 * torch.rand(n, 1, generator=generator, dtype=self.dtype) - 2.0

    def true_mean_scale(self, x: Tensor) -> tuple[Tensor, Tensor]:
        return 0.1 * x**2 + x + 1.0, torch.ones_like(x)

    def model_mean_scale(self, x: Tensor) -> tuple[Tensor, Tensor]:
        return 0.1 * (1.0 - self.delta) * x**2 + x + 1.0, torch.ones_like(x)


class GaussianToy:
    r"""Conjugate toy: :math:`\theta \sim N(0, I_D)`, :math:`x = \theta + N(0, s^2 I_D)`.

    The exact posterior is :math:`N(w x, w s^2 I)` with :math:`w = 1 / (1 + s^2)`
    (for ``s = 0.5``: :math:`N(0.8 x, 0.2 I)`). :meth:`posterior` returns it, or a
    deliberately wrong version of it.

    Arguments:
        dim: parameter and observation dimension ``D``.
        noise_std: observation noise ``s``.
        dtype: floating dtype of sampled tensors.

    Example:
        >>> toy = GaussianToy(dim=2, noise_std=0.5)
        >>> theta, x = toy.sample(10, torch.Generator().manual_seed(0))
        >>> toy.posterior(variance_scale=2.0)(x).variance[0]
        tensor([0.4000, 0.4000])
    """

    def __init__(
        self, dim: int = 2, noise_std: float = 0.5, dtype: torch.dtype = torch.float32
    ) -> None:
        self.dim, self.noise_std, self.dtype = dim, float(noise_std), dtype
        self.weight = 1.0 / (1.0 + self.noise_std**2)

    def sample(
        self, n: int, generator: torch.Generator | None = None
    ) -> tuple[Tensor, Tensor]:
        """Draw ``n`` pairs ``(theta, x)``, each of shape ``(n, D)``."""
        theta = torch.randn(n, self.dim, generator=generator, dtype=self.dtype)
        noise = torch.randn(n, self.dim, generator=generator, dtype=self.dtype)
        return theta, theta + self.noise_std * noise

    def posterior(
        self, variance_scale: float = 1.0, shift: float = 0.0
    ) -> _ToyPosterior:
        """The exact posterior, with its variance multiplied by ``variance_scale`` and
        its mean moved by ``shift`` in every coordinate (both no-ops by default)."""
        return _ToyPosterior(self.weight, self.weight * self.noise_std**2 * variance_scale, shift)


class _ToyPosterior:
    def __init__(self, weight: float, variance: float, shift: float) -> None:
        self.weight, self.std, self.shift = weight, math.sqrt(variance), shift

    def __call__(self, x: Tensor) -> Distribution:
        return _normal(self.weight * x + self.shift, self.std)
