r"""Samples-only posteriors: an estimator that can draw from :math:`q(\theta \mid x)` and
nothing else (ABC, MCMC, a home-grown sampler).

:class:`SamplePosterior` wraps a callable ``fn(x, num_samples) -> (S, N, D)``. The
sampling-based checks apply to it: marginal ranks, with the distance rank
(:func:`~calib_lightning.functional.distance_log_prob`) as the joint statistic in place
of the energy rank, TARP, recovery, L-C2ST and the reference distances. The checks that
need a density, its score or the inverse map (KCCSD, ``LatentCalibration``,
``LC2STNF``, the calibration losses) raise a :class:`ValueError` that says so, and
:func:`calib_lightning.diagnose` skips them with that reason.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from calib_lightning.posteriors.base import Posterior, unsupported

__all__ = ["SamplePosterior"]


class SamplePosterior(Posterior):
    r"""A posterior known through its samples only.

    ``fn`` is called under ``torch.no_grad`` with ``x`` cast to the dtype of ``fn``'s
    parameters (when it is an ``nn.Module``); its draws are checked (a floating tensor of
    shape ``(S, N, D)``) and returned in ``x``'s dtype. ``log_prob``, ``score``,
    ``to_latent`` and their combinations raise a :class:`ValueError` naming the missing
    capability and the checks that need it.

    Arguments:
        fn: ``fn(x, num_samples)``: ``x`` of shape ``(N, *X)`` -> draws ``(S, N, D)``,
            ``S = num_samples`` independent draws from :math:`q(\cdot \mid x_i)` per row.
        num_dims: ``D``, if known: ``theta``'s width is then checked before sampling.

    Example:
        >>> import torch
        >>> def fn(x, num_samples):  # the exact posterior N(0.8 x, 0.2) of GaussianToy
        ...     return 0.8 * x + 0.2**0.5 * torch.randn(num_samples, *x.shape)
        >>> post = SamplePosterior(fn, num_dims=2)
        >>> post.sample(torch.zeros(4, 2), 3).shape
        torch.Size([3, 4, 2])
        >>> post.log_prob(torch.zeros(4, 2), torch.zeros(4, 2))
        Traceback (most recent call last):
        ...
        calib_lightning.posteriors.base.UnsupportedError: SamplePosterior does not provide log_prob, which KCCSD ...
    """  # noqa: E501

    capabilities = frozenset({"sample"})

    def __init__(self, fn: Callable[[Tensor, int], Tensor], num_dims: int | None = None) -> None:
        if not callable(fn):
            raise ValueError(
                f"fn must be a callable (x (N, *X), num_samples) -> (S, N, D), got {fn!r:.60}"
            )
        if num_dims is not None and (
            isinstance(num_dims, bool) or not isinstance(num_dims, int) or num_dims < 1
        ):
            raise ValueError(f"num_dims must be a positive integer or None, got {num_dims!r}")
        super().__init__(fn)
        self.num_dims = num_dims

    def event_size(self) -> int | None:
        return self.num_dims

    def sample(self, x: Tensor, num_posterior_samples: int) -> Tensor:
        inner, out = self._sampling_inputs(x, num_posterior_samples)
        with torch.no_grad(), self._errors(None, inner):
            samples = self.module(inner, num_posterior_samples)
        n = x.shape[0]
        if (
            not isinstance(samples, Tensor)
            or samples.ndim != 3
            or (tuple(samples.shape[:2]) != (num_posterior_samples, n))
        ):
            got = tuple(samples.shape) if isinstance(samples, Tensor) else type(samples).__name__
            raise ValueError(
                f"fn(x, num_samples) must return samples of shape (S, N, D) with (S, N) = "
                f"{(num_posterior_samples, n)}, got {got}"
            )
        if not samples.is_floating_point():
            raise ValueError(f"fn(x, num_samples) must return floating draws, got {samples.dtype}")
        if self.num_dims is not None and samples.shape[-1] != self.num_dims:
            raise ValueError(
                f"fn(x, num_samples) must return D = num_dims = {self.num_dims} columns, got "
                f"shape {tuple(samples.shape)}"
            )
        return samples.to(out)

    def log_prob(self, theta: Tensor, x: Tensor) -> Tensor:
        raise unsupported(self, "log_prob")

    def sample_and_log_prob(self, x: Tensor, num_posterior_samples: int) -> tuple[Tensor, Tensor]:
        raise unsupported(self, "log_prob")

    def score(self, theta: Tensor, x: Tensor, *, create_graph: bool = False) -> Tensor:
        raise unsupported(self, "score")

    def to_latent(self, theta: Tensor, x: Tensor) -> Tensor:
        raise unsupported(self, "to_latent")

    def log_prob_and_latent(self, theta: Tensor, x: Tensor) -> tuple[Tensor, Tensor]:
        raise unsupported(self, "log_prob")
