r"""Post-hoc recalibration of a trained posterior, fitted on held-out pairs.

A posterior that the diagnosis finds miscalibrated is fixed here, without retraining,
from pairs the estimator never trained on (the validation split):

* :class:`LatentScale`: per-coordinate scales of a flow's latent (:mod:`.scale`), the
  flow counterpart of temperature scaling.
"""

from calib_lightning.recalibration.conformal import ConformalRegion
from calib_lightning.recalibration.scale import LatentScale

__all__ = ["ConformalRegion", "LatentScale"]
