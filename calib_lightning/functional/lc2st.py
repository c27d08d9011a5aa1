r"""L-C2ST statistics on classifier outputs: the MSE statistic, its p-value, PP-curves.

A classifier :math:`d(\theta, x) = P(\text{class } 1 \mid \theta, x)` is trained to tell
calibration pairs from the estimator's (L-C2ST), or the flow's latents of the
calibration pairs from normal draws (L-C2ST-NF); the training lives in
:mod:`calib_lightning.classifiers.local_c2st`. At an observation :math:`x_o`, with
evaluation points :math:`\theta_j`, :math:`j = 1..N_v`,

.. math::
    T(x_o) = \frac{1}{N_v} \sum_j \big(d(\theta_j, x_o) - \tfrac12\big)^2,

zero for a Bayes-optimal classifier iff :math:`q(\cdot \mid x_o) = p(\cdot \mid x_o)`, and
:math:`p = (1 + \#\{T_h \ge T\}) / (1 + H)` over :math:`H` null statistics. The PP-plot
compares the empirical CDF of the :math:`d(\theta_j, x_o)` with the band of the null
classifiers' CDFs.

These functions take classifier outputs and statistics as tensors.

References:
    Linhart, Gramfort, Rodrigues. "L-C2ST: Local Diagnostics for Posterior
    Approximations in Simulation-Based Inference." NeurIPS 2023.

    Kim, Lee, Lei. "Global and local two-sample tests via regression." Electronic
    Journal of Statistics, 2019 (the MSE statistic).
"""

from __future__ import annotations

import torch
from torch import Tensor

from calib_lightning._utils.validation import check_probability
from calib_lightning.functional.combine import monte_carlo_p_value

__all__ = ["lc2st_p_value", "lc2st_statistic", "pp_band", "pp_ecdf"]


def lc2st_statistic(probabilities: Tensor) -> Tensor:
    r"""The MSE statistic :math:`T = \frac{1}{N_v} \sum_j (d_j - \frac12)^2`.

    Arguments:
        probabilities: classifier outputs :math:`d_j` at the evaluation points,
            shape ``(*, N_v)``.

    Returns:
        ``(*)``.

    Example:
        >>> lc2st_statistic(torch.tensor([[0.5, 0.5], [0.0, 1.0]]))
        tensor([0.0000, 0.2500])
    """
    return (probabilities - 0.5).square().mean(-1)


def lc2st_p_value(statistic: Tensor, null_statistics: Tensor) -> Tensor:
    r"""Permutation-style p-value :math:`(1 + \#\{T_h \ge T\}) / (1 + H)`.

    Arguments:
        statistic: ``(*)``.
        null_statistics: ``(H, *)``, or ``(H, **)`` with ``**`` a trailing part of ``*``
            (one null shared by leading batch dimensions).

    Returns:
        ``(*)``, in :math:`[1 / (1 + H), 1]`.

    Example:
        >>> lc2st_p_value(torch.tensor(0.3), torch.tensor([0.1, 0.2, 0.3, 0.4]))
        tensor(0.6000)
    """
    if (
        null_statistics.ndim < 1
        or null_statistics.ndim - 1 > statistic.ndim
        or (
            statistic.shape[statistic.ndim - null_statistics.ndim + 1 :]
            != null_statistics.shape[1:]
        )
    ):
        raise ValueError(
            f"null_statistics must have shape (H, *) with * a trailing part of the statistic's "
            f"shape {tuple(statistic.shape)}, got {tuple(null_statistics.shape)}"
        )
    null = null_statistics.reshape(
        null_statistics.shape[0],
        *[1] * (statistic.ndim + 1 - null_statistics.ndim),
        *null_statistics.shape[1:],
    )
    dtype = statistic.dtype if statistic.is_floating_point() else torch.get_default_dtype()
    return monte_carlo_p_value(statistic, null.movedim(0, -1), dtype=dtype)


def pp_ecdf(probabilities: Tensor, grid: Tensor) -> Tensor:
    r"""Empirical CDF of predicted probabilities on a grid: :math:`\hat F(\alpha)`, the PP-plot.

    Arguments:
        probabilities: ``(*, N_v)``.
        grid: levels :math:`\alpha`, shape ``(G,)``.

    Returns:
        ``(*, G)``: :math:`\frac{1}{N_v} \#\{j : d_j \le \alpha\}`.

    Example:
        >>> pp_ecdf(torch.tensor([0.2, 0.5, 0.5, 0.9]), torch.tensor([0.0, 0.5, 1.0]))
        tensor([0.0000, 0.7500, 1.0000])
    """
    num_points, levels = probabilities.shape[-1], grid.to(probabilities).contiguous()
    bins = torch.bucketize(probabilities.contiguous(), levels)  # d <= grid[g] <=> bin <= g
    rows = bins.reshape(-1, num_points)
    offsets = torch.arange(rows.shape[0], device=rows.device)[:, None] * (len(levels) + 1)
    counts = torch.bincount(
        (rows + offsets).reshape(-1), minlength=offsets.numel() * (len(levels) + 1)
    )
    cdf = counts.reshape(rows.shape[0], -1).cumsum(-1)[:, : len(levels)]
    cdf = cdf.to(probabilities.dtype) / num_points
    return cdf.reshape(*probabilities.shape[:-1], len(levels))


def pp_band(null_ecdf: Tensor, level: float = 0.05) -> Tensor:
    """Pointwise band of the null classifiers' PP-curves, covering ``1 - level`` of them.

    At each grid point the band runs from the ``level / 2`` to the ``1 - level / 2``
    quantile of the null curves.

    Arguments:
        null_ecdf: :func:`pp_ecdf` of the ``H`` null classifiers, ``(H, *, G)``.
        level: share of null curves outside the band at each grid point.

    Returns:
        ``(2, *, G)``: lower and upper quantiles.

    Example:
        >>> curves = torch.linspace(0, 1, 11)[:, None].expand(11, 3)
        >>> pp_band(curves, level=0.2)[:, 0]
        tensor([0.1000, 0.9000])
    """
    check_probability("level", level)
    tail = level / 2
    levels = torch.tensor([tail, 1.0 - tail], dtype=null_ecdf.dtype, device=null_ecdf.device)
    return torch.quantile(null_ecdf, levels, dim=0)
