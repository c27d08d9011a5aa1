r"""Wild bootstrap of degenerate U-statistics (shared by the KCCSD and SKCE tests).

For a zero-diagonal kernel matrix :math:`H` of :math:`n` points, the U-statistic
:math:`\hat C = \frac{1}{n (n-1)} \sum_{i \ne j} H_{ij}` is degenerate under the null
(mean zero), and the wild bootstrap
:math:`C_b = w_b^\top H w_b / (n (n-1))`, :math:`w_b` Rademacher, approximates its null
distribution; :math:`p = (1 + \#\{C_b \ge \hat C\}) / (1 + B)`.

References:
    Chwialkowski, Sejdinovic, Gretton. "A Wild Bootstrap for Degenerate Kernel Tests."
    NeurIPS 2014.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from calib_lightning._utils.chunks import row_blocks
from calib_lightning._utils.validation import check_positive
from calib_lightning.functional.combine import monte_carlo_p_value

__all__ = [
    "SymmetricBlocks",
    "bootstrap_p_value",
    "rademacher",
    "u_statistic",
    "wild_bootstrap",
]


def rademacher(
    shape: tuple[int, ...],
    generator: torch.Generator | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> Tensor:
    """Independent random signs of the given shape (drawn on the CPU, then moved)."""
    signs = torch.randint(0, 2, shape, generator=generator, dtype=torch.int8)
    return (2 * signs - 1).to(dtype=dtype, device=device)


class SymmetricBlocks:
    """A symmetric ``(*, n, n)`` matrix ``H`` held as a function of its blocks, never whole.

    ``H @ W`` (the one use :func:`wild_bootstrap` makes of a matrix) is a sweep over
    the blocks on and above the diagonal that also sums ``H`` (kept in :attr:`total`,
    with the autograd graph), so a statistic and its bootstrap share one evaluation
    of each block. Memory is ``O(block_size^2 + n B)``.

    Arguments:
        block: ``block(rows, cols)``, the block ``H[..., rows, cols]``.
        shape: ``(*, n, n)``.
        dtype: of the blocks.
        device: of the blocks.
        block_size: side of the blocks.
    """

    def __init__(
        self,
        block: Callable[[slice, slice], Tensor],
        shape: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device,
        block_size: int,
    ) -> None:
        self.block, self.shape, self.block_size = block, tuple(shape), block_size
        self.dtype, self.device = dtype, device
        self.total: Tensor | None = None

    def detach(self) -> SymmetricBlocks:
        return self  # the product below is computed from detached blocks

    def __matmul__(self, weights: Tensor) -> Tensor:
        self.total, product = self.sweep(weights)
        return product

    def sweep(self, weights: Tensor | None) -> tuple[Tensor, Tensor | None]:
        """``(sum of H (*) in float64, H @ weights (*, n, B) or None)``."""
        # H is symmetric: compute the blocks on and above the diagonal only; an
        # off-diagonal block counts twice in the sum and feeds both H_IJ W_J and H_JI W_I
        total = 0.0
        product = None if weights is None else torch.zeros_like(weights)
        blocks = row_blocks(self.shape[-1], self.block_size)
        for i, rows in enumerate(blocks):
            for cols in blocks[i:]:
                h = self.block(rows, cols)
                twice = 1.0 if cols is rows else 2.0
                total = total + twice * h.sum(-1).double().sum(-1)
                if product is not None:
                    h = h.detach()
                    product[..., rows, :] += h @ weights[..., cols, :]
                    if cols is not rows:
                        product[..., cols, :] += h.transpose(-1, -2) @ weights[..., rows, :]
        return total, product


def u_statistic(matrix: Tensor) -> Tensor:
    r"""U-statistic :math:`\frac{1}{n(n-1)} \sum_{i \ne j} H_{ij}` of a zero-diagonal
    ``(*, n, n)`` matrix."""
    n = matrix.shape[-1]
    return matrix.sum((-1, -2)) / (n * (n - 1))


def wild_bootstrap(
    matrix: Tensor | SymmetricBlocks,
    num_null: int = 500,
    generator: torch.Generator | None = None,
    weights: Tensor | None = None,
) -> Tensor:
    r"""Wild-bootstrap draws :math:`C_b = w_b^\top H w_b / (n (n-1))` of a degenerate U-statistic.

    All draws are one matrix product :math:`H W`, ``W`` of shape ``(n, B)``.

    Arguments:
        matrix: zero-diagonal ``(*, n, n)``, or a :class:`SymmetricBlocks`.
        num_null: ``B``.
        generator: random generator for the Rademacher multipliers.
        weights: explicit multipliers ``(*, n, B)`` (overrides the two above).

    Returns:
        ``(*, B)`` draws.
    """
    n = matrix.shape[-1]
    if weights is None:
        check_positive("num_null", num_null, integer=True)
        weights = rademacher(
            (*matrix.shape[:-2], n, num_null), generator, matrix.dtype, matrix.device
        )
    return (weights * (matrix.detach() @ weights)).sum(-2) / (n * (n - 1))


def bootstrap_p_value(statistic: Tensor, draws: Tensor) -> Tensor:
    r""":math:`p = (1 + \#\{C_b \ge \hat C\}) / (1 + B)` for ``statistic`` ``(*)`` and
    ``draws`` ``(*, B)``."""
    return monte_carlo_p_value(statistic, draws)
