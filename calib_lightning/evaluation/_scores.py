r"""Scores and latents of a posterior at calibration pairs, checked finite.

Part of the evaluation layer (:mod:`calib_lightning.evaluation`, which re-exports these
functions): scores switch gradients on locally, latents are evaluated without gradient
unless ``create_graph=True``; both come in blocks of pairs sized from the memory budget.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from calib_lightning._utils.validation import (
    NonFinitePairs,
    check_finite,
    check_finite_pairs,
    check_matrix,
    check_pairs,
    check_positive,
    check_same_device_dtype,
    non_finite_kinds,
)
from calib_lightning.evaluation._blocks import named_in_full as _named_in_full
from calib_lightning.evaluation._memory import LATENT_PROBE_UNITS, ChunkSizer, draw_blocks
from calib_lightning.posteriors import Posterior, as_posterior
from calib_lightning.posteriors.base import density_draws

__all__ = [
    "base_scores",
    "latents",
    "log_prob_and_latent",
    "pair_and_base_scores",
    "scores",
]


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
            score = _by_pairs(
                lambda rows: post.score(theta[rows], x[rows]), n, ChunkSizer(x.device)
            )
        if n and density_draws(post):
            with torch.no_grad():
                log_q = _by_pairs(
                    lambda rows: post.log_prob(theta[rows], x[rows]), n, ChunkSizer(x.device)
                )
            problems["posterior log_prob at theta must be finite"] = non_finite_kinds(log_q)
    problems["posterior score at theta must be finite"] = non_finite_kinds(score)
    problems = {what: kinds for what, kinds in problems.items() if kinds}
    if problems:
        raise NonFinitePairs(problems)
    return score


def _by_pairs(run: Callable[[slice], Tensor], n: int, sizer: ChunkSizer) -> Tensor:
    """``run(rows)`` on blocks of ``n`` pairs sized by ``sizer``, concatenated."""
    parts = [
        sizer.run(rows.stop - rows.start, lambda rows=rows: run(rows))
        for rows, _, _ in draw_blocks(n, 1, sizer)
    ]
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
        parts = [
            post.score(base_points[s : s + step, None].expand(-1, n, d), x, create_graph=True)
            for s in range(0, m, step)
        ]
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
            z = _by_pairs(
                lambda rows: post.to_latent(theta[rows], x[rows]),
                theta.shape[0],
                ChunkSizer(x.device, probe_units=LATENT_PROBE_UNITS),
            )
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
