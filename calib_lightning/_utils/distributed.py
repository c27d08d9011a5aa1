"""Gathering ``cat`` list states when some processes have no data, in an order that
does not depend on how the rows were split.

torchmetrics replaces an empty list state by a 1-D empty tensor of the metric's dtype
before gathering; when the other processes hold ``(n, D)`` float64 tensors the shapes
and dtypes disagree and the gather fails. :func:`shape_empty_list_states` runs first
(in a metric's ``_sync_dist``, which every process reaches in ``compute``): one small
``all_gather`` of each state's trailing shape and dtype, after which an empty process
holds a ``(0, *trailing)`` tensor of the right dtype. :func:`room_for_rows` bounds the
rows a process keeps in such states.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist
from torchmetrics import Metric

__all__ = [
    "canonical_order",
    "gather_rows",
    "max_over_processes",
    "room_for_rows",
    "shape_empty_list_states",
]

_DTYPES = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.bool,
)
_MAX_NDIM = 8


def _header(value: list[torch.Tensor]) -> torch.Tensor:
    """``[present, ndim, dtype, *shape[1:]]`` (padded) of a list state's first tensor."""
    header = torch.full((3 + _MAX_NDIM,), -1, dtype=torch.long)
    if value:
        first = value[0]
        if first.ndim > _MAX_NDIM + 1 or first.dtype not in _DTYPES:
            raise ValueError(
                f"list states must hold tensors of at most {_MAX_NDIM + 1} dimensions and a "
                f"dtype in {_DTYPES}, got {first.dtype} of shape {tuple(first.shape)}"
            )
        header[0], header[1], header[2] = 1, first.ndim, _DTYPES.index(first.dtype)
        header[3 : 3 + first.ndim - 1] = torch.tensor(first.shape[1:], dtype=torch.long)
    return header


def shape_empty_list_states(metric: Metric, names: tuple[str, ...], group: Any = None) -> None:
    """Give each empty list state in ``names`` the trailing shape and dtype of the
    processes that hold data (a no-op when every process or none holds data)."""
    headers = torch.stack([_header(getattr(metric, name)) for name in names])
    device = _collective_device(group)
    gathered = [torch.empty_like(headers, device=device) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, headers.to(device), group=group)
    for row, name in enumerate(names):
        if getattr(metric, name):
            continue
        present = [h[row].cpu() for h in gathered if int(h[row, 0]) == 1]
        if not present:
            continue
        ndim, dtype = int(present[0][1]), _DTYPES[int(present[0][2])]
        trailing = [int(s) for s in present[0][3 : 3 + ndim - 1]]
        setattr(metric, name, [torch.zeros(0, *trailing, dtype=dtype, device=metric.device)])


def max_over_processes(value: int, group: Any = None) -> int:
    """The largest ``value`` over all processes (every process calls it)."""
    device = _collective_device(group)
    values = torch.tensor([value], dtype=torch.long, device=device)
    dist.all_reduce(values, op=dist.ReduceOp.MAX, group=group)
    return int(values.item())


def gather_rows(local: torch.Tensor, group: Any = None) -> torch.Tensor:
    """Concatenate ``(n_r, *trailing)`` tensors of all processes in rank order (every
    process calls it; ``n_r`` may be 0)."""
    from torchmetrics.utilities.distributed import gather_all_tensors

    return torch.cat(gather_all_tensors(local, group=group))


def _collective_device(group: Any) -> torch.device:
    backend = dist.get_backend(group)
    if backend == "nccl" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def canonical_order(theta: torch.Tensor) -> torch.Tensor:
    """Row order sorting ``theta`` lexicographically (stable), independent of arrival order."""
    order = torch.arange(theta.shape[0], device=theta.device)
    for column in reversed(range(theta.shape[1])):
        key = theta[order, column]
        order = order[torch.sort(key, stable=True).indices]
    return order


def room_for_rows(metric: Metric, incoming: int, *stored: list[torch.Tensor]) -> int:
    """Rows of a batch of ``incoming`` that fit under ``metric.max_pairs`` next to the
    rows already in the ``stored`` list states; warns once (until ``metric._warned`` is
    reset) when rows are cut. Call it from ``update``: the warning names its caller."""
    room = metric.max_pairs - sum(t.shape[0] for state in stored for t in state)
    if room < incoming and not metric._warned:
        warnings.warn(
            f"{type(metric).__name__} keeps at most max_pairs={metric.max_pairs} pairs per "
            f"process; {incoming - max(room, 0)} further pairs are ignored",
            stacklevel=3,
        )
        metric._warned = True
    return max(room, 0)
