"""Lightning callback running sampling-free latent calibration while a flow trains."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from matplotlib.figure import Figure
from matplotlib.text import Text
from torch import Tensor

from calib_lightning.callbacks.base import CalibrationCallback
from calib_lightning.metrics.latent import LatentCalibration, LatentCalibrationResult
from calib_lightning.plots.ranks import (
    plot_expected_coverage,
    plot_rank_ecdf,
    plot_rank_histograms,
)

__all__ = ["LatentCalibrationCallback"]

# The rank figures name the joint rank and its regions after the energy / HPD regions;
# here the joint value is the latent radius and the regions are latent balls.
_RELABEL = (
    ("Joint energy rank", "Joint: latent radius c = F_χ²(|z*|²)"),
    ("joint (energy)", "joint (radius)"),
    ("Expected coverage (energy rank)", "Expected coverage (latent balls)"),
    ("credibility level of the HPD region", "credibility level of the latent-ball region"),
    ("rank of the truth / (M + 1)", "Φ(z*) or c, in cells"),
    ("t (fractional rank)", "t (uniform value)"),
    ("Rank histograms", "Latent histograms"),
    ("truth less probable than the posterior's own draws", "truth further out than claimed"),
    ("truth less probable than the draws", "truth further out than claimed"),
    ("Joint (energy)", "Joint (radius)"),
    (
        "Marginal ranks, one curve per dimension",
        "Marginal: Φ(z*_d), one curve per latent coordinate",
    ),
)
MAX_COORDINATES = 6
"""Latent coordinates drawn by default: all up to this many, else the ones with the
smallest ECDF p-values (where the check fails)."""

# result fields with one entry per latent coordinate, and with the joint one after them
_PER_COORDINATE = ("marginal_p_values", "marginal_statistics", "latent_mean", "latent_std")
_PER_ROW = ("ecdf_p_values", "outside_band")
_PER_ROW_CURVE = ("histogram", "ecdf")


def _relabel(figure: Figure, extra: tuple[tuple[str, str], ...] = ()) -> Figure:
    """Replace the rank wording of a rank figure's texts by the latent one."""
    for text in figure.findobj(Text):
        value = text.get_text()
        for old, new in (*_RELABEL, *extra):
            value = value.replace(old, new)
        text.set_text(value)
    return figure


def select_coordinates(
    result: LatentCalibrationResult, coordinates: Sequence[int]
) -> LatentCalibrationResult:
    """The result restricted to some latent coordinates (and the joint row), for figures;
    ``global_p_value`` and the joint fields are unchanged (they cover all ``D``)."""
    index = torch.as_tensor(list(coordinates), dtype=torch.long)
    rows = torch.cat([index, torch.tensor([result.histogram.shape[-2] - 1])])
    changes = {name: getattr(result, name)[..., index] for name in _PER_COORDINATE}
    changes.update({name: getattr(result, name)[..., rows] for name in _PER_ROW})
    changes.update({name: getattr(result, name)[..., rows, :] for name in _PER_ROW_CURVE})
    return dataclasses.replace(result, **changes)


class LatentCalibrationCallback(CalibrationCallback):
    r"""Latent calibration every ``every_n_epochs`` epochs: one inverse pass, no sampling.

    Logs, under ``{prefix}/latent/``, the ``logged`` fields of
    :class:`~calib_lightning.functional.latent.LatentCalibrationResult`:
    ``global_p_value`` (the verdict: every test combined; small = miscalibrated
    somewhere), ``p_value`` (uniformity of the latent radius' credibility
    :math:`c = F_{\chi^2_D}(|z^*|^2)`), ``coverage_error`` (signed area of the coverage
    curve of the flow's latent-ball credible regions: **negative = over-confident**,
    positive = under-confident), ``marginal_p_values/<d>`` and ``ecdf_p_values/<d>``
    per latent coordinate (the last ``ecdf_p_values`` entry is the joint one). Figures:
    ``ecdf``, ``histograms``, ``expected_coverage`` (the rank figures, relabelled for
    latents) and ``history``; histograms ``u/<d>`` and ``u/joint`` of the uniform
    values (cell centres).

    Cheap enough to run every epoch (the cost of one ``log_prob`` pass); pair it with a
    :class:`~calib_lightning.callbacks.RankCalibrationCallback` every few epochs for
    sharpness and HPD ranks, which see some errors this check cannot (a dependence
    between latent coordinates that keeps each coordinate's law and the radius' law).

    Arguments:
        theta: calibration parameters ``(N, D)``.
        x: calibration observations ``(N, *X)``.
        metric: a configured :class:`calib_lightning.LatentCalibration`; default
            ``LatentCalibration(num_dims=D)``.
        labels: names of the ``D`` latent coordinates for the figures (default
            ``z1, ..., zD``: for a flow they are not the parameters).
        coordinates: indices of the latent coordinates the figures draw (the joint row
            is always drawn); default: all when ``D <= 6``, else the 6 with the smallest
            ECDF p-values. Logged scalars always cover every coordinate.
        **kwargs: :class:`~calib_lightning.callbacks.CalibrationCallback` arguments.

    Example:
        >>> from calib_lightning.tasks import TwoMoons
        >>> theta, x = TwoMoons().sample(256, torch.Generator().manual_seed(0))
        >>> callback = LatentCalibrationCallback(theta, x)
        >>> callback.metric.num_cells, callback.metric.num_dims
        (1000, 2)
    """

    name: ClassVar[str] = "latent"
    history_keys: ClassVar[tuple[str, ...]] = ("global_p_value", "p_value", "coverage_error")
    history_titles: ClassVar[dict[str, str]] = {
        "global_p_value": "all latent tests combined (verdict)",
        "p_value": "latent radius: chi-square",
        "coverage_error": "latent-ball coverage error",
    }
    metric_type: ClassVar[type] = LatentCalibration
    needs: ClassVar[tuple[str, ...]] = ("to_latent",)

    def __init__(
        self,
        theta: Tensor | None = None,
        x: Tensor | None = None,
        *,
        metric: LatentCalibration | None = None,
        labels: list[str] | None = None,
        coordinates: Sequence[int] | None = None,
        **kwargs: Any,
    ) -> None:
        if metric is None:
            num_dims = theta.shape[-1] if isinstance(theta, Tensor) and theta.ndim == 2 else None
            metric = LatentCalibration(num_dims=num_dims)
        if coordinates is not None:
            coordinates = [int(i) for i in coordinates]
            if not coordinates or min(coordinates) < 0 or len(set(coordinates)) < len(coordinates):
                raise ValueError(
                    f"coordinates must be distinct non-negative indices, got {coordinates}"
                )
        super().__init__(metric, theta, x, **kwargs)
        self.labels, self.coordinates = labels, coordinates

    def figures(self, result: LatentCalibrationResult) -> dict[str, Figure]:
        figures = super().figures(result)
        d = result.histogram.shape[0] - 1
        labels = self.labels if self.labels is not None else [f"z{i + 1}" for i in range(d)]
        if len(labels) != d:
            raise ValueError(f"labels must name the D = {d} latent coordinates, got {len(labels)}")
        shown = self.coordinates
        if shown is None:
            order = torch.argsort(result.ecdf_p_values[:d], stable=True)
            shown = sorted(order[:MAX_COORDINATES].tolist())
        elif max(shown) >= d:
            raise ValueError(f"coordinates must lie in 0..D-1 = 0..{d - 1}, got {shown}")
        extra: tuple[tuple[str, str], ...] = ()
        if len(shown) < d:
            result = select_coordinates(result, shown)
            which = "chosen" if self.coordinates is not None else "smallest ECDF p-values"
            extra = (
                (
                    "one curve per latent coordinate",
                    f"{len(shown)} of {d} latent coordinates ({which})",
                ),
                (
                    "Latent histograms (",
                    f"Latent histograms of {len(shown)} of {d} coordinates ({which}; "
                    "judge by the global p-value) and the radius (",
                ),
            )
        names = [labels[i] for i in shown]
        figures["ecdf"] = _relabel(plot_rank_ecdf(result, labels=names), extra)
        figures["histograms"] = _relabel(plot_rank_histograms(result, labels=names), extra)
        figures["expected_coverage"] = _relabel(plot_expected_coverage(result))
        return figures

    def histograms(self, result: LatentCalibrationResult) -> dict[str, Tensor]:
        """Uniform values at their cell centres, from the counts (``D`` coordinates, then
        the joint ``c``)."""
        counts = result.histogram
        k = counts.shape[1]
        centres = (torch.arange(k, dtype=torch.float32) + 0.5) / k
        names = [str(d) for d in range(counts.shape[0] - 1)] + ["joint"]
        return {
            f"u/{name}": centres.repeat_interleave(row.to(torch.long))
            for name, row in zip(names, counts, strict=True)
        }
