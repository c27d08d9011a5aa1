"""Non-finite values at calibration pairs: which pairs, which kind, and one error
that counts them over the whole input.

A check that meets NaN or infinite values in a posterior's output names the affected
calibration pairs (:class:`NonFinitePairs`); a check working block by block gathers the
flags of every block first (:class:`PairAudit`), so that its message counts over all
``N`` pairs. Re-exported by :mod:`calib_lightning._checks`.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["NonFinitePairs", "PairAudit", "check_finite_pairs", "non_finite_kinds"]


#: how many row indices a message about non-finite pairs lists
_SHOWN_ROWS = 5


def non_finite_kinds(
    value: Tensor, *, pair_dim: int = 0, allow_negative_infinity: bool = False
) -> dict[str, Tensor]:
    """Which pairs hold which kind of non-finite entry: ``{"NaN": flags, "+inf": flags,
    "-inf": flags}``, each ``(n,)`` bool on the CPU, one flag per index of ``pair_dim``
    (kinds no pair has are left out; ``-inf`` not counted with
    ``allow_negative_infinity``)."""
    value = value.detach()
    if bool(torch.isfinite(value).all()):
        return {}
    n = value.shape[pair_dim] if value.ndim else 1
    masks = {"NaN": value.isnan(), "+inf": value == torch.inf}
    if not allow_negative_infinity:
        masks["-inf"] = value == -torch.inf
    kinds = {}
    for kind, mask in masks.items():
        flags = mask.movedim(pair_dim, 0).reshape(n, -1).any(1) if value.ndim else mask[None]
        if bool(flags.any()):
            kinds[kind] = flags.cpu()
    return kinds


class NonFinitePairs(ValueError):
    """The posterior gave non-finite values at some calibration pairs.

    The message counts the affected pairs and lists the first rows of ``theta`` and
    ``x``. Raised on a block of the pairs (``offset``: the block's first row), it
    carries the flags, so that a caller working block by block can count over the whole
    input instead (:class:`PairAudit`).

    Arguments:
        problems: what must hold -> kind of value (``"NaN"``, ``"+inf"``, ...) ->
            ``(n,)`` bool flags of the pairs of the block that broke it.
        offset: row of the block's first pair in the caller's input.
        num_pairs: ``N``, the pairs of that input; ``None``: the block's ``n``.
    """

    def __init__(
        self, problems: dict[str, dict[str, Tensor]], offset: int = 0, num_pairs: int | None = None
    ) -> None:
        self.problems, self.offset = problems, offset
        n = next(iter(next(iter(problems.values())).values())).numel()
        self.num_pairs = n if num_pairs is None else num_pairs
        sentences = [_pair_sentence(what, kinds, offset, self.num_pairs)
                     for what, kinds in problems.items()]  # fmt: skip
        super().__init__("; ".join(sentences))


def _pair_sentence(what: str, kinds: dict[str, Tensor], offset: int, num_pairs: int) -> str:
    """``"<what>, got NaN for 3, +inf for 2 of 200 calibration pairs (rows of theta and x:
    [7, 9, ...])"``."""
    counts = ", ".join(f"{kind} for {int(flags.sum())}" for kind, flags in kinds.items())
    bad = torch.stack(list(kinds.values())).any(0)
    rows = (bad.nonzero().flatten() + offset).tolist()
    where = (f"rows of theta and x: {rows}" if len(rows) <= _SHOWN_ROWS
             else f"first rows of theta and x: {rows[:_SHOWN_ROWS]}")  # fmt: skip
    return f"{what}, got {counts} of {num_pairs} calibration pairs ({where})"


def check_finite_pairs(
    what: str, value: Tensor, *, pair_dim: int = 0, allow_negative_infinity: bool = False
) -> Tensor:
    """Raise :class:`NonFinitePairs` if ``value`` holds NaN or infinite entries, counting
    the calibration pairs (indices of ``pair_dim``) affected; ``what`` says what must hold,
    e.g. ``"posterior log_prob at theta must be finite"``."""
    kinds = non_finite_kinds(value, pair_dim=pair_dim,
                             allow_negative_infinity=allow_negative_infinity)  # fmt: skip
    if kinds:
        raise NonFinitePairs({what: kinds})
    return value


class PairAudit:
    """Which of the ``N`` pairs of an input broke which check, gathered block by block.

    A check that works on blocks of pairs (chunks of draws) and meets non-finite values
    in one of them keeps going through the others, adding each block's flags, and then
    raises one :class:`NonFinitePairs` that counts over all ``N`` pairs and names rows in
    the input's numbering.

    Arguments:
        num_pairs: ``N``.
    """

    def __init__(self, num_pairs: int) -> None:
        self.num_pairs = num_pairs
        self.flags: dict[str, dict[str, Tensor]] = {}

    def add(self, start: int, problems: dict[str, dict[str, Tensor]]) -> None:
        """Add the flags ``(n,)`` of the block whose first pair is row ``start``."""
        for what, kinds in problems.items():
            for kind, flags in kinds.items():
                known = self.flags.setdefault(what, {})
                total = known.setdefault(kind, torch.zeros(self.num_pairs, dtype=torch.bool))
                total[start : start + flags.numel()] |= flags.cpu()

    def error(self) -> NonFinitePairs | None:
        """The error over all pairs added, ``None`` if none broke a check."""
        problems = {what: {kind: flags for kind, flags in kinds.items() if bool(flags.any())}
                    for what, kinds in self.flags.items()}  # fmt: skip
        problems = {what: kinds for what, kinds in problems.items() if kinds}
        return NonFinitePairs(problems, 0, self.num_pairs) if problems else None
