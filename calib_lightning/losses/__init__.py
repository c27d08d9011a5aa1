r"""Calibration terms for neural posterior estimation.

Post-hoc fixes of a trained posterior (``LatentScale`` and the others) live in
:mod:`calib_lightning.recalibration`.

* Losses to add to the negative log-likelihood of an NPE,
  ``loss = nll + weight * regularizer(posterior, theta, x)``, on the training batch:
  :class:`LatentCoverageLoss` (sampling-free coverage of the flow's own regions,
  :mod:`.latent`), :class:`BalancingLoss` (balanced NPE, :mod:`.balancing`),
  :class:`KCCSDLoss` (Glaser et al. 2023, :mod:`.kccsd`) and :class:`CoverageLoss`
  (Falkiewicz et al. 2023, without ``torchsort``, :mod:`.coverage`).
* :func:`log_prob_and_latent`: the NLL's log-density and the latent from one pass of
  the flow, so a latent or log-density regularizer adds no second forward pass.

All evaluate the model through :mod:`calib_lightning.evaluation`, so its input checks
apply.

References:
    Glaser, Widmann, Lindsten, Gretton. "Fast and Scalable Score-Based Kernel
    Calibration Tests." UAI 2023.
    Falkiewicz, Takeishi, Shekhzadeh, Wehenkel, Delaunoy, Louppe, Kalousis.
    "Calibrating Neural Simulation-Based Inference with Differentiable Coverage
    Probability." NeurIPS 2023.
    Delaunoy, Miller, Forré, Weniger, Louppe. "Balancing Simulation-based Inference for
    Conservative Posteriors." AABI 2023.
    Guo, Pleiss, Sun, Weinberger. "On Calibration of Modern Neural Networks." ICML 2017.
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

__all__ = [
    "BalancingLoss",
    "CoverageLoss",
    "KCCSDLoss",
    "LatentCoverageLoss",
    "kccsd_loss",
    "latent_coverage_levels",
    "latent_coverage_loss",
    "latent_kccsd_loss",
    "log_prob_and_latent",
]
