"""Shared posterior draws (one sampling pass per check epoch) and the TARP callback.

What must hold: in a ``Trainer.fit`` with the rank, TARP and L-C2ST-NF callbacks checking
in the same epoch, the calibration x is sampled once per epoch and the observations once;
a later epoch (other parameters) draws again; a rank check on shared draws equals the
unshared one under the same seed, and a TARP test on draws shared with the ranks keeps
its level; the cache never holds more than its bound and serves unshared beyond it;
rows of a held tensor are served, equal data in another tensor is not; the TARP callback
logs its tags and writes its figure.
"""

from __future__ import annotations

import csv
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, TensorDataset

import calib_lightning as cl
from calib_lightning.callbacks import LC2STNFCallback, RankCalibrationCallback, TARPCallback
from calib_lightning.evaluation import draw_chunks, draws
from calib_lightning.evaluation._draw_cache import SharedDraws, row_range
from calib_lightning.posteriors import Posterior
from calib_lightning.tasks import GaussianToy

N, M, n_obs = 300, 50, 2


class Counted(Posterior):
    """A posterior that records ``(rows, draws)`` of every sampling call."""

    def __init__(self, posterior):
        self.inner = cl.as_posterior(posterior)
        super().__init__(self.inner.module)
        self.calls: list[tuple[int, int]] = []

    def sample(self, x, num_posterior_samples):
        self.calls.append((x.shape[0], num_posterior_samples))
        return self.inner.sample(x, num_posterior_samples)

    def sample_and_log_prob(self, x, num_posterior_samples):
        self.calls.append((x.shape[0], num_posterior_samples))
        return self.inner.sample_and_log_prob(x, num_posterior_samples)

    def log_prob(self, theta, x):
        return self.inner.log_prob(theta, x)

    def to_latent(self, theta, x):
        return self.inner.to_latent(theta, x)

    def event_size(self):
        return self.inner.event_size()


class Module(L.LightningModule):
    """A Gaussian posterior whose mean moves with a trained parameter (so each epoch's
    parameters differ), sampled through a :class:`Counted` wrapper."""

    def __init__(self):
        super().__init__()
        self.shift = torch.nn.Parameter(torch.zeros(()))
        toy = GaussianToy(dim=2)
        self.counted = Counted(lambda x: toy.posterior(shift=float(self.shift))(x))

    def training_step(self, batch, batch_idx):
        return (self.shift - 1.0) ** 2

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit(callbacks, epochs=2, logger=False, module=None):
    toy = GaussianToy(dim=2)
    train = DataLoader(TensorDataset(*toy.sample(16, torch.Generator().manual_seed(8))),
                       batch_size=16)  # fmt: skip
    module = module or Module()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=epochs, logger=logger,
                        enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False, callbacks=callbacks)  # fmt: skip
    trainer.fit(module, train)
    return module, trainer


@pytest.fixture(autouse=True)
def _run_in_tmp_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)


@pytest.fixture(scope="module")
def pairs():
    return GaussianToy(dim=2).sample(N, torch.Generator().manual_seed(7))


def three_callbacks(theta, x, tarp_draws=M, **kwargs):
    observations = GaussianToy(dim=2).sample(n_obs, torch.Generator().manual_seed(9))[1]
    lc2st = cl.LC2STNF(observations=observations, num_null=10, num_posterior_samples=200, seed=1)
    reference = torch.randn(30, n_obs, 2, generator=torch.Generator().manual_seed(3))
    return [
        RankCalibrationCallback(theta, x, metric=cl.RankCalibration(M, max_pairs=0),
                                estimator="counted", **kwargs),
        TARPCallback(theta, x, metric=cl.TARP(tarp_draws, num_null=100), estimator="counted",
                     **kwargs),
        LC2STNFCallback(theta, x, metric=lc2st, estimator="counted", reference_samples=reference,
                        map_num_posterior_samples=100, misspecification=False, **kwargs),
    ]  # fmt: skip


def calibration_draws(calls):
    """Draws per pair of each sampling pass over the ``N`` calibration pairs (a pass comes
    in chunks of pairs sized from the memory budget; the observations' calls have at most
    ``n_obs`` rows)."""
    passes, rows_done = [], 0
    for rows, count in calls:
        if rows > n_obs:
            rows_done += rows
            if rows_done == N:
                passes.append(count)
                rows_done = 0
    return passes


def observation_draws(calls):
    """Draws times observations sampled away from the calibration x."""
    return sum(rows * draws for rows, draws in calls if rows <= n_obs)


@pytest.mark.parametrize("tarp_draws", [M, 2 * M])
def test_calibration_x_is_sampled_once_per_check_epoch(pairs, tarp_draws):
    theta, x = pairs
    module, trainer = fit(three_callbacks(theta, x, tarp_draws))
    calls = module.counted.calls
    # two epochs: one pass of max(M, S) draws each (S > M adds only the missing draws)
    expected = [M] * 2 if tarp_draws == M else [M, tarp_draws - M] * 2
    assert calibration_draws(calls) == expected
    # the maps (100 draws) and the reference scores (30) share the observations' draws
    assert observation_draws(calls) == 2 * n_obs * 100
    assert float(module.shift) != 0.0  # the parameters changed between the epochs
    for callback in trainer.callbacks[:3]:  # every callback checked twice, without error
        assert callback.epochs == [0, 1]
        assert not callback.errors


def test_one_callback_alone_draws_as_before(pairs):
    theta, x = pairs
    module, _ = fit(three_callbacks(theta, x)[1:2])  # TARP alone: nothing to share
    assert calibration_draws(module.counted.calls) == [M, M]


@pytest.mark.parametrize("other", ["clone", "other pairs"])
def test_callbacks_share_equal_data_and_only_it(pairs, other):
    theta, x = pairs
    callbacks = three_callbacks(theta, x)[:2]
    if other == "clone":  # equal values in other tensors: the same batches, shared
        callbacks[1].theta, callbacks[1].x = theta.clone(), x.clone()
    else:
        callbacks[1].theta, callbacks[1].x = GaussianToy(dim=2).sample(N, torch.Generator())
    module, _ = fit(callbacks)
    expected = [M, M] if other == "clone" else [M, M, M, M]
    assert calibration_draws(module.counted.calls) == expected


def test_ranks_on_shared_draws_equal_the_unshared_check(pairs):
    theta, x = pairs
    torch.manual_seed(11)
    alone, _ = fit(three_callbacks(theta, x)[:1])
    torch.manual_seed(11)
    _, trainer = fit(three_callbacks(theta, x))
    ranks_alone = alone.trainer.callbacks[0]
    ranks_shared = trainer.callbacks[0]
    assert ranks_alone.history["global_p_value"] == ranks_shared.history["global_p_value"]
    assert torch.equal(ranks_alone.last_result.histogram, ranks_shared.last_result.histogram)


def test_validate_after_fit_draws_again(pairs):
    theta, x = pairs
    callbacks = three_callbacks(theta, x, check_on=("fit", "validate"))[:2]
    module, trainer = fit(callbacks, epochs=1)
    before = len(module.counted.calls)
    val = DataLoader(TensorDataset(*GaussianToy(dim=2).sample(8, torch.Generator())), batch_size=8)
    module.validation_step = lambda batch, batch_idx: None
    trainer.validate(module, val, verbose=False)
    assert calibration_draws(module.counted.calls[before:]) == [M]  # one new shared pass


def test_tarp_on_draws_shared_with_ranks_keeps_its_level():
    """200 fresh datasets, exact posterior: TARP and ranks on the same draws each reject at
    the level (binomial band), and both are computed from one sampling pass."""
    toy, reps, level = GaussianToy(dim=2), 200, 0.05
    rejected = torch.zeros(2)
    for rep in range(reps):
        theta, x = toy.sample(100, torch.Generator().manual_seed(1000 + rep))
        posterior = Counted(toy.posterior())
        shared = SharedDraws(posterior)
        ranks = cl.RankCalibration(num_posterior_samples=30)
        tarp = cl.TARP(num_posterior_samples=30, num_null=200)
        ranks.update(shared, theta, x)
        tarp.update(shared, theta, x)
        assert sum(rows for rows, _ in posterior.calls) == 100  # one pass, in chunks
        assert {draws for _, draws in posterior.calls} == {30}
        rejected += torch.tensor([float(ranks.compute().global_p_value < level),
                                  float(tarp.compute().p_value < level)])  # fmt: skip
    # 99.9% binomial band of Bin(200, 0.05): [2, 21]
    assert bool((rejected >= 2).all() and (rejected <= 21).all()), rejected


def test_memory_bound_is_respected_and_requests_beyond_it_are_drawn_unshared():
    toy = GaussianToy(dim=2)
    theta, x = toy.sample(100, torch.Generator().manual_seed(0))
    posterior = Counted(toy.posterior())
    bound = 100 * 40 * 3  # 40 draws of 100 pairs with D = 2 and their log-densities
    shared = SharedDraws(posterior, max_elements=bound)
    draws(shared, x, 40)  # D unknown to the posterior: learnt from the first chunk
    assert sum(rows * draws for rows, draws in posterior.calls) == 100 * 40
    assert shared.num_elements == bound
    calls = len(posterior.calls)
    again = draws(shared, x[10:20], 25)  # rows of the held tensor, fewer draws: served
    assert len(posterior.calls) == calls
    assert again.shape == (25, 10, 2)
    draws(shared, x, 41)  # one more draw would exceed the bound: drawn unshared
    assert sum(rows * draws for rows, draws in posterior.calls[calls:]) == 100 * 41
    assert shared.num_elements == bound
    chunks = list(draw_chunks(shared, theta, x, 41, max_chunk_elements=1000))
    assert shared.num_elements <= bound
    assert sum(c.samples.shape[0] for c in chunks) == 41 * len({c.start for c in chunks})


def test_served_chunks_are_the_held_draws_in_the_same_chunks():
    toy = GaussianToy(dim=2)
    theta, x = toy.sample(50, torch.Generator().manual_seed(0))
    shared = SharedDraws(cl.as_posterior(toy.posterior()))
    first = list(draw_chunks(shared, theta, x, 20, max_chunk_elements=100))
    second = list(draw_chunks(shared, theta, x, 20, max_chunk_elements=100))
    assert len(first) == len(second) > 1
    for a, b in zip(first, second, strict=True):
        assert (a.start, a.first_draw) == (b.start, b.first_draw)
        assert torch.equal(a.samples, b.samples)
        assert torch.equal(a.log_prob, b.log_prob)
    held = draws(shared, x, 20)  # the same draws, as one tensor
    for chunk in first:
        rows = slice(chunk.start, chunk.start + chunk.theta.shape[0])
        block = held[chunk.first_draw : chunk.first_draw + chunk.samples.shape[0], rows]
        assert torch.equal(block, chunk.samples)


def test_row_range_matches_only_row_slices_of_the_same_tensor():
    x = torch.randn(10, 3, 4)
    assert row_range(x, x) == slice(0, 10)
    assert row_range(x, x[3:7]) == slice(3, 7)
    assert row_range(x, x[::2]) is None
    assert row_range(x, x.clone()) is None
    assert row_range(x, x[:, 1:]) is None
    assert row_range(x[2:], x[:5]) is None  # rows before the held tensor


def test_tarp_callback_logs_its_tags_and_figures(tmp_path, pairs):
    theta, x = pairs
    logger = CSVLogger(tmp_path, name="csv", version=0)
    fit(three_callbacks(theta, x)[1:2], logger=logger)
    with open(Path(logger.log_dir, "metrics.csv")) as f:
        rows = list(csv.DictReader(f))
    for key in ("p_value", "coverage_error", "statistic", "num_pairs"):
        values = [float(r[f"calibration/tarp/{key}"]) for r in rows if r[f"calibration/tarp/{key}"]]
        assert len(values) == 2, key
    root = Path(logger.log_dir, "calibration", "tarp")
    assert {p.parent.name for p in root.rglob("*.png")} == {"coverage", "history"}
    assert sorted(p.name for p in (root / "coverage").glob("*.png")) == [
        "epoch=0000.png", "epoch=0001.png"]  # fmt: skip


def test_tarp_callback_default_metric_and_bad_metric():
    theta, x = GaussianToy(dim=2).sample(20, torch.Generator().manual_seed(0))
    assert TARPCallback(theta, x).metric.num_posterior_samples == 100
    assert cl.TARPCallback is TARPCallback
    with pytest.raises(ValueError, match=r"metric must be a calib_lightning\.TARP"):
        TARPCallback(theta, x, metric=cl.RankCalibration(10))


def test_rank_callback_logs_each_test_quantity_by_name(pairs):
    theta, x = pairs
    quantities = {"sum": lambda t: t.sum(-1), "norm": lambda t: t.norm(dim=-1)}
    metric = cl.RankCalibration(M, max_pairs=0, statistics=quantities)
    callback = RankCalibrationCallback(theta, x, metric=metric, estimator="counted")
    fit([callback], epochs=1)
    for name in quantities:
        for key in ("statistic_p_values", "statistic_ecdf_p_values"):
            values = callback.history[f"{key}/{name}"]
            assert len(values) == 1
            assert 0 < values[0] <= 1


def test_bound_holds_when_the_posterior_does_not_know_its_dimension():
    toy = GaussianToy(dim=10)  # D = 10, unknown to the posterior until it samples
    _, x = toy.sample(50, torch.Generator().manual_seed(0))
    posterior = Counted(toy.posterior())
    shared = SharedDraws(posterior, max_elements=50 * 20 * 5)  # room for D = 4 at most
    out = draws(shared, x, 20)
    assert out.shape == (20, 50, 10)
    assert shared.num_elements == 0  # the first chunk told D = 10: nothing kept
    first, *rest = posterior.calls  # that chunk (a probe of at most 256 draws), then the
    assert first[0] * first[1] <= 256  # unshared draws of every pair
    assert sum(rows * draws for rows, draws in rest) == 50 * 20


def test_the_prior_support_callback_samples_through_the_shared_draws(pairs):
    """With the rank callback in the same epoch, the support check counts the rank
    check's draws: one sampling pass over the calibration x per epoch."""
    from calib_lightning.callbacks import PriorSupportCallback

    theta, x = pairs
    bound = torch.full((2,), float(theta.abs().max()) + 1e-3, dtype=theta.dtype)
    box = torch.distributions.Independent(torch.distributions.Uniform(-bound, bound), 1)
    support = PriorSupportCallback(theta, x, metric=cl.PriorSupport(box, M), estimator="counted")
    module, _ = fit([three_callbacks(theta, x)[0], support])
    assert calibration_draws(module.counted.calls) == [M, M]
    assert support.epochs == [0, 1]
    assert not support.errors
    assert len(support.history["statistic"]) == 2


@pytest.mark.parametrize("source", ["fresh", "shared, first pass", "shared, replayed"])
def test_the_caller_keeps_autograd_while_it_handles_draws_and_after_it_stops_early(source):
    """Draws are made without a graph, but the caller's loop body runs in the caller's grad
    mode, and an exception in that loop leaves autograd on: a ``yield`` inside
    ``no_grad`` turned it off for the rest of the process (the suspended generator stays
    alive with the exception's traceback), and a training step after a failed check then
    had no gradients."""
    toy = GaussianToy(dim=2)
    theta, x = toy.sample(40, torch.Generator().manual_seed(0))
    posterior = cl.as_posterior(toy.posterior())
    posterior = posterior if source == "fresh" else SharedDraws(posterior)
    if source == "shared, replayed":
        draws(posterior, x, 8)  # held: the chunks below replay them
    seen = []

    def stop_at_the_first_chunk() -> None:
        for chunk in draw_chunks(posterior, theta, x, 8, max_chunk_elements=64):
            seen.append(torch.is_grad_enabled())
            assert not chunk.samples.requires_grad
            raise RuntimeError("stop")

    with pytest.raises(RuntimeError, match="stop"):
        stop_at_the_first_chunk()
    assert seen == [True]
    assert torch.is_grad_enabled()
    # the public path where it showed: a statistic that fails its shape check
    metric = cl.RankCalibration(10, statistics={"bad": lambda t: t})
    with pytest.raises(ValueError, match=r"statistics\['bad'\] must map theta"):
        metric.update(posterior, theta, x)
    assert torch.is_grad_enabled()
