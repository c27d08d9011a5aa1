r"""Posterior mass outside the prior's support: an exact falsification of :math:`q = p`.

The true posterior :math:`p(\theta \mid x) \propto \pi(\theta)\, p(x \mid \theta)` is zero
wherever the prior :math:`\pi` is. A draw of :math:`q(\cdot \mid x)` outside the support of
:math:`\pi` is one the true posterior cannot produce. With :math:`S` draws
:math:`\theta_{is} \sim q(\cdot \mid x_i)` per pair,

.. math::
    \ell_i = \frac{1}{S} \sum_{s=1}^{S} \mathbb{1}[\theta_{is} \notin \operatorname{supp} \pi]

estimates the leakage :math:`q(\theta \notin \operatorname{supp}\pi \mid x_i)` without bias,
and one draw outside rejects :math:`q = p` with certainty: the test's p-value is 0 when a
draw is outside and 1 otherwise, so it never rejects an exact posterior (level 0) and
adds nothing to the level of a combination with other tests. A flow on
:math:`\mathbb{R}^D` trained on a bounded prior puts mass outside it unless it is
truncated; sbi's ``DirectPosterior`` rejects such draws when sampling, an estimator used
as trained does not (measured on sbibm's estimators in ``docs/calibration.md``).

References:
    Greenberg, Nonnenmacher, Macke. "Automatic Posterior Transformation for
    Likelihood-Free Inference." ICML 2019 (leakage outside the prior's support).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from calib_lightning.results import Result

__all__ = ["SupportResult", "support_leakage"]


@dataclass(eq=False)
class SupportResult(Result):
    """Draws outside the prior's support (:func:`support_leakage`).

    Attributes:
        statistic: ``()`` share of all the draws outside the support (the mean leakage).
        p_value: ``()`` 0 when a draw is outside, else 1 (the verdict; exact).
        leakage: ``(N,)`` share of each pair's draws outside.
        num_outside: ``()`` draws outside, of ``num_draws``.
        num_draws: ``()`` draws checked.
        observation_leakage: ``(O,)`` share of the draws at each observation outside,
            or ``None`` (not part of the verdict: the observations need not be
            simulator outputs).
    """

    verdict = "p_value"
    logged = ("statistic", "p_value")

    statistic: Tensor
    p_value: Tensor
    leakage: Tensor
    num_outside: Tensor
    num_draws: Tensor
    observation_leakage: Tensor | None = None


def support_leakage(outside: Tensor, at_observations: Tensor | None = None) -> SupportResult:
    """The leakage of each pair and the exact test (module docstring).

    Arguments:
        outside: ``(S, N)`` whether each of ``S`` draws per calibration pair lies outside
            the prior's support (bool).
        at_observations: ``(S', O)`` the same at the observations, or ``None``.

    Example:
        >>> outside = torch.tensor([[False, True], [False, False]])  # S = 2, N = 2
        >>> out = support_leakage(outside)
        >>> out.leakage, out.statistic, out.p_value
        (tensor([0.0000, 0.5000]), tensor(0.2500), tensor(0.))
    """
    for name, value in (("outside", outside), ("at_observations", at_observations)):
        if value is not None and (value.dtype != torch.bool or value.ndim != 2):
            raise ValueError(
                f"{name} must be a bool tensor of shape (S, N), got "
                f"{value.dtype} {tuple(value.shape)}"
            )
    count = outside.sum()
    return SupportResult(
        statistic=outside.float().mean(),
        p_value=(count == 0).float(),
        leakage=outside.float().mean(0),
        num_outside=count,
        num_draws=torch.tensor(outside.numel(), device=outside.device),
        observation_leakage=None if at_observations is None else at_observations.float().mean(0),
    )
