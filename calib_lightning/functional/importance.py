r"""Expected coverage of a posterior known up to its normalizing constant, without MCMC.

For a calibration pair :math:`(\theta^*, x)` and an unnormalized posterior
:math:`\tilde q(\theta \mid x)`, the highest-density credibility of the truth is
:math:`c^* = Q(\tilde q(\theta \mid x) > \tilde q(\theta^* \mid x))`, the posterior mass of
the points more probable than it. Hermans et al. (2022) and swyft estimate it by
self-normalized importance sampling from a proposal :math:`g` (the prior by default):
``M`` draws :math:`\theta_k \sim g(\cdot \mid x)` with weights
:math:`w_k = \tilde q(\theta_k \mid x) / g(\theta_k \mid x)`, and
:math:`\hat c = \sum_k \bar w_k 1[\tilde q(\theta_k) > \tilde q(\theta^*)]`.

That estimate is biased at finite ``M`` (its level drifts as the effective sample size
falls). :func:`importance_credibility` adds the truth to the sample, with its own
weight :math:`w_0 = \tilde q(\theta^*) / g(\theta^*)`, and randomizes inside the truth's
own mass:

.. math::
    c = \frac{\sum_{k \ge 1} w_k 1[\tilde q(\theta_k) > \tilde q(\theta^*)]
              + V \big(w_0 + \sum_{k \ge 1} w_k 1[\tilde q(\theta_k) = \tilde q(\theta^*)]\big)}
             {\sum_{k = 0}^{M} w_k},
    \qquad V \sim U(0, 1).

If :math:`\theta^* \sim q(\cdot \mid x)` and the draws come from :math:`g`, then given
the set :math:`\{\theta^*, \theta_1, \dots, \theta_M\}` the truth is any of its points
with probability proportional to its weight (the identity behind conditional
importance sampling, Andrieu, Doucet and Holenstein 2010), so :math:`c` is the
randomized probability integral transform of a discrete distribution and is **exactly**
:math:`U(0, 1)` for every ``M`` and every proposal whose support covers the posterior's.
The test then holds its level; what a small effective sample size costs is power: with
all the weight on the truth, :math:`c = V` and nothing can be seen.
:func:`importance_coverage` therefore refuses to judge below ``min_ess``.

Sign: ``coverage_error`` :math:`= \frac12 - \bar c`, the signed area between the
expected-coverage curve (the ECDF of :math:`c`) and the diagonal; **negative =
over-confident** (or biased: a shifted posterior reads negative too), as
:func:`~calib_lightning.functional.sbc.coverage_error`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from calib_lightning._utils.validation import check_positive
from calib_lightning.functional.bands import ecdf_test
from calib_lightning.functional.combine import combine_p_values
from calib_lightning.functional.sbc import uniformity_test
from calib_lightning.results import Result

__all__ = [
    "MIN_EFFECTIVE_SAMPLE_SIZE",
    "ImportanceCoverageResult",
    "importance_coverage",
    "importance_credibility",
]

#: median effective sample size below which :func:`importance_coverage` does not judge
MIN_EFFECTIVE_SAMPLE_SIZE = 50.0


@dataclass(eq=False)
class ImportanceCoverageResult(Result):
    r"""What :class:`calib_lightning.ImportanceCoverage` returns.

    Attributes:
        global_p_value: ``()`` the verdict, Cauchy combination of ``p_value`` and
            ``ecdf_p_value``; NaN when ``cannot_judge``.
        p_value: ``()`` chi-square test of the credibilities against :math:`U(0, 1)` in
            ``num_bins`` equal bins (:func:`~calib_lightning.functional.sbc.uniformity_test`).
        ecdf_p_value: ``()`` exact simultaneous ECDF-band test
            (:func:`~calib_lightning.functional.bands.ecdf_test`) at ``levels``.
        coverage_error: ``()`` :math:`\frac12 - \bar c`; negative = over-confident.
        levels: ``(K,)`` credibility levels of the curve.
        coverage: ``(K,)`` expected coverage, the fraction of pairs with :math:`c \le`
            level.
        credibility: ``(N,)`` float64 the randomized credibilities :math:`c`.
        effective_sample_size: ``(N,)`` :math:`(\sum_k w_k)^2 / \sum_k w_k^2` over the
            ``M`` proposal draws of each pair.
        ess_min: ``()`` its minimum. ess_median: ``()`` its median.
        num_pairs: ``()`` ``N``. num_bins: ``()`` chi-square bins.
        cannot_judge: ``None``, or why the p-values and ``coverage_error`` are NaN.
    """

    logged: ClassVar[tuple[str, ...]] = (
        "global_p_value",
        "p_value",
        "ecdf_p_value",
        "coverage_error",
        "ess_min",
        "ess_median",
    )
    verdict: ClassVar[str | None] = "global_p_value"
    global_p_value: Tensor
    p_value: Tensor
    ecdf_p_value: Tensor
    coverage_error: Tensor
    levels: Tensor
    coverage: Tensor
    credibility: Tensor
    effective_sample_size: Tensor
    ess_min: Tensor
    ess_median: Tensor
    num_pairs: Tensor
    num_bins: Tensor
    cannot_judge: str | None = None


def importance_credibility(
    log_target: Tensor,
    log_proposal: Tensor,
    log_target_theta: Tensor,
    log_proposal_theta: Tensor,
    *,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, Tensor]:
    r"""Randomized HPD credibility of the truth by importance sampling, and the ESS.

    Arguments:
        log_target: :math:`\log \tilde q(\theta_k \mid x)` of the draws, ``(M, N)``, up to
            a constant per pair (``-inf`` outside the target's support).
        log_proposal: :math:`\log g(\theta_k \mid x)` of the same draws, ``(M, N)``,
            finite (they were drawn from ``g``); up to the same kind of constant.
        log_target_theta: :math:`\log \tilde q(\theta^* \mid x)`, ``(N,)``.
        log_proposal_theta: :math:`\log g(\theta^* \mid x)`, ``(N,)``, finite: the
            proposal must cover the truth.
        generator: for :math:`V`.

    Returns:
        ``(credibility, effective_sample_size)``, each ``(N,)`` float64: :math:`c` (module
        docstring), in :math:`[0, 1]`, and :math:`(\sum_k w_k)^2 / \sum_k w_k^2` over the
        ``M`` draws (0 when every draw has weight 0).

    Example:
        Target = proposal (equal weights); the truth is less probable than 2 of 4 draws,
        so :math:`c = (2 + V) / 5`:

        >>> lt = torch.tensor([[3.0], [2.0], [0.0], [-1.0]])
        >>> c, ess = importance_credibility(lt, lt, torch.ones(1), torch.ones(1),
        ...                                 generator=torch.Generator().manual_seed(0))
        >>> 0.4 <= float(c) <= 0.6, float(ess)
        (True, 4.0)

    References:
        Hermans et al. "A trust crisis in simulation-based inference? Your posterior
        approximations can be unfaithful." TMLR (2022). Andrieu, Doucet, Holenstein.
        "Particle Markov chain Monte Carlo methods." JRSS B 72 (2010).
    """
    if log_target.ndim != 2 or log_target.shape[0] < 1 or log_proposal.shape != log_target.shape:
        raise ValueError(
            f"log_target and log_proposal must have the same shape (M, N), M >= 1, got "
            f"{tuple(log_target.shape)} and {tuple(log_proposal.shape)}"
        )
    n = log_target.shape[1]
    for name, value in (
        ("log_target_theta", log_target_theta),
        ("log_proposal_theta", log_proposal_theta),
    ):
        if value.shape != (n,):
            raise ValueError(f"{name} must have shape (N,) = ({n},), got {tuple(value.shape)}")
    if bool(torch.isnan(log_target).any() | torch.isnan(log_target_theta).any()):
        raise ValueError("log_target and log_target_theta must not be NaN (-inf is allowed)")
    if not bool(torch.isfinite(log_proposal).all()):
        raise ValueError("log_proposal must be finite: the draws come from the proposal")
    if not bool(torch.isfinite(log_proposal_theta).all()):
        bad = int((~torch.isfinite(log_proposal_theta)).sum())
        raise ValueError(
            f"log_proposal_theta must be finite: the proposal must cover every true theta, "
            f"got {bad} pairs outside its support"
        )
    if bool((log_target_theta == float("inf")).any() | (log_target == float("inf")).any()):
        raise ValueError("log_target and log_target_theta must be below +inf")
    lt, lp = log_target.double(), log_proposal.double()
    lt0, lp0 = log_target_theta.double(), log_proposal_theta.double()
    log_w, log_w0 = lt - lp, lt0 - lp0
    shift = torch.maximum(log_w.amax(0), log_w0)
    shift = torch.where(torch.isfinite(shift), shift, 0.0)
    w, w0 = (log_w - shift).exp(), (log_w0 - shift).exp()
    above = (w * (lt > lt0)).sum(0)
    tied = w0 + (w * (lt == lt0)).sum(0)
    v = torch.rand(n, generator=generator, dtype=torch.float64).to(w.device)
    total = w.sum(0) + w0
    credibility = ((above + v * tied) / total).clamp(0.0, 1.0)
    sum_w = w.sum(0)
    ess = torch.where(sum_w > 0, sum_w**2 / (w**2).sum(0).clamp_min(1e-300), 0.0)
    return credibility, ess


def importance_coverage(
    credibility: Tensor,
    effective_sample_size: Tensor,
    *,
    min_ess: float = MIN_EFFECTIVE_SAMPLE_SIZE,
    num_bins: int | None = None,
    num_ecdf_points: int = 100,
) -> ImportanceCoverageResult:
    r"""Uniformity tests, expected-coverage curve and coverage error of credibilities.

    Arguments:
        credibility: ``(N,)`` from :func:`importance_credibility`, ``N >= 2``.
        effective_sample_size: ``(N,)`` from :func:`importance_credibility`.
        min_ess: when the median effective sample size is below it, the result's
            p-values and ``coverage_error`` are NaN and ``cannot_judge`` says why.
        num_bins: chi-square bins (default ``min(20, max(2, N // 5))``).
        num_ecdf_points: ``K`` levels ``k / (K + 1)`` of the curve and the ECDF test.

    Returns:
        :class:`ImportanceCoverageResult`.

    Example:
        >>> c = (torch.arange(200, dtype=torch.float64) + 0.5) / 200  # perfectly uniform
        >>> out = importance_coverage(c, torch.full((200,), 500.0))
        >>> float(out.coverage_error), bool(out.global_p_value > 0.99), out.cannot_judge
        (0.0, True, None)
        >>> importance_coverage(c, torch.full((200,), 3.0)).cannot_judge[:40]
        'median effective sample size 3.0 < min_e'
    """
    n = credibility.shape[0] if credibility.ndim == 1 else 0
    if n < 2 or effective_sample_size.shape != credibility.shape:
        raise ValueError(
            f"credibility and effective_sample_size must have the same shape (N,), N >= 2, "
            f"got {tuple(credibility.shape)} and {tuple(effective_sample_size.shape)}"
        )
    c = credibility.double().cpu()
    if not bool(((c >= 0) & (c <= 1)).all()):
        raise ValueError("credibility must lie in [0, 1] (and not be NaN)")
    if isinstance(min_ess, bool) or not isinstance(min_ess, int | float) or min_ess < 0:
        raise ValueError(f"min_ess must be a number >= 0, got {min_ess!r}")
    check_positive("num_ecdf_points", num_ecdf_points, integer=True)
    num_bins = min(20, max(2, n // 5)) if num_bins is None else num_bins
    check_positive("num_bins", num_bins, integer=True)
    if num_bins < 2:
        raise ValueError(f"num_bins must be >= 2, got {num_bins}")
    ess = effective_sample_size.double().cpu()
    levels = torch.arange(1, num_ecdf_points + 1, dtype=torch.float64) / (num_ecdf_points + 1)
    coverage = (c[:, None] <= levels).double().mean(0)
    cells = (c * num_bins).floor().clamp(0, num_bins - 1).long()
    histogram = torch.bincount(cells, minlength=num_bins)
    _, p_value = uniformity_test(histogram, num_bins)
    _, ecdf_p_value = ecdf_test(coverage, levels, n)
    global_p = combine_p_values(torch.stack([p_value, ecdf_p_value.to(p_value)]))
    error = 0.5 - c.mean()
    median = ess.median()
    reason = None
    if not float(median) >= min_ess:
        reason = (
            f"median effective sample size {float(median):.1f} < min_ess = {min_ess:g} "
            f"(min {float(ess.min()):.1f}): the importance weights rest on a few draws and "
            "the test could not see a miscalibration; draw more proposal samples "
            "(num_proposal_samples) or use a proposal closer to the posterior "
            "(proposal='adaptive', a Gaussian fitted to each pair, or a flow trained on the "
            "same simulations)"
        )
        nan = torch.tensor(math.nan, dtype=torch.float64)
        global_p, p_value, ecdf_p_value, error = nan, nan.clone(), nan.clone(), nan.clone()
    return ImportanceCoverageResult(
        global_p_value=global_p,
        p_value=p_value,
        ecdf_p_value=ecdf_p_value.double(),
        coverage_error=error,
        levels=levels,
        coverage=coverage,
        credibility=c,
        effective_sample_size=ess,
        ess_min=ess.min(),
        ess_median=median,
        num_pairs=torch.tensor(n),
        num_bins=torch.tensor(num_bins),
        cannot_judge=reason,
    )
