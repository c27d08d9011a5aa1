r"""Squared kernel calibration error (SKCE), the baseline the KCCSD is compared with.

.. math::
    \widehat{\mathrm{SKCE}} = \frac{1}{n(n-1)} \sum_{i \ne j} G_{ij}, \quad
    G_{ij} = k(P_i, P_j) \big[ l(y_i, y_j) - E_{z \sim P_i} l(z, y_j)
             - E_{z' \sim P_j} l(y_i, z') + E_{z \sim P_i, z' \sim P_j} l(z, z') \big]

with a Gaussian kernel :math:`l` on parameters. For diagonal Gaussian predictions the
expectations are closed-form (:func:`calib_lightning.kernels.gaussian_expected_kernel`);
otherwise they are Monte Carlo averages over model samples, paired across ``i`` and
``j`` so the estimate stays unbiased at ``O(n^2 S)`` cost. Kernels between
predictions: the exponentiated MMD (closed form for diagonal Gaussians, unbiased from
samples otherwise) and the exponentiated 2-Wasserstein distance between diagonal
Gaussians, :math:`W_2^2 = \|\mu - \mu'\|^2 + \|\sigma - \sigma'\|^2`. (The UAI paper
prints :math:`d(\sigma^2 - \sigma'^2)` for isotropic Gaussians; the Wasserstein
distance is :math:`d(\sigma - \sigma')^2`, which is what we use.)

The test reuses the wild bootstrap of :mod:`calib_lightning.functional.bootstrap`.

References:
    Widmann, Lindsten, Zachariah. "Calibration tests beyond classification." ICLR 2021.

    Glaser, Widmann, Lindsten, Gretton. "Fast and Scalable Score-Based Kernel
    Calibration Tests." UAI 2023 (eq. 3-4, section 6).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from calib_lightning._utils.validation import (
    check_choice,
    check_finite,
    check_points,
    check_positive,
    check_same_device_dtype,
)
from calib_lightning.functional.bootstrap import (
    bootstrap_p_value,
    u_statistic,
    wild_bootstrap,
)
from calib_lightning.kernels import (
    _pairwise_bandwidth,
    exponentiated,
    gaussian_expected_kernel,
    median_bandwidth,
    median_from_sq_distances,
    sq_distances,
)

__all__ = [
    "SKCETest",
    "gaussian_mmd_sq",
    "sample_mmd_sq",
    "skce_matrix_gaussian",
    "skce_matrix_samples",
    "skce_test",
    "wasserstein_sq_gaussian",
]

_PREDICTION_KERNELS = ("wasserstein", "mmd", None)


def _pairwise(a: Tensor) -> tuple[Tensor, Tensor]:
    """``(*, n, D)`` -> views ``(*, n, 1, D)`` and ``(*, 1, n, D)`` for all pairs."""
    return a.unsqueeze(-2), a.unsqueeze(-3)


def _zero_diagonal(matrix: Tensor) -> Tensor:
    eye = torch.eye(matrix.shape[-1], dtype=torch.bool, device=matrix.device)
    return matrix.masked_fill(eye, 0.0)


def wasserstein_sq_gaussian(mean: Tensor, var: Tensor) -> Tensor:
    r"""Squared 2-Wasserstein distances between diagonal Gaussians: ``(*, n, D)`` -> ``(*, n, n)``.

    .. math:: W_2^2 = \|\mu_i - \mu_j\|^2 + \|\sigma_i - \sigma_j\|^2
    """
    std = var.sqrt()
    return sq_distances(mean, mean) + sq_distances(std, std)


def gaussian_mmd_sq(mean: Tensor, var: Tensor, bandwidth: Tensor | float) -> Tensor:
    r"""Closed-form MMD^2 between diagonal Gaussians with an RBF kernel: ``(*, n, n)``."""
    bw = _pairwise_bandwidth(bandwidth, mean)
    mi, mj = _pairwise(mean)
    vi, vj = _pairwise(var)
    cross = gaussian_expected_kernel(mi, vi, mj, vj, bw)
    self_term = torch.diagonal(cross, dim1=-2, dim2=-1)
    return (self_term.unsqueeze(-1) + self_term.unsqueeze(-2) - 2.0 * cross).clamp_min(0.0)


def sample_mmd_sq(samples: Tensor, bandwidth: Tensor | float) -> Tensor:
    r"""Unbiased MMD^2 between all pairs of sample sets ``(*, n, S, D)`` -> ``(*, n, n)``.

    Cost ``O(n^2 S^2 D)``; ``S >= 2`` is needed for the within-set terms.
    """
    n, s = samples.shape[-3], samples.shape[-2]
    if s < 2:
        raise ValueError(f"samples must have S >= 2 draws per model, got S = {s}")
    flat = samples.flatten(-3, -2)
    gram = exponentiated(sq_distances(flat, flat), bandwidth)
    blocks = gram.unflatten(-1, (n, s)).unflatten(-3, (n, s))  # (*, n, S, n, S)
    cross = blocks.mean((-1, -3))
    within = torch.diagonal(blocks.sum((-1, -3)), dim1=-2, dim2=-1) - s  # drop l(z, z) = 1
    within = within / (s * (s - 1))
    return _zero_diagonal(within.unsqueeze(-1) + within.unsqueeze(-2) - 2.0 * cross)


def _prediction_kernel(sq: Tensor, bandwidth: Tensor | float | None) -> Tensor:
    if bandwidth is None:
        bandwidth = median_from_sq_distances(sq)
    return exponentiated(sq, bandwidth)


def skce_matrix_gaussian(
    theta: Tensor,
    mean: Tensor,
    var: Tensor,
    *,
    bandwidth: Tensor | float | None = None,
    distribution_kernel: str | None = "wasserstein",
    distribution_bandwidth: Tensor | float | None = None,
    mmd_bandwidth: Tensor | float | None = None,
) -> Tensor:
    r"""SKCE matrix :math:`G` (zero diagonal) for diagonal Gaussian predictions, in closed form.

    Arguments:
        theta: targets :math:`y_i`, ``(*, n, D)``.
        mean: prediction means, ``(*, n, D)``.
        var: prediction variances (diagonal), ``(*, n, D)``.
        bandwidth: RBF bandwidth of :math:`l`; ``None``: median heuristic on ``theta``.
        distribution_kernel: ``"wasserstein"``, ``"mmd"`` or ``None`` (:math:`k \equiv 1`).
        distribution_bandwidth: bandwidth of :math:`k`; ``None``: median heuristic.
        mmd_bandwidth: ground-kernel bandwidth of the MMD; ``None``: that of :math:`l`.

    Returns:
        ``(*, n, n)``.
    """
    check_choice("distribution_kernel", distribution_kernel, _PREDICTION_KERNELS)
    check_points("theta", theta, min_rows=2)
    for name, value in (("mean", mean), ("var", var)):
        check_finite(name, value)
        if value.shape != theta.shape:
            raise ValueError(
                f"{name} must have shape {tuple(theta.shape)}, got {tuple(value.shape)}"
            )
    check_same_device_dtype(theta=theta, mean=mean, var=var)
    if bool((var < 0).any()):
        raise ValueError(f"var must be non-negative, got minimum {float(var.min())}")
    if bandwidth is None:
        bandwidth = median_bandwidth(theta)
    bw = _pairwise_bandwidth(bandwidth, theta)
    yi, yj = _pairwise(theta)
    mi, mj = _pairwise(mean)
    vi, vj = _pairwise(var)
    zero = torch.zeros((), dtype=theta.dtype, device=theta.device)
    g = (
        gaussian_expected_kernel(yi, zero, yj, zero, bw)
        - gaussian_expected_kernel(mi, vi, yj, zero, bw)
        - gaussian_expected_kernel(yi, zero, mj, vj, bw)
        + gaussian_expected_kernel(mi, vi, mj, vj, bw)
    )
    if distribution_kernel == "wasserstein":
        g = g * _prediction_kernel(wasserstein_sq_gaussian(mean, var), distribution_bandwidth)
    elif distribution_kernel == "mmd":
        ground = bandwidth if mmd_bandwidth is None else mmd_bandwidth
        sq = gaussian_mmd_sq(mean, var, ground)
        g = g * _prediction_kernel(sq, distribution_bandwidth)
    return _zero_diagonal(g)


def skce_matrix_samples(
    theta: Tensor,
    samples: Tensor,
    *,
    bandwidth: Tensor | float | None = None,
    distribution_kernel: str | None = "mmd",
    distribution_bandwidth: Tensor | float | None = None,
    mmd_bandwidth: Tensor | float | None = None,
) -> Tensor:
    r"""SKCE matrix :math:`G` (zero diagonal) with expectations estimated from model samples.

    Arguments:
        theta: targets ``(*, n, D)``.
        samples: ``S`` draws from each prediction, ``(*, n, S, D)``.
        bandwidth: as in :func:`skce_matrix_gaussian`.
        distribution_kernel: as in :func:`skce_matrix_gaussian` (``"wasserstein"`` is not
            available).
        distribution_bandwidth: as in :func:`skce_matrix_gaussian`.
        mmd_bandwidth: as in :func:`skce_matrix_gaussian`.

    Returns:
        ``(*, n, n)``.
    """
    check_choice("distribution_kernel", distribution_kernel, ("mmd", None))
    check_points("theta", theta, min_rows=2)
    check_finite("samples", samples)
    if (
        samples.ndim != theta.ndim + 1
        or samples.shape[:-2] != theta.shape[:-1]
        or (samples.shape[-1] != theta.shape[-1])
    ):
        raise ValueError(
            f"samples must have shape (*, n, S, D) matching theta {tuple(theta.shape)}, "
            f"got {tuple(samples.shape)}"
        )
    check_same_device_dtype(theta=theta, samples=samples)
    if bandwidth is None:
        bandwidth = median_bandwidth(theta)
    s = samples.shape[-2]
    g = exponentiated(sq_distances(theta, theta), bandwidth)
    for k in range(s):
        z = samples[..., k, :]
        z_y = exponentiated(sq_distances(z, theta), bandwidth)
        g = g - z_y / s - z_y.transpose(-1, -2) / s
        g = g + exponentiated(sq_distances(z, z), bandwidth) / s
    if distribution_kernel == "mmd":
        ground = bandwidth if mmd_bandwidth is None else mmd_bandwidth
        sq = sample_mmd_sq(samples, ground).clamp_min(0.0)
        g = g * _prediction_kernel(sq, distribution_bandwidth)
    return _zero_diagonal(g)


class SKCETest(NamedTuple):
    """What :func:`skce_test` returns.

    Attributes:
        statistic: the SKCE U-statistic, ``(*)``.
        p_value: its wild-bootstrap p-value, ``(*)``.
    """

    statistic: Tensor
    p_value: Tensor


def skce_test(
    matrix: Tensor, num_null: int = 500, generator: torch.Generator | None = None
) -> SKCETest:
    r"""SKCE U-statistic and wild-bootstrap p-value from a :math:`G` matrix ``(*, n, n)``.

    Arguments:
        matrix: zero-diagonal :math:`G`, ``(*, n, n)``, ``n >= 2``.
        num_null: bootstrap replicates ``B``.
        generator: random generator for the multipliers.

    Returns:
        :class:`SKCETest`.
    """
    check_positive("num_null", num_null, integer=True)
    if matrix.ndim < 2 or matrix.shape[-1] != matrix.shape[-2] or matrix.shape[-1] < 2:
        raise ValueError(f"matrix must have shape (*, n, n) with n >= 2, got {tuple(matrix.shape)}")
    check_finite("matrix", matrix)
    statistic = u_statistic(matrix)
    draws = wild_bootstrap(matrix, num_null, generator)
    return SKCETest(statistic, bootstrap_p_value(statistic, draws))
