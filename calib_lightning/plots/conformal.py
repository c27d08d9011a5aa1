r"""Figure of a conformal credible region: the calibrated HPD contour against the nominal.

:func:`plot_conformal_region` draws, at one observation :math:`x_o`, the region of a
fitted :class:`~calib_lightning.ConformalRegion` at the calibrated level (solid) and the
posterior's own HPD region at the nominal level (dashed), over the posterior's draws and,
when given, reference samples and the true parameter. For ``D = 2`` the regions are
contours of the credibility map on a grid; for ``D > 2`` the figure shows the draws in two
coordinates, those inside the calibrated region and those inside the nominal one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from matplotlib.figure import Figure
from torch import Tensor

__all__ = ["plot_conformal_region"]

_CALIBRATED, _NOMINAL, _REFERENCE = "C0", "C3", "C1"


def plot_conformal_region(
    region: Any,
    x_o: Tensor,
    *,
    level: float = 0.9,
    reference: Tensor | None = None,
    truth: Tensor | None = None,
    parameters: tuple[int, int] = (0, 1),
    grid_size: int = 200,
    bounds: tuple[tuple[float, float], tuple[float, float]] | None = None,
    num_shown: int = 500,
    labels: Sequence[str] | None = None,
    figsize: tuple[float, float] = (4.2, 4.0),
) -> Figure:
    r"""The calibrated ``level`` region at ``x_o`` beside the nominal HPD region.

    Arguments:
        region: a fitted :class:`~calib_lightning.ConformalRegion`.
        x_o: one observation ``(1, *X)``.
        level: nominal coverage :math:`1 - \alpha`.
        reference: reference posterior samples at ``x_o`` ``(M, D)``, drawn in grey.
        truth: the true parameter ``(D,)``, drawn as a star.
        parameters: the two coordinates shown (``D > 2``).
        grid_size: grid points per axis (``D = 2``).
        bounds: ``((low, high), (low, high))`` of the two axes (a zoom); ``None``: the
            draws' range.
        num_shown: posterior draws shown.
        labels: names of all ``D`` parameters for the axes; ``None``: :math:`\theta_i`.
        figsize: figure size in inches.

    Returns:
        A :class:`matplotlib.figure.Figure` (never shown; log it or save it).
    """
    if not isinstance(x_o, Tensor) or x_o.ndim < 2 or x_o.shape[0] != 1:
        raise ValueError(f"x_o must have shape (1, *X), got {x_o!r:.60}")
    level_hat = float(region.calibrated_level(level, x_o).reshape(-1)[0])
    with torch.no_grad():
        draws = region.posterior.sample(x_o, region.num_posterior_samples)[:, 0]
    d = draws.shape[-1]
    i, j = parameters
    if not (0 <= i < d and 0 <= j < d and i != j):
        raise ValueError(
            f"parameters must be two distinct coordinates below D = {d}, got {parameters}"
        )
    if labels is not None and len(labels) != d:
        raise ValueError(f"labels must name the D = {d} parameters, got {len(labels)} labels")
    fig = Figure(figsize=figsize, layout="constrained")
    ax = fig.add_subplot()
    shown = draws[:num_shown].double().cpu().numpy()
    if reference is not None:
        ref = reference.double().cpu().numpy()
        ax.scatter(
            ref[:num_shown, i],
            ref[:num_shown, j],
            s=3,
            c=_REFERENCE,
            alpha=0.35,
            label="reference",
            rasterized=True,
        )
    if d == 2:
        ax.scatter(
            shown[:, 0],
            shown[:, 1],
            s=2,
            c="0.2",
            alpha=0.25,
            rasterized=True,
            label="posterior draws",
        )
        every = draws.double().cpu().numpy()
        points = np.concatenate([every] + ([] if reference is None else [ref[:, :2]]))
        low, high = np.quantile(points, 0.002, 0), np.quantile(points, 0.998, 0)
        pad = 0.15 * (high - low)  # robust to stray draws; the regions' tails fit
        limits = bounds or [(low[k] - pad[k], high[k] + pad[k]) for k in range(2)]
        axes = [np.linspace(*limits[k], grid_size) for k in range(2)]
        grid = np.stack(np.meshgrid(*axes, indexing="xy"), -1).reshape(-1, 1, 2)
        theta = torch.as_tensor(grid, dtype=draws.dtype, device=draws.device)
        cred = region.credibility(theta, x_o).reshape(grid_size, grid_size).double().cpu()
        for value, color, style in ((level_hat, _CALIBRATED, "-"), (level, _NOMINAL, "--")):
            if value < 1:
                ax.contour(
                    axes[0],
                    axes[1],
                    cred.numpy(),
                    levels=[value],
                    colors=color,
                    linestyles=style,
                    linewidths=1.6,
                )
    else:
        cred = region.credibility(draws[:num_shown, None], x_o)[:, 0].double().cpu().numpy()
        inside = cred < level_hat
        ax.scatter(
            shown[~inside, i], shown[~inside, j], s=3, c="0.2", alpha=0.3, label="draws outside"
        )
        ax.scatter(
            shown[inside, i],
            shown[inside, j],
            s=4,
            c=_CALIBRATED,
            alpha=0.6,
            label=f"calibrated ({level_hat:.3f} HPD): draws inside",
        )
        nominal = cred < level
        ax.scatter(
            shown[nominal, i],
            shown[nominal, j],
            s=14,
            facecolors="none",
            edgecolors=_NOMINAL,
            linewidths=0.5,
            alpha=0.6,
            label=f"nominal ({level:.2f} HPD): draws inside",
        )
    if bounds is not None:
        ax.set_xlim(*bounds[0])
        ax.set_ylim(*bounds[1])
    if truth is not None:
        t = truth.reshape(-1).double().cpu().numpy()
        ax.scatter([t[i]], [t[j]], marker="*", s=120, c="k", zorder=5, label="truth")
    if d == 2:  # the contours' legend entries
        ax.plot([], [], color=_CALIBRATED, label=f"calibrated ({level_hat:.3f} HPD)")
        ax.plot([], [], color=_NOMINAL, ls="--", label=f"nominal ({level:.2f} HPD)")
    ax.legend(loc="best", fontsize=7, framealpha=0.8)  # (where it hides the fewest points)
    ax.set_xlabel(f"$\\theta_{{{i + 1}}}$" if labels is None else labels[i])
    ax.set_ylabel(f"$\\theta_{{{j + 1}}}$" if labels is None else labels[j])
    kind = "local" if region.local else "global"
    ax.set_title(f"{level:.0%} conformal region ({kind})", fontsize=9)
    return fig
