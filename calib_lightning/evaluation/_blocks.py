"""Argument errors raised on blocks of rows, reworded to name the caller's whole input.

The evaluation layer calls the posterior on blocks of pairs; :func:`named_in_full`
makes a ``ValueError`` raised in a block show the shapes the caller passed.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator

from torch import Tensor

__all__ = ["named_in_full"]


@contextlib.contextmanager
def named_in_full(**inputs: Tensor) -> Iterator[None]:
    """Errors raised on blocks of rows name the caller's whole ``inputs``.

    The evaluation loops call the posterior on blocks of rows of ``theta`` and ``x`` (the
    probe chunk: 28 pairs of 9 draws); an argument error raised there (theta's width, x
    against the model's context) would show the block's shape, ``(28, 1)`` for an ``x``
    of shape ``(200, 1)``. In the message of a ``ValueError`` leaving the block, a shape
    ``(k, *X)`` with ``k <= N`` rows and the trailing shape of an input ``(N, *X)`` is
    that input's: it becomes ``(N, *X)``.
    """
    try:
        yield
    except ValueError as error:
        message = str(error)
        for value in inputs.values():
            n, tail = value.shape[0], "".join(f", {size}" for size in value.shape[1:])
            block = re.compile(rf"\((\d+){re.escape(tail)}\)")
            message = block.sub(
                lambda m, n=n, tail=tail: f"({n}{tail})" if int(m.group(1)) <= n else m.group(0),
                message,
            )
        if error.args and message != str(error):
            error.args = (message, *error.args[1:])
        raise
