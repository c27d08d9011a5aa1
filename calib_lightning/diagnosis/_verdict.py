"""The plain-sentence verdict of a diagnosis, from the checks' typed results.

One overall p-value keeps the level: the Cauchy combination of each check's verdict
p-value (KCCSD ``p_value``, ranks ``global_p_value``, TARP ``p_value``, L-C2ST-NF
``global_p_value``). When it rejects, the sentence says what the rejecting checks
point at: the sign of the coverage error (over- or under-confident), a parameter whose
posterior mean is off (bias, from the recovery z-scores), an observation where the
local test rejects, an observation the simulator would hardly produce.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from calib_lightning.functional.combine import combine_p_values

__all__ = ["VERDICT_CHECKS", "overall_p_value", "verdict_sentence"]

#: the checks whose verdict p-value enters the overall verdict, and its field
VERDICT_CHECKS = {
    "kccsd": "p_value",
    "ranks": "global_p_value",
    "tarp": "p_value",
    "lc2st_nf": "global_p_value",
}

#: a mean z-score this many standard errors from 0 counts as bias
BIAS_Z = 4.0


def overall_p_value(checks: Mapping[str, Any]) -> float:
    """Cauchy combination of the verdict p-values of the checks that ran (``nan``: none)."""
    values = [float(getattr(checks[name], field)) for name, field in VERDICT_CHECKS.items()
              if name in checks]  # fmt: skip
    if not values:
        return math.nan
    return float(combine_p_values(torch.tensor(values, dtype=torch.float64), dim=0))


def _observations(indices: list[int]) -> str:
    """``observation 2`` or ``observations 0, 1 and 3``."""
    if len(indices) == 1:
        return f"observation {indices[0]}"
    return f"observations {', '.join(map(str, indices[:-1]))} and {indices[-1]}"


def _name(labels: Sequence[str] | None, d: int) -> str:
    return f"{labels[d]}" if labels is not None else f"parameter {d}"


def _biased(checks: Mapping[str, Any], labels: Sequence[str] | None) -> list[str]:
    recovery = checks.get("recovery")
    if recovery is None:
        return []
    n = recovery.z_scores.shape[0]
    mean, std = recovery.z_score_mean.double(), recovery.z_score_std.double()
    strength = mean * math.sqrt(n) / std.clamp_min(1e-12)
    out = []
    for d in range(mean.shape[0]):
        if abs(float(strength[d])) > BIAS_Z:
            side = "too high" if float(mean[d]) > 0 else "too low"
            out.append(f"biased in {_name(labels, d)} (posterior mean {side})")
    return out


def verdict_sentence(
    checks: Mapping[str, Any], level: float, labels: Sequence[str] | None = None
) -> str:
    """A short plain sentence: calibrated, or what the rejecting checks point at."""
    parts: list[str] = []
    misspec = checks.get("misspecification")
    if misspec is not None:
        outside = [o for o, p in enumerate(misspec.p_value.tolist()) if p < level]
        if outside:
            verb = "looks" if len(outside) == 1 else "look"
            parts.append(f"{_observations(outside)} {verb} outside the simulator")
    overall = overall_p_value(checks)
    if math.isnan(overall):
        head = "no calibration check ran"
    elif overall >= level:
        head = f"calibrated: no evidence of miscalibration at level {level:g}"
    else:
        failures: list[str] = []
        ranks = checks.get("ranks")
        tarp = checks.get("tarp")
        signed = ranks.coverage_error if ranks is not None else (
            tarp.coverage_error if tarp is not None else None)  # fmt: skip
        if signed is not None:
            error = float(signed)  # the joint coverage error, ()
            if error < 0:
                failures.append("over-confident (credible regions too narrow or misplaced)")
            elif error > 0:
                failures.append("under-confident (credible regions too wide)")
        failures += _biased(checks, labels)
        local = checks.get("lc2st_nf")
        if local is not None:
            wrong = [o for o, p in enumerate(local.p_value.tolist()) if p < level]
            if wrong:
                failures.append(f"wrong at {_observations(wrong)}")
        head = "miscalibrated: " + ("; ".join(failures) if failures else "see the table")
    return "; ".join([head, *parts]) + "."
