r"""Differentiable calibration regularizers for neural posterior estimation.

Two losses to add to the negative log-likelihood of an NPE,
``loss = nll + weight * regularizer(posterior, theta, x)``, computed on the training
batch. Both evaluate the model through :mod:`calib_lightning.evaluation` (latents,
scores, reparameterized draws, with their graphs), so its input checks apply.

* :class:`KCCSDLoss`: the kernel calibration-conditional Stein discrepancy of
  Glaser et al. (2023) as a U-statistic on the batch, normalized to ``[-1/(n-1), 1]``,
  by default on the flow's latent calibration problem
  (:mod:`calib_lightning.losses.kccsd`).
* :class:`CoverageLoss`: the differentiable expected-coverage regularizer of
  Falkiewicz et al. (2023), with a straight-through rank and ``torch.sort`` (no
  ``torchsort``) (:mod:`calib_lightning.losses.coverage`).

References:
    Glaser, Widmann, Lindsten, Gretton. "Fast and Scalable Score-Based Kernel
    Calibration Tests." UAI 2023.
    Falkiewicz, Takeishi, Shekhzadeh, Wehenkel, Delaunoy, Louppe, Kalousis.
    "Calibrating Neural Simulation-Based Inference with Differentiable Coverage
    Probability." NeurIPS 2023.
"""

from calib_lightning.evaluation import log_prob_and_latent
from calib_lightning.losses.balancing import BalancingLoss
from calib_lightning.losses.coverage import CoverageLoss
from calib_lightning.losses.kccsd import KCCSDLoss, kccsd_loss, latent_kccsd_loss
from calib_lightning.losses.latent import (
    LatentCoverageLoss,
    latent_coverage_levels,
    latent_coverage_loss,
)
from calib_lightning.losses.scale import LatentScale

__all__ = [
    "BalancingLoss",
    "CoverageLoss",
    "KCCSDLoss",
    "LatentCoverageLoss",
    "LatentScale",
    "kccsd_loss",
    "latent_coverage_levels",
    "latent_coverage_loss",
    "latent_kccsd_loss",
    "log_prob_and_latent",
]
