r"""The model-evaluation layer: the one place where the package runs an estimator.

Metrics, losses, callbacks and the report call these functions to turn a posterior
(anything :func:`calib_lightning.as_posterior` accepts) and calibration pairs into
tensors: scores, latents, draws and log-densities. The functional core
(:mod:`calib_lightning.functional`) then works on those tensors only.

The rules, in one place:

* **Gradients.** Draws, log-densities of draws and latents are evaluated without
  gradient (``torch.no_grad``). Scores switch gradients on locally (they are
  gradients); with ``create_graph=True`` they stay differentiable in the estimator's
  parameters, which the calibration losses need.
* **Memory.** Scores, draws and latents (one ODE solve per pair for sbi's vector-field
  estimators) come in chunks sized from the memory budget
  (:func:`calib_lightning.set_memory_budget`) by the measured peak of the first chunks
  (:mod:`calib_lightning._memory`), unless a ``chunk_size`` / ``max_chunk_elements`` is
  given; what a caller keeps meanwhile counts against it.
* **Sharing.** Handed a :class:`~calib_lightning._draw_cache.SharedDraws` (what the
  callbacks pass when several check in one epoch), :func:`draws` and :func:`draw_chunks`
  serve the draws it already holds at the same ``x`` (the first ``n``) and keep new ones.
* **Dtype and device.** The adapters cast inputs to the model's dtype and return the
  caller's dtype (:mod:`calib_lightning.posteriors`); nothing here moves tensors.
* **Checks.** Every output is checked finite; a failure raises a ``ValueError`` that
  names the quantity and counts the pairs affected.
"""

from __future__ import annotations

import contextlib
import functools
import re
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch
from torch import Tensor

from calib_lightning._checks import (
    NonFinitePairs,
    check_finite,
    check_finite_pairs,
    check_matrix,
    check_pairs,
    check_positive,
    check_same_device_dtype,
    non_finite_kinds,
)
from calib_lightning._draw_cache import SharedDraws
from calib_lightning._event_size import check_event_size
from calib_lightning._features import embed
from calib_lightning._memory import LATENT_PROBE_UNITS, ChunkSizer, assembled_draws, draw_blocks
from calib_lightning.posteriors import DistributionPosterior, Posterior, as_posterior, check_width
from calib_lightning.posteriors.base import density_draws, supports, unsupported
from calib_lightning.posteriors.distributions import draws_and_log_prob

__all__ = [
    "DrawChunk",
    "base_scores",
    "check_event_size",
    "checked_samples",
    "chunk_sizer",
    "draw_chunks",
    "draws",
    "draws_and_log_probs",
    "embed",
    "latents",
    "log_prob_and_latent",
    "pair_and_base_scores",
    "reparameterized_draws",
    "scores",
]


@contextlib.contextmanager
def _named_in_full(**inputs: Tensor) -> Iterator[None]:
    """Errors raised on blocks of rows name the caller's whole ``inputs``.

    The loops below call the posterior on blocks of rows of ``theta`` and ``x`` (the
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
            message = block.sub(lambda m, n=n, tail=tail: f"({n}{tail})"
                                if int(m.group(1)) <= n else m.group(0), message)  # fmt: skip
        if error.args and message != str(error):
            error.args = (message, *error.args[1:])
        raise


def scores(
    posterior: Posterior | Any, theta: Tensor, x: Tensor, *, create_graph: bool = False
) -> Tensor:
    r"""Scores :math:`\nabla_\theta \log q(\theta_i \mid x_i)` at the pairs, ``(N, D)``,
    checked finite, as are the log-densities :math:`\log q(\theta_i \mid x_i)` they are
    the gradients of.

    A log-density of ``±inf`` or NaN can have a finite gradient (``log_prob + inf`` has
    the gradient of ``log_prob``), so the scores alone would pass: the log-densities are
    evaluated too (one more forward pass per pair, without gradient) wherever the
    posterior computes them cheaply (:func:`~calib_lightning.posteriors.density_draws`:
    not through an ODE's trace).

    Arguments:
        posterior: anything :func:`calib_lightning.as_posterior` accepts.
        theta: parameters ``(N, D)``.
        x: observations ``(N, *X)``.
        create_graph: keep the scores differentiable in the model's parameters.

    Raises:
        ValueError: a non-finite score or log-density, counting the pairs affected and
            naming the first rows.
    """
    check_pairs(theta, x)
    post = as_posterior(posterior)
    n = theta.shape[0]
    problems = {}
    with _named_in_full(theta=theta, x=x):
        if create_graph or n == 0:  # the graph is kept whole: one call
            score = post.score(theta, x, create_graph=create_graph)
        else:  # autograd through the model, by blocks of pairs
            score = _by_pairs(lambda rows: post.score(theta[rows], x[rows]), n,
                              ChunkSizer(x.device))  # fmt: skip
        if n and density_draws(post):
            with torch.no_grad():
                log_q = _by_pairs(lambda rows: post.log_prob(theta[rows], x[rows]), n,
                                  ChunkSizer(x.device))  # fmt: skip
            problems["posterior log_prob at theta must be finite"] = non_finite_kinds(log_q)
    problems["posterior score at theta must be finite"] = non_finite_kinds(score)
    problems = {what: kinds for what, kinds in problems.items() if kinds}
    if problems:
        raise NonFinitePairs(problems)
    return score


def _by_pairs(run: Callable[[slice], Tensor], n: int, sizer: ChunkSizer) -> Tensor:
    """``run(rows)`` on blocks of ``n`` pairs sized by ``sizer``, concatenated."""
    parts = [sizer.run(rows.stop - rows.start, lambda rows=rows: run(rows))
             for rows, _, _ in draw_blocks(n, 1, sizer)]  # fmt: skip
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def base_scores(
    posterior: Posterior | Any,
    x: Tensor,
    base_points: Tensor,
    *,
    create_graph: bool = False,
    chunk_size: int | None = None,
) -> Tensor:
    """Scores of each model :math:`q(\\cdot \\mid x_i)` at shared base points, ``(N, m, D)``.

    Arguments:
        posterior: anything :func:`calib_lightning.as_posterior` accepts.
        x: observations ``(N, *X)``.
        base_points: ``(m, D)``, shared by all pairs.
        create_graph: keep the scores differentiable in the model's parameters (every
            evaluation's graph is kept, so chunking saves nothing: ``chunk_size`` base
            points, 16 by default, at all pairs per call).
        chunk_size: ``chunk_size * N`` model evaluations per call, with their autograd
            graphs; ``None`` (default): blocks of pairs and base points sized from the
            memory budget (:func:`calib_lightning.set_memory_budget`).
    """
    check_matrix("base_points", base_points)
    if chunk_size is not None:
        check_positive("chunk_size", chunk_size, integer=True)
    post = as_posterior(posterior)
    with _named_in_full(x=x):
        out = _base_scores(post, x, base_points, create_graph, chunk_size)
    check_finite_pairs("posterior score at the base points must be finite", out)
    return out


def _base_scores(
    post: Posterior, x: Tensor, base_points: Tensor, create_graph: bool, chunk_size: int | None
) -> Tensor:
    """:func:`base_scores`, unchecked."""
    n, (m, d) = x.shape[0], base_points.shape
    if create_graph:  # every evaluation's graph is kept: chunk_size base points at all pairs
        step = chunk_size or 16
        parts = [post.score(base_points[s : s + step, None].expand(-1, n, d), x, create_graph=True)
                 for s in range(0, m, step)]  # fmt: skip
        out = torch.cat(parts, 0).transpose(0, 1)
    else:
        sizer = ChunkSizer(x.device, fixed_units=None if chunk_size is None else chunk_size * n)
        out = base_points.new_empty(n, m, d)
        for rows, first, count in draw_blocks(n, m, sizer):
            z = base_points[first : first + count, None].expand(-1, rows.stop - rows.start, d)
            part = sizer.run(z.shape[0] * z.shape[1], lambda z=z, rows=rows: post.score(z, x[rows]))
            out[rows, first : first + count] = part.transpose(0, 1)
    return out


def pair_and_base_scores(
    posterior: Posterior | Any,
    theta: Tensor,
    x: Tensor,
    base_points: Tensor | None = None,
    *,
    create_graph: bool = False,
    chunk_size: int | None = None,
) -> tuple[Tensor, Tensor | None]:
    """:func:`scores` at the pairs and :func:`base_scores` (``None`` without base points)."""
    score = scores(posterior, theta, x, create_graph=create_graph)
    if base_points is None:
        return score, None
    check_matrix("base_points", base_points, columns=theta.shape[1])
    check_same_device_dtype(theta=theta, base_points=base_points)
    return score, base_scores(
        posterior, x, base_points, create_graph=create_graph, chunk_size=chunk_size
    )


def latents(
    posterior: Posterior | Any, theta: Tensor, x: Tensor, *, create_graph: bool = False
) -> Tensor:
    """Base-space points :math:`z_i = T^{-1}(\\theta_i; x_i)`, ``(N, D)``, checked finite.

    Without gradient by default, in chunks of pairs sized from the memory budget;
    ``create_graph=True`` keeps the graph (one call), so the latents are differentiable
    in the model's parameters (for the calibration losses).
    """
    check_pairs(theta, x)
    post = as_posterior(posterior)
    if create_graph or theta.shape[0] == 0:
        with contextlib.nullcontext() if create_graph else torch.no_grad():
            z = post.to_latent(theta, x)
    else:  # by blocks of pairs (ODE solves for vector fields: a small probe)
        with torch.no_grad(), _named_in_full(theta=theta, x=x):
            z = _by_pairs(lambda rows: post.to_latent(theta[rows], x[rows]), theta.shape[0],
                          ChunkSizer(x.device, probe_units=LATENT_PROBE_UNITS))  # fmt: skip
    check_finite("posterior latents", z)
    return z


def log_prob_and_latent(
    posterior: Posterior | Any, theta: Tensor, x: Tensor
) -> tuple[Tensor, Tensor]:
    r""":math:`\log q(\theta_i \mid x_i)` ``(N,)`` and :math:`z_i` ``(N, D)`` with their graphs,
    from one pass of a zuko flow (the NLL and a latent loss share it), checked finite."""
    check_pairs(theta, x)
    log_q, z = as_posterior(posterior).log_prob_and_latent(theta, x)
    check_finite("posterior log_prob at theta", log_q)
    check_finite("posterior latents", z)
    return log_q, z


def draws(
    posterior: Posterior | Any,
    x: Tensor,
    num_posterior_samples: int,
    *,
    chunk_size: int | None = None,
) -> Tensor:
    """``S`` posterior draws at each observation, ``(S, N, D)``, no gradient, checked finite.

    Arguments:
        posterior: anything :func:`calib_lightning.as_posterior` accepts.
        x: observations ``(N, *X)``.
        num_posterior_samples: ``S``.
        chunk_size: observations sampled per call (memory ``S * chunk_size * D``);
            ``None``: calls sized from the memory budget
            (:func:`calib_lightning.set_memory_budget`).
    """
    check_positive("num_posterior_samples", num_posterior_samples, integer=True)
    post = as_posterior(posterior)
    if chunk_size is not None:
        check_positive("chunk_size", chunk_size, integer=True)
    if isinstance(post, SharedDraws):
        with torch.no_grad():
            held = post.serve_draws(x, num_posterior_samples)
        if held is not None:
            checked_samples(held)
            return held
        post = post.posterior
    s = num_posterior_samples
    whole = chunk_size is not None or not supports(post, "log_prob")  # whole pairs a call
    sizer = ChunkSizer(x.device, fixed_units=None if chunk_size is None else chunk_size * s)
    with _named_in_full(x=x):
        (samples,) = assembled_draws(lambda x_, take: (post.sample(x_, take),), x, s, sizer,
                                     whole)  # fmt: skip
    checked_samples(samples)
    return samples


def draws_and_log_probs(
    posterior: Posterior | Any, x: Tensor, num_posterior_samples: int
) -> tuple[Tensor, Tensor]:
    """``S`` draws at each observation ``(S, N, D)`` and their log-densities ``(S, N)``
    from ``sample_and_log_prob``, in calls sized from the memory budget, no gradient."""
    check_positive("num_posterior_samples", num_posterior_samples, integer=True)
    post = as_posterior(posterior)
    with _named_in_full(x=x):
        samples, log_prob = assembled_draws(post.sample_and_log_prob, x, num_posterior_samples,
                                            ChunkSizer(x.device), whole=False)  # fmt: skip
    checked_samples(samples, log_prob)
    return samples, log_prob


class DrawChunk(NamedTuple):
    """One chunk of :func:`draw_chunks`: draws of some pairs, with their log-densities.

    Attributes:
        start: index of the chunk's first pair.
        theta: the chunk's true parameters ``(n, D)``.
        log_prob_theta: :math:`\\log q(\\theta_i \\mid x_i)`, ``(n,)`` (equal for all
            draw chunks of the same pairs); ``None`` for a samples-only posterior.
        samples: ``(s, n, D)`` draws.
        log_prob: their log-densities ``(s, n)``; ``None`` for a samples-only posterior.
        first_draw: index of the chunk's first draw among the pair's ``M``.
    """

    start: int
    theta: Tensor
    log_prob_theta: Tensor | None
    samples: Tensor
    log_prob: Tensor | None
    first_draw: int


def draw_chunks(
    posterior: Posterior | Any,
    theta: Tensor,
    x: Tensor,
    num_posterior_samples: int,
    *,
    max_chunk_elements: int | None = None,
    log_densities: bool | None = None,
    kept_bytes: int = 0,
) -> Iterator[DrawChunk]:
    """Draw ``M`` samples per pair with their log-densities, in bounded chunks, no gradient.

    Chunks hold as many draws as the memory budget affords at the peak the first chunks
    were measured to need (:mod:`calib_lightning._memory`); with ``max_chunk_elements``,
    pairs are taken ``max(1, max_chunk_elements // (M D))`` at a time. Whole pairs go in
    one chunk when their draws fit it; the draws of one pair are split otherwise. For
    each block of pairs the truth's log-density comes from one ``log_prob`` call, the
    draws and their densities from ``sample_and_log_prob`` calls; without ``log_prob``
    (samples only), from ``sample`` calls, with ``None`` log-densities and all ``M``
    draws of a pair in one chunk. Shapes are checked here; finiteness lazily by the consumer.

    Arguments:
        posterior: anything :func:`calib_lightning.as_posterior` accepts.
        theta: true parameters ``(N, D)``.
        x: observations ``(N, *X)``.
        num_posterior_samples: ``M``.
        max_chunk_elements: bound on ``draws_per_chunk * pairs_per_chunk * D`` instead of
            the memory budget; ``None`` (default): the budget.
        log_densities: whether the chunks carry log-densities; ``None`` (default): when
            the posterior computes them cheaply
            (:func:`~calib_lightning.posteriors.density_draws`: not for an ODE's trace).
        kept_bytes: what the caller keeps while the chunks come (e.g. one output the
            chunks are copied into), counted against the budget.

    Raises:
        UnsupportedError: ``log_densities=True`` for a posterior without ``log_prob``.
    """
    check_pairs(theta, x)
    check_positive("num_posterior_samples", num_posterior_samples, integer=True)
    if max_chunk_elements is not None:
        check_positive("max_chunk_elements", max_chunk_elements, integer=True)
    post = as_posterior(posterior)
    dense = density_draws(post) if log_densities is None else bool(log_densities)
    if dense and not supports(post, "log_prob"):
        raise unsupported(post, "log_prob")
    if isinstance(post, SharedDraws) and dense != density_draws(post):
        post = post.posterior  # the cache holds the other kind of draws: draw afresh
    with _named_in_full(theta=theta, x=x):
        if isinstance(post, SharedDraws):
            with torch.no_grad():
                served = post.serve_chunks(theta, x, num_posterior_samples, max_chunk_elements,
                                           functools.partial(_draw_fresh, post.posterior,
                                                             kept_bytes=kept_bytes))  # fmt: skip
                if served is not None:
                    for chunk in served:
                        yield DrawChunk(*chunk)
                    return
            post = post.posterior
        yield from _draw_fresh(post, theta, x, num_posterior_samples, max_chunk_elements, dense,
                               kept_bytes)  # fmt: skip


def _draw_fresh(
    post: Posterior, theta: Tensor, x: Tensor, num_posterior_samples: int,
    max_chunk_elements: int | None, dense: bool | None = None, kept_bytes: int = 0,
) -> Iterator[DrawChunk]:
    """:func:`draw_chunks` without sharing (``dense``: with log-densities; ``None``: when
    cheap)."""
    (n, d), m = theta.shape, num_posterior_samples
    dense = density_draws(post) if dense is None else dense
    sizer = chunk_sizer(x, d, max_chunk_elements)
    sizer.keep(kept_bytes)
    theta = theta.detach()
    log_prob_theta: Tensor | None = None
    with torch.no_grad():
        for rows, done, take in draw_blocks(n, m, sizer, whole_pairs=not dense):
            th, xc = theta[rows], x[rows]
            k = th.shape[0]
            if done == 0:
                log_prob_theta = post.log_prob(th, xc) if dense else None
            samples, log_prob = sizer.run(take * k, lambda xc=xc, take=take: (
                post.sample_and_log_prob(xc, take) if dense else (post.sample(xc, take), None)))
            shape = (take, k) if log_prob is None else tuple(log_prob.shape)
            if samples.shape != (take, k, d) or shape != (take, k):
                raise ValueError(
                    "posterior.sample_and_log_prob must return shapes (S, N, D) = "
                    f"{(take, k, d)} and (S, N) = {(take, k)}, got "
                    f"{tuple(samples.shape)} and {shape}"
                )
            yield DrawChunk(rows.start, th, log_prob_theta, samples, log_prob, done)


def chunk_sizer(x: Tensor, width: int, max_chunk_elements: int | None) -> ChunkSizer:
    """The :class:`~calib_lightning._memory.ChunkSizer` of a sampling loop at ``x``: from the
    memory budget, or ``max_chunk_elements // width`` draws per call when given."""
    if max_chunk_elements is None:
        return ChunkSizer(x.device)
    check_positive("max_chunk_elements", max_chunk_elements, integer=True)
    return ChunkSizer(x.device, fixed_units=max(1, max_chunk_elements // width))


def checked_samples(samples: Tensor, log_prob: Tensor | None = None) -> None:
    """Raise if a posterior produced non-finite samples ``(S, N, D)`` or log-densities
    ``(S, N)``, naming how many pairs."""
    check_finite("posterior samples", samples.transpose(0, 1))
    if log_prob is not None:
        check_finite("posterior log_prob", log_prob.transpose(0, 1))


def reparameterized_draws(
    posterior: Posterior | Any,
    theta: Tensor,
    x: Tensor,
    num_posterior_samples: int,
    *,
    at_theta: bool = True,
) -> tuple[Tensor, Tensor, Tensor | None]:
    r"""Reparameterized draws and log-densities, differentiable in the model's parameters.

    From one distribution per call (``draws_and_log_prob`` of the distributions
    adapter, reparameterized): draws :math:`\theta_{il} \sim q(\cdot \mid x_i)`
    ``(S, N, D)``, their log-densities ``(S, N)`` and, with ``at_theta``,
    :math:`\log q(\theta_i \mid x_i)` ``(N,)`` (else ``None``), all checked finite.

    Arguments:
        posterior: a zuko flow or a callable ``x -> Distribution`` (the other adapters
            cannot draw reparameterized samples).
        theta: true parameters ``(N, D)``, checked against the event size.
        x: observations ``(N, *X)``.
        num_posterior_samples: ``S``.
        at_theta: also return the log-density at ``theta``.
    """
    check_pairs(theta, x)
    check_positive("num_posterior_samples", num_posterior_samples, integer=True)
    post = as_posterior(posterior)
    post = post.posterior if isinstance(post, SharedDraws) else post
    if not isinstance(post, DistributionPosterior):
        raise ValueError(
            "reparameterized draws need a zuko flow or a callable "
            f"x -> torch.distributions.Distribution, got {type(post).__name__}"
        )
    dist = post.distribution(x)
    check_width(theta, dist.event_shape[-1])
    samples, log_prob = draws_and_log_prob(dist, num_posterior_samples, reparameterized=True)
    log_prob_theta = None
    if at_theta:
        log_prob_theta = dist.log_prob(theta)
        check_finite("posterior log_prob at theta", log_prob_theta)
    check_finite("posterior log_prob at its samples", log_prob.transpose(0, 1))
    checked_samples(samples)
    return samples, log_prob, log_prob_theta
