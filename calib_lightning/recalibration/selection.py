r"""What ``cl.recalibrate(..., method="auto")`` scored, and why it chose: :class:`Selection`.

One row per candidate map: its cross-fitted held-out calibration error (the mean
:math:`|\mathrm{coverage} - \mathrm{level}|` of the HPD regions over levels 0.01-0.99, and
the largest gap), its held-out NLL, whether it was chosen, and why, in words: the NLL
guard that ruled it out, how far it is from the best in standard errors, or that it is
the same map as a simpler candidate (``"scale"`` fitted to the identity is ``"none"``).

``print(fixed.selection)`` shows the table; ``fixed.selection["scale"]`` is that
candidate's full scores (a ``dict`` of floats, :func:`~.api.cross_fit_scores`);
:meth:`Selection.state` is a plain ``dict`` (what a ``state_dict`` and a checkpoint keep).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["Candidate", "Selection"]


@dataclass(frozen=True)
class Candidate:
    """One row of the table.

    Attributes:
        method: the candidate (``"none"``, ``"scale"``, ``"radial"``, ``"scale+radial"``).
        calibration_error: cross-fitted held-out mean :math:`|\\mathrm{coverage} -
            \\mathrm{level}|` of its HPD regions (what ``"auto"`` minimizes).
        max_gap: the largest :math:`|\\mathrm{coverage} - \\mathrm{level}|` of the same curve.
        nll: cross-fitted held-out negative log-density (the guard).
        chosen: whether ``"auto"`` returned it.
        why: the reason, in words.
    """

    method: str
    calibration_error: float
    max_gap: float
    nll: float
    chosen: bool
    why: str


class Selection(Mapping[str, dict[str, float]]):
    """The candidates of ``method="auto"``: a table (``repr``) and, by method name, each
    candidate's full held-out scores.

    Arguments:
        rows: the table's rows, in the order the candidates were tried.
        scores: method -> its scores (:func:`~.api.cross_fit_scores` and the rule's).
        note: one line above the table (the split and the rule).

    Attributes:
        rows: the :class:`Candidate` rows.
        chosen: the method returned.
        note: the line above the table.
    """

    def __init__(self, rows: list[Candidate], scores: dict[str, dict[str, float]],
                 note: str = "") -> None:  # fmt: skip
        self.rows = tuple(rows)
        self._scores = {name: dict(values) for name, values in scores.items()}
        chosen = [row.method for row in self.rows if row.chosen]
        self.chosen = chosen[0] if chosen else ""
        self.note = note

    def __getitem__(self, method: str) -> dict[str, float]:
        return self._scores[method]

    def __iter__(self) -> Iterator[str]:
        return iter(self._scores)

    def __len__(self) -> int:
        return len(self._scores)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Selection) and self.state() == other.state()

    __hash__ = None  # type: ignore[assignment]

    def table(self) -> str:
        """The rows as an aligned text table."""
        header = ("method", "calibration error", "max |cov - level|", "NLL", "chosen", "why")
        body = [(row.method, f"{row.calibration_error:.4f}", f"{row.max_gap:.3f}",
                 f"{row.nll:.4f}", "yes" if row.chosen else "", row.why)
                for row in self.rows]  # fmt: skip
        widths = [max(len(line[i]) for line in (header, *body)) for i in range(5)]
        lines = ["  ".join(cell.ljust(width) for cell, width in zip(line[:5], widths, strict=True))
                 + "  " + line[5] for line in (header, *body)]  # fmt: skip
        return "\n".join(line.rstrip() for line in lines)

    def __repr__(self) -> str:
        top = f"Selection: chose {self.chosen!r}" + (f" ({self.note})" if self.note else "")
        return top + "\n" + self.table()

    def state(self) -> dict[str, Any]:
        """The table and the scores as plain values (``str``, ``float``, ``bool``,
        lists and dicts), for a ``state_dict`` or a checkpoint."""
        return {"rows": [asdict(row) for row in self.rows], "scores": self._scores,
                "note": self.note}  # fmt: skip

    @classmethod
    def from_state(cls, state: Any) -> Selection | None:
        """A :class:`Selection` from :meth:`state` (returned as is when it is one already;
        ``None`` stays ``None``). A plain ``method -> scores`` dict, what ``.selection``
        held before this table (and checkpoints saved then), gets rows without reasons."""
        if state is None or isinstance(state, Selection):
            return state
        if not isinstance(state, Mapping):
            raise ValueError(f"selection must be a Selection or its state(), got {state!r:.60}")
        if "rows" in state:
            rows = [Candidate(**row) for row in state["rows"]]
            return cls(rows, state["scores"], state.get("note", ""))
        rows = [Candidate(name, float(values.get("calibration_error", float("nan"))),
                          float(values.get("max_gap", float("nan"))),
                          float(values.get("nll", float("nan"))),
                          bool(values.get("chosen", 0.0)), "")
                for name, values in state.items()]  # fmt: skip
        return cls(rows, dict(state))
