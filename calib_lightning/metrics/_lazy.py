"""States whose shapes depend on ``D``, allocated at the first update (rank-style metrics).

:class:`LazyDimension` holds the mechanics shared by :class:`~calib_lightning.RankCalibration`
and :class:`~calib_lightning.LatentCalibration`: the states in ``lazy_states`` start empty
unless ``num_dims`` is given, are allocated by the first update, and a process (or a
``forward`` batch) that saw no data is shaped like the others before states are merged or
gathered. torchmetrics has no public hook before a merge or a gather, so this overrides
its ``_reduce_states`` and ``_sync_dist``: the only place where an empty side can be
shaped.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import Tensor
from torchmetrics.utilities.distributed import gather_all_tensors

from calib_lightning._utils.distributed import max_over_processes, shape_empty_list_states
from calib_lightning.metrics._shapes import KeepShapes

__all__ = ["LazyDimension"]


class LazyDimension(KeepShapes):
    """A metric whose ``lazy_states`` (``histogram`` first, ``(D + extra_rows, K)``) depend
    on ``D``.

    Subclasses define ``lazy_states``, ``_zero_states(d, device)`` returning those states
    in that order (empty when ``d = 0``), and ``_dims()``, the ``D`` of the allocated
    states (0 when empty); ``list_states`` are ``cat`` list states to shape when empty;
    ``extra_rows`` the rows of ``histogram`` beyond one per parameter (the joint rank's).
    """

    lazy_states: ClassVar[tuple[str, ...]] = ("histogram",)
    list_states: ClassVar[tuple[str, ...]] = ()
    extra_rows: ClassVar[int] = 1
    histogram: Tensor

    def _zero_states(self, d: int, device: torch.device | None = None) -> tuple[Tensor, ...]:
        raise NotImplementedError

    def _dims(self) -> int:
        raise NotImplementedError

    def _allocate(self, d: int) -> None:
        """Allocate zero states for ``D = d``, or raise if ``num_dims`` or earlier updates
        had another ``D``."""
        if self.histogram.shape[0] == 0:
            zeros = self._zero_states(d, self.histogram.device)
            for name, value in zip(self.lazy_states, zeros, strict=True):
                setattr(self, name, value)
        elif self.histogram.shape[0] != d + self.extra_rows and not bool(self.histogram.any()):
            raise ValueError(  # no update yet: D came from the num_dims argument
                f"num_dims must equal theta's D = {d}, got num_dims = "
                f"{self.histogram.shape[0] - self.extra_rows}"
            )
        elif self.histogram.shape[0] != d + self.extra_rows:
            raise ValueError(
                f"theta must have D = {self.histogram.shape[0] - self.extra_rows} columns as "
                f"in earlier updates, got D = {d}"
            )

    def _reduce_states(self, incoming_state: dict[str, Any]) -> None:
        """Merge states like torchmetrics, where one side may be not yet allocated (empty)."""
        incoming = dict(incoming_state)
        incoming_empty = incoming["histogram"].numel() == 0
        local_empty = self.histogram.numel() == 0
        for attr in self.lazy_states:
            if incoming_empty:
                incoming[attr] = torch.zeros_like(getattr(self, attr))
            elif local_empty:
                setattr(self, attr, torch.zeros_like(incoming[attr]))
        super()._reduce_states(incoming)

    def _sync_dist(self, dist_sync_fn: Any = gather_all_tensors, process_group: Any = None) -> None:
        # a process that saw no data (and got no num_dims) allocates zero states of the
        # others' D first, so that every process gathers tensors of one shape
        group = process_group or self.process_group
        d = max_over_processes(self._dims(), group)
        if d and self.histogram.numel() == 0:
            self._allocate(d)
        if self.list_states:
            shape_empty_list_states(self, self.list_states, group)
        super()._sync_dist(dist_sync_fn, process_group)
