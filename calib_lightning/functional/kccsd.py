r"""Kernel calibration-conditional Stein discrepancy (KCCSD) and its wild-bootstrap test.

For pairs :math:`(P_i = q(\cdot \mid x_i), y_i = \theta^*_i)`, :math:`i = 1..n`:

.. math::
    \hat C = \frac{1}{n (n-1)} \sum_{i \ne j} H_{ij}, \qquad H_{ij} = k(P_i, P_j)\, h_{ij}

with :math:`h` the Stein kernel (:func:`calib_lightning.kernels.stein_kernel`) and
:math:`k` an exponentiated GFD/KGFD kernel between the models, computed from their
scores at base points shared by all pairs. Under calibration :math:`\hat C` is a
degenerate U-statistic with mean zero; the wild bootstrap
:math:`C_b = w_b^\top H w_b / (n (n-1))`, :math:`w_b` Rademacher, approximates its null
distribution and :math:`p = (1 + \#\{C_b \ge \hat C\}) / (1 + B)`
(:mod:`calib_lightning.functional.bootstrap`).

The functions here take tensors only: the scores :math:`s_i(y_i)` ``(*, N, D)`` and
:math:`s_i(z_k)` ``(*, N, m, D)`` come from the model-evaluation layer
(:func:`calib_lightning.evaluation.pair_and_base_scores`), or from the metric
:class:`calib_lightning.KCCSD`, which evaluates a posterior and calls :func:`kccsd`.
All take optional leading batch dimensions ``(*)`` so that many datasets are tested
in one call.

References:
    Glaser, Widmann, Lindsten, Gretton. "Fast and Scalable Score-Based Kernel
    Calibration Tests." UAI 2023.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from calib_lightning._utils.validation import (
    check_choice,
    check_finite,
    check_matrix,
    check_points,
    check_positive,
    check_same_device_dtype,
)
from calib_lightning.functional._moments import moments, split_moments, std_from_moments
from calib_lightning.functional.bootstrap import (
    SymmetricBlocks,
    bootstrap_p_value,
    wild_bootstrap,
)
from calib_lightning.kernels import (
    DISTRIBUTION_KERNELS,
    KERNELS,
    _evenly_spaced,
    _pairwise_bandwidth,
    embedding_sq_distances,
    median_bandwidth,
    median_from_sq_distances,
    score_embedding,
    stein_kernel_terms,
)

__all__ = ["KCCSDTest", "base_points_from_moments", "gaussian_base_points", "kccsd", "kccsd_matrix"]

_MEDIAN_POINTS = 512  # the median of 130k pairwise distances is plenty


def gaussian_base_points(
    theta: Tensor, num_points: int, generator: torch.Generator | None = None
) -> Tensor:
    r"""Base points :math:`z_k \sim N(\bar\theta, \mathrm{diag}(s_\theta^2))` fitted to ``theta``.

    The base measure of the GFD must cover the posteriors' support; a standard
    normal in raw parameter units does not when parameters live on other scales.

    Arguments:
        theta: calibration parameters ``(N, D)``, ``N >= 2``.
        num_points: ``m``.
        generator: random generator (on the CPU).

    Returns:
        ``(m, D)`` base points on ``theta``'s device and dtype.
    """
    check_matrix("theta", theta, min_rows=2)
    check_positive("num_points", num_points, integer=True)
    points = base_points_from_moments(moments(theta), num_points, generator, theta.dtype)
    return points.to(theta)


def base_points_from_moments(
    state: Tensor,
    num_points: int,
    generator: torch.Generator | None = None,
    dtype: torch.dtype = torch.float64,
) -> Tensor:
    r"""Base points :math:`z_k = \bar\theta + s_\theta \varepsilon_k`,
    :math:`\varepsilon_k \sim N(0, I)`, from a diagonal moment state ``(1 + 2 D,)`` of the
    calibration parameters (:mod:`calib_lightning.functional._moments`); zero deviations (also of
    a single point) become 1.

    The normal draws are made in ``dtype`` (on the CPU, with ``generator``).

    Returns:
        ``(m, D)`` in float64 on the state's device.
    """
    check_positive("num_points", num_points, integer=True)
    mean, std = split_moments(state)[1], std_from_moments(state)
    eps = torch.randn(num_points, mean.shape[-1], generator=generator, dtype=dtype)
    return mean + std * eps.to(mean)


def _validate(
    theta: Tensor,
    score: Tensor,
    base_scores: Tensor | None,
    base_points: Tensor | None,
    kernel: str,
    dist_kernel: str | None,
    bandwidths: dict[str, float | Tensor | None],
) -> None:
    check_choice("kernel", kernel, KERNELS)
    check_choice("distribution_kernel", dist_kernel, (*DISTRIBUTION_KERNELS, None))
    check_points("theta", theta, min_rows=2)
    if score.shape != theta.shape:
        raise ValueError(
            f"score must have the shape of theta {tuple(theta.shape)}, got {tuple(score.shape)}"
        )
    check_finite("score", score)
    check_same_device_dtype(theta=theta, score=score, base_scores=base_scores)
    if base_scores is not None:
        expected = (*theta.shape[:-1], base_scores.shape[-2], theta.shape[-1])
        if base_scores.ndim != theta.ndim + 1 or tuple(base_scores.shape) != expected:
            raise ValueError(
                f"base_scores must have shape (*, N, m, D) = {expected}, "
                f"got {tuple(base_scores.shape)}"
            )
        check_finite("base_scores", base_scores)
        if dist_kernel == "kgfd" and base_points is not None:
            check_matrix("base_points", base_points, columns=theta.shape[-1])
            if base_points.shape[0] != base_scores.shape[-2]:
                raise ValueError(
                    f"base_points must have shape (m, D) with m = {base_scores.shape[-2]} "
                    f"(the base points of base_scores), got {tuple(base_points.shape)}"
                )
            check_same_device_dtype(theta=theta, base_points=base_points)
    elif dist_kernel is not None:
        raise ValueError(
            f"base_scores must be given for distribution_kernel={dist_kernel!r}, got None"
        )
    for name, value in bandwidths.items():
        if value is not None and not isinstance(value, Tensor):
            check_positive(name, value)


class _Setup:
    """Bandwidths and score embeddings shared by every block of H."""

    def __init__(
        self,
        theta: Tensor,
        score: Tensor,
        base_scores: Tensor | None,
        base_points: Tensor | None,
        kernel: str,
        bandwidth: float | Tensor | None,
        distribution_kernel: str | None,
        distribution_bandwidth: float | Tensor | None,
        base_bandwidth: float | Tensor | None,
    ) -> None:
        _validate(
            theta,
            score,
            base_scores,
            base_points,
            kernel,
            distribution_kernel,
            {
                "bandwidth": bandwidth,
                "distribution_bandwidth": distribution_bandwidth,
                "base_bandwidth": base_bandwidth,
            },
        )
        self.theta, self.score, self.kernel = theta, score, kernel
        self.bandwidth = median_bandwidth(theta, _MEDIAN_POINTS) if bandwidth is None else bandwidth
        self.left = self.right = None
        self.distribution_bandwidth = distribution_bandwidth
        if distribution_kernel is not None:
            # float64 where float32's squared score differences overflow (score_embedding)
            self.left, self.right = score_embedding(
                base_scores, distribution_kernel, base_points, base_bandwidth
            )
            if distribution_bandwidth is None:
                index = _evenly_spaced(theta.shape[-2], _MEDIAN_POINTS, theta.device)
                left, right = self.left.index_select(-2, index), self.right.index_select(-2, index)
                self.distribution_bandwidth = median_from_sq_distances(
                    embedding_sq_distances(left.detach(), right.detach())
                )

    def block(self, rows: slice, cols: slice) -> Tensor:
        """The block ``H[rows, cols]``; entries with ``i == j`` are set to zero."""
        theta, score = self.theta, self.score
        log_k, bracket = stein_kernel_terms(
            theta[..., rows, :],
            score[..., rows, :],
            theta[..., cols, :],
            score[..., cols, :],
            self.kernel,
            self.bandwidth,
        )
        if self.left is not None:  # k(P_i, P_j) l(y_i, y_j) in one exp
            sq = embedding_sq_distances(self.left, self.right, rows, cols)
            sigma = _pairwise_bandwidth(self.distribution_bandwidth, sq)
            log_k = log_k - (sq / (2.0 * sigma**2)).to(log_k.dtype)
        h = torch.exp(log_k) * bracket
        first, last = max(rows.start, cols.start), min(rows.stop, cols.stop)
        if first < last:  # the block holds part of the diagonal
            index = torch.arange(first, last, device=h.device)
            diagonal = torch.zeros(h.shape[-2:], dtype=torch.bool, device=h.device)
            diagonal[index - rows.start, index - cols.start] = True
            h = h.masked_fill(diagonal, 0.0)
        return h


def kccsd_matrix(
    theta: Tensor,
    score: Tensor,
    base_scores: Tensor | None = None,
    base_points: Tensor | None = None,
    *,
    kernel: str = "rbf",
    bandwidth: float | Tensor | None = None,
    distribution_kernel: str | None = "gfd",
    distribution_bandwidth: float | Tensor | None = None,
    base_bandwidth: float | Tensor | None = None,
) -> Tensor:
    r"""The matrix :math:`H_{ij} = k(P_i, P_j)\, h_{ij}` with a zero diagonal.

    Arguments:
        theta: true parameters :math:`y_i`, ``(*, N, D)``.
        score: model scores at them :math:`s_i(y_i)`, ``(*, N, D)``.
        base_scores: model scores at shared base points, ``(*, N, m, D)``; needed unless
            ``distribution_kernel`` is ``None``.
        base_points: the base points ``(m, D)`` (needed for ``"kgfd"``).
        kernel: ``"rbf"`` or ``"imq"`` kernel :math:`l` on parameters.
        bandwidth: :math:`\ell`; ``None``: median heuristic on ``theta``.
        distribution_kernel: ``"gfd"``, ``"kgfd"`` or ``None`` (:math:`k \equiv 1`).
        distribution_bandwidth: :math:`\sigma`; ``None``: median heuristic on the divergences.
        base_bandwidth: bandwidth of the KGFD's kernel on base points.

    Returns:
        ``(*, N, N)``.
    """
    setup = _Setup(
        theta,
        score,
        base_scores,
        base_points,
        kernel,
        bandwidth,
        distribution_kernel,
        distribution_bandwidth,
        base_bandwidth,
    )
    everything = slice(0, theta.shape[-2])
    return setup.block(everything, everything)


class KCCSDTest(NamedTuple):
    r"""What :func:`kccsd` returns; shapes ``(*)`` are the batch dimensions of ``theta``.

    Attributes:
        statistic: the U-statistic :math:`\hat C`, ``(*)``, with the autograd graph of
            ``score`` and ``base_scores``.
        p_value: wild-bootstrap p-value of :math:`H_0`: calibrated, ``(*)`` (NaN when
            ``num_null = 0``).
        bandwidth: :math:`\ell` of the kernel on parameters, ``()`` or ``(*)``.
        distribution_bandwidth: :math:`\sigma` of the kernel between models, ``()`` or
            ``(*)``; NaN without a distribution kernel.
    """

    statistic: Tensor
    p_value: Tensor
    bandwidth: Tensor
    distribution_bandwidth: Tensor


def kccsd(
    theta: Tensor,
    score: Tensor,
    base_scores: Tensor | None = None,
    base_points: Tensor | None = None,
    *,
    kernel: str = "rbf",
    bandwidth: float | Tensor | None = None,
    distribution_kernel: str | None = "gfd",
    distribution_bandwidth: float | Tensor | None = None,
    base_bandwidth: float | Tensor | None = None,
    num_null: int = 500,
    generator: torch.Generator | None = None,
    block_size: int = 1024,
) -> KCCSDTest:
    r"""KCCSD statistic and wild-bootstrap p-value from the models' scores.

    The scores come from the model-evaluation layer (``pair_and_base_scores``), the
    base points from :func:`gaussian_base_points`. ``H`` is built in
    ``block_size x block_size`` blocks on and above its diagonal (it is symmetric), so
    memory is ``O(block_size^2 + N * num_null)`` rather than ``O(N^2)`` and the kernel
    work is halved. The statistic keeps the autograd graph of ``score`` and
    ``base_scores``; the bandwidths and the bootstrap do not.

    Arguments: as :func:`kccsd_matrix`, plus
        num_null: bootstrap replicates ``B``; ``0`` skips the test (``p_value`` is NaN).
        generator: random generator for the multipliers.
        block_size: side of the blocks of ``H``.

    Returns:
        :class:`KCCSDTest`.

    Example:
        Models :math:`P_i = N(\mu_i, v I)`, whose scores are :math:`-(y - \mu_i) / v`;
        the truths are drawn from :math:`N(\mu_i, I)`:

        >>> g = torch.Generator().manual_seed(0)
        >>> mean = torch.randn(200, 2, generator=g)
        >>> theta = mean + torch.randn(200, 2, generator=g)
        >>> base = gaussian_base_points(theta, 16, g)
        >>> def scores(v):  # at the truths (N, D) and at the base points (N, m, D)
        ...     return -(theta - mean) / v, -(base - mean[:, None]) / v
        >>> kccsd(theta, *scores(1.0), base, generator=g).p_value  # calibrated
        tensor(0.2136)
        >>> kccsd(theta, *scores(0.25), base, generator=g).p_value  # over-confident
        tensor(0.0020)
    """
    setup = _Setup(
        theta,
        score,
        base_scores,
        base_points,
        kernel,
        bandwidth,
        distribution_kernel,
        distribution_bandwidth,
        base_bandwidth,
    )
    check_positive("block_size", block_size, integer=True)
    if num_null != 0:
        check_positive("num_null", num_null, integer=True)
    matrix = SymmetricBlocks(
        setup.block,
        (*theta.shape[:-2], theta.shape[-2], theta.shape[-2]),
        theta.dtype,
        theta.device,
        block_size,
    )
    if num_null:
        draws = wild_bootstrap(matrix, num_null, generator)
        total = matrix.total  # summed in the same sweep as H W
    else:
        total = matrix.sweep(None)[0]
    n = theta.shape[-2]
    statistic = (total / (n * (n - 1))).to(theta.dtype)
    if num_null:
        p_value = bootstrap_p_value(statistic, draws)
    else:
        p_value = torch.full_like(statistic.detach(), float("nan"))
    dist_bw = setup.distribution_bandwidth
    return KCCSDTest(
        statistic,
        p_value,
        torch.as_tensor(setup.bandwidth, dtype=theta.dtype),
        torch.as_tensor(float("nan") if dist_bw is None else dist_bw, dtype=theta.dtype),
    )
