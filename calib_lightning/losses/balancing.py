r"""Balancing regularizer of balanced NPE (Delaunoy et al., 2023).

NPE's posterior defines a classifier between joint pairs :math:`(\theta, x)` and
marginal pairs :math:`(\theta', x)`, :math:`d(\theta, x) = \sigma(\log q(\theta \mid x)
- \log p(\theta))`. The classifier is *balanced* when
:math:`E_{\text{joint}}[d] + E_{\text{marginal}}[d] = 1`; Delaunoy et al. show that a
balanced classifier cannot be over-confident on average, and penalize the squared
imbalance of the batch.

References:
    Delaunoy, Miller, Forré, Weniger, Louppe. "Balancing Simulation-based Inference for
    Conservative Posteriors." AABI 2023 (arXiv:2304.10978).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn
from torch.distributions import Distribution

from calib_lightning import evaluation
from calib_lightning._utils.validation import check_finite, check_pairs, check_shape
from calib_lightning.posteriors import Posterior

__all__ = ["BalancingLoss"]


class BalancingLoss(nn.Module):
    r"""Balanced-NPE regularizer: :math:`(\bar d_{\text{joint}} + \bar d_{\text{marginal}}
    - 1)^2` on a batch.

    The marginal pairs pair each ``x_i`` with the batch's parameters rolled by one,
    :math:`\theta'_i = \theta_{i-1}`; the term needs one more pass of the flow on those
    pairs (the joint log-density can come from the NLL's pass, ``log_prob=``). The
    paper's weight is 100.

    Arguments:
        prior: the prior, a ``torch.distributions.Distribution`` with event shape
            ``(D,)`` or a callable ``theta (n, D) -> log p(theta) (n,)``.

    Example:
        >>> from calib_lightning.tasks import GaussianToy
        >>> toy = GaussianToy(dim=2)
        >>> theta, x = toy.sample(4096, torch.Generator().manual_seed(0))
        >>> loss = BalancingLoss(toy.prior())
        >>> bool(loss(toy.posterior(), theta, x) < loss(toy.posterior(0.3), theta, x))
        True

    References:
        Delaunoy, Miller, Forré, Weniger, Louppe. "Balancing Simulation-based Inference
        for Conservative Posteriors." AABI 2023 (arXiv:2304.10978).
    """

    def __init__(self, prior: Distribution | Callable[[Tensor], Tensor]) -> None:
        super().__init__()
        if isinstance(prior, Distribution):
            self.prior_log_prob: Callable[[Tensor], Tensor] = prior.log_prob
        elif callable(prior):
            self.prior_log_prob = prior
        else:
            raise ValueError(
                "prior must be a torch Distribution or a callable theta -> log p(theta), "
                f"got {type(prior).__name__}"
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
        shuffled = theta.roll(1, dims=0)
        if log_prob is None:
            both = evaluation.log_prob_and_latent(
                posterior, torch.cat([theta, shuffled]), torch.cat([x, x])
            )[0]
            log_prob, log_q_marginal = both.chunk(2)
        else:
            check_shape("log_prob", log_prob, theta.shape[:1])
            log_q_marginal = evaluation.log_prob_and_latent(posterior, shuffled, x)[0]
        log_prior = self.prior_log_prob(torch.cat([theta, shuffled]))
        check_finite("prior log_prob at theta", log_prior)
        joint = torch.sigmoid(log_prob - log_prior[: len(theta)]).mean()
        marginal = torch.sigmoid(log_q_marginal - log_prior[len(theta) :]).mean()
        return (joint + marginal - 1.0).pow(2)
