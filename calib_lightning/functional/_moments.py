r"""Centred first and second moments that merge exactly across batches and processes.

A set of ``n`` points is summarized by its count, mean :math:`\bar x` and centred
second moment :math:`M_2 = \sum_i (x_i - \bar x)(x_i - \bar x)^\top` (or only its
diagonal). Unlike raw sums of :math:`x` and :math:`x^2`, these lose no precision
when the points sit far from the origin (a variance of :math:`10^{-4}` at an offset
of :math:`10^9` has no significant digit left in :math:`\sum x^2 - n \bar x^2`).

Parts :math:`k = 1..K` merge with the parallel formula of Chan, Golub and LeVeque:

.. math::
    n = \sum_k n_k, \quad \bar x = \frac{1}{n} \sum_k n_k \bar x_k, \quad
    M_2 = \sum_k M_{2,k} + \sum_k n_k (\bar x_k - \bar x)(\bar x_k - \bar x)^\top,

computed with the part means taken relative to the anchor of the largest part, so
that no term carries the offset. Empty parts (``n_k = 0``) contribute nothing.

A state is one float64 tensor ``(*, L)`` packing ``[n, anchor (D), mean - anchor (D),
M2]`` with ``M2`` of ``D`` (diagonal) or ``D * D`` (full) entries. The anchor is one
of the points, so the mean is held to the precision of the spread, not of the offset
(a mean rounded at :math:`1.1 \cdot 10^9` is off by :math:`10^{-7}`, which a merge
would turn into a relative error of :math:`10^{-5}` in a variance of
:math:`10^{-4}`). Packed, a state is a single torchmetrics state whose
``dist_reduce_fx`` is :func:`merge_moments` (partially applied with ``covariance``):
torchmetrics stacks the states of all processes (zero-padded, that is empty, where a
process has not allocated its state) and merges them in one call, so DDP equals one
process up to float rounding.

References:
    Chan, Golub, LeVeque. "Algorithms for Computing the Sample Variance: Analysis and
    Recommendations." The American Statistician 37(3), 1983.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = [
    "merge_moments",
    "moment_state_size",
    "moments",
    "split_moments",
    "std_from_moments",
    "std_or_one",
    "variance_from_moments",
]


def moment_state_size(dim: int, covariance: bool = False) -> int:
    """Length ``L`` of a packed state of ``dim``-dimensional points: ``1 + 3 D`` (diagonal)
    or ``1 + 2 D + D * D`` (full)."""
    return 1 + 2 * dim + (dim * dim if covariance else dim)


def _dim_of(size: int, covariance: bool) -> int:
    # full: 1 + 2 D + D^2 = (D + 1)^2
    dim = math.isqrt(max(size, 1)) - 1 if covariance else (size - 1) // 3
    if size < 1 or moment_state_size(dim, covariance) != size:
        kind = "1 + 2 D + D * D" if covariance else "1 + 3 D"
        raise ValueError(f"state must have a last axis of length {kind}, got {size}")
    return dim


def moments(points: Tensor, covariance: bool = False) -> Tensor:
    r"""Packed count, mean and centred second moment of ``points`` ``(*, n, D)``.

    The mean is kept as an anchor :math:`a` (the first point, exactly representable)
    plus the mean of :math:`x - a`, a number of the size of the spread, so that merging
    parts whose means differ by less than the rounding of the offset stays exact. Two
    passes in float64: the mean of :math:`x - a`, then the deviations from it, with the
    correction :math:`M_2 = \sum c c^\top - n \bar c \bar c^\top` for the rounding of
    the first mean (:math:`c` the deviations, :math:`\bar c` their mean).

    Arguments:
        points: ``(*, n, D)``; ``n = 0`` gives an empty state (count 0).
        covariance: keep the full ``(D, D)`` co-moment rather than its diagonal.

    Returns:
        float64 state ``(*, L)`` with ``L = moment_state_size(D, covariance)``, laid out
        as ``[n, anchor (D), mean - anchor (D), M2 (D or D * D)]``.
    """
    x = points.detach().double()
    n = x.shape[-2]
    if n == 0:
        shape = (*x.shape[:-2], moment_state_size(x.shape[-1], covariance))
        return torch.zeros(shape, dtype=torch.float64, device=x.device)
    anchor = x[..., 0, :]
    x = x - anchor.unsqueeze(-2)
    mean = x.mean(-2)
    dev = x - mean.unsqueeze(-2)
    shift = dev.mean(-2)
    if covariance:
        m2 = dev.transpose(-1, -2) @ dev - n * (shift.unsqueeze(-1) * shift.unsqueeze(-2))
        m2 = m2.flatten(-2)
    else:
        m2 = ((dev * dev).sum(-2) - n * shift * shift).clamp_min(0.0)
    count = torch.full((*x.shape[:-2], 1), float(n), dtype=torch.float64, device=x.device)
    return torch.cat([count, anchor, mean + shift, m2], -1)


def _split(state: Tensor, covariance: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """count ``(*)``, anchor ``(*, D)``, mean - anchor ``(*, D)``, M2 ``(*, D[, D])``."""
    dim = _dim_of(state.shape[-1], covariance)
    count, anchor = state[..., 0], state[..., 1 : 1 + dim]
    relative, m2 = state[..., 1 + dim : 1 + 2 * dim], state[..., 1 + 2 * dim :]
    if covariance:
        m2 = m2.unflatten(-1, (dim, dim))
    return count, anchor, relative, m2


def split_moments(state: Tensor, covariance: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """Unpack a state ``(*, L)`` into count ``(*)``, mean ``(*, D)`` and ``M2`` ``(*, D)``
    (diagonal) or ``(*, D, D)`` (full)."""
    count, anchor, relative, m2 = _split(state, covariance)
    return count, anchor + relative, m2


def merge_moments(states: Tensor, covariance: bool = False) -> Tensor:
    r"""Merge a stack of states ``(K, *, L)`` into one ``(*, L)`` (Chan et al.'s formula).

    Exact in real arithmetic for any split of the points into the ``K`` parts, and in
    float64 free of the cancellation of raw moments: the part means enter relative to
    the anchor of the largest part (see the module docstring). Parts with count 0 are
    ignored; if all are empty the result is the empty state.
    """
    if states.ndim < 2:
        raise ValueError(
            f"states must have shape (K, *, L) with a leading part axis, got {tuple(states.shape)}"
        )
    count, anchor, relative, m2 = _split(states.double(), covariance)
    total = count.sum(0)
    largest = count.argmax(0).unsqueeze(0).unsqueeze(-1).expand(1, *anchor.shape[1:])
    reference = anchor.gather(0, largest).squeeze(0)
    nonempty = count.unsqueeze(-1) > 0
    delta = torch.where(nonempty, (anchor - reference) + relative, torch.zeros_like(relative))
    weight = count.unsqueeze(-1)
    shift = (weight * delta).sum(0) / total.clamp_min(1.0).unsqueeze(-1)
    dev = delta - shift
    if covariance:
        spread = (weight.unsqueeze(-1) * dev.unsqueeze(-1) * dev.unsqueeze(-2)).sum(0)
        merged_m2 = (m2.sum(0) + spread).flatten(-2)
    else:
        merged_m2 = m2.sum(0) + (weight * dev * dev).sum(0)
    return torch.cat([total.unsqueeze(-1), reference, shift, merged_m2], -1)


def variance_from_moments(state: Tensor, covariance: bool = False) -> tuple[Tensor, Tensor]:
    r"""Mean ``(*, D)`` and unbiased variance ``(*, D)`` (or covariance ``(*, D, D)``),
    :math:`M_2 / (n - 1)`, of a state; raises unless every count is at least 2."""
    count, mean, m2 = split_moments(state, covariance)
    if bool((count < 2).any()):
        raise ValueError(f"a variance needs at least 2 points, got count {int(count.min())}")
    scale = (count - 1.0).unsqueeze(-1)
    if covariance:
        scale = scale.unsqueeze(-1)
    return mean, m2 / scale


def std_or_one(std: Tensor) -> Tensor:
    """``std`` with its zero entries (constant columns) replaced by 1, safe to divide by."""
    return torch.where(std > 0, std, torch.ones_like(std))


def std_from_moments(state: Tensor) -> Tensor:
    r"""Standard deviation ``(*, D)`` of a diagonal state, :math:`\sqrt{M_2 / (n - 1)}`;
    zeros (also of a single point) become 1 (:func:`std_or_one`)."""
    count, _, m2 = split_moments(state)
    std = (m2 / (count - 1.0).clamp_min(1.0).unsqueeze(-1)).clamp_min(0.0).sqrt()
    return std_or_one(std)
