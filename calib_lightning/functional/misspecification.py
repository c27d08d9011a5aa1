r"""Conformal misspecification test: does an observation look like the simulator's output?

Split the simulated observations into a *fit* set and a *calibration* set. The
nonconformity score of a feature vector :math:`f` is its distance to the ``k``-th
nearest fit point, after standardizing every feature with the fit set's mean and
standard deviation,

.. math::
    s(f) = \big\| \tilde f - \tilde f^{\mathrm{fit}}_{(k)} \big\|, \qquad
    \tilde f = (f - \mu_{\mathrm{fit}}) / \sigma_{\mathrm{fit}},

(a large score: few simulations nearby), and the conformal p-value of an observation
:math:`x_o` compares its score with the scores :math:`s_1, \dots, s_n` of the ``n``
calibration points,

.. math::
    p(x_o) = \frac{1 + \#\{i : s_i \ge s(x_o)\}}{1 + n}.

The score is built from the fit set alone, so for an :math:`x_o` drawn from the
simulator, :math:`s(x_o), s_1, \dots, s_n` are exchangeable given the fit set and
:math:`P(p(x_o) \le \alpha) \le \alpha` holds exactly, for every ``n``, every ``k``
and every feature map, ties included (they count against the observation). The
choice of score only moves the power.

These functions see feature tensors only; applying an embedding network and splitting
the simulations happen in :func:`calib_lightning.misspecification_test`.

References:
    Vovk, Gammerman, Shafer. "Algorithmic Learning in a Random World." Springer (2005).

    Angelopoulos, Bates. "A Gentle Introduction to Conformal Prediction and
    Distribution-Free Uncertainty Quantification." arXiv:2107.07511 (2021).
"""

from __future__ import annotations

import torch
from torch import Tensor

from calib_lightning._utils.chunks import row_blocks
from calib_lightning._utils.validation import check_points, check_positive
from calib_lightning.functional.combine import monte_carlo_p_value

__all__ = [
    "conformal_p_value",
    "knn_distance",
    "misspecification_scores",
    "standardization",
]


def standardization(reference: Tensor) -> tuple[Tensor, Tensor]:
    r"""Location and scale that standardize features with the ``reference`` set.

    A feature that is constant on the reference set (standard deviation zero, up to
    rounding: at most ``eps * |mean|``) gets scale 1, so it adds its raw difference to
    distances instead of dividing by zero.

    Arguments:
        reference: features, shape ``(*, R, F)``.

    Returns:
        ``(mean, scale)``, each ``(*, 1, F)``: the mean and the standard deviation
        (divisor ``R``) over the ``R`` points.

    Example:
        >>> mean, scale = standardization(torch.tensor([[0.0, 2.0], [2.0, 2.0]]))
        >>> mean, scale
        (tensor([[1., 2.]]), tensor([[1., 1.]]))
    """
    check_points("reference", reference)
    mean = reference.mean(-2, keepdim=True)
    std = reference.std(-2, correction=0, keepdim=True)
    constant = std <= torch.finfo(std.dtype).eps * mean.abs()
    return mean, torch.where(constant, torch.ones_like(std), std)


def knn_distance(points: Tensor, reference: Tensor, k: int = 5, block_size: int = 1024) -> Tensor:
    r"""Euclidean distance from each point to its ``k``-th nearest ``reference`` point.

    Distances are computed coordinate by coordinate, not through the
    :math:`|a|^2 + |b|^2 - 2 a^\top b` matmul shortcut, so that one point gets the
    same distance, bit for bit, whichever set and block it is evaluated in: equal
    points then tie exactly, which the conformal p-value's validity relies on.

    Arguments:
        points: ``(*, M, F)``.
        reference: ``(*, R, F)`` with ``R >= k``; a point is not excluded from its own
            neighbours (use disjoint sets).
        k: which neighbour, ``1 <= k <= R``.
        block_size: points processed at once (memory ``block_size * R * F``).

    Returns:
        ``(*, M)``: the ``k``-th smallest of :math:`\|y_m - r_j\|` over ``j``.

    Example:
        >>> reference = torch.tensor([[0.0], [1.0], [3.0]])
        >>> knn_distance(torch.tensor([[0.0], [2.0]]), reference, k=2)
        tensor([1., 1.])
    """
    check_positive("k", k, integer=True)
    check_positive("block_size", block_size, integer=True)
    check_points("reference", reference, min_rows=k)
    check_points("points", points, columns=reference.shape[-1])
    out = [
        torch.cdist(points[..., rows, :], reference, compute_mode="donot_use_mm_for_euclid_dist")
        .topk(k, -1, largest=False)  # several times faster than kthvalue for small k
        .values[..., -1]
        for rows in row_blocks(points.shape[-2], block_size)
    ]
    return torch.cat(out, -1)


def misspecification_scores(
    observations: Tensor,
    fit: Tensor,
    calibration: Tensor,
    *,
    k: int = 5,
    standardize: bool = True,
    block_size: int = 1024,
) -> tuple[Tensor, Tensor]:
    r"""Nonconformity scores of the observations and of the calibration set.

    Both are :math:`s(f) = \|\tilde f - \tilde f^{\mathrm{fit}}_{(k)}\|`, the distance
    to the ``k``-th nearest fit point after standardizing with the fit set (see the
    module docstring).

    Arguments:
        observations: features of the observations :math:`x_o`, ``(*, O, F)``.
        fit: features of the fit simulations, ``(*, N_fit, F)`` with ``N_fit >= k``.
        calibration: features of the calibration simulations, ``(*, N_cal, F)``.
        k: the neighbour whose distance is the score.
        standardize: standardize every feature with the fit set's mean and standard
            deviation (:func:`standardization`); ``False``: raw Euclidean distances.
        block_size: rows of each distance block.

    Returns:
        ``(score, calibration_scores)``: ``(*, O)`` and ``(*, N_cal)``.

    Example:
        >>> fit = torch.tensor([[0.0], [2.0]])
        >>> misspecification_scores(torch.tensor([[5.0]]), fit, torch.tensor([[1.0]]), k=1)
        (tensor([3.]), tensor([0.]))
    """
    check_points("fit", fit, min_rows=k)
    width = fit.shape[-1]
    check_points("observations", observations, columns=width)
    check_points("calibration", calibration, min_rows=1, columns=width)
    if standardize:
        mean, scale = standardization(fit)
        fit, observations, calibration = (
            (t - mean) / scale for t in (fit, observations, calibration)
        )
    score = knn_distance(observations, fit, k, block_size)
    return score, knn_distance(calibration, fit, k, block_size)


def conformal_p_value(
    score: Tensor, calibration_scores: Tensor, *, dtype: torch.dtype | None = None
) -> Tensor:
    r"""Conformal p-value :math:`p = (1 + \#\{i : s_i \ge s\}) / (1 + n)` of each score.

    Valid for a score exchangeable with the ``n`` calibration scores:
    :math:`P(p \le \alpha) \le \alpha` exactly, with equality when
    :math:`\alpha (n + 1)` is an integer and there are no ties. Large scores are
    nonconforming (small p-values). Every entry of ``score`` is compared with the same
    calibration scores, so the ``O`` p-values are dependent.

    Arguments:
        score: scores of the observations, ``(*, O)``.
        calibration_scores: :math:`s_1, \dots, s_n`, ``(*, n)``.
        dtype: of the result; ``None``: the dtype of ``calibration_scores``.

    Returns:
        ``(*, O)``, in :math:`[1 / (1 + n), 1]`.

    References:
        Vovk, Gammerman, Shafer. "Algorithmic Learning in a Random World." Springer
        (2005), chapter 2 (smoothing aside).

    Example:
        >>> conformal_p_value(torch.tensor([0.5, 9.0]), torch.tensor([0.1, 0.5, 0.7, 2.0]))
        tensor([0.8000, 0.2000])
    """
    if score.ndim < 1 or calibration_scores.ndim < 1 or calibration_scores.shape[-1] < 1:
        raise ValueError(
            "score must have shape (*, O) and calibration_scores (*, n) with n >= 1, got "
            f"{tuple(score.shape)} and {tuple(calibration_scores.shape)}"
        )
    return monte_carlo_p_value(score, calibration_scores.unsqueeze(-2), dtype=dtype)
