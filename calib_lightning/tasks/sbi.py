"""SBI benchmark tasks of the L-C2ST paper (sbibm definitions), written in torch.

References:
    Lueckmann, Boelts, Greenberg, Goncalves, Macke. "Benchmarking Simulation-Based
    Inference." AISTATS 2021.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor
from torch.distributions import Distribution, Independent, Normal

__all__ = ["SLCP", "GaussianLinearUniform", "SBITask", "TwoMoons"]


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
    r"""Gaussian linear with a uniform prior: :math:`\theta \sim U(-1, 1)^{D}`,
    :math:`x \sim N(\theta, 0.1\, I)`. The posterior is :math:`N(x, 0.1\, I)` truncated to
    the prior box, sampled exactly by inverse CDF; its log-likelihood is
    :meth:`log_likelihood`.

    Arguments:
        dim: ``D``, 10 in sbibm (the default).
        dtype: floating dtype of sampled tensors.
    """

    prior_bounds = (-1.0, 1.0)
    noise_var = 0.1

    def __init__(self, dim: int = 10, dtype: torch.dtype = torch.float32) -> None:
        super().__init__(dtype)
        if isinstance(dim, bool) or not isinstance(dim, int) or dim < 1:
            raise ValueError(f"dim must be an integer >= 1, got {dim!r}")
        self.theta_dim = self.x_dim = dim

    def __repr__(self) -> str:
        return f"{type(self).__name__}(dim={self.theta_dim})"

    def log_likelihood(self, theta: Tensor, x: Tensor) -> Tensor:
        r""":math:`\log p(x \mid \theta)` at pairs ``theta (M, D)``, ``x (M, D)``: ``(M,)``."""
        var, d = self.noise_var, theta.shape[-1]
        return -0.5 * (((x - theta) ** 2).sum(-1) / var + d * math.log(2 * math.pi * var))

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
