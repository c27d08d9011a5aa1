"""Row blocks for the chunked loops that keep memory bounded."""

from __future__ import annotations

__all__ = ["SCRATCH_NUMBERS", "pair_blocks", "row_blocks"]

#: numbers per block of :func:`pair_blocks` (4 MiB per float64 scratch copy)
SCRATCH_NUMBERS = 2**19


def row_blocks(n: int, size: int) -> list[slice]:
    """Consecutive slices of at most ``size`` rows covering ``0..n``.

    Example:
        >>> row_blocks(5, 2)
        [slice(0, 2, None), slice(2, 4, None), slice(4, 5, None)]
    """
    return [slice(s, min(s + size, n)) for s in range(0, n, size)]


def pair_blocks(num_pairs: int, numbers_per_pair: int) -> list[slice]:
    """:func:`row_blocks` of pairs holding about :data:`SCRATCH_NUMBERS` numbers each (at
    least one pair): the blocks of a functional core whose scratch copies of all the
    draws (``M * D`` numbers per pair) would otherwise grow with ``N``.

    Example:
        >>> pair_blocks(3, 2**18)
        [slice(0, 2, None), slice(2, 3, None)]
    """
    return row_blocks(num_pairs, max(1, SCRATCH_NUMBERS // max(numbers_per_pair, 1)))
