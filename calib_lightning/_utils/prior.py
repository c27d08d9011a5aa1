"""Which parameters lie outside a prior's support: the one place the package reads a prior."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

__all__ = ["check_prior", "not_a_prior", "outside_support"]


def not_a_prior(prior: Any) -> ValueError:
    """The error for a ``prior`` the package cannot read."""
    return ValueError(
        f"prior must be a torch Distribution or have log_prob, got {type(prior).__name__}"
    )


def _inside(prior: Any, theta: Tensor) -> Tensor:
    """Whether each ``theta (..., D)`` is in the support: ``prior.support.check`` reduced
    over ``D``, or where ``log_prob`` is finite when the prior has no checkable support."""
    try:
        check = prior.support.check
    except (AttributeError, NotImplementedError):
        log_prob = getattr(prior, "log_prob", None)
        if log_prob is None:
            raise not_a_prior(prior) from None
        with torch.no_grad():
            return torch.isfinite(log_prob(theta))
    inside = check(theta)
    return inside.all(-1) if inside.shape == theta.shape else inside


def outside_support(prior: Any, theta: Tensor) -> Tensor:
    """Whether each parameter ``theta (..., D)`` lies outside ``prior``'s support:
    ``(...)`` bool.

    ``prior``: a torch ``Distribution`` (its ``support``, e.g. sbi's ``BoxUniform``) or any
    object with ``log_prob`` (outside where it is not finite). Evaluated on ``theta``'s
    device, or on the CPU when the prior lives there.
    """
    shape = getattr(prior, "batch_shape", ()) + getattr(prior, "event_shape", (theta.shape[-1],))
    if tuple(shape) != (theta.shape[-1],):
        raise ValueError(
            f"prior must have event shape (D,) = ({theta.shape[-1]},) like theta (batch and "
            f"event shape together), got {tuple(shape)}"
        )
    try:
        inside = _inside(prior, theta)
    except RuntimeError:  # a CPU prior and CUDA parameters
        if theta.device.type == "cpu":
            raise
        inside = _inside(prior, theta.cpu())
    if inside.shape != theta.shape[:-1]:
        raise ValueError(
            f"prior must have event shape (D,) = ({theta.shape[-1]},) like theta: its "
            f"support check of theta {tuple(theta.shape)} gave shape {tuple(inside.shape)}"
        )
    return ~inside.to(device=theta.device, dtype=torch.bool)


def check_prior(prior: Any, theta: Tensor) -> None:
    """Raise a ``ValueError`` naming ``prior`` if there is none, or if calibration parameters
    ``theta (N, D)`` (drawn from it) lie outside its support."""
    if prior is None:
        raise ValueError("prior must be the prior theta were drawn from, got None")
    outside = outside_support(prior, theta)
    if bool(outside.any()):
        raise ValueError(
            f"prior must be the prior theta were drawn from, but {int(outside.sum())} of the "
            f"N = {theta.shape[0]} calibration theta lie outside its support"
        )
