"""The names of ``cl.diagnose``'s checks, their order and their random streams."""

from __future__ import annotations

__all__ = ["CHECKS", "LOCAL", "NEEDS", "SAMPLING", "STREAMS"]

#: every check ``diagnose`` can run, in the order of the report
CHECKS = ("kccsd", "ranks", "tarp", "joint_c2st", "recovery", "lc2st_nf", "lc2st",
          "misspecification", "support")  # fmt: skip
#: the checks that read the shared posterior draws
SAMPLING = ("ranks", "tarp", "joint_c2st", "recovery", "support")
#: the checks at the observations
LOCAL = ("lc2st_nf", "lc2st", "misspecification")
#: the posterior capability each check needs beyond sampling
NEEDS = {"kccsd": "score", "lc2st_nf": "to_latent"}
#: the random stream of each step (with ``seed``): a check's numbers do not depend on
#: which other checks run
STREAMS = {name: k for k, name in enumerate(
    ("draws", *(c for c in CHECKS if c not in ("joint_c2st", "support", "lc2st")),
     "reference", "joint_c2st", "region", "support", "lc2st"), start=1)}  # fmt: skip
