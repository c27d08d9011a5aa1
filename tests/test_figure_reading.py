"""Figures that a reader used to misread, read the way they are meant.

What must hold: the z-score/contraction figure never prints "Calibrated" (z-scores of
mean 0 and sd 1 come from miscalibrated posteriors too) and says which calibration
test rejects where it is drawn beside one (callback and report); it draws every pair or
says how many lie beyond its axes and where; a p-value history keeps the level line
readable however small the p-values; a probability map draws the posterior's shape,
tells "no draws here" apart from "consistent" and labels its crosshair.
"""

import math
import re

import numpy as np
import pytest
import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.collections import PathCollection, QuadMesh
from matplotlib.contour import ContourSet
from matplotlib.text import Text
from torch.distributions import Independent, Normal

import calib_lightning as cl
from calib_lightning.callbacks import RankCalibrationCallback
from calib_lightning.functional.recovery import recovery
from calib_lightning.plots import plot_probability_map, plot_z_score_contraction
from calib_lightning.plots.lc2st import HPD_MASSES
from calib_lightning.plots.recovery import KAPPA_CAP, Z_CAP


def _texts(fig):
    """Every text of the figure, wrapped lines joined."""
    return [t.get_text().replace("\n", " ") for t in fig.findobj(Text)]


def _unit_normal(x):
    return Independent(Normal(x, torch.ones_like(x)), 1)


def _bimodal_error_pairs(n=1000, seed=0):
    """``q(theta | x) = N(x, I)`` while the truths sit near ``x +- 1``: the z-scores have
    mean 0 and sd 1, yet the ranks pile up at Phi(-1) and Phi(1)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 2, generator=g)
    sign = torch.randint(0, 2, (n, 2), generator=g) * 2 - 1
    theta = x + 0.98 * sign + 0.2 * torch.randn(n, 2, generator=g)  # error sd 1.0
    return theta, x


# -- z-score against contraction ----------------------------------------------------------
def test_z_scores_of_sd_one_beside_a_rejecting_rank_test_are_not_called_calibrated():
    theta, x = _bimodal_error_pairs()
    metric = cl.RankCalibration(num_posterior_samples=100)
    torch.manual_seed(0)
    metric.update(_unit_normal, theta, x)
    result = metric.compute()
    assert float(result.global_p_value) < 1e-10  # the ranks see the two modes
    callback = RankCalibrationCallback(theta, x)
    fig = callback.figures(result)["z_score_contraction"]
    stds = [float(t.split("sd ")[1].split("\n")[0]) for t in (ax.get_title() for ax in fig.axes)]
    assert all(0.9 < sd < 1.1 for sd in stds), stds  # what used to read "Calibrated"
    text = " ".join(_texts(fig))
    assert "Calibrated" not in text
    assert "Calibration is rejected at level 0.05 by the rank tests combined, p = " in text
    assert "not a calibration test" in text


def test_the_reports_z_score_figure_names_the_rejecting_checks(tmp_path):
    theta, x = _bimodal_error_pairs(n=600)
    report = cl.diagnose(_unit_normal, theta, x, checks=("kccsd", "ranks", "recovery"), seed=0)
    rows = {row["check"]: row for row in report.rows()}
    assert rows["ranks"]["verdict"] == "rejected"
    fig = report.figures["recovery_z_score_vs_contraction"]
    text = " ".join(_texts(fig))
    assert "Calibrated" not in text
    assert "rejected at level 0.05 by the rank tests, p = " in text
    captions = re.findall(r"<figcaption>(.*?)</figcaption>", report.save(tmp_path).read_text())
    (caption,) = [c for c in captions if "z-score" in c]
    assert "not a calibration test" in caption
    assert not [c for c in captions if "Calibrated" in c]


def test_a_lone_z_score_figure_never_says_calibrated():
    g = torch.Generator().manual_seed(1)
    theta = torch.randn(300, 2, generator=g)
    samples = theta + torch.randn(100, 300, 2, generator=g)  # exact-like draws
    fig = plot_z_score_contraction((samples, theta))
    text = " ".join(_texts(fig))
    assert "Calibrated" not in text
    assert "Calibration is" not in text  # no test given, none named


def test_every_pair_is_drawn_when_contractions_reach_below_minus_one():
    """Two Moons: bimodal posteriors wider than the prior give contractions below -1,
    which were clipped at -1.05 and drawn as z-triangles."""
    g = torch.Generator().manual_seed(2)
    theta = torch.randn(400, 1, generator=g, dtype=torch.float64)
    width = torch.linspace(0.5, 2.0, 400, dtype=torch.float64)[:, None]  # var up to 4x prior
    samples = theta + width * torch.randn(200, 400, 1, generator=g, dtype=torch.float64)
    out = recovery(samples, theta, torch.ones(1, dtype=torch.float64))
    assert float(out.contractions.min()) < -2.5
    fig = plot_z_score_contraction(out)
    (ax,) = fig.axes
    assert ax.get_xlim()[0] < float(out.contractions.min())
    low, high = ax.get_ylim()
    assert low < float(out.z_scores.min())
    assert float(out.z_scores.max()) < high
    scatters = [c for c in ax.collections if isinstance(c, PathCollection)]
    assert len(scatters) == 1  # the pairs, and no red triangles on the edges
    assert len(scatters[0].get_offsets()) == 400
    assert not ax.texts  # no note of pairs beyond the axes


def test_pairs_beyond_the_axes_are_counted_with_where_they_are():
    g = torch.Generator().manual_seed(3)
    theta = torch.randn(500, 1, generator=g, dtype=torch.float64)
    samples = theta + torch.randn(100, 500, 1, generator=g, dtype=torch.float64)
    theta[:3, 0] -= torch.tensor([40.0, 30.0, -50.0], dtype=torch.float64)  # z +40, +30, -50
    samples[:, 3:5] *= 6.0  # two very wide posteriors: contraction far below -KAPPA_CAP
    out = recovery(samples, theta, torch.ones(1, dtype=torch.float64))
    z, kappa = out.z_scores[:, 0], out.contractions[:, 0]
    assert int((z > Z_CAP).sum()) == 2
    assert int((z < -Z_CAP).sum()) == 1
    assert int((kappa < -KAPPA_CAP).sum()) == 2
    (ax,) = plot_z_score_contraction(out).axes
    notes = [t.get_text() for t in ax.texts]
    assert notes == [f"▲ 2 with z > 12, max {float(z.max()):.3g}",
                     f"▼ 1 with z < −12, min −{-float(z.min()):.3g}",
                     f"2 with κ < −4, min −{-float(kappa.min()):.3g}"]  # fmt: skip
    assert ax.get_ylim() == (-Z_CAP, Z_CAP)
    assert math.isclose(ax.get_xlim()[0], -KAPPA_CAP)


@pytest.mark.parametrize("level", [0.05, 0.01])
def test_the_tests_line_says_which_reject_and_which_do_not(level):
    g = torch.Generator().manual_seed(4)
    theta = torch.randn(50, 1, generator=g)
    samples = theta + torch.randn(20, 50, 1, generator=g)
    fig = plot_z_score_contraction((samples, theta), level=level,
                                   calibration_tests={"KCCSD": 0.03, "TARP": 0.5})  # fmt: skip
    text = " ".join(_texts(fig))
    if level == 0.05:
        assert "rejected at level 0.05 by KCCSD, p = 0.03" in text
        assert "Not rejected by TARP, p = 0.5" in text
    else:
        assert "Calibration is not rejected at level 0.01 by KCCSD, p = 0.03; TARP, p = 0.5" in text


# -- p-value histories ------------------------------------------------------------------
def _axes_height(ax, value):
    """Where ``value`` sits on a log axis, as a share of the axis' height from the bottom."""
    low, high = (math.log10(v) for v in ax.get_ylim())
    return (math.log10(value) - low) / (high - low)


def test_a_history_with_1e_155_keeps_the_level_line_apart_from_a_final_1e_5():
    """The ranks history of the Two Moons demo: 1e-155 at the first check stretched the
    axis over 155 decades, and a final p-value of 1e-5 sat 2 % of the panel below the
    0.05 line, as if touching it."""
    from calib_lightning.plots import plot_history

    values = [4.8e-155, 1e-93, 1e-58, 3e-15, 7e-9, 1e-5]
    fig = plot_history([0, 3, 6, 9, 12, 15], {"global_p_value": values}, level=0.05)
    (ax,) = fig.axes
    gap = _axes_height(ax, 0.05) - _axes_height(ax, 1e-5)
    assert gap > 0.25, gap  # a quarter of the panel, not 2 %
    assert _axes_height(ax, 0.05) < 0.95  # the level line inside the panel, not on its edge
    (floored,) = [line for line in ax.lines if line.get_marker() == "v"]
    assert list(floored.get_xdata()) == [0, 3, 6, 9]  # each below the floor, marked there
    assert {t.get_text() for t in ax.texts} >= {"5e-155", "1e-93", "1e-58", "3e-15"}
    assert 0 < _axes_height(ax, floored.get_ydata()[0]) < 0.3  # the floor: low, inside


# -- probability maps ---------------------------------------------------------------------
def _ring(n=3000, seed=5):
    """Draws on a ring of radius 2: no posterior mass at its centre."""
    g = torch.Generator().manual_seed(seed)
    angle = 2 * math.pi * torch.rand(n, generator=g)
    radius = 2 + 0.15 * torch.randn(n, generator=g)
    return torch.stack([radius * angle.cos(), radius * angle.sin()], -1)


def _pixel(fig, ax, x, y):
    """The RGB colour the rendered figure has at data point ``(x, y)`` of ``ax``."""
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    image = np.asarray(canvas.buffer_rgba())[..., :3]
    px, py = ax.transData.transform((x, y))
    return image[image.shape[0] - round(py), round(px)]


def _map_panel(fig):
    """The 2-D panel of a two-parameter probability map."""
    (ax,) = [ax for ax in fig.axes if ax.get_label() != "<colorbar>"
             and any(isinstance(c, QuadMesh) for c in ax.collections)]
    return ax


def test_a_probability_map_tells_no_mass_from_consistent():
    samples = _ring()
    fig = plot_probability_map(samples, torch.full((samples.shape[0],), 0.5))  # consistent
    ax = _map_panel(fig)
    on_ring, centre = _pixel(fig, ax, 0.0, 2.0), _pixel(fig, ax, 0.05, 0.05)
    assert (on_ring >= 245).all(), on_ring  # d = 0.5: white, consistent
    assert (centre <= 235).all(), centre  # no draws: grey (hatched), never white
    (legend,) = fig.legends
    labels = [t.get_text() for t in legend.get_texts()]
    assert "d ≈ 0.5: consistent" in labels
    assert "fewer than 5 draws: no posterior mass, not tested" in labels


def test_a_probability_map_draws_the_posteriors_highest_density_regions():
    g = torch.Generator().manual_seed(6)
    samples = torch.randn(2000, 2, generator=g, dtype=torch.float64)
    fig = plot_probability_map(samples, torch.full((2000,), 0.5))
    (contours,) = [c for c in _map_panel(fig).collections if isinstance(c, ContourSet)]
    assert len(contours.levels) == len(HPD_MASSES) == 2
    inner, outer = contours.get_paths()[::-1]  # levels ascend: the 90 % region first
    points = samples.numpy()
    # the regions hold their masses of the draws (KDE level sets at the draws' quantiles)
    assert inner.contains_points(points).mean() == pytest.approx(0.5, abs=0.04)
    assert outer.contains_points(points).mean() == pytest.approx(0.9, abs=0.03)
    # for a standard normal, the 50 % region is the disk of radius sqrt(2 ln 2) = 1.18
    radius = np.hypot(*inner.vertices.T)
    assert np.median(radius) == pytest.approx(math.sqrt(2 * math.log(2)), rel=0.1)
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert {"50% HPD region of the draws", "90% HPD region of the draws"} <= set(labels)


def test_a_probability_maps_crosshair_is_the_true_parameter_and_is_named():
    samples = _ring()
    truth = torch.tensor([3.5, -0.5])  # outside the draws' range: the axes reach it
    fig = plot_probability_map(samples, torch.full((samples.shape[0],), 0.5), truth=truth)
    ax = _map_panel(fig)
    low, high = ax.get_xlim()
    assert low < 3.5 < high
    crosshair = [line for line in ax.lines if line.get_linestyle() == "-."]
    horizontal = [float(line.get_ydata()[0]) for line in crosshair
                  if line.get_ydata()[0] == line.get_ydata()[1]]  # fmt: skip
    vertical = [float(line.get_xdata()[0]) for line in crosshair
                if line.get_xdata()[0] == line.get_xdata()[1]]  # fmt: skip
    assert (horizontal, vertical) == ([-0.5], [3.5])
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert "true parameter (generated x_o)" in labels
    # without a truth, no crosshair and nothing in the legend claims one
    fig = plot_probability_map(samples, torch.full((samples.shape[0],), 0.5))
    assert not [line for line in _map_panel(fig).lines if line.get_linestyle() == "-."]
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert "true parameter (generated x_o)" not in labels
