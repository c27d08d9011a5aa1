r"""The memory budget of the chunked evaluations, and the measured peak that sizes chunks.

Every check that draws from a posterior, evaluates log-densities or solves ODEs does it
in chunks (:mod:`calib_lightning.evaluation`). How many units (draws at a pair, ODE
solves) go in one chunk is set by a **memory budget** in bytes (default
:data:`DEFAULT_MEMORY_BUDGET`, 256 MiB; change it with :func:`set_memory_budget`): a
:class:`ChunkSizer` measures what the first chunks allocate at their peak and sizes the
next ones so that one chunk's peak stays near the budget.

**Measuring** (:func:`measure_peak`, with the garbage collector paused). On CUDA,
``torch.cuda.max_memory_allocated`` above the memory allocated before the chunk, read
again when the next chunk is sized, so that it includes what the caller allocated while
working on the chunk, less what it keeps (:meth:`ChunkSizer.keep`). On the CPU,
:class:`TensorPeak`: a ``TorchFunctionMode`` that adds up the bytes of the tensor
storages every torch function returns and drops them when they are freed, so its peak
is the most tensor memory alive at once during the chunk.

**Sizing.** The first chunk is a probe of :data:`PROBE_UNITS` units
(:data:`LATENT_PROBE_UNITS` pairs for latents); its peak per unit sizes the later
chunks. On CUDA the second chunk is measured too and the larger of the two peaks per
unit sizes the rest; on the CPU only the probe is measured, and its peak per unit is
taken :data:`PROBE_MARGIN` times. Bytes a check keeps until it ends (an output filled
chunk by chunk, draws shared by later checks) come off the budget of its chunks
(:meth:`ChunkSizer.keep`). After a chunk of at least an eighth of the budget and
:data:`COLLECT_BYTES`, the garbage collector runs on the young generations and, on the
CPU, the C heap's free pages go back to the system (glibc's ``malloc_trim``). Sizes
depend only on the operations run, so a seeded check gives the same chunks, hence the
same numbers, every time.

Why it is built this way: ``docs/design.md``, "Memory: a budget, measured"; the peaks
and times it gives: ``examples/benchmarks/results/memory.md`` (CPU) and
``examples/benchmarks/results/memory_cuda.md`` (GPU).
"""

from __future__ import annotations

import ctypes
import functools
import gc
import weakref
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

__all__ = [
    "COLLECT_BYTES",
    "DEFAULT_MEMORY_BUDGET",
    "LATENT_PROBE_UNITS",
    "PROBE_MARGIN",
    "PROBE_UNITS",
    "ChunkSizer",
    "TensorPeak",
    "assembled_draws",
    "draw_blocks",
    "get_memory_budget",
    "measure_peak",
    "set_memory_budget",
]

#: default bytes one chunk of a check may allocate at its peak (256 MiB)
DEFAULT_MEMORY_BUDGET = 256 * 2**20
#: units (draws at a pair, ODE solves) in the first, probing chunk
PROBE_UNITS = 256
#: pairs in the probe of a latent pass: an ODE solve (sbi's FMPE and NPSE) takes as many
#: steps for 32 pairs as for 1,000, so a small probe halves its extra cost
LATENT_PROBE_UNITS = 32
#: on the CPU, where only the probe is measured, its peak per unit times this sizes chunks
#: (resident memory: about 1.8x the tensors' peak, and up to 1.3x between chunks)
PROBE_MARGIN = 2.5
#: a chunk measured to need this many bytes is followed by ``gc.collect(1)`` (32 MiB)
COLLECT_BYTES = 32 * 2**20

_BUDGET = [DEFAULT_MEMORY_BUDGET]
T = TypeVar("T")


def check_budget(nbytes: object) -> int:
    """``nbytes`` as an int of at least 1 MiB, else a ``ValueError``."""
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 2**20:
        raise ValueError(
            f"memory budget must be an int number of bytes >= 2**20 (1 MiB), got {nbytes!r}"
        )
    return nbytes


def get_memory_budget() -> int:
    """The bytes one chunk of a check may allocate (:func:`set_memory_budget`)."""
    return _BUDGET[0]


class set_memory_budget:
    """Set the bytes one chunk of every check may allocate at its peak.

    Takes effect at once; used as a context manager, the previous budget comes back on
    exit. A GPU's or a laptop's spare memory bounds it; a larger budget makes fewer,
    larger chunks (sampling is about as fast from a few tens of MiB on).

    Arguments:
        nbytes: the budget in bytes, an int of at least ``2**20``.

    Example:
        >>> import calib_lightning as cl
        >>> with cl.set_memory_budget(64 * 2**20):
        ...     cl.get_memory_budget() // 2**20
        64
        >>> cl.get_memory_budget() // 2**20
        256
    """

    def __init__(self, nbytes: int) -> None:
        self.previous = _BUDGET[0]
        _BUDGET[0] = check_budget(nbytes)

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        _BUDGET[0] = self.previous


class TensorPeak(TorchFunctionMode):
    """Peak bytes of tensor storage alive at once while active (CPU or any device).

    Attributes:
        now: bytes of the storages created inside and still alive.
        peak: the most ``now`` has been.
    """

    def __init__(self) -> None:
        super().__init__()
        self.now = self.peak = 0
        self._live: dict[int, Any] = {}

    def _free(self, key: int, nbytes: int, *_: object) -> None:
        if self._live.pop(key, None) is not None:
            self.now -= nbytes

    def _track(self, value: torch.Tensor) -> None:
        if value.device.type == "meta":
            return
        storage = value.untyped_storage()
        key, nbytes = storage.data_ptr(), storage.nbytes()
        if nbytes and key not in self._live:
            # a weak reference whose callback forgets the storage: cheaper than finalize
            self._live[key] = weakref.ref(storage, functools.partial(self._free, key, nbytes))
            self.now += nbytes
            self.peak = max(self.peak, self.now)

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        # most calls return one tensor or no container (a shape, a number): no tree walk
        if isinstance(out, torch.Tensor):
            self._track(out)
        elif isinstance(out, (tuple, list, dict)) and not isinstance(out, torch.Size):
            for value in tree_flatten(out)[0]:
                if isinstance(value, torch.Tensor):
                    self._track(value)
        return out


def measure_peak(run: Callable[[], T], device: torch.device | None = None) -> tuple[T, int]:
    """``run()`` and the peak bytes it allocated above what was allocated before: on a
    CUDA ``device`` from the caching allocator's statistics, else by :class:`TensorPeak`.

    The garbage collector is paused meanwhile, so the peak includes every tensor that
    reference cycles keep until a collection (a zuko flow's distributions hold their
    intermediates in cycles): the most the same work can hold whenever the collector
    runs (``examples/benchmarks/results/memory.md``).
    """
    paused = gc.isenabled()
    gc.disable()
    try:
        if device is not None and device.type == "cuda":
            torch.cuda.synchronize(device)
            before = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
            out = run()
            return out, _cuda_peak_since(device, before)
        with TensorPeak() as tracker:
            out = run()
        return out, tracker.peak
    finally:
        if paused:
            gc.enable()


def _cuda_peak_since(device: torch.device | None, before: int) -> int:
    """The CUDA allocator's peak since its last reset, above ``before`` bytes."""
    torch.cuda.synchronize(device)
    return max(0, torch.cuda.max_memory_allocated(device) - before)


class ChunkSizer:
    """How many units (draws at a pair, ODE solves) the next chunk may hold.

    :meth:`size` gives the next chunk's size, :meth:`run` runs it, measuring the first
    chunk (two on CUDA; module docstring).

    Arguments:
        device: where the chunks run (CUDA: the allocator's statistics).
        budget: bytes per chunk; ``None``: :func:`get_memory_budget`.
        fixed_units: instead of a budget, this many units per chunk, unmeasured (the
            checks' explicit ``max_chunk_elements`` / ``chunk_size`` arguments).
        probe_units: units in the first, measured chunk.
    """

    def __init__(
        self,
        device: torch.device | None = None,
        budget: int | None = None,
        *,
        fixed_units: int | None = None,
        probe_units: int = PROBE_UNITS,
    ) -> None:
        self.device, self.fixed_units, self.probe_units = device, fixed_units, probe_units
        self.budget = get_memory_budget() if budget is None else check_budget(budget)
        self.kept = 0  # bytes the check keeps until it ends (keep)
        self.per_unit: float | None = None
        self.measured = 0
        self.chunks = 0
        self.last = False  # the next chunk, sized before any was measured, is the last
        # CUDA: (bytes allocated before, units, bytes kept before) of a measured chunk
        # whose peak is read again at the next size(), to include what its consumer
        # allocated meanwhile
        self._open: tuple[int, int, int] | None = None

    def _settle(self) -> None:
        """Close an open CUDA measurement: the allocator's peak since the chunk began
        covers the chunk and the work its caller did on it (ranking the draws, scoring
        them) until asking for the next chunk, which the chunk's own peak misses. What the
        caller keeps meanwhile (:meth:`keep`: the output it fills chunk by chunk, allocated
        after the probe) is counted there, not per unit (as a per-unit cost it would
        shrink the later chunks: ``examples/benchmarks/results/memory_cuda.md``)."""
        if self._open is None:
            return
        before, units, kept = self._open
        self._open = None
        peak = max(0, _cuda_peak_since(self.device, before) - (self.kept - kept))
        self.per_unit = max(self.per_unit or 0.0, peak / max(units, 1))

    def size(self, limit: int) -> int:
        """Units for the next chunk, at most ``limit``: the probe first, then what the
        budget affords at the measured bytes per unit (at least 1)."""
        if self.fixed_units is not None:
            return max(1, min(limit, self.fixed_units))
        self._settle()
        if self.per_unit is None:
            self.last = limit <= self.probe_units  # what is left fits the probe: nothing to size
            return max(1, min(limit, self.probe_units))
        available = max(self.budget // 4, self.budget - self.kept, 2**20)
        return max(1, min(limit, int(available // max(self.per_unit, 1.0))))

    def keep(self, nbytes: int) -> None:
        """Count ``nbytes`` the check keeps until it ends (an output filled chunk by chunk,
        draws shared by later checks) against the budget: the later chunks get the rest,
        at least a quarter of it."""
        self.kept += nbytes

    def run(self, units: int, chunk: Callable[[], T]) -> T:
        """``chunk()`` (of ``units`` units), measured while the sizes are being learnt."""
        self.chunks += 1
        cuda = self.device is not None and self.device.type == "cuda"
        last, self.last = self.last, False
        if self.measured >= (2 if cuda else 1) or self.fixed_units is not None or last:
            out = chunk()  # (a last chunk within the probe's size is not measured: on the
            # CPU the tracker's Python time per torch call doubles an ODE solve's)
        else:
            self._settle()
            before = torch.cuda.memory_allocated(self.device) if cuda else 0
            out, peak = measure_peak(chunk, self.device)
            per_unit = peak / max(units, 1) * (1.0 if cuda else PROBE_MARGIN)
            self.per_unit = per_unit if self.per_unit is None else max(self.per_unit, per_unit)
            self.measured += 1
            self._open = (before, units, self.kept) if cuda else None
        if self.per_unit is not None and self.per_unit * units >= max(
            self.budget / 8, COLLECT_BYTES
        ):
            # a large chunk's garbage in reference cycles (zuko's), freed now: the young
            # generations, where it is (a full collection walks every object of the
            # process: 0.3 s a chunk with sbi imported, half of a TARP check on a zuko NSF
            # at D = 2 on the CPU, and most of the chunks' extra time on a GPU)
            gc.collect(1)
            if not cuda:
                _trim_heap()
        return out


def _trim_heap() -> None:
    """Hand the C heap's free pages back to the system (glibc's ``malloc_trim``; nothing
    elsewhere): without it, freed chunks stay resident in a fragmented heap and the
    process's peak grows with the number of chunks."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim() -> Any:
    """glibc's ``malloc_trim``, or ``None`` where the C library has none."""
    try:
        return getattr(ctypes.CDLL(None), "malloc_trim", None)
    except OSError:  # pragma: no cover - no C library to load
        return None


def draw_blocks(
    num_pairs: int, num_draws: int, sizer: ChunkSizer, *, whole_pairs: bool = False
) -> Iterator[tuple[slice, int, int]]:
    """``(rows, first_draw, count)`` of each sampling call: blocks of pairs, and within a
    block the draws of each call, sized by ``sizer`` when reached (so after the calls
    before were measured). A block holds as many pairs as ``sizer.size`` affords whole
    (``num_draws`` draws each), at least one, whose draws are split only when one pair's
    exceed it, never with ``whole_pairs`` (samples-only posteriors draw a pair at once).
    """
    start = 0
    while start < num_pairs:
        units = sizer.size((num_pairs - start) * num_draws)
        rows = slice(start, start + max(1, min(num_pairs - start, units // num_draws)))
        done = 0
        while done < num_draws:
            left = num_draws - done
            count = left if whole_pairs or rows.stop - rows.start > 1 else sizer.size(left)
            yield rows, done, count
            done += count
        start = rows.stop


def assembled_draws(
    draw: Callable[[torch.Tensor, int], tuple[torch.Tensor, ...]],
    x: torch.Tensor,
    s: int,
    sizer: ChunkSizer,
    whole: bool,
) -> tuple[torch.Tensor, ...]:
    """``draw(x, s)``'s outputs (each ``(s, N, ...)``) assembled from calls that ``sizer``
    sizes (:func:`draw_blocks`; ``whole``: all draws of a pair in one call), no gradient;
    one call's outputs as they are, without a copy."""
    out: list[torch.Tensor] | None = None
    with torch.no_grad():
        for rows, done, take in draw_blocks(x.shape[0], s, sizer, whole_pairs=whole):
            parts = sizer.run(
                take * (rows.stop - rows.start), lambda rows=rows, take=take: draw(x[rows], take)
            )
            if out is None:
                if rows.stop - rows.start == x.shape[0] and take == s:
                    return parts  # one call: no copy
                out = [p.new_empty(s, x.shape[0], *p.shape[2:]) for p in parts]
                sizer.keep(sum(o.numel() * o.element_size() for o in out))  # kept meanwhile
            for o, p in zip(out, parts, strict=True):
                o[done : done + take, rows] = p
        return tuple(out) if out is not None else draw(x, s)  # (no observations)
