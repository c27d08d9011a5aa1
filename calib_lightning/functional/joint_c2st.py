r"""The joint classifier test: conformal ranks of a classifier's score over :math:`(\theta, x)`.

A classifier :math:`d(\theta, x)` is trained to tell true pairs :math:`(\theta^*_i, x_i)`
from :math:`(\tilde\theta_i, x_i)`, :math:`\tilde\theta_i \sim q(\cdot \mid x_i)`, on
pairs other than :math:`i`. At pair :math:`i` the score of the true parameter is ranked
among the scores of ``M`` posterior draws at the same :math:`x_i`, with uniform
tie-breaking:

.. math::
    u_i = \frac{\#\{m : d(\theta_{im}, x_i) < d(\theta^*_i, x_i)\} + V_i
              \big(1 + \#\{m : d(\theta_{im}, x_i) = d(\theta^*_i, x_i)\}\big)}{M + 1},
    \qquad V_i \sim U(0, 1).

For a classifier that has not seen pair :math:`i`, :math:`H_0: q = p` makes
:math:`\theta^*_i` and the draws exchangeable given :math:`x_i`, so :math:`u_i` is
exactly :math:`U(0, 1)`: a conformal p-value per pair whatever the classifier's quality
(Hu and Lei 2024; Bansal, Chen and Scott 2025), conditional on :math:`x_i`, so that a
posterior that ignores :math:`x` (the prior) is visible.

**Cross-fitting, repeated.** One random split (train on half, rank the other half)
makes the verdict a lottery over the split and the classifier's initialization: on one
fixed calibration set the p-value of a calibrated posterior ranged over 0.07-0.93 and
the test rejected at some seeds only (``examples/benchmarks/results/seed_stability.md``).
So the pairs are split into ``K`` folds, each fold ranked by a classifier trained on the
others (every pair is ranked), and this is repeated ``R`` times with fresh folds and
classifiers; a pair's rank is its average over the repetitions,
:math:`\bar u_i = \frac1R \sum_r u_{ir}` (one :math:`V_i` shared by them). Under
:math:`H_0` the position of the truth among a pair's :math:`M + 1` values is uniform
given every classifier that ranks it, so the law of :math:`\bar u_i` is known exactly
from the pair's own scores: with :math:`b_r(j)` the count below value ``j`` and
:math:`c_r(j)` one plus its ties under repetition ``r``,

.. math::
    \mathbb E\,\bar u_i = \tfrac12, \qquad
    \sigma_i^2 = \frac{\mathrm{Var}_j\big(\bar b(j) + \bar c(j) / 2\big)
                 + \mathrm{mean}_j\, \bar c(j)^2 / 12}{(M + 1)^2},

(:math:`j` uniform on the :math:`M + 1` values, bars the averages over ``r``),
:math:`1 / 12` for one repetition and no ties, less when the repetitions agree. The test
is two-sided on their sum,

.. math::
    Z = \frac{\sum_i (\bar u_i - \frac12)}{\sqrt{\sum_i \sigma_i^2}}, \qquad
    p = 2\,\Phi(-|Z|),

computed from :math:`\log \Phi` so that it does not underflow before the float64 range
ends (``2 (1 - Phi(15.8))`` is 0.0 in float64, the true value 3.1e-56). The ranks of
two pairs in different folds are not exactly independent (each pair trains the other's
classifier), but the dependence is of order :math:`1 / N^2` per pair of pairs: its total
is of order 1 against a variance of order :math:`N`; the level is measured in
``examples/benchmarks/results/level_audit_joint.md`` and by the test suite. The
classifier is trained to score true pairs higher over the mixture of all :math:`x`: one
that learned mostly the marginal law of :math:`\theta` can rank the true parameter
*below* the draws at its own :math:`x` (a posterior shrunk half-way to the prior at
``D = 3``: mean rank 0.30), which a one-sided test would call calibrated.

These functions take classifier scores as tensors.

References:
    Hu, Lei. "A Two-Sample Conditional Distribution Test Using Conformal Prediction and
    Weighted Rank Sum." JASA 119 (2024).

    Bansal, Chen, Scott. "Conformal C2ST: Turning weak classifiers into strong two-sample
    tests." arXiv:2507.17026 (2025).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = [
    "averaged_ranks",
    "conformal_ranks",
    "normal_two_sided_p_value",
    "rank_sum_test",
    "repeat_p_value_error",
    "uniform_mean_test",
]

#: the smallest positive normal float64: a p-value below it is stored as it, never 0
TINY_P_VALUE = 2.2250738585072014e-308


def conformal_ranks(
    score: Tensor, drawn_scores: Tensor, generator: torch.Generator | None = None
) -> Tensor:
    r"""Randomized fractional ranks :math:`u_i` of ``score`` among ``drawn_scores``.

    Arguments:
        score: :math:`d(\theta^*_i, x_i)`, shape ``(*, n)``.
        drawn_scores: :math:`d(\theta_{im}, x_i)` for ``M`` draws
            :math:`\theta_{im} \sim q(\cdot \mid x_i)`, shape ``(*, M, n)``.
        generator: draws the tie-breaking :math:`V_i` (on the CPU).

    Returns:
        ``(*, n)`` in :math:`(0, 1)`; exactly uniform when ``score`` and the ``M`` draws
        are exchangeable.

    Example:
        >>> u = conformal_ranks(torch.tensor([2.0, -1.0]), torch.tensor([[0.0, 0.0]]))
        >>> bool(0.5 < u[0] < 1), bool(0 < u[1] < 0.5)  # above / below the one draw
        (True, True)
    """
    if (
        not isinstance(score, Tensor) or not isinstance(drawn_scores, Tensor)
        or drawn_scores.ndim != score.ndim + 1 or drawn_scores.shape[-1] != score.shape[-1]
        or drawn_scores.shape[:-2] != score.shape[:-1] or drawn_scores.shape[-2] < 1
    ):  # fmt: skip
        got = tuple(drawn_scores.shape) if isinstance(drawn_scores, Tensor) else drawn_scores
        shape = tuple(score.shape) if isinstance(score, Tensor) else score
        raise ValueError(
            f"drawn_scores must have shape (*, M, n) with M >= 1 for score of shape (*, n) = "
            f"{shape}, got {got}"
        )
    score = score.unsqueeze(-2)
    below = (drawn_scores < score).sum(-2).to(torch.float64)
    ties = (drawn_scores == score).sum(-2).to(torch.float64)
    jitter = torch.rand(below.shape, generator=generator, dtype=torch.float64)  # on the CPU
    jitter = jitter.to(below.device)
    return ((below + jitter * (1 + ties)) / (drawn_scores.shape[-2] + 1)).to(
        score.dtype if score.is_floating_point() else torch.float64
    )


def uniform_mean_test(ranks: Tensor) -> tuple[Tensor, Tensor]:
    r"""Two-sided test that independent :math:`U(0, 1)` values have mean 1/2.

    Arguments:
        ranks: :math:`u_i`, shape ``(*, n)``, ``n >= 1``.

    Returns:
        ``(z, p_value)``, each ``(*)``: :math:`Z = \sqrt{12 n}(\bar u - \frac12)` and
        :math:`2 (1 - \Phi(|Z|))` (float64).

    Example:
        >>> z, p = uniform_mean_test(torch.full((12,), 0.75))
        >>> round(float(z), 3), round(float(p), 4)
        (3.0, 0.0027)
    """
    if not isinstance(ranks, Tensor) or ranks.ndim < 1 or ranks.shape[-1] < 1:
        got = tuple(ranks.shape) if isinstance(ranks, Tensor) else type(ranks).__name__
        raise ValueError(f"ranks must have shape (*, n) with n >= 1, got {got}")
    ranks = ranks.double()
    z = math.sqrt(12 * ranks.shape[-1]) * (ranks.mean(-1) - 0.5)
    return z, normal_two_sided_p_value(z)


def normal_two_sided_p_value(z: Tensor) -> Tensor:
    r""":math:`2 \Phi(-|z|)` from :math:`\log \Phi`, float64, at least the smallest normal
    float64 (``torch.special.ndtr(-15.8)`` is already 0.0).

    Example:
        >>> normal_two_sided_p_value(torch.tensor([0.0, 15.8]))
        tensor([1.0000e+00, 3.1112e-56], dtype=torch.float64)
    """
    log_p = math.log(2.0) + torch.special.log_ndtr(-z.double().abs())
    return log_p.exp().clamp(TINY_P_VALUE, 1.0)


def averaged_ranks(
    scores: Tensor, generator: torch.Generator | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    r"""Each pair's conformal rank averaged over repetitions, and its exact null variance.

    Arguments:
        scores: ``(*, R, M + 1, n)``: the classifier scores of each pair's :math:`M + 1`
            values (value 0 the true parameter, then the ``M`` draws) under the ``R``
            classifiers that rank it (one per repetition, none trained on the pair).
        generator: draws the tie-breaking :math:`V_i` (on the CPU), one per pair.

    Returns:
        ``(ranks, variance, per_repeat)``: :math:`\bar u_i` and its variance
        :math:`\sigma_i^2` under :math:`H_0`, each ``(*, n)`` float64 (module docstring;
        :math:`\bar u_i` has mean 1/2 there), and each repetition's rank ``(*, R, n)``
        (their mean is :math:`\bar u_i`).

    Example:
        >>> s = torch.tensor([[[2.0], [0.0], [1.0]]])  # one repetition, M = 2, one pair
        >>> u, v, _ = averaged_ranks(s, torch.Generator().manual_seed(0))
        >>> bool(2 / 3 < u < 1), round(float(v), 4)  # the truth above both draws
        (True, 0.0833)
    """
    if not isinstance(scores, Tensor) or scores.ndim < 3 or scores.shape[-2] < 2:
        got = tuple(scores.shape) if isinstance(scores, Tensor) else type(scores).__name__
        raise ValueError(f"scores must have shape (*, R, M + 1, n) with M >= 1, got {got}")
    scores = scores.detach().double()
    values = scores.shape[-2]
    ordered = scores.transpose(-1, -2).sort(-1).values.contiguous()  # (*, R, n, M + 1)
    query = scores.transpose(-1, -2).contiguous()
    below = torch.searchsorted(ordered, query).double()  # strictly below each value
    ties = torch.searchsorted(ordered, query, right=True).double() - below  # itself included
    jitter = torch.rand(below.shape[:-3] + below.shape[-2:-1], generator=generator,
                        dtype=torch.float64).to(below.device).unsqueeze(-2)  # one per pair
    per_repeat = (below[..., 0] + jitter * ties[..., 0]) / values  # (*, R, n)
    below, ties = below.mean(-3), ties.mean(-3)  # (*, n, M + 1): averaged over repetitions
    middle = below + ties / 2
    variance = (middle.var(-1, unbiased=False) + ties.square().mean(-1) / 12) / values**2
    return per_repeat.mean(-2), variance, per_repeat


def rank_sum_test(ranks: Tensor, variance: Tensor) -> tuple[Tensor, Tensor]:
    r"""Two-sided test that ranks with mean 1/2 and variances :math:`\sigma_i^2` do not
    drift: :math:`Z = \sum_i (\bar u_i - \frac12) / \sqrt{\sum_i \sigma_i^2}`.

    Arguments:
        ranks, variance: ``(*, n)`` (:func:`averaged_ranks`).

    Returns:
        ``(z, p_value)``, each ``(*)``, float64 (:func:`normal_two_sided_p_value`).

    Example:
        >>> z, p = rank_sum_test(torch.full((12,), 0.75), torch.full((12,), 1 / 12))
        >>> round(float(z), 3), round(float(p), 4)
        (3.0, 0.0027)
    """
    if ranks.shape != variance.shape or ranks.ndim < 1 or ranks.shape[-1] < 1:
        raise ValueError(f"ranks and variance must have one shape (*, n) with n >= 1, got "
                         f"{tuple(ranks.shape)} and {tuple(variance.shape)}")  # fmt: skip
    z = (ranks.double() - 0.5).sum(-1) / variance.double().sum(-1).sqrt()
    return z, normal_two_sided_p_value(z)


def repeat_p_value_error(per_repeat: Tensor, variance: Tensor) -> Tensor:
    r"""Monte Carlo standard error of :func:`rank_sum_test`'s p-value over the repetitions.

    The statistic's numerator is the mean over the ``R`` repetitions of
    :math:`S_r = \sum_i (u_{ir} - \frac12)`; its standard error
    :math:`\mathrm{sd}_r(S_r) / \sqrt R`, divided by :math:`\sqrt{\sum_i \sigma_i^2}`, moves
    :math:`Z` by :math:`\pm \delta`, and half the p-value's change over
    :math:`Z \pm \delta` is the error. ``0`` for one repetition (no spread to measure).

    Arguments:
        per_repeat: ``(*, R, n)`` (:func:`averaged_ranks`).
        variance: ``(*, n)``.

    Returns:
        ``(*)`` float64.
    """
    repeats = per_repeat.shape[-2]
    sums = (per_repeat.double() - 0.5).sum(-1)  # (*, R)
    scale = variance.double().sum(-1).sqrt()
    z = sums.mean(-1) / scale
    if repeats < 2:
        return torch.zeros_like(z)
    delta = sums.std(-1) / math.sqrt(repeats) / scale
    low, high = normal_two_sided_p_value(z.abs() + delta), normal_two_sided_p_value(
        (z.abs() - delta).clamp_min(0))  # fmt: skip
    return (high - low) / 2
