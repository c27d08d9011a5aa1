"""The HTML pieces of a diagnosis report: the style sheet, tables, captions, advice.

Shared by :class:`~calib_lightning.diagnosis.Diagnosis` (one posterior) and
:class:`~calib_lightning.diagnosis.Comparison` (before and after, side by side).
"""

from __future__ import annotations

import html
from collections.abc import Sequence

__all__ = ["DISAGREE", "style", "table"]


def style(color: str) -> str:
    """The report's style sheet; ``color`` marks the verdict box."""
    return f"""<style>
body {{ font-family: system-ui, sans-serif; max-width: 1100px; margin: 2em auto;
        padding: 0 1em; color: #222; }}
.verdict {{ border-left: 6px solid {color}; background: #f6f6f6; padding: .8em 1em;
            font-size: 1.25em; }}
table {{ border-collapse: collapse; margin: 1em 0; }}
td, th {{ border-bottom: 1px solid #ddd; padding: .3em .8em; text-align: left; }}
tr.named td {{ font-weight: 600; }}
figure {{ margin: 1.5em 0; }} img {{ max-width: 100%; }}
figcaption {{ font-weight: 600; margin-bottom: .3em; }}
.note {{ color: #555; font-size: .92em; }}
</style>"""


DISAGREE = """
<h2>When checks disagree</h2>
<ul>
<li><b>Global checks pass, L-C2ST-NF (or L-C2ST) rejects at an observation:</b> the
posterior is right on average but wrong there. Trust the local result for that
observation; look at its PP-plot and, with more budget, simulate near it.</li>
<li><b>Ranks reject, KCCSD does not:</b> rank tests are the most powerful against a small,
global dispersion error; read the Directions table (a direction is named only when its
own test rejects) and the rank histograms.</li>
<li><b>A check rejects but no direction is named:</b> the error is of a kind the
directional tests do not measure (a wrong shape or correlation, or a local error); the
check's figures show which.</li>
<li><b>An observation looks outside the simulator:</b> no calibration check vouches for its
posterior, however good the verdicts on simulations; revisit the simulator or the
noise model first.</li>
<li><b>Calibrated but wide:</b> calibration says nothing about sharpness. Look at the
contraction and R<sup>2</sup> of the recovery plot: a posterior equal to the prior is
calibrated and useless; of the global checks only the joint classifier test sees it.</li>
<li>Each verdict is a test at the stated level: "not rejected" is no proof of calibration;
more calibration pairs give more power. "Cannot reject at this size" is weaker still: the
test could not have rejected whatever the data.</li>
</ul>
"""


def table(header: Sequence[str], rows: list[list[str]], classes: list[str] | None = None) -> str:
    """An HTML table of ``rows`` (cells escaped), each row with its CSS class."""
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join(
        f'<tr class="{c}">' + "".join(f"<td>{html.escape(cell)}</td>" for cell in row) + "</tr>"
        for row, c in zip(rows, classes or [""] * len(rows), strict=True)
    )
    return f"<table><tr>{head}</tr>{body}</table>"
