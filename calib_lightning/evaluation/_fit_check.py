"""Check calibration data against an estimator before any check runs.

``cl.diagnose`` and the calibration callbacks (at the start of ``fit``, ``validate`` or
``test``) call :func:`check_fits`, so data of the wrong shape fail at once with the
``ValueError`` a metric would raise at its first evaluation, naming the argument that is
wrong, instead of after an epoch of training (or as NaN in the logs).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from calib_lightning._utils.validation import check_pairs
from calib_lightning.evaluation._draw_cache import SharedDraws
from calib_lightning.evaluation._event_size import check_event_size
from calib_lightning.posteriors import Posterior, as_posterior, check_width

__all__ = ["check_fits"]


def check_fits(
    posterior: Posterior | Any, theta: Tensor, x: Tensor, *, observations: Tensor | None = None
) -> None:
    """Raise the metrics' ``ValueError`` now if the data do not fit the estimator.

    In this order: ``theta`` against the event size ``D`` when the model tells it
    (:func:`~calib_lightning.evaluation.check_event_size`); ``x`` against the context
    shape when the model tells it; one ``log_prob`` at the first two pairs (the adapters'
    errors for the widths the model fails on). Where ``log_prob`` fails or is not
    supported, one draw at two rows of ``x`` instead (its errors name ``x``) and
    ``theta``'s width against the draw's. Last, ``observations`` against ``x``: the
    estimator accepted ``x``, so the observations must have its shape ``*X``. Nothing is
    drawn from the caller's random stream (a draw runs with torch's generators forked).

    Arguments:
        posterior: anything :func:`calib_lightning.as_posterior` accepts.
        theta: parameters ``(N, D)``.
        x: observations ``(N, *X)``.
        observations: reference observations ``(O, *X)``, if any.

    Example:
        >>> from calib_lightning.tasks import GaussianToy
        >>> theta, x = GaussianToy(dim=2).sample(10, torch.Generator().manual_seed(0))
        >>> check_fits(GaussianToy(dim=2).posterior(), theta[:, :1], x)
        Traceback (most recent call last):
            ...
        ValueError: theta must have D = 2 columns like the posterior's event shape (2,), got shape (10, 1)
    """  # noqa: E501
    theta, x = check_pairs(theta, x)
    post = as_posterior(posterior)
    post = post.posterior if isinstance(post, SharedDraws) else post
    check_event_size(post, theta, x)  # reads D from x[:1] at most
    if isinstance(post, Posterior):
        post._prepare_x(x)  # x's shape against the context, when the model tells it
    density = getattr(post, "unnormalized_log_prob", None) or post.log_prob  # a ratio's r p
    try:
        with torch.no_grad():
            density(theta[:2], x[:2])
    except (ValueError, NotImplementedError):  # a samples-only estimator, or a mistake:
        devices = [x.device.index or 0] if x.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            drawn = post.sample(x[:2], 1)  # which the draw (naming x) or theta's width tells
        check_width(theta, drawn.shape[-1])
    if observations is not None and (
        not isinstance(observations, Tensor)
        or observations.ndim < 2
        or observations.shape[1:] != x.shape[1:]
    ):
        got = tuple(observations.shape) if isinstance(observations, Tensor) else observations
        raise ValueError(
            f"observations must have shape (O, {', '.join(map(str, x.shape[1:]))}) like x "
            f"{tuple(x.shape)}, which the posterior accepts, got {got}"
        )
