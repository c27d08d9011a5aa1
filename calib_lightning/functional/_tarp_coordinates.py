r"""The coordinates of TARP: where references are drawn and how distances are scaled.

Fitted on the pooled values of every pair (its true parameter and its posterior
samples), a function of each pair's unordered set of values: which value is the true one
does not change them, which keeps :func:`~calib_lightning.functional.tarp`'s permutation
test exact, and no random pick is needed (module docstring of
:mod:`calib_lightning.functional.tarp`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from calib_lightning._utils.validation import check_matrix, check_points, check_positive
from calib_lightning.functional._moments import moments, std_from_moments

__all__ = [
    "NUM_REFERENCES",
    "check_scale",
    "pooled_values",
    "tarp_box",
    "tarp_fit_scale",
    "tarp_references",
]

#: references per pair of :func:`~calib_lightning.functional.tarp` and
#: :class:`~calib_lightning.TARP`
NUM_REFERENCES = 16


def tarp_fit_scale(values: Tensor) -> Tensor:
    """Per-dimension standard deviation of ``values`` ``(*, P, D)`` -> ``(*, D)``; zeros become 1.

    Computed in float64 from centred moments (exact at any offset), returned in the
    dtype of ``values``. :func:`tarp` fits it on the pooled values of all pairs (their
    ``theta`` and their samples, :func:`pooled_values`).
    """
    check_points("values", values, min_rows=2)
    return std_from_moments(moments(values)).to(values.dtype)


def pooled_values(samples: Tensor, theta: Tensor) -> Tensor:
    """Every pair's :math:`S + 1` values, pooled: ``(S, N, D)``, ``(N, D)`` -> ``((S + 1) N, D)``.

    A function of each pair's unordered set of values: which of them is the true one
    does not change it (the coordinates of :func:`tarp` are fitted on it).
    """
    return torch.cat([theta.detach().unsqueeze(0), samples.detach().to(theta.dtype)]).flatten(0, 1)


def tarp_box(values: Tensor, num_pairs: int) -> tuple[Tensor, Tensor]:
    r"""The box references are drawn in: the :math:`1 / (N + 1)` and :math:`N / (N + 1)`
    quantiles of each coordinate of ``values``.

    These are where the smallest and the largest of ``N`` draws of the values' marginal
    fall on average: the box of ``N`` points, without the randomness of which ``N``.

    Arguments:
        values: pooled values ``(P, D)`` (:func:`pooled_values`).
        num_pairs: ``N``.

    Returns:
        ``(low, high)``, each ``(D,)`` in the dtype of ``values``.
    """
    check_matrix("values", values, min_rows=1)
    check_positive("num_pairs", num_pairs, integer=True)
    data = values.detach().double().T.contiguous()  # (D, P): selection along rows is fast
    last = values.shape[0] - 1
    bounds = []
    for level in (1.0 / (num_pairs + 1), num_pairs / (num_pairs + 1)):
        position = level * last  # linear interpolation between order statistics
        below = int(position)
        above = min(below + 1, last)
        weight = position - below
        low = data.kthvalue(below + 1, 1).values
        high = data.kthvalue(above + 1, 1).values if above != below else low
        bounds.append(((1 - weight) * low + weight * high).to(values.dtype))
    return bounds[0], bounds[1]


def tarp_references(
    low: Tensor,
    high: Tensor,
    num_pairs: int,
    num_references: int = NUM_REFERENCES,
    generator: torch.Generator | None = None,
) -> Tensor:
    r"""``R`` reference points per pair, uniform on the box ``[low, high]``.

    Arguments:
        low: lower corner of the box ``(D,)`` (:func:`tarp_box`, or a prior's bounds).
        high: upper corner of the box ``(D,)``.
        num_pairs: ``N``.
        num_references: ``R``.
        generator: random generator (on the CPU).

    Returns:
        ``(R, N, D)`` in the dtype and on the device of ``low``.
    """
    check_positive("num_pairs", num_pairs, integer=True)
    check_positive("num_references", num_references, integer=True)
    if low.ndim != 1 or low.shape != high.shape:
        raise ValueError(
            f"low and high must be tensors of shape (D,), got {tuple(low.shape)} "
            f"and {tuple(high.shape)}"
        )
    # pair-major draws: the references of pair i do not depend on how many pairs are drawn
    # with it (a metric updated in batches draws the same as in one call)
    u = torch.rand(
        num_pairs, num_references, low.shape[0], generator=generator, dtype=torch.float64
    ).transpose(0, 1)
    low64, high64 = low.detach().double().cpu(), high.detach().double().cpu()
    return (low64 + (high64 - low64) * u).to(dtype=low.dtype, device=low.device)


def check_scale(scale: Tensor, dim: int | None = None) -> Tensor:
    """Raise unless ``scale`` is a positive finite tensor of shape ``(dim,)`` (any ``(D,)``)."""
    if not isinstance(scale, Tensor) or scale.ndim != 1 or dim not in (None, scale.shape[0]):
        shape = tuple(scale.shape) if isinstance(scale, Tensor) else type(scale).__name__
        raise ValueError(f"scale must be a tensor of shape ({dim or 'D'},), got {shape}")
    if not bool((scale > 0).all()) or not bool(torch.isfinite(scale).all()):
        raise ValueError(f"scale must be a positive tensor of finite values, got {scale.tolist()}")
    return scale
