"""Row blocks for the chunked loops that keep memory bounded."""

from __future__ import annotations

__all__ = ["row_blocks"]


def row_blocks(n: int, size: int) -> list[slice]:
    """Consecutive slices of at most ``size`` rows covering ``0..n``.

    Example:
        >>> row_blocks(5, 2)
        [slice(0, 2, None), slice(2, 4, None), slice(4, 5, None)]
    """
    return [slice(s, min(s + size, n)) for s in range(0, n, size)]
