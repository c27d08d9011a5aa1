r"""The overall p-value of a diagnosis: which field of each check's result is its verdict
p-value, and how the verdicts of the checks that ran combine into one.

The combination is the equal-weight Holm (Bonferroni) rule :math:`\min(1, K \min_k p_k)`
over the ``K`` weighted checks; the support check's exact p-value (0 or 1) takes no
share. Also read here: the smallest p-value a check's verdict can reach and the Monte
Carlo error of its p-value. The sentence built on them is in
:mod:`calib_lightning.diagnosis._verdict`, which re-exports these names.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from calib_lightning.functional.combine import combine_p_values

__all__ = [
    "LOCAL_TESTS",
    "VERDICT_CHECKS",
    "VERDICT_METHOD",
    "VERDICT_WEIGHTS",
    "combine_verdicts",
    "overall_p_value",
    "smallest_verdict_p_value",
    "verdict_p_value",
    "verdict_p_value_error",
]

#: the checks whose verdict p-value enters the overall verdict, and its field
VERDICT_CHECKS = {
    "kccsd": "p_value",
    "ranks": "global_p_value",
    "tarp": "p_value",
    "lc2st_nf": "global_p_value",
    "lc2st": "global_p_value",
    "joint_c2st": "p_value",
    "support": "p_value",
    "coverage_is": "global_p_value",
    "balance": "p_value",
}

#: the share of the level each check's verdict gets in the overall verdict (weighted
#: Bonferroni, renormalized over the checks that ran): equal, so that the verdict is at
#: least as powerful as its best check at level alpha / K on every failure mode
VERDICT_WEIGHTS = {
    "kccsd": 1.0,
    "ranks": 1.0,
    "tarp": 1.0,
    "lc2st_nf": 1.0,
    "lc2st": 1.0,
    "joint_c2st": 1.0,
    "coverage_is": 1.0,
    "balance": 1.0,
}
#: the local tests at each observation (L-C2ST in L-C2ST-NF's place without latents)
LOCAL_TESTS = ("lc2st_nf", "lc2st")
#: how the overall verdict combines the weighted checks (functional.combine_p_values)
VERDICT_METHOD = "holm"


def combine_verdicts(p_values: Mapping[str, float]) -> float:
    """The overall p-value from the verdict p-values of the checks that ran, by name
    (keys of :data:`VERDICT_CHECKS`; others are ignored), weighted by
    :data:`VERDICT_WEIGHTS` (a check without a weight there gets L-C2ST-NF's);
    ``nan`` when none ran. The support check's exact p-value (0 or 1) takes no weight:
    0 when it is 0, else the others' combination (1 when it ran alone)."""
    if "support" in p_values and float(p_values["support"]) == 0:
        return 0.0
    names = [name for name in VERDICT_CHECKS if name in p_values and name != "support"]
    if not names:
        return 1.0 if "support" in p_values else math.nan
    values = torch.tensor([float(p_values[name]) for name in names], dtype=torch.float64)
    weights = torch.tensor([VERDICT_WEIGHTS.get(name, VERDICT_WEIGHTS["lc2st_nf"])
                            for name in names], dtype=torch.float64)  # fmt: skip
    return float(combine_p_values(values, dim=0, method=VERDICT_METHOD, weights=weights))


def overall_p_value(checks: Mapping[str, Any]) -> float:
    """:func:`combine_verdicts` of the checks' results (``nan``: none ran)."""
    values = {name: float(getattr(checks[name], field))
              for name, field in VERDICT_CHECKS.items() if name in checks}  # fmt: skip
    return combine_verdicts(values)


def verdict_p_value(name: str, result: Any) -> float | None:
    """A check's verdict p-value (the field :data:`VERDICT_CHECKS` names, or the
    result type's ``verdict``), ``None`` where it has none or it is not one number."""
    field = VERDICT_CHECKS.get(name, getattr(type(result), "verdict", None))
    value = getattr(result, field, None) if field else None
    if value is None or (hasattr(value, "numel") and value.numel() != 1):
        return None
    return float(value)


def smallest_verdict_p_value(result: Any) -> float | None:
    """The smallest p-value a check's verdict can reach at its size (``None``: analytic).

    Reads ``result.smallest_global_p_value`` or else ``result.smallest_p_value``
    (permutation, bootstrap and conformal tests: :math:`1 / (1 + B)`).
    """
    value = getattr(result, "smallest_global_p_value", None)
    if value is None:
        value = getattr(result, "smallest_p_value", None)
    return None if value is None else float(value)


def verdict_p_value_error(name: str, result: Any) -> float | None:
    """The Monte Carlo standard error of a check's verdict p-value (the result's
    ``global_p_value_error`` where its verdict is the global p-value, else its
    ``p_value_error``), or ``None``: an analytic test, or not estimated."""
    field = VERDICT_CHECKS.get(name, getattr(type(result), "verdict", None))
    attribute = "global_p_value_error" if field == "global_p_value" else "p_value_error"
    value = getattr(result, attribute, None)
    if value is None or (hasattr(value, "numel") and value.numel() != 1):
        return None
    return float(value)
