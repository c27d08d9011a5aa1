"""Features of an embedding network for the classifier-based checks (re-exported by
:mod:`calib_lightning.evaluation` as ``embed``, where the package runs its models)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from calib_lightning._utils.chunks import row_blocks
from calib_lightning._utils.validation import check_finite, check_positive, model_dtype

__all__ = ["embed"]


def embed(
    embedding: Callable[[Tensor], Tensor] | None,
    x: Tensor,
    batch_size: int = 1024,
    *,
    name: str = "x",
) -> Tensor:
    r"""Features of an embedding network, ``embedding(x)`` flattened to ``(N, F)``.

    Evaluated ``batch_size`` rows at a time under ``torch.no_grad`` (the features are
    constants for whatever is trained on them); an ``nn.Module`` runs in eval mode
    (deterministic BatchNorm and Dropout) and every submodule gets its own train/eval
    mode back afterwards. Floating ``x`` is cast to the module's dtype and the features to
    ``x``'s; ``embedding=None`` flattens ``x``. Raises a ``ValueError`` naming ``name``
    when the output is not one row per input row or is not finite.

    Arguments:
        embedding: ``nn.Module`` or callable ``(n, *X) -> (n, *F)``, or ``None``.
        x: inputs ``(N, *X)``.
        batch_size: rows per call.
        name: what ``x`` is, for error messages.

    Example:
        >>> from torch import nn
        >>> net = nn.Sequential(nn.Flatten(), nn.Linear(64, 4), nn.Dropout())
        >>> features = embed(net, torch.randn(10, 1, 8, 8), batch_size=4)
        >>> features.shape, features.requires_grad, net.training
        (torch.Size([10, 4]), False, True)
    """
    check_positive("batch_size", batch_size, integer=True)
    if not isinstance(x, Tensor) or x.ndim < 1:
        raise ValueError(f"{name} must be a tensor of shape (N, *X), got {x!r:.60}")
    if embedding is None:
        return x.reshape(x.shape[0], -1)
    if not callable(embedding):
        raise ValueError(
            f"embedding must be an nn.Module or a callable x -> features, got {embedding!r:.60}"
        )
    dtype = x.dtype if x.is_floating_point() else torch.get_default_dtype()
    inputs = x.to(model_dtype(embedding) or dtype) if x.is_floating_point() else x
    modules = list(embedding.modules()) if isinstance(embedding, torch.nn.Module) else []
    modes = [(m, m.training) for m in modules]
    chunks = []
    try:
        if modules:
            embedding.eval()  # restored module by module below
        with torch.no_grad():
            for rows in row_blocks(x.shape[0], batch_size):
                out = embedding(inputs[rows])
                size = rows.stop - rows.start
                if not isinstance(out, Tensor) or out.ndim < 1 or out.shape[0] != size:
                    got = tuple(out.shape) if isinstance(out, Tensor) else type(out).__name__
                    raise ValueError(
                        f"embedding must map {name} of shape (n, *X) to features (n, F) with "
                        f"n = {size}, got {got} for input of shape {tuple(inputs[rows].shape)}"
                    )
                chunks.append(out.reshape(size, -1).to(dtype))
    finally:
        for m, mode in modes:
            m.training = mode
    if not chunks:
        return x.new_zeros((0, 0), dtype=dtype)
    return check_finite(f"embedding({name})", torch.cat(chunks))
