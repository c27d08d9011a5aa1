r"""Conjugate Gaussian toys with exact posteriors and knobs to miscalibrate them.

:class:`GaussianToy`: :math:`\theta \sim N(0, I)`, :math:`x = \theta + N(0, s^2 I)`;
:class:`CorrelatedGaussianToy`: the same with a correlated two-parameter prior.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor
from torch.distributions import Distribution, MultivariateNormal

from calib_lightning.tasks._common import normal

__all__ = ["CorrelatedGaussianToy", "GaussianToy"]


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

    def sample(self, n: int, generator: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
        """Draw ``n`` pairs ``(theta, x)``, each of shape ``(n, D)``."""
        theta = torch.randn(n, self.dim, generator=generator, dtype=self.dtype)
        noise = torch.randn(n, self.dim, generator=generator, dtype=self.dtype)
        return theta, theta + self.noise_std * noise

    def prior(self) -> Distribution:
        """The prior :math:`N(0, I_D)`, event shape ``(D,)``."""
        return normal(torch.zeros(self.dim, dtype=self.dtype), 1.0)

    def posterior(self, variance_scale: float = 1.0, shift: float = 0.0) -> _ToyPosterior:
        """The exact posterior, with its variance multiplied by ``variance_scale`` and
        its mean moved by ``shift`` in every coordinate (both no-ops by default)."""
        return _ToyPosterior(self.weight, self.weight * self.noise_std**2 * variance_scale, shift)


class _ToyPosterior:
    def __init__(self, weight: float, variance: float, shift: float) -> None:
        self.weight, self.std, self.shift = weight, math.sqrt(variance), shift

    def __call__(self, x: Tensor) -> Distribution:
        return normal(self.weight * x + self.shift, self.std)


class CorrelatedGaussianToy:
    r"""Two parameters with correlated prior: :math:`\theta \sim N(0, \Sigma)`,
    :math:`\Sigma = [[1, \rho], [\rho, 1]]`, :math:`x = \theta + N(0, s^2 I_2)`.

    The exact posterior is :math:`N(C x / s^2, C)` with
    :math:`C = (\Sigma^{-1} + I / s^2)^{-1}`, correlated. :meth:`posterior` can keep
    its marginals exactly and change only the correlation: marginal ranks stay
    uniform, only a joint check can notice.

    Arguments:
        correlation: prior correlation :math:`\rho`, in ``(-1, 1)``.
        noise_std: observation noise ``s``.
        dtype: floating dtype of sampled tensors.

    Example:
        >>> toy = CorrelatedGaussianToy(correlation=0.8)
        >>> round(toy.posterior_correlation, 3)
        0.328
        >>> toy.posterior(correlation=0.0)(torch.zeros(1, 2)).covariance_matrix[0, 0, 1]
        tensor(0.)
    """

    dim = 2

    def __init__(
        self, correlation: float = 0.8, noise_std: float = 0.5, dtype: torch.dtype = torch.float32
    ) -> None:
        if not -1 < correlation < 1:
            raise ValueError(f"correlation must lie in (-1, 1), got {correlation!r}")
        self.correlation, self.noise_std, self.dtype = float(correlation), float(noise_std), dtype
        prior = torch.tensor([[1.0, correlation], [correlation, 1.0]], dtype=torch.float64)
        self.prior_tril = torch.linalg.cholesky(prior)
        self.covariance = torch.linalg.inv(
            torch.linalg.inv(prior) + torch.eye(2, dtype=torch.float64) / self.noise_std**2
        )
        cov = self.covariance
        self.posterior_correlation = float(cov[0, 1] / (cov[0, 0] * cov[1, 1]).sqrt())

    def sample(self, n: int, generator: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
        """Draw ``n`` pairs ``(theta, x)``, each of shape ``(n, 2)``."""
        eps = torch.randn(n, 2, generator=generator, dtype=torch.float64)
        theta = eps @ self.prior_tril.T
        noise = torch.randn(n, 2, generator=generator, dtype=torch.float64)
        return theta.to(self.dtype), (theta + self.noise_std * noise).to(self.dtype)

    def posterior(self, correlation: float | None = None) -> Callable[[Tensor], Distribution]:
        """The exact posterior, or one with the same marginals and posterior correlation
        ``correlation`` (``None``: the true one)."""
        cov = self.covariance.clone()
        if correlation is not None:
            if not -1 < correlation < 1:
                raise ValueError(f"correlation must lie in (-1, 1), got {correlation!r}")
            cov[0, 1] = cov[1, 0] = correlation * (cov[0, 0] * cov[1, 1]).sqrt()
        gain = self.covariance / self.noise_std**2  # posterior mean = gain @ x
        tril = torch.linalg.cholesky(cov)

        def model(x: Tensor) -> Distribution:
            loc = x @ gain.to(x.dtype).T
            return MultivariateNormal(loc, scale_tril=tril.to(x.dtype))  # shared, not expanded

        return model
