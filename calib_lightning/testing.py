"""Helpers for testing metrics under ``torch.distributed`` on the CPU.

:func:`run_distributed` forks ``world_size`` processes that join one gloo process
group and run a function; it returns what each rank returned. Forking (rather than
spawning) lets tests pass local closures; it is unsafe once CUDA is initialised in the
process (a forked rank cannot use CUDA), and on a machine with a GPU once autograd has
run a backward pass in it (autograd then keeps a thread per device, and a forked rank's
backward raises). :func:`fork_is_safe` says whether it may run and
:func:`run_distributed` refuses otherwise.
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import queue as queues
import sys
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from calib_lightning._utils.validation import check_positive

__all__ = ["fork_is_safe", "run_distributed"]


def fork_is_safe(timeout: float = 30.0) -> bool:
    """Whether this process may fork ranks that use autograd.

    False where CUDA is initialised in it, or where a forked child cannot run a backward
    pass: autograd starts a thread per accelerator at the first backward of a process on a
    machine with a GPU, even on CPU tensors, and refuses a backward in a fork made after
    it. That second case has no public flag, so a forked child tries a one-element backward
    and reports (a child still running after ``timeout`` seconds counts as unsafe).
    """
    if torch.cuda.is_initialized():
        return False
    probe = mp.get_context("fork").Process(target=_backward_probe)
    probe.start()
    probe.join(timeout)
    if probe.is_alive():
        probe.kill()
        probe.join()
        return False
    return probe.exitcode == 0


def _backward_probe() -> None:
    """A forked child's one-element backward pass; exit code 1 if autograd refuses it."""
    try:
        torch.ones(1, requires_grad=True).sum().backward()
    except RuntimeError:
        sys.exit(1)


def _worker(
    fn: Callable[[int, int], Any], rank: int, world_size: int, init_file: str, queue: Any
) -> None:
    try:
        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size
        )
        try:
            result = fn(rank, world_size)
        finally:
            dist.destroy_process_group()
        buffer = io.BytesIO()
        torch.save(_to_plain(result), buffer)  # bytes: no shared-memory tensor handles
        queue.put((rank, "ok", buffer.getvalue()))
    except BaseException:  # report any failure to the parent instead of hanging it
        queue.put((rank, "error", traceback.format_exc()))


def _to_plain(value: Any) -> Any:
    """Tensors become detached CPU clones."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().clone()
    if isinstance(value, dict):
        return {k: _to_plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_to_plain(v) for v in value)
    return value


def run_distributed(
    fn: Callable[[int, int], Any], world_size: int = 2, timeout: float = 120.0
) -> list[Any]:
    """Run ``fn(rank, world_size)`` in ``world_size`` processes joined by a gloo group.

    Arguments:
        fn: the function each rank runs; it may be a closure.
        world_size: number of processes.
        timeout: seconds to wait for all ranks.

    Returns:
        The return values, indexed by rank.

    Raises:
        RuntimeError: with the rank's traceback if any rank failed; naming the ranks
            that sent nothing within ``timeout`` and their exit codes; before
            forking, if a forked rank could not use CUDA or autograd
            (:func:`fork_is_safe`).
    """
    check_positive("world_size", world_size, integer=True)
    check_positive("timeout", timeout)
    if not fork_is_safe():
        raise RuntimeError(
            "run_distributed forks its ranks, and a fork of this process could not use CUDA "
            "or autograd (CUDA is initialised in it, or autograd's device threads started "
            "at a backward pass on this GPU machine); run it in a fresh process"
        )
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        procs = [
            ctx.Process(target=_worker, args=(fn, rank, world_size, init_file, queue))
            for rank in range(world_size)
        ]
        for proc in procs:
            proc.start()
        results: dict[int, Any] = {}
        try:
            for _ in range(world_size):
                try:
                    rank, status, value = queue.get(timeout=timeout)
                except queues.Empty:
                    missing = [r for r in range(world_size) if r not in results]
                    codes = {r: procs[r].exitcode for r in missing}
                    raise RuntimeError(
                        f"rank(s) {missing} sent no result within {timeout:g} s; exit codes "
                        f"{codes} (None: still running, e.g. blocked in a collective or on "
                        "a lock inherited by the fork)"
                    ) from None
                if status != "ok":
                    raise RuntimeError(f"rank {rank} failed:\n{value}")
                results[rank] = torch.load(io.BytesIO(value), weights_only=False)
        finally:
            for proc in procs:
                proc.join(timeout=10)
                if proc.is_alive():
                    proc.kill()
    return [results[rank] for rank in range(world_size)]
