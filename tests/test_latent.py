"""Latent calibration: level, power with the right sign, closed forms, streaming, DDP, flows."""

import math

import lightning as L
import numpy as np
import pytest
import torch
import zuko
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from matplotlib.text import Text
from nflows.distributions.normal import ConditionalDiagonalNormal, StandardNormal
from nflows.flows.base import Flow
from nflows.transforms import CompositeTransform, MaskedAffineAutoregressiveTransform
from scipy import stats
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch.distributions import Independent, Normal, Uniform
from torch.utils.data import DataLoader, TensorDataset

import calib_lightning as cl
from calib_lightning.callbacks import LatentCalibrationCallback
from calib_lightning.functional import (
    latent_calibration,
    latent_histogram,
    latent_summary,
    latent_sums,
    latent_values,
    sbc_ranks,
)
from calib_lightning.tasks import GaussianToy
from calib_lightning.testing import run_distributed

F64 = torch.float64


def gen(seed):
    return torch.Generator().manual_seed(seed)


# -- closed forms ---------------------------------------------------------------------------


def test_values_and_cells_match_scipy():
    z = torch.randn(300, 4, generator=gen(0), dtype=F64) * 1.7
    u, c = latent_values(z)
    zn = z.numpy()
    np.testing.assert_allclose(u.numpy(), stats.norm.cdf(zn), rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(c.numpy(), stats.chi2.cdf((zn**2).sum(1), 4), rtol=1e-10)
    k = 37
    hist = latent_histogram(z, k)
    cells = np.floor(k * np.concatenate([stats.norm.cdf(zn), c.numpy()[:, None]], 1))
    expected = np.stack([np.bincount(col.astype(int), minlength=k) for col in cells.T])
    assert np.array_equal(hist.numpy(), expected)
    # D = 1: c = P(|Z| <= |z|) = 2 Phi(|z|) - 1
    u1, c1 = latent_values(z[:, :1])
    torch.testing.assert_close(c1, 2 * u1[:, 0].where(z[:, 0] > 0, 1 - u1[:, 0]) - 1)


def test_hand_made_case_joint_chi_square_and_coverage_error():
    # D = 2: F_chi2_2(r) = 1 - exp(-r / 2), so |z|^2 = -2 log(1 - c) places c exactly.
    # N = 20 pairs, default 4 chi-square bins (min(K, 20, N // 5)): 11, 3, 3, 3 values of c
    # in the four quarters; expected 5 each: X^2 = (36 + 4 + 4 + 4) / 5 = 9.6 on 3 dof.
    c = torch.tensor([0.01 + 0.02 * i for i in range(11)] + [0.3, 0.4, 0.45]
                     + [0.55, 0.6, 0.7] + [0.8, 0.9, 0.99], dtype=F64)  # fmt: skip
    c = c + 0.0005  # mid-cell: no value on an edge of the K = 1000 cells
    angle = torch.linspace(0.1, 6.0, 20, dtype=F64)
    radius = (-2 * torch.log1p(-c)).sqrt()
    z = torch.stack([radius * angle.cos(), radius * angle.sin()], -1)
    out = latent_calibration(z)
    assert out.histogram.shape == (3, 1000)
    assert int(out.num_bins) == 4
    x2 = 9.6
    closed = math.erfc(math.sqrt(x2 / 2)) + math.sqrt(2 * x2 / math.pi) * math.exp(-x2 / 2)
    assert float(out.statistic) == pytest.approx(x2, rel=1e-12)
    assert float(out.p_value) == pytest.approx(closed, rel=1e-10)
    assert closed == pytest.approx(stats.chi2.sf(x2, 3), rel=1e-12)
    # coverage error: (M / 2 - mean cell) / (M + 1) with M + 1 = K = 1000 cells
    cells = np.floor(1000 * c.numpy())
    assert float(out.coverage_error) == pytest.approx((999 / 2 - cells.mean()) / 1000, abs=1e-12)
    assert float(out.coverage_error) == pytest.approx(0.5 - c.mean().item(), abs=1 / 2000)
    # marginal chi-square p-values as scipy computes them from Phi(z_d) directly
    u = stats.norm.cdf(z.numpy())
    for d in range(2):
        observed = np.bincount(np.floor(4 * u[:, d]).astype(int), minlength=4)
        want = stats.chisquare(observed, np.full(4, 5.0)).pvalue
        assert float(out.marginal_p_values[d]) == pytest.approx(want, rel=1e-10)
    # the curves are the ECDFs of u and c at the printed levels
    want_ecdf = (c.numpy()[:, None] < out.levels.numpy()).mean(0)
    np.testing.assert_allclose(out.coverage.numpy(), want_ecdf, atol=1e-12)
    # latent moments
    torch.testing.assert_close(out.latent_mean, z.mean(0))
    torch.testing.assert_close(out.latent_std, z.std(0))


def test_joint_value_is_the_hpd_credibility_of_a_gaussian_posterior():
    # for a Gaussian q the latent balls are its HPD regions: the energy rank among M draws,
    # divided by M, estimates c for every pair (binomial error), and has the same sign
    toy = GaussianToy(dim=3)
    theta, x = toy.sample(200, gen(1))
    post = toy.posterior(variance_scale=0.7)
    dist, m = post(x), 4000
    torch.manual_seed(2)
    samples = dist.sample((m,))
    ranks = sbc_ranks(samples, dist.log_prob(samples), theta, dist.log_prob(theta))[:, -1]
    _, c = latent_values(cl.as_posterior(post).to_latent(theta, x))
    err = (ranks.double() / m - c).abs()
    assert bool((err <= 4.5 * (c * (1 - c) / m).sqrt() + 2 / m).all())


# -- level and power --------------------------------------------------------------------------


@pytest.mark.parametrize("dim", [1, 5, 20])
def test_level_on_exact_gaussian_posteriors(dim):
    reps, n = 200, 200
    toy = GaussianToy(dim=dim)
    g = gen(100 + dim)
    p = np.empty((reps, 3))
    for r in range(reps):  # fresh data, a fresh metric with default arguments, as users run it
        theta, x = toy.sample(n, g)
        metric = cl.LatentCalibration()
        metric.update(toy.posterior(), theta, x)
        out = metric.compute()
        p[r] = float(out.global_p_value), float(out.p_value), float(out.ecdf_p_values[-1])
    low, high = stats.binom.ppf([0.005, 0.995], reps, 0.05) / reps
    rates = (p <= 0.05).mean(0)
    assert bool(((low <= rates) & (rates <= high)).all()), rates
    grid = np.linspace(0, 1, 101)  # joint p-values uniform, not only at 0.05
    assert np.abs((p[:, 1, None] <= grid).mean(0) - grid).max() < 0.1


@pytest.mark.parametrize(
    ("variance_scale", "shift", "sign"),
    [(0.5, 0.0, -1), (2.0, 0.0, 1), (1.0, 0.5, -1)],
    ids=["over-confident", "under-confident", "biased"],
)
def test_power_and_sign(variance_scale, shift, sign):
    toy = GaussianToy(dim=5)
    theta, x = toy.sample(500, gen(3))
    metric = cl.LatentCalibration()
    metric.update(toy.posterior(variance_scale=variance_scale, shift=shift), theta, x)
    out = metric.compute()
    assert float(out.global_p_value) < 1e-6
    assert float(out.p_value) < 1e-3
    assert float(out.ecdf_p_values[-1]) < 1e-3
    assert sign * float(out.coverage_error) > 0.03
    assert bool(out.outside_band[-1])
    deviation = out.ecdf[:-1] - out.levels  # marginal curves, read as on the figure
    left, right = deviation[:, out.levels < 0.5], deviation[:, out.levels > 0.5]
    if shift:  # posterior too high: u small, ECDF - t above 0 throughout; z* mean < 0
        assert bool((deviation.mean(-1) > 0.05).all())
        torch.testing.assert_close(out.latent_mean, torch.full((5,), -shift / 0.2**0.5, dtype=F64),
                                   atol=0.15, rtol=0)  # fmt: skip
    else:  # too narrow: above 0 on the left, below on the right, std > 1; too wide: reverse
        assert bool((sign * left.mean(-1) < -0.02).all())
        assert bool((sign * right.mean(-1) > 0.02).all())
        want = torch.full((5,), variance_scale**-0.5, dtype=F64)
        torch.testing.assert_close(out.latent_std, want, rtol=0.1, atol=0)
    # the rank metric reads the same direction on the same pairs
    ranks = cl.RankCalibration(num_posterior_samples=100)
    torch.manual_seed(4)
    ranks.update(toy.posterior(variance_scale=variance_scale, shift=shift), theta, x)
    assert sign * float(ranks.compute().coverage_error) > 0.03


def test_blind_spot_law_of_coordinates_and_radius_kept():
    # z* = r (cos a, sin a) with r^2 ~ chi2_2 and angle density (1 + sin 2a) / (2 pi): each
    # coordinate is N(0, 1) and the radius law is exact, yet corr(z1, z2) = 1/2. The check
    # is built on those two laws and cannot see it (documented); the moments show nothing.
    n = 20000
    g = gen(5)
    r = (-2 * torch.rand(n, generator=g, dtype=F64).log()).sqrt()
    a = torch.rand(3 * n, generator=g, dtype=F64) * 2 * math.pi
    keep = torch.rand(3 * n, generator=g, dtype=F64) * 2 < 1 + torch.sin(2 * a)
    a = a[keep][:n]
    z = torch.stack([r * a.cos(), r * a.sin()], -1)
    assert float(torch.corrcoef(z.T)[0, 1]) > 0.45
    out = latent_calibration(z)
    assert float(out.global_p_value) > 0.01


# -- dimensions, offsets, flows ------------------------------------------------------------------


def test_one_dimension_keeps_documented_shapes():
    toy = GaussianToy(dim=1)
    theta, x = toy.sample(300, gen(6))
    metric = cl.LatentCalibration()
    metric.update(toy.posterior(), theta, x)
    out = metric.compute()
    assert out.marginal_p_values.shape == out.latent_mean.shape == out.latent_std.shape == (1,)
    assert out.ecdf_p_values.shape == out.outside_band.shape == (2,)
    assert out.global_p_value.shape == out.p_value.shape == ()
    assert out.histogram.shape == (2, 1000)


def test_fifty_dimensions():
    toy = GaussianToy(dim=50)
    theta, x = toy.sample(1000, gen(7))
    good, narrow = cl.LatentCalibration(), cl.LatentCalibration()
    good.update(toy.posterior(), theta, x)
    narrow.update(toy.posterior(variance_scale=0.9), theta, x)  # 5% too narrow in sd
    good, narrow = good.compute(), narrow.compute()
    assert good.histogram.shape == (51, 1000)
    assert float(good.global_p_value) > 0.01
    assert float(narrow.p_value) < 1e-6
    assert float(narrow.coverage_error) < -0.05


def test_offset_parameters_give_the_same_cells():
    toy = GaussianToy(dim=3, dtype=F64)
    theta, x = toy.sample(2000, gen(8))
    base, far = cl.LatentCalibration(), cl.LatentCalibration()
    base.update(toy.posterior(), theta, x)
    far.update(toy.posterior(shift=1e6), theta + 1e6, x)  # theta near 1e6, same posterior
    assert torch.equal(base.histogram, far.histogram)
    torch.testing.assert_close(base.latent_sums, far.latent_sums, rtol=1e-8, atol=1e-6)
    # float32 latents: cells computed in float64, so only values within float32 rounding
    # of a cell edge can move
    z = cl.as_posterior(toy.posterior()).to_latent(theta, x)
    moved = (latent_histogram(z.float()) - latent_histogram(z)).abs().sum()
    assert int(moved) <= 4


def _zuko_maf(dim, context, seed=0):
    torch.manual_seed(seed)
    return zuko.flows.MAF(dim, context, transforms=2, hidden_features=(16, 16))


def _nflows(dim, context, base):
    torch.manual_seed(0)
    transform = CompositeTransform([
        MaskedAffineAutoregressiveTransform(features=dim, hidden_features=16,
                                            context_features=context)
        for _ in range(2)
    ])  # fmt: skip
    if base == "standard":
        return Flow(transform, StandardNormal([dim]))
    encoder = torch.nn.Linear(context, 2 * dim)
    return Flow(transform, ConditionalDiagonalNormal([dim], context_encoder=encoder))


@pytest.mark.parametrize("kind", ["zuko", "nflows", "nflows-cond-base"])
def test_a_flow_is_calibrated_for_its_own_draws(kind):
    # truths drawn from the (untrained) flow itself: q is the true posterior, z* ~ N(0, I)
    dim, context, n = 3, 2, 3000
    base = "conditional" if kind == "nflows-cond-base" else "standard"
    flow = _zuko_maf(dim, context) if kind == "zuko" else _nflows(dim, context, base)
    post = cl.as_posterior(flow)
    x = torch.randn(n, context, generator=gen(9))
    torch.manual_seed(10)
    theta = post.sample(x, 1)[0]
    metric = cl.LatentCalibration()
    metric.update(flow, theta, x)
    out = metric.compute()
    assert float(out.global_p_value) > 0.01
    torch.testing.assert_close(out.latent_std, torch.ones(dim, dtype=out.latent_std.dtype),
                               atol=0.06, rtol=0)  # fmt: skip
    # truths spread twice as wide around the flow's mean lie further out than the flow
    # claims: over-confident
    wide = cl.LatentCalibration()
    mean = post.sample(x, 16).mean(0)
    wide.update(flow, mean + 2 * (theta - mean), x)
    out = wide.compute()
    assert float(out.global_p_value) < 1e-6
    assert float(out.coverage_error) < -0.05


# -- streaming and DDP --------------------------------------------------------------------------


def test_many_small_updates_equal_one_big_update():
    toy = GaussianToy(dim=3)
    theta, x = toy.sample(600, gen(11))
    post = toy.posterior(variance_scale=0.8)
    big, small = cl.LatentCalibration(), cl.LatentCalibration()
    big.update(post, theta, x)
    for start, stop in [(0, 7), (7, 300), (300, 301), (301, 600)]:
        small.update(post, theta[start:stop], x[start:stop])
    assert torch.equal(big.histogram, small.histogram)
    torch.testing.assert_close(big.latent_sums, small.latent_sums, rtol=1e-12, atol=1e-12)
    a, b = big.compute(), small.compute()
    for key in ("global_p_value", "p_value", "marginal_p_values", "ecdf_p_values",
                "coverage_error", "ecdf"):  # fmt: skip
        assert torch.equal(a[key], b[key]), key
    # the functional call on all latents gives the same result
    c = latent_calibration(cl.as_posterior(post).to_latent(theta, x))
    assert torch.equal(c.histogram, a.histogram)
    assert torch.equal(c.global_p_value, a.global_p_value)
    # forward returns the batch's result while the state accumulates; merge_state adds up
    stepped, merged = cl.LatentCalibration(), cl.LatentCalibration()
    assert int(stepped(post, theta[:300], x[:300]).num_pairs) == 300
    assert int(stepped(post, theta[300:], x[300:]).num_pairs) == 300
    assert torch.equal(stepped.histogram, big.histogram)
    merged.merge_state(stepped)
    assert torch.equal(merged.histogram, big.histogram)
    big.reset()
    assert big.histogram.numel() == 0


@pytest.mark.forks
def test_ddp_equals_one_process_also_with_a_rank_without_data():
    toy = GaussianToy(dim=2, dtype=F64)
    theta, x = toy.sample(400, gen(12))
    theta = theta + 1e6
    post = toy.posterior(variance_scale=1.3, shift=1e6)
    single = cl.LatentCalibration()
    single.update(post, theta, x)
    expected = single.compute()

    def fn(rank, world_size, split):
        metric = cl.LatentCalibration()  # no num_dims: the empty rank learns D at sync
        if split == "uneven":
            rows = [slice(150, 400)] if rank else [slice(0, 100), slice(100, 150)]
        else:
            rows = [slice(0, 120), slice(120, 400)] if rank == 0 else []
        for r in rows:
            metric.update(post, theta[r], x[r])
        return metric.compute()

    for split in ("uneven", "empty"):
        results = run_distributed(lambda rank, world, s=split: fn(rank, world, s), world_size=2)
        for result in results:
            assert torch.equal(result.histogram, expected.histogram)
            for key in ("global_p_value", "p_value", "ecdf_p_values", "coverage_error"):
                assert torch.equal(result[key], expected[key]), key
            torch.testing.assert_close(result.latent_mean, expected.latent_mean, rtol=1e-12,
                                       atol=1e-12)  # fmt: skip
            torch.testing.assert_close(result.latent_std, expected.latent_std, rtol=1e-12, atol=0)
    assert float(expected.coverage_error) > 0  # the data were not degenerate: too wide


# -- bad input ------------------------------------------------------------------------------------


def test_bad_arguments_and_inputs_are_named():
    toy = GaussianToy(dim=2)
    theta, x = toy.sample(10, gen(13))
    post = toy.posterior()
    for kwargs, name in [({"num_cells": 1}, "num_cells"), ({"num_cells": 2.5}, "num_cells"),
                         ({"level": 1.0}, "level"), ({"num_bins": 1}, "num_bins"),
                         ({"num_bins": 2000}, "num_bins"), ({"num_dims": 0}, "num_dims"),
                         ({"num_ecdf_points": 0}, "num_ecdf_points"),
                         ({"global_method": "fisher"}, "global_method")]:  # fmt: skip
        with pytest.raises(ValueError, match=name):
            cl.LatentCalibration(**kwargs)
    metric = cl.LatentCalibration()
    with pytest.raises(ValueError, match=r"theta must have shape \(N, D\)"):
        metric.update(post, theta[:, 0], x)
    with pytest.raises(ValueError, match="x"):
        metric.update(post, theta, x[:5])
    bad = theta.clone()
    bad[3, 1] = float("nan")
    with pytest.raises(ValueError, match="theta"):
        metric.update(post, bad, x)
    with pytest.raises(ValueError, match="N >= 2"):
        metric.compute()
    metric.update(post, theta, x)
    with pytest.raises(ValueError, match="D = 2 columns as in earlier updates, got D = 3"):
        metric.update(GaussianToy(dim=3).posterior(), torch.zeros(4, 3), torch.zeros(4, 3))

    def uniform(x):
        return Independent(Uniform(x - 1, x + 1), 1)

    with pytest.raises(ValueError, match="to_latent needs a flow or a Gaussian"):
        cl.LatentCalibration().update(uniform, theta, x)

    def blows_up(x):  # zero scale: infinite latents
        return Independent(Normal(x, torch.zeros_like(x), validate_args=False), 1)

    with pytest.raises(ValueError, match="must be finite"):
        cl.LatentCalibration().update(blows_up, theta, x)
    with pytest.raises(ValueError, match=r"z must have shape \(\*, N, D\)"):
        latent_calibration(torch.zeros(5))
    with pytest.raises(ValueError, match="D >= 1"):
        latent_values(torch.zeros(5, 0))
    with pytest.raises(ValueError, match="N >= 2"):
        latent_calibration(torch.zeros(1, 2))
    with pytest.raises(ValueError, match="z"):
        latent_calibration(torch.tensor([[0.0, float("inf")], [0.0, 0.0]]))
    z = torch.randn(30, 2, generator=gen(14))
    with pytest.raises(ValueError, match="sums must have shape"):
        latent_summary(latent_histogram(z), latent_sums(z)[:, :1])
    with pytest.raises(ValueError, match="num_cells"):
        latent_histogram(z, 1)
    with pytest.raises(ValueError, match=r"metric must be a calib_lightning\.LatentCalibration"):
        LatentCalibrationCallback(theta, x, metric=cl.RankCalibration(10))
    with pytest.raises(ValueError, match="coordinates"):
        LatentCalibrationCallback(theta, x, coordinates=[0, 0])
    out = latent_calibration(z)
    with pytest.raises(ValueError, match="labels"):
        LatentCalibrationCallback(theta, x, labels=["a"]).figures(out)
    with pytest.raises(ValueError, match="coordinates"):
        LatentCalibrationCallback(theta, x, coordinates=[2]).figures(out)


# -- callback -------------------------------------------------------------------------------------


class _FixedPosterior(L.LightningModule):
    def __init__(self, dim, variance_scale):
        super().__init__()
        self.dummy = torch.nn.Parameter(torch.zeros(()))
        self.flow = GaussianToy(dim=dim).posterior(variance_scale=variance_scale)

    def training_step(self, batch, batch_idx):
        return self.dummy**2

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(callback, logger, dim=2, variance_scale=1.0, epochs=1):
    train = DataLoader(TensorDataset(*GaussianToy(dim=dim).sample(32, gen(15))), batch_size=32)
    fit = L.Trainer(accelerator="cpu", devices=1, max_epochs=epochs, logger=logger,
                    callbacks=[callback], enable_progress_bar=False,
                    enable_model_summary=False, enable_checkpointing=False)  # fmt: skip
    fit.fit(_FixedPosterior(dim, variance_scale), train)


@pytest.mark.parametrize("variance_scale", [1.0, 0.5])
def test_callback_logs_scalars_figures_and_histograms(tmp_path, variance_scale):
    theta, x = GaussianToy(dim=2).sample(400, gen(16))
    callback = LatentCalibrationCallback(theta, x)
    logger = TensorBoardLogger(tmp_path, name="tb", version=0)
    _fit(callback, logger, variance_scale=variance_scale)
    acc = EventAccumulator(logger.log_dir, size_guidance={"scalars": 0, "images": 0,
                                                          "histograms": 0})  # fmt: skip
    acc.Reload()
    expected = ({"global_p_value", "p_value", "coverage_error", "num_pairs"}
                | {f"marginal_p_values/{d}" for d in (0, 1)}
                | {f"ecdf_p_values/{d}" for d in (0, 1, 2)})  # fmt: skip
    expected |= {f"log10_{k}" for k in expected if k != "coverage_error" and "p_value" in k}
    assert set(acc.Tags()["scalars"]) - {"epoch"} == {f"calibration/latent/{k}" for k in expected}
    figures = {"history", "ecdf", "histograms", "expected_coverage"}
    assert set(acc.Tags()["images"]) == {f"calibration/latent/{f}" for f in figures}
    tags = {f"calibration/latent/u/{r}" for r in ("0", "1", "joint")}
    assert set(acc.Tags()["histograms"]) == tags
    joint = acc.Histograms("calibration/latent/u/joint")[0].histogram_value
    assert joint.num == 400
    assert 0 < joint.min <= joint.max < 1
    if variance_scale == 1.0:
        assert callback.history["global_p_value"][0] > 0.01
    else:
        assert callback.history["global_p_value"][0] < 1e-6
        assert callback.history["coverage_error"][0] < -0.05


def test_callback_figures_speak_of_latents_and_stay_small_at_fifty_dimensions(tmp_path):
    toy = GaussianToy(dim=50)
    theta, x = toy.sample(500, gen(17))
    metric = cl.LatentCalibration()
    scale = 0.2**0.5 * torch.linspace(0.7, 1.0, 50)  # the first coordinates too narrow

    def post(x):
        return Independent(Normal(0.8 * x, scale), 1)

    metric.update(post, theta, x)
    out = metric.compute()
    callback = LatentCalibrationCallback(theta, x)
    figures = callback.figures(out)
    assert set(figures) == {"ecdf", "histograms", "expected_coverage"}
    for name, figure in figures.items():
        width, height = figure.get_size_inches()
        assert width <= 24, name
        assert height <= 6, name
        texts = " ".join(t.get_text() for t in figure.findobj(Text))
        assert "energy" not in texts.lower(), (name, texts)
        assert "HPD" not in texts, (name, texts)
    # the six coordinates drawn are the ones with the smallest ECDF p-values, named z<d>
    shown = sorted(torch.argsort(out.ecdf_p_values[:50])[:6].tolist())
    titles = [ax.get_title().split(" ")[0] for ax in figures["histograms"].axes
              if ax.get_visible() and ax.get_title()]  # fmt: skip
    assert titles == [*(f"z{i + 1}" for i in shown), "joint"]
    assert max(shown) < 25  # the too-narrow coordinates
    assert "6 of 50 latent coordinates (smallest ECDF p-values)" in " ".join(
        t.get_text() for t in figures["ecdf"].findobj(Text))
    chosen = LatentCalibrationCallback(theta, x, coordinates=[3, 49]).figures(out)
    assert len(chosen["histograms"].axes) == 3


def test_callback_writes_png_files_with_a_csv_logger(tmp_path):
    theta, x = GaussianToy(dim=2).sample(200, gen(18))
    callback = LatentCalibrationCallback(theta, x)
    logger = CSVLogger(tmp_path, name="csv", version=0)
    _fit(callback, logger, epochs=2)
    root = tmp_path / "csv" / "version_0" / "calibration" / "latent"
    written = {p.parent.name for p in root.rglob("*.png")}
    assert written == {"history", "ecdf", "histograms", "expected_coverage"}
    assert callback.epochs == [0, 1]
