"""Exact draws of a uniform multinomial: the null histograms of the TARP test."""

from __future__ import annotations

import torch
from torch import Tensor

from calib_lightning._utils.validation import check_positive

__all__ = ["uniform_multinomial"]


def uniform_multinomial(
    total: Tensor, cells: int, num_null: int, generator: torch.Generator | None = None
) -> Tensor:
    r"""Draws of :math:`\mathrm{Multinomial}(\mathrm{total}, (1/\mathrm{cells}, \dots))`.

    Two exact samplers, picked by cost: for small totals (``total <= 8 cells``) each
    draw puts ``total`` uniform indices into the cells (cost ``B * total``); otherwise
    binary splitting: a block of ``c`` cells holding ``t`` counts sends
    :math:`\mathrm{Binomial}(t, \lfloor c/2 \rfloor / c)` to its left half, level by
    level (cost ``log2(cells)`` vectorized binomial draws of size ``B * cells``,
    whatever ``total``).

    Arguments:
        total: number of trials ``(*)`` (integer valued).
        cells: number of equiprobable cells.
        num_null: ``B``, the number of draws.
        generator: random generator (on the CPU).

    Returns:
        ``(*, B, cells)`` float64 counts.
    """
    check_positive("cells", cells, integer=True)
    check_positive("num_null", num_null, integer=True)
    total = torch.as_tensor(total, dtype=torch.float64).cpu()
    if not bool((torch.isfinite(total) & (total >= 0) & (total == total.round())).all()):
        raise ValueError(
            f"total must hold non-negative integers, got {total.flatten()[:5].tolist()}"
        )
    largest = int(total.max()) if total.numel() else 0
    if largest <= 8 * cells:
        return _multinomial_by_indices(total, largest, cells, num_null, generator)
    counts = total[..., None, None].expand(*total.shape, num_null, 1).contiguous()
    sizes = [cells]
    while any(s > 1 for s in sizes):
        left = torch.tensor([s // 2 for s in sizes], dtype=torch.float64)
        prob = (left / torch.tensor(sizes, dtype=torch.float64)).expand_as(counts).contiguous()
        to_left = torch.binomial(counts, prob, generator=generator)
        counts = torch.stack([to_left, counts - to_left], -1).flatten(-2)
        children = [size for s in sizes for size in (s // 2, s - s // 2)]
        keep = torch.tensor([size > 0 for size in children])
        counts, sizes = counts[..., keep], [size for size in children if size > 0]
    return counts


def _multinomial_by_indices(
    total: Tensor, largest: int, cells: int, num_null: int, generator: torch.Generator | None
) -> Tensor:
    """Multinomial draws as histograms of ``total`` uniform indices, in bounded chunks."""
    flat = total.reshape(-1)
    out = torch.zeros(flat.shape[0], num_null, cells, dtype=torch.float64)
    used = (torch.arange(largest, dtype=torch.float64) < flat[:, None]).double()  # (T, largest)
    step = max(1, (1 << 22) // max(largest, 1))
    for start in range(0, num_null, step):
        stop = min(start + step, num_null)
        index = torch.randint(0, cells, (flat.shape[0], stop - start, largest), generator=generator)
        weights = used[:, None, :].expand(-1, stop - start, -1)
        out[:, start:stop].scatter_add_(-1, index, weights)
    return out.reshape(*total.shape, num_null, cells)
