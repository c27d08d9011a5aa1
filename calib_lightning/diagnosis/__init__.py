"""One call that answers "is this posterior calibrated, and where not?".

:func:`diagnose` runs every check of the package on a trained posterior (sharing one set
of posterior draws among the sampling-based ones) and returns a :class:`Diagnosis`: a
plain-sentence verdict, a table, the figures and an HTML report
(``Diagnosis.save(directory)``). ``python -m calib_lightning diagnose`` does the same
for a saved Lightning checkpoint. Given the posterior before a fix too
(``diagnose(fixed, theta, x, before=posterior)``), the report shows both side by side
(:class:`Comparison`).
"""

from calib_lightning.diagnosis._compare import Comparison
from calib_lightning.diagnosis._report import Diagnosis
from calib_lightning.diagnosis._run import CHECKS, diagnose

__all__ = ["CHECKS", "Comparison", "Diagnosis", "diagnose"]
