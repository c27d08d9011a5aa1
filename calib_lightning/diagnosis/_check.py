r"""What a check of ``cl.diagnose`` is: one object that owns one diagnostic.

A :class:`Check` holds everything about one diagnostic: its name, what it needs (a
posterior capability, the shared posterior draws, the observations, the prior), which
posteriors it applies to, its random stream, how it runs its metric, which p-value of
the result is its verdict, the words the sentence and the report use, its figures, the
size column of the table and its directional tests. ``diagnose``, the verdict, the table,
the HTML report and the comparison loop over the registered checks
(:data:`calib_lightning.diagnosis.checks.REGISTRY`).

How to add one: ``CONTRIBUTING.md``, "Add a diagnostic".
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import Tensor

from calib_lightning.functional.combine import holm_adjust
from calib_lightning.posteriors import UnnormalizedPosterior, supports, unsupported

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from calib_lightning.posteriors.base import Posterior

__all__ = [
    "Check",
    "Direction",
    "FigureInputs",
    "Inputs",
    "ObservationList",
    "Outcome",
    "adjusted_directions",
    "number",
    "observation_list",
    "observations_phrase",
    "unnormalized",
]


def unnormalized(posterior: Any) -> bool:
    """Whether ``posterior`` is known only up to its normalizing constant (a ratio or
    likelihood estimator with its prior), its shared-draws wrapper included."""
    return isinstance(getattr(posterior, "posterior", posterior), UnnormalizedPosterior)


@dataclass(frozen=True)
class Inputs:
    """What every check of one diagnosis may read (the same for every posterior)."""

    theta: Tensor
    x: Tensor
    observations: Tensor | None
    reference_samples: Tensor | None
    prior: Any
    level: float
    seed: int
    num_posterior_samples: int
    embedding: Any
    devices: list[torch.device]


@dataclass
class Outcome:
    """What the checks gave for one posterior: results, seconds, skipped checks (with the
    reason), and the probability maps of the local test."""

    results: dict[str, Any] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    maps: Any = None


@dataclass(frozen=True)
class Direction:
    """One one-sided directional test and whether the sentence names it.

    Attributes:
        words: what the sentence says when it is named (``"over-confident"``,
            ``"biased in a: posterior too high"``).
        parameter: the parameter index, ``None`` for a test of the whole vector.
        estimate: coverage error (whole vector) or mean fractional rank (parameter).
        half_width: half-width of its ``1 - level`` confidence interval.
        p_value: one-sided p-value.
        adjusted_p_value: Holm-adjusted over every one-sided test of the diagnosis.
        named: it rejects after Holm, and the overall verdict and its check's reject.
        check: the check whose result it tests.
    """

    words: str
    parameter: int | None
    estimate: float
    half_width: float
    p_value: float
    adjusted_p_value: float
    named: bool
    check: str = ""

    def size(self) -> str:
        """``coverage error -0.088 ± 0.028`` or ``mean rank 0.31 ± 0.03, 0.5 if unbiased``."""
        if self.parameter is None:
            return f"coverage error {self.estimate:+.3f} ± {self.half_width:.3f}"
        return f"mean rank {self.estimate:.3f} ± {self.half_width:.3f}, 0.5 if unbiased"


def adjusted_directions(
    directions: Sequence[Direction], level: float, gates: Mapping[str, bool]
) -> list[Direction]:
    """``directions`` with one Holm correction over all of them; each named when its
    adjusted p-value is below ``level`` and the gate of its check is open."""
    if not directions:
        return []
    p = torch.tensor([d.p_value for d in directions], dtype=torch.float64)
    out = []
    for d, a in zip(directions, holm_adjust(p).tolist(), strict=True):
        named = bool(gates.get(d.check)) and float(a) < level
        out.append(
            Direction(
                d.words, d.parameter, d.estimate, d.half_width, d.p_value, float(a), named, d.check
            )
        )
    return out


@dataclass(frozen=True)
class ObservationList:
    """A per-observation test with Holm's correction.

    Attributes:
        check: the check's name.
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
class FigureInputs:
    """What a check's figures may read besides its own result: the level, the parameter
    names and those drawn, the verdict p-values of the global calibration tests that ran
    (the sentence's name -> p), the local test's probability maps and Holm-adjusted
    p-values."""

    level: float
    labels: Sequence[str] | None
    parameters: Sequence[int] | None
    global_tests: Mapping[str, float]
    probability_maps: Any = None
    adjusted_p_values: Sequence[float] | None = None


def number(value: Any) -> float | None:
    """A one-element tensor or a Python number as a float, else ``None``."""
    if isinstance(value, Tensor) and value.numel() == 1:
        return float(value)
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    return None


class Check:
    """One diagnostic of ``cl.diagnose``: the defaults of the attributes and methods every
    check shares (a check overrides what differs).

    Attributes:
        name: its key in ``Diagnosis.checks`` and in ``checks=``.
        title: its name in the HTML report.
        words: its name in the verdict sentence.
        figure_words: the figures the sentence points to (``""``: none of its own).
        stream: its random stream with the diagnosis seed: its numbers do not depend on
            which other checks run.
        needs: the posterior capability it needs beyond sampling (``None``: none).
        draws: whether it reads the shared posterior draws.
        at_observations: it needs the observations.
        needs_prior: it needs the prior.
        posteriors: the posteriors it applies to: ``"normalized"``, ``"unnormalized"``
            (known up to a constant: a ratio or likelihood estimator with its prior) or
            ``"any"``.
        default: it runs when ``checks`` is not given and it applies.
        in_overall: its verdict p-value enters the overall verdict.
        exact: its p-value is 0 or 1 (a draw outside the prior's support): a rejection
            sets the overall p-value to 0, otherwise it takes no share of the level.
        local: a local test at each observation (its probability maps are drawn).
        gated_by_overall: its per-observation list names observations only when the
            overall verdict rejects too (a calibration test), not only its own.
        selectable: a name for ``checks=`` (else it runs whenever it applies).
        needs_samples: it needs posterior samples (by default: it reads the shared draws
            or is a local test).
        remedy: HTML the report shows when the check rejects: how to fix what it found.
        instead_of: a check whose result makes this one unnecessary.
    """

    name: ClassVar[str]
    title: ClassVar[str]
    words: ClassVar[str]
    figure_words: ClassVar[str] = ""
    stream: ClassVar[int]
    needs: ClassVar[str | None] = None
    draws: ClassVar[bool] = False
    at_observations: ClassVar[bool] = False
    needs_prior: ClassVar[bool] = False
    posteriors: ClassVar[str] = "normalized"
    default: ClassVar[bool] = True
    in_overall: ClassVar[bool] = True
    exact: ClassVar[bool] = False
    local: ClassVar[bool] = False
    gated_by_overall: ClassVar[bool] = True
    selectable: ClassVar[bool] = True
    needs_samples: ClassVar[bool | None] = None
    remedy: ClassVar[str] = ""
    instead_of: str | None = None

    def samples_needed(self) -> bool:
        """:attr:`needs_samples`, by default whether it draws or is a local test."""
        return (self.draws or self.local) if self.needs_samples is None else self.needs_samples

    # -- planning -------------------------------------------------------------------
    def skip_reason(self, posterior: Posterior, inputs: Inputs, by_default: bool) -> str | None:
        """Why this check cannot run on ``posterior``, or ``None``: the capability it lacks
        (:attr:`needs`); samples, for a posterior known up to a constant without a
        sampler; a normalized posterior for a check of unnormalized ones."""
        known_up_to_constant = unnormalized(posterior)
        if self.posteriors == "unnormalized" and not known_up_to_constant:
            return (
                "needs a posterior known up to its normalizing constant (a ratio or "
                f"likelihood estimator with prior=), got {type(posterior).__name__}"
            )
        if self.posteriors == "normalized" and known_up_to_constant and not self.samples_needed():
            return f"needs a normalized posterior, got {type(posterior).__name__}"
        if known_up_to_constant and self.samples_needed() and not supports(posterior, "sample"):
            return (
                f"needs posterior samples, and this {type(posterior).__name__} is known only "
                "up to its normalizing constant (scores only): KCCSD and the "
                "importance-sampled coverage check it without sampling; for this check, pass "
                "sampler= (e.g. MCMC, batched over x)"
            )
        if self.needs is not None and not supports(posterior, self.needs):
            return str(unsupported(posterior, self.needs))
        return None

    def applies_by_default(self, posterior: Posterior, inputs: Inputs) -> bool:
        """Whether the check is in the default plan for ``posterior`` and ``inputs``."""
        known_up_to_constant = unnormalized(posterior)
        if not self.default or (self.at_observations and inputs.observations is None):
            return False
        if self.needs_prior and (inputs.prior is None or known_up_to_constant):
            return False  # f p has no mass outside the prior's support
        if self.posteriors == "unnormalized":
            return known_up_to_constant
        return True

    # -- running ------------------------------------------------------------------------
    def common(self, inputs: Inputs, posteriors: Sequence[Posterior]) -> Any:
        """What the posteriors of one diagnosis share beyond the random stream (e.g.
        TARP's reference box), from every posterior it runs on; ``None`` by default."""
        return None

    def run(self, posterior: Posterior, inputs: Inputs, common: Any, outcome: Outcome) -> Any:
        """The check's typed result on ``posterior`` (its draws shared when :attr:`draws`)."""
        raise NotImplementedError

    # -- reading its result ---------------------------------------------------------------
    def verdict_p_value(self, result: Any) -> float | None:
        """The p-value its verdict reads (the result type's ``verdict`` field)."""
        name = getattr(type(result), "verdict", None)
        return number(getattr(result, name, None)) if name else None

    def p_value_error(self, result: Any) -> float | None:
        """The Monte Carlo standard error of :meth:`verdict_p_value`, ``None`` if none."""
        verdict = getattr(type(result), "verdict", None)
        attribute = "global_p_value_error" if verdict == "global_p_value" else "p_value_error"
        return number(getattr(result, attribute, None))

    def smallest_p_value(self, result: Any) -> float | None:
        """The smallest p-value its verdict can reach at its size (``None``: analytic)."""
        value = getattr(result, "smallest_global_p_value", None)
        if value is None:
            value = getattr(result, "smallest_p_value", None)
        return None if value is None else float(value)

    def cannot_reject(self, result: Any, smallest: float, level: float) -> str:
        """The note when the check could not have rejected whatever the data."""
        return (
            f"{self.words} cannot reject with this many null draws: smallest p-value "
            f"{smallest:.2g}, not below {level:g}"
        )

    def size(self, result: Any, directions: Sequence[Direction], level: float) -> str:
        """How large the miscalibration it measures is, in its own units."""
        return ""

    def row(self, row: dict[str, Any], result: Any) -> dict[str, Any]:
        """Its row of the table (check, statistic, p-values, verdict, size, seconds)."""
        return row

    def directions(
        self, result: Any, level: float, labels: Sequence[str] | None
    ) -> list[Direction]:
        """Its one-sided directional tests, not yet Holm-adjusted (none by default)."""
        return []

    def observation_list(self, result: Any, level: float, gate: bool) -> ObservationList | None:
        """Holm over its per-observation p-values, for a test at each observation."""
        return None

    def finding(self, result: Any, observations: ObservationList | None, level: float) -> str:
        """What the sentence says when the check rejects; ``""``: only its name."""
        return ""

    def figures(self, result: Any, inputs: FigureInputs) -> dict[str, Figure]:
        """Figure key (``{prefix}_{figure}``) -> figure."""
        return {}

    def caption(self, key: str) -> str | None:
        """The report's caption of its figure ``key``, ``None``: not its figure."""
        return None

    def coverage_errors(self, result: Any) -> dict[str, tuple[str, float]]:
        """For the before/after comparison: quantity -> (its description, value)."""
        return {}

    def overlay(self, before: Any, after: Any) -> tuple[str, str, Figure] | None:
        """``(key, caption, figure)``: both results on the same axes, for the comparison."""
        return None


def observation_list(name: str, result: Any, level: float, gate: bool) -> ObservationList:
    """Holm over a check's per-observation ``p_value`` ``(O,)``; ``gate``: may name."""
    p = result.p_value.double().flatten()
    adjusted = holm_adjust(p)
    smallest = getattr(result, "smallest_p_value", None)
    smallest_adjusted = None if smallest is None else min(1.0, p.shape[0] * float(smallest))
    named = [o for o, a in enumerate(adjusted.tolist()) if gate and a < level]
    return ObservationList(
        check=name,
        p_value=p.tolist(),
        adjusted_p_value=adjusted.tolist(),
        named=named,
        can_reject=smallest_adjusted is None or smallest_adjusted < level,
        smallest_adjusted=smallest_adjusted,
    )


def observations_phrase(indices: Sequence[int]) -> str:
    """``observation 2`` or ``observations 0, 1 and 3``."""
    if len(indices) == 1:
        return f"observation {indices[0]}"
    return f"observations {', '.join(map(str, indices[:-1]))} and {indices[-1]}"
