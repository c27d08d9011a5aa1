r"""The joint classifier test: conformal ranks of a classifier's score over :math:`(\theta, x)`.

A classifier :math:`d(\theta, x)` is trained on one part of the calibration pairs to tell
true pairs :math:`(\theta^*_i, x_i)` from :math:`(\tilde\theta_i, x_i)`,
:math:`\tilde\theta_i \sim q(\cdot \mid x_i)`. On the other, held-out pairs, the score
of the true parameter is ranked among the scores of ``M`` posterior draws at the same
:math:`x_i`, with uniform tie-breaking:

.. math::
    u_i = \frac{\#\{m : d(\theta_{im}, x_i) < d(\theta^*_i, x_i)\} + V_i
              \big(1 + \#\{m : d(\theta_{im}, x_i) = d(\theta^*_i, x_i)\}\big)}{M + 1},
    \qquad V_i \sim U(0, 1).

For a classifier fixed before the held-out pairs are seen, :math:`H_0: q = p` makes
:math:`\theta^*_i` and the draws exchangeable given :math:`x_i`, so every :math:`u_i` is
exactly :math:`U(0, 1)` and the :math:`u_i` are independent: a conformal p-value per pair
whatever the classifier's quality (Hu and Lei 2024; Bansal, Chen and Scott 2025), here
conditional on :math:`x_i`, so a posterior that ignores :math:`x` (the prior) is visible.
The test is two-sided:

.. math::
    Z = \sqrt{12 n}\,\big(\bar u - \tfrac12\big), \qquad p = 2\,\big(1 - \Phi(|Z|)\big),

the normal approximation of the Irwin-Hall law of :math:`n \bar u` (its moments are
exact). The classifier is trained to score true pairs higher, but over the mixture of
all :math:`x`: one that learned mostly the marginal law of :math:`\theta` can rank the true
parameter *below* the draws at its own :math:`x` (a posterior shrunk half-way to the prior
at ``D = 3``: mean rank 0.30), which a one-sided test would call calibrated.

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

__all__ = ["conformal_ranks", "uniform_mean_test"]


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
    return z, 2 * torch.special.ndtr(-z.abs())
