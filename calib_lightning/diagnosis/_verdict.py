r"""The plain-sentence verdict of a diagnosis: it says only what a test found.

**Overall.** One p-value keeps the level: the Bonferroni (equal-weight Holm)
combination :math:`\min(1, K \min_k p_k)` of the verdict p-values of the ``K`` checks
that ran (KCCSD ``p_value``, ranks ``global_p_value``, TARP ``p_value``, the joint
classifier test ``p_value``, L-C2ST-NF or L-C2ST ``global_p_value``): exact under any
dependence, and it rejects whenever one check rejects at :math:`\alpha / K`, so its power
at every failure mode is at least that of the best check at :math:`\alpha / K`. Weights
that gave the rank check 0.86 of the level (issue 23) lost that guarantee where another
check carries the power: on the NPT suite's mean shift (``D = 3``, ``N = 300``, shift
0.08) KCCSD rejected 0.75 of 20 datasets and the weighted verdict 0.30; equal weights
keep KCCSD's power at :math:`\alpha / 3` (``examples/benchmarks/results/power_curves.md``).
At or above the level the sentence says "calibrated". The support check (draws outside
the prior's support, given the prior) is exact, p-value 0 or 1, and takes no share: a
draw outside sets the overall p-value to 0, none leaves the combination of the others
unchanged.

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
from dataclasses import dataclass, replace
from typing import Any

import torch
from scipy import stats
from torch import Tensor

from calib_lightning.diagnosis._overall import (
    LOCAL_TESTS,
    VERDICT_CHECKS,
    VERDICT_METHOD,
    VERDICT_WEIGHTS,
    combine_verdicts,
    overall_p_value,
    smallest_verdict_p_value,
    verdict_p_value_error,
)
from calib_lightning.diagnosis._overall import verdict_p_value as _verdict_p_value
from calib_lightning.functional.combine import holm_adjust
from calib_lightning.functional.direction import credibility_mean_test, rank_mean_test
from calib_lightning.plots._format import format_p_value

__all__ = [
    "VERDICT_CHECKS",
    "VERDICT_METHOD",
    "VERDICT_WEIGHTS",
    "Direction",
    "ObservationList",
    "Verdict",
    "combine_verdicts",
    "overall_p_value",
    "smallest_verdict_p_value",
    "verdict",
    "verdict_p_value_error",
    "verdict_sentence",
]


#: how the sentence names each check, and the figures it points to
NAMES = {
    "kccsd": ("KCCSD", ""),  # no figure of its own
    "ranks": ("the rank tests", "the expected-coverage, rank ECDF and histogram figures"),
    "tarp": ("TARP", "the TARP coverage figure"),
    "lc2st_nf": ("L-C2ST-NF", "the PP-plots and probability maps"),
    "lc2st": ("L-C2ST", "the PP-plots and probability maps"),
    "joint_c2st": ("the joint classifier test", ""),  # no figure of its own
    "misspecification": ("the misspecification test", "the misspecification figure"),
    "support": ("the prior-support check", ""),  # no figure of its own
    "coverage_is": ("the importance-sampled coverage test", "the expected-coverage figure"),
    "balance": ("the balance test", ""),  # no figure of its own
}


@dataclass(frozen=True)
class Direction:
    """One one-sided directional test and whether the sentence names it.

    Attributes:
        words: what the sentence says when it is named (``"over-confident"``,
            ``"biased in a: posterior too high"``).
        parameter: the parameter index, ``None`` for the joint rank.
        estimate: coverage error (joint) or mean fractional rank (parameter).
        half_width: half-width of its ``1 - level`` confidence interval.
        p_value: one-sided p-value.
        adjusted_p_value: Holm-adjusted over every one-sided test of the diagnosis.
        named: it rejects after Holm, and the overall verdict and its check's reject.
        check: the check whose result it tests (``"ranks"``, ``"coverage_is"``).
    """

    words: str
    parameter: int | None
    estimate: float
    half_width: float
    p_value: float
    adjusted_p_value: float
    named: bool
    check: str = "ranks"

    def size(self) -> str:
        """``coverage error -0.088 ± 0.028`` or ``mean rank 0.31 ± 0.03, 0.5 if unbiased``."""
        if self.parameter is None:
            return f"coverage error {self.estimate:+.3f} ± {self.half_width:.3f}"
        return f"mean rank {self.estimate:.3f} ± {self.half_width:.3f}, 0.5 if unbiased"


@dataclass(frozen=True)
class ObservationList:
    """A per-observation test with Holm's correction.

    Attributes:
        check: ``"lc2st_nf"``, ``"lc2st"`` or ``"misspecification"``.
        p_value: raw p-values ``(O,)``.
        adjusted_p_value: Holm-adjusted ``(O,)``.
        named: indices the sentence lists (adjusted below the level, gates passed).
        can_reject: whether Holm-adjusted p-values can fall below the level at all.
        smallest_adjusted: the smallest attainable Holm-adjusted p-value
            (``O * smallest_p_value``), or ``None`` for an analytic test.
    """

    check: str
    p_value: list[float]
    adjusted_p_value: list[float]
    named: list[int]
    can_reject: bool
    smallest_adjusted: float | None


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


def _observations(indices: Sequence[int]) -> str:
    """``observation 2`` or ``observations 0, 1 and 3``."""
    if len(indices) == 1:
        return f"observation {indices[0]}"
    return f"observations {', '.join(map(str, indices[:-1]))} and {indices[-1]}"


def _and(items: Sequence[str]) -> str:
    if len(items) <= 1:
        return "".join(items)
    return f"{', '.join(items[:-1])} and {items[-1]}"


def _name(labels: Sequence[str] | None, d: int) -> str:
    return f"{labels[d]}" if labels is not None else f"parameter {d}"


def _one_sided(test: Any, level: float) -> tuple[Tensor, Any]:
    """``(p, half)``: the one-sided p-values ``(K, 2)`` (mean above 1/2, below) and the
    half-widths of the ``1 - level`` intervals ``(K,)`` of a :class:`RankMeanTest`."""
    p = torch.stack([test.p_greater, test.p_less], -1).reshape(-1, 2)
    quantile = stats.t.ppf(1 - level / 2, test.num_pairs.reshape(-1).cpu().numpy() - 1)
    return p, test.standard_error.reshape(-1).cpu().numpy() * quantile


def _rank_directions(
    ranks: Any, level: float, labels: Sequence[str] | None
) -> list[tuple[Direction, str]]:
    """The rank check's directions (not yet adjusted), the joint rank first."""
    test = rank_mean_test(ranks.histogram)  # each (D + 1,): marginal rows, then joint
    p, half = _one_sided(test, level)
    num_dims = p.shape[0] - 1
    out = []
    for row in (num_dims, *range(num_dims)):  # the joint rank first
        joint = row == num_dims
        for side in range(2):  # 0: mean rank above 1/2, 1: below
            if joint:
                words = "over-confident" if side == 0 else "under-confident"
                estimate = -float(test.offset[row])  # the coverage error
            else:
                where = "too low" if side == 0 else "too high"
                words = f"biased in {_name(labels, row)}: posterior {where}"
                estimate = 0.5 + float(test.offset[row])
            direction = Direction(
                words=words,
                parameter=None if joint else row,
                estimate=estimate,
                half_width=float(half[row]),
                p_value=float(p[row, side]),
                adjusted_p_value=float("nan"),
                named=False,
            )
            out.append((direction, "ranks"))
    return out


def _coverage_directions(result: Any, level: float) -> list[tuple[Direction, str]]:
    """The importance-sampled coverage check's two directions (not yet adjusted)."""
    if result.cannot_judge is not None or result.credibility.numel() < 2:
        return []
    test = credibility_mean_test(result.credibility)
    p, half = _one_sided(test, level)
    words = ("over-confident or biased", "under-confident")  # a shift reads as the first
    return [
        (
            Direction(
                words=words[side],
                parameter=None,
                estimate=-float(test.offset),
                half_width=float(half[0]),
                p_value=float(p[0, side]),
                adjusted_p_value=float("nan"),
                named=False,
                check="coverage_is",
            ),
            "coverage_is",
        )
        for side in range(2)
    ]


def _holm(
    tests: list[tuple[Direction, str]], level: float, gates: Mapping[str, bool]
) -> list[Direction]:
    """The directions with one Holm correction over all of them; each named when its
    adjusted p-value is below ``level`` and its check's gate is open."""
    if not tests:
        return []
    adjusted = holm_adjust(torch.tensor([d.p_value for d, _ in tests], dtype=torch.float64))
    return [
        replace(d, adjusted_p_value=float(a), named=bool(gates.get(check)) and float(a) < level)
        for (d, check), a in zip(tests, adjusted.tolist(), strict=True)
    ]


def observation_list(
    name: str, result: Any, level: float, gate: bool
) -> ObservationList:
    """Holm over a check's per-observation ``p_value`` ``(O,)``; ``gate``: may name."""
    p = result.p_value.double().flatten()
    adjusted = holm_adjust(p)
    smallest = getattr(result, "smallest_p_value", None)
    smallest_adjusted = None if smallest is None else min(1.0, p.shape[0] * float(smallest))
    named = [o for o, a in enumerate(adjusted.tolist()) if gate and a < level]
    return ObservationList(
        check=name, p_value=p.tolist(), adjusted_p_value=adjusted.tolist(), named=named,
        can_reject=smallest_adjusted is None or smallest_adjusted < level,
        smallest_adjusted=smallest_adjusted,
    )  # fmt: skip


def _lc2st_size(result: Any, named: Sequence[int], level: float) -> str:
    stats = ", ".join(f"{float(result.statistic[o]):.2g}" for o in named)
    null = torch.quantile(result.null_statistics.double(), 1 - level, dim=0)
    chance = max(float(null[o]) for o in named)
    return f"L-C2ST statistic {stats}; null {1 - level:.0%} quantile at most {chance:.2g}"


def _cannot(name: str, result: Any, smallest: float, level: float) -> str:
    what = NAMES.get(name, (name, ""))[0]
    count = result.p_value.numel() if hasattr(result, "p_value") else 1
    if name == "misspecification":
        single = float(result.smallest_p_value)
        if smallest > single:  # Holm over the observations
            return (f"{what} cannot reject with {result.num_simulations} simulations "
                    f"({result.num_calibration} for calibration) and {count} observations: "
                    f"smallest p-value 1/{result.num_calibration + 1} = {single:.2g}, "
                    f"{smallest:.2g} after Holm's correction, not below {level:g}")  # fmt: skip
        return (f"{what} cannot reject with {result.num_simulations} simulations "
                f"({result.num_calibration} for calibration): smallest p-value "
                f"1/{result.num_calibration + 1} = {single:.2g}, not below {level:g}")  # fmt: skip
    if name in LOCAL_TESTS:
        size = f"{result.null_statistics.shape[0]} null classifiers"
    else:
        size = "this many null draws"
    return f"{what} cannot reject with {size}: smallest p-value {smallest:.2g}, not below {level:g}"


def verdict(
    checks: Mapping[str, Any], level: float, labels: Sequence[str] | None = None
) -> Verdict:
    """The sentence and its ingredients (see the module docstring)."""
    overall = overall_p_value(checks)
    overall_rejects = not math.isnan(overall) and overall < level
    rejected = [n for n, r in checks.items()
                if (p := _verdict_p_value(n, r)) is not None and p < level]  # fmt: skip
    cannot = {n: s for n, r in checks.items()
              if (s := smallest_verdict_p_value(r)) is not None and s >= level}  # fmt: skip
    notes = [_cannot(n, checks[n], s, level) for n, s in cannot.items()]
    unsettled = {}
    for name, result in checks.items():
        p, error = _verdict_p_value(name, result), verdict_p_value_error(name, result)
        if p is not None and error and abs(p - level) < 2 * error and name not in cannot:
            unsettled[name] = (p, error)
    if unsettled:  # the range another seed may give, inside [0, 1], not p ± an error
        words = _and([
            f"{NAMES.get(n, (n, ''))[0]} (p = {p:.2g}, another seed "
            f"{max(0.0, p - 2 * e):.2g}-{min(1.0, p + 2 * e):.2g})"
            for n, (p, e) in unsettled.items()
        ])
        notes.append(f"{words} within twice {'its' if len(unsettled) == 1 else 'their'} Monte "
                     f"Carlo error of the level {level:g}: another seed may decide otherwise")

    tests = [] if "ranks" not in checks else _rank_directions(checks["ranks"], level, labels)
    if "coverage_is" in checks:
        tests += _coverage_directions(checks["coverage_is"], level)
    gates = {name: overall_rejects and name in rejected for name in ("ranks", "coverage_is")}
    directions = _holm(tests, level, gates)
    lists: dict[str, ObservationList] = {}
    for name in (n for n in LOCAL_TESTS if n in checks):
        lists[name] = observation_list(name, checks[name], level,
                                       overall_rejects and name in rejected)  # fmt: skip
    if "misspecification" in checks:
        result = checks["misspecification"]
        lists["misspecification"] = observation_list(
            "misspecification", result, level, "misspecification" in rejected)

    tail: list[str] = []
    misspec = lists.get("misspecification")
    if misspec is not None and misspec.named:
        verb = "looks" if len(misspec.named) == 1 else "look"
        smallest = min(misspec.adjusted_p_value[o] for o in misspec.named)
        tail.append(f"{_observations(misspec.named)} {verb} outside the simulator "
                    f"(Holm-adjusted p {'=' if len(misspec.named) == 1 else '>='} "
                    f"{smallest:.2g})")  # fmt: skip
    elif misspec is not None and "misspecification" not in cannot and not misspec.can_reject:
        notes.append(f"no single observation can be called outside the simulator with "
                     f"{len(misspec.p_value)} observations (smallest Holm-adjusted p-value "
                     f"{misspec.smallest_adjusted:.2g})")  # fmt: skip

    if math.isnan(overall):
        head = "no calibration check ran"
    elif not overall_rejects:
        head = f"calibrated: no evidence of miscalibration at level {level:g}"
        alone = [n for n in rejected if n in VERDICT_CHECKS]
        if alone:  # the table marks them rejected: say why the verdict still does not
            words = _and([f"{NAMES[n][0]} ({format_p_value(_verdict_p_value(n, checks[n]), 3)})"
                          for n in alone])  # fmt: skip
            verb = "rejects" if len(alone) == 1 else "reject"
            head += (f" (overall p = {overall:.2g}); {words} alone {verb}, which the "
                     f"combination of the {sum(n in checks for n in VERDICT_WEIGHTS)} checks "
                     "does not confirm")  # fmt: skip
    else:
        found = [f"{d.words} ({d.size()})" for d in directions if d.named]
        if any(d.named and d.parameter is not None for d in directions) and any(
                d.named and d.words == "over-confident" for d in directions):
            # the joint test cannot tell too narrow from misplaced: do not claim "narrow"
            found[0] = (f"credible regions cover the truth too rarely ({directions[0].size()}; "
                        "a bias alone does this)")  # fmt: skip
        found = list(dict.fromkeys(found))  # the ranks and coverage_is may say the same
        if "support" in rejected:  # exact: the true posterior has no mass there
            share = float(checks["support"].statistic)
            found.insert(0, f"{share:.1%} of its draws at the calibration x lie outside the "
                            "prior's support, where the true posterior puts none")  # fmt: skip
        shown = {"support"} | {d.check for d in directions if d.named}
        for name in (n for n in LOCAL_TESTS if n in lists):
            local = lists[name]
            if local.named:
                found.append(f"wrong at {_observations(local.named)} "
                             f"({_lc2st_size(checks[name], local.named, level)})")  # fmt: skip
            elif name in rejected:
                why = "" if local.can_reject else (
                    f"; with {len(local.p_value)} observations the smallest Holm-adjusted "
                    f"p-value is {local.smallest_adjusted:.2g}")  # fmt: skip
                found.append(f"{NAMES[name][0]} rejects over the observations together, at "
                             f"no single one after Holm's correction{why}")  # fmt: skip
            shown |= {name} if name in rejected else set()
        others = [n for n in rejected if n in VERDICT_CHECKS and n not in shown]
        if others:
            words = _and([f"{NAMES[n][0]} ({format_p_value(_verdict_p_value(n, checks[n]), 3)})"
                          for n in others])  # fmt: skip
            verb = "rejects" if len(others) == 1 else "reject"
            figures = _and([NAMES[n][1] for n in others if NAMES[n][1]])
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
            found.append(f"the checks reject together (overall p = {overall:.2g}), "
                         "none alone: see the table")  # fmt: skip
        head = "miscalibrated: " + "; ".join(found)
    sentence = "; ".join([head, *tail, *notes]) + "."
    return Verdict(sentence=sentence, overall_p_value=overall, rejected=rejected,
                   directions=directions, observations=lists, cannot_reject=cannot,
                   unsettled=unsettled)  # fmt: skip


def verdict_sentence(
    checks: Mapping[str, Any], level: float, labels: Sequence[str] | None = None
) -> str:
    """A short plain sentence: calibrated, or what a test found (:func:`verdict`)."""
    return verdict(checks, level, labels).sentence
