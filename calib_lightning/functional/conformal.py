r"""Split-conformal credible regions: the calibrated level of HPD-type regions.

**Score.** For a pair :math:`(\theta^*, x)` and ``S`` draws :math:`\theta_k \sim q(\cdot
\mid x)`, the *credibility* of :math:`\theta^*` is the share of draws more probable than
it, an estimate of the :math:`q`-mass of the smallest HPD region of :math:`q(\cdot \mid
x)` that contains :math:`\theta^*` (the CDF of the HPD score under :math:`q`, the
"CDF-split" score of CP4SBI):

.. math::
    r = \#\{k : \ell(\theta_k) > \ell(\theta^*)\}, \qquad
    c = \frac{r + U}{S + 1}, \quad U \sim \mathrm{Uniform}(0, 1),

with :math:`\ell = \log q(\cdot \mid x)` (or a density-free statistic of the draws,
:func:`~calib_lightning.functional.distance_log_prob`). The randomization makes
:math:`c` continuous (no ties between pairs) and exactly uniform under an exact
posterior.

**Calibrated level.** For nominal level :math:`1 - \alpha` and held-out scores
:math:`c_1, \dots, c_n` of exchangeable pairs, the calibrated level is the
:math:`k`-th smallest score, :math:`k = \lceil (n + 1)(1 - \alpha) \rceil`
(:func:`conformal_quantile`). For a new exchangeable pair,

.. math::
    1 - \alpha \le P(c_{n+1} \le \hat a) \le 1 - \alpha + \frac{1}{n + 1},

the upper bound needing no ties (true for the randomized score). The region at
:math:`x` is the HPD region of :math:`q(\cdot \mid x)` at credibility :math:`\hat a`:
:math:`\{\theta : r(\theta) < \hat a (S + 1)\}`, i.e. a log-density above
:func:`density_threshold`. It contains :math:`\{c \le \hat a\}`, so its coverage is at
least :math:`1 - \alpha` too (and at most the upper bound plus :math:`P(r = \lceil \hat a
(S + 1) \rceil - 1)`, about :math:`1 / (S + 1)` unless the truth often lies beyond all
the draws).

**Coverage error.** Over all nominal levels at once, the signed area between the
coverage curve of the calibrated regions on new pairs and the diagonal has a closed form
(:func:`conformal_coverage_error`), the conformal counterpart of the rank-based
``coverage_error`` of :mod:`calib_lightning.functional.sbc`.

**Local.** With a partition of the ``x`` space built without the calibration pairs (a
regression tree fitted on other pairs), :func:`leaf_quantiles` takes one conformal
quantile per cell: the coverage bound then holds within every cell (with the cell's
``n``), hence marginally.

References:
    Vovk, Gammerman, Shafer. "Algorithmic Learning in a Random World." Springer (2005).

    Cabezas, Soares, Ramos, Stern, Izbicki. "Distribution-free calibration of
    statistical confidence sets." (LOCART) 2024; Vagner, Cabezas, Izbicki et al.
    "CP4SBI: Local Conformal Calibration of Credible Sets in Simulation-Based
    Inference." arXiv:2508.17077 (2025).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from calib_lightning._utils.validation import check_probability

__all__ = [
    "conformal_coverage_error",
    "conformal_quantile",
    "credibility",
    "density_threshold",
    "leaf_quantiles",
    "min_pairs",
]


def min_pairs(level: float) -> int:
    r"""The fewest held-out pairs that give a finite conformal quantile at ``level``:
    :math:`\lceil (n + 1)\,\mathrm{level} \rceil \le n \iff n \ge
    \mathrm{level} / (1 - \mathrm{level})`.

    Example:
        >>> min_pairs(0.9), min_pairs(0.95)
        (9, 19)
    """
    check_probability("level", level)
    return math.ceil(level / (1 - level) - 1e-9)


def _rank_of(level: float, n: int) -> int:
    return math.ceil((n + 1) * level - 1e-9)


def conformal_quantile(scores: Tensor, level: float) -> Tensor:
    r"""The conformal quantile: the :math:`\lceil (n + 1)\,\mathrm{level} \rceil`-th
    smallest of ``n`` scores (module docstring), along the last dimension.

    Arguments:
        scores: held-out scores ``(*, n)``, finite.
        level: nominal coverage :math:`1 - \alpha` in ``(0, 1)``.

    Returns:
        ``(*)``, the calibrated threshold.

    Raises:
        ValueError: ``n`` below :func:`min_pairs` (the quantile would be infinite), or
            non-finite scores.

    Example:
        >>> conformal_quantile(torch.arange(1.0, 20.0), 0.9)  # k = ceil(20 * 0.9) = 18
        tensor(18.)
    """
    _check_scores(scores)
    n = scores.shape[-1]
    k = _rank_of(level, n)
    if k > n:
        raise ValueError(
            f"level {level} needs at least {min_pairs(level)} held-out pairs for a finite "
            f"conformal quantile, got {n}"
        )
    return scores.sort(-1).values[..., k - 1]


def leaf_quantiles(
    scores: Tensor, leaves: Tensor, num_leaves: int, level: float, *, fill: float = math.inf
) -> tuple[Tensor, Tensor]:
    r"""One conformal quantile per cell of a partition (LOCART).

    Arguments:
        scores: held-out scores ``(n,)``.
        leaves: the cell of each score, integers in ``[0, num_leaves)``, ``(n,)``.
        num_leaves: number of cells ``L``.
        level: nominal coverage in ``(0, 1)``.
        fill: the threshold of a cell with fewer than :func:`min_pairs` scores (the
            trivially valid "everything", ``inf`` for raw scores, 1 for credibilities).

    Returns:
        ``(thresholds (L,), counts (L,))``.

    Example:
        >>> scores = torch.cat([torch.linspace(0, 1, 20), torch.linspace(0, 2, 20)])
        >>> leaves = torch.arange(40) // 20
        >>> leaf_quantiles(scores, leaves, 3, 0.9)[0]
        tensor([0.9474, 1.8947,    inf])
    """
    _check_scores(scores)
    if scores.ndim != 1 or leaves.shape != scores.shape or leaves.is_floating_point():
        raise ValueError(
            "scores must have shape (n,) and leaves integer shape (n,), got "
            f"{tuple(scores.shape)} and {tuple(leaves.shape)} ({leaves.dtype})"
        )
    if len(leaves) and (int(leaves.min()) < 0 or int(leaves.max()) >= num_leaves):
        raise ValueError(
            f"leaves must lie in [0, {num_leaves}), got {int(leaves.min())}..{int(leaves.max())}"
        )
    check_probability("level", level)
    counts = torch.bincount(leaves, minlength=num_leaves)
    by_score = torch.argsort(scores, stable=True)  # then by leaf, keeping score order
    ranked = scores[by_score][torch.argsort(leaves[by_score], stable=True)]
    starts = torch.cumsum(counts, 0) - counts
    k = torch.ceil((counts + 1).to(torch.float64) * level - 1e-9).long()
    enough = k <= counts
    index = (starts + k - 1).clamp(0, max(len(scores) - 1, 0))
    out = torch.full((num_leaves,), fill, dtype=scores.dtype, device=scores.device)
    if scores.numel():
        out = torch.where(enough, ranked[index], out)
    return out, counts


def conformal_coverage_error(
    scores: Tensor,
    credibility_new: Tensor,
    leaves: Tensor | None = None,
    leaves_new: Tensor | None = None,
) -> Tensor:
    r"""Signed area between the coverage curve of calibrated regions and the diagonal.

    For new pairs with (non-randomized) credibilities :math:`c_i`, the calibrated region
    at nominal level :math:`t` contains :math:`\theta^*_i` iff :math:`c_i < \hat a(t)`,
    with :math:`\hat a(t)` the :math:`\lceil (n + 1) t \rceil`-th smallest held-out score
    (of :math:`c_i`'s cell when local; everything when that rank exceeds :math:`n`). The
    coverage curve :math:`C(t)` is the share of new pairs inside; integrating the step
    function exactly,

    .. math::
        \int_0^1 \big(C(t) - t\big)\, dt
        = \frac{1}{2} - \frac{1}{N} \sum_i \frac{\#\{j : s_j \le c_i\}}{n + 1},

    with :math:`s_j` and :math:`n` the held-out scores of :math:`c_i`'s cell. Same
    convention as the rank-based ``coverage_error`` (negative = over-confident); under the
    guarantee it is :math:`\frac{1}{2(n + 1)}` in expectation for randomized
    :math:`c_i` and up to about :math:`\frac{1}{S + 1}` more for the deterministic ones.

    Arguments:
        scores: held-out scores ``(n,)`` (the region's calibration scores).
        credibility_new: credibilities of the new pairs ``(N,)``.
        leaves: cell of each held-out score ``(n,)`` (local); ``None``: one cell.
        leaves_new: cell of each new pair ``(N,)``, with ``leaves``.

    Returns:
        ``()`` float64, in :math:`[-\frac12, \frac12]`.

    Example:
        >>> scores = torch.tensor([0.1, 0.3, 0.5, 0.7, 0.9], dtype=torch.float64)
        >>> conformal_coverage_error(scores, scores.clone())  # 1/2 - mean(1..5) / 6
        tensor(0., dtype=torch.float64)
    """
    _check_scores(scores)
    if scores.ndim != 1 or credibility_new.ndim != 1:
        raise ValueError(
            f"scores must have shape (n,) and credibility_new (N,), got "
            f"{tuple(scores.shape)} and {tuple(credibility_new.shape)}"
        )
    if (leaves is None) != (leaves_new is None):
        raise ValueError("leaves and leaves_new must be given together (local) or not at all")
    if leaves is None or leaves_new is None:
        leaves = torch.zeros(len(scores), dtype=torch.long, device=scores.device)
        leaves_new = torch.zeros(len(credibility_new), dtype=torch.long, device=scores.device)
    if leaves.shape != scores.shape or leaves_new.shape != credibility_new.shape:
        raise ValueError(
            f"leaves must have shape {tuple(scores.shape)} and leaves_new "
            f"{tuple(credibility_new.shape)}, got {tuple(leaves.shape)} and "
            f"{tuple(leaves_new.shape)}"
        )
    same_cell = leaves_new[:, None] == leaves[None, :]  # (N, n)
    below = (same_cell & (scores[None, :] <= credibility_new[:, None])).sum(1)
    rank = below.double() / (same_cell.sum(1).double() + 1)
    return 0.5 - rank.mean()


def credibility(
    log_prob_samples: Tensor, log_prob_theta: Tensor, noise: Tensor | None = None
) -> Tensor:
    r"""Credibility :math:`c = (r + U) / (S + 1)` of ``theta`` among ``S`` draws (module
    docstring).

    Arguments:
        log_prob_samples: :math:`\ell(\theta_k)` of the draws, ``(S, *)``.
        log_prob_theta: :math:`\ell(\theta^*)`, ``(*)`` (or ``(K, *)``: ``K`` points
            compared with the same draws).
        noise: :math:`U` in ``[0, 1)``, shaped like ``log_prob_theta``; ``None``: 0, the
            deterministic :math:`r / (S + 1)` (what region membership uses).

    Returns:
        Shaped like ``log_prob_theta``, in :math:`[0, 1)`.

    Example:
        >>> credibility(torch.tensor([[0.0], [1.0], [2.0]]), torch.tensor([0.5]))
        tensor([0.5000])
    """
    if (
        log_prob_samples.ndim < 1
        or log_prob_samples.shape[1:]
        != log_prob_theta.shape[log_prob_theta.ndim - (log_prob_samples.ndim - 1) :]
    ):
        raise ValueError(
            "log_prob_samples must have shape (S, *) and log_prob_theta (..., *), got "
            f"{tuple(log_prob_samples.shape)} and {tuple(log_prob_theta.shape)}"
        )
    extra = log_prob_theta.ndim - (log_prob_samples.ndim - 1)
    draws = log_prob_samples.reshape(
        log_prob_samples.shape[:1] + (1,) * extra + log_prob_samples.shape[1:]
    )
    above = (draws > log_prob_theta).sum(0).to(log_prob_theta.dtype)
    if noise is not None:
        if noise.shape != log_prob_theta.shape:
            raise ValueError(
                f"noise must have shape {tuple(log_prob_theta.shape)}, got {tuple(noise.shape)}"
            )
        above = above + noise
    return above / (log_prob_samples.shape[0] + 1)


def density_threshold(log_prob_samples: Tensor, level: Tensor | float) -> Tensor:
    r"""Log-density threshold of the HPD region at credibility ``level`` from ``S`` draws.

    The region :math:`\{\theta : \ell(\theta) \ge t\}` with :math:`t` the
    :math:`m`-th largest :math:`\ell(\theta_k)`, :math:`m = \lceil \mathrm{level}\,(S + 1)
    \rceil`, is exactly :math:`\{\theta : r(\theta) / (S + 1) < \mathrm{level}\}`
    (:func:`credibility` without noise); :math:`t = -\infty` (everything) when
    :math:`m > S`.

    Arguments:
        log_prob_samples: :math:`\ell(\theta_k)`, ``(S, *)``.
        level: credibility in ``(0, 1]``, a float or a tensor broadcastable to ``(*)``.

    Returns:
        ``(*)`` thresholds.

    Example:
        >>> density_threshold(torch.arange(9.0)[:, None], 0.5)  # m = 5: the 5th largest
        tensor([4.])
    """
    if log_prob_samples.ndim < 1 or log_prob_samples.shape[0] < 1:
        raise ValueError(
            f"log_prob_samples must have shape (S, *), got {tuple(log_prob_samples.shape)}"
        )
    s = log_prob_samples.shape[0]
    level = torch.as_tensor(level, dtype=torch.float64, device=log_prob_samples.device)
    if bool(((level <= 0) | (level > 1)).any()):
        raise ValueError(f"level must lie in (0, 1], got {level}")
    m = torch.ceil(level * (s + 1) - 1e-9).long().expand(log_prob_samples.shape[1:])
    ranked = log_prob_samples.sort(0, descending=True).values
    picked = ranked.gather(0, (m.clamp(max=s) - 1)[None]).squeeze(0)
    return torch.where(m > s, torch.full_like(picked, -math.inf), picked)


def _check_scores(scores: Tensor) -> None:
    if not isinstance(scores, Tensor) or scores.ndim < 1 or not scores.is_floating_point():
        raise ValueError(f"scores must be a floating tensor of shape (*, n), got {scores!r:.60}")
    if not bool(torch.isfinite(scores).all()):
        bad = int((~torch.isfinite(scores)).sum())
        raise ValueError(f"scores must be finite, got {bad} non-finite values")
