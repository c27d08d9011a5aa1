"""TARP expected-coverage figure: coverage vs credibility level with the test's band."""

from __future__ import annotations

from matplotlib.figure import Figure

from calib_lightning.functional.tarp import TARPResult
from calib_lightning.plots._format import format_p_value

__all__ = ["plot_tarp"]


def plot_tarp(
    result: TARPResult,
    *,
    title: str | None = "TARP expected coverage",
    figsize: tuple[float, float] = (4.8, 4.4),
) -> Figure:
    r"""Expected coverage probability against credibility level, with the null band.

    The grey band is the simultaneous band of the TARP test: under calibration the
    whole curve stays inside it with probability ``1 - level``, and the test rejects
    exactly when the curve leaves it (up to the Monte Carlo error of the band). Read the
    curve on its right half, credibility :math:`c > 1/2`, where the shaded area between
    the curve and the diagonal is ``coverage_error`` (the ATC): above the diagonal the posterior is
    conservative (under-confident, too wide), below it is over-confident (too narrow),
    as for every coverage curve of the package (``Reading the sign`` in
    :mod:`calib_lightning.functional.sbc`). The left half mirrors the right one
    (random references see a dispersion error like a marginal rank does: an S-shaped
    curve), so it is left unshaded and a note on the figure says so.

    Arguments:
        result: the :class:`~calib_lightning.functional.tarp.TARPResult` of
            :func:`calib_lightning.functional.tarp`,
            :func:`~calib_lightning.functional.tarp_test` or ``TARP.compute()``, one
            curve: ``coverage`` of shape ``(A,)`` like ``credibility``.
        title: figure title (``None``: none).
        figsize: figure size in inches.

    Returns:
        A :class:`matplotlib.figure.Figure` (never shown; log it or save it).
    """
    if not isinstance(result, TARPResult):
        raise ValueError(f"result must be a TARPResult, got {type(result).__name__}")
    c = result.credibility.detach().double().cpu()
    coverage = result.coverage.detach().double().cpu()
    if coverage.shape != c.shape or result.band.numel() != 1:
        raise ValueError(
            f"result.coverage must be one curve of shape {tuple(c.shape)} like "
            f"credibility, got {tuple(coverage.shape)} (plot batched results one at a time)"
        )
    band = float(result.band)
    fig = Figure(figsize=figsize)
    ax = fig.add_subplot(1, 1, 1)
    level = float(result.level)
    ax.fill_between(
        c,
        (c - band).clamp(0, 1),
        (c + band).clamp(0, 1),
        color="0.85",
        label=f"calibrated: {1 - level:.0%} of curves inside",
    )
    ax.plot([0, 1], [0, 1], color="0.3", ls="--", lw=1)
    upper = c >= 0.5
    ax.fill_between(
        c[upper],
        c[upper],
        coverage[upper],
        where=coverage[upper] >= c[upper],
        color="tab:blue",
        alpha=0.25,
        lw=0,
        label="conservative (too wide)",
    )
    ax.fill_between(
        c[upper],
        c[upper],
        coverage[upper],
        where=coverage[upper] < c[upper],
        color="tab:red",
        alpha=0.25,
        lw=0,
        label="over-confident (too narrow)",
    )
    ax.plot(c, coverage, color="black", lw=1.6, label="expected coverage")
    summary = [
        format_p_value(result.p_value, digits=3, name="TARP p"),
        f"coverage error = {float(result.coverage_error):+.3f}",
    ]
    ax.text(0.03, 0.97, ", ".join(summary), transform=ax.transAxes, va="top", fontsize=9)
    ax.text(
        0.03,
        0.89,
        "read c > 1/2: above = too wide,\nbelow = over-confident;\nc < 1/2 mirrors it",
        transform=ax.transAxes,
        va="top",
        fontsize=7,
        color="0.3",
    )
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.set_aspect("equal")
    ax.set_xlabel("credibility level c")
    ax.set_ylabel("expected coverage")
    ax.legend(loc="lower right", fontsize=7, frameon=False)
    if title:
        ax.set_title(title)
    fig.tight_layout()
    return fig
