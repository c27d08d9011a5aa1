r"""Differentiable expected-coverage regularizer (Falkiewicz et al., 2023).

References:
    Falkiewicz, Takeishi, Shekhzadeh, Wehenkel, Delaunoy, Louppe, Kalousis.
    "Calibrating Neural Simulation-Based Inference with Differentiable Coverage
    Probability." NeurIPS 2023.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from calib_lightning import evaluation
from calib_lightning._utils.validation import check_finite, check_pairs, check_positive, check_shape
from calib_lightning.posteriors import Posterior

__all__ = ["CoverageLoss"]


def _straight_through_step(value: Tensor, temperature: float) -> Tensor:
    """``1[value > 0]`` forward; gradient of ``sigmoid(value / temperature)`` backward."""
    soft = torch.sigmoid(value / temperature)
    return (value > 0).to(value.dtype) + (soft - soft.detach())


class CoverageLoss(nn.Module):
    r"""Differentiable expected-coverage regularizer (Falkiewicz et al., 2023).

    For each pair draw :math:`L` reparameterized samples :math:`\theta_{il} \sim
    q(\cdot \mid x_i)` and count those more probable than the truth,

    .. math::
        r_i = \sum_l \mathrm{step}\big(\log q(\theta_{il} \mid x_i) -
              \log q(\theta^*_i \mid x_i)\big), \qquad
        c_i = \frac{r_i + u_i}{L + 1}, \quad u_i \sim U(0, 1),

    the credibility level of the smallest highest-density region containing
    :math:`\theta^*_i` (randomized within its rank, so that :math:`c_i \sim U(0, 1)`
    exactly under calibration). The step is hard in the forward pass and has the
    gradient of :math:`\mathrm{sigmoid}(\cdot / \tau)` in the backward pass
    (straight-through). With :math:`c_{(k)}` sorted across the batch
    (``torch.sort`` passes gradients to the values),

    .. math::
        \mathcal{L} = \frac1n \sum_k \big(c_{(k)} - \tfrac{k - 1/2}{n}\big)^2

    the squared distance between the expected-coverage curve and the diagonal;
    ``conservative=True`` penalizes only over-confidence
    (:math:`c_{(k)} > (k - 1/2)/n`). Sampling needs ``L`` inverse passes of the flow
    per pair (``D`` network passes each for an autoregressive flow), which is where
    its cost comes from; the paper's weight is 5.

    Arguments:
        num_posterior_samples: ``L``.
        temperature: :math:`\tau`, in log-density units.
        conservative: one-sided version.

    Example:
        >>> from calib_lightning.tasks import GaussianToy
        >>> toy = GaussianToy(dim=2)
        >>> theta, x = toy.sample(512, torch.Generator().manual_seed(0))
        >>> _ = torch.manual_seed(0)
        >>> loss = CoverageLoss()
        >>> bool(loss(toy.posterior(), theta, x) < loss(toy.posterior(0.3), theta, x))
        True

    References:
        Falkiewicz, Takeishi, Shekhzadeh, Wehenkel, Delaunoy, Louppe, Kalousis.
        "Calibrating Neural Simulation-Based Inference with Differentiable Coverage
        Probability." NeurIPS 2023.
    """

    def __init__(
        self,
        num_posterior_samples: int = 16,
        temperature: float = 1.0,
        conservative: bool = False,
    ) -> None:
        super().__init__()
        check_positive("num_posterior_samples", num_posterior_samples, integer=True)
        check_positive("temperature", temperature)
        self.num_posterior_samples, self.temperature = num_posterior_samples, float(temperature)
        self.conservative = bool(conservative)

    def extra_repr(self) -> str:
        return (
            f"num_posterior_samples={self.num_posterior_samples}, temperature={self.temperature}, "
            f"conservative={self.conservative}"
        )

    def forward(
        self,
        posterior: Posterior | object,
        theta: Tensor,
        x: Tensor,
        log_prob: Tensor | None = None,
    ) -> Tensor:
        r"""Regularizer on the batch ``theta (n, D)``, ``x (n, *X)``, ``n >= 2``: a scalar.

        ``log_prob``: :math:`\log q(\theta_i \mid x_i)` ``(n,)`` with its graph, if the
        caller already has it from the NLL.
        """
        check_pairs(theta, x, min_rows=2)
        _, log_q, log_q_true = evaluation.reparameterized_draws(
            posterior, theta, x, self.num_posterior_samples, at_theta=log_prob is None
        )
        if log_prob is not None:
            log_q_true = log_prob
        check_shape("log_prob", log_q_true, theta.shape[:1])
        check_finite("posterior log_prob at theta", log_q_true)
        above = _straight_through_step(log_q - log_q_true, self.temperature)
        jitter = torch.rand(theta.shape[0], dtype=theta.dtype, device=theta.device)
        level = (above.sum(0) + jitter) / (self.num_posterior_samples + 1)
        n = theta.shape[0]
        quantiles = (torch.arange(n, dtype=theta.dtype, device=theta.device) + 0.5) / n
        gap = torch.sort(level).values - quantiles
        if self.conservative:
            gap = gap.clamp_min(0.0)
        return (gap**2).mean()
