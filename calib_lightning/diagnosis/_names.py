"""The names of ``cl.diagnose``'s checks, their order and their random streams."""

from __future__ import annotations

import math

__all__ = ["CHECKS", "LOCAL", "NEEDS", "SAMPLING", "STREAMS", "UNNORMALIZED", "local_num_null"]

#: every check ``diagnose`` can run, in the order of the report
CHECKS = ("kccsd", "ranks", "tarp", "joint_c2st", "recovery", "lc2st_nf", "lc2st",
          "misspecification", "support", "coverage_is", "balance")  # fmt: skip
#: the checks of a posterior known up to its constant (an UnnormalizedPosterior: a ratio
#: or likelihood estimator with its prior), which no other posterior runs by default
UNNORMALIZED = ("coverage_is", "balance")
#: the checks that read the shared posterior draws
SAMPLING = ("ranks", "tarp", "joint_c2st", "recovery", "support")
#: the checks at the observations
LOCAL = ("lc2st_nf", "lc2st", "misspecification")
#: the posterior capability each check needs beyond sampling
NEEDS = {"kccsd": "score", "lc2st_nf": "to_latent"}
#: the random stream of each step (with ``seed``): a check's numbers do not depend on
#: which other checks run
STREAMS = {name: k for k, name in enumerate(
    ("draws", *(c for c in CHECKS if c not in ("joint_c2st", "support", "lc2st", *UNNORMALIZED)),
     "reference", "joint_c2st", "region", "support", "lc2st", *UNNORMALIZED), start=1)}  # fmt: skip


def local_num_null(num_observations: int, level: float, default: int = 100) -> int:
    """Null classifiers for the local tests in ``diagnose``: enough for Holm to name one.

    The verdict lists observations by Holm-adjusted p-values; with ``H`` null
    classifiers the smallest is ``O / (1 + H)``. ``H = max(default, ceil(2 O / level))``
    keeps it at most ``level / 2``, so every observation can be named (100 up to
    ``O = 2.5`` at level 0.05; 200 for 5 observations, 400 for 10).
    """
    return max(default, math.ceil(2 * num_observations / level))
