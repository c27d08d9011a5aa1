"""Streaming sample-comparison metrics: Frechet distance and density/coverage.

These compare sets of samples, not calibration pairs, so their ``update`` takes sample
tensors ``(*, n, D)`` rather than ``(posterior, theta, x)``. Only the metrics whose
statistic is a sum over samples stream: the Frechet distance needs the first two
moments of each set, density and coverage need per-reference-ball hit counts. MMD
(a U-statistic with a permutation test) and the Vendi score (an eigendecomposition)
need all points at once: call :func:`calib_lightning.functional.mmd` and
:func:`calib_lightning.functional.vendi_score` on the full sets.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torchmetrics import Metric

from calib_lightning._utils.validation import check_points, check_positive
from calib_lightning.functional._moments import (
    merge_moments,
    moment_state_size,
    moments,
    variance_from_moments,
)
from calib_lightning.functional.samples import (
    ball_counts,
    frechet_distance_from_moments,
    knn_sq_radii,
)
from calib_lightning.results import Result

__all__ = ["DensityCoverage", "DensityCoverageResult", "FrechetDistance", "FrechetDistanceResult"]


@dataclass(eq=False)
class FrechetDistanceResult(Result):
    """What :class:`FrechetDistance` returns.

    Attributes:
        frechet_distance: ``batch_shape`` squared Frechet distance between the Gaussian
            fits of the samples and of the reference.
    """

    logged = ("frechet_distance",)

    frechet_distance: Tensor


@dataclass(eq=False)
class DensityCoverageResult(Result):
    """What :class:`DensityCoverage` returns, each of the reference's batch shape ``(*)``.

    Attributes:
        density: ``(*)`` hits per sample over ``k`` (1 in expectation for equal sets).
        coverage: ``(*)`` fraction of reference balls hit at least once.
    """

    logged = ("density", "coverage")

    density: Tensor
    coverage: Tensor


class FrechetDistance(Metric):
    r"""Squared Frechet distance between Gaussian fits of two streams of samples.

    ``update(samples=..., reference=...)`` adds points ``(*, n, D)`` to either set
    (either may be omitted); ``compute()`` fits a Gaussian to each set and returns
    :func:`~calib_lightning.functional.frechet_distance_from_moments`. States are
    float64, ``O(D^2)`` per comparison whatever the number of points: the centred
    moments of each set (count, mean and
    :math:`\sum (x - \bar x)(x - \bar x)^\top`, see :mod:`calib_lightning.functional._moments`),
    merged across batches and processes with Chan et al.'s formula: exact for points
    far from the origin, and DDP equals one process up to float rounding.

    Arguments:
        dim: ``D``.
        batch_shape: leading dimensions ``(*)`` of every update, e.g. ``(K,)`` to keep
            one distance per reference observation (samples ``(K, n, D)``).
        reset_reference: if ``False``, ``reset()`` keeps the reference moments, so a
            fixed reference set is added once and every epoch's samples compared to it.

    Example:
        >>> g = torch.Generator().manual_seed(0)
        >>> metric = FrechetDistance(dim=2)
        >>> for _ in range(10):
        ...     metric.update(samples=torch.randn(10_000, 2, generator=g) + 1.0,
        ...                   reference=torch.randn(10_000, 2, generator=g))
        >>> metric.compute().frechet_distance  # exact: 2 * 1^2 = 2
        tensor(1.9771, dtype=torch.float64)

    References:
        Heusel, Ramsauer, Unterthiner, Nessler, Hochreiter. "GANs Trained by a Two
        Time-Scale Update Rule Converge to a Local Nash Equilibrium." NeurIPS 2017.
    """

    is_differentiable = False
    higher_is_better = False
    full_state_update = False

    samples_moments: Tensor
    reference_moments: Tensor
    _SETS = ("samples", "reference")

    def __init__(
        self,
        dim: int,
        batch_shape: tuple[int, ...] = (),
        reset_reference: bool = True,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        check_positive("dim", dim, integer=True)
        self.dim, self.batch_shape = dim, tuple(batch_shape)
        self.reset_reference = reset_reference
        size = moment_state_size(dim, covariance=True)
        merge = functools.partial(merge_moments, covariance=True)
        for name in self._SETS:
            default = torch.zeros(*self.batch_shape, size, dtype=torch.float64)
            self.add_state(f"{name}_moments", default, dist_reduce_fx=merge)

    def update(self, samples: Tensor | None = None, reference: Tensor | None = None) -> None:
        """Add points ``(*, n, D)`` to the samples and/or to the reference set."""
        if samples is None and reference is None:
            raise ValueError("update needs samples or reference, got neither")
        for name, points in (("samples", samples), ("reference", reference)):
            if points is None:
                continue
            check_points(name, points, columns=self.dim)
            if tuple(points.shape[:-2]) != self.batch_shape:
                raise ValueError(
                    f"{name} must have shape (*batch_shape, n, {self.dim}) with batch_shape "
                    f"{self.batch_shape}, got {tuple(points.shape)}"
                )
            state = getattr(self, f"{name}_moments")
            batch = moments(points, covariance=True).to(state.device)
            setattr(self, f"{name}_moments", merge_moments(torch.stack([state, batch]), True))

    def _moments(self, name: str) -> tuple[Tensor, Tensor]:
        state = getattr(self, f"{name}_moments")
        count = state[..., 0]
        if bool((count < 2).any()):
            raise ValueError(
                f"FrechetDistance.compute() needs at least 2 {name} points, got {int(count.min())}"
            )
        return variance_from_moments(state, covariance=True)

    def compute(self) -> FrechetDistanceResult:
        """``frechet_distance`` of shape ``batch_shape``."""
        distance = frechet_distance_from_moments(
            *self._moments("samples"), *self._moments("reference")
        )
        return FrechetDistanceResult(frechet_distance=distance)

    def reset(self) -> None:
        kept = {}
        if not self.reset_reference:
            kept = {"reference_moments": self.reference_moments.clone()}
        super().reset()
        for key, value in kept.items():
            setattr(self, key, value)


class DensityCoverage(Metric):
    r"""Density and coverage (Naeem et al. 2020) of a stream of samples against a fixed reference.

    The reference set and its ``k``-NN radii are fixed at construction (the radii
    need the whole reference). ``update(samples)`` adds, for every reference ball, how
    many samples fall inside it; both scores are functions of these counts:
    density = total hits / (k n), coverage = fraction of balls hit at least once. The
    state is ``m`` integers per comparison, summed across processes: exact under DDP.

    Arguments:
        reference: ``(*, m, D)`` reference samples, ``m > k``.
        k: nearest neighbour defining the balls.
        block_size: samples per block in ``update`` (memory ``block_size * m``).

    Example:
        >>> g = torch.Generator().manual_seed(0)
        >>> metric = DensityCoverage(torch.randn(1000, 2, generator=g))
        >>> for _ in range(4):
        ...     metric.update(torch.randn(250, 2, generator=g))
        >>> out = metric.compute()  # expected: density 1, coverage 1 - 2**-5 = 0.97
        >>> out.density, out.coverage
        (tensor(1.0088), tensor(0.9710))

    References:
        Naeem, Oh, Uh, Choi, Yoo. "Reliable Fidelity and Diversity Metrics for
        Generative Models." ICML 2020.
    """

    is_differentiable = False
    higher_is_better = None
    full_state_update = False

    counts: Tensor
    num_samples: Tensor

    def __init__(
        self, reference: Tensor, k: int = 5, block_size: int = 1024, **kwargs: Any
    ) -> None:
        super().__init__(**kwargs)
        check_positive("k", k, integer=True)
        check_positive("block_size", block_size, integer=True)
        check_points("reference", reference, min_rows=k + 1)
        self.k, self.block_size = k, block_size
        reference = reference.detach().clone()
        self.register_buffer("reference", reference)
        self.register_buffer("sq_radii", knn_sq_radii(reference, k, block_size))
        batch = reference.shape[:-2]
        self.add_state("counts", torch.zeros(reference.shape[:-1], dtype=torch.long), "sum")
        self.add_state("num_samples", torch.zeros(batch, dtype=torch.long), "sum")

    def update(self, samples: Tensor) -> None:
        """Count the samples ``(*, n, D)`` falling in each reference ball."""
        check_points("samples", samples, columns=self.reference.shape[-1])
        if samples.shape[:-2] != self.reference.shape[:-2]:
            raise ValueError(
                f"samples must have the batch shape {tuple(self.reference.shape[:-2])} of "
                f"reference, got shape {tuple(samples.shape)}"
            )
        reference = self.reference.to(samples.dtype)
        self.counts += ball_counts(
            samples.detach(), reference, self.sq_radii.to(samples.dtype), self.block_size
        ).to(self.counts.device)
        self.num_samples += samples.shape[-2]

    def compute(self) -> DensityCoverageResult:
        """``density`` and ``coverage``, each of the reference's batch shape."""
        if bool((self.num_samples < 2).any()):
            raise ValueError(
                "DensityCoverage.compute() needs at least n >= 2 samples, got "
                f"n = {int(self.num_samples.min())}"
            )
        dtype = self.reference.dtype
        density = self.counts.sum(-1).to(dtype) / (self.k * self.num_samples.to(dtype))
        coverage = (self.counts > 0).to(dtype).mean(-1)
        return DensityCoverageResult(density=density, coverage=coverage)
