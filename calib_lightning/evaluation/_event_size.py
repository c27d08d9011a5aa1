"""The event-size check of the metrics that only sample a posterior."""

from __future__ import annotations

import contextlib
from typing import Any

from torch import Tensor

from calib_lightning.evaluation._draw_cache import SharedDraws
from calib_lightning.posteriors import DistributionPosterior, Posterior, as_posterior, check_width

__all__ = ["check_event_size"]


def check_event_size(posterior: Posterior | Any, theta: Tensor, x: Tensor) -> None:
    """Raise unless ``theta (N, D)`` has the posterior's event size ``D``.

    For metrics that only sample the posterior (so the adapter never sees ``theta``).
    ``D`` is read from the model where the adapter knows it, else from the event shape
    of the distribution at the first observation (zuko flows build it lazily, without a
    network pass). Tensors of samples and estimators whose ``D`` cannot be read pass.
    """
    if isinstance(posterior, Tensor):
        return
    post = as_posterior(posterior)
    post = post.posterior if isinstance(post, SharedDraws) else post
    if isinstance(post, Posterior):
        post.check_reading(theta, x)  # data shaped for another reading of the model
    size = post.event_size()
    if size is None and isinstance(post, DistributionPosterior):
        with contextlib.suppress(ValueError, RuntimeError):  # the full evaluation reports these
            size = post.distribution(x[:1]).event_shape[-1]
    check_width(theta, size)
