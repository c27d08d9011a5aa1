r"""Sampling-free coverage regularizer on a flow's latent space.

A flow writes :math:`q(\cdot \mid x)` as the push-forward of :math:`N(0, I_D)` by a
bijection :math:`T_x`. Under calibration :math:`z^* = T_x^{-1}(\theta^*)` is
:math:`N(0, I_D)` for every :math:`x`, so the credibility level of the flow's own
ellipsoidal region that just contains :math:`\theta^*`,

.. math::
    c = F_{\chi^2_D}(\lVert z^* \rVert^2),

is uniform on :math:`[0, 1]`, and so is each coordinate's central-interval level
:math:`c_d = F_{\chi^2_1}(z_d^{*2})`. The loss compares the sorted levels of a batch
with the uniform quantiles, as :class:`~calib_lightning.losses.CoverageLoss` does with
sampled HPD levels, but the levels are exact, differentiable through the flow's inverse
(the regularized incomplete gamma function) and cost no sampling: the latent comes
from the pass that computes the NLL.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from calib_lightning import evaluation
from calib_lightning._utils.validation import check_finite, check_pairs, check_shape
from calib_lightning.posteriors import Posterior

__all__ = ["LatentCoverageLoss", "latent_coverage_levels", "latent_coverage_loss"]


def latent_coverage_levels(latent: Tensor, *, marginal: bool = True) -> Tensor:
    r"""Credibility levels of the flow's own regions at the truth, from latents ``(n, D)``.

    Returns ``(n, 1 + D)`` with ``marginal`` (column 0: the joint level
    :math:`F_{\chi^2_D}(\lVert z \rVert^2)`; columns ``1..D``: :math:`F_{\chi^2_1}(z_d^2)`),
    or ``(n, 1)`` without. Each column is uniform under calibration; a level near 1 means
    the truth lies in the flow's tails (over-confidence).
    """
    if latent.ndim != 2:
        raise ValueError(f"latent must have shape (n, D), got {tuple(latent.shape)}")
    dim = latent.shape[1]
    half = latent.new_tensor(0.5)
    joint = torch.special.gammainc(half * dim, half * latent.pow(2).sum(1)).unsqueeze(1)
    if not marginal or dim == 1:
        return joint
    # F_chi2_1(z^2) = erf(|z| / sqrt 2): the closed form is much faster than gammainc
    return torch.cat([joint, torch.erf(latent.abs() * half.sqrt())], dim=1)


def latent_coverage_loss(
    latent: Tensor, *, conservative: bool = False, marginal: bool = True
) -> Tensor:
    r"""Squared gap between the expected-coverage curves of a batch and the diagonal.

    With :math:`c_{(k)}` the sorted levels of one column of
    :func:`latent_coverage_levels` (``torch.sort`` passes gradients to the values),

    .. math::
        \mathcal{L} = \frac1n \sum_k \big(c_{(k)} - \tfrac{k - 1/2}{n}\big)^2,

    averaged as ``(joint + mean of the D marginal terms) / 2`` (just the joint term
    without ``marginal`` or at ``D = 1``). ``conservative=True`` keeps only positive
    gaps (over-confidence), so an under-confident flow pays nothing.

    Arguments:
        latent: :math:`z_i = T_{x_i}^{-1}(\theta_i)`, ``(n, D)``, ``n >= 2``, with its
            graph.
        conservative: the one-sided form.
        marginal: add the per-coordinate terms.

    Example:
        >>> z = torch.randn(4096, 3, generator=torch.Generator().manual_seed(0))
        >>> bool(latent_coverage_loss(z) < latent_coverage_loss(1.5 * z) / 20)
        True
        >>> float(latent_coverage_loss(0.5 * z, conservative=True))
        0.0
    """
    if latent.ndim != 2 or latent.shape[0] < 2:
        raise ValueError(f"latent must have shape (n, D) with n >= 2, got {tuple(latent.shape)}")
    check_finite("latent", latent)
    levels = latent_coverage_levels(latent, marginal=marginal)
    n = levels.shape[0]
    quantiles = (torch.arange(n, dtype=levels.dtype, device=levels.device) + 0.5) / n
    gap = torch.sort(levels, dim=0).values - quantiles.unsqueeze(1)
    if conservative:
        gap = gap.clamp_min(0.0)
    per_curve = gap.pow(2).mean(0)
    if per_curve.numel() == 1:
        return per_curve[0]
    return 0.5 * (per_curve[0] + per_curve[1:].mean())


class LatentCoverageLoss(nn.Module):
    r"""Sampling-free coverage regularizer for flows (:func:`latent_coverage_loss`).

    ``loss = nll + weight * regularizer(flow, theta, x, latent=latent)``; pass the latent
    of the NLL's own pass (:func:`calib_lightning.losses.log_prob_and_latent`) so the
    flow runs once per batch. Without ``latent`` the regularizer inverts the flow itself.

    Arguments:
        conservative: penalize only over-confidence.
        marginal: add the per-coordinate central-interval levels to the joint level.

    Example:
        >>> from calib_lightning.tasks import GaussianToy
        >>> toy = GaussianToy(dim=2)
        >>> theta, x = toy.sample(1024, torch.Generator().manual_seed(0))
        >>> loss = LatentCoverageLoss()
        >>> bool(loss(toy.posterior(), theta, x) < loss(toy.posterior(0.5), theta, x) / 10)
        True
    """

    def __init__(self, conservative: bool = False, marginal: bool = True) -> None:
        super().__init__()
        self.conservative, self.marginal = bool(conservative), bool(marginal)

    def extra_repr(self) -> str:
        return f"conservative={self.conservative}, marginal={self.marginal}"

    def forward(
        self, posterior: Posterior | object, theta: Tensor, x: Tensor, latent: Tensor | None = None
    ) -> Tensor:
        """Regularizer on the batch ``theta (n, D)``, ``x (n, *X)``, ``n >= 2``: a scalar.

        ``latent``: :math:`T_x^{-1}(\\theta)` ``(n, D)`` with its graph, if the caller
        already has it from the NLL's pass.
        """
        check_pairs(theta, x, min_rows=2)
        if latent is None:
            latent = evaluation.latents(posterior, theta, x, create_graph=True)
        else:
            check_shape("latent", latent, theta.shape, f"the shape of theta {tuple(theta.shape)}")
        return latent_coverage_loss(latent, conservative=self.conservative, marginal=self.marginal)
