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

**Cross-fitting, repeated, folds combined.** One random split (train on half, rank the
other half) makes the verdict a lottery over the split and the classifier's
initialization: on one fixed calibration set of a biased posterior the p-value ranged
over 3e-4-0.16 and the test rejected at 75 % of the seeds
(``examples/benchmarks/results/seed_stability.md``). So the pairs are split into ``K``
folds, each fold ranked by a classifier trained on the others, and this is repeated ``R``
times with fresh folds and classifiers. Within a fold the test is exact: given the
classifier, which did not see the fold, the position of each truth among its pair's
:math:`M + 1` values is uniform and independent across the fold's pairs, so the mean and
variance of a pair's rank follow from its own scores (:func:`averaged_ranks`, with ties:
:math:`b(j)` the count below value ``j``, :math:`c(j)` one plus its ties,
:math:`\sigma_i^2 = (\mathrm{Var}_j(b(j) + c(j)/2) + \mathrm{mean}_j\, c(j)^2/12) / (M+1)^2`,
:math:`1/12` without ties), and the fold's statistic
:math:`Z_f = \sum_{i \in f} (u_i - \frac12) / \sqrt{\sum_{i \in f} \sigma_i^2}` is
:math:`N(0, 1)` (:func:`rank_sum_test`), two-sided :math:`p_f = 2\,\Phi(-|Z_f|)`, computed
from :math:`\log \Phi` so that it does not underflow before the float64 range ends
(``2 (1 - Phi(15.8))`` is 0.0 in float64, the true value 3.1e-56).

The folds are *not* independent of each other: each fold's classifier learns the
chance pattern of the pairs it trains on, and the other fold's truths are scored by it
while its own are scored by theirs, so two folds' statistics correlate (0.12-0.20 under
:math:`H_0`, at ``N`` = 300 and 1,000). Summing all ranks into one ``Z`` therefore
inflates its spread at every ``N`` (standard deviation 1.10-1.14 from ``N`` = 100 to
1,000: level 0.08). The ``K R`` fold p-values are combined by the Cauchy combination
(:func:`~calib_lightning.functional.combine.combine_p_values`), which keeps its level under
such dependence (measured 0.047-0.053 at 0.05, 300-600 datasets) and is more powerful
than one split (a posterior shrunk 5 % of the way to the prior, ``N`` = 1,000: 0.35 of
datasets against 0.14: ``examples/benchmarks/results/joint_c2st.md``).
The
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

from calib_lightning.functional._tails import normal_two_sided_p_value

__all__ = [
    "averaged_ranks",
    "conformal_ranks",
    "rank_sum_test",
    "uniform_mean_test",
]


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
        not isinstance(score, Tensor)
        or not isinstance(drawn_scores, Tensor)
        or drawn_scores.ndim != score.ndim + 1
        or drawn_scores.shape[-1] != score.shape[-1]
        or drawn_scores.shape[:-2] != score.shape[:-1]
        or drawn_scores.shape[-2] < 1
    ):
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
    jitter = (
        torch.rand(below.shape[:-3] + below.shape[-2:-1], generator=generator, dtype=torch.float64)
        .to(below.device)
        .unsqueeze(-2)
    )  # one per pair
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
        raise ValueError(
            f"ranks and variance must have one shape (*, n) with n >= 1, got "
            f"{tuple(ranks.shape)} and {tuple(variance.shape)}"
        )
    z = (ranks.double() - 0.5).sum(-1) / variance.double().sum(-1).sqrt()
    return z, normal_two_sided_p_value(z)
