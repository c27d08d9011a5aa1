"""Argument checks shared by the whole package.

Every public entry point validates its tensors here, so that bad input fails
early with a :class:`ValueError` that names the argument, what was expected and
what was received, instead of producing a silently wrong number.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = [
    "check_choice",
    "check_finite",
    "check_matrix",
    "check_pairs",
    "check_points",
    "check_positive",
    "check_probability",
    "check_same_device_dtype",
]


def _as_tensor(name: str, value: object) -> Tensor:
    if not isinstance(value, Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    return value


def check_finite(name: str, value: Tensor) -> Tensor:
    """Raise if ``value`` holds NaN or infinite entries; say how many and where."""
    value = _as_tensor(name, value)
    if value.is_floating_point() or value.is_complex():
        bad = ~torch.isfinite(value)
        if bool(bad.any()):
            count = int(bad.sum())
            if value.ndim >= 1:
                rows = bad.reshape(bad.shape[0], -1).any(dim=1).nonzero().flatten()
                first = rows[:5].tolist()
                where = f" in {rows.numel()} of {value.shape[0]} rows (first: {first})"
            else:
                where = ""
            raise ValueError(
                f"{name} must be finite, got {count} NaN/inf entries{where}"
            )
    return value


def check_matrix(
    name: str,
    value: Tensor,
    *,
    min_rows: int = 1,
    columns: int | None = None,
) -> Tensor:
    """Check that ``value`` is a ``(N, D)`` tensor with ``N >= min_rows``."""
    value = _as_tensor(name, value)
    if value.ndim != 2:
        expected = f"(N, {columns})" if columns is not None else "(N, D)"
        raise ValueError(f"{name} must have shape {expected}, got {tuple(value.shape)}")
    if columns is not None and value.shape[1] != columns:
        raise ValueError(f"{name} must have shape (N, {columns}), got {tuple(value.shape)}")
    if value.shape[0] < min_rows:
        raise ValueError(
            f"{name} must have at least {min_rows} rows (N >= {min_rows}), "
            f"got shape {tuple(value.shape)}"
        )
    if not value.is_floating_point():
        raise ValueError(f"{name} must have a floating dtype, got {value.dtype}")
    check_finite(name, value)
    return value


def check_points(
    name: str, value: Tensor, *, min_rows: int = 1, columns: int | None = None
) -> Tensor:
    """Check a finite floating point set ``(*, N, D)`` (optional leading batch dimensions)."""
    value = _as_tensor(name, value)
    if value.ndim < 2:
        raise ValueError(f"{name} must have shape (*, N, D), got {tuple(value.shape)}")
    if columns is not None and value.shape[-1] != columns:
        raise ValueError(f"{name} must have shape (*, N, {columns}), got {tuple(value.shape)}")
    if value.shape[-2] < min_rows:
        raise ValueError(
            f"{name} must have at least {min_rows} points (N >= {min_rows}) in shape (*, N, D), "
            f"got {tuple(value.shape)}"
        )
    if not value.is_floating_point():
        raise ValueError(f"{name} must have a floating dtype, got {value.dtype}")
    check_finite(name, value)
    return value


def check_same_device_dtype(**tensors: Tensor) -> None:
    """Raise if the named tensors do not share one device and one floating dtype."""
    items = [(name, t) for name, t in tensors.items() if t is not None]
    if not items:
        return
    first_name, first = items[0]
    for name, t in items[1:]:
        if t.device != first.device:
            raise ValueError(
                f"{name} must be on the same device as {first_name} ({first.device}), "
                f"got {t.device}"
            )
        if t.is_floating_point() and first.is_floating_point() and t.dtype != first.dtype:
            raise ValueError(
                f"{name} must have the same dtype as {first_name} ({first.dtype}), got {t.dtype}"
            )


def check_pairs(theta: Tensor, x: Tensor, *, min_rows: int = 1) -> tuple[Tensor, Tensor]:
    """Check calibration pairs: ``theta`` of shape ``(N, D)`` and ``x`` of shape ``(N, *X)``.

    ``x`` may carry any event shape (vectors, images, sequences) as long as its
    first dimension matches ``theta``'s.
    """
    check_matrix("theta", theta, min_rows=min_rows)
    x = _as_tensor("x", x)
    if x.ndim < 2:
        raise ValueError(
            f"x must have shape (N, X) with a leading batch dimension, got {tuple(x.shape)}"
            " (use x[:, None] for a scalar observation)"
        )
    if x.shape[0] != theta.shape[0]:
        raise ValueError(
            f"x must have the same number of rows as theta ({theta.shape[0]}), "
            f"got shape {tuple(x.shape)}"
        )
    check_finite("x", x)
    check_same_device_dtype(theta=theta, x=x)
    return theta, x


def check_positive(name: str, value: float | int, *, integer: bool = False) -> None:
    """Raise unless ``value`` is a positive (integer) number."""
    if integer:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    elif isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ValueError(f"{name} must be a positive number, got {value!r}")


def check_probability(name: str, value: float, *, open_interval: bool = True) -> None:
    """Raise unless ``0 < value < 1`` (or ``0 <= value <= 1``)."""
    ok = 0 < value < 1 if open_interval else 0 <= value <= 1
    if not ok:
        interval = "(0, 1)" if open_interval else "[0, 1]"
        raise ValueError(f"{name} must lie in {interval}, got {value!r}")


def check_choice(name: str, value: object, choices: Sequence[object]) -> None:
    """Raise unless ``value`` is one of ``choices``."""
    if value not in choices:
        raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}")
