r"""How ``cl.recalibrate(..., method="auto")`` chooses, and its record: :class:`Selection`.

:func:`select_method` fits every candidate (``"none"``, ``"scale"``, ``"radial"``,
``"scale+radial"``) and takes their cross-fitted held-out scores
(:func:`~.cross_fit.cross_fit_scores`); :func:`choose` applies the rule to them: an NLL
guard, then the lowest held-out calibration error within paired standard errors
(:data:`BOOTSTRAP_RESAMPLES` bootstrap resamples), then the simplest of those as sharp
as the sharpest.

What it scored and why it chose is a :class:`Selection`, one row per candidate map: its
cross-fitted held-out calibration error (the mean :math:`|\mathrm{coverage} - \mathrm{level}|`
of the HPD regions over levels 0.01-0.99, and the largest gap), its held-out NLL, whether
it was chosen, and why, in words: the NLL guard that ruled it out, how far it is from the
best in standard errors, or that it is the same map as a simpler candidate (``"scale"``
fitted to the identity is ``"none"``).

``print(fixed.selection)`` shows the table; ``fixed.selection["scale"]`` is that
candidate's full scores (a ``dict`` of floats, :func:`~.cross_fit.cross_fit_scores`);
:meth:`Selection.state` is a plain ``dict`` (what a ``state_dict`` and a checkpoint keep).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import Tensor

from calib_lightning.recalibration._hpd import LatentDraws, on_cpu
from calib_lightning.recalibration.cross_fit import (
    AUTO_CANDIDATES,
    CALIBRATION_LEVELS,
    _cross_fit,
    _fit_map,
    marginal_coverage_gaps,
    scale_kinds,
)
from calib_lightning.recalibration.radial import LatentMap
from calib_lightning.recalibration.scale import shared_hpd_log_scale

__all__ = ["BOOTSTRAP_RESAMPLES", "Candidate", "Selection", "choose", "select_method"]


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
        marginal_error: cross-fitted held-out mean :math:`|\\mathrm{coverage} -
            \\mathrm{level}|` of the latent coordinates
            (:func:`~.cross_fit.marginal_coverage_gaps`; ``nan`` in a table saved before
            it was scored).
    """

    method: str
    calibration_error: float
    max_gap: float
    nll: float
    chosen: bool
    why: str
    marginal_error: float = float("nan")


class Selection(Mapping[str, dict[str, float]]):
    """The candidates of ``method="auto"``: a table (``repr``) and, by method name, each
    candidate's full held-out scores.

    Arguments:
        rows: the table's rows, in the order the candidates were tried.
        scores: method -> its scores (:func:`~.cross_fit.cross_fit_scores` and the rule's).
        note: one line above the table (the split and the rule).

    Attributes:
        rows: the :class:`Candidate` rows.
        chosen: the method returned.
        note: the line above the table.
    """

    def __init__(
        self, rows: list[Candidate], scores: dict[str, dict[str, float]], note: str = ""
    ) -> None:
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
        header = (
            "method",
            "calibration error",
            "max |cov - level|",
            "marginal error",
            "NLL",
            "chosen",
            "why",
        )
        body = [
            (
                row.method,
                f"{row.calibration_error:.4f}",
                f"{row.max_gap:.3f}",
                f"{row.marginal_error:.4f}",
                f"{row.nll:.4f}",
                "yes" if row.chosen else "",
                row.why,
            )
            for row in self.rows
        ]
        widths = [max(len(line[i]) for line in (header, *body)) for i in range(6)]
        lines = [
            "  ".join(cell.ljust(width) for cell, width in zip(line[:6], widths, strict=True))
            + "  "
            + line[6]
            for line in (header, *body)
        ]
        return "\n".join(line.rstrip() for line in lines)

    def __repr__(self) -> str:
        top = f"Selection: chose {self.chosen!r}" + (f" ({self.note})" if self.note else "")
        return top + "\n" + self.table()

    def state(self) -> dict[str, Any]:
        """The table and the scores as plain values (``str``, ``float``, ``bool``,
        lists and dicts), for a ``state_dict`` or a checkpoint."""
        return {
            "rows": [asdict(row) for row in self.rows],
            "scores": self._scores,
            "note": self.note,
        }

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
        rows = [
            Candidate(
                name,
                float(values.get("calibration_error", float("nan"))),
                float(values.get("max_gap", float("nan"))),
                float(values.get("nll", float("nan"))),
                bool(values.get("chosen", 0.0)),
                "",
            )
            for name, values in state.items()
        ]
        return cls(rows, dict(state))


#: paired bootstrap resamples of the pairs for the standard error of a difference in
#: calibration error between two candidates
BOOTSTRAP_RESAMPLES = 200


def _bootstrap_se(
    levels: dict[str, Tensor],
    best: str,
    seed: int,
    coordinate_levels: dict[str, Tensor] | None = None,
    folds: Tensor | None = None,
) -> dict[str, float]:
    """Paired bootstrap standard error of each candidate's calibration error minus the
    best's: :data:`BOOTSTRAP_RESAMPLES` resamples of the pairs, shared by all (with
    ``coordinate_levels``, of the error the rule then ranks by: the mean of the HPD and
    the per-coordinate errors)."""
    n = levels[best].numel()
    generator = torch.Generator().manual_seed(seed + 1)
    rows = torch.randint(n, (BOOTSTRAP_RESAMPLES, n), generator=generator)
    weight = torch.zeros(BOOTSTRAP_RESAMPLES, n, dtype=torch.float64)
    weight.scatter_add_(1, rows, torch.ones_like(rows, dtype=torch.float64))
    weight /= n

    def errors(level: Tensor) -> Tensor:
        curve = weight @ (level[:, None] <= CALIBRATION_LEVELS).double()
        return (curve - CALIBRATION_LEVELS).abs().mean(1)

    def combined(name: str) -> Tensor:
        if coordinate_levels is None:
            return errors(levels[name])
        gaps = marginal_coverage_gaps(coordinate_levels[name], folds, weight)
        return 0.5 * (errors(levels[name]) + gaps.abs().mean((1, 2, 3)))

    reference = combined(best)
    return {name: float((combined(name) - reference).std()) for name in levels}


def select_method(
    z: Tensor,
    log_prob: Tensor,
    draws: LatentDraws,
    *,
    band: int | None = None,
    seed: int = 0,
    nll_tolerance: float = 0.01,
    num_standard_errors: float = 2.0,
    scale_target: str | None = None,
) -> tuple[str, Selection, dict[str, LatentMap]]:
    r"""The method ``"auto"`` picks, the :class:`~.selection.Selection` table of every
    candidate's :func:`~.cross_fit.cross_fit_scores`, and each candidate's map fitted on all pairs.

    By the cross-fitted held-out calibration error :math:`e` (``calibration_error``: the
    mean :math:`|\mathrm{coverage} - \mathrm{level}|` of the HPD regions, from ``draws``
    at the same pairs), with :math:`k` = ``num_standard_errors``:

    1. the NLL guard: candidates whose held-out ``nll`` exceeds the identity's by more than
       ``nll_tolerance * max(1, |nll|)`` plus :math:`k` paired standard errors
       (``nll_difference_se``: a map fitted on half of the pairs is noisier than the
       final one) are out (``kept_by_nll``); it only vetoes a clearly worse density;
    2. of the others the one with the smallest :math:`e` is the best; as calibrated are
       those within :math:`k` standard errors of it in :math:`e`
       (``calibration_difference_se``: the paired bootstrap standard error of the
       difference, :data:`BOOTSTRAP_RESAMPLES` resamples of the pairs) and not off in the
       absolute signed area ``hpd_coverage_error`` (off: beyond :math:`k` of its own
       standard errors from 0, ``hpd_se``, and beyond the best's by :math:`k` paired ones,
       ``hpd_difference_se``; the more powerful measure against a shift of every level, a
       variance error, where :math:`e` is noisier);
    3. of those, the first in :data:`AUTO_CANDIDATES` order (simplest first, ``"none"``
       included) whose held-out NLL is within :math:`k` paired standard errors of their
       lowest (``nll_to_sharpest_se``) is picked: the identity stays unless a map is
       measurably better calibrated, and a map replaces a simpler one only when it is
       measurably better calibrated or, as calibrated, measurably sharper;
    4. a candidate whose map, fitted on all pairs, is the same as a simpler candidate's
       (:meth:`~.radial.LatentMap.same_as`: ``"scale"`` fitted to the identity is
       ``"none"``) gives way to it, and the table says so.
    """
    scores, levels, changes, coordinate_levels, folds = _cross_fit(
        z, log_prob, AUTO_CANDIDATES, band, seed, draws, scale_target
    )
    kinds = scale_kinds(scale_target)
    full_hpd = shared_hpd_log_scale(on_cpu(draws))
    z_all = z.detach().double().cpu()
    maps = {
        name: _fit_map(z_all, name, band, full_hpd if kinds.get(name) == "hpd" else None)
        for name in AUTO_CANDIDATES
    }
    same = {
        name: next(
            (
                other
                for other in AUTO_CANDIDATES[: AUTO_CANDIDATES.index(name)]
                if maps[name].same_as(maps[other])
            ),
            None,
        )
        for name in AUTO_CANDIDATES
    }
    chosen, selection = choose(
        scores,
        levels,
        changes,
        same,
        seed=seed,
        nll_tolerance=nll_tolerance,
        num_standard_errors=num_standard_errors,
        coordinate_levels=coordinate_levels,
        folds=folds,
    )
    return chosen, selection, maps


def choose(
    scores: dict[str, dict[str, float]],
    levels: dict[str, Tensor],
    changes: dict[str, Tensor],
    same: dict[str, str | None],
    *,
    seed: int = 0,
    nll_tolerance: float = 0.01,
    num_standard_errors: float = 2.0,
    coordinate_levels: dict[str, Tensor] | None = None,
    folds: Tensor | None = None,
) -> tuple[str, Selection]:
    r"""The rule of :func:`select_method` on the cross-fitted ``scores`` (each candidate's
    ``calibration_error``, ``max_gap``, ``nll`` and ``nll_difference_se``), held-out HPD
    levels ``(n,)``, per-pair log-density changes ``(n,)`` and ``same`` (candidate -> the
    simpler candidate with the same map, or ``None``), in :data:`AUTO_CANDIDATES` order:
    the method chosen and the :class:`~.selection.Selection` table. With
    ``coordinate_levels`` (candidate -> held-out :math:`\Phi(u)` ``(n, D)``; ``folds``
    ``(n,)``: the fold that scored each pair, each fold's curves apart), the error
    ranked is the mean of the HPD error and the per-coordinate one
    (``marginal_calibration_error``), so that a map that calibrates the HPD regions but
    leaves each coordinate's shape wrong is not as calibrated as one that fixes both."""
    names = list(scores)
    reference = scores[names[0]]["nll"]
    margin = nll_tolerance * max(1.0, abs(reference))
    k = num_standard_errors
    limit = {name: reference + margin + k * scores[name]["nll_difference_se"] for name in names}
    kept = [name for name in names if scores[name]["nll"] <= limit[name]]
    error = {name: scores[name]["calibration_error"] for name in names}
    if coordinate_levels is not None:
        for name in names:
            gaps = marginal_coverage_gaps(coordinate_levels[name], folds).abs().mean()
            scores[name]["marginal_calibration_error"] = float(gaps)
            scores[name]["selection_error"] = 0.5 * (error[name] + float(gaps))
        error = {name: scores[name]["selection_error"] for name in names}
    best = min(kept, key=error.__getitem__)
    se = _bootstrap_se(levels, best, seed, coordinate_levels, folds)
    root_n = math.sqrt(levels[best].numel())
    signed = {name: abs(scores[name]["hpd_coverage_error"]) for name in names}
    signed_se = {name: float((levels[name] - levels[best]).std() / root_n) for name in names}
    own_se = {name: float(levels[name].std() / root_n) for name in names}
    # as calibrated as the best: within k SE of it by the curve's distance, and by the
    # signed area (the more powerful against a shift of every level, a variance error)
    # unless that area is itself within k SE of 0
    off = {
        name: signed[name] > k * own_se[name] and signed[name] - signed[best] > k * signed_se[name]
        for name in names
    }
    level = [name for name in kept if error[name] - error[best] <= k * se[name] and not off[name]]
    nll = {name: scores[name]["nll"] for name in names}
    sharpest = min(level, key=nll.__getitem__)
    nll_se = {name: float((changes[sharpest] - changes[name]).std() / root_n) for name in names}
    within = [name for name in level if nll[name] - nll[sharpest] <= k * nll_se[name]]
    chosen = same[within[0]] or within[0]
    for name in names:
        scores[name]["hpd_se"] = own_se[name]
        scores[name]["hpd_difference_se"] = signed_se[name]
        scores[name]["calibration_difference_se"] = se[name]
        scores[name]["nll_to_sharpest_se"] = nll_se[name]
        scores[name]["kept_by_nll"] = float(name in kept)
        scores[name]["chosen"] = float(name == chosen)

    def why(name: str) -> str:
        gap = error[name] - error[best]
        if same[name] is not None:
            return f"same map as {same[name]!r} (fitted on all pairs)"
        if name not in kept:
            return (
                f"NLL {nll[name] - reference:+.4f} over {names[0]!r}'s, beyond the guard "
                f"({limit[name] - reference:.4f}): out"
            )
        if name == chosen and name != within[0]:
            return f"{within[0]!r} won, and fitted on all pairs its map is this one"
        if gap > k * se[name]:
            return f"{gap:+.4f} from the best {best!r}, beyond {k:g} SE ({k * se[name]:.4f})"
        if name not in level:
            return (
                f"signed coverage area {signed[name] - signed[best]:+.4f} beyond the best "
                f"{best!r}'s, more than {k:g} SE ({k * signed_se[name]:.4f})"
            )
        loss = nll[name] - nll[sharpest]
        if name == chosen:
            calibrated = (
                "lowest held-out calibration error"
                if name == best
                else f"within {k:g} SE of the best {best!r} ({gap:+.4f})"
            )
            if len(level) == 1:
                return calibrated
            if name == sharpest:
                return f"{calibrated}; the lowest NLL of those"
            return f"{calibrated}; NLL within {k:g} SE of the lowest ({loss:+.4f}), simplest"
        if loss > k * nll_se[name]:
            return (
                f"as calibrated (within {k:g} SE), but NLL {loss:+.4f} over "
                f"{sharpest!r}'s, beyond {k:g} SE ({k * nll_se[name]:.4f})"
            )
        return f"as calibrated and as sharp (within {k:g} SE), but {chosen!r} is simpler"

    nan = float("nan")
    rows = [
        Candidate(
            name,
            scores[name]["calibration_error"],
            scores[name]["max_gap"],
            nll[name],
            name == chosen,
            why(name),
            scores[name].get("marginal_calibration_error", nan),
        )
        for name in names
    ]
    ranked = (
        "mean of the HPD and the marginal error"
        if coordinate_levels is not None
        else "the calibration error"
    )
    note = (
        f"2-fold cross-fit on {levels[best].numel()} held-out pairs; calibration error = "
        f"mean |coverage - level| of the HPD regions, marginal error = that of the "
        f"latent coordinates; ranked by the {ranked}; NLL guard +{nll_tolerance:g} x "
        f"max(1, |NLL|) + {k:g} SE"
    )
    return chosen, Selection(rows, scores, note)
