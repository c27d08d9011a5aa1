"""The :class:`Diagnosis` returned by ``cl.diagnose``: verdict, table, figures, report.

``Diagnosis.save(directory)`` writes ``report.html`` (one self-contained page: the
verdict, the table of checks, every figure embedded as PNG, and what to do when checks
disagree), the figures as PNG files beside it, and ``summary.json`` (the table and the
verdict, for scripts).
"""

from __future__ import annotations

import base64
import dataclasses
import html
import io
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from calib_lightning.diagnosis._check import FigureInputs, number
from calib_lightning.diagnosis._compare import Comparison
from calib_lightning.diagnosis._html import DISAGREE, style, table
from calib_lightning.diagnosis._verdict import Verdict, verdict
from calib_lightning.diagnosis.checks import REGISTRY, by_name
from calib_lightning.plots._format import format_p_value

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from calib_lightning.diagnosis._regions import RegionSummary

__all__ = ["Diagnosis"]


def _title(name: str) -> str:
    """The report's name of the check ``name`` (the name itself if none is registered)."""
    try:
        return by_name(name).title
    except KeyError:
        return name


class Diagnosis:
    """What :func:`~calib_lightning.diagnose` found.

    Attributes:
        checks: check name -> its typed result (``KCCSDResult``,
            ``RankCalibrationResult``, ``TARPResult``, ``JointC2STResult``, ``Recovery``,
            ``LC2STResult``,
            ``MisspecificationResult``, ``SupportResult`` given the prior).
        verdict: one plain sentence (calibrated; over-/under-confident; biased in a
            parameter; wrong at an observation; an observation outside the simulator;
            a check that cannot reject at this size), each backed by a test
            (:mod:`calib_lightning.diagnosis._verdict`).
        findings: what the sentence was built from: the directional tests with their
            Holm-adjusted p-values, the Holm-corrected per-observation lists, the checks
            that cannot reject.
        overall_p_value: equal-weight Bonferroni combination of the checks' verdict
            p-values, ``min(1, K min_k p_k)`` over the ``K`` checks that ran; the
            verdict rejects calibration when it is below ``level``.
        probability_maps: L-C2ST-NF's classifier on posterior draws at each observation
            (``ProbabilityMap``), when it ran; drawn in the report.
        level: the test level.
        seconds: wall time of each check (and of the shared draws).
        skipped: check name -> why it did not run (a capability the posterior lacks,
            e.g. the score for KCCSD on a samples-only posterior); listed in the table.
        before: the diagnosis of the posterior before a fix (``cl.diagnose(...,
            before=...)``), or ``None``; with it :meth:`save` writes both side by side.
        comparison: :class:`~calib_lightning.diagnosis.Comparison` of ``before`` and this
            diagnosis (``.table()``: the two columns as text; ``.identity``: the fix
            changed nothing; ``.changed``: the checks whose decision changed), or ``None``.
        regions: the conformal region's calibrated levels at the observations
            (``cl.diagnose(..., region=...)``), or ``None``.
    """

    def __init__(
        self,
        checks: Mapping[str, Any],
        *,
        level: float,
        labels: Sequence[str] | None = None,
        parameters: Sequence[int] | None = None,
        seconds: Mapping[str, float] | None = None,
        num_pairs: int | None = None,
        num_posterior_samples: int | None = None,
        reference_samples: Tensor | None = None,
        probability_maps: Any = None,
        skipped: Mapping[str, str] | None = None,
        before: Diagnosis | None = None,
        regions: RegionSummary | None = None,
        identity: bool = False,
    ) -> None:
        self.checks = dict(checks)
        self.level, self.labels = level, list(labels) if labels is not None else None
        self.seconds = dict(seconds or {})
        self.parameters = list(parameters) if parameters is not None else None
        self.num_pairs, self.num_posterior_samples = num_pairs, num_posterior_samples
        self.reference_samples, self.probability_maps = reference_samples, probability_maps
        self.skipped = dict(skipped or {})
        self.findings: Verdict = verdict(self.checks, level, self.labels)
        self.overall_p_value = self.findings.overall_p_value
        self.verdict = self.findings.sentence
        self._figures: dict[str, Figure] | None = None
        self._captions: dict[str, str] = {}
        self.before, self.regions = before, regions
        self.comparison = None if before is None else Comparison(before, self, identity)

    def __repr__(self) -> str:
        if self.comparison is not None and self.comparison.identity:
            return f"Diagnosis({self.verdict!r}, no change: the fix is the identity)"
        if self.before is not None:
            return f"Diagnosis({self.verdict!r}, before={self.before.verdict!r})"
        return f"Diagnosis({self.verdict!r})"

    # -- the table -------------------------------------------------------------------
    def rows(self) -> list[dict[str, Any]]:
        """One row per check: name, statistic, p-value, global p-value, verdict, size; then
        one per skipped check, its verdict ``"skipped: <reason>"``."""
        rows = []
        for check in REGISTRY:
            if check.name not in self.checks:
                continue
            result = self.checks[check.name]
            p = check.verdict_p_value(result)
            local = getattr(result, "p_value", None)
            row = {
                "check": check.name,
                "statistic": number(getattr(result, "statistic", None)),
                "p_value": number(local) if local is not None else None,
                "global_p_value": number(getattr(result, "global_p_value", None)),
                "verdict": "" if p is None else ("rejected" if p < self.level else "not rejected"),
                "size": check.size(result, self.findings.directions, self.level),
                "seconds": self.seconds.get(check.name),
                "p_value_error": check.p_value_error(result),
            }
            if check.name in self.findings.unsettled:
                row["verdict"] += " (within Monte Carlo error)"
            if check.name in self.findings.cannot_reject:
                row["verdict"] = (
                    f"cannot reject at this size (smallest p "
                    f"{self.findings.cannot_reject[check.name]:.2g})"
                )
            rows.append(check.row(row, result))
        for name, reason in self.skipped.items():
            rows.append(
                {
                    "check": name,
                    "statistic": None,
                    "p_value": None,
                    "global_p_value": None,
                    "verdict": f"skipped: {reason}",
                    "seconds": None,
                    "size": "",
                    "p_value_error": None,
                }
            )
        return rows

    def table(self) -> str:
        """The rows as a plain-text table (p-values never print as 0)."""
        header = (
            "check",
            "statistic",
            "p_value",
            "global_p_value",
            f"level {self.level:g}",
            "size",
        )
        lines, reasons = [header], {}
        for row in self.rows():
            if row["verdict"].startswith("skipped: "):  # the reasons below, each once
                reason = row["verdict"].removeprefix("skipped: ")
                reasons.setdefault(reason, []).append(row["check"])
                row = {**row, "verdict": "skipped (below)"}
            lines.append(
                (
                    row["check"],
                    "" if row["statistic"] is None else f"{row['statistic']:.4g}",
                    "" if row["p_value"] is None else format_p_value(row["p_value"], 4, name=""),
                    ""
                    if row["global_p_value"] is None
                    else format_p_value(row["global_p_value"], 4, name=""),
                    row["verdict"],
                    row["size"],
                )
            )
        widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
        table = "\n".join(
            "  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip()
            for line in lines
        )
        notes = [f"skipped {', '.join(names)}: {reason}" for reason, names in reasons.items()]
        return "\n".join([table, *notes])

    # -- figures ---------------------------------------------------------------------
    @property
    def figures(self) -> dict[str, Figure]:
        """Every figure of the diagnosis, drawn on first access (with L-C2ST-NF, a
        probability map and PP-plot per observation)."""
        if self._figures is None:
            self._figures, self._captions = self._draw()
            if self.regions is not None:
                self._figures.update(self.regions.figures(self.parameters, self.labels))
        return self._figures

    def caption(self, key: str) -> str:
        """The report's caption of the figure ``key``."""
        self.figures  # noqa: B018 - drawn on first access, with their captions
        if key in self._captions:
            return self._captions[key]
        if key.startswith("conformal_region_"):
            return (
                f"Observation {key.rsplit('_', 1)[1]}: the calibrated 90 % credible region "
                "(conformal) beside the posterior's own 90 % HPD region"
            )
        return key.replace("_", " ")

    def _draw(self) -> tuple[dict[str, Figure], dict[str, str]]:
        """Every check's figures (one local test's: the one whose maps were kept), and
        their captions."""
        ran = [(c, self.checks[c.name]) for c in REGISTRY if c.name in self.checks]
        tests = {
            c.words: c.verdict_p_value(r) for c, r in ran if c.in_overall and not c.at_observations
        }
        local = next((c for c, _ in ran if c.local), None)
        listed = None if local is None else self.findings.observations.get(local.name)
        inputs = FigureInputs(
            level=self.level,
            labels=self.labels,
            parameters=self.parameters,
            global_tests={k: v for k, v in tests.items() if v is not None},
            probability_maps=self.probability_maps,
            adjusted_p_values=None if listed is None else listed.adjusted_p_value,
        )
        figures: dict[str, Figure] = {}
        captions: dict[str, str] = {}
        for check, result in ran:
            if check.local and check is not local:
                continue
            for key, figure in check.figures(result, inputs).items():
                figures[key] = figure
                captions[key] = check.caption(key) or key.replace("_", " ")
        return figures, captions

    # -- saving ----------------------------------------------------------------------
    def summary(self) -> dict[str, Any]:
        """The verdict, the table, the directional tests and the per-observation lists
        as JSON-ready values."""

        def clean(value: Any) -> Any:
            return None if isinstance(value, float) and math.isnan(value) else value

        return {
            "verdict": self.verdict,
            "overall_p_value": clean(self.overall_p_value),
            "level": self.level,
            "num_pairs": self.num_pairs,
            "num_posterior_samples": self.num_posterior_samples,
            "draw_seconds": self.seconds.get("draws"),
            "checks": [{k: clean(v) for k, v in row.items()} for row in self.rows()],
            "directions": [dataclasses.asdict(d) for d in self.findings.directions],
            "observations": {
                name: dataclasses.asdict(o) for name, o in self.findings.observations.items()
            },
            "cannot_reject": self.findings.cannot_reject,
            "unsettled": {
                name: {"p_value": p, "p_value_error": e}
                for name, (p, e) in self.findings.unsettled.items()
            },
            "regions": None if self.regions is None else self.regions.rows(),
            "multiple_testing": MULTIPLE_TESTING,
        }

    def save(self, directory: str | Path) -> Path:
        """Write ``report.html``, ``summary.json`` and ``figures/*.png``; return the page.

        With :attr:`before`, the page shows before and after side by side and each
        posterior's own report goes to ``before/`` and ``after/``
        (:meth:`Comparison.save <calib_lightning.diagnosis.Comparison.save>`)."""
        if self.comparison is not None:
            return self.comparison.save(directory)
        return self._save_one(directory)

    def _save_one(self, directory: str | Path) -> Path:
        folder = Path(directory)
        (folder / "figures").mkdir(parents=True, exist_ok=True)
        images = []
        for key, figure in self.figures.items():
            buffer = io.BytesIO()
            figure.savefig(buffer, format="png", dpi=100, bbox_inches="tight")
            data = buffer.getvalue()
            (folder / "figures" / f"{key}.png").write_bytes(data)
            images.append((key, base64.b64encode(data).decode("ascii")))
        (folder / "summary.json").write_text(json.dumps(self.summary(), indent=2))
        page = folder / "report.html"
        page.write_text(self._html(images))
        return page

    def _html(self, images: list[tuple[str, str]]) -> str:
        ok = self.verdict.startswith("calibrated")
        color = "#1b7f3b" if ok else "#b3261e"
        overall = (
            ""
            if math.isnan(self.overall_p_value)
            else format_p_value(self.overall_p_value, 3, name="overall p")
        )
        header = ("check", "statistic", "p-value", "global p-value", "verdict", "size", "seconds")
        figures = "".join(
            f'<figure id="{html.escape(key)}"><figcaption>{html.escape(self.caption(key))}'
            f'</figcaption><img src="data:image/png;base64,{data}" alt="{html.escape(key)}">'
            "</figure>"
            for key, data in images
        )
        how = "Bonferroni combination of the checks' verdicts, min(1, K min p)"
        fix = ""
        for check in REGISTRY:  # an exact check that rejects decides the overall p-value
            if check.name in self.findings.rejected and check.remedy:
                how = f"0: {check.words} rejects" if check.exact else how
                fix += f'<p class="note">{check.remedy}</p>'
        budget = f"{self.num_pairs} calibration pairs"
        if self.num_posterior_samples:
            budget += f", {self.num_posterior_samples} posterior draws per pair"
            if "draws" in self.seconds:  # the shared draws are in no check's seconds
                budget += (
                    f" (drawn once in {self.seconds['draws']:.1f} s for the checks "
                    "that share them; their seconds exclude it)"
                )
        return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>Calibration report</title>
{style(color)}</head><body>
<h1>Calibration report</h1>
<p class="verdict">{html.escape(self.verdict[0].upper() + self.verdict[1:])}</p>
<p>{html.escape(overall)} ({html.escape(how)}, level {self.level:g});
{html.escape(budget)}.</p>
{fix}
<h2>Checks</h2>
{table(header, self._tab_rows())}
<p class="note">p-values: small means evidence of miscalibration. Where a check runs
several tests (ranks: per parameter and joint; L-C2ST-NF: per observation), its global
p-value combines them and is its verdict. "Cannot reject at this size": a permutation or
conformal test whose smallest attainable p-value is not below the level; it could not
have rejected whatever the data. "Size" says how large the miscalibration is, so a tiny
significant error at a large N reads differently from a large one.</p>
{self._directions_html()}
{self._observations_html()}
{"" if self.regions is None else self.regions.html()}
{DISAGREE}
<h2>Figures</h2>
{figures}
</body></html>
"""

    def _tab_rows(self) -> list[list[str]]:
        out = []
        for row in self.rows():
            p = row["p_value"]
            g = row["global_p_value"]
            out.append(
                [
                    _title(row["check"]),
                    "" if row["statistic"] is None else f"{row['statistic']:.4g}",
                    "" if p is None else format_p_value(p, 3, name=""),
                    "" if g is None else format_p_value(g, 3, name=""),
                    row["verdict"],
                    row["size"],
                    "" if row["seconds"] is None else f"{row['seconds']:.1f}",
                ]
            )
        return out

    def _directions_html(self) -> str:
        directions = self.findings.directions
        if not directions:
            return ""
        rows, classes = [], []
        for d in directions:
            rows.append(
                [
                    d.words,
                    d.size(),
                    format_p_value(d.p_value, 3, name=""),
                    format_p_value(d.adjusted_p_value, 3, name=""),
                    "named" if d.named else "",
                ]
            )
            classes.append("named" if d.named else "")
        header = (
            "direction",
            f"size ({1 - self.level:.0%} interval)",
            "one-sided p",
            "Holm-adjusted p",
            "in the verdict",
        )
        return f"""<h2>Directions</h2>
<p class="note">A direction is named only when its one-sided test rejects after Holm's
correction over these {len(directions)} tests and both the overall verdict and its own
check reject. Tests: one-sample t-tests of the mean fractional rank (0.5 under
calibration) on the joint (HPD) rank for over/under-confidence (coverage error = 0.5 -
mean joint rank; negative = over-confident) and on each marginal rank for a posterior too
high or too low; for a posterior known up to a constant, of the mean importance-sampled
credibility (a shift reads as over-confidence there).</p>
{table(header, rows, classes)}"""

    def _observations_html(self) -> str:
        lists = self.findings.observations
        if not lists:
            return ""
        count = len(next(iter(lists.values())).p_value)
        header = ["observation"]
        ran = [by_name(name) for name in lists]
        locals_ = [(c.name, lists[c.name], self.checks[c.name]) for c in ran if c.local]
        outside = [c.name for c in ran if not c.local]
        misspec = lists[outside[0]] if outside else None
        nulls = {}
        for name, _, result in locals_:
            prefix = f"{by_name(name).words}: " if len(locals_) > 1 else ""
            header += [
                f"{prefix}L-C2ST statistic",
                f"null {1 - self.level:.0%} quantile",
                "p",
                "Holm-adjusted p",
            ]
            nulls[name] = torch.quantile(
                result.null_statistics.double(), 1 - self.level, dim=0
            ).tolist()
        if misspec is not None:
            header += ["outside the simulator: p", "Holm-adjusted p"]
        header.append("in the verdict")
        rows, classes = [], []
        for o in range(count):
            row, named = [str(o)], []
            for name, local, result in locals_:
                row += [
                    f"{float(result.statistic[o]):.3g}",
                    f"{nulls[name][o]:.3g}",
                    format_p_value(local.p_value[o], 3, name=""),
                    format_p_value(local.adjusted_p_value[o], 3, name=""),
                ]
                named += [f"wrong here ({by_name(name).words})"] if o in local.named else []
            if misspec is not None:
                row += [
                    format_p_value(misspec.p_value[o], 3, name=""),
                    format_p_value(misspec.adjusted_p_value[o], 3, name=""),
                ]
                named += ["outside the simulator"] if o in misspec.named else []
            rows.append([*row, "; ".join(named)])
            classes.append("named" if named else "")
        notes = []
        for name, item in lists.items():
            if not item.can_reject:
                notes.append(
                    f"{by_name(name).title.split(' (')[0]}: the smallest Holm-adjusted "
                    f"p-value at this size is {item.smallest_adjusted:.2g}, not below "
                    f"{self.level:g}; no observation can be named."
                )
        return f"""<h2>Per observation</h2>
<p class="note">Holm's step-down correction over the {count} observations (family-wise
error at {self.level:g} under any dependence), separately for each test. An observation is
named in the verdict (last column) when its Holm-adjusted p-value is below the level and the
check's own verdict rejects (for L-C2ST-NF and L-C2ST, the overall verdict too). {
            html.escape(" ".join(notes))
        }</p>
{table(header, rows, classes)}"""


MULTIPLE_TESTING = (
    "directions: Holm over every one-sided test (the 2 (D + 1) rank-mean tests, the 2 "
    "credibility tests of a posterior known up to a constant), each gated by the overall "
    "verdict and its check's; per-observation lists: Holm over the O observations, gated by "
    "the check's verdict"
)
