"""Posterior draws reduced to SBC ranks and sharpness moments, chunk by chunk.

:func:`posterior_ranks` is the sampling loop of :class:`~calib_lightning.RankCalibration`
(re-exported by :mod:`calib_lightning.metrics.ranks`): chunks of draws from the evaluation
layer, each reduced by the functional core, non-finite values counted over every pair.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from calib_lightning._checks import NonFinitePairs, PairAudit
from calib_lightning.evaluation import DrawChunk, draw_chunks
from calib_lightning.functional.ranks import (
    MOMENT_DRAWS,
    PosteriorDraws,
    RankWorkspace,
    draw_moments,
    draw_problems,
    rank_draw_chunk,
    statistic_ranks,
)
from calib_lightning.posteriors import Posterior

__all__ = ["posterior_ranks"]


def posterior_ranks(
    posterior: Posterior | object,
    theta: Tensor,
    x: Tensor,
    num_posterior_samples: int,
    *,
    max_chunk_elements: int | None = None,
    generator: torch.Generator | None = None,
    statistics: Sequence[Callable[[Tensor], Tensor]] = (),
    names: Sequence[str] | None = None,
    log_densities: bool | None = None,
) -> PosteriorDraws:
    r"""Draw ``M`` posterior samples per pair in chunks and reduce them to ranks and moments.

    The chunks come from :func:`calib_lightning.evaluation.draw_chunks` (memory: one
    chunk of draws sized from the memory budget, :func:`calib_lightning.set_memory_budget`,
    or of ``max_chunk_elements`` numbers, and their log-densities; on the CPU, scratch
    arrays of a block of
    :data:`~calib_lightning.functional.ranks.BLOCK_NUMBERS` draws, elsewhere two of the
    chunk's size; plus the ``(N, D + 1)`` outputs); each is reduced by
    :func:`~calib_lightning.functional.ranks.rank_draw_chunk` and the sums of a block of
    pairs add up over its chunks. The sharpness moments use the first
    ``min(M, MOMENT_DRAWS)`` draws of each pair.

    Arguments:
        posterior: anything :func:`calib_lightning.as_posterior` accepts.
        theta: true parameters ``(N, D)``.
        x: observations ``(N, *X)``.
        num_posterior_samples: ``M >= 2``.
        max_chunk_elements: bound on ``samples_per_chunk * pairs_per_chunk * D``;
            ``None``: chunks sized from the memory budget.
        generator: for tie-breaking (sampling uses the posterior's own randomness).
        statistics: ``Q`` test quantities ``(..., D) -> (...)``; their ranks
            (:func:`~calib_lightning.functional.ranks.statistic_ranks`) follow the joint
            rank as the last ``Q`` columns of ``ranks``.
        names: their names, for error messages.
        log_densities: rank jointly by the energy (``True``) or the distance rank
            (``False``, no log-densities drawn); ``None``: the energy when the posterior
            computes log-densities cheaply
            (:func:`~calib_lightning.posteriors.density_draws`).

    Returns:
        :class:`~calib_lightning.functional.ranks.PosteriorDraws` (``ranks`` of shape
        ``(N, D + 1 + Q)``).

    Raises:
        ValueError: for bad shapes, non-finite ``theta``/``x``, or non-finite posterior
            samples/log-densities (naming how many pairs were affected).
    """
    if num_posterior_samples < 2:
        raise ValueError(f"num_posterior_samples must be >= 2, got {num_posterior_samples}")
    head = min(num_posterior_samples, MOMENT_DRAWS)
    work = RankWorkspace()
    blocks: list[list[Tensor]] = []
    audit: tuple[PairAudit, NonFinitePairs] | None = None
    for chunk in draw_chunks(posterior, theta, x, num_posterior_samples,
                             max_chunk_elements=max_chunk_elements,
                             log_densities=log_densities):  # fmt: skip
        if audit is None:
            try:
                sums = _rank_chunk(chunk, head, generator, work, statistics, names)
            except NonFinitePairs as error:  # count over every pair, not this chunk's
                audit = (PairAudit(theta.shape[0]), error)
        if audit is not None:
            audit[0].add(chunk.start, _chunk_problems(chunk, statistics, names))
            continue
        if chunk.first_draw == 0:
            blocks.append(list(sums))
        else:
            blocks[-1] = [a + b for a, b in zip(blocks[-1], sums, strict=True)]
    if audit is not None:
        raise audit[0].error() or audit[1]
    ranks, total, total_sq = (torch.cat(parts) for parts in zip(*blocks, strict=True))
    return PosteriorDraws(ranks, *draw_moments(total, total_sq, head))


def _rank_chunk(
    chunk: DrawChunk, head: int, generator: torch.Generator | None, work: RankWorkspace,
    statistics: Sequence[Callable[[Tensor], Tensor]], names: Sequence[str] | None,
) -> tuple[Tensor, ...]:  # fmt: skip
    """:func:`~calib_lightning.functional.ranks.rank_draw_chunk` of one chunk, with the
    ranks of the test quantities after the joint rank."""
    sums = rank_draw_chunk(
        chunk.theta, chunk.log_prob_theta, chunk.samples, chunk.log_prob,
        first_draw=chunk.first_draw, moment_draws=head, offset=chunk.start,
        generator=generator, workspace=work,
    )  # fmt: skip
    if not statistics:
        return tuple(sums)
    quantities = statistic_ranks(chunk.samples, chunk.theta, statistics, names=names,
                                 generator=generator)  # fmt: skip
    return (torch.cat([sums[0], quantities], -1), *sums[1:])


def _chunk_problems(
    chunk: DrawChunk, statistics: Sequence[Callable[[Tensor], Tensor]],
    names: Sequence[str] | None,
) -> dict[str, dict[str, Tensor]]:  # fmt: skip
    """The non-finite values of one chunk, per pair (its share of a :class:`PairAudit`)."""
    at_theta = chunk.log_prob_theta if chunk.first_draw == 0 else None
    problems = draw_problems(chunk.samples, chunk.log_prob, at_theta)
    names = [str(q) for q in range(len(statistics))] if names is None else list(names)
    for name, statistic in zip(names, statistics, strict=True):
        values = torch.cat([statistic(chunk.theta)[None], statistic(chunk.samples)])
        kinds = {"NaN": values.isnan().any(0).cpu()}
        if bool(kinds["NaN"].any()):
            problems[f"statistics[{name!r}] must not be NaN"] = kinds
    return problems
