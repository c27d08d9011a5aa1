"""Before and after, side by side: the report of ``cl.diagnose(..., before=...)``.

A :class:`Comparison` holds two :class:`~calib_lightning.diagnosis.Diagnosis` of the same
calibration pairs (typically a trained posterior and its recalibration by
``cl.recalibrate``). ``Comparison.save(directory)`` writes ``report.html``: the two
verdicts, each check's verdict p-value and verdict in two columns, the coverage errors
in two columns, and every figure of both, before on the left and after on the right;
beside it ``before/`` and ``after/`` hold each posterior's full report (directions,
per-observation tables, sizes) and ``summary.json`` both summaries and the two-column
tables.
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from calib_lightning.diagnosis._html import DISAGREE, style, table
from calib_lightning.diagnosis.checks import REGISTRY, by_name
from calib_lightning.plots._format import format_p_value


class Diagnosis(Protocol):
    """What a comparison reads of each :class:`~calib_lightning.diagnosis.Diagnosis`."""

    checks: Mapping[str, Any]
    level: float
    num_pairs: int | None
    num_posterior_samples: int | None
    verdict: str
    overall_p_value: float

    @property
    def figures(self) -> Mapping[str, Any]: ...

    def caption(self, key: str) -> str: ...

    def rows(self) -> list[dict[str, Any]]: ...

    def summary(self) -> dict[str, Any]: ...

    def _save_one(self, directory: str | Path) -> Path: ...


__all__ = ["Comparison", "coverage_errors"]

_OK, _BAD = "#1b7f3b", "#b3261e"  # the verdict box: calibrated, not
_PAIR_STYLE = """<style>
.pair { display: grid; grid-template-columns: 1fr 1fr; gap: 1.2em; align-items: start; }
.pair.stacked { grid-template-columns: 1fr; }
.pair > div > h3 { margin: .2em 0; }
.pair .verdict { font-size: 1.05em; }
.side { color: #555; font-size: .9em; font-weight: 600; text-transform: uppercase; }
</style>"""
#: figures wider than this (pixels) go one above the other, not side by side
_SIDE_BY_SIDE_WIDTH = 540


def coverage_errors(diagnosis: Diagnosis) -> dict[str, tuple[str, float]]:
    """How far the coverage of ``diagnosis``'s credible regions is from nominal, from the
    checks that ran: quantity -> (its description, value). The rank check's
    ``hpd_signed_area`` (its ``coverage_error``; negative = over-confident) and
    ``hpd_largest_gap`` (the largest absolute gap of the HPD expected-coverage curve to
    the diagonal), TARP's ``tarp_atc`` (its signed area), the importance-sampled
    coverage's ``is_signed_area``."""
    out: dict[str, tuple[str, float]] = {}
    for check in REGISTRY:
        if check.name in diagnosis.checks:
            out.update(check.coverage_errors(diagnosis.checks[check.name]))
    return out


def _title(name: str) -> str:
    """The report's name of the check ``name`` (the name itself if none is registered)."""
    try:
        return by_name(name).title
    except KeyError:
        return name


def _decision(verdict: str) -> str:
    """``"rejected"`` or ``"not rejected"`` (or the verdict itself for other rows)."""
    return (
        "not rejected"
        if verdict.startswith("not rejected")
        else ("rejected" if verdict.startswith("rejected") else verdict)
    )


def _verdict_p(row: dict[str, Any]) -> float | None:
    """The p-value a check's verdict reads: its global p-value where it has one."""
    return row["global_p_value"] if row["global_p_value"] is not None else row["p_value"]


def _p(value: float | None) -> str:
    return "" if value is None or math.isnan(value) else format_p_value(value, 3, name="")


def _error(quantity: str, value: float | None) -> str:
    """A coverage error, with its sign where it has one."""
    if value is None:
        return ""
    return f"{value:.3f}" if quantity == "hpd_largest_gap" else f"{value:+.3f}"


class Comparison:
    """Two diagnoses of the same calibration pairs, before and after a fix.

    ``cl.diagnose(fixed, ..., before=posterior)`` runs both with common random numbers
    (:mod:`calib_lightning.diagnosis._checks`), so a difference between the columns is a
    difference between the posteriors.

    Arguments:
        before: the :class:`~calib_lightning.diagnosis.Diagnosis` of the posterior as
            trained.
        after: the diagnosis of the fixed (e.g. recalibrated) posterior, on the same
            pairs with the same ``level``.

    Attributes:
        identity: the fix is the identity (``after``'s posterior says so:
            ``is_identity``, e.g. a ``cl.recalibrate`` fit that changed nothing): the
            report says "no change" instead of comparing.
        changed: the checks whose decision differs between the two (at ``level``).

    Raises:
        ValueError: the two differ in ``level`` or in the number of calibration pairs.
    """

    def __init__(self, before: Diagnosis, after: Diagnosis, identity: bool = False) -> None:
        if before.level != after.level or before.num_pairs != after.num_pairs:
            raise ValueError(
                "before must be diagnosed at the same level on the same calibration pairs as "
                f"after (level {after.level:g}, {after.num_pairs} pairs), got level "
                f"{before.level:g} and {before.num_pairs} pairs"
            )
        self.before, self.after, self.identity = before, after, identity
        self.changed = [
            row["check"]
            for row in self.rows()
            if row["before_verdict"]
            and row["after_verdict"]
            and _decision(row["before_verdict"]) != _decision(row["after_verdict"])
        ]

    def __repr__(self) -> str:
        if self.identity:
            return (
                "Comparison(no change: the fix is the identity, so the posterior is the one "
                f"before; verdict {self.after.verdict!r})"
            )
        return f"Comparison(before={self.before.verdict!r}, after={self.after.verdict!r})"

    def summary_line(self) -> str:
        """One sentence: no change (an identity fix, or no decision changed), or which
        checks changed their decision."""
        if self.identity:
            return "No change: the fix is the identity, so the posterior is the one before."
        if not self.changed:
            return "No check changed its decision."
        return f"Changed decision: {', '.join(self.changed)}."

    def rows(self) -> list[dict[str, Any]]:
        """One row per check that ran or was skipped for either posterior: ``check``,
        then ``before_p_value``/``after_p_value`` (the p-value its verdict reads: the
        global one where the check has one) and ``before_verdict``/``after_verdict``
        (``""``: not run for that posterior)."""
        rows: dict[str, dict[str, Any]] = {}
        for side, diagnosis in (("before", self.before), ("after", self.after)):
            for row in diagnosis.rows():
                out = rows.setdefault(
                    row["check"],
                    {
                        "check": row["check"],
                        "before_p_value": None,
                        "after_p_value": None,
                        "before_verdict": "",
                        "after_verdict": "",
                    },
                )
                out[f"{side}_p_value"] = _verdict_p(row)
                out[f"{side}_verdict"] = row["verdict"]
        order = {check.name: k for k, check in enumerate(REGISTRY)}
        return sorted(rows.values(), key=lambda row: order.get(row["check"], len(order)))

    def coverage_rows(self) -> list[dict[str, Any]]:
        """One row per coverage error of :func:`coverage_errors`: ``quantity``,
        ``before``, ``after`` (``None`` where the check did not run)."""
        before, after = coverage_errors(self.before), coverage_errors(self.after)
        keys = list(dict.fromkeys([*before, *after]))
        return [
            {
                "quantity": key,
                "before": before[key][1] if key in before else None,
                "after": after[key][1] if key in after else None,
                "description": (before.get(key) or after[key])[0],
            }
            for key in keys
        ]

    def table(self) -> str:
        """The overall p-values, the checks and the coverage errors as plain text, in two
        columns (the verdicts are ``before.verdict`` and ``after.verdict``)."""
        before, after = self.before, self.after
        lines = [
            ("", "before", "after"),
            ("overall p", _p(before.overall_p_value), _p(after.overall_p_value)),
        ]
        if self.identity:
            lines.insert(1, ("change", "", "none: the fix is the identity"))
        for row in self.rows():
            lines.append(
                (
                    row["check"],
                    f"{_p(row['before_p_value'])} {row['before_verdict']}".strip(),
                    f"{_p(row['after_p_value'])} {row['after_verdict']}".strip(),
                )
            )
        for row in self.coverage_rows():
            lines.append(
                (
                    row["quantity"],
                    _error(row["quantity"], row["before"]),
                    _error(row["quantity"], row["after"]),
                )
            )
        widths = [max(len(line[i]) for line in lines) for i in range(3)]
        text = "\n".join(
            "  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip()
            for line in lines
        )
        return text

    def summary(self) -> dict[str, Any]:
        """Both summaries and the two-column tables, JSON-ready."""

        def clean(value: Any) -> Any:
            return None if isinstance(value, float) and math.isnan(value) else value

        return {
            "change": self.summary_line(),
            "identity": self.identity,
            "changed": self.changed,
            "before": self.before.summary(),
            "after": self.after.summary(),
            "checks": [{k: clean(v) for k, v in row.items()} for row in self.rows()],
            "coverage_errors": self.coverage_rows(),
        }

    def save(self, directory: str | Path) -> Path:
        """Write ``report.html`` (side by side), ``summary.json``, and each posterior's
        full report in ``before/`` and ``after/``; return the page."""
        folder = Path(directory)
        folder.mkdir(parents=True, exist_ok=True)
        self.before._save_one(folder / "before")
        self.after._save_one(folder / "after")
        (folder / "summary.json").write_text(json.dumps(self.summary(), indent=2))
        page = folder / "report.html"
        page.write_text(self._html(folder))
        return page

    def _html(self, folder: Path) -> str:
        keys = list(self.after.figures) + [
            k for k in self.before.figures if k not in self.after.figures
        ]
        figures = _overlay(self.before, self.after, folder) + "".join(
            _figure_pair(folder, key, self.before, self.after) for key in keys
        )
        checks = [
            [
                _title(row["check"]),
                _p(row["before_p_value"]),
                _p(row["after_p_value"]),
                row["before_verdict"],
                row["after_verdict"],
            ]
            for row in self.rows()
        ]
        coverage = [
            [
                row["description"],
                _error(row["quantity"], row["before"]),
                _error(row["quantity"], row["after"]),
            ]
            for row in self.coverage_rows()
        ]
        after = self.after
        budget = f"{after.num_pairs} calibration pairs"
        if after.num_posterior_samples:
            budget += f", {after.num_posterior_samples} posterior draws per pair"
        return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>Calibration report: before and after</title>
{style(_BAD)}
{_PAIR_STYLE}</head><body>
<h1>Calibration report: before and after</h1>
<div class="pair">{_verdict_box("Before", self.before)}{_verdict_box("After", after)}</div>
<p class="verdict">{html.escape(self.summary_line())}</p>
<p>Both on the same {html.escape(budget)} with the same random numbers (references,
folds, classifier seeds, base points, and latent draws where both share a base); level
{after.level:g}. Each posterior's full
report (directions, per-observation tables, sizes, timings):
<a href="before/report.html">before</a>, <a href="after/report.html">after</a>.</p>
<h2>Checks</h2>
{table(("check", "p-value before", "p-value after", "verdict before", "verdict after"), checks)}
<p class="note">The p-value each check's verdict reads (its global p-value where it runs
several tests); small means evidence of miscalibration.</p>
<h2>Coverage errors</h2>
{table(("coverage of the credible regions", "before", "after"), coverage)}
<p class="note">0 for a calibrated posterior, up to sampling noise. Signed areas: negative =
over-confident (regions too narrow), positive = under-confident.</p>
<h2>Figures: before and after</h2>
{figures}
{DISAGREE}
</body></html>
"""


def _verdict_box(side: str, diagnosis: Diagnosis) -> str:
    color = _OK if diagnosis.verdict.startswith("calibrated") else _BAD
    sentence = diagnosis.verdict[0].upper() + diagnosis.verdict[1:]
    overall = _p(diagnosis.overall_p_value)
    overall = f"overall p {overall}" if overall else ""
    return (
        f'<div><h3>{side}</h3><p class="verdict" style="border-left-color: {color}">'
        f"{html.escape(sentence)}</p><p>{html.escape(overall)}</p></div>"
    )


def _png_width(data: bytes) -> int:
    """The width in pixels from a PNG's header."""
    return int.from_bytes(data[16:20], "big")


def _img(data: bytes, alt: str) -> str:
    encoded = base64.b64encode(data).decode("ascii")
    return f'<img src="data:image/png;base64,{encoded}" alt="{html.escape(alt)}">'


def _figure_pair(folder: Path, key: str, before: Diagnosis, after: Diagnosis) -> str:
    """The figure ``key`` of both diagnoses (read from the saved PNGs), side by side, or
    one above the other when they are too wide for half the page."""
    cells, wide = [], False
    for side, diagnosis in (("before", before), ("after", after)):
        if key not in diagnosis.figures:
            cells.append(
                f'<div><div class="side">{side}</div><p class="note">(not drawn for '
                "this posterior)</p></div>"
            )
            continue
        data = (folder / side / "figures" / f"{key}.png").read_bytes()
        wide = wide or _png_width(data) > _SIDE_BY_SIDE_WIDTH
        cells.append(f'<div><div class="side">{side}</div>{_img(data, f"{side}: {key}")}</div>')
    layout = "pair stacked" if wide else "pair"
    caption = after.caption(key) if key in after.figures else before.caption(key)
    return (
        f'<figure id="{html.escape(key)}"><figcaption>{html.escape(caption)}'
        f'</figcaption><div class="{layout}">{"".join(cells)}</div></figure>'
    )


def _overlay(before: Diagnosis, after: Diagnosis, folder: Path) -> str:
    """The figures of the checks that draw both results on the same axes (the expected
    coverage before and after), into ``figures/`` of the page."""
    out = []
    for check in REGISTRY:
        if check.name not in before.checks or check.name not in after.checks:
            continue
        drawn = check.overlay(before.checks[check.name], after.checks[check.name])
        if drawn is None:
            continue
        key, caption, figure = drawn
        buffer = io.BytesIO()
        figure.savefig(buffer, format="png", dpi=100, bbox_inches="tight")
        data = buffer.getvalue()
        (folder / "figures").mkdir(exist_ok=True)
        (folder / "figures" / f"{key}.png").write_bytes(data)
        out.append(
            f'<figure id="{html.escape(key)}"><figcaption>{html.escape(caption)}'
            f"</figcaption>{_img(data, key.replace('_', ' '))}</figure>"
        )
    return "".join(out)
