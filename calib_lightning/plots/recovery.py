r"""Figures of parameter recovery: posterior mean against truth, z-score against contraction.

Both take a :class:`~calib_lightning.functional.recovery.Recovery` (or the tensors
``(samples, theta)`` / ``(samples, theta, prior_variance)`` to compute one) and draw one
panel per parameter, in a grid of at most ``max_columns`` columns, so that ``D = 50``
parameters stay a bounded figure; ``parameters=`` picks the ones to draw.

* :func:`plot_recovery`: posterior mean (with one posterior standard deviation as an
  error bar) against the truth; on the diagonal = recovered, :math:`R^2` in each title;
* :func:`plot_z_score_contraction`: posterior z-score against posterior contraction;
  errors of the posterior means that match the posterior widths give a cloud of
  standard deviation about 1 around 0 (95% inside the band :math:`|z| \le 2` for a
  Gaussian posterior), sharp = far right. A calibrated posterior gives such a cloud,
  but so can a miscalibrated one of the wrong shape: the rank tests judge calibration.

Directions read as in :mod:`calib_lightning.functional.recovery`: z-scores spread
wider than 1 = over-confident (too narrow), narrower = under-confident (too wide);
shifted up = the posterior sits too high, down = too low.

References:
    Schad, Betancourt, Vehtari. "Toward a principled Bayesian workflow in cognitive
    science." Psychological Methods 26(1), 2021. Radev et al. "BayesFlow: Amortized
    Bayesian workflows with neural networks." JOSS 8(89), 2023.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator
from torch import Tensor

from calib_lightning._utils.validation import check_probability
from calib_lightning.functional.recovery import Recovery, calibrated_z_score_std, recovery
from calib_lightning.plots._format import format_p_value
from calib_lightning.plots._grid import (
    MAX_COLUMNS,
    MAX_ROWS,
    heading_and_note,
    outer_labels,
    panel_grid,
)
from calib_lightning.plots._grid import select_parameters as _select_all

__all__ = ["KAPPA_CAP", "Z_CAP", "plot_recovery", "plot_z_score_contraction"]

_NOTE_SIZE = 8.0
_POINT_COLOR = "tab:blue"
_CLIP_COLOR = "tab:red"


def _as_recovery(result_or_tensors: Recovery | Sequence[Tensor]) -> Recovery:
    if isinstance(result_or_tensors, Recovery):
        return result_or_tensors
    if isinstance(result_or_tensors, Sequence) and 2 <= len(result_or_tensors) <= 3:
        return recovery(*result_or_tensors)
    raise ValueError(
        "result_or_tensors must be a Recovery or a tuple (samples (S, N, D), theta (N, D)"
        f"[, prior_variance (D,)]), got {type(result_or_tensors).__name__}"
    )


def _select(
    d: int, parameters: Sequence[int] | None, labels: Sequence[str] | None
) -> tuple[list[int], list[str], str]:
    """The parameters to draw; by default all, or the first ``MAX_COLUMNS * MAX_ROWS``
    (then the third value says so, for the title)."""
    most = MAX_COLUMNS * MAX_ROWS
    if parameters is None and d > most:
        chosen, names = _select_all(d, range(most), labels)
        return chosen, names, f", first {most} of D = {d} parameters (parameters= picks)"
    chosen, names = _select_all(d, parameters, labels)
    return chosen, names, ""


def _shown_pairs(n: int, max_points: int | None) -> Tensor:
    if max_points is None or n <= max_points:
        return torch.arange(n)
    return torch.linspace(0, n - 1, max_points).round().long()


def _offset(lo: float, hi: float) -> float:
    """0, or a round number near the middle of ``[lo, hi]`` when the range is narrow next
    to its distance from 0 (tick labels would need many digits)."""
    span, middle = hi - lo, (hi + lo) / 2
    if abs(middle) < 1e3 * max(span, 1e-300):
        return 0.0
    step = (
        10.0 ** math.floor(math.log10(span))
        if span > 0
        else 10.0 ** math.floor(math.log10(abs(middle)))
    )
    return round(middle / step) * step


def plot_recovery(
    result_or_tensors: Recovery | Sequence[Tensor],
    labels: Sequence[str] | None = None,
    parameters: Sequence[int] | None = None,
    max_columns: int = 6,
    *,
    max_points: int | None = 500,
    panel_size: tuple[float, float] = (2.5, 2.5),
) -> Figure:
    r"""Posterior mean against the truth, one panel per parameter, with :math:`R^2`.

    Each point is a calibration pair: the truth :math:`\theta^*_{ia}` on x, the
    posterior mean :math:`\mu_{ia}` on y, with a bar of :math:`\pm \sigma_{ia}` (one
    posterior standard deviation). Points on the dashed diagonal = recovered; a flat
    cloud at the truths' mean = the posterior learned nothing about the parameter
    (:math:`R^2 \approx 0`). The title gives
    :math:`R^2 = 1 - \mathrm{SSE}/\mathrm{SST}` over all ``N`` pairs.

    Arguments:
        result_or_tensors: a :class:`~calib_lightning.functional.recovery.Recovery`, or
            ``(samples (S, N, D), theta (N, D)[, prior_variance (D,)])``.
        labels: names of all ``D`` parameters (default ``θ1 .. θD``).
        parameters: indices of the parameters to draw, in order (default all, at most
            the first 60: ten rows of six).
        max_columns: panels per row; more parameters wrap into rows.
        max_points: pairs drawn per panel (evenly spaced; ``None`` for all); the
            :math:`R^2` uses every pair.
        panel_size: inches per panel.

    Returns:
        The figure (never shown; log it or save it).

    Example:
        >>> theta = torch.linspace(-1, 1, 20)[:, None].repeat(1, 3)
        >>> g = torch.Generator().manual_seed(0)
        >>> samples = theta + 0.1 * torch.randn(50, 20, 3, generator=g)
        >>> fig = plot_recovery((samples, theta), labels=["a", "b", "c"], parameters=[2, 0])
        >>> [ax.get_title().split()[0] for ax in fig.axes]
        ['c', 'a']
    """
    out = _as_recovery(result_or_tensors)
    n, d = out.theta.shape
    chosen, names, shown_note = _select(d, parameters, labels)
    shown = _shown_pairs(n, max_points)
    fig, axes = panel_grid(len(chosen), panel_size, max_columns=max_columns)
    truth, mean, std = (
        t.detach().cpu()[shown] for t in (out.theta, out.posterior_mean, out.posterior_std)
    )
    for ax, a, name in zip(axes, chosen, names, strict=True):
        x, y, s = truth[:, a].numpy(), mean[:, a].numpy(), std[:, a].numpy()
        lo, hi = min(x.min(), y.min()), max(x.max(), y.max())
        shift = _offset(lo, hi)  # far from 0: draw relative to a round number, say so
        x, y, lo, hi = x - shift, y - shift, lo - shift, hi - shift
        pad = 0.06 * (hi - lo) if hi > lo else 1.0
        lo, hi = lo - pad, hi + pad
        if shift:
            ax.text(
                0.03,
                0.97,
                f"both axes − {shift:g}",
                transform=ax.transAxes,
                va="top",
                fontsize=7,
                color="0.3",
            )
        ax.ticklabel_format(useOffset=False)
        ax.vlines(x, y - s, y + s, color=_POINT_COLOR, alpha=0.25, lw=0.8, rasterized=True)
        ax.scatter(x, y, s=5, color=_POINT_COLOR, alpha=0.8, lw=0, rasterized=True)
        ax.plot([lo, hi], [lo, hi], color="0.25", ls="--", lw=0.9)
        ax.set_xlim(lo, hi)
        ax.set_ylim(lo, hi)
        ax.set_aspect("equal", adjustable="box")
        ax.set_title(f"{name}   R² = {float(out.r_squared[a]):.3f}", fontsize=_NOTE_SIZE + 1)
        ax.grid(alpha=0.25)
    outer_labels(axes, max_columns, "truth", "posterior mean", fontsize=_NOTE_SIZE)
    count = f"N = {n} pairs" + (f", {len(shown)} shown" if len(shown) < n else "")
    heading_and_note(
        fig,
        f"Parameter recovery ({count}{shown_note})",
        "Posterior mean ± 1 posterior sd against the truth. On the dashed diagonal = "
        "recovered; a flat cloud = no better than the prior. "
        "R²\u00a0=\u00a01\u00a0−\u00a0SSE/SST: 1 perfect, 0 no better than the truths' mean.",
    )
    return fig


def _clip_limits(
    values: Tensor, low_default: float, high_default: float, cap: float
) -> tuple[float, float]:
    """Axis limits reaching every value with a 5 % margin, at least ``low_default`` to
    ``high_default``, at most ``-cap`` to ``cap``."""
    lo, hi = float(values.min()), float(values.max())
    pad = 0.05 * max(hi - lo, 1e-12)
    return max(min(low_default, lo - pad), -cap), min(max(high_default, hi + pad), cap)


def _minus(value: float) -> str:
    return f"{value:.3g}".replace("-", "−")  # the axes' minus sign


def _mark_clipped(ax: Axes, z: Tensor, kappa: Tensor, z_lim: float, k_lo: float) -> int:
    """Write beside each edge of ``ax`` how many pairs lie beyond it and how far the
    furthest goes; returns how many pairs lie beyond the axes."""
    box = {"facecolor": "white", "alpha": 0.8, "lw": 0, "pad": 1}
    above, below, left = (z > z_lim), (z < -z_lim), (kappa < k_lo)
    for pick, text, where in (
        (
            above,
            f"▲ {int(above.sum())} with z > {_minus(z_lim)}, max {_minus(float(z.max()))}",
            {"xy": (0.98, 0.97), "ha": "right", "va": "top"},
        ),
        (
            below,
            f"▼ {int(below.sum())} with z < {_minus(-z_lim)}, min {_minus(float(z.min()))}",
            {"xy": (0.98, 0.03), "ha": "right", "va": "bottom"},
        ),
        (
            left,
            f"{int(left.sum())} with κ < {_minus(k_lo)}, min {_minus(float(kappa.min()))}",
            {"xy": (0.03, 0.5), "ha": "left", "va": "center", "rotation": 90},
        ),
    ):
        if bool(pick.any()):
            ax.annotate(
                text, xycoords="axes fraction", fontsize=6.5, color=_CLIP_COLOR, bbox=box, **where
            )
    return int((above | below | left).sum())


def _tests_line(calibration_tests: Mapping[str, float], level: float) -> str:
    """One sentence on the calibration tests drawn beside the figure."""
    rejected = [
        f"{name}, {format_p_value(p, 2)}" for name, p in calibration_tests.items() if p < level
    ]
    kept = [
        f"{name}, {format_p_value(p, 2)}" for name, p in calibration_tests.items() if not p < level
    ]
    if rejected:
        line = (
            f"Calibration is rejected at level {level:g} by {'; '.join(rejected)}, "
            "whatever the z-scores' mean and sd."
        )
        return line + (f" Not rejected by {'; '.join(kept)}." if kept else "")
    return f"Calibration is not rejected at level {level:g} by {'; '.join(kept)}."


#: z-scores beyond ``±Z_CAP`` and contractions below ``-KAPPA_CAP`` sit on the axes' edges
Z_CAP, KAPPA_CAP = 12.0, 4.0


def plot_z_score_contraction(
    result_or_tensors: Recovery | Sequence[Tensor],
    labels: Sequence[str] | None = None,
    parameters: Sequence[int] | None = None,
    max_columns: int = 6,
    *,
    max_points: int | None = 2000,
    panel_size: tuple[float, float] = (2.5, 2.3),
    calibration_tests: Mapping[str, float] | None = None,
    level: float = 0.05,
) -> Figure:
    r"""Posterior z-score against posterior contraction, one panel per parameter.

    Each point is a calibration pair: :math:`\kappa = 1 - \sigma^2 /
    \mathrm{Var}_{\mathrm{prior}}` on x, :math:`z = (\mu - \theta^*) / \sigma` on y
    (grey band :math:`|z| \le 2`, dotted lines at :math:`\pm 3`). Right = sharp (the
    data pin the parameter down), left = no narrower than the prior.

    What the z-scores measure: their standard deviation compares the errors of the
    posterior means with the posterior widths, on average over the pairs (about 1,
    :func:`~calib_lightning.functional.recovery.calibrated_z_score_std` with ``S``
    draws, when they match; wider = over-confident, narrower = under-confident), their
    mean whether the posterior sits too high (> 0) or too low. Both hold for a
    calibrated posterior, but not the other way round: a posterior whose shape is wrong
    (two modes, heavy tails) can have z-scores of mean 0 and sd 1, so the figure never
    says "calibrated"; with ``calibration_tests`` the note says which tests reject. Each
    title gives the mean and standard deviation of the z-scores and the mean
    contraction over all ``N`` pairs.

    The axes reach every pair (at least :math:`|z| \le 4` and :math:`\kappa \ge -0.05`)
    up to :math:`|z| \le` :data:`Z_CAP` and :math:`\kappa \ge -` :data:`KAPPA_CAP`;
    pairs beyond are drawn on the edge as red triangles pointing outwards, and a red
    note beside that edge says how many there are and how far the furthest goes.

    Arguments:
        result_or_tensors: a :class:`~calib_lightning.functional.recovery.Recovery`, or
            ``(samples (S, N, D), theta (N, D)[, prior_variance (D,)])``.
        labels: names of all ``D`` parameters (default ``θ1 .. θD``).
        parameters: indices of the parameters to draw, in order (default all, at most
            the first 60: ten rows of six).
        max_columns: panels per row; more parameters wrap into rows.
        max_points: pairs drawn per panel (evenly spaced; ``None`` for all); the
            summaries and the counts of pairs beyond the axes use every pair.
        panel_size: inches per panel.
        calibration_tests: name -> p-value of the calibration tests shown beside the
            figure (e.g. ``{"the rank tests": global_p_value}``); the note says which
            reject at ``level``.
        level: test level for ``calibration_tests``.

    Returns:
        The figure (never shown; log it or save it).

    Example:
        >>> theta = torch.linspace(-1, 1, 20)[:, None].repeat(1, 2)
        >>> g = torch.Generator().manual_seed(0)
        >>> samples = theta + 0.1 * torch.randn(50, 20, 2, generator=g)
        >>> fig = plot_z_score_contraction((samples, theta))
        >>> [ax.get_xlabel() for ax in fig.axes]
        ['posterior contraction', 'posterior contraction']
    """
    out = _as_recovery(result_or_tensors)
    check_probability("level", level)
    n, d = out.theta.shape
    chosen, names, shown_note = _select(d, parameters, labels)
    shown = _shown_pairs(n, max_points)
    fig, axes = panel_grid(len(chosen), panel_size, max_columns=max_columns)
    z_all, kappa_all = out.z_scores.detach().cpu(), out.contractions.detach().cpu()
    any_clipped = False
    for ax, a, name in zip(axes, chosen, names, strict=True):
        z, kappa = z_all[shown, a], kappa_all[shown, a]
        z_lo, z_hi = _clip_limits(z_all[:, a], -4.0, 4.0, Z_CAP)
        z_lim = max(-z_lo, z_hi)  # symmetric: 0 in the middle
        k_lo, _ = _clip_limits(kappa_all[:, a], -0.05, 1.0, KAPPA_CAP)
        ax.axhspan(-2, 2, color="0.88", lw=0)
        for line in (-3, 3):
            ax.axhline(line, color="0.45", ls=":", lw=0.8)
        ax.axhline(0, color="0.3", lw=0.6)
        inside = (z.abs() <= z_lim) & (kappa >= k_lo)
        ax.scatter(
            kappa[inside], z[inside], s=5, color=_POINT_COLOR, alpha=0.5, lw=0, rasterized=True
        )
        for marker, pick in (
            ("^", z > z_lim),
            ("v", z < -z_lim),
            ("<", (kappa < k_lo) & (z.abs() <= z_lim)),
        ):
            if bool(pick.any()):
                ax.scatter(
                    kappa[pick].clamp_min(k_lo),
                    z[pick].clamp(-z_lim, z_lim),
                    s=14,
                    marker=marker,
                    color=_CLIP_COLOR,
                    lw=0,
                    clip_on=False,
                )
        ax.set_xlim(k_lo, 1.05)
        ax.set_ylim(-z_lim, z_lim)
        any_clipped |= _mark_clipped(ax, z_all[:, a], kappa_all[:, a], z_lim, k_lo) > 0
        ax.set_title(
            f"{name}   κ̄ = {float(out.contraction[a]):.2f}\n"
            f"z: mean {float(out.z_score_mean[a]):+.2f}, sd {float(out.z_score_std[a]):.2f}",
            fontsize=_NOTE_SIZE + 0.5,
        )
    outer_labels(
        axes, max_columns, "posterior contraction", "posterior z-score", fontsize=_NOTE_SIZE
    )
    for ax in axes:
        ax.xaxis.set_major_locator(MaxNLocator(5, steps=[1, 2, 2.5, 5, 10]))
        ax.yaxis.set_major_locator(MaxNLocator(5, integer=True, steps=[1, 2, 5, 10]))
    draws_per_pair = out.num_posterior_samples or 0
    reference = calibrated_z_score_std(draws_per_pair) if draws_per_pair >= 4 else 1.0
    draws = f", S = {out.num_posterior_samples} draws" if out.num_posterior_samples else ""
    expected = f"{reference:.2f} with S = {draws_per_pair} draws" if draws_per_pair >= 4 else "1"
    note = (
        "z sd: the posterior means' errors against the posterior widths, on average "
        f"(≈ {expected} when they match; larger: too narrow, over-confident; smaller: too "
        "wide). z mean > 0: posterior too high; < 0: too low. Two modes or heavy tails can "
        "keep sd ≈ 1: this is not a calibration test. Contraction near 1 = sharp, near 0 = "
        "no narrower than the prior."
    )
    if any_clipped:
        note += " Red: pairs beyond the axes, drawn on the edge and counted beside it."
    if calibration_tests:
        note = _tests_line(calibration_tests, level) + "\n" + note
    lines = heading_and_note(
        fig, f"Posterior z-score against contraction (N = {n} pairs{draws}{shown_note})", note
    )
    # room for the note beyond the four lines the grid leaves (0.14 inch a line at 8 pt)
    fig.set_figheight(fig.get_figheight() + 0.14 * max(lines - 4, 0))
    return fig
