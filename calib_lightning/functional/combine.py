r"""One p-value for "calibrated everywhere tested": combining dependent p-values.

A check that runs ``K`` tests (``D`` marginal rank tests and a joint one; one local
test per reference observation) reports ``global_p_value``: the p-value of the
intersection of the ``K`` null hypotheses. The tests share data, so the combination
must hold its level under dependence.

* ``"cauchy"`` (default): the Cauchy combination of Liu and Xie (2020),

  .. math::
      T = \frac{1}{K} \sum_k \tan\big((\tfrac12 - p_k)\pi\big), \qquad
      p = \tfrac12 - \arctan(T) / \pi .

  Each term is standard Cauchy under its null, and the tail of the average stays
  Cauchy under arbitrary dependence (exactly for independent or perfectly
  dependent tests, asymptotically in the tail otherwise), so it is valid at small
  levels and more powerful than Bonferroni when several tests are weakly
  significant together. p-values above ``1 - 1e-3`` enter as ``1 - 1e-3``: a
  permutation p-value of exactly 1 would otherwise add :math:`-\infty` and hide every
  other test (this cap makes each term at least :math:`-1/(10^{-3}\pi)`, a change of
  the null law of at most ``1e-3`` in probability per test).
* ``"holm"``: the smallest Holm-adjusted p-value, :math:`\min(1, K \min_k p_k)`
  (equal to Bonferroni's): exact under any dependence, conservative when the tests
  are strongly dependent.

Both take ``weights`` :math:`w_k > 0` (normalized to sum to one over the tests that
ran): the weighted Bonferroni p-value :math:`\min(1, \min_k p_k / w_k)`, exact under
any dependence (it rejects when some :math:`p_k \le w_k \alpha`, and the
:math:`w_k \alpha` sum to :math:`\alpha`), and the weighted Cauchy statistic
:math:`T = \sum_k w_k \tan((\tfrac12 - p_k)\pi)` (Liu and Xie's general form). A
weight spends the level where the power is: a test that carries the power against
most alternatives keeps most of :math:`\alpha`.

Both return at least :data:`~calib_lightning.functional.bands.P_VALUE_FLOOR`, float64's
smallest normal number, never 0: the Cauchy terms are summed scaled by the smallest
p-value, so that a dozen p-values at the floor (terms of :math:`1.4 \cdot 10^{307}`
each) do not overflow float64 (see :func:`_cauchy`).

References:
    Liu, Xie. "Cauchy Combination Test: A Powerful Test With Analytic p-Value
    Calculation Under Arbitrary Dependency Structures." JASA 115 (2020).

    Holm. "A Simple Sequentially Rejective Multiple Test Procedure." Scandinavian
    Journal of Statistics 6 (1979).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from calib_lightning.functional.bands import P_VALUE_FLOOR

__all__ = ["COMBINATION_METHODS", "combine_p_values", "holm_adjust", "monte_carlo_p_value"]

COMBINATION_METHODS = ("cauchy", "holm")

# Below this p, tan((1/2 - p) pi) is computed as 1 / (p pi): same value to float64
# precision, without the cancellation in 1/2 - p.
_SMALL_P = 1e-12
# Largest p-value that enters the Cauchy sum (see the module docstring).
_LARGE_P = 1.0 - 1e-3


def combine_p_values(
    p_values: Tensor, dim: int = -1, method: str = "cauchy", weights: Tensor | None = None
) -> Tensor:
    r"""Combine dependent p-values along ``dim`` into one p-value.

    Arguments:
        p_values: p-values in ``[0, 1]``, shape ``(*, K, **)`` with ``K`` along ``dim``.
        dim: the dimension of the ``K`` tests.
        method: ``"cauchy"`` (Liu and Xie 2020) or ``"holm"`` (smallest Holm-adjusted
            p-value); see the module docstring for when each holds its level.
        weights: ``(K,)`` positive weights of the tests along ``dim`` (normalized over
            the tests that ran); ``None``: equal weights.

    Returns:
        ``(*, **)``, in ``[P_VALUE_FLOOR, 1]`` (never 0: the floor is float64's smallest
        normal number, :data:`~calib_lightning.functional.bands.P_VALUE_FLOOR`), float64
        unless the input is another floating type with more precision. NaN entries (a
        test that could not run) are ignored; a slice of NaNs gives NaN.

    Example:
        >>> p = torch.tensor([0.01, 0.5, 0.9], dtype=torch.float64)
        >>> round(float(combine_p_values(p)), 4), float(combine_p_values(p, method="holm"))
        (0.0331, 0.03)
        >>> float(combine_p_values(torch.tensor([0.2, 0.2])))  # equal p-values: same p
        0.2
        >>> w = torch.tensor([0.8, 0.1, 0.1])  # weighted Bonferroni: min_k p_k / w_k
        >>> round(float(combine_p_values(p, method="holm", weights=w)), 4)
        0.0125
    """
    if not isinstance(p_values, Tensor):
        raise ValueError(f"p_values must be a torch.Tensor, got {type(p_values).__name__}")
    if method not in COMBINATION_METHODS:
        raise ValueError(f"method must be one of {COMBINATION_METHODS}, got {method!r}")
    if p_values.ndim == 0 or p_values.shape[dim] == 0:
        raise ValueError(
            f"p_values must have at least one test along dim={dim}, got shape "
            f"{tuple(p_values.shape)}"
        )
    p = p_values.to(torch.promote_types(p_values.dtype, torch.float64)).movedim(dim, -1)
    valid = ~torch.isnan(p)
    if bool(((p[valid] < 0) | (p[valid] > 1)).any()):
        raise ValueError(
            f"p_values must lie in [0, 1], got values in [{float(p[valid].min())}, "
            f"{float(p[valid].max())}]"
        )
    count = valid.sum(-1)
    share = None if weights is None else _shares(weights, valid, dim)
    if method == "holm":
        if share is None:
            smallest = torch.where(valid, p, torch.ones_like(p)).amin(-1)
            out = (count * smallest).clamp(max=1.0)
        else:
            ratio = torch.where(valid, p / share, torch.ones_like(p))
            out = ratio.amin(-1).clamp(max=1.0)
    else:
        out = _cauchy(p, valid, count, share)
    out = out.clamp(P_VALUE_FLOOR, 1.0)
    return torch.where(count > 0, out, torch.full_like(out, math.nan))


def _cauchy(p: Tensor, valid: Tensor, count: Tensor, share: Tensor | None) -> Tensor:
    r"""The Cauchy combination of ``p`` ``(*, K)`` (``valid``: not NaN) with weights
    ``share`` (``None``: ``1 / count``), without overflow.

    The terms :math:`t_k = \tan((\frac12 - p_k)\pi)` reach :math:`1 / (p_k \pi) \approx
    1.4 \cdot 10^{307}` at the smallest normal float64, so a sum of a dozen of them would
    overflow to ``inf`` (and the p-value to 0). They are summed scaled by
    :math:`s = \pi \min_k p_k` (each scaled term of a small :math:`p_k` is
    :math:`\min_k p_k / p_k \le 1`): :math:`R = s T`, and the p-value
    :math:`\frac12 - \arctan(T) / \pi` is :math:`\arctan(s / R) / \pi` for
    :math:`T > 0` (no cancellation), :math:`\frac12 - \arctan(R / s) / \pi` otherwise.
    """
    clipped = p.clamp(min=torch.finfo(p.dtype).tiny, max=_LARGE_P)
    smallest = torch.where(valid, clipped, torch.ones_like(clipped)).amin(-1, keepdim=True)
    scale = smallest * math.pi
    scaled = torch.where(
        clipped < _SMALL_P,
        smallest / clipped,  # s / (p pi): tan((1/2 - p) pi) = 1 / (p pi) to float64 precision
        scale * torch.tan((0.5 - clipped) * math.pi),
    )
    weight = 1.0 / count.unsqueeze(-1).to(p.dtype) if share is None else share
    scaled_sum = torch.where(valid, weight * scaled, torch.zeros_like(scaled)).sum(-1)
    scale = scale.squeeze(-1)
    return torch.where(
        scaled_sum > 0,
        torch.atan(scale / scaled_sum) / math.pi,
        0.5 - torch.atan(scaled_sum / scale) / math.pi,
    )


def _shares(weights: Tensor, valid: Tensor, dim: int) -> Tensor:
    """``weights`` ``(K,)`` normalized over the valid tests, the shape of ``valid``."""
    weights = torch.as_tensor(weights)
    if weights.shape != valid.shape[-1:] or not bool((weights > 0).all()):
        raise ValueError(
            f"weights must be {valid.shape[-1]} positive numbers, one per test "
            f"along dim={dim}, got {weights.tolist()}"
        )
    dtype = torch.promote_types(weights.dtype, torch.float64)
    share = torch.where(valid, weights.to(dtype=dtype, device=valid.device), 0.0)
    return share / share.sum(-1, keepdim=True).clamp_min(torch.finfo(dtype).tiny)


def holm_adjust(p_values: Tensor, dim: int = -1) -> Tensor:
    r"""Holm's step-down adjusted p-values of ``K`` tests along ``dim``.

    With the valid p-values sorted, :math:`p_{(1)} \le \dots \le p_{(K)}`,

    .. math::
        \tilde p_{(j)} = \min\Big(1, \max_{i \le j} (K - i + 1)\, p_{(i)}\Big),

    and hypothesis ``k`` is rejected at level :math:`\alpha` when
    :math:`\tilde p_k \le \alpha`: exactly the hypotheses Holm's procedure rejects.
    It controls the family-wise error (the probability of rejecting any true null) at
    :math:`\alpha` under arbitrary dependence. The smallest adjusted p-value is
    :func:`combine_p_values` with ``method="holm"``. NaN entries (a test that did not
    run) stay NaN and do not count in ``K``.

    Arguments:
        p_values: p-values in ``[0, 1]``, shape ``(*, K, **)`` with ``K`` along ``dim``.
        dim: the dimension of the ``K`` tests.

    Returns:
        Adjusted p-values, the shape of ``p_values``, float64 (or a wider float).

    References:
        Holm. "A Simple Sequentially Rejective Multiple Test Procedure." Scandinavian
        Journal of Statistics 6 (1979).

    Example:
        >>> holm_adjust(torch.tensor([0.01, 0.04, 0.03, 0.5], dtype=torch.float64))
        tensor([0.0400, 0.0900, 0.0900, 0.5000], dtype=torch.float64)
    """
    if not isinstance(p_values, Tensor) or p_values.ndim == 0:
        got = tuple(p_values.shape) if isinstance(p_values, Tensor) else type(p_values).__name__
        raise ValueError(f"p_values must be a tensor of shape (*, K, **), got {got}")
    p = p_values.to(torch.promote_types(p_values.dtype, torch.float64)).movedim(dim, -1)
    valid = ~torch.isnan(p)
    count = valid.sum(-1, keepdim=True)
    ordered, order = torch.where(valid, p, torch.full_like(p, math.inf)).sort(-1)
    position = torch.arange(p.shape[-1], device=p.device)
    multiplier = (count - position).clamp_min(1).to(p.dtype)
    adjusted = (ordered * multiplier).cummax(-1).values.clamp(max=1.0)
    out = torch.empty_like(p).scatter_(-1, order, adjusted)
    return torch.where(valid, out, p).movedim(-1, dim)


def monte_carlo_p_value(
    statistic: Tensor,
    draws: Tensor,
    *,
    tolerance: float = 0.0,
    dtype: torch.dtype | None = None,
) -> Tensor:
    r"""Monte Carlo p-value :math:`p = (1 + \#\{T_b \ge T\}) / (1 + B)`, never 0.

    Valid (level at most :math:`\alpha`) whenever the observed :math:`T` and the
    :math:`B` draws are exchangeable under the null (permutation, bootstrap or
    simulated null statistics).

    Arguments:
        statistic: observed :math:`T`, ``(*)`` (not differentiated through).
        draws: null draws :math:`T_b`, ``(*, B)``.
        tolerance: draws within this of :math:`T` count as ties (at least as large).
        dtype: of the result; ``None``: the dtype of ``draws``.

    Returns:
        ``(*)``, in :math:`[1 / (1 + B), 1]`; NaN where ``statistic`` is NaN.

    References:
        Phipson, Smyth. "Permutation P-values Should Never Be Zero." Statistical
        Applications in Genetics and Molecular Biology 9(1), 2010.

    Example:
        >>> monte_carlo_p_value(torch.tensor(0.3), torch.tensor([0.1, 0.2, 0.3, 0.4]))
        tensor(0.6000)
    """
    threshold = statistic.detach().unsqueeze(-1)
    if tolerance:
        threshold = threshold - tolerance
    exceed = (draws >= threshold).sum(-1)
    p = (1.0 + exceed.to(draws.dtype if dtype is None else dtype)) / (1.0 + draws.shape[-1])
    # a NaN statistic exceeds nothing: it would read as the smallest p-value, a rejection
    return p.masked_fill(torch.isnan(statistic.detach()), float("nan"))
