r"""Toy simulators with known posteriors, for tests, benchmarks and examples.

Two families live here:

* the synthetic calibration models of Glaser et al. (2023, section 6): MGM, LGM,
  HGM and QGM, where a Gaussian predictive model :math:`P_{|x}` is calibrated for
  ``delta = 0`` and miscalibrated otherwise;
* the SBI benchmark tasks of the L-C2ST paper (sbibm definitions): :class:`TwoMoons`,
  :class:`SLCP`, :class:`GaussianLinearUniform`;
* :class:`NPTGaussian`, the perturbation suite of neural posterior testing (Chen,
  Bansal and Scott 2024): a Gaussian posterior whose mean and covariance depend on
  ``x`` and its failure modes;
* :class:`JansenRit`, the stochastic Jansen-Rit neural mass model of the L-C2ST
  paper's case study (no tractable posterior), with its log-PSD summary :class:`LogPSD`;
* :class:`GaussianToy`, the conjugate toy :math:`\theta \sim N(0, I)`,
  :math:`x = \theta + N(0, s^2 I)` whose exact posterior is Gaussian, with knobs to
  inflate, shrink or shift it.

Each model is callable ``x -> Distribution``, so :func:`calib_lightning.as_posterior`
accepts it directly.

References:
    Glaser, Widmann, Lindsten, Gretton. "Fast and Scalable Score-Based Kernel
    Calibration Tests." UAI 2023.
"""

from calib_lightning.tasks.images import GaussianBlob, Oscillator
from calib_lightning.tasks.jansen_rit import JansenRit, LogPSD
from calib_lightning.tasks.npt import NPT_MODES, MultivariateT, NPTGaussian
from calib_lightning.tasks.sbi import SLCP, GaussianLinearUniform, SBITask, TwoMoons
from calib_lightning.tasks.synthetic import HGM, LGM, MGM, QGM, SyntheticModel
from calib_lightning.tasks.toys import CorrelatedGaussianToy, GaussianToy

__all__ = [
    "HGM",
    "LGM",
    "MGM",
    "NPT_MODES",
    "QGM",
    "SLCP",
    "CorrelatedGaussianToy",
    "GaussianBlob",
    "GaussianLinearUniform",
    "GaussianToy",
    "JansenRit",
    "LogPSD",
    "MultivariateT",
    "NPTGaussian",
    "Oscillator",
    "SBITask",
    "SyntheticModel",
    "TwoMoons",
]
