"""TARP expected-coverage figure: coverage vs credibility level with the test's band."""

from __future__ import annotations

from collections.abc import Mapping

from matplotlib.figure import Figure
from torch import Tensor

from calib_lightning.plots._format import format_p_value

__all__ = ["plot_tarp"]


def plot_tarp(
    result: Mapping[str, Tensor],
    *,
    title: str | None = "TARP expected coverage",
    figsize: tuple[float, float] = (4.8, 4.4),
) -> Figure:
    r"""Expected coverage probability against credibility level, with the null band.

    The grey band is the simultaneous band of the TARP test: under calibration the
    whole curve stays inside it with probability ``1 - level``, and the test rejects
    exactly when the curve leaves it (up to the Monte Carlo error of the band). Read the
    curve on its right half, :math:`\alpha > 1/2`, where the shaded area between the
    curve and the diagonal is the ATC: above the diagonal the posterior is
    conservative (under-confident, too wide), below it is over-confident (too narrow),
    as for every coverage curve of the package (``Reading the sign`` in
    :mod:`calib_lightning.functional.sbc`). The left half mirrors the right one
    (random references see a dispersion error like a marginal rank does: an S-shaped
    curve), so it is left unshaded and a note on the figure says so.

    Arguments:
        result: the dict returned by :func:`calib_lightning.functional.tarp`,
            :func:`~calib_lightning.functional.tarp_test` or ``TARP.compute()``: keys
            ``alpha``, ``ecp`` (one curve, shape ``(A,)``), ``band``, and optionally
            ``atc``, ``p_value`` and ``level``.
        title: figure title (``None``: none).
        figsize: figure size in inches.

    Returns:
        A :class:`matplotlib.figure.Figure` (never shown; log it or save it).
    """
    for key in ("alpha", "ecp", "band"):
        if key not in result:
            raise ValueError(f"result must contain {key!r}, got keys {sorted(result)}")
    alpha = result["alpha"].detach().double().cpu()
    ecp = result["ecp"].detach().double().cpu()
    if ecp.shape != alpha.shape or result["band"].numel() != 1:
        raise ValueError(
            f"result['ecp'] must be one curve of shape {tuple(alpha.shape)} like alpha, "
            f"got {tuple(ecp.shape)} (plot batched results one at a time)"
        )
    band = float(result["band"])
    fig = Figure(figsize=figsize)
    ax = fig.add_subplot(1, 1, 1)
    level = float(result.get("level", 0.05))
    ax.fill_between(alpha, (alpha - band).clamp(0, 1), (alpha + band).clamp(0, 1),
                    color="0.85", label=f"calibrated: {1 - level:.0%} of curves inside")
    ax.plot([0, 1], [0, 1], color="0.3", ls="--", lw=1)
    upper = alpha >= 0.5
    ax.fill_between(alpha[upper], alpha[upper], ecp[upper], where=ecp[upper] >= alpha[upper],
                    color="tab:blue", alpha=0.25, lw=0, label="conservative (too wide)")
    ax.fill_between(alpha[upper], alpha[upper], ecp[upper], where=ecp[upper] < alpha[upper],
                    color="tab:red", alpha=0.25, lw=0, label="over-confident (too narrow)")
    ax.plot(alpha, ecp, color="black", lw=1.6, label="expected coverage")
    summary = []
    if "p_value" in result:
        summary.append(format_p_value(result["p_value"], digits=3))
    if "atc" in result:
        summary.append(f"ATC = {float(result['atc']):+.3f}")
    if summary:
        ax.text(0.03, 0.97, ", ".join(summary), transform=ax.transAxes, va="top", fontsize=9)
    ax.text(0.03, 0.89, "read α > 1/2: above = too wide,\nbelow = over-confident;\n"
            "α < 1/2 mirrors it", transform=ax.transAxes, va="top", fontsize=7,
            color="0.3")  # fmt: skip
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.set_aspect("equal")
    ax.set_xlabel(r"credibility level $\alpha$")
    ax.set_ylabel("expected coverage")
    ax.legend(loc="lower right", fontsize=7, frameon=False)
    if title:
        ax.set_title(title)
    fig.tight_layout()
    return fig
