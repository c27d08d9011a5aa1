r"""The plain-sentence verdict of a diagnosis: it says only what a test found.

**Overall.** One p-value keeps the level: the Bonferroni (equal-weight Holm)
combination :math:`\min(1, K \min_k p_k)` of the verdict p-values of the ``K``
registered checks that ran with ``in_overall`` (each check's verdict field): exact under
any dependence, and it rejects whenever one check rejects at :math:`\alpha / K`. At or
above the level the sentence says "calibrated". An exact check (the support check, a
p-value of 0 or 1) takes no share: a rejection sets the overall p-value to 0. Why equal
weights: ``docs/design.md``, "The overall verdict: equal weights".

**Directions** (over-confident, under-confident, biased in a parameter) are named only
when a test *of that direction* rejects: the one-sided t-tests of
:func:`~calib_lightning.functional.direction.rank_mean_test` on the rank histogram, the
joint (HPD) rank for over/under-confidence and each marginal rank for a posterior too
high or too low (``2 (D + 1)`` hypotheses), and, for a posterior known up to a constant,
the same tests on the importance-sampled credibilities of ``coverage_is``
(:func:`~calib_lightning.functional.direction.credibility_mean_test`: two more, whose
"too rarely" side reads "over-confident or biased", since a shift does it too), all
with one Holm correction (:func:`~calib_lightning.functional.holm_adjust`), which
controls the family-wise error under any dependence. Each is gated, closed-testing
style, by the overall verdict and by its own check's verdict, so the sentence never
names a direction the table does not back. Without a direction the sentence names the
checks that rejected, and says whether a directional test ran.

**Per-observation lists** (L-C2ST-NF "wrong at", misspecification "outside the
simulator") are Holm-adjusted over the ``O`` observations and gated by the check's own
verdict (and, for L-C2ST-NF, by the overall verdict). ``diagnose`` runs the
misspecification test with ``global_method="holm"``, so its row and its list agree.

**Size.** Each named finding carries its size: the coverage error with its
``1 - level`` confidence interval, the mean fractional marginal rank (0.5 when
unbiased), the L-C2ST statistic beside its null quantile.

**Monte Carlo error.** A randomized check's p-value moves with the seed by about its
``p_value_error`` (the permutations, bootstrap or null classifiers it drew, the
references and repetitions it averaged; for the local tests the binomial error of their
null classifiers). When the p-value lies within twice that error of the level, the
decision is one another seed may reverse: the sentence says so (``Verdict.unsettled``)
instead of presenting it as settled.

**Cannot reject.** A permutation or conformal test has a smallest attainable p-value
(``result.smallest_p_value``); when it, times the multiplicity, is not below the level,
the check could not have rejected whatever the data, and the sentence and the table say
so instead of "not rejected".
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from calib_lightning.diagnosis._check import (
    Check,
    Direction,
    ObservationList,
    adjusted_directions,
)
from calib_lightning.diagnosis.checks import REGISTRY, by_name
from calib_lightning.functional.combine import combine_p_values
from calib_lightning.plots._format import format_p_value

__all__ = [
    "VERDICT_METHOD",
    "Verdict",
    "combine_verdicts",
    "overall_p_value",
    "verdict",
    "verdict_sentence",
]

#: how the overall verdict combines the checks' verdict p-values (equal weights)
VERDICT_METHOD = "holm"


@dataclass(frozen=True)
class Verdict:
    """The sentence and what it was built from (for the report's tables)."""

    sentence: str
    overall_p_value: float
    rejected: list[str]
    directions: list[Direction]
    observations: dict[str, ObservationList]
    cannot_reject: dict[str, float]
    unsettled: dict[str, tuple[float, float]]


def _and(items: Sequence[str]) -> str:
    if len(items) <= 1:
        return "".join(items)
    return f"{', '.join(items[:-1])} and {items[-1]}"


def _ran(checks: Mapping[str, Any]) -> list[tuple[Check, Any]]:
    """The registered checks that gave a result, with it, in the order of the report."""
    return [(check, checks[check.name]) for check in REGISTRY if check.name in checks]


def combine_verdicts(p_values: Mapping[str, float]) -> float:
    r"""The overall p-value from the verdict p-values of the checks that ran, by name
    (others than the registered checks in the overall verdict are ignored): equal-weight
    Bonferroni, :math:`\min(1, K \min_k p_k)`; ``nan`` when none ran. An exact check's
    p-value (0 or 1: the support check) takes no share: 0 when it is 0, else the others'
    combination (1 when it ran alone)."""
    counted = [c for c in REGISTRY if c.in_overall and c.name in p_values]
    if any(c.exact and float(p_values[c.name]) == 0 for c in counted):
        return 0.0
    shared = [float(p_values[c.name]) for c in counted if not c.exact]
    if not shared:
        return 1.0 if counted else math.nan
    values = torch.tensor(shared, dtype=torch.float64)
    return float(combine_p_values(values, dim=0, method=VERDICT_METHOD))


def overall_p_value(checks: Mapping[str, Any]) -> float:
    """:func:`combine_verdicts` of the checks' results (``nan``: none ran)."""
    values = {check.name: check.verdict_p_value(result) for check, result in _ran(checks)}
    return combine_verdicts({k: v for k, v in values.items() if v is not None})


def verdict(
    checks: Mapping[str, Any], level: float, labels: Sequence[str] | None = None
) -> Verdict:
    """The sentence and its ingredients (see the module docstring)."""
    ran = _ran(checks)
    overall = overall_p_value(checks)
    overall_rejects = not math.isnan(overall) and overall < level
    p_of = {c.name: c.verdict_p_value(r) for c, r in ran}
    rejected = [name for name, p in p_of.items() if p is not None and p < level]
    cannot = {c.name: s for c, r in ran if (s := c.smallest_p_value(r)) is not None and s >= level}
    notes = [c.cannot_reject(r, cannot[c.name], level) for c, r in ran if c.name in cannot]
    unsettled = {}
    for check, result in ran:
        p, error = p_of[check.name], check.p_value_error(result)
        if p is not None and error and abs(p - level) < 2 * error and check.name not in cannot:
            unsettled[check.name] = (p, error)
    if unsettled:  # the range another seed may give, inside [0, 1], not p ± an error
        words = _and(
            [
                f"{by_name(n).words} (p = {p:.2g}, another seed "
                f"{max(0.0, p - 2 * e):.2g}-{min(1.0, p + 2 * e):.2g})"
                for n, (p, e) in unsettled.items()
            ]
        )
        notes.append(
            f"{words} within twice {'its' if len(unsettled) == 1 else 'their'} Monte "
            f"Carlo error of the level {level:g}: another seed may decide otherwise"
        )

    tests = [d for c, r in ran for d in c.directions(r, level, labels)]
    gates = {c.name: overall_rejects and c.name in rejected for c, _ in ran}
    directions = adjusted_directions(tests, level, gates)
    lists: dict[str, ObservationList] = {}
    for check, result in ran:
        gate = check.name in rejected and (overall_rejects or not check.gated_by_overall)
        listed = check.observation_list(result, level, gate)
        if listed is not None:
            lists[check.name] = listed

    tail: list[str] = []
    for check, _ in ran:
        if check.name in lists and hasattr(check, "tail"):
            phrase, note = check.tail(lists[check.name], level, check.name in cannot)
            tail += [phrase] if phrase else []
            notes += [note] if note else []

    if math.isnan(overall):
        head = "no calibration check ran"
    elif not overall_rejects:
        head = f"calibrated: no evidence of miscalibration at level {level:g}"
        alone = [c for c, _ in ran if c.in_overall and c.name in rejected]
        if alone:  # the table marks them rejected: say why the verdict still does not
            words = _and([f"{c.words} ({format_p_value(p_of[c.name], 3)})" for c in alone])
            verb = "rejects" if len(alone) == 1 else "reject"
            counted = sum(c.in_overall for c, _ in ran)
            head += (
                f" (overall p = {overall:.2g}); {words} alone {verb}, which the "
                f"combination of the {counted} checks does not confirm"
            )
    else:
        head = "miscalibrated: " + "; ".join(
            _findings(ran, directions, lists, rejected, overall, level)
        )
    sentence = "; ".join([head, *tail, *notes]) + "."
    return Verdict(
        sentence=sentence,
        overall_p_value=overall,
        rejected=rejected,
        directions=directions,
        observations=lists,
        cannot_reject=cannot,
        unsettled=unsettled,
    )


def _findings(
    ran: Sequence[tuple[Check, Any]],
    directions: Sequence[Direction],
    lists: Mapping[str, ObservationList],
    rejected: Sequence[str],
    overall: float,
    level: float,
) -> list[str]:
    """What a rejecting verdict says: exact findings, the named directions, the local
    findings, then the other checks that rejected."""
    named = [d for d in directions if d.named]
    found = [f"{d.words} ({d.size()})" for d in named]
    if any(d.parameter is not None for d in named) and any(
        d.parameter is None and d.words == "over-confident" for d in named
    ):  # the joint test cannot tell too narrow from misplaced: do not claim "narrow"
        joint = next(d for d in directions if d.parameter is None)
        found[0] = (
            f"credible regions cover the truth too rarely ({joint.size()}; a bias alone does this)"
        )
    found = list(dict.fromkeys(found))  # two checks' directions may read the same
    shown = {d.check for d in named}
    for check, result in ran:
        if check.exact and check.name in rejected:  # the true posterior has no mass there
            found.insert(0, check.finding(result, None, level))
            shown.add(check.name)
        elif check.local and check.name in lists:
            listed = lists[check.name]
            if listed.named or check.name in rejected:
                found.append(check.finding(result, listed, level))
            if check.name in rejected:
                shown.add(check.name)
    others = [c for c, _ in ran if c.in_overall and c.name in rejected and c.name not in shown]
    if others:
        words = _and(
            [
                f"{c.words} ({format_p_value(c.verdict_p_value(r), 3)})"
                for c, r in ran
                if c in others
            ]
        )
        verb = "rejects" if len(others) == 1 else "reject"
        figures = _and([c.figure_words for c in others if c.figure_words])
        see = f": see {figures}" if figures else " (no figure of its own)"
        if not figures and found:
            see = ", which has no figure of its own"
        if not found and directions:
            found.append(f"{words} {verb}, but no directional test does{see}")
        elif not found:
            found.append(f"{words} {verb}{see}; no directional test ran")
        else:
            found.append(f"also rejected by {words}{see}")
    if not found:
        found.append(
            f"the checks reject together (overall p = {overall:.2g}), none alone: see the table"
        )
    return found


def verdict_sentence(
    checks: Mapping[str, Any], level: float, labels: Sequence[str] | None = None
) -> str:
    """A short plain sentence: calibrated, or what a test found (:func:`verdict`)."""
    return verdict(checks, level, labels).sentence
