r"""Toy simulators with known posteriors, for tests, benchmarks and examples.

Two families live here:

* the synthetic calibration models of Glaser et al. (2023, section 6): MGM, LGM,
  HGM and QGM, where a Gaussian predictive model :math:`P_{|x}` is calibrated for
  ``delta = 0`` and miscalibrated otherwise;
* the SBI benchmark tasks of the L-C2ST paper (sbibm definitions): :class:`TwoMoons`,
  :class:`SLCP`, :class:`GaussianLinearUniform`;
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
from collections.abc import Callable

import torch
from torch import Tensor
from torch.distributions import Distribution, Independent, MultivariateNormal, Normal

__all__ = [
    "HGM",
    "LGM",
    "MGM",
    "QGM",
    "SLCP",
    "CorrelatedGaussianToy",
    "GaussianLinearUniform",
    "GaussianToy",
    "SBITask",
    "SyntheticModel",
    "TwoMoons",
]


def _normal(loc: Tensor, scale: Tensor | float) -> Distribution:
    scale = torch.as_tensor(scale, dtype=loc.dtype, device=loc.device).expand_as(loc)
    return Independent(Normal(loc, scale), 1)


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

    def sample(
        self, n: int, generator: torch.Generator | None = None
    ) -> tuple[Tensor, Tensor]:
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


class SBITask:
    r"""A simulation-based inference benchmark task: a prior and a simulator in torch.

    Subclasses follow sbibm's definitions (Lueckmann et al. 2021) as used in the
    L-C2ST paper's benchmarks. ``sample(n)`` draws ``(theta, x)`` from the joint;
    :meth:`reference_posterior_samples` draws exact posterior samples where the
    posterior is tractable.
    """

    theta_dim: int
    x_dim: int

    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        self.dtype = dtype

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    @property
    def prior_bounds(self) -> tuple[float, float]:
        """Lower and upper bound of the box-uniform prior (same for every coordinate)."""
        raise NotImplementedError

    def prior(self) -> Distribution:
        """The prior as a torch distribution with event shape ``(D,)``."""
        low, high = self.prior_bounds
        zeros = torch.zeros(self.theta_dim, dtype=self.dtype)
        return Independent(torch.distributions.Uniform(zeros + low, zeros + high), 1)

    def sample_prior(self, n: int, generator: torch.Generator | None = None) -> Tensor:
        low, high = self.prior_bounds
        u = torch.rand(n, self.theta_dim, generator=generator, dtype=self.dtype)
        return low + (high - low) * u

    def simulate(self, theta: Tensor, generator: torch.Generator | None = None) -> Tensor:
        """Observations ``(N, X)`` for parameters ``(N, D)``."""
        raise NotImplementedError

    def sample(self, n: int, generator: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
        """Draw ``n`` pairs from the joint: ``theta (n, D)``, ``x (n, X)``."""
        theta = self.sample_prior(n, generator)
        return theta, self.simulate(theta, generator)

    def reference_posterior_samples(
        self, x: Tensor, num_samples: int, generator: torch.Generator | None = None
    ) -> Tensor:
        """Exact posterior samples ``(S, N, D)`` at observations ``x (N, X)``."""
        raise NotImplementedError(f"{type(self).__name__} has no tractable posterior")


class TwoMoons(SBITask):
    r"""Two Moons: :math:`\theta \sim U(-1, 1)^2`, :math:`a \sim U(-\pi/2, \pi/2)`,
    :math:`r \sim N(0.1, 0.01^2)`, :math:`p = (r \cos a + 0.25, r \sin a)`,
    :math:`x = p + (-|\theta_1 + \theta_2| / \sqrt 2, (\theta_2 - \theta_1) / \sqrt 2)`.

    The posterior is bimodal and crescent-shaped; exact samples come from inverting
    the simulator (the map from ``p`` to ``theta`` has unit Jacobian on each branch).
    """

    theta_dim, x_dim = 2, 2
    prior_bounds = (-1.0, 1.0)

    def _p(self, n: int, generator: torch.Generator | None) -> Tensor:
        a = math.pi * (torch.rand(n, generator=generator, dtype=self.dtype) - 0.5)
        r = 0.1 + 0.01 * torch.randn(n, generator=generator, dtype=self.dtype)
        return torch.stack([r * torch.cos(a) + 0.25, r * torch.sin(a)], -1)

    def simulate(self, theta: Tensor, generator: torch.Generator | None = None) -> Tensor:
        p = self._p(theta.shape[0], generator).to(theta.device)
        shift = torch.stack(
            [-(theta[:, 0] + theta[:, 1]).abs(), theta[:, 1] - theta[:, 0]], -1
        ) / math.sqrt(2.0)
        return p + shift

    def reference_posterior_samples(
        self, x: Tensor, num_samples: int, generator: torch.Generator | None = None
    ) -> Tensor:
        out = torch.empty(num_samples, x.shape[0], 2, dtype=self.dtype)
        for i in range(x.shape[0]):
            accepted: list[Tensor] = []
            total = 0
            while total < num_samples:
                p = self._p(4 * num_samples, generator)
                u = p - x[i].cpu().to(self.dtype)  # u = p - x = -shift
                total_sum = math.sqrt(2.0) * u[:, 0]  # |t1 + t2| = sqrt2 (p0 - x0)
                diff = -math.sqrt(2.0) * u[:, 1]  # t2 - t1
                sign = torch.randint(0, 2, (u.shape[0],), generator=generator) * 2 - 1
                s = sign.to(self.dtype) * total_sum
                theta = torch.stack([(s - diff) / 2, (s + diff) / 2], -1)
                ok = (total_sum >= 0) & (theta.abs() <= 1).all(-1)
                accepted.append(theta[ok])
                total += int(ok.sum())
            out[:, i] = torch.cat(accepted)[:num_samples]
        return out.to(x.device)


class SLCP(SBITask):
    r"""Simple likelihood, complex posterior: :math:`\theta \sim U(-3, 3)^5`; four i.i.d.
    2-D Gaussian draws with mean :math:`(\theta_1, \theta_2)`, scales
    :math:`\theta_3^2, \theta_4^2` and correlation :math:`\tanh \theta_5`, flattened to
    :math:`x \in R^8`. The posterior has four symmetric modes."""

    theta_dim, x_dim = 5, 8
    prior_bounds = (-3.0, 3.0)

    def simulate(self, theta: Tensor, generator: torch.Generator | None = None) -> Tensor:
        mean = theta[:, :2]
        s1, s2, rho = theta[:, 2] ** 2, theta[:, 3] ** 2, torch.tanh(theta[:, 4])
        eps = torch.randn(theta.shape[0], 4, 2, generator=generator, dtype=self.dtype)
        eps = eps.to(theta.device)
        # Cholesky factor of [[s1^2, rho s1 s2], [rho s1 s2, s2^2]]
        first = s1[:, None] * eps[..., 0]
        rho, root = rho[:, None], (1 - rho**2).sqrt()[:, None]
        second = s2[:, None] * (rho * eps[..., 0] + root * eps[..., 1])
        return (torch.stack([first, second], -1) + mean[:, None, :]).reshape(-1, 8)


class GaussianLinearUniform(SBITask):
    r"""Gaussian linear with a uniform prior: :math:`\theta \sim U(-1, 1)^{10}`,
    :math:`x \sim N(\theta, 0.1\, I)`. The posterior is :math:`N(x, 0.1\, I)` truncated to
    the prior box, sampled exactly by inverse CDF."""

    theta_dim, x_dim = 10, 10
    prior_bounds = (-1.0, 1.0)
    noise_var = 0.1

    def simulate(self, theta: Tensor, generator: torch.Generator | None = None) -> Tensor:
        eps = torch.randn(theta.shape, generator=generator, dtype=self.dtype).to(theta.device)
        return theta + math.sqrt(self.noise_var) * eps

    def reference_posterior_samples(
        self, x: Tensor, num_samples: int, generator: torch.Generator | None = None
    ) -> Tensor:
        std = math.sqrt(self.noise_var)
        normal = Normal(x.cpu().double(), std)
        low, high = normal.cdf(torch.tensor(-1.0)), normal.cdf(torch.tensor(1.0))
        u = torch.rand(num_samples, *x.shape, generator=generator, dtype=torch.float64)
        theta = normal.icdf(low + u * (high - low)).clamp(-1.0, 1.0)
        return theta.to(dtype=self.dtype, device=x.device)
