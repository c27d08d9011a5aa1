r"""Log-ratios of a ratio estimator at joint and marginal pairs (for the balance check).

A ratio estimator is given as a batched callable ``f(theta (M, D), x (M, *X)) -> (M,)``
returning :math:`\log r(\theta, x)`, an sbi ``RatioEstimator`` (``NRE_A/B/C``, ``BNRE``),
an :class:`~calib_lightning.UnnormalizedPosterior` built from one, or an sbi
``MCMCPosterior`` / ``RejectionPosterior`` / ``ImportanceSamplingPosterior`` whose
potential holds one. Likelihood and posterior estimators are refused: their outputs are
no classifier logits.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from calib_lightning._utils.validation import as_float, model_dtype, model_errors
from calib_lightning.posteriors import Posterior, UnnormalizedPosterior, recognize

__all__ = ["log_ratio_function", "log_ratio_matrix"]

_NOT_A_RATIO = (
    "estimator must be a ratio estimator: a callable (theta (M, D), x (M, *X)) -> log r "
    "(M,), an sbi RatioEstimator (NRE_A/B/C, BNRE) or a cl.UnnormalizedPosterior built from "
    "one, got {what}"
)


def log_ratio_function(estimator: Any) -> Callable[[Tensor, Tensor], Tensor]:
    r"""``estimator`` as a callable ``(theta (M, D), x (M, *X)) -> log r (M,)``; a
    ``ValueError`` naming ``estimator`` when it is a likelihood or posterior estimator."""
    return _ratio(estimator)[0]


def _ratio(estimator: Any) -> tuple[Callable[[Tensor, Tensor], Tensor], Any]:
    """:func:`log_ratio_function`, and ``(D, X)`` where the estimator tells them."""
    if isinstance(estimator, UnnormalizedPosterior):
        if estimator.kind == "likelihood":
            what = (
                "a posterior built from a likelihood estimator (NLE): log q(x | theta) is "
                "not a classifier's logit"
            )
            raise ValueError(_NOT_A_RATIO.format(what=what))
        return estimator.log_likelihood, (estimator.event_size(), estimator.context_shape())
    if isinstance(estimator, Posterior):
        raise ValueError(_NOT_A_RATIO.format(what=f"the posterior {estimator!r}"))
    found = recognize(estimator)
    if found is None or not ({"ratio", "unnormalized"} & set(found.readings)):
        what = type(estimator).__name__ if found is None else found.what
        raise ValueError(_NOT_A_RATIO.format(what=what))
    return found.log_likelihood, found.shapes.get("ratio", (None, None))


def _check_shapes(theta: Tensor, x: Tensor, shapes: Any) -> None:
    """``theta (N, D)`` and ``x (N, *X)`` against the estimator's ``(D, X)``, where known,
    before the ``N^2`` pairs are formed (so an error names the user's shapes)."""
    size, context = shapes
    if size is not None and theta.shape[-1] != size:
        raise ValueError(
            f"theta must have shape (N, D) = (N, {size}) for this estimator, got "
            f"{tuple(theta.shape)}"
        )
    if context is not None and tuple(x.shape[1:]) != tuple(context):
        raise ValueError(
            f"x must have shape (N, {', '.join(map(str, context))}) for this estimator, got "
            f"{tuple(x.shape)}"
        )


def log_ratio_matrix(
    estimator: Any, theta: Tensor, x: Tensor, *, max_pairs_per_call: int = 65536
) -> Tensor:
    r""":math:`f(\theta_j, x_i)` at row ``i``, column ``j``: ``(N, N)`` in ``theta``'s
    dtype, without gradient; the diagonal holds the joint pairs, the rest marginal pairs.

    Arguments:
        estimator: a ratio estimator (:func:`log_ratio_function`).
        theta: parameters ``(N, D)``.
        x: observations ``(N, *X)``.
        max_pairs_per_call: pairs per call of the estimator (whole rows at a time).
    """
    f, shapes = _ratio(estimator)
    _check_shapes(theta, x, shapes)
    n = theta.shape[0]
    dtype = model_dtype(f)
    rows = max(1, max_pairs_per_call // n)
    model_theta = as_float(theta, dtype)
    out = []
    for start in range(0, n, rows):
        block = as_float(x[start : start + rows], dtype)
        m = block.shape[0]
        pair_theta = model_theta.repeat(m, 1)
        pair_x = block.repeat_interleave(n, dim=0)
        with torch.no_grad(), model_errors(pair_theta, pair_x, dtype=dtype):
            try:
                value = f(pair_theta, pair_x)
            except TypeError as error:
                raise ValueError(
                    _NOT_A_RATIO.format(what=f"{type(estimator).__name__}, which failed: {error}")
                ) from error
        if not isinstance(value, Tensor) or value.shape != (m * n,):
            got = (
                f"shape {tuple(value.shape)}"
                if isinstance(value, Tensor)
                else (type(value).__name__)
            )
            raise ValueError(
                f"estimator must return log r of shape (M,) = ({m * n},) for theta (M, D) "
                f"and x (M, *X), got {got}"
            )
        out.append(value.reshape(m, n).to(theta.dtype))
    matrix = torch.cat(out)
    if not bool(torch.isfinite(matrix).all()):
        bad = int((~torch.isfinite(matrix)).sum())
        raise ValueError(f"estimator returned {bad} non-finite log-ratios of {n * n}")
    return matrix
