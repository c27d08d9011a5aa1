r"""Tail probabilities of the analytic tests, exact down to the smallest float64.

Every p-value the package reads off a normal, chi-square or Student t tail comes from
here, computed in float64 from functions that stay accurate until the tail probability
itself drops below float64's range:

* the normal tail from :math:`\log \Phi` (``torch.special.log_ndtr``):
  ``torch.special.ndtr(-15.8)`` is already 0 in float64 (it computes
  :math:`\frac12 (1 + \mathrm{erf}(z / \sqrt 2))`, which cancels below
  :math:`z \approx -8`), while :math:`\Phi(-15.8) = 1.2 \cdot 10^{-56}`;
* the chi-square tail :math:`Q(k/2, x/2)` from scipy's regularized upper incomplete
  gamma function (``torch.special.gammaincc`` is off by up to ``1e-9`` relative in the
  bulk, e.g. at :math:`\chi^2_{99} = 118.8`);
* the Student t tail from scipy's ``stdtr`` (incomplete beta function).

A tail probability below :data:`P_VALUE_FLOOR` (the smallest normal float64, about
``2.2e-308``) is reported as :data:`P_VALUE_FLOOR`: an upper bound on the exact
p-value, so still a valid p-value, never exactly 0.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from scipy import special
from torch import Tensor

from calib_lightning.functional.bands import P_VALUE_FLOOR

__all__ = [
    "chi2_sf",
    "floor_p_value",
    "normal_two_sided_p_value",
    "student_t_cdf",
]


def floor_p_value(p_value: Tensor) -> Tensor:
    """``p_value`` in float64, clipped to ``[P_VALUE_FLOOR, 1]``; NaN stays NaN."""
    return torch.as_tensor(p_value).double().clamp(P_VALUE_FLOOR, 1.0)


def normal_two_sided_p_value(z: Tensor) -> Tensor:
    r"""Two-sided p-value of a standard normal statistic, :math:`2 \Phi(-|z|)`.

    Computed as :math:`\exp(\log 2 + \log \Phi(-|z|))` in float64, exact to float64
    precision down to :data:`P_VALUE_FLOOR` (reached at :math:`|z| \approx 37.5`), and
    :data:`P_VALUE_FLOOR` beyond.

    Arguments:
        z: statistics, any shape ``(*)``; NaN gives NaN.

    Returns:
        ``(*)`` float64 p-values in ``[P_VALUE_FLOOR, 1]``, on ``z``'s device.

    Example:
        >>> p = normal_two_sided_p_value(torch.tensor([0.0, 1.959964, 15.8, 40.0]))
        >>> [f"{v:.4g}" for v in p.tolist()]  # 40: below the floor
        ['1', '0.05', '3.111e-56', '2.225e-308']
    """
    z = torch.as_tensor(z).double()
    log_p = math.log(2.0) + torch.special.log_ndtr(-z.abs())
    return floor_p_value(log_p.exp())


def chi2_sf(statistic: Tensor, df: float | Tensor) -> Tensor:
    r"""Chi-square tail :math:`P(\chi^2_k \ge X^2) = Q(k / 2, X^2 / 2)`, floored.

    Arguments:
        statistic: :math:`X^2 \ge 0`, any shape ``(*)``.
        df: degrees of freedom :math:`k > 0`, a number or a tensor broadcasting with
            ``statistic``.

    Returns:
        ``(*)`` float64 p-values in ``[P_VALUE_FLOOR, 1]``, on ``statistic``'s device.

    Example:
        >>> [f"{v:.4g}" for v in chi2_sf(torch.tensor([0.0, 1000.0, 5000.0]), 99).tolist()]
        ['1', '7.23e-149', '2.225e-308']
    """
    statistic = torch.as_tensor(statistic)
    x = statistic.detach().double().cpu().numpy()
    k = torch.as_tensor(df, dtype=torch.float64).cpu().numpy()
    p = torch.as_tensor(special.gammaincc(k / 2.0, x / 2.0), dtype=torch.float64)
    return floor_p_value(p).to(statistic.device)


def student_t_cdf(t: Tensor, df: float | Tensor) -> Tensor:
    r"""Student t distribution function :math:`P(T_\nu \le t)`, floored.

    Arguments:
        t: statistics, any shape ``(*)`` (``±inf`` allowed).
        df: degrees of freedom :math:`\nu > 0`, a number or a tensor broadcasting with
            ``t``.

    Returns:
        ``(*)`` float64 probabilities in ``[P_VALUE_FLOOR, 1]``, on ``t``'s device; the
        upper tail :math:`P(T_\nu \ge t)` is ``student_t_cdf(-t, df)``.

    Example:
        >>> [f"{v:.4g}" for v in student_t_cdf(torch.tensor([0.0, -40.0]), 999).tolist()]
        ['0.5', '6.213e-210']
    """
    t = torch.as_tensor(t)
    nu = np.asarray(torch.as_tensor(df, dtype=torch.float64).cpu().numpy())
    p = torch.as_tensor(special.stdtr(nu, t.detach().double().cpu().numpy()), dtype=torch.float64)
    return floor_p_value(p).to(t.device)
