"""Calibration callbacks inside real ``Trainer.fit`` runs (CPU, tiny flows, few epochs).

What must hold: scalars reach the logger under their tags and figures reach
TensorBoard; EarlyStopping and ModelCheckpoint can monitor a calibration scalar; a
resumed run continues the histories with the same base points; without TensorBoard
the scalars are still logged; a two-process DDP run writes each figure once and logs
the same synced values as one process on the same data.
"""

import csv
import math
import warnings
from pathlib import Path

import lightning as L
import pytest
import torch
import zuko
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics import Metric
from torchmetrics.utilities.data import dim_zero_cat

import calib_lightning as cl
from calib_lightning.callbacks import CalibrationCallback, KCCSDCallback, summary_table
from calib_lightning.callbacks._scalars import is_p_value
from calib_lightning.tasks import GaussianToy, TwoMoons

KEYS = ("statistic", "p_value", "bandwidth", "distribution_bandwidth", "num_pairs")
TAGS = {f"calibration/kccsd/{k}" for k in KEYS}


class NPE(L.LightningModule):
    """Minimal neural posterior estimation module: a tiny zuko flow, NLL loss."""

    def __init__(self, lr=1e-3, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.flow = zuko.flows.MAF(2, 2, transforms=1, hidden_features=(16, 16))
        self.head = torch.nn.Dropout(0.1).eval()  # a submodule the user keeps in eval mode
        self.lr = lr

    def training_step(self, batch, batch_idx):
        theta, x = batch
        return -self.flow(x).log_prob(theta).mean()

    def validation_step(self, batch, batch_idx):
        theta, x = batch
        self.log("val_loss", -self.flow(x).log_prob(theta).mean())

    def configure_optimizers(self):
        return (
            torch.optim.SGD(self.parameters(), lr=self.lr)
            if self.lr == 0
            else torch.optim.Adam(self.parameters(), lr=self.lr)
        )


class FixedPosterior(L.LightningModule):
    """A module whose 'flow' is a known Gaussian posterior of :class:`GaussianToy`."""

    def __init__(self, shift):
        super().__init__()
        self.dummy = torch.nn.Parameter(torch.zeros(()))
        self.flow = GaussianToy(dim=2).posterior(shift=shift)

    def training_step(self, batch, batch_idx):
        return self.dummy**2

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def two_moons(n, seed):
    return TwoMoons().sample(n, torch.Generator().manual_seed(seed))


def loader(theta, x, batch_size=64, shuffle=False):
    return DataLoader(TensorDataset(theta, x), batch_size=batch_size, shuffle=shuffle)


def metric():
    return cl.KCCSD(num_null=100, base_points=8, seed=3)


def trainer(tmp_path=None, **kwargs):
    options = {
        "accelerator": "cpu",
        "devices": 1,
        "enable_progress_bar": False,
        "max_epochs": 2,
        "enable_model_summary": False,
        "enable_checkpointing": False,
        "logger": False,
    }
    options.update(kwargs)
    if tmp_path is not None:
        options["default_root_dir"] = tmp_path
    return L.Trainer(**options)


def events(log_dir):
    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "images": 0, "histograms": 0})
    acc.Reload()
    return acc


@pytest.fixture(autouse=True)
def _run_in_tmp_path(tmp_path, monkeypatch):
    """Trainers without a logger write figure files under the working directory."""
    monkeypatch.chdir(tmp_path)


@pytest.fixture(scope="module")
def data():
    return two_moons(256, 0), two_moons(96, 1)


def test_tensorboard_gets_scalars_and_history_figure(tmp_path, data):
    (theta, x), (theta_cal, x_cal) = data
    callback = KCCSDCallback(theta_cal, x_cal, metric=metric())
    logger = TensorBoardLogger(tmp_path, name="tb", version=0)
    trainer(max_epochs=3, logger=logger, callbacks=[callback]).fit(
        NPE(), loader(theta, x, shuffle=True), loader(theta_cal, x_cal)
    )

    acc = events(logger.log_dir)
    scalar_tags = set(acc.Tags()["scalars"])
    assert scalar_tags >= TAGS
    for tag in TAGS:  # one value per check, equal to the recorded history
        logged = [e.value for e in acc.Scalars(tag)]
        assert logged == pytest.approx(callback.history[tag.split("/")[-1]], rel=1e-6)
    assert callback.epochs == [0, 1, 2]
    images = acc.Images("calibration/kccsd/history")
    assert len(images) == 3
    assert [e.step for e in images] == [e.step for e in acc.Scalars("calibration/kccsd/p_value")]
    assert all(e.encoded_image_string.startswith(b"\x89PNG") for e in images)
    assert callback.history["num_pairs"] == [96.0] * 3
    assert all(0 < p <= 1 for p in callback.history["p_value"])


class LatentMean(Metric):
    """Toy metric: mean of the flow's latent z* = T^-1(theta*; x) (0 when calibrated)."""

    full_state_update = False

    def __init__(self):
        super().__init__()
        self.add_state("total", torch.zeros(2), dist_reduce_fx="sum")
        self.add_state("count", torch.tensor(0.0), dist_reduce_fx="sum")
        self.add_state("latent", [], dist_reduce_fx="cat")

    def update(self, posterior, theta, x):
        z = cl.as_posterior(posterior).to_latent(theta, x)
        self.total += z.sum(0)
        self.count += z.shape[0]
        self.latent.append(z)

    def compute(self):
        return {"mean": self.total / self.count, "latent": dim_zero_cat(self.latent)}


class LatentCallback(CalibrationCallback):
    """A new diagnostic is a few lines: its metric, its history keys, its histograms."""

    name = "latent"
    history_keys = ("mean",)

    def __init__(self, theta, x, **kwargs):
        super().__init__(LatentMean(), theta, x, **kwargs)

    def histograms(self, result):
        return {"latent_0": result["latent"][:, 0]}


def test_subclass_logs_vector_scalars_histograms_and_figures(tmp_path):
    toy = GaussianToy(dim=2)
    theta, x = toy.sample(64, torch.Generator().manual_seed(0))
    callback = LatentCallback(theta, x)
    logger = TensorBoardLogger(tmp_path, name="tb", version=0)
    trainer(max_epochs=2, logger=logger, callbacks=[callback]).fit(
        FixedPosterior(shift=0.5), loader(theta, x)
    )
    acc = events(logger.log_dir)
    expected = ((theta - toy.weight * x - 0.5) / math.sqrt(0.2)).mean(0)
    for i in range(2):
        logged = [e.value for e in acc.Scalars(f"calibration/latent/mean/{i}")]
        assert logged == pytest.approx([float(expected[i])] * 2, abs=1e-5)
    histogram = acc.Histograms("calibration/latent/latent_0")
    assert len(histogram) == 2
    assert histogram[0].histogram_value.num == 64
    assert len(acc.Images("calibration/latent/history")) == 2


def test_check_runs_in_eval_mode_and_restores_each_submodule(data):
    (theta, x), (theta_cal, x_cal) = data
    seen = []

    def estimator(module):
        def posterior(x):
            seen.append((module.flow.training, torch.is_grad_enabled()))
            return module.flow(x)

        return posterior

    class ModeProbe(L.Callback):
        def on_train_epoch_end(self, trainer, module):
            modes.append((module.training, module.flow.training, module.head.training))

    modes = []
    callback = KCCSDCallback(
        theta_cal, x_cal, metric=metric(), estimator=estimator, log_figures=False
    )
    # no validation loop: the check runs at train-epoch end, while the module trains
    trainer(max_epochs=2, callbacks=[callback, ModeProbe()]).fit(NPE(), loader(theta, x))
    assert callback.epochs == [0, 1]
    assert seen
    assert all(not training for training, _ in seen)
    assert any(grad for _, grad in seen)  # scores take gradients even under no_grad
    assert modes == [(True, True, False)] * 2  # train mode back; the eval head stays eval


def test_float64_module_gets_its_calibration_data_in_float64(data):
    (theta, x), (theta_cal, x_cal) = data  # float32 tensors
    callback = KCCSDCallback(theta_cal, x_cal, metric=metric(), log_figures=False)
    trainer(max_epochs=1, precision="64-true", callbacks=[callback]).fit(
        NPE(), loader(theta.double(), x.double())
    )
    assert callback.metric.base_points.dtype == torch.float64
    assert callback.history["num_pairs"] == [96.0]


def test_every_n_epochs_without_validation_checks_at_train_epoch_end(data):
    (theta, x), (theta_cal, x_cal) = data
    callback = KCCSDCallback(theta_cal, x_cal, metric=metric(), every_n_epochs=2, log_figures=False)
    trainer(max_epochs=4, limit_val_batches=0, callbacks=[callback]).fit(
        NPE(), loader(theta, x), loader(theta_cal, x_cal)
    )
    assert callback.epochs == [0, 1, 3]  # the first epoch, then every second one
    assert len(callback.seconds) == 3


@pytest.mark.parametrize("kind", ["none", "csv"])
def test_without_tensorboard_figures_are_png_files_and_scalars_are_logged(tmp_path, data, kind):
    (theta, x), (theta_cal, x_cal) = data
    callback = KCCSDCallback(theta_cal, x_cal, metric=metric())
    logger = False if kind == "none" else CSVLogger(tmp_path, name="csv", version=0)
    fit = trainer(tmp_path / "root", max_epochs=2, logger=logger, callbacks=[callback])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit.fit(NPE(), loader(theta, x), loader(theta_cal, x_cal))
    assert not [w for w in caught if "figure" in str(w.message).lower()]
    assert set(fit.callback_metrics) >= TAGS
    assert (
        float(fit.callback_metrics["calibration/kccsd/p_value"]) == callback.history["p_value"][-1]
    )
    root = Path(logger.log_dir if kind == "csv" else tmp_path / "root")
    pngs = sorted((root / "calibration" / "kccsd" / "history").glob("*.png"))
    assert [p.name for p in pngs] == ["epoch=0000.png", "epoch=0001.png"]
    assert all(p.stat().st_size > 10_000 for p in pngs)  # a drawn figure, not an empty file
    if kind == "csv":
        with open(logger.log_dir + "/metrics.csv") as f:
            rows = [r for r in csv.DictReader(f) if r["calibration/kccsd/p_value"]]
        assert [int(r["epoch"]) for r in rows] == [0, 1]
        assert [float(r["calibration/kccsd/p_value"]) for r in rows] == pytest.approx(
            callback.history["p_value"]
        )


def test_every_callback_writes_its_figures_as_png_files_with_a_csv_logger(tmp_path):
    from calib_lightning.callbacks import LC2STNFCallback, RankCalibrationCallback

    toy = GaussianToy(dim=2)
    theta, x = toy.sample(200, torch.Generator().manual_seed(7))
    callbacks = [
        KCCSDCallback(theta, x, metric=metric()),
        RankCalibrationCallback(theta, x, metric=cl.RankCalibration(20, num_dims=2)),
        LC2STNFCallback(theta, x, metric=lc2st_metric(x[:2]), map_num_posterior_samples=200),
    ]
    logger = CSVLogger(tmp_path, name="csv", version=0)
    train = loader(*toy.sample(32, torch.Generator().manual_seed(8)))
    trainer(max_epochs=2, logger=logger, callbacks=callbacks).fit(FixedPosterior(0.0), train)
    expected = {
        "kccsd": {"history"},
        "ranks": {"history", "ecdf", "rank_histograms", "expected_coverage", "recovery",
                  "z_score_contraction"},
        "lc2st_nf": {"history", "pp", "probability_map/0", "probability_map/1"},
    }  # fmt: skip
    root = Path(logger.log_dir, "calibration")
    for name, figures in expected.items():
        written = {
            str(p.parent.relative_to(root / name)): p.name
            for p in (root / name).rglob("*.png")
        }
        assert set(written) == figures, name
        pngs = sorted((root / name / "history").glob("*.png"))
        assert [p.name for p in pngs] == ["epoch=0000.png", "epoch=0001.png"]


def test_mlflow_receives_the_figures_as_run_artifacts(tmp_path, data, monkeypatch):
    pytest.importorskip("mlflow")
    from lightning.pytorch.loggers import MLFlowLogger

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # a local store, no server
    (theta, x), (theta_cal, x_cal) = data
    callback = KCCSDCallback(theta_cal, x_cal, metric=metric())
    logger = MLFlowLogger("calib", tracking_uri=f"file:{tmp_path / 'mlruns'}")
    trainer(max_epochs=2, logger=logger, callbacks=[callback]).fit(
        NPE(), loader(theta, x), loader(theta_cal, x_cal)
    )
    artifacts = Path(tmp_path, "mlruns").rglob("artifacts/calibration/kccsd/history/*.png")
    assert sorted(p.name for p in artifacts) == ["epoch=0000.png", "epoch=0001.png"]
    metrics = logger.experiment.get_metric_history(logger.run_id, "calibration/kccsd/p_value")
    assert [m.value for m in metrics] == pytest.approx(callback.history["p_value"], rel=1e-6)


def test_the_last_epoch_is_checked_whatever_every_n_epochs(data):
    (theta, x), (theta_cal, x_cal) = data
    with_validation = KCCSDCallback(
        theta_cal, x_cal, metric=metric(), every_n_epochs=3, log_figures=False, name="val"
    )
    without = KCCSDCallback(
        theta_cal, x_cal, metric=metric(), every_n_epochs=3, log_figures=False, name="train"
    )
    trainer(max_epochs=5, callbacks=[with_validation]).fit(
        NPE(), loader(theta, x), loader(theta_cal, x_cal)
    )
    trainer(max_epochs=5, limit_val_batches=0, callbacks=[without]).fit(
        NPE(), loader(theta, x), loader(theta_cal, x_cal)
    )
    assert with_validation.epochs == [0, 2, 4]
    assert without.epochs == [0, 2, 4]
    by_steps = KCCSDCallback(theta_cal, x_cal, metric=metric(), every_n_epochs=3,
                             log_figures=False)  # fmt: skip
    steps_per_epoch = len(loader(theta, x))
    trainer(max_epochs=10, max_steps=4 * steps_per_epoch, callbacks=[by_steps]).fit(
        NPE(), loader(theta, x)
    )
    assert by_steps.epochs == [0, 2, 3]  # max_steps ends fit in epoch 3


class TestedNPE(NPE):
    def test_step(self, batch, batch_idx):
        return self.validation_step(batch, batch_idx)


def test_validate_and_test_run_a_check_when_asked(tmp_path, data):
    (theta, x), (theta_cal, x_cal) = data
    callback = KCCSDCallback(
        theta_cal, x_cal, metric=metric(), check_on=("fit", "validate", "test")
    )
    logger = CSVLogger(tmp_path, name="csv", version=0)
    fit = trainer(max_epochs=1, logger=logger, callbacks=[callback])
    module = TestedNPE()
    fit.fit(module, loader(theta, x))
    fit.validate(module, loader(theta_cal, x_cal), verbose=False)
    fit.test(module, loader(theta_cal, x_cal), verbose=False)
    assert callback.stages == ["fit", "validate", "test"]
    assert len(callback.history["p_value"]) == 3
    assert all(0 <= p <= 1 for p in callback.history["p_value"])
    assert callback.history["p_value"][1] == pytest.approx(callback.history["p_value"][2])
    quiet = KCCSDCallback(theta_cal, x_cal, metric=metric(), log_figures=False)
    fit = trainer(max_epochs=1, callbacks=[quiet])
    fit.fit(module, loader(theta, x))
    fit.validate(module, loader(theta_cal, x_cal), verbose=False)
    assert quiet.stages == ["fit"]  # the default checks during fit only
    with pytest.raises(ValueError, match="check_on must be one of"):
        KCCSDCallback(theta_cal, x_cal, check_on=("fit", "predict"))


def test_early_stopping_monitors_calibration_p_value():
    theta, x = GaussianToy(dim=2).sample(128, torch.Generator().manual_seed(0))
    empty = loader(torch.zeros(4, 1), torch.zeros(4, 1))

    def run(shift):
        callback = KCCSDCallback(theta, x, metric=metric(), log_figures=False)
        stop = EarlyStopping(
            "calibration/kccsd/p_value",
            mode="max",
            patience=100,
            divergence_threshold=0.02,
            check_on_train_epoch_end=True,
        )
        fit = trainer(max_epochs=4, callbacks=[callback, stop])
        fit.fit(FixedPosterior(shift), empty)
        return fit, callback

    fit, callback = run(shift=1.0)  # posterior mean off by one prior sd: rejected at once
    assert fit.should_stop
    assert callback.epochs == [0]
    assert callback.history["p_value"][0] < 0.02
    fit, callback = run(shift=0.0)  # the exact posterior: trains to max_epochs
    assert not fit.should_stop
    assert callback.epochs == [0, 1, 2, 3]
    assert min(callback.history["p_value"]) > 0.02


def test_resume_continues_histories_and_keeps_base_points(tmp_path, data):
    (theta, x), (theta_cal, x_cal) = data
    monitor = "calibration/kccsd/p_value"

    def run(max_epochs, seed, ckpt_path=None):
        callback = KCCSDCallback(
            theta_cal,
            x_cal,
            every_n_epochs=2,
            log_figures=False,
            metric=cl.KCCSD(num_null=100, base_points=8, seed=seed),
        )
        checkpoint = ModelCheckpoint(
            tmp_path / f"run{seed}", monitor=monitor, mode="max", save_last=True
        )
        trainer(
            max_epochs=max_epochs, callbacks=[callback, checkpoint], enable_checkpointing=True
        ).fit(NPE(seed=seed), loader(theta, x), loader(theta_cal, x_cal), ckpt_path=ckpt_path)
        return callback, checkpoint

    first, checkpoint = run(max_epochs=3, seed=0)
    assert first.epochs == [0, 1, 2]  # epoch 2 is off the schedule but the last one
    assert checkpoint.best_model_score == pytest.approx(max(first.history["p_value"]))
    # which epoch last.ckpt holds depends on Lightning's version (2.6: epoch 0, the only
    # save of a monitor that did not improve later; 2.5: the last epoch): the resumed run
    # keeps the history up to it, checks at once (so the ModelCheckpoint finds its
    # monitor), then on the schedule (epochs 1, 3, 5) and at the last epoch
    last = tmp_path / "run0" / "last.ckpt"
    saved = torch.load(last, map_location="cpu", weights_only=False)["epoch"]
    second, _ = run(max_epochs=6, seed=1, ckpt_path=last)
    resumed = {saved + 1, 5} | {e for e in range(saved + 1, 6) if (e + 1) % 2 == 0}
    assert second.epochs == first.epochs[: saved + 1] + sorted(resumed)
    for key, values in first.history.items():
        assert second.history[key][: saved + 1] == values[: saved + 1]
        assert not any(math.isnan(v) for v in second.history[key])
    # base points come from the checkpoint, not from a new draw with the new seed
    assert torch.equal(second.metric.base_points, first.metric.base_points)
    fresh = cl.KCCSD(base_points=8, seed=1)
    fresh.update(GaussianToy(dim=2).posterior(), theta_cal, x_cal)
    fresh.compute()  # the base points are fitted in the first compute
    assert not torch.allclose(fresh.base_points, first.metric.base_points)
    assert "kccsd" in summary_table([second])


def test_dataloader_and_tensors_give_the_same_test(data):
    (theta, x), (theta_cal, x_cal) = data
    base = torch.randn(8, 2, generator=torch.Generator().manual_seed(0))
    from_tensors = KCCSDCallback(
        theta_cal, x_cal, log_figures=False, metric=cl.KCCSD(num_null=100, base_points=base)
    )
    from_loader = KCCSDCallback(
        dataloader=loader(theta_cal, x_cal, batch_size=20),
        name="kccsd_loader",
        log_figures=False,
        metric=cl.KCCSD(num_null=100, base_points=base),
    )
    fit = trainer(max_epochs=1, callbacks=[from_tensors, from_loader])
    fit.fit(NPE(), loader(theta, x))
    assert from_loader.history["num_pairs"] == [96.0]
    for key in ("statistic", "p_value"):
        assert from_loader.history[key] == pytest.approx(from_tensors.history[key], rel=1e-5)
    assert "calibration/kccsd_loader/statistic" in fit.callback_metrics


def test_bad_arguments_are_named():
    theta, x = torch.zeros(8, 2), torch.zeros(8, 3)
    with pytest.raises(ValueError, match="either as tensors theta and x or as a dataloader"):
        KCCSDCallback()
    with pytest.raises(ValueError, match="either as tensors"):
        KCCSDCallback(theta, x, dataloader=loader(theta, x))
    with pytest.raises(ValueError, match="theta and x must both be given"):
        KCCSDCallback(theta)
    with pytest.raises(ValueError, match="x must have the same number of rows"):
        KCCSDCallback(theta, x[:5])
    with pytest.raises(ValueError, match="every_n_epochs must be a positive integer"):
        KCCSDCallback(theta, x, every_n_epochs=0)
    with pytest.raises(ValueError, match=r"metric must be a calib_lightning\.KCCSD"):
        KCCSDCallback(theta, x, metric=torch.nn.Linear(1, 1))
    callback = KCCSDCallback(theta, x, estimator="posterior_net")
    with pytest.raises(ValueError, match=r"'posterior_net'.*submodules are \['flow', 'head'\]"):
        trainer(max_epochs=1, callbacks=[callback]).fit(NPE(), loader(*two_moons(8, 0)))
    callback = KCCSDCallback(dataloader=[torch.zeros(4, 2)], log_figures=False)
    with pytest.raises(ValueError, match="dataloader must yield \\(theta, x\\) pairs"):
        trainer(max_epochs=1, callbacks=[callback]).fit(NPE(), loader(*two_moons(8, 0)))


class DrawCounter(KCCSDCallback):
    """Records, in a file per rank, each time it draws figures."""

    def __init__(self, *args, record_dir, **kwargs):
        super().__init__(*args, **kwargs)
        self.record_dir = record_dir

    def on_fit_start(self, trainer, pl_module):
        self.rank = trainer.global_rank

    def figures(self, result):
        with open(self.record_dir / f"figures-rank{self.rank}.txt", "a") as f:
            f.write(f"{self.tag_name}\n")
        return super().figures(result)


@pytest.mark.forks
def test_ddp_two_processes_log_figures_once_and_match_one_process(tmp_path):
    # the exact posterior of the Gaussian toy: p-values away from their floor 1 / 101
    theta_cal, x_cal = GaussianToy(dim=2).sample(80, torch.Generator().manual_seed(1))
    base = torch.randn(8, 2, generator=torch.Generator().manual_seed(0))

    def run(devices):
        record_dir = tmp_path / f"devices{devices}"
        record_dir.mkdir()
        callbacks = [  # tensors: rows split over ranks; a loader: batches split over ranks
            DrawCounter(theta_cal, x_cal, metric=metric(), record_dir=record_dir),
            DrawCounter(
                dataloader=loader(theta_cal, x_cal, batch_size=20),
                name="loader",
                metric=cl.KCCSD(num_null=100, base_points=base),
                record_dir=record_dir,
            ),
        ]
        logger = TensorBoardLogger(tmp_path, name=f"devices{devices}", version=0)
        fit = trainer(
            max_epochs=2,
            devices=devices,
            logger=logger,
            callbacks=callbacks,
            strategy="ddp_fork" if devices > 1 else "auto",
        )
        fit.fit(FixedPosterior(shift=0.0), loader(theta_cal, x_cal, batch_size=16))
        draws = {p.name: p.read_text().split() for p in sorted(record_dir.glob("figures-*"))}
        return events(logger.log_dir), draws

    (one, draws_one), (two, draws_two) = run(1), run(2)
    assert draws_two == draws_one == {"figures-rank0.txt": ["kccsd", "loader"] * 2}
    for name in ("kccsd", "loader"):
        for key in KEYS:  # per check (steps differ: each rank trains on half the batches)
            tag = f"calibration/{name}/{key}"
            expected = [e.value for e in one.Scalars(tag)]
            got = [e.value for e in two.Scalars(tag)]
            if key == "p_value":  # at most one bootstrap count may flip on float rounding
                assert got == pytest.approx(expected, abs=1.5 / 101)
            else:
                assert got == pytest.approx(expected, rel=1e-4)
        assert [e.value for e in two.Scalars(f"calibration/{name}/num_pairs")] == [80.0] * 2
        p_values = [e.value for e in one.Scalars(f"calibration/{name}/p_value")]
        assert min(p_values) > 0.05  # so their agreement is not that of two floors
        steps = [e.step for e in two.Images(f"calibration/{name}/history")]
        assert len(steps) == 2  # once per check, not once per rank
        assert len(set(steps)) == 2


@pytest.mark.parametrize("shift", [0.0, 0.4])
def test_rank_callback_logs_scalars_figures_and_rank_histograms(tmp_path, shift):
    from calib_lightning.callbacks import RankCalibrationCallback

    theta, x = GaussianToy(dim=2).sample(400, torch.Generator().manual_seed(5))
    callback = RankCalibrationCallback(theta, x, labels=["a", "b"])
    logger = TensorBoardLogger(tmp_path, name="tb", version=0)
    train = loader(*GaussianToy(dim=2).sample(64, torch.Generator().manual_seed(6)))
    trainer(max_epochs=1, logger=logger, callbacks=[callback]).fit(FixedPosterior(shift), train)

    acc = events(logger.log_dir)
    expected = (
        {"global_p_value", "p_value", "coverage_error", "num_pairs"}
        | {
            f"{key}/{d}"
            for key in ("marginal_p_values", "contraction", "mean_squared_error")
            for d in (0, 1)
        }
        | {f"ecdf_p_values/{d}" for d in (0, 1, 2)}
    )
    expected |= {f"log10_{k}" for k in expected if is_p_value(k)}  # beside every p-value
    assert set(acc.Tags()["scalars"]) - {"epoch"} == {f"calibration/ranks/{k}" for k in expected}
    figures = {"history", "ecdf", "rank_histograms", "expected_coverage", "recovery",
               "z_score_contraction"}
    assert set(acc.Tags()["images"]) == {f"calibration/ranks/{f}" for f in figures}
    kept = callback.last_result  # every pair's posterior moments, for the recovery plots
    assert kept.pair_theta.shape == kept.pair_mean.shape == kept.pair_variance.shape == (400, 2)
    torch.testing.assert_close(kept.pair_theta, theta.double())
    assert set(acc.Tags()["histograms"]) == {
        f"calibration/ranks/rank/{r}" for r in ("0", "1", "joint")
    }
    joint = acc.Histograms("calibration/ranks/rank/joint")[0].histogram_value
    assert joint.num == 400  # every calibration pair's rank
    assert 0 <= joint.min <= joint.max <= 100

    p_value = callback.history["p_value"][0]
    marginal = min(callback.history["marginal_p_values/0"], callback.history["marginal_p_values/1"])
    if shift == 0.0:  # the exact posterior
        assert p_value > 0.01
        assert marginal[0] > 0.01
    else:  # every coordinate shifted by 0.4 posterior-widths: the marginal ranks see it
        assert marginal[0] < 1e-6
    assert callback.history["contraction/0"][0] == pytest.approx(0.8, abs=0.05)


def lc2st_metric(x_o):
    return cl.LC2STNF(observations=x_o, num_null=20, num_posterior_samples=1000, seed=1)


def test_lc2st_nf_callback_logs_per_observation_tests_maps_and_reference_scores(
    tmp_path, monkeypatch
):
    import calib_lightning.callbacks.lc2st as module
    from calib_lightning.callbacks import LC2STNFCallback

    oracle_calls = []

    def recorded_oracle(*args, **kwargs):
        oracle_calls.append(kwargs)
        return cl.baselines.oracle_c2st(*args, **kwargs)

    monkeypatch.setattr(module, "oracle_c2st", recorded_oracle)
    quick = {"classifier": "mlp", "learning_rate": 1e-2, "patience": 3, "max_epochs": 200}

    toy = GaussianToy(dim=2)
    theta, x = toy.sample(300, torch.Generator().manual_seed(7))
    theta_o, x_o = toy.sample(2, torch.Generator().manual_seed(8))
    with torch.random.fork_rng():
        torch.manual_seed(9)
        reference = cl.as_posterior(toy.posterior()).sample(x_o, 500)  # exact posterior
    callback = LC2STNFCallback(
        theta, x, metric=lc2st_metric(x_o), truths=theta_o, reference_samples=reference,
        labels=["a", "b"], map_num_posterior_samples=500, oracle_kwargs=quick,
    )  # fmt: skip
    logger = TensorBoardLogger(tmp_path, name="tb", version=0)
    train = loader(*toy.sample(64, torch.Generator().manual_seed(6)))
    trainer(max_epochs=1, logger=logger, callbacks=[callback]).fit(FixedPosterior(0.0), train)

    acc = events(logger.log_dir)
    keys = ("statistic", "p_value", "mmd", "mmd_p_value", "frechet_distance",
            "reference_density", "reference_coverage", "oracle_c2st",
            "misspecification_p_value",
            "density", "coverage")  # deprecated aliases of the reference scores, until 0.3.0
    expected = {f"calibration/lc2st_nf/{k}/{o}" for k in keys for o in (0, 1)}
    expected.add("calibration/lc2st_nf/global_p_value")  # the O local tests combined
    expected |= {f"calibration/lc2st_nf/log10_{k}" for k in ("global_p_value", "p_value/0",
                 "p_value/1", "mmd_p_value/0", "mmd_p_value/1", "misspecification_p_value/0",
                 "misspecification_p_value/1")}  # fmt: skip
    assert set(acc.Tags()["scalars"]) - {"epoch"} == expected
    figures = {"history", "pp", "probability_map/0", "probability_map/1"}
    assert set(acc.Tags()["images"]) == {f"calibration/lc2st_nf/{f}" for f in figures}
    # the exact posterior: no local test rejects, and reference scores say "the same"
    for o in (0, 1):
        assert callback.history[f"p_value/{o}"][0] > 0.05
        assert callback.history[f"mmd_p_value/{o}"][0] > 0.01
        assert 0.4 < callback.history[f"oracle_c2st/{o}"][0] < 0.6
    assert oracle_calls == [{"seed": 0, **quick}]  # the oracle's settings reach it
    for new, old in (("reference_density", "density"), ("reference_coverage", "coverage")):
        for o in (0, 1):  # the alias holds the renamed score's value, in the logs too
            assert callback.history[old + f"/{o}"] == callback.history[new + f"/{o}"]
            (renamed,), (alias,) = (acc.Scalars(f"calibration/lc2st_nf/{k}/{o}")
                                    for k in (new, old))  # fmt: skip
            assert renamed.value == alias.value
    # draws like the reference: density about 1, coverage about 1 - 2^-5 (Naeem et al.)
    for o in (0, 1):
        assert 0.7 < callback.history[f"reference_density/{o}"][0] < 1.3
        assert 0.85 < callback.history[f"reference_coverage/{o}"][0] <= 1.0
    # simulator outputs: not flagged as misspecified; the p-value equals the function's
    expected_p = cl.misspecification_test(x_o, x).p_value
    logged = [callback.history[f"misspecification_p_value/{o}"][0] for o in (0, 1)]
    assert logged == pytest.approx(expected_p.tolist())
    assert min(logged) > 0.05


def test_lc2st_nf_callback_resume_does_not_retrain_the_null(tmp_path, data, monkeypatch):
    from calib_lightning.callbacks import LC2STNFCallback
    from calib_lightning.classifiers import MLPEnsemble

    fits = []
    original = MLPEnsemble.fit

    def counting(self, features, labels):
        fits.append(self.num_members)
        return original(self, features, labels)

    monkeypatch.setattr(MLPEnsemble, "fit", counting)
    (theta, x), (theta_cal, x_cal) = data

    def run(max_epochs, ckpt_path=None):
        callback = LC2STNFCallback(theta_cal, x_cal, metric=lc2st_metric(x_cal[:2]))
        save = ModelCheckpoint(dirpath=tmp_path, save_last=True)
        trainer(max_epochs=max_epochs, callbacks=[callback, save], enable_checkpointing=True).fit(
            NPE(), loader(theta, x, shuffle=True), ckpt_path=ckpt_path
        )
        return callback

    first = run(2)
    assert fits == [20, 1, 1]  # the null once (20 members), then one classifier per check
    fits.clear()
    resumed = run(4, ckpt_path=tmp_path / "last.ckpt")
    assert fits == [1, 1]  # checks at epochs 2 and 3; the null came from the checkpoint
    assert resumed.epochs == [0, 1, 2, 3]
    assert resumed.history["p_value/0"][:2] == first.history["p_value/0"]
    torch.testing.assert_close(
        resumed.metric.null.null_statistics, first.metric.null.null_statistics
    )


class DivergingPosterior(L.LightningModule):
    """The exact Gaussian-toy posterior, except that at ``bad_epoch`` its flow
    "diverges": NaN location, so NaN draws and log-probabilities."""

    def __init__(self, bad_epoch):
        super().__init__()
        self.dummy = torch.nn.Parameter(torch.zeros(()))
        self.bad_epoch = bad_epoch

    def flow(self, x):
        toy = GaussianToy(dim=2)
        loc = toy.weight * x
        if self.current_epoch == self.bad_epoch:
            loc = loc * math.nan
        scale = math.sqrt(toy.weight * toy.noise_std**2)
        return torch.distributions.Independent(
            torch.distributions.Normal(loc, scale, validate_args=False), 1
        )

    def training_step(self, batch, batch_idx):
        return self.dummy**2

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_failing_check_warns_logs_nan_and_training_goes_on(tmp_path):
    from calib_lightning.callbacks import RankCalibrationCallback

    toy = GaussianToy(dim=2)
    theta, x = toy.sample(200, torch.Generator().manual_seed(11))
    callback = RankCalibrationCallback(
        theta, x, metric=cl.RankCalibration(20, num_dims=2), log_figures=False
    )
    logger = CSVLogger(tmp_path, name="csv", version=0)
    train = loader(*toy.sample(32, torch.Generator().manual_seed(12)))
    fit = trainer(max_epochs=3, logger=logger, callbacks=[callback])
    with pytest.warns(RuntimeWarning, match=r"epoch 1 failed.*ValueError.*(NaN|nan)"):
        fit.fit(DivergingPosterior(bad_epoch=1), train)

    assert fit.current_epoch == 3  # all epochs ran
    assert callback.epochs == [0, 1, 2]
    assert [epoch for epoch, _ in callback.errors] == [1]
    verdicts = callback.history["global_p_value"]
    assert math.isfinite(verdicts[0])
    assert math.isnan(verdicts[1])
    assert math.isfinite(verdicts[2])
    assert all(math.isnan(values[1]) for values in callback.history.values())
    with open(f"{logger.log_dir}/metrics.csv") as f:  # the logger got NaN at the failed check
        rows = [r for r in csv.DictReader(f) if r.get("calibration/ranks/global_p_value")]
    logged = [float(r["calibration/ranks/global_p_value"]) for r in rows]
    assert len(logged) == 3
    assert math.isnan(logged[1])
    assert logged[0] > 0
    assert logged[2] > 0
    assert "not rejected" in summary_table([callback])  # verdict of the last check

    callback.history["global_p_value"][-1] = math.nan  # a run whose last check failed
    assert "check failed" in summary_table([callback])


def test_failing_check_raises_with_on_error_raise():
    from calib_lightning.callbacks import RankCalibrationCallback

    toy = GaussianToy(dim=2)
    theta, x = toy.sample(200, torch.Generator().manual_seed(11))
    callback = RankCalibrationCallback(
        theta, x, metric=cl.RankCalibration(20, num_dims=2), on_error="raise", log_figures=False
    )
    train = loader(*toy.sample(32, torch.Generator().manual_seed(12)))
    fit = trainer(max_epochs=3, callbacks=[callback])
    with pytest.raises(ValueError, match=r"(NaN|nan)"):
        fit.fit(DivergingPosterior(bad_epoch=1), train)
    assert callback.epochs == [0]  # the failed check left no entry
    assert fit.current_epoch == 1
    with pytest.raises(ValueError, match="on_error must be one of"):
        RankCalibrationCallback(theta, x, on_error="ignore")


def test_summary_gives_one_verdict_per_check_and_never_prints_zero():
    from calib_lightning.callbacks import RankCalibrationCallback
    from calib_lightning.functional.bands import P_VALUE_FLOOR

    theta, x = torch.zeros(4, 2), torch.zeros(4, 2)
    ranks = RankCalibrationCallback(theta, x)
    ranks.epochs = [0, 5]
    ranks.history = {  # every test of a calibrated check is "significant" at 0.05 alone...
        "global_p_value": [P_VALUE_FLOOR, 0.2],
        "p_value": [P_VALUE_FLOOR, 0.03],
        "coverage_error": [-0.2, 0.01],
        "marginal_p_values/0": [1e-9, 0.04],
    }
    kccsd = KCCSDCallback(theta, x)
    kccsd.epochs, kccsd.history = [0, 5], {"p_value": [0.001, 0.01], "statistic": [3.0, 1.0]}
    table = summary_table([ranks, kccsd]).splitlines()
    verdicts = [line for line in table[1:] if line.endswith("rejected")]
    assert len(verdicts) == 2  # one per check
    assert verdicts[0].split()[:2] == ["ranks", "global_p_value"]
    assert verdicts[0].endswith("not rejected")  # ...but the check's verdict is the global one
    assert verdicts[1].split()[:2] == ["kccsd", "p_value"]
    assert verdicts[1].endswith(" rejected")
    assert "< 2.2e-308" in table[1]
    assert " 0 " not in " ".join(table)

    class Local(CalibrationCallback):  # a check with several p-values and no global one
        history_keys = ("p_value",)

    local = Local(cl.KCCSD(), theta, x, name="local")
    local.epochs, local.history = [0, 5], {"p_value/0": [0.5, 0.004], "p_value/1": [0.5, 0.9]}
    (row,) = [line for line in summary_table([local]).splitlines() if "rejected" in line]
    combined = cl.functional.combine_p_values(torch.tensor([0.004, 0.9], dtype=torch.float64))
    assert row.split()[:2] == ["local", "global_p_value"]
    assert row.endswith(" rejected")
    assert f"{float(combined):.4g}" in row


def test_underflowing_p_values_are_logged_and_kept_above_zero(tmp_path):
    from calib_lightning.callbacks import RankCalibrationCallback
    from calib_lightning.callbacks._scalars import P_VALUE_TAG_FLOOR
    from calib_lightning.functional.bands import P_VALUE_FLOOR

    toy = GaussianToy(dim=2)
    theta, x = toy.sample(2000, torch.Generator().manual_seed(13))
    callback = RankCalibrationCallback(theta, x, log_figures=False)
    logger = CSVLogger(tmp_path, name="csv", version=0)
    train = loader(*toy.sample(32, torch.Generator().manual_seed(14)))
    # shifted by 3 posterior widths: every truth below every draw, chi-square tail ~ 1e-8000
    trainer(max_epochs=1, logger=logger, callbacks=[callback]).fit(FixedPosterior(1.5), train)
    assert callback.history["p_value"] == [P_VALUE_FLOOR]
    assert callback.history["global_p_value"][0] > 0
    with open(f"{logger.log_dir}/metrics.csv") as f:
        (row,) = [r for r in csv.DictReader(f) if r.get("calibration/ranks/p_value")]
    # the tag reads float32's smallest normal in every logger; its log10 the float64 floor
    assert float(row["calibration/ranks/p_value"]) == P_VALUE_TAG_FLOOR
    assert float(row["calibration/ranks/log10_p_value"]) == pytest.approx(math.log10(P_VALUE_FLOOR))
    assert "< 2.2e-308" in summary_table([callback])


def test_history_figure_wraps_many_scalars_and_reads_every_p_value_on_a_log_axis():
    from calib_lightning.plots.history import MAX_COLUMNS, plot_history

    epochs = [0, 3, 6]
    history = {f"p_value/{o}": [1e-6, 0.02, 0.5] for o in range(50)}
    history["statistic"] = [3.0, 1.0, 0.1]
    fig = plot_history(epochs, history, level=0.05)
    visible = [ax for ax in fig.axes if ax.get_visible()]
    assert len(visible) == 51
    width = fig.get_size_inches()[0]
    assert width <= MAX_COLUMNS * 3.6 + 1e-9  # at most MAX_COLUMNS panels side by side
    columns = {round(ax.get_position().x0, 3) for ax in visible}
    assert len(columns) <= MAX_COLUMNS
    scales = {ax.get_ylabel(): ax.get_yscale() for ax in visible}
    assert scales["p_value/7"] == "log"
    assert scales["statistic"] == "linear"


class CountingNPE(TestedNPE):
    """Counts its training steps: a setup error must come before the first."""

    steps = 0

    def training_step(self, batch, batch_idx):
        type(self).steps += 1
        return super().training_step(batch, batch_idx)


WRONG_THETA = r"theta must have D = 2 columns like the posterior's event shape \(2,\), got shape"


def every_callback(theta, x, observations):
    from calib_lightning.callbacks import (
        LatentCalibrationCallback,
        LC2STNFCallback,
        RankCalibrationCallback,
        TARPCallback,
    )

    quiet = {"log_figures": False, "on_error": "warn"}  # a setup error raises all the same
    return {
        "ranks": lambda: RankCalibrationCallback(theta, x, **quiet),
        "tarp": lambda: TARPCallback(theta, x, **quiet),
        "kccsd": lambda: KCCSDCallback(theta, x, metric=metric(), **quiet),
        "latent": lambda: LatentCalibrationCallback(theta, x, **quiet),
        "lc2st_nf": lambda: LC2STNFCallback(
            theta, x, metric=cl.LC2STNF(observations, num_null=3, num_posterior_samples=16),
            **quiet,
        ),
    }


@pytest.mark.parametrize("name", ["ranks", "tarp", "kccsd", "latent", "lc2st_nf"])
def test_calibration_data_that_do_not_fit_the_estimator_fail_at_the_start_of_fit(data, name):
    """Issue 22: ``RankCalibrationCallback(theta[:, :1], x)`` on a 2-parameter flow raises
    the metric's ValueError before the first training step, not NaN after an epoch."""
    (theta, x), (theta_cal, x_cal) = data
    cases = [
        (theta_cal[:, :1], x_cal, x_cal[:2], WRONG_THETA + r" \(96, 1\)"),
        (torch.cat([theta_cal, theta_cal], 1), x_cal, x_cal[:2], WRONG_THETA + r" \(96, 4\)"),
        (theta_cal, x_cal[:, :1], x_cal[:2, :1],
         r"x must have shape \(N, 2\) for this posterior's context, got \(96, 1\)"),
    ]  # fmt: skip
    if name == "lc2st_nf":
        cases.append((theta_cal, x_cal, x_cal[:2, :1],
                      r"observations must have shape \(O, 2\) like x \(96, 2\)"))  # fmt: skip
    for bad_theta, bad_x, observations, match in cases:
        callback = every_callback(bad_theta, bad_x, observations)[name]()
        CountingNPE.steps = 0
        with pytest.raises(ValueError, match=match):
            trainer(max_epochs=1, callbacks=[callback]).fit(CountingNPE(), loader(theta, x))
        assert CountingNPE.steps == 0
        assert callback.epochs == []


def test_setup_check_runs_at_validate_and_test_and_on_dataloaders(data):
    (theta, x), (theta_cal, x_cal) = data
    module = CountingNPE()
    for stage in ("validate", "test"):
        callback = KCCSDCallback(theta_cal[:, :1], x_cal, metric=metric(), check_on=(stage,))
        run = getattr(trainer(callbacks=[callback]), stage)
        with pytest.raises(ValueError, match=WRONG_THETA + r" \(96, 1\)"):
            run(module, loader(theta_cal, x_cal), verbose=False)
    callback = KCCSDCallback(dataloader=loader(theta_cal[:, :1], x_cal, batch_size=32),
                             metric=metric())  # fmt: skip
    with pytest.raises(ValueError, match=WRONG_THETA + r" \(32, 1\)"):
        trainer(max_epochs=1, callbacks=[callback]).fit(module, loader(theta, x))
    # a stage that runs no check checks nothing: fit with check_on=("test",) trains
    callback = KCCSDCallback(theta_cal[:, :1], x_cal, metric=metric(), check_on=("test",))
    CountingNPE.steps = 0
    trainer(max_epochs=1, callbacks=[callback]).fit(module, loader(theta, x))
    assert CountingNPE.steps > 0


def test_lc2st_nf_callback_names_truths_and_reference_samples_of_the_wrong_width(data):
    from calib_lightning.callbacks import LC2STNFCallback

    theta, x = data[1]
    for name, value in (("truths", torch.zeros(2, 3)), ("reference_samples", torch.zeros(5, 2, 3))):
        with pytest.raises(ValueError, match=rf"{name} must have shape .* and D = 2 like theta"):
            LC2STNFCallback(theta, x, observations=x[:2], **{name: value})
