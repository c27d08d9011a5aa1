"""Feature blocks shared by the classifier ensembles: validation, standardization, gathering.

``features`` is a tensor or a sequence of blocks joined along the last axis, each block
``(M, F_b)`` (shared by all ``K`` members, never copied ``K`` times) or ``(K, M, F_b)``
(one dataset per member); ``labels`` in ``{0, 1}`` have shape ``(M,)`` or ``(K, M)``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import Tensor

from calib_lightning._utils.validation import check_finite
from calib_lightning.functional._moments import std_or_one

__all__ = [
    "Features",
    "as_blocks",
    "as_labels",
    "gather",
    "gather_labels",
    "standardize",
    "threads",
]

Features = Tensor | Sequence[Tensor]


@contextmanager
def threads(num_threads: int | None) -> Iterator[None]:
    """Run torch ops on ``num_threads`` intra-op threads (``None``: leave as is), then restore."""
    before = torch.get_num_threads()
    if num_threads is not None and num_threads != before:
        torch.set_num_threads(num_threads)
    try:
        yield
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)


def as_blocks(features: Features, num_members: int) -> list[Tensor]:
    """Validate ``features`` and return its blocks, each ``(M, F_b)`` or ``(K, M, F_b)``."""
    blocks = [features] if isinstance(features, Tensor) else list(features)
    if not blocks:
        raise ValueError("features must hold at least one block, got an empty sequence")
    rows = None
    for i, block in enumerate(blocks):
        if not isinstance(block, Tensor) or not block.is_floating_point():
            raise ValueError(f"features block {i} must be a floating tensor, got {block!r:.60}")
        if block.ndim == 3 and block.shape[0] != num_members:
            raise ValueError(
                f"features block {i} must have shape (M, F) or (K, M, F) with K = {num_members} "
                f"members, got {tuple(block.shape)}"
            )
        if block.ndim not in (2, 3):
            raise ValueError(
                f"features block {i} must have shape (M, F) or (K, M, F), got {tuple(block.shape)}"
            )
        if rows is not None and block.shape[-2] != rows:
            raise ValueError(
                f"features blocks must share the number of rows M = {rows}, "
                f"block {i} has shape {tuple(block.shape)}"
            )
        rows = block.shape[-2]
        check_finite(f"features block {i}", block.reshape(-1, block.shape[-1]))
    return blocks


def as_labels(labels: Tensor, num_members: int, rows: int) -> Tensor:
    if not isinstance(labels, Tensor) or labels.shape not in ((rows,), (num_members, rows)):
        got = tuple(labels.shape) if isinstance(labels, Tensor) else type(labels).__name__
        raise ValueError(f"labels must have shape ({rows},) or ({num_members}, {rows}), got {got}")
    if not bool(((labels == 0) | (labels == 1)).all()):
        raise ValueError("labels must be 0 or 1")
    return labels


def standardize(blocks: list[Tensor], num_members: int) -> tuple[list[Tensor], Tensor, Tensor]:
    """Standardize every block with its own (per-member) mean and standard deviation.

    Returns the standardized blocks and the ``(K, F)`` location and scale used.
    """
    out, locs, scales = [], [], []
    for block in blocks:
        loc = block.mean(-2, keepdim=True)
        scale = block.std(-2, keepdim=True) if block.shape[-2] > 1 else torch.ones_like(loc)
        scale = std_or_one(scale)
        out.append((block - loc) / scale)
        width = block.shape[-1]
        locs.append(loc.squeeze(-2).expand(num_members, width))
        scales.append(scale.squeeze(-2).expand(num_members, width))
    return out, torch.cat(locs, -1), torch.cat(scales, -1)


def gather(blocks: list[Tensor], members: Tensor, rows: Tensor) -> Tensor:
    """Rows ``rows (k, B)`` of the blocks for members ``members (k,)``: ``(k, B, F)``."""
    parts = []
    for b in blocks:
        if b.ndim == 3:  # one flat index into (K * M, F): much faster than b[members, rows]
            flat_rows = (rows + (members * b.shape[1])[:, None]).reshape(-1)
            b = b.reshape(-1, b.shape[-1])
        else:
            flat_rows = rows.reshape(-1)
        parts.append(b.index_select(0, flat_rows).view(*rows.shape, b.shape[-1]))
    return torch.cat(parts, -1) if len(parts) > 1 else parts[0]


def gather_labels(labels: Tensor, members: Tensor, rows: Tensor) -> Tensor:
    return labels[rows] if labels.ndim == 1 else labels[members[:, None], rows]
