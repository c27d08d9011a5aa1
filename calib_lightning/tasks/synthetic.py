"""The synthetic calibration models of Glaser et al. (2023, section 6).

A Gaussian predictive model :math:`P_{|x}` is calibrated for ``delta = 0`` and
miscalibrated otherwise: MGM (mean), LGM (linear), HGM (heteroscedastic), QGM (quadratic).

References:
    Glaser, Widmann, Lindsten, Gretton. "Fast and Scalable Score-Based Kernel
    Calibration Tests." UAI 2023.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.distributions import Distribution

from calib_lightning.tasks._common import normal

__all__ = ["HGM", "LGM", "MGM", "QGM", "SyntheticModel"]


class SyntheticModel:
    r"""A joint :math:`P(X)\,P(Y \mid X)` with a Gaussian predictive model :math:`P_{|x}`.

    Subclasses define :meth:`true_mean_scale` and
    :meth:`model_mean_scale` (diagonal Gaussians), and :meth:`sample_x` when the
    covariates are not standard normal. ``model(x)`` is the predictive
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
        """``n`` covariates ``(n, X)``; standard normal unless a model says otherwise."""
        return torch.randn(n, self.x_dim, generator=generator, dtype=self.dtype)

    def true_mean_scale(self, x: Tensor) -> tuple[Tensor, Tensor]:
        raise NotImplementedError

    def model_mean_scale(self, x: Tensor) -> tuple[Tensor, Tensor]:
        raise NotImplementedError

    def sample(self, n: int, generator: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
        """Draw ``n`` pairs: ``theta`` of shape ``(n, D)`` and ``x`` of shape ``(n, X)``."""
        x = self.sample_x(n, generator)
        mean, scale = self.true_mean_scale(x)
        noise = torch.randn(mean.shape, generator=generator, dtype=self.dtype)
        return mean + scale * noise, x

    def __call__(self, x: Tensor) -> Distribution:
        mean, scale = self.model_mean_scale(x)
        return normal(mean, scale)


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
