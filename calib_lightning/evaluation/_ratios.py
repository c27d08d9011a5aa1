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

from calib_lightning._checks import as_float, model_dtype, model_errors
from calib_lightning.posteriors import Posterior, UnnormalizedPosterior
from calib_lightning.posteriors._sbi_kinds import (
    POTENTIAL_POSTERIORS,
    _SbiLikelihood,
    adapt_sbi,
    sbi_kind,
)

__all__ = ["log_ratio_function", "log_ratio_matrix"]

_NOT_A_RATIO = (
    "estimator must be a ratio estimator: a callable (theta (M, D), x (M, *X)) -> log r "
    "(M,), an sbi RatioEstimator (NRE_A/B/C, BNRE) or a cl.UnnormalizedPosterior built from "
    "one, got {what}"
)


def log_ratio_function(estimator: Any) -> Callable[[Tensor, Tensor], Tensor]:
    r"""``estimator`` as a callable ``(theta (M, D), x (M, *X)) -> log r (M,)``; a
    ``ValueError`` naming ``estimator`` when it is a likelihood or posterior estimator."""
    if isinstance(estimator, UnnormalizedPosterior):
        if isinstance(estimator.module, _SbiLikelihood):
            raise ValueError(_NOT_A_RATIO.format(what="a posterior built from a likelihood "
                                                      "estimator (NLE): log q(x | theta) is "
                                                      "not a classifier's logit"))  # fmt: skip
        return estimator.log_likelihood
    if isinstance(estimator, Posterior):
        raise ValueError(_NOT_A_RATIO.format(what=f"the posterior {estimator!r}"))
    module = type(estimator).__module__
    if type(estimator).__name__ in POTENTIAL_POSTERIORS and module.startswith("sbi."):
        inner = getattr(estimator.potential_fn, "ratio_estimator", None)
        if inner is None:
            raise ValueError(_NOT_A_RATIO.format(
                what=f"an sbi {type(estimator).__name__} without a ratio estimator"))
        estimator = inner
    kind = sbi_kind(estimator)
    if module.startswith("sbi.") and kind != "ratio":
        what = {"likelihood": "an sbi likelihood estimator (NLE)",
                "posterior": "an sbi posterior estimator (NPE)"}  # fmt: skip
        raise ValueError(_NOT_A_RATIO.format(what=what.get(kind, f"sbi's {type(estimator)}")))
    if kind == "ratio":
        return adapt_sbi(estimator)[0]
    if not callable(estimator):
        raise ValueError(_NOT_A_RATIO.format(what=type(estimator).__name__))
    return estimator


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
    f = log_ratio_function(estimator)
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
                raise ValueError(_NOT_A_RATIO.format(
                    what=f"{type(estimator).__name__}, which failed: {error}")) from error
        if not isinstance(value, Tensor) or value.shape != (m * n,):
            got = f"shape {tuple(value.shape)}" if isinstance(value, Tensor) else (
                type(value).__name__)  # fmt: skip
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
