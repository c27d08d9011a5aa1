"""The :class:`Diagnosis` returned by ``cl.diagnose``: verdict, table, figures, report.

``Diagnosis.save(directory)`` writes ``report.html`` (one self-contained page: the
verdict, the table of checks, every figure embedded as PNG, and what to do when checks
disagree), the figures as PNG files beside it, and ``summary.json`` (the table and the
verdict, for scripts).
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch import Tensor

from calib_lightning.diagnosis._verdict import VERDICT_CHECKS, overall_p_value, verdict_sentence
from calib_lightning.plots._format import format_p_value

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["Diagnosis"]

_TITLES = {
    "kccsd": "KCCSD (kernel calibration test, scores only)",
    "ranks": "Rank calibration (SBC, marginal and joint)",
    "tarp": "TARP (coverage from random references)",
    "recovery": "Recovery (posterior mean vs truth, z-scores)",
    "lc2st_nf": "L-C2ST-NF (local test at each observation)",
    "misspecification": "Misspecification (observation vs simulations)",
    "reference": "Reference samples (MMD test per observation)",
}

_DISAGREE = """
<h2>When checks disagree</h2>
<ul>
<li><b>Global checks pass, L-C2ST-NF rejects at an observation:</b> the posterior is right
on average but wrong there. Trust the local result for that observation; look at its
PP-plot and, with more budget, simulate near it.</li>
<li><b>Ranks reject, KCCSD does not:</b> rank tests are the most powerful against a small,
global dispersion error; read the sign of the coverage error (over- or
under-confident) and the rank histograms.</li>
<li><b>An observation looks outside the simulator:</b> no calibration check vouches for its
posterior, however good the verdicts on simulations; revisit the simulator or the
noise model first.</li>
<li><b>Calibrated but wide:</b> calibration says nothing about sharpness. Look at the
contraction and R<sup>2</sup> of the recovery plot: a posterior equal to the prior is
calibrated and useless.</li>
<li>Each verdict is a test at the stated level: "not rejected" is no proof of calibration;
more calibration pairs give more power.</li>
</ul>
"""


def _number(value: Any) -> float | None:
    if isinstance(value, Tensor) and value.numel() == 1:
        return float(value)
    if isinstance(value, int | float):
        return float(value)
    return None


class Diagnosis:
    """What :func:`~calib_lightning.diagnose` found.

    Attributes:
        checks: check name -> its typed result (``KCCSDResult``,
            ``RankCalibrationResult``, ``TARPResult``, ``Recovery``, ``LC2STResult``,
            ``MisspecificationResult``).
        verdict: one plain sentence (calibrated; over-/under-confident; biased in a
            parameter; wrong at an observation; an observation outside the simulator).
        overall_p_value: Cauchy combination of the checks' verdict p-values; the
            verdict rejects calibration when it is below ``level``.
        level: the test level.
        seconds: wall time of each check (and of the shared draws).
        skipped: check name -> why it did not run (a capability the posterior lacks,
            e.g. the score for KCCSD on a samples-only posterior); listed in the table.
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
        skipped: Mapping[str, str] | None = None,
    ) -> None:
        self.checks = dict(checks)
        self.level, self.labels = level, list(labels) if labels is not None else None
        self.seconds = dict(seconds or {})
        self.parameters = list(parameters) if parameters is not None else None
        self.num_pairs, self.num_posterior_samples = num_pairs, num_posterior_samples
        self.reference_samples = reference_samples
        self.skipped = dict(skipped or {})
        self.overall_p_value = overall_p_value(self.checks)
        self.verdict = verdict_sentence(self.checks, level, self.labels)
        self._figures: dict[str, Figure] | None = None

    def __repr__(self) -> str:
        return f"Diagnosis({self.verdict!r})"

    # -- the table -------------------------------------------------------------------
    def rows(self) -> list[dict[str, Any]]:
        """One row per check: name, statistic, p-value, global p-value, verdict; then one
        per skipped check, its verdict ``"skipped: <reason>"``."""
        rows = []
        for name, result in self.checks.items():
            field = VERDICT_CHECKS.get(name, getattr(type(result), "verdict", None))
            p = _number(getattr(result, field)) if field else None
            local = getattr(result, "p_value", None)
            row = {
                "check": name,
                "statistic": _number(getattr(result, "statistic", None)),
                "p_value": _number(local) if local is not None else None,
                "global_p_value": _number(getattr(result, "global_p_value", None)),
                "verdict": "" if p is None else ("rejected" if p < self.level else "not rejected"),
                "seconds": self.seconds.get(name),
            }
            if name == "recovery":
                row["verdict"] = "see figures"
            if name == "reference":  # one MMD test per observation: the smallest p-value
                row["p_value"] = float(result.mmd_p_value.min())
                row["verdict"] = "see p-values per observation"
            rows.append(row)
        for name, reason in self.skipped.items():
            rows.append({"check": name, "statistic": None, "p_value": None,
                         "global_p_value": None, "verdict": f"skipped: {reason}",
                         "seconds": None})  # fmt: skip
        return rows

    def table(self) -> str:
        """The rows as a plain-text table (p-values never print as 0)."""
        header = ("check", "statistic", "p_value", "global_p_value", f"level {self.level:g}")
        lines = [header]
        for row in self.rows():
            lines.append((
                row["check"],
                "" if row["statistic"] is None else f"{row['statistic']:.4g}",
                "" if row["p_value"] is None else format_p_value(row["p_value"], 4, name=""),
                "" if row["global_p_value"] is None
                else format_p_value(row["global_p_value"], 4, name=""),
                row["verdict"],
            ))  # fmt: skip
        widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
        return "\n".join(
            "  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip()
            for line in lines
        )

    # -- figures ---------------------------------------------------------------------
    @property
    def figures(self) -> dict[str, Figure]:
        """Every figure of the diagnosis, drawn on first access."""
        if self._figures is None:
            from calib_lightning.diagnosis._figures import draw_figures

            self._figures = draw_figures(self.checks, self.level, self.labels, self.parameters)
        return self._figures

    # -- saving ----------------------------------------------------------------------
    def summary(self) -> dict[str, Any]:
        """The verdict and the table as JSON-ready values."""

        def clean(value: Any) -> Any:
            return None if isinstance(value, float) and math.isnan(value) else value

        return {
            "verdict": self.verdict,
            "overall_p_value": clean(self.overall_p_value),
            "level": self.level,
            "num_pairs": self.num_pairs,
            "num_posterior_samples": self.num_posterior_samples,
            "checks": [{k: clean(v) for k, v in row.items()} for row in self.rows()],
        }

    def save(self, directory: str | Path) -> Path:
        """Write ``report.html``, ``summary.json`` and ``figures/*.png``; return the page."""
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
        overall = ("" if math.isnan(self.overall_p_value)
                   else format_p_value(self.overall_p_value, 3, name="overall p"))  # fmt: skip
        cells = "".join(
            "<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in line.split("\t")) + "</tr>"
            for line in self._tab_rows()
        )
        figures = "".join(
            f'<figure><figcaption>{html.escape(_caption(key))}</figcaption>'
            f'<img src="data:image/png;base64,{data}" alt="{html.escape(key)}"></figure>'
            for key, data in images
        )
        budget = f"{self.num_pairs} calibration pairs"
        if self.num_posterior_samples:
            budget += f", {self.num_posterior_samples} posterior draws per pair"
        return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>Calibration report</title>
<style>
body {{ font-family: system-ui, sans-serif; max-width: 1100px; margin: 2em auto;
        padding: 0 1em; color: #222; }}
.verdict {{ border-left: 6px solid {color}; background: #f6f6f6; padding: .8em 1em;
            font-size: 1.25em; }}
table {{ border-collapse: collapse; margin: 1em 0; }}
td, th {{ border-bottom: 1px solid #ddd; padding: .3em .8em; text-align: left; }}
figure {{ margin: 1.5em 0; }} img {{ max-width: 100%; }}
figcaption {{ font-weight: 600; margin-bottom: .3em; }}
</style></head><body>
<h1>Calibration report</h1>
<p class="verdict">{html.escape(self.verdict[0].upper() + self.verdict[1:])}</p>
<p>{html.escape(overall)} (Cauchy combination of the checks' verdicts, level
{self.level:g}); {html.escape(budget)}.</p>
<h2>Checks</h2>
<table><tr><th>check</th><th>statistic</th><th>p-value</th><th>global p-value</th>
<th>verdict</th><th>seconds</th></tr>{cells}</table>
<p>p-values: small means evidence of miscalibration. Where a check runs several tests
(ranks: per parameter and joint; L-C2ST-NF: per observation), its global p-value
combines them and is its verdict; the others say where it fails.</p>
{_DISAGREE}
<h2>Figures</h2>
{figures}
</body></html>
"""

    def _tab_rows(self) -> list[str]:
        out = []
        for row in self.rows():
            p = row["p_value"]
            g = row["global_p_value"]
            out.append("\t".join([
                _TITLES.get(row["check"], row["check"]),
                "" if row["statistic"] is None else f"{row['statistic']:.4g}",
                "" if p is None else format_p_value(p, 3, name=""),
                "" if g is None else format_p_value(g, 3, name=""),
                row["verdict"],
                "" if row["seconds"] is None else f"{row['seconds']:.1f}",
            ]))  # fmt: skip
        return out


def _caption(key: str) -> str:
    check, _, figure = key.partition("_")
    names = {"lc2st": "L-C2ST-NF", "ranks": "Rank calibration", "tarp": "TARP",
             "recovery": "Recovery", "misspecification": "Misspecification"}  # fmt: skip
    return f"{names.get(check, check)}: {figure.replace('_', ' ')}".rstrip(": ")
