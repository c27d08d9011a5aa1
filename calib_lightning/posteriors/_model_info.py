"""What a posterior adapter can read from a model without evaluating it.

The context shape a zuko or nflows flow was built for, the dtype of a returned
distribution, and which backend an object comes from; ``None`` wherever a backend does
not say. :mod:`calib_lightning.posteriors` checks the inputs against these before the
model runs.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor
from torch.distributions import Distribution

__all__ = [
    "default_dtype",
    "distribution_dtype",
    "is_nflows",
    "nflows_context",
    "zuko_context",
]


def distribution_dtype(dist: Distribution) -> torch.dtype | None:
    """Floating dtype of a distribution's tensors (through wrapped base distributions)."""
    for attr in ("base_dist", "base"):
        inner = getattr(dist, attr, None)
        if isinstance(inner, Distribution):
            return distribution_dtype(inner)
    for value in vars(dist).values():
        if isinstance(value, Tensor) and value.is_floating_point():
            return value.dtype
    return None


def zuko_context(flow: object) -> tuple[int, ...] | None:
    """Context width of a zuko autoregressive flow (MAF, NSF), read from its hyper-network.

    zuko records no context size, but the first masked layer of each
    ``MaskedAutoregressiveTransform`` takes ``D + C`` inputs and its last emits
    ``D * total`` outputs (``total`` parameters per feature). ``None`` for other flows,
    for unconditional ones, and for modules that merely contain a flow (their ``x`` may
    go through an embedding first).
    """
    try:
        from zuko.flows.autoregressive import MaskedAutoregressiveTransform
        from zuko.lazy import Flow
    except ImportError:  # pragma: no cover - zuko is a dependency
        return None
    if not isinstance(flow, Flow):  # e.g. a module that embeds x before its flow
        return None
    for module in flow.modules():
        if isinstance(module, MaskedAutoregressiveTransform):
            layers = [m for m in module.hyper.modules() if isinstance(m, torch.nn.Linear)]
            features = layers[-1].out_features // module.total
            context = layers[0].in_features - features
            return (context,) if context > 0 else None
    return None


def nflows_context(flow: object) -> tuple[int, ...] | None:
    """Context width of an nflows flow without an embedding net, read from its layers.

    nflows' MADE and residual networks take the context through a ``context_layer``
    (``nn.Linear``) or record ``context_features``. ``None`` when a (non-identity)
    embedding net sits in front, or when no layer says.
    """
    embedding = getattr(flow, "_embedding_net", None)
    if embedding is not None and not isinstance(embedding, torch.nn.Identity):
        return None
    modules = getattr(flow, "modules", None)
    if not callable(modules):
        return None
    for module in modules():
        features = getattr(module, "context_features", None)
        if isinstance(features, int) and not isinstance(features, bool):
            return (features,)
        layer = getattr(module, "context_layer", None)
        if isinstance(layer, torch.nn.Linear):
            return (layer.in_features,)
    return None


@contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    if dtype not in (torch.float32, torch.float64):  # the only defaults torch accepts
        dtype = previous
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def is_nflows(obj: object) -> bool:
    try:
        from nflows.flows.base import Flow
    except ImportError:  # pragma: no cover - nflows is a dependency
        return False
    return isinstance(obj, Flow)
