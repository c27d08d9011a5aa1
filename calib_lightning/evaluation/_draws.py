r"""Posterior draws and their log-densities, in chunks sized from the memory budget.

Part of the evaluation layer (:mod:`calib_lightning.evaluation`, which re-exports these
names): draws without gradient, served from a
:class:`~calib_lightning.evaluation._draw_cache.SharedDraws` where it holds them, the chunked loop
of the rank and TARP metrics (:func:`draw_chunks`), and reparameterized draws for the
calibration losses.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch
from torch import Tensor

from calib_lightning._utils.validation import check_finite, check_pairs, check_positive
from calib_lightning.evaluation._blocks import named_in_full as _named_in_full
from calib_lightning.evaluation._draw_cache import SharedDraws
from calib_lightning.evaluation._memory import ChunkSizer, assembled_draws, draw_blocks
from calib_lightning.posteriors import DistributionPosterior, Posterior, as_posterior, check_width
from calib_lightning.posteriors.base import density_draws, supports, unsupported
from calib_lightning.posteriors.distributions import draws_and_log_prob

__all__ = [
    "DrawChunk",
    "checked_samples",
    "chunk_sizer",
    "draw_chunks",
    "draws",
    "draws_and_log_probs",
    "reparameterized_draws",
]


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
        (samples,) = assembled_draws(lambda x_, take: (post.sample(x_, take),), x, s, sizer, whole)
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
        samples, log_prob = assembled_draws(
            post.sample_and_log_prob, x, num_posterior_samples, ChunkSizer(x.device), whole=False
        )
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
    were measured to need (:mod:`calib_lightning.evaluation._memory`); with ``max_chunk_elements``,
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
                served = post.serve_chunks(
                    theta,
                    x,
                    num_posterior_samples,
                    max_chunk_elements,
                    functools.partial(_draw_fresh, post.posterior, kept_bytes=kept_bytes),
                )
            if served is not None:
                for chunk in _without_grad(served):
                    yield DrawChunk(*chunk)
                return
            post = post.posterior
        yield from _draw_fresh(
            post, theta, x, num_posterior_samples, max_chunk_elements, dense, kept_bytes
        )


def _draw_fresh(
    post: Posterior,
    theta: Tensor,
    x: Tensor,
    num_posterior_samples: int,
    max_chunk_elements: int | None,
    dense: bool | None = None,
    kept_bytes: int = 0,
) -> Iterator[DrawChunk]:
    """:func:`draw_chunks` without sharing (``dense``: with log-densities; ``None``: when
    cheap)."""
    (n, d), m = theta.shape, num_posterior_samples
    dense = density_draws(post) if dense is None else dense
    sizer = chunk_sizer(x, d, max_chunk_elements)
    sizer.keep(kept_bytes)
    theta = theta.detach()
    log_prob_theta: Tensor | None = None
    for rows, done, take in draw_blocks(n, m, sizer, whole_pairs=not dense):
        with torch.no_grad():  # not across the yield: the caller's grad mode is its own
            th, xc = theta[rows], x[rows]
            k = th.shape[0]
            if done == 0:
                log_prob_theta = post.log_prob(th, xc) if dense else None
            samples, log_prob = sizer.run(
                take * k,
                lambda xc=xc, take=take: (
                    post.sample_and_log_prob(xc, take) if dense else (post.sample(xc, take), None)
                ),
            )
            shape = (take, k) if log_prob is None else tuple(log_prob.shape)
            if samples.shape != (take, k, d) or shape != (take, k):
                raise ValueError(
                    "posterior.sample_and_log_prob must return shapes (S, N, D) = "
                    f"{(take, k, d)} and (S, N) = {(take, k)}, got "
                    f"{tuple(samples.shape)} and {shape}"
                )
        yield DrawChunk(rows.start, th, log_prob_theta, samples, log_prob, done)


def _without_grad(chunks: Iterator[Any]) -> Iterator[Any]:
    """The items of ``chunks``, each made under ``torch.no_grad()``, the caller's code
    between them in the caller's grad mode: a ``yield`` inside ``no_grad`` leaves autograd
    off in the caller while it handles the item, and for good when it stops early (an
    exception in its loop keeps the suspended generator, and ``no_grad``, alive)."""
    end = object()
    while True:
        with torch.no_grad():
            item = next(chunks, end)
        if item is end:
            return
        yield item


def chunk_sizer(x: Tensor, width: int, max_chunk_elements: int | None) -> ChunkSizer:
    """The :class:`~calib_lightning.evaluation._memory.ChunkSizer` of a sampling loop at
    ``x``: from the memory budget, or ``max_chunk_elements // width`` draws per call when
    given."""
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
