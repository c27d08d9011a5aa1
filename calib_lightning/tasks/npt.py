r"""The perturbation suite of neural posterior testing (Chen, Bansal and Scott 2024).

A Gaussian truth whose mean and covariance both depend on ``x``: with a correlated
prior :math:`\theta \sim N(\mathbf 1, \Sigma_0)`, :math:`(\Sigma_0)_{ij} = 0.6^{|i-j|}`,
a noise scale :math:`s \sim U(0.5, 1.5)^D` drawn per pair and observed, and
:math:`x_1 = \theta + s \odot \epsilon`, the observation is :math:`x = (x_1, \log s)`
(``2 D`` features) and the exact posterior is

.. math::
    p(\theta \mid x) = N(\mu_x, \Sigma_x), \qquad
    \Sigma_x = (\Sigma_0^{-1} + \mathrm{diag}(s)^{-2})^{-1}, \qquad
    \mu_x = \Sigma_x (\Sigma_0^{-1} \mathbf 1 + x_1 / s^2),

whose eigenvectors turn with ``s``. Each failure mode is a pair (truth, estimate)
indexed by a strength :math:`\gamma \ge 0`; :math:`\gamma = 0` gives the exact
posterior:

* ``"mean_shift"``: :math:`q = N((1 + \gamma) \mu_x, \Sigma_x)`;
* ``"covariance"``: :math:`q = N(\mu_x, (1 + \gamma) \Sigma_x)` (inflation);
* ``"anisotropic"``: :math:`q = N(\mu_x, \Sigma_x + \gamma v v^\top)`, ``v`` the
  eigenvector of :math:`\Sigma_x` with the smallest eigenvalue;
* ``"heavy_tails"``: :math:`q = t_\nu(\mu_x, \Sigma_x)` with :math:`\nu = 1 / \gamma`
  (scale matrix :math:`\Sigma_x`), a :class:`MultivariateT`;
* ``"extra_mode"``: :math:`q = (1 - \gamma) N(\mu_x, \Sigma_x) + \gamma N(-\mu_x, \Sigma_x)`;
* ``"mode_collapse"``: the truth is that mixture and :math:`q = N(\mu_x, \Sigma_x)`;
* ``"blind_prior"``: :math:`q(\theta \mid x) = p(\theta)` whatever ``x`` (calibrated and
  useless; the strength is ignored).

Every estimate is a torch ``Distribution`` with ``sample`` and a ``log_prob`` that has a
gradient in theta, so every check of the package applies; the Gaussian ones and the
multivariate t also map theta to a standard normal latent (the mixtures do not).

References:
    Chen, Bansal, Scott. "From NPE to NPT: a benchmark suite for neural posterior
    testing." 2024 (NPTBench).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import ClassVar

import numpy as np
import torch
from scipy import special
from torch import Tensor
from torch.distributions import (
    Categorical,
    Distribution,
    MixtureSameFamily,
    MultivariateNormal,
    constraints,
)

from calib_lightning.tasks._common import normal

__all__ = ["NPT_MODES", "MultivariateT", "NPTGaussian"]

#: the failure modes, in the order of the benchmark's figure
NPT_MODES = (
    "mean_shift",
    "covariance",
    "anisotropic",
    "heavy_tails",
    "extra_mode",
    "mode_collapse",
    "blind_prior",
)


class _RadialToNormal:
    r"""``theta -> z``: whitens by the scale matrix, then maps the radius so that a
    multivariate t's :math:`r^2 / (r^2 + \nu) \sim \mathrm{Beta}(D/2, \nu/2)` becomes a
    :math:`\chi_D` radius (probability integral transform, in float64 with scipy)."""

    def __init__(self, loc: Tensor, scale_tril: Tensor, df: float) -> None:
        self.loc, self.scale_tril, self.df = loc, scale_tril, df

    def __call__(self, theta: Tensor) -> Tensor:
        diff = (theta - self.loc).unsqueeze(-1)
        tril = self.scale_tril.expand(diff.shape[:-2] + self.scale_tril.shape[-2:])
        u = torch.linalg.solve_triangular(tril, diff, upper=False).squeeze(-1)
        dim = u.shape[-1]
        r2 = u.detach().double().square().sum(-1).cpu().numpy()
        # upper tail probability of the radius, then the chi-square radius with that tail
        upper = special.betainc(self.df / 2, dim / 2, self.df / (r2 + self.df))
        chi2 = 2.0 * special.gammainccinv(dim / 2, np.clip(upper, 1e-300, 1.0))
        ratio = np.sqrt(chi2 / np.maximum(r2, 1e-300))
        return u * torch.as_tensor(ratio, dtype=u.dtype, device=u.device).unsqueeze(-1)


class MultivariateT(Distribution):
    r"""Multivariate Student t, :math:`\theta = \mu + L z / \sqrt{w / \nu}`,
    :math:`z \sim N(0, I_D)`, :math:`w \sim \chi^2_\nu`.

    ``log_prob`` is the closed form (differentiable in theta); ``transform`` and ``base``
    map theta to a standard normal latent through the radius (see the module), which is
    how the package's latent checks read it.

    Arguments:
        loc: :math:`\mu`, ``(*, D)``.
        scale_tril: lower Cholesky factor ``L`` of the scale matrix, ``(*, D, D)``.
        df: degrees of freedom :math:`\nu > 0`.

    Example:
        >>> t = MultivariateT(torch.zeros(4, 2), torch.eye(2).expand(4, 2, 2), df=5.0)
        >>> t.sample((3,)).shape, t.log_prob(torch.zeros(4, 2)).shape
        (torch.Size([3, 4, 2]), torch.Size([4]))
        >>> t.base.log_prob(t.transform(torch.zeros(4, 2))).shape  # the latent's density
        torch.Size([4])
    """

    arg_constraints: ClassVar[dict[str, constraints.Constraint]] = {
        "loc": constraints.real_vector,
        "scale_tril": constraints.lower_cholesky,
    }
    support = constraints.real_vector
    has_rsample = False

    def __init__(self, loc: Tensor, scale_tril: Tensor, df: float) -> None:
        if not df > 0:
            raise ValueError(f"df must be positive, got {df!r}")
        self.loc, self.scale_tril, self.df = loc, scale_tril, float(df)
        super().__init__(loc.shape[:-1], loc.shape[-1:], validate_args=False)
        self.transform = _RadialToNormal(loc, scale_tril, self.df)
        self.base = normal(torch.zeros_like(loc), 1.0)

    def sample(self, sample_shape: torch.Size | tuple[int, ...] = ()) -> Tensor:
        shape = torch.Size(sample_shape) + self.loc.shape
        with torch.no_grad():
            z = torch.randn(shape, dtype=self.loc.dtype, device=self.loc.device)
            half = torch.full(shape[:-1], self.df / 2, dtype=self.loc.dtype, device=z.device)
            w = torch.distributions.Gamma(half, 0.5).sample()
            step = (self.scale_tril @ z.unsqueeze(-1)).squeeze(-1)
            return self.loc + step / (w / self.df).sqrt().unsqueeze(-1)

    def log_prob(self, value: Tensor) -> Tensor:
        diff = (value - self.loc).unsqueeze(-1)
        tril = self.scale_tril.expand(diff.shape[:-2] + self.scale_tril.shape[-2:])
        u = torch.linalg.solve_triangular(tril, diff, upper=False).squeeze(-1)
        dim, nu = u.shape[-1], self.df
        log_det = self.scale_tril.diagonal(dim1=-2, dim2=-1).log().sum(-1)
        const = math.lgamma((nu + dim) / 2) - math.lgamma(nu / 2) - dim / 2 * math.log(nu * math.pi)
        return const - log_det - (nu + dim) / 2 * torch.log1p(u.square().sum(-1) / nu)


class NPTGaussian:
    r"""The Gaussian problem of the NPT suite and its failure modes (module docstring).

    Arguments:
        dim: parameter dimension ``D`` (``x`` has ``2 D`` features).
        dtype: floating dtype of sampled tensors and of the distributions.

    Example:
        >>> task = NPTGaussian(dim=3)
        >>> truth, estimate = task.case("covariance", 0.5)
        >>> theta, x = task.sample(100, truth, torch.Generator().manual_seed(0))
        >>> theta.shape, x.shape
        (torch.Size([100, 3]), torch.Size([100, 6]))
        >>> ratio = estimate(x).covariance_matrix / truth(x).covariance_matrix
        >>> float(ratio.mean())
        1.5
    """

    correlation = 0.6
    noise_range = (0.5, 1.5)

    def __init__(self, dim: int = 3, dtype: torch.dtype = torch.float32) -> None:
        if not isinstance(dim, int) or dim < 1:
            raise ValueError(f"dim must be a positive integer, got {dim!r}")
        self.dim, self.dtype = dim, dtype
        index = torch.arange(dim, dtype=torch.float64)
        self.prior_covariance = self.correlation ** (index[:, None] - index).abs()
        self.prior_tril = torch.linalg.cholesky(self.prior_covariance)
        self.prior_precision = torch.cholesky_inverse(self.prior_tril)

    def __repr__(self) -> str:
        return f"NPTGaussian(dim={self.dim})"

    def prior(self) -> Distribution:
        r"""The prior :math:`N(\mathbf 1, \Sigma_0)`, event shape ``(D,)``."""
        return MultivariateNormal(
            torch.ones(self.dim, dtype=self.dtype), scale_tril=self.prior_tril.to(self.dtype)
        )

    def sample_x(self, n: int, generator: torch.Generator | None = None) -> Tensor:
        """``n`` observations ``(n, 2 D)`` from their marginal (theta from the prior)."""
        eps = torch.randn(3, n, self.dim, generator=generator, dtype=torch.float64)
        theta = 1.0 + eps[0] @ self.prior_tril.T
        low, high = self.noise_range
        s = low + (high - low) * torch.rand(n, self.dim, generator=generator, dtype=torch.float64)
        return torch.cat([theta + s * eps[1], s.log()], -1).to(self.dtype)

    def moments(self, x: Tensor) -> tuple[Tensor, Tensor]:
        r"""Exact posterior mean ``(N, D)`` and covariance ``(N, D, D)``, float64."""
        if x.ndim != 2 or x.shape[-1] != 2 * self.dim:
            raise ValueError(f"x must have shape (N, {2 * self.dim}), got {tuple(x.shape)}")
        x = x.double()
        data, noise_precision = x[:, : self.dim], torch.exp(-2.0 * x[:, self.dim :])
        precision = self.prior_precision + torch.diag_embed(noise_precision)
        covariance = torch.cholesky_inverse(torch.linalg.cholesky(precision))
        target = self.prior_precision.sum(-1) + data * noise_precision
        return (covariance @ target.unsqueeze(-1)).squeeze(-1), covariance

    def sample(
        self,
        n: int,
        truth: Callable[[Tensor], Distribution],
        generator: torch.Generator | None = None,
    ) -> tuple[Tensor, Tensor]:
        """``n`` pairs: ``x (n, 2 D)`` from its marginal, then ``theta ~ truth(x)``, ``(n, D)``.

        Uses ``generator`` for ``x`` and torch's global generator for ``theta`` (the
        distributions' ``sample``), seeded from ``generator`` when one is given.
        """
        x = self.sample_x(n, generator)
        if generator is not None:
            seed = int(torch.randint(2**62, (), generator=generator))
            with torch.random.fork_rng():
                torch.manual_seed(seed)
                theta = truth(x).sample()
        else:
            theta = truth(x).sample()
        return theta.to(self.dtype), x

    def case(
        self, mode: str, strength: float = 0.0
    ) -> tuple[Callable[[Tensor], Distribution], Callable[[Tensor], Distribution]]:
        """``(truth, estimate)``: callables ``x (N, 2 D) -> Distribution`` (batch ``(N,)``,
        event ``(D,)``) for a failure mode of :data:`NPT_MODES` at ``strength``."""
        if mode not in NPT_MODES:
            raise ValueError(f"mode must be one of {NPT_MODES}, got {mode!r}")
        if not (isinstance(strength, int | float) and math.isfinite(strength) and strength >= 0):
            raise ValueError(f"strength must be a finite number >= 0, got {strength!r}")
        if mode in ("extra_mode", "mode_collapse") and strength > 1:
            raise ValueError(f"strength is a mixture weight for {mode}: at most 1, got {strength}")
        gamma = float(strength)
        exact = self._gaussian()
        if mode == "mode_collapse":
            return self._mixture(gamma), exact
        if mode == "blind_prior":
            return exact, self._blind_prior
        if gamma == 0:
            return exact, exact
        if mode == "mean_shift":
            return exact, self._gaussian(mean_factor=1.0 + gamma)
        if mode == "covariance":
            return exact, self._gaussian(covariance_factor=1.0 + gamma)
        if mode == "anisotropic":
            return exact, self._gaussian(anisotropic=gamma)
        if mode == "heavy_tails":
            return exact, self._student(1.0 / gamma)
        return exact, self._mixture(gamma)

    def _gaussian(
        self, mean_factor: float = 1.0, covariance_factor: float = 1.0, anisotropic: float = 0.0
    ) -> Callable[[Tensor], Distribution]:
        def posterior(x: Tensor) -> Distribution:
            mean, cov = self.moments(x)
            if anisotropic:
                v = torch.linalg.eigh(cov).eigenvectors[..., :, 0]  # smallest eigenvalue
                cov = cov + anisotropic * v.unsqueeze(-1) * v.unsqueeze(-2)
            tril = torch.linalg.cholesky(covariance_factor * cov)
            return MultivariateNormal((mean_factor * mean).to(x.dtype), scale_tril=tril.to(x.dtype))

        return posterior

    def _student(self, df: float) -> Callable[[Tensor], Distribution]:
        def posterior(x: Tensor) -> Distribution:
            mean, cov = self.moments(x)
            return MultivariateT(mean.to(x.dtype), torch.linalg.cholesky(cov).to(x.dtype), df)

        return posterior

    def _mixture(self, weight: float) -> Callable[[Tensor], Distribution]:
        if weight == 0:
            return self._gaussian()

        def posterior(x: Tensor) -> Distribution:
            mean, cov = self.moments(x)
            tril = torch.linalg.cholesky(cov).to(x.dtype)
            loc = torch.stack([mean, -mean], -2).to(x.dtype)  # (N, 2, D)
            probs = torch.tensor([1.0 - weight, weight], dtype=x.dtype).expand(x.shape[0], 2)
            components = MultivariateNormal(
                loc, scale_tril=tril.unsqueeze(-3).expand(-1, 2, -1, -1)
            )
            return MixtureSameFamily(Categorical(probs=probs), components)

        return posterior

    def _blind_prior(self, x: Tensor) -> Distribution:
        loc = torch.ones(x.shape[0], self.dim, dtype=x.dtype)
        return MultivariateNormal(loc, scale_tril=self.prior_tril.to(x.dtype))
