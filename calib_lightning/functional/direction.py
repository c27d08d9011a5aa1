r"""Directional tests on rank histograms: over- or under-confident, biased high or low.

The rank checks test "ranks are uniform", which says *that* a posterior is wrong, not
*how*. A direction is a one-sided hypothesis about the mean of the ranks. With ``M``
draws per pair, the fractional rank of pair ``i`` is :math:`u_i = (r_i + \tfrac12) /
(M + 1)`; under calibration :math:`r_i` is uniform on :math:`\{0, \dots, M\}` (ties
broken at random), so :math:`E[u] = 1/2` exactly, whatever the posterior's shape.

* **Joint (energy, HPD) rank**: :math:`\bar u - 1/2 = -\,\mathrm{coverage\_error}`. A
  mean above 1/2 means the truth is less probable than most draws: the credible
  regions cover it less often than they claim (over-confident: too narrow, or
  misplaced); below 1/2, more often (under-confident: too wide).
* **Marginal rank of parameter** ``a`` (number of draws below the truth): a mean above
  1/2 means the draws sit below the truth (posterior too low), below 1/2 too high.
  A dispersion error alone (a U or a hump, symmetric) leaves this mean at 1/2, so it
  is a test of location, not of width.

The test is a one-sample t-test of :math:`E[u] = 1/2` on the ``N`` independent ranks,

.. math::
    t = \frac{\bar u - 1/2}{s_u / \sqrt N}, \qquad
    p_{\mathrm{greater}} = P(T_{N-1} \ge t), \quad p_{\mathrm{less}} = P(T_{N-1} \le t),

with :math:`s_u` the sample standard deviation of the :math:`u_i` (divisor ``N - 1``).
Studentizing matters: the one-sided null "not over-confident" (:math:`E[u] \le 1/2`)
and the bias nulls hold for non-uniform ranks too (a too-narrow but unbiased posterior
has U-shaped marginal ranks with mean 1/2 and a larger variance than the uniform's),
and a test with the uniform's variance :math:`M (M + 2) / (12 (M+1)^2)` would exceed
its level there. The ranks are bounded, so the central limit theorem makes the level
exact as ``N`` grows; ``tests/test_direction.py`` measures it by simulation at
``N = 30`` to ``1000`` for uniform, U-shaped and hump-shaped ranks.

Naming a direction is a multiple test over the ``2 (D + 1)`` one-sided hypotheses
(over, under; each parameter high, low): :func:`~calib_lightning.functional.holm_adjust`
controls the family-wise error under any dependence between them.

References:
    Talts et al. "Validating Bayesian inference algorithms with simulation-based
    calibration." arXiv:1804.06788 (2018): the shapes of rank histograms.

    Holm. "A Simple Sequentially Rejective Multiple Test Procedure." Scandinavian
    Journal of Statistics 6 (1979).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from calib_lightning.functional._tails import student_t_cdf
from calib_lightning.functional.ranks import _check_counts

__all__ = ["RankMeanTest", "credibility_mean_test", "rank_mean_test"]


class RankMeanTest(NamedTuple):
    r"""What :func:`rank_mean_test` returns, each ``(*)`` float64.

    Attributes:
        offset: :math:`\bar u - 1/2`, in :math:`[-1/2, 1/2]`; for the joint rank
            ``-coverage_error``.
        standard_error: :math:`s_u / \sqrt N`.
        statistic: :math:`t`, the offset over its standard error.
        p_greater: p-value of :math:`E[u] \le 1/2` against :math:`E[u] > 1/2`.
        p_less: p-value of :math:`E[u] \ge 1/2` against :math:`E[u] < 1/2`.
        num_pairs: ``N``.
    """

    offset: Tensor
    standard_error: Tensor
    statistic: Tensor
    p_greater: Tensor
    p_less: Tensor
    num_pairs: Tensor


def rank_mean_test(histogram: Tensor) -> RankMeanTest:
    r"""One-sided t-tests of "the mean fractional rank is 1/2", from rank counts.

    Arguments:
        histogram: rank counts ``(*, M + 1)``, ``N >= 2`` pairs per row (for example
            ``RankCalibrationResult.histogram``, ``(D + 1, M + 1)``: marginal rows, then
            the joint rank).

    Returns:
        :class:`RankMeanTest`, each field ``(*)``. A row whose ranks are all equal has
        :math:`s_u = 0`: its p-value is
        :data:`~calib_lightning.functional.bands.P_VALUE_FLOOR` on the side of its
        offset and 1 on the other (1/2 on both when the offset is 0).

    Example:
        >>> flat = torch.full((11,), 10)  # M = 10, N = 110 uniform ranks
        >>> low = torch.tensor([30, 20, 10, 10, 10, 10, 10, 5, 3, 1, 1])  # truths low
        >>> out = rank_mean_test(torch.stack([flat, low]))
        >>> out.offset
        tensor([ 0.0000, -0.2083], dtype=torch.float64)
        >>> float(out.p_greater[0]), float(out.p_less[0]), bool(out.p_less[1] < 1e-9)
        (0.5, 0.5, True)
    """
    _check_counts("histogram", histogram)
    if histogram.ndim < 1 or histogram.shape[-1] < 2:
        raise ValueError(
            f"histogram must have shape (*, M + 1) with M >= 1, got {tuple(histogram.shape)}"
        )
    counts = histogram.double()
    n = counts.sum(-1)
    if bool((n < 2).any()):
        raise ValueError(f"histogram rows must count N >= 2 pairs, got N = {n.min():.0f}")
    m = counts.shape[-1] - 1
    centred = torch.arange(m + 1, dtype=torch.float64, device=counts.device) * 2 - m  # 2r - M
    offset = (counts * centred).sum(-1) / (2 * n * (m + 1))  # integer sums: exact 0 when flat
    u = (centred / (m + 1) + 1) / 2  # (r + 1/2) / (M + 1)
    variance = (counts * (u - 0.5 - offset.unsqueeze(-1)) ** 2).sum(-1) / (n - 1)
    error = (variance / n).sqrt()
    error = torch.where(error > 1e-12, error, torch.zeros_like(error))  # rounding of all-equal
    statistic = torch.where(error > 0, offset / error, offset.sign() * torch.inf)
    statistic = torch.where(offset == 0, torch.zeros_like(statistic), statistic)
    return RankMeanTest(
        offset=offset,
        standard_error=error,
        statistic=statistic,
        p_greater=student_t_cdf(-statistic, n - 1),  # P(T >= t)
        p_less=student_t_cdf(statistic, n - 1),  # P(T <= t)
        num_pairs=n,
    )


def credibility_mean_test(credibility: Tensor) -> RankMeanTest:
    r"""The one-sided t-tests of :func:`rank_mean_test` on continuous credibilities.

    For credibilities :math:`c_i \in [0, 1]` that are :math:`U(0, 1)` under calibration
    (the importance-sampled highest-density credibility of
    :func:`~calib_lightning.functional.importance_credibility`, the latent ball's
    :math:`F_{\chi^2_D}(|z|^2)`): :math:`t = (\bar c - 1/2) / (s_c / \sqrt N)`,
    studentized for the same reason as the ranks' test. A mean above 1/2 means the truth
    sits outside most of the posterior's mass: its credible regions cover it too rarely
    (over-confident, or misplaced); below 1/2, too often (under-confident).

    Arguments:
        credibility: ``(*, N)``, ``N >= 2``.

    Returns:
        :class:`RankMeanTest`, each field ``(*)``, ``offset`` :math:`\bar c - 1/2`
        (``-coverage_error``).

    Example:
        >>> high = torch.linspace(0.3, 1.0, 50)  # truths in the tails
        >>> out = credibility_mean_test(high)
        >>> round(float(out.offset), 3), bool(out.p_greater < 1e-4), float(out.p_less) > 0.99
        (0.15, True, True)
    """
    if not isinstance(credibility, Tensor) or credibility.ndim < 1:
        got = tuple(credibility.shape) if isinstance(credibility, Tensor) else credibility
        raise ValueError(f"credibility must have shape (*, N), got {got}")
    if credibility.shape[-1] < 2:
        raise ValueError(f"credibility must hold N >= 2 values, got {credibility.shape[-1]}")
    c = credibility.double()
    n = torch.full(c.shape[:-1], float(c.shape[-1]), dtype=torch.float64, device=c.device)
    offset = c.mean(-1) - 0.5
    error = (c.var(-1) / n).sqrt()
    error = torch.where(error > 1e-12, error, torch.zeros_like(error))
    statistic = torch.where(error > 0, offset / error, offset.sign() * torch.inf)
    statistic = torch.where(offset == 0, torch.zeros_like(statistic), statistic)
    return RankMeanTest(
        offset=offset,
        standard_error=error,
        statistic=statistic,
        p_greater=student_t_cdf(-statistic, n - 1),
        p_less=student_t_cdf(statistic, n - 1),
        num_pairs=n,
    )
