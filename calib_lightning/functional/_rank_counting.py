"""The counting kernels of the SBC ranks: how many draws fall below the truth.

:func:`count_signs` counts below and ties from the signs of the differences (any device
and dtype); :func:`chunk_numpy` counts a chunk of draws on the CPU with numpy
comparisons by cache-sized blocks of :data:`BLOCK_NUMBERS` numbers, :func:`chunk_torch`
elsewhere; :func:`break_ties` ranks a truth among the draws equal to it at random. The
ranks built on them are in :mod:`calib_lightning.functional.ranks`, which re-exports
:data:`BLOCK_NUMBERS` and :class:`RankWorkspace`.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor

__all__ = [
    "BLOCK_NUMBERS",
    "RankWorkspace",
    "break_ties",
    "chunk_numpy",
    "chunk_torch",
    "count_below",
    "count_signs",
]


#: numbers per block of draws that
#: :func:`~calib_lightning.functional.ranks.rank_draw_chunk` compares at once on the CPU:
#: the scratch arrays stay in the cache (a 512 KiB mask), where scratch arrays of a whole
#: chunk were fresh pages at every update
BLOCK_NUMBERS = 2**19


class RankWorkspace:
    """Reusable scratch tensors for a loop of
    :func:`~calib_lightning.functional.ranks.rank_draw_chunk` calls.

    Fresh multi-megabyte temporaries per chunk cost more in page faults than the
    arithmetic on them (glibc returns large blocks to the system); reusing buffers keeps
    the check's overhead over sampling small.
    """

    def __init__(self) -> None:
        self._buffers: dict[str, Tensor] = {}

    def __call__(self, name: str, like: Tensor, dtype: torch.dtype | None = None) -> Tensor:
        dtype = like.dtype if dtype is None else dtype
        buffer = self._buffers.get(name)
        if (buffer is None or buffer.numel() < like.numel() or buffer.dtype != dtype
                or buffer.device != like.device):  # fmt: skip
            buffer = torch.empty(like.numel(), dtype=dtype, device=like.device)
            self._buffers[name] = buffer
        return buffer[: like.numel()].view(like.shape)


def count_signs(diff: Tensor) -> tuple[Tensor, Tensor]:
    """``#{k : diff_k < 0}`` and ``#{k : diff_k = 0}`` over the first dimension of ``diff``
    ``(M, *)``, int64 ``(*)`` each; ``diff`` is scratch (overwritten by its sign).

    Two sums of ``s = sign(diff)`` give both counts: ``sum(s) = above - below`` and
    ``sum(|s|) = above + below``. A NaN counts as a tie (``sign(nan) = 0``), which the
    caller rules out.
    """
    m = diff.shape[0]
    exact = torch.float64 if m >= 2**24 or diff.dtype == torch.float64 else torch.float32
    sign = torch.sign(diff, out=diff)
    excess = sign.sum(0, dtype=exact)
    nonzero = sign.abs_().sum(0, dtype=exact)
    return ((nonzero - excess) / 2).round().long(), m - nonzero.round().long()


def break_ties(
    below: Tensor, ties: Tensor, generator: torch.Generator | None
) -> tuple[Tensor, bool]:
    """``below`` plus a uniform integer in ``[0, ties]`` per entry (the rank of a truth
    among draws equal to it, at random), and whether there was any tie."""
    if not bool(ties.any()):
        return below, False
    u = torch.rand(ties.shape, generator=generator, dtype=torch.float64)
    return below + (u.to(ties.device) * (ties + 1)).floor().long().clamp_max(ties), True


def count_below(diff: Tensor, generator: torch.Generator | None) -> tuple[Tensor, bool]:
    """``#{k : diff_k < 0}`` plus a uniform integer in ``[0, #{k : diff_k = 0}]`` over the
    first dimension of the scratch ``diff`` ``(M, *)``, and whether any ``diff_k`` was 0:
    a tie, or a NaN, which the caller rules out."""
    return break_ties(*count_signs(diff), generator)


def chunk_numpy(
    samples: Tensor, theta: Tensor, log_prob: Tensor, log_prob_theta: Tensor, head: int,
    work: RankWorkspace,
) -> tuple[Tensor, Tensor, Tensor, Tensor, bool]:  # fmt: skip
    """:func:`~calib_lightning.functional.ranks.rank_draw_chunk`'s counts
    ``(n, D + 1)`` (marginal, then joint: strictly below the truth, ties apart), moment
    sums ``(n, D)``, ties ``(n, D + 1)`` and whether the log-densities are all finite
    (their sum is), by numpy comparisons on CPU tensors (a NaN compares neither way: it
    counts as a tie).

    The draws go by blocks of at most :data:`BLOCK_NUMBERS` numbers: contiguous reads,
    and scratch arrays that stay in the cache instead of fresh pages of the chunk's size.
    The moments add the squares of the differences in their dtype (float32: a relative
    error of ``6e-8`` per term) in float64.
    """
    s, t = samples.detach().numpy(), theta.detach().numpy()
    lp, lpt = log_prob.detach().numpy(), log_prob_theta.detach().numpy()
    m, n, d = s.shape
    step = min(m, max(1, BLOCK_NUMBERS // max(n * d, 1)))
    # counts of a block in the smallest exact integer type (bytes: no conversion)
    count = np.uint8 if step < 2**8 else np.uint16 if step < 2**16 else np.int64
    below = np.zeros((2, n, d), dtype=np.int64)  # strictly below, strictly above
    energy = np.zeros((2, n), dtype=np.int64)
    total = np.zeros((n, d), dtype=np.float64)
    total_sq = np.zeros((n, d), dtype=np.float64)
    mask = work("mask", samples[:step], torch.bool).numpy()
    lp_mask = work("lp_mask", log_prob[:step], torch.bool).numpy()
    diff = work("diff", samples[: min(step, head)], torch.promote_types(samples.dtype, theta.dtype))
    lp_sum = 0.0
    for k in range(0, m, step):
        block, lp_block = s[k : k + step], lp[k : k + step]
        rows = block.shape[0]
        below[0] += _counted(np.less, block, t, mask[:rows], count)
        below[1] += _counted(np.greater, block, t, mask[:rows], count)
        # energy rank: #{k : -log q(theta_k) < -log q(theta*)}, i.e. log q(theta_k) > ...
        energy[0] += _counted(np.greater, lp_block, lpt, lp_mask[:rows], count)
        energy[1] += _counted(np.less, lp_block, lpt, lp_mask[:rows], count)
        lp_sum += float(lp_block.sum())  # the block is in the cache: a cheap pass
        if k < head:  # moments from the first draws
            first = np.subtract(s[k : min(k + step, head)], t, out=diff.numpy()[: head - k])
            total += np.add.reduce(first, 0, dtype=np.float64)
            total_sq += np.add.reduce(np.square(first, out=first), 0, dtype=np.float64)
    counts = torch.from_numpy(np.concatenate([below, energy[..., None]], -1))  # (2, n, D + 1)
    ties = m - counts[0] - counts[1]
    return (
        counts[0],
        torch.from_numpy(total),
        torch.from_numpy(total_sq),
        ties,
        math.isfinite(lp_sum),
    )


def _counted(compare: np.ufunc, a: np.ndarray, b: np.ndarray, mask: np.ndarray,
             count: type) -> np.ndarray:  # fmt: skip
    """``compare(a, b)`` (``(k, *)`` against ``(*)``) counted over the first axis in the
    integer type ``count``, through the boolean scratch ``mask``."""
    return compare(a, b, out=mask).view(np.uint8).sum(0, dtype=count)


def chunk_torch(
    samples: Tensor, theta: Tensor, log_prob: Tensor, log_prob_theta: Tensor, head: int,
    work: RankWorkspace,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """:func:`chunk_numpy` in torch (any device and dtype): from the signs of the
    differences to the truth (:func:`count_signs`)."""
    n, d = theta.shape
    total = torch.zeros(n, d, dtype=torch.float64, device=theta.device)
    total_sq = torch.zeros_like(total)
    dtype = torch.promote_types(samples.dtype, theta.dtype)
    diff = torch.sub(samples, theta, out=work("diff", samples, dtype))
    if head:  # moments from the first draws, in float64
        first = work("head64", diff[:head], torch.float64).copy_(diff[:head])
        total += first.sum(0)
        total_sq += first.square_().sum(0)
    marginal, ties = count_signs(diff)  # overwrites diff
    dtype = torch.promote_types(log_prob.dtype, log_prob_theta.dtype)
    energy = torch.sub(log_prob_theta, log_prob, out=work("energy", log_prob, dtype))
    joint, joint_ties = count_signs(energy)
    return (torch.cat([marginal, joint[:, None]], -1), total, total_sq,
            torch.cat([ties, joint_ties[:, None]], -1))  # fmt: skip
