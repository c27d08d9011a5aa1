r"""The balancing condition of a ratio estimator, with a test (Delaunoy et al., 2022).

A ratio estimator :math:`\log r(\theta, x)` is a classifier
:math:`d(\theta, x) = \sigma(\log r(\theta, x))` between joint pairs
:math:`(\theta, x) \sim p(\theta, x)` and marginal pairs
:math:`(\theta', x) \sim p(\theta) p(x)`. The Bayes-optimal classifier, and any
*balanced* one, satisfies :math:`E_{\text{joint}}[d] + E_{\text{marginal}}[d] = 1`, so

.. math::
    B = E_{\text{joint}}[\sigma(\log r)] + E_{\text{marginal}}[\sigma(\log r)] - 1

is 0 for the exact ratio. It is estimated on calibration pairs :math:`(\theta_i, x_i)`,
:math:`i = 1..N`, from the matrix :math:`d_{ij} = \sigma(f(\theta_j, x_i))`: its diagonal
holds the joint pairs, its :math:`N (N - 1)` other entries marginal pairs,

.. math::
    \hat B = \frac{1}{N} \sum_i d_{ii} + \frac{1}{N (N - 1)} \sum_{i \ne j} d_{ij} - 1,

an unbiased U-statistic. Its variance comes from its Hoeffding projection: with
:math:`\bar r_i = \frac{1}{N-1} \sum_{j \ne i} d_{ij}` (``x_i`` fixed) and
:math:`\bar c_i = \frac{1}{N-1} \sum_{j \ne i} d_{ji}` (``theta_i`` fixed),
:math:`\psi_i = d_{ii} + \bar r_i + \bar c_i`, plus its second-order term from the
residuals :math:`e_{ij} = d_{ij} - \bar r_i - \bar c_j + \bar d_{\text{marginal}}`,

.. math::
    \widehat{\operatorname{se}}^2 = \frac{\widehat{\operatorname{Var}}(\psi)}{N}
        + \frac{1}{N (N - 1)} \cdot \frac{1}{N (N - 1)} \sum_{i \ne j} e_{ij}^2;

the
two-sided test of :math:`B = 0` refers :math:`\hat B / \widehat{\operatorname{se}}` to
Student's t with :math:`N - 1` degrees of freedom.

The cost is :math:`N^2` evaluations of the estimator (per batch, in a streaming
metric); why all pairs rather than one marginal partner per pair: ``docs/design.md``,
"Ratio balance: all pairs".

Streaming: the six sums of :func:`balance_sums` add over independent batches (each batch
its own U-statistic) and processes.

References:
    Delaunoy, Hermans, Rozet, Wehenkel, Louppe. "Towards Reliable Simulation-Based
    Inference with Balanced Neural Ratio Estimation." NeurIPS 2022.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from scipy import stats
from torch import Tensor

from calib_lightning.results import Result

__all__ = ["RatioBalanceResult", "balance_from_sums", "balance_sums", "ratio_balance"]

#: what :func:`balance_sums` returns along its last axis, in order: pairs, batches,
#: N * B-hat + N (so that a sum over batches is N * B-hat + N overall), N^2 * se^2,
#: the sums of the joint and of the (per-batch mean) marginal classifier outputs
SUMS = ("num_pairs", "num_batches", "sum_balance", "sum_variance", "sum_joint", "sum_marginal")

#: the fewest pairs :func:`balance_from_sums` tests on
MIN_PAIRS = 10


@dataclass(eq=False)
class RatioBalanceResult(Result):
    r"""The balance of a ratio estimator and its test (:func:`ratio_balance`).

    Positive balance means the classifier :math:`\sigma(\log r)` says "joint" too often
    (over both kinds of pairs), negative too rarely. What the tests find
    (``tests/test_ratio_balance.py``, Gaussian model :math:`x \sim N(\theta, s^2)`,
    :math:`\theta \sim N(0, 1)`): an over-confident tempered ratio :math:`r^\tau`,
    :math:`\tau = 1.5`, gives a positive balance, an under-confident one
    (:math:`\tau = 0.6`) a negative one, and a constant shift :math:`\log r + c` the sign
    of :math:`c` (always: :math:`\hat B` increases with :math:`c`). A shift leaves the
    normalized posterior :math:`r\, p(\theta) / Z(x)` unchanged, so a nonzero balance
    says the ratio is wrong, not that the posterior is; its sign alone does not tell an
    over-confident ratio from one shifted up.

    Attributes:
        statistic: :math:`\hat B`, ``(*)``: 0 for the exact ratio.
        standard_error: standard error of :math:`\hat B`, ``(*)``.
        p_value: two-sided p-value of :math:`B = 0` (Student's t, :math:`N - 1` degrees
            of freedom), ``(*)``.
        lower: lower end of the ``confidence`` interval for :math:`B`, ``(*)``.
        upper: upper end, ``(*)``.
        joint: mean classifier output on the joint pairs, ``(*)``.
        marginal: mean classifier output on the marginal pairs (all pairs ``i != j``), ``(*)``.
        num_pairs: pairs used, ``(*)``.
    """

    logged = ("statistic", "p_value", "standard_error", "lower", "upper", "joint", "marginal")
    verdict = "p_value"

    statistic: Tensor
    standard_error: Tensor
    p_value: Tensor
    lower: Tensor
    upper: Tensor
    joint: Tensor
    marginal: Tensor
    num_pairs: Tensor


def balance_sums(log_ratio: Tensor) -> Tensor:
    r"""The sums behind :math:`\hat B` and its standard error for one batch of pairs,
    ``(*, 6)`` in the order of ``SUMS``; they add over independent batches and processes.

    Arguments:
        log_ratio: :math:`f(\theta_j, x_i)` at row ``i``, column ``j``, ``(*, N, N)``,
            ``N >= 2``: the diagonal holds the joint pairs.
    """
    _check_matrix(log_ratio)
    n = log_ratio.shape[-1]
    d = torch.sigmoid(log_ratio)
    joint = torch.diagonal(d, dim1=-2, dim2=-1)
    rows = (d.sum(-1) - joint) / (n - 1)  # x_i fixed, theta over the others
    cols = (d.sum(-2) - joint) / (n - 1)  # theta_i fixed, x over the others
    balance = joint.mean(-1) + rows.mean(-1) - 1
    psi = joint + rows + cols
    marginal = rows.mean(-1)
    residual = d - rows[..., :, None] - cols[..., None, :] + marginal[..., None, None]
    off = ~torch.eye(n, dtype=torch.bool, device=d.device)
    second = (residual**2).masked_fill(~off, 0.0).sum((-2, -1)) / (n * (n - 1))
    variance = psi.var(-1) / n + second / (n * (n - 1))
    return torch.stack(
        [
            torch.full_like(balance, n),
            torch.ones_like(balance),
            n * (balance + 1),
            n**2 * variance,
            joint.sum(-1),
            rows.sum(-1),
        ],
        -1,
    )


def balance_from_sums(sums: Tensor, confidence: float = 0.95) -> RatioBalanceResult:
    r""":class:`RatioBalanceResult` from the sums of :func:`balance_sums` ``(*, 6)``
    (added over batches); t with :math:`N - b` degrees of freedom for :math:`b` batches."""
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must lie in (0, 1), got {confidence!r}")
    if sums.shape[-1:] != (len(SUMS),):
        raise ValueError(f"sums must have shape (*, {len(SUMS)}), got {tuple(sums.shape)}")
    n, batches, total, variance, joint, marginal = sums.double().unbind(-1)
    if bool((n < MIN_PAIRS).any()):
        raise ValueError(f"the balance test needs at least {MIN_PAIRS} pairs, got {int(n.min())}")
    b = total / n - 1
    se = variance.clamp_min(0.0).sqrt() / n
    df = (n - batches).clamp_min(1).cpu().numpy()
    t = (b / se).cpu().numpy()
    p = torch.as_tensor(2 * stats.t.sf(abs(t), df)).to(b)
    p = torch.where(se > 0, p, (b == 0).to(b))
    half = torch.as_tensor(stats.t.ppf(0.5 + confidence / 2, df)).to(b) * se
    dtype = sums.dtype if sums.is_floating_point() else torch.float64
    return RatioBalanceResult(
        statistic=b.to(dtype),
        standard_error=se.to(dtype),
        p_value=p.to(dtype),
        lower=(b - half).to(dtype),
        upper=(b + half).to(dtype),
        joint=(joint / n).to(dtype),
        marginal=(marginal / n).to(dtype),
        num_pairs=n.long(),
    )


def ratio_balance(log_ratio: Tensor, confidence: float = 0.95) -> RatioBalanceResult:
    r"""The balance :math:`\hat B` of a ratio estimator with its standard error, two-sided
    test of :math:`B = 0` and ``confidence`` interval (module docstring), batched over
    ``*`` (e.g. independent datasets).

    Arguments:
        log_ratio: :math:`f(\theta_j, x_i)` at row ``i``, column ``j``, ``(*, N, N)``,
            ``N >= 10``: the estimator's log-ratio itself (not up to a function of ``x``:
            :math:`\sigma` is not shift-invariant); the diagonal holds the joint pairs.
        confidence: level of the interval ``[lower, upper]``.

    Returns:
        :class:`RatioBalanceResult`, fields of shape ``(*)``.

    Example:
        A constant log-ratio of 0 is the classifier 1/2 everywhere: balanced.

        >>> out = ratio_balance(torch.zeros(10, 10))
        >>> float(out.statistic), float(out.p_value)
        (0.0, 1.0)

    References:
        Delaunoy, Hermans, Rozet, Wehenkel, Louppe. "Towards Reliable Simulation-Based
        Inference with Balanced Neural Ratio Estimation." NeurIPS 2022.
    """
    return balance_from_sums(balance_sums(log_ratio), confidence)


def _check_matrix(log_ratio: Tensor) -> None:
    if (
        not isinstance(log_ratio, Tensor)
        or not log_ratio.is_floating_point()
        or (
            log_ratio.ndim < 2
            or log_ratio.shape[-1] != log_ratio.shape[-2]
            or log_ratio.shape[-1] < 2
        )
    ):
        got = (
            f"{log_ratio.dtype} tensor of shape {tuple(log_ratio.shape)}"
            if isinstance(log_ratio, Tensor)
            else type(log_ratio).__name__
        )
        raise ValueError(
            f"log_ratio must be a floating tensor of shape (*, N, N) with N >= 2, got {got}"
        )
    if not bool(torch.isfinite(log_ratio).all()):
        bad = int((~torch.isfinite(log_ratio)).sum())
        raise ValueError(f"log_ratio must be finite, got {bad} non-finite values")
