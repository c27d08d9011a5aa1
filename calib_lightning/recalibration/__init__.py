r"""Post-hoc recalibration of a trained posterior, fitted on held-out pairs.

A posterior that the diagnosis finds miscalibrated is fixed here, without retraining,
from pairs the estimator never trained on (the validation split):

* :func:`recalibrate` (:mod:`.api`): one call, any estimator with an inverse, methods
  ``"scale"``, ``"radial"``, ``"scale+radial"``, ``"marginal"``, ``"marginal+radial"`` and
  ``"auto"``; what it returns is an
  ``nn.Module`` called like the flow (``fixed(x)`` a distribution, :mod:`._module`), and
  ``"auto"`` says what it scored and why it chose in a :class:`Selection` table
  (:mod:`.selection`, on the cross-fitted held-out scores of :mod:`.cross_fit`);
* :class:`RecalibratedPosterior` and :class:`LatentMap` (:mod:`.radial`): the fitted map
  of the latent space, before the flow, with an explicit density;
* :class:`LatentScale`: per-coordinate scales of a flow's latent (:mod:`.scale`), the
  flow counterpart of temperature scaling;
* :class:`TruncatedPosterior` (:mod:`.truncation`): a posterior restricted to the prior's
  support (``recalibrate(..., prior=prior)``), which removes the leakage ``cl.diagnose``
  reports, with a lower expected NLL;
* :class:`ConformalRegion` (:mod:`.conformal`): split-conformal credible regions, global
  or local over ``x``, with finite-sample marginal coverage, for every estimator.
"""

from calib_lightning.recalibration._module import ConditionalDistribution
from calib_lightning.recalibration.api import METHODS, recalibrate, register_method
from calib_lightning.recalibration.conformal import ConformalRegion
from calib_lightning.recalibration.radial import LatentMap
from calib_lightning.recalibration.recalibrated import RecalibratedPosterior
from calib_lightning.recalibration.scale import LatentScale
from calib_lightning.recalibration.selection import Selection
from calib_lightning.recalibration.truncation import TruncatedPosterior

__all__ = [
    "METHODS",
    "ConditionalDistribution",
    "ConformalRegion",
    "LatentMap",
    "LatentScale",
    "RecalibratedPosterior",
    "Selection",
    "TruncatedPosterior",
    "recalibrate",
    "register_method",
]
