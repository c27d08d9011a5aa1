r"""Posterior draws shared by the checks of one epoch: one sampling pass per observation.

:class:`SharedDraws` wraps a posterior for the duration of one check (one model state):
the first request for draws at an observation tensor ``x`` draws them (with their
log-densities) and keeps them; later requests at the same ``x``, or at rows of it, and
for at most as many draws, get the first ``n`` of them; a request for more draws the
missing ones only. :func:`calib_lightning.evaluation.draws` and
:func:`~calib_lightning.evaluation.draw_chunks` serve from it when handed a
:class:`SharedDraws`; every other method is the wrapped posterior's.

**Which x.** An entry is keyed by the tensor it was drawn at: a request matches when it
is that tensor or a slice of its rows (same storage, layout and dtype), so callers must
hand the *same* tensors (the callbacks share their moved calibration batches through
:meth:`SharedDraws.batches` for that). Equal data in another tensor is drawn again.

**Validity.** Each consumer still sees independent draws from :math:`q(\cdot \mid x)`,
independent of :math:`\theta^*` given ``x``: every test stays valid. Two tests on the
same draws are dependent; ``cl.diagnose``'s overall verdict combines them by
Bonferroni's bound, valid under any dependence. A metric that needs two *independent*
sets at one ``x`` must ask for ``2 n`` draws and split them.

**Samples only.** For a posterior without a cheap ``log_prob``
(:func:`~calib_lightning.posteriors.density_draws`) the cache holds draws only, draws with
``sample`` and serves chunks with ``None`` log-densities and all draws of a pair in one
chunk, as :func:`~calib_lightning.evaluation.draw_chunks` does.

**Memory.** The cache holds at most ``max_elements`` numbers (draws, their
log-densities and the shared calibration batches); a request that would exceed it is
drawn unshared, chunked as without sharing. Drawing into the cache is chunked like
:func:`~calib_lightning.evaluation.draw_chunks` (from the memory budget, or
``max_chunk_elements`` per call).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any
from weakref import WeakKeyDictionary

import torch
from torch import Tensor, nn

from calib_lightning.evaluation._memory import ChunkSizer, draw_blocks
from calib_lightning.posteriors.base import Posterior, density_draws

__all__ = [
    "MAX_SHARED_ELEMENTS",
    "SharedDraws",
    "fingerprint",
    "release_shared_draws",
    "row_range",
    "same_data",
    "shared_draws_for",
]

#: default bound on the numbers a :class:`SharedDraws` holds (128 MiB in float32)
MAX_SHARED_ELEMENTS = 2**25

Chunk = tuple[int, Tensor, Tensor | None, Tensor, Tensor | None, int]  # an evaluation.DrawChunk
Fresh = Callable[[Tensor, Tensor, int, int | None], Iterator[Chunk]]
#: numbers per chunk served from held draws (views) when no explicit bound is given
REPLAY_ELEMENTS = 2**20


def row_range(base: Tensor, view: Tensor) -> slice | None:
    """The rows of ``base`` that ``view`` is (``base`` itself or ``base[a:b]``), else ``None``."""
    if view is base:
        return slice(0, base.shape[0])
    if (
        view.dtype != base.dtype
        or view.device != base.device
        or view.ndim != base.ndim
        or view.shape[1:] != base.shape[1:]
        or view.stride() != base.stride()
        or view.untyped_storage().data_ptr() != base.untyped_storage().data_ptr()
    ):
        return None
    step, offset = base.stride(0), view.storage_offset() - base.storage_offset()
    if step <= 0 or offset % step:
        return None
    start = offset // step
    if start < 0 or start + view.shape[0] > base.shape[0]:
        return None
    return slice(start, start + view.shape[0])


def same_data(a: Any, b: Any) -> bool:
    """``a is b``, two tensors of one shape, dtype and device holding equal values, or
    two equal non-tensors."""
    if a is b:
        return True
    if not (isinstance(a, Tensor) and isinstance(b, Tensor)):
        return not isinstance(a, Tensor) and not isinstance(b, Tensor) and a == b
    return (
        a.shape == b.shape
        and a.dtype == b.dtype
        and a.device == b.device
        and bool(torch.equal(a, b))
    )


class _Entry:
    """Draws held at one observation tensor ``x``: segments ``(s_k, N, D)`` of draws and
    ``(s_k, N)`` log-densities (``None`` for a samples-only posterior), ``held = sum s_k``."""

    def __init__(self, x: Tensor, width: int | None = None) -> None:
        self.x, self.width = x, width
        self.samples: list[Tensor] = []
        self.log_prob: list[Tensor | None] = []
        self.held = 0

    def numel(self) -> int:
        return sum(
            s.numel() + (0 if p is None else p.numel())
            for s, p in zip(self.samples, self.log_prob, strict=True)
        )

    def take(self, first: int, count: int, rows: slice) -> tuple[Tensor, Tensor | None]:
        """Draws ``first .. first + count`` at ``rows`` (views when one segment holds them)."""
        parts, at = [], 0
        for s, p in zip(self.samples, self.log_prob, strict=True):
            lo, hi = max(first, at), min(first + count, at + s.shape[0])
            if lo < hi:
                parts.append(
                    (s[lo - at : hi - at, rows], None if p is None else p[lo - at : hi - at, rows])
                )
            at += s.shape[0]
        if len(parts) == 1:
            return parts[0]
        log_prob = [p for _, p in parts]
        joined = None if None in log_prob else torch.cat(log_prob)  # type: ignore[arg-type]
        return torch.cat([s for s, _ in parts]), joined


class SharedDraws(Posterior):
    """A posterior whose draws at the same observations are made once (module docstring).

    Arguments:
        posterior: the wrapped :class:`~calib_lightning.posteriors.Posterior`.
        max_elements: bound on the numbers held.

    Attributes:
        drawn: draws made so far, counted per observation (``draws * rows``).
    """

    def __init__(self, posterior: Posterior, *, max_elements: int = MAX_SHARED_ELEMENTS) -> None:
        super().__init__(posterior.module)
        self.posterior, self.max_elements = posterior, max_elements
        self.drawn = 0
        self._entries: list[_Entry] = []
        self._batches: list[tuple[tuple[Any, ...], list[tuple[Tensor, Tensor]]]] = []

    # -- the wrapped posterior ----------------------------------------------------------
    @property
    def capabilities(self) -> frozenset[str]:  # type: ignore[override]
        return self.posterior.capabilities

    @property
    def costly(self) -> frozenset[str]:  # type: ignore[override]
        return self.posterior.costly

    @property
    def dtype(self) -> torch.dtype | None:
        return self.posterior.dtype

    def event_size(self) -> int | None:
        return self.posterior.event_size()

    def context_shape(self) -> tuple[int, ...] | None:
        return self.posterior.context_shape()

    def sample(self, x: Tensor, num_posterior_samples: int) -> Tensor:
        return self.posterior.sample(x, num_posterior_samples)

    def sample_and_log_prob(self, x: Tensor, num_posterior_samples: int) -> tuple[Tensor, Tensor]:
        return self.posterior.sample_and_log_prob(x, num_posterior_samples)

    def log_prob(self, theta: Tensor, x: Tensor) -> Tensor:
        return self.posterior.log_prob(theta, x)

    def to_latent(self, theta: Tensor, x: Tensor) -> Tensor:
        return self.posterior.to_latent(theta, x)

    def score(self, theta: Tensor, x: Tensor, *, create_graph: bool = False) -> Tensor:
        return self.posterior.score(theta, x, create_graph=create_graph)

    # -- shared batches -------------------------------------------------------------------
    def batches(
        self, key: tuple[Any, ...], make: Callable[[], Iterator[tuple[Tensor, Tensor]]]
    ) -> Iterator[tuple[Tensor, Tensor]]:
        """The batches ``make()`` yields, made once per ``key`` (compared with
        :func:`same_data`) and kept, so that every caller with the same key gets the same
        tensors and so the same draws; made afresh (unshared) beyond the memory bound."""
        for held, batches in self._batches:
            if len(held) == len(key) and all(map(same_data, held, key)):
                return iter(batches)
        size = sum(t.numel() for t in key if isinstance(t, Tensor))  # bounds the shard's
        if self.num_elements + size > self.max_elements:
            return make()  # lazily, one batch at a time, as without sharing
        batches = list(make())
        self._batches.append((key, batches))
        self._entries.extend(_Entry(x, t.shape[-1]) for t, x in batches)
        return iter(batches)

    # -- draws ------------------------------------------------------------------------------
    @property
    def num_elements(self) -> int:
        """Numbers held: draws, log-densities and shared batches (at most ``max_elements``)."""
        batches = sum(t.numel() + x.numel() for _, held in self._batches for t, x in held)
        return batches + sum(e.numel() for e in self._entries)

    def _locate(self, x: Tensor) -> tuple[_Entry, slice]:
        for entry in self._entries:
            rows = row_range(entry.x, x)
            if rows is not None:
                return entry, rows
        entry = _Entry(x)
        self._entries.append(entry)
        return entry, slice(0, x.shape[0])

    def _fits(self, entry: _Entry, count: int, width: int | None) -> bool:
        width = width or entry.width or self.event_size() or 1
        more = (count - entry.held) * entry.x.shape[0] * (width + 1)
        return self.num_elements + more <= self.max_elements

    def _extend(self, entry: _Entry, count: int, max_chunk_elements: int | None) -> bool:
        """Draw ``count - held`` more at every row of the entry, in chunks sized from the
        memory budget (or ``max_chunk_elements`` numbers per call). When ``D`` is not known
        yet, one row is drawn first to learn it; if the draws then exceed the bound,
        nothing is kept and this returns ``False``."""
        new, x, n = count - entry.held, entry.x, entry.x.shape[0]
        d, dense = entry.width or self.event_size(), density_draws(self.posterior)
        sizer = ChunkSizer(
            x.device,
            fixed_units=None
            if max_chunk_elements is None or d is None
            else max(1, max_chunk_elements // d),
        )
        if d is None:
            sizer.fixed_units = 1 if max_chunk_elements is not None else None
        samples: Tensor | None = None
        log_prob: Tensor | None = None
        for rows, done, take in draw_blocks(n, new, sizer, whole_pairs=not dense):
            xc = x[rows]
            k = xc.shape[0]
            s, p = sizer.run(
                take * k,
                lambda xc=xc, take=take: (
                    self.posterior.sample_and_log_prob(xc, take)
                    if dense
                    else (self.posterior.sample(xc, take), None)
                ),
            )
            shape = (take, k) if p is None else tuple(p.shape)
            if s.ndim != 3 or s.shape[:2] != (take, k) or shape != (take, k):
                raise ValueError(
                    "posterior.sample_and_log_prob must return shapes (S, N, D) and "
                    f"(S, N) with (S, N) = {(take, k)}, got {tuple(s.shape)} and {shape}"
                )
            if samples is None:
                if d is None and not self._fits(entry, count, s.shape[-1]):
                    return False
                d = entry.width = s.shape[-1]
                if max_chunk_elements is not None:
                    sizer.fixed_units = max(1, max_chunk_elements // d)
                samples = s.new_empty(new, n, d)
                log_prob = None if p is None else p.new_empty(new, n)
                sizer.keep(samples.nbytes + (0 if log_prob is None else log_prob.nbytes))
            samples[done : done + take, rows] = s
            if log_prob is not None:
                log_prob[done : done + take, rows] = p
            self.drawn += take * k
        entry.samples.append(samples)
        entry.log_prob.append(log_prob)
        entry.held = count
        return True

    def hold(self, x: Tensor, samples: Tensor, log_prob: Tensor | None) -> None:
        """Keep ``samples (S, N, D)`` (and their log-densities ``(S, N)``, ``None`` for a
        samples-only posterior) as the draws at ``x (N, *X)``: draws made elsewhere, e.g.
        one set of latent draws pushed through two posteriors."""
        entry, rows = self._locate(x)
        if entry.held or rows != slice(0, x.shape[0]):
            raise ValueError("x must be a tensor this cache holds no draws at, got one it does")
        if samples.ndim != 3 or samples.shape[1] != x.shape[0]:
            raise ValueError(
                f"samples must have shape (S, N, D) with N = {x.shape[0]}, got "
                f"{tuple(samples.shape)}"
            )
        entry.width = samples.shape[-1]
        entry.samples.append(samples)
        entry.log_prob.append(log_prob if density_draws(self.posterior) else None)
        entry.held = samples.shape[0]

    def serve_draws(
        self, x: Tensor, count: int, max_chunk_elements: int | None = None
    ) -> Tensor | None:
        """The first ``count`` draws ``(count, N, D)`` at ``x`` (a fresh tensor), drawing the
        missing ones; ``None`` beyond the memory bound (the caller draws unshared)."""
        entry, rows = self._locate(x)
        if entry.held < count and not (
            self._fits(entry, count, None) and self._extend(entry, count, max_chunk_elements)
        ):
            return None
        return entry.take(0, count, rows)[0].clone()

    def serve_chunks(
        self, theta: Tensor, x: Tensor, count: int, max_chunk_elements: int | None, fresh: Fresh
    ) -> Iterator[Chunk] | None:
        """:func:`~calib_lightning.evaluation.draw_chunks`'s chunks, as tuples, from the
        held draws; ``fresh`` (the unshared chunk stream) draws an empty entry so that the
        random stream is that of an unshared run. ``None`` beyond the memory bound."""
        entry, rows = self._locate(x)
        if entry.held < count and not self._fits(entry, count, theta.shape[1]):
            return None
        if entry.held == 0 and rows == slice(0, entry.x.shape[0]):
            return self._stream(entry, theta, x, count, max_chunk_elements, fresh)
        if entry.held < count and not self._extend(entry, count, max_chunk_elements):
            return None
        return self._replay(entry, rows, theta, x, count, max_chunk_elements)

    def _stream(
        self,
        entry: _Entry,
        theta: Tensor,
        x: Tensor,
        count: int,
        max_chunk_elements: int | None,
        fresh: Fresh,
    ) -> Iterator[Chunk]:
        samples: Tensor | None = None
        log_prob: Tensor | None = None
        for chunk in fresh(theta, x, count, max_chunk_elements):
            start, th, _, s, p, first = chunk
            if samples is None:
                samples = s.new_empty(count, x.shape[0], s.shape[-1])
                log_prob = None if p is None else p.new_empty(count, x.shape[0])
            samples[first : first + s.shape[0], start : start + th.shape[0]] = s
            if log_prob is not None:
                log_prob[first : first + s.shape[0], start : start + th.shape[0]] = p
            self.drawn += s.shape[0] * th.shape[0]
            yield chunk
        if entry.held == 0 and samples is not None:  # complete: keep it
            entry.samples.append(samples)
            entry.log_prob.append(log_prob)
            entry.held = count

    def _replay(
        self,
        entry: _Entry,
        rows: slice,
        theta: Tensor,
        x: Tensor,
        count: int,
        max_chunk_elements: int | None,
    ) -> Iterator[Chunk]:
        (n, d), dense = theta.shape, density_draws(self.posterior)
        max_chunk_elements = max_chunk_elements or REPLAY_ELEMENTS  # views: no new memory
        block = max(1, max_chunk_elements // (count * d))
        per_call = max(1, min(count, max_chunk_elements // d)) if dense else count
        theta = theta.detach()
        for start in range(0, n, block):
            th, xc = theta[start : start + block], x[start : start + block]
            log_prob_theta = self.posterior.log_prob(th, xc) if dense else None
            part = slice(rows.start + start, rows.start + start + th.shape[0])
            for done in range(0, count, per_call):
                s, p = entry.take(done, min(per_call, count - done), part)
                yield start, th, log_prob_theta, s, p, done


# one cache per owner (a Trainer) and model state: (key, fingerprint, estimator, cache)
_HELD: WeakKeyDictionary[Any, list[tuple[Any, Tensor, Any, SharedDraws]]] = WeakKeyDictionary()


def fingerprint(*modules: Any) -> Tensor:
    """Sum and sum of squares of every parameter of the ``nn.Module`` s given, float64:
    changes when the parameters do (a training step, swapped weights)."""
    params = {id(p): p for m in modules if isinstance(m, nn.Module) for p in m.parameters()}
    if not params:
        return torch.zeros(0, dtype=torch.float64)
    with torch.no_grad():
        values = [
            torch.stack([p.detach().double().sum(), p.detach().double().square().sum()])
            for p in params.values()
        ]
        return torch.cat(values).cpu()


def shared_draws_for(
    owner: Any, key: Any, estimator: Any, posterior: Posterior, *modules: Any
) -> SharedDraws:
    """The :class:`SharedDraws` of ``owner`` for ``estimator`` at ``key`` (e.g. stage, epoch
    and step) with the parameters of ``modules`` as they are now; a new one (and every
    other cache of ``owner`` dropped) when the key or the parameters changed."""
    now = fingerprint(estimator, *modules)
    held = _HELD.get(owner, [])
    if any(k != key or not torch.equal(f, now) for k, f, _, _ in held):
        held = []
    for _, _, kept, cache in held:
        if kept is estimator:  # the cache holds the estimator: its id cannot be reused
            return cache
    cache = SharedDraws(posterior)
    _HELD[owner] = [*held, (key, now, estimator, cache)]
    return cache


def release_shared_draws(owner: Any) -> None:
    """Drop ``owner``'s caches (the end of a check epoch)."""
    _HELD.pop(owner, None)
