"""Figures and logged scalars at many parameters (D = 1 to 100).

What must hold: every figure of a check stays within about 20 x 30 inches at D = 50
(and the rank figures at D = 100); grids have at most six columns; probability maps draw
a few chosen parameters, never D x D; ``parameters=`` picks the panels and ``labels=``
names them; the worst dimensions are the ones drawn when not all fit; D = 1 draws; the
rank callback logs a summary of its per-parameter scalars beyond six parameters (the
smallest p-value, how many Holm rejects) and every one of them on request.
"""

import io
import math
import re
from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from matplotlib.collections import QuadMesh
from matplotlib.text import Text
from torch.distributions import Independent, Normal

import calib_lightning as cl
from calib_lightning.callbacks import RankCalibrationCallback
from calib_lightning.callbacks.ranks import _holm_rejections, parameter_scalars
from calib_lightning.functional import summarize_ranks, tarp
from calib_lightning.functional.recovery import recovery
from calib_lightning.plots import (
    plot_expected_coverage,
    plot_history,
    plot_pp,
    plot_probability_map,
    plot_rank_ecdf,
    plot_rank_histograms,
    plot_recovery,
    plot_tarp,
    plot_z_score_contraction,
)
from calib_lightning.plots._format import format_p_value
from calib_lightning.plots._grid import MAX_COLUMNS
from calib_lightning.plots.history import HISTORY_FLOOR, axis_floor
from calib_lightning.plots.lc2st import MAX_MAP_PARAMETERS
from calib_lightning.tasks import GaussianToy

MAX_WIDTH, MAX_HEIGHT = 20.0, 30.0  # inches


def _bounded(fig):
    width, height = fig.get_size_inches()
    assert width <= MAX_WIDTH, (width, height)
    assert height <= MAX_HEIGHT, (width, height)


def _panels(fig):
    return [ax for ax in fig.axes if ax.get_visible() and ax.get_label() != "<colorbar>"]


def _columns(fig):
    return len({round(ax.get_position().x0, 3) for ax in _panels(fig)})


def _rank_counts(d, bad=(), num_pairs=400, num_draws=30, seed=0):
    """A rank histogram ``(D + 1, M + 1)``: uniform ranks, and ranks piled at 0 in ``bad``."""
    g = torch.Generator().manual_seed(seed)
    ranks = torch.randint(0, num_draws + 1, (d + 1, num_pairs), generator=g)
    for i in bad:
        ranks[i] = torch.randint(0, num_draws // 4, (num_pairs,), generator=g)
    counts = torch.zeros(d + 1, num_draws + 1, dtype=torch.long)
    return counts.scatter_add_(1, ranks, torch.ones_like(ranks))


def _shifted(toy, shift):
    """The toy's exact posterior, its mean moved by ``shift`` ``(D,)`` posterior sds."""
    std = math.sqrt(toy.weight) * toy.noise_std
    return lambda x: Independent(Normal(toy.weight * x + shift * std, std), 1)


def _lc2st_like(num_obs, grid=50):
    """The fields ``plot_pp`` reads, for ``num_obs`` observations."""
    t = torch.linspace(0, 1, grid, dtype=torch.float64)
    return SimpleNamespace(
        pp_grid=t, pp_ecdf=t.repeat(num_obs, 1), pp_band=torch.stack([t - 0.1, t + 0.1])[
            :, None].repeat(1, num_obs, 1), statistic=torch.zeros(num_obs),
        p_value=torch.full((num_obs,), 0.5), global_p_value=torch.tensor(0.5),
    )  # fmt: skip


# -- bounded at many parameters ------------------------------------------------------
def test_every_figure_is_bounded_at_fifty_parameters():
    d, g = 50, torch.Generator().manual_seed(1)
    ranks = summarize_ranks(_rank_counts(d, bad=(3, 17)))
    theta = torch.randn(60, d, generator=g, dtype=torch.float64)
    samples = theta + 0.5 * torch.randn(40, 60, d, generator=g, dtype=torch.float64)
    moments = recovery(samples, theta)
    history = {f"marginal_p_values/{i}": [0.5, 0.01, 1e-6] for i in range(d)}
    figures = {
        "rank_histograms": plot_rank_histograms(ranks),
        "ecdf": plot_rank_ecdf(ranks),
        "expected_coverage": plot_expected_coverage(ranks),
        "recovery": plot_recovery(moments),
        "z_score_contraction": plot_z_score_contraction(moments),
        "history": plot_history([0, 1, 2], history),
        "tarp": plot_tarp(tarp(samples.float(), theta.float())),
        "pp": plot_pp(_lc2st_like(d)),  # one panel per observation: 50 of them
        "probability_map": plot_probability_map(samples[:, 0], torch.rand(40, generator=g)),
    }
    for name, fig in figures.items():
        _bounded(fig)
        assert _columns(fig) <= MAX_COLUMNS, name
    # before: 153 inches wide (one row of 51 panels); now nine rows of six
    assert len(_panels(figures["rank_histograms"])) == d + 1
    assert _columns(figures["rank_histograms"]) == MAX_COLUMNS
    assert len(_panels(figures["history"])) == d
    # before: a 50 x 50 corner (2,500 panels); now the first four parameters: 4 x 4
    corner = figures["probability_map"]
    assert len(_panels(corner)) == 4 * 4
    assert [ax.get_xlabel() for ax in corner.axes[12:16]] == ["θ1", "θ2", "θ3", "θ4"]
    assert "θ1, θ2, θ3, θ4 of D = 50" in corner._suptitle.get_text()
    figures["rank_histograms"].savefig(io.BytesIO(), format="png", dpi=30)  # draws


def test_rank_figures_stay_bounded_at_a_hundred_parameters_and_draw_the_worst():
    d, bad = 100, (7, 93)
    ranks = summarize_ranks(_rank_counts(d, bad=bad))
    fig = plot_rank_histograms(ranks)
    _bounded(fig)
    titles = [ax.get_title().split()[0] for ax in _panels(fig)]
    assert len(titles) == 60  # ten rows of six: the 59 worst dimensions and the joint
    assert {"θ8", "θ94"} <= set(titles)
    assert titles[-1] == "joint"
    assert "smallest chi-square p-values" in fig._suptitle.get_text()
    shown = [int(t[1:]) - 1 for t in titles[:-1]]
    others = sorted(set(range(d)) - set(shown))
    assert float(ranks.marginal_p_values[shown].max()) <= float(
        ranks.marginal_p_values[others].min()
    )
    ecdf = plot_rank_ecdf(ranks)
    legend = [t.get_text() for t in ecdf.axes[0].get_legend().get_texts()]
    coloured = [t.split(":")[0] for t in legend if t.startswith("θ")]
    assert len(coloured) == 5
    assert {"θ8", "θ94"} <= set(coloured)
    assert any(t.startswith("95 other dimensions") for t in legend)
    assert len(ecdf.axes[0].get_lines()) >= d  # every dimension is drawn, most in grey
    # recovery draws the first 60 of 100 and says so
    g = torch.Generator().manual_seed(2)
    theta = torch.randn(30, d, generator=g)
    fig = plot_recovery((theta + torch.randn(8, 30, d, generator=g), theta))
    _bounded(fig)
    assert len(_panels(fig)) == 60
    assert "first 60 of D = 100" in fig._suptitle.get_text()


def test_probability_map_panels_are_bounded_whatever_the_selection():
    g = torch.Generator().manual_seed(3)
    samples, probabilities = torch.randn(500, 50, generator=g), torch.rand(500, generator=g)
    fig = plot_probability_map(samples, probabilities, parameters=range(MAX_MAP_PARAMETERS))
    assert len(_panels(fig)) == MAX_MAP_PARAMETERS**2
    _bounded(fig)
    with pytest.raises(ValueError, match=r"parameters must hold at most 6 indices .* got 7"):
        plot_probability_map(samples, probabilities, parameters=range(7))
    with pytest.raises(ValueError, match=r"parameters must be a non-empty list .* \[0, 50\)"):
        plot_probability_map(samples, probabilities, parameters=[50])


# -- parameters= and labels= ---------------------------------------------------------
def test_parameters_select_and_labels_name_the_panels():
    d = 8
    names = [f"p{i}" for i in range(d)]
    ranks = summarize_ranks(_rank_counts(d, bad=(5,)))
    fig = plot_rank_histograms(ranks, labels=names, parameters=[5, 1])
    assert [ax.get_title().split()[0] for ax in fig.axes] == ["p5", "p1", "joint"]
    assert fig.axes[0].get_title() == (
        f"p5  chi-square {format_p_value(ranks.marginal_p_values[5])}")
    fig = plot_rank_ecdf(ranks, labels=names, parameters=[2, 6])
    legend = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert [t.split(":")[0] for t in legend if t.startswith("p")] == ["p2", "p6"]
    assert any(t.startswith("6 other dimensions") for t in legend)
    assert "the 2 chosen" in fig.axes[0].get_title()
    fig = plot_rank_ecdf(ranks, labels=names)  # D > 6: the five worst, p5 among them
    assert "p5" in " ".join(t.get_text() for t in fig.axes[0].get_legend().get_texts())

    g = torch.Generator().manual_seed(4)
    samples, probabilities = torch.randn(400, d, generator=g), torch.rand(400, generator=g)
    fig = plot_probability_map(samples, probabilities, labels=names, parameters=[6, 2, 3],
                               truth=torch.zeros(d))  # fmt: skip
    assert [ax.get_xlabel() for ax in fig.axes[6:9]] == ["p6", "p2", "p3"]
    assert [fig.axes[k].get_ylabel() for k in (3, 6)] == ["p2", "p3"]
    theta = torch.randn(30, d, generator=g)
    fig = plot_z_score_contraction((theta + torch.randn(8, 30, d, generator=g), theta),
                                   labels=names, parameters=[7])  # fmt: skip
    assert fig.axes[0].get_title().startswith("p7")

    with pytest.raises(ValueError, match="labels must name all D = 8 parameters, got 2"):
        plot_rank_histograms(ranks, labels=["a", "b"])
    with pytest.raises(ValueError, match=r"parameters must be a non-empty list .* \[0, 8\)"):
        plot_rank_ecdf(ranks, parameters=[8])
    with pytest.raises(ValueError, match="parameters must be a non-empty list"):
        plot_rank_histograms(ranks, parameters=[])
    with pytest.raises(ValueError, match="max_columns must be a positive integer"):
        plot_rank_histograms(ranks, max_columns=0)


def test_small_figures_keep_their_look():
    """Up to six parameters: every ECDF curve in colour, every histogram, balanced rows."""
    ranks = summarize_ranks(_rank_counts(6))
    fig = plot_rank_ecdf(ranks)
    legend = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert len(legend) == 2 + 6
    assert not any("other" in t for t in legend)
    fig = plot_rank_histograms(ranks)
    assert len(_panels(fig)) == 7
    assert _columns(fig) == 4  # 4 + 3, not 6 + 1


def test_one_parameter_draws_every_figure():
    toy = GaussianToy(dim=1)
    theta, x = toy.sample(200, torch.Generator().manual_seed(5))
    metric = cl.RankCalibration(num_posterior_samples=40)
    torch.manual_seed(6)
    metric.update(toy.posterior(), theta, x)
    out = metric.compute()
    g = torch.Generator().manual_seed(7)
    samples = theta + 0.3 * torch.randn(20, 200, 1, generator=g)
    figures = [
        plot_rank_histograms(out, labels=["mass"]), plot_rank_ecdf(out, labels=["mass"]),
        plot_expected_coverage(out), plot_recovery((samples, theta)),
        plot_z_score_contraction((samples, theta), parameters=[0]),
        plot_probability_map(samples[:, 0], torch.rand(20, generator=g), labels=["mass"]),
    ]  # fmt: skip
    assert [ax.get_title().split()[0] for ax in figures[0].axes] == ["mass", "joint"]
    assert figures[5].axes[0].get_xlabel() == "mass"
    for fig in figures:
        _bounded(fig)
        fig.savefig(io.BytesIO(), format="png", dpi=30)


# -- summarized scalars ------------------------------------------------------------------
def test_holm_counts_on_hand_made_p_values():
    p = torch.tensor([0.5, 0.02, 0.01, 0.03], dtype=torch.float64)
    # sorted 0.01 <= 0.05/4 rejects; 0.02 > 0.05/3 stops
    assert int(_holm_rejections(p, 0.05)) == 1
    p = torch.tensor([0.04, 0.001, 0.02, 0.01], dtype=torch.float64)
    assert int(_holm_rejections(p, 0.05)) == 4  # 0.001, 0.01, 0.02, 0.04 <= 0.05/(4, 3, 2, 1)
    assert int(_holm_rejections(torch.tensor([0.2, 0.3]), 0.05)) == 0


def test_rank_callback_summarizes_per_parameter_scalars_at_twenty_parameters():
    d, bad = 20, (4, 11)
    toy = GaussianToy(dim=d)
    theta, x = toy.sample(400, torch.Generator().manual_seed(8))
    shift = torch.zeros(d)
    shift[list(bad)] = 1.0  # one posterior sd off in two parameters
    metric = cl.RankCalibration(num_posterior_samples=50)
    torch.manual_seed(9)
    metric.update(_shifted(toy, shift), theta, x)
    result = metric.compute()

    summary = RankCalibrationCallback(theta, x).scalars(result)  # per_parameter="auto"
    assert set(summary) == {
        "global_p_value", "p_value", "coverage_error", "num_pairs",
        "marginal_p_values/min", "marginal_p_values/num_rejected",
        "ecdf_p_values/min", "ecdf_p_values/num_rejected", "ecdf_p_values/joint",
        "contraction/mean", "contraction/min", "mean_squared_error/mean",
        "mean_squared_error/max",
    }  # fmt: skip
    assert float(summary["marginal_p_values/min"]) == float(result.marginal_p_values.min())
    assert float(summary["marginal_p_values/min"]) < 1e-6
    assert int(summary["marginal_p_values/num_rejected"]) == len(bad)  # exactly the two
    assert int(summary["ecdf_p_values/num_rejected"]) == len(bad)
    assert float(summary["ecdf_p_values/joint"]) == float(result.ecdf_p_values[-1])
    assert float(summary["contraction/mean"]) == pytest.approx(0.8, abs=0.05)
    assert float(summary["contraction/min"]) == float(result.contraction.min())
    assert float(summary["mean_squared_error/max"]) == float(result.mean_squared_error.max())

    every = RankCalibrationCallback(theta, x, per_parameter=True).scalars(result)
    per_parameter = {k for k in every if "/" in k}
    assert per_parameter == {
        f"{key}/{i}" for key in ("marginal_p_values", "contraction", "mean_squared_error")
        for i in range(d)
    } | {f"ecdf_p_values/{i}" for i in range(d + 1)}  # fmt: skip
    assert set(every) - per_parameter == {"global_p_value", "p_value", "coverage_error",
                                          "num_pairs"}  # fmt: skip
    # D <= 6 keeps every tag under "auto"; False summarizes even there
    small = SimpleNamespace(marginal_p_values=torch.tensor([0.01, 0.5]))
    tags = {"marginal_p_values/0": torch.tensor(0.01), "marginal_p_values/1": torch.tensor(0.5)}
    assert parameter_scalars(tags, small, per_parameter="auto", level=0.05) == tags
    assert set(parameter_scalars(tags, small, per_parameter=False, level=0.05)) == {
        "marginal_p_values/min", "marginal_p_values/num_rejected"}
    with pytest.raises(ValueError, match="per_parameter must be True, False or 'auto', got 'all'"):
        RankCalibrationCallback(theta, x, per_parameter="all")
    with pytest.raises(ValueError, match=r"parameters must be a non-empty list .* \[0, 20\)"):
        RankCalibrationCallback(theta, x, parameters=[20])
    with pytest.raises(ValueError, match="labels must name all D = 20 parameters, got 2"):
        RankCalibrationCallback(theta, x, labels=["a", "b"])


def test_rank_callback_at_twenty_parameters_logs_the_summary_and_bounded_figures(tmp_path):
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    d = 20
    toy = GaussianToy(dim=d)

    class Exact(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.dummy = torch.nn.Parameter(torch.zeros(()))
            self.flow = toy.posterior()

        def training_step(self, batch, batch_idx):
            return self.dummy**2

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    theta, x = toy.sample(200, torch.Generator().manual_seed(10))
    names = [f"p{i}" for i in range(d)]
    callback = RankCalibrationCallback(theta, x, labels=names, parameters=[3, 0, 19])
    logger = CSVLogger(tmp_path, name="csv", version=0)
    train = DataLoader(TensorDataset(*toy.sample(32, torch.Generator().manual_seed(11))),
                       batch_size=32)  # fmt: skip
    trainer = L.Trainer(max_epochs=1, logger=logger, callbacks=[callback], accelerator="cpu",
                        enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False)  # fmt: skip
    torch.manual_seed(12)
    trainer.fit(Exact(), train)
    assert "marginal_p_values/min" in callback.history
    assert not any(k.startswith("marginal_p_values/1") for k in callback.history)
    assert callback.history["marginal_p_values/num_rejected"] == [0.0]  # the exact posterior
    assert len(callback.history) == 13
    figures = callback.figures(callback.last_result)
    for fig in figures.values():
        _bounded(fig)
    titles = [ax.get_title().split()[0] for ax in figures["rank_histograms"].axes]
    assert titles == ["p3", "p0", "p19", "joint"]
    assert set(callback.histograms(callback.last_result)) == {
        "rank/3", "rank/0", "rank/19", "rank/joint"}
    pngs = sorted(p.parent.name for p in (tmp_path / "csv").rglob("*.png"))
    assert pngs == sorted(["ecdf", "expected_coverage", "history", "rank_histograms",
                           "recovery", "z_score_contraction"])  # fmt: skip


def test_diagnose_passes_parameters_to_the_report_figures():
    d = 8
    toy = GaussianToy(dim=d)
    theta, x = toy.sample(150, torch.Generator().manual_seed(13))
    names = [f"p{i}" for i in range(d)]
    torch.manual_seed(14)
    report = cl.diagnose(toy.posterior(), theta, x, checks=("ranks", "recovery"),
                         labels=names, parameters=[6, 2], num_posterior_samples=30)  # fmt: skip
    titles = [ax.get_title().split()[0] for ax in report.figures["ranks_rank_histograms"].axes]
    assert titles == ["p6", "p2", "joint"]
    recovered = report.figures["recovery_mean_vs_truth"].axes
    assert [ax.get_title().split()[0] for ax in recovered] == ["p6", "p2"]
    with pytest.raises(ValueError, match=r"parameters must be a non-empty list .* \[0, 8\)"):
        cl.diagnose(toy.posterior(), theta, x, checks=("ranks",), parameters=[9])


# -- what the figures say: reference lines, fixed colours, named tests -----------------
def _reference_line(ax):
    """The dotted horizontal line of a history panel: its height and label."""
    (line,) = [line for line in ax.lines if line.get_linestyle() == ":"]
    assert set(line.get_ydata()) == {line.get_ydata()[0]}
    return float(line.get_ydata()[0]), line.get_label()


def test_history_reference_lines_sit_at_the_calibrated_value():
    history = {
        "oracle_c2st/0": [0.99, 0.9, 0.7],  # a classifier's accuracy: chance is 0.5
        "statistic": [3.0, 1.0, 0.1],
        "coverage_error": [-0.2, -0.1, 0.0],
        "density": [0.2, 0.6, 0.9],
    }
    fig = plot_history([0, 1, 2], history)
    (c2st, statistic, coverage, density) = fig.axes
    assert _reference_line(c2st) == (0.5, "0.5: chance (indistinguishable)")
    assert _reference_line(statistic)[0] == 0.0
    assert _reference_line(coverage)[0] == 0.0
    assert _reference_line(density)[0] == 1.0
    low, high = c2st.get_ylim()  # the line is inside the axes, not on their edge
    assert low < 0.5 < high
    assert "chance" in " ".join(t.get_text() for t in c2st.texts)
    assert "over-" in coverage.get_title()
    # a quantity without a known calibrated value gets no line rather than a wrong one
    fig = plot_history([0, 1, 2], {"contraction/0": [0.1, 0.5, 0.8]})
    assert not [line for line in fig.axes[0].lines if line.get_linestyle() == ":"]


def test_oracle_c2st_history_of_the_lc2st_callback_is_referenced_at_chance():
    from calib_lightning.callbacks import LC2STNFCallback

    toy = GaussianToy(dim=2)
    theta, x = toy.sample(40, torch.Generator().manual_seed(0))
    callback = LC2STNFCallback(theta, x, observations=x[:2], misspecification=False)
    callback.epochs = [0, 1]
    callback.history = {"global_p_value": [1e-3, 0.4], "p_value/0": [1e-3, 0.2],
                        "oracle_c2st/0": [0.9, 0.55]}  # fmt: skip
    fig = callback.figures(_lc2st_like(2))["history"]
    panels = {ax.get_ylabel(): ax for ax in fig.axes}
    assert _reference_line(panels["oracle_c2st/0"])[0] == 0.5
    assert panels["oracle_c2st/0"].get_title() == "oracle C2ST accuracy"
    assert panels["p_value/0"].get_title() == "L-C2ST-NF at one x_o"
    level = [line for line in panels["p_value/0"].lines if line.get_linestyle() == "--"]
    assert [float(line.get_ydata()[0]) for line in level] == [0.05]


def test_history_p_value_axis_stops_at_its_floor_and_writes_the_smaller_values():
    values = [1e-150, 1e-40, 3e-6, 0.2]
    fig = plot_history([0, 1, 2, 3], {"p_value": values})
    (ax,) = fig.axes
    low, high = ax.get_ylim()
    assert 1e-15 < low < HISTORY_FLOOR  # not 1e-150: the level line stays readable
    assert high >= 1.0
    (curve,) = [line for line in ax.lines if line.get_color() == "tab:blue"]
    assert list(curve.get_ydata()) == [HISTORY_FLOOR, HISTORY_FLOOR, 3e-6, 0.2]
    (floored,) = [line for line in ax.lines if line.get_marker() == "v"]
    assert list(floored.get_xdata()) == [0, 1]
    assert [t.get_text() for t in ax.texts] == ["level 0.05", "1e-150", "1e-40"]
    assert "below 1e-10" in fig.get_supxlabel()
    (level,) = [line for line in ax.lines if line.get_linestyle() == "--"]
    assert float(level.get_ydata()[0]) == 0.05
    # above the floor, the axis reaches the smallest p-value, and nothing is floored
    (ax,) = plot_history([0, 1], {"p_value": [3e-9, 0.6]}).axes
    assert ax.get_ylim()[0] < 3e-9
    assert not [line for line in ax.lines if line.get_marker() == "v"]
    # a calibrated run keeps the usual axis (down to 1e-4)
    (ax,) = plot_history([0, 1], {"p_value": [0.3, 0.6]}).axes
    assert 1e-5 < ax.get_ylim()[0] < 1e-4
    # a tiny level keeps its line four decades above the floor
    assert axis_floor(1e-8) == pytest.approx(1e-12)


def _map_colours(fig):
    meshes = [c for ax in fig.axes for c in ax.collections if isinstance(c, QuadMesh)]
    assert meshes
    return {mesh.get_clim() for mesh in meshes}


def test_probability_map_colour_scale_is_the_same_for_any_data():
    g = torch.Generator().manual_seed(5)
    samples = torch.randn(2000, 2, generator=g)
    near_chance = 0.5 + 0.05 * (torch.rand(2000, generator=g) - 0.5)  # epoch k: 0.475-0.525
    far = torch.sigmoid(3 * samples[:, 0])  # epoch k + 1: 0.001-0.999
    colours = [_map_colours(plot_probability_map(samples, p)) for p in (near_chance, far)]
    assert colours[0] == colours[1] == {(0.0, 1.0)}
    fig = plot_probability_map(samples, far)
    (bar,) = [ax for ax in fig.axes if ax.get_label() == "<colorbar>"]
    assert "classifier output" in bar.get_ylabel()
    ticks = " ".join(t.get_text() for t in bar.get_yticklabels())
    for meaning in ("too much mass", "too little mass", "chance"):
        assert meaning in ticks
    narrow = plot_probability_map(samples, far, color_range=0.25)  # fixed too, and says so
    assert _map_colours(narrow) == {(0.25, 0.75)}
    with pytest.raises(ValueError, match=r"color_range must lie in \(0, 0.5\], got 0.7"):
        plot_probability_map(samples, far, color_range=0.7)


_P_TEXT = re.compile(r"\bp [=<]")
_NAMED = re.compile(r"(chi-square|ECDF band|L-C2ST-NF|L-C2ST|TARP|conformal|global) p [=<]")


def _p_value_texts(fig):
    texts = [t.get_text() for t in fig.findobj(Text)]
    return [line for text in texts for line in text.split("\n") if _P_TEXT.search(line)]


def test_every_p_value_in_a_legend_or_title_names_its_test():
    ranks = summarize_ranks(_rank_counts(2, bad=(1,)))
    histograms, ecdf = plot_rank_histograms(ranks), plot_rank_ecdf(ranks)
    # one parameter, two tests, two different p-values: each says which test it is
    title = histograms.axes[1].get_title()
    legend = [t.get_text() for t in ecdf.axes[0].get_legend().get_texts()]
    assert title == f"θ2  chi-square {format_p_value(ranks.marginal_p_values[1])}"
    assert f"θ2: ECDF band {format_p_value(ranks.ecdf_p_values[1])}" in legend
    g = torch.Generator().manual_seed(6)
    theta = torch.randn(60, 2, generator=g)
    samples = theta + 0.5 * torch.randn(40, 60, 2, generator=g)
    x_sim = torch.randn(200, 3, generator=g)
    figures = {
        "rank_histograms": histograms, "ecdf": ecdf,
        "pp": plot_pp(_lc2st_like(3)),
        "tarp": plot_tarp(tarp(samples, theta)),
        "misspecification": cl.plots.plot_misspecification(
            cl.misspecification_test(x_sim[:3] + 4, x_sim)),
    }  # fmt: skip
    for name, fig in figures.items():
        texts = _p_value_texts(fig)
        assert texts, name
        unnamed = [t for t in texts if not _NAMED.search(t)]
        assert not unnamed, (name, unnamed)
    assert "L-C2ST-NF p =" in figures["pp"].axes[0].get_title()
    lc2st = _lc2st_like(1)
    lc2st.samples = torch.zeros(1, 5, 2)  # L-C2ST (not NF) keeps its evaluation draws
    assert "L-C2ST p =" in plot_pp(lc2st).axes[0].get_title()


def test_pp_panels_judged_by_adjusted_p_values_say_so():
    result = _lc2st_like(3)
    result.p_value = torch.tensor([0.01, 0.02, 0.3])  # raw: two below 0.05
    fig = plot_pp(result, adjusted_p_values=[0.03, 0.04, 0.3], level=0.05)
    titles = [ax.get_title() for ax in fig.axes[:3]]
    assert [t.split("\n")[0].endswith(": rejected") for t in titles] == [True, True, False]
    assert all("Holm-adjusted p" in t for t in titles)
    assert "Holm-adjusted" in fig.get_suptitle()
    fig = plot_pp(result, adjusted_p_values=[0.06, 0.06, 0.6], level=0.05)  # none survives
    assert all("not rejected" in ax.get_title() for ax in fig.axes[:3])
    assert "p = 0.01" in fig.axes[0].get_title()  # the raw p stays beside its adjustment
    with pytest.raises(ValueError, match="adjusted_p_values must have one entry"):
        plot_pp(result, adjusted_p_values=[0.1])


def test_rank_figures_name_the_joint_rank_they_draw():
    """A samples-only posterior's joint rank is the distance rank: the figures say so (and
    its regions are central, not HPD); a density's figures say energy and HPD."""
    import calib_lightning as cl
    from calib_lightning.tasks import GaussianToy

    toy = GaussianToy(dim=2)
    theta, x = toy.sample(200, torch.Generator().manual_seed(0))
    exact = toy.posterior()
    samples_only = cl.SamplePosterior(lambda x_, n: exact(x_).sample((n,)))
    for posterior, joint, region in ((exact, "energy", "HPD region"),
                                     (samples_only, "distance", "central region")):
        metric = cl.RankCalibration(num_posterior_samples=20)
        torch.manual_seed(0)
        metric.update(posterior, theta, x)
        result = metric.compute()
        assert result.joint_statistic == joint
        coverage = plot_expected_coverage(result)
        assert f"({joint} rank)" in coverage.axes[0].get_title()
        assert region in coverage.axes[0].get_xlabel()
        ecdf = plot_rank_ecdf(result)
        assert ecdf.axes[1].get_title() == f"Joint {joint} rank"
        note = ecdf.axes[1].texts[0].get_text()
        assert ("less probable" in note) == (joint == "energy"), note
        histograms = plot_rank_histograms(result)
        assert histograms.axes[-1].get_title().startswith(f"joint ({joint})")
