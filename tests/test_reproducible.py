"""One seed, the same numbers: ``cl.diagnose``, the command line and the callbacks (issue 22).

What must hold: two identical calls of ``cl.diagnose(..., seed=s)`` give identical
tables and identical result fields, and leave the caller's global random state (torch,
numpy, Python) where it was; another seed gives other numbers for a sampling check; the
command line passes ``--seed`` through. Two identical trainings with calibration
callbacks log identical numbers, and a training with the callbacks ends with the same
weights as without them (the checks draw from a forked random state).
"""

from __future__ import annotations

import dataclasses
import json
import random
import textwrap

import lightning as L
import numpy as np
import torch
import zuko
from torch.utils.data import DataLoader, TensorDataset

import calib_lightning as cl
from calib_lightning.__main__ import main
from calib_lightning._utils.random import cuda_devices, derived_seed, seeded
from calib_lightning.callbacks import KCCSDCallback, RankCalibrationCallback, TARPCallback
from calib_lightning.tasks import GaussianToy

TOY = GaussianToy(dim=2)


def fields(result: object) -> dict[str, object]:
    """Every field of a typed result (or entry of a dict result)."""
    if dataclasses.is_dataclass(result):
        return {f.name: getattr(result, f.name) for f in dataclasses.fields(result)}
    if isinstance(result, dict):
        return dict(result)
    return dict(result._asdict()) if hasattr(result, "_asdict") else {"value": result}


def assert_identical(a: object, b: object, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        assert a.shape == b.shape, where
        assert a.dtype == b.dtype, where
        assert torch.equal(a.nan_to_num(-7.0), b.nan_to_num(-7.0)), where
    elif dataclasses.is_dataclass(a) or isinstance(a, dict):
        fa, fb = fields(a), fields(b)
        assert fa.keys() == fb.keys(), where
        for key in fa:
            assert_identical(fa[key], fb[key], f"{where}.{key}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), where
        for i, (u, v) in enumerate(zip(a, b, strict=True)):
            assert_identical(u, v, f"{where}[{i}]")
    elif isinstance(a, float) and a != a:
        assert b != b, where
    else:
        assert a == b, where


def global_states() -> tuple[torch.Tensor, tuple, object]:
    numpy_state = np.random.get_state()  # noqa: NPY002 - the legacy global state, on purpose
    return torch.get_rng_state(), numpy_state[1].copy(), random.getstate()


def test_diagnose_twice_with_one_seed_gives_identical_numbers_and_keeps_the_global_state():
    theta, x = TOY.sample(200, torch.Generator().manual_seed(0))
    observations = TOY.sample(2, torch.Generator().manual_seed(1))[1]
    posterior = TOY.posterior(variance_scale=0.9)
    torch.manual_seed(123)
    np.random.seed(123)  # noqa: NPY002 - the caller's global state, kept
    random.seed(123)
    before = global_states()
    runs = [
        cl.diagnose(posterior, theta, x, observations=observations, seed=7,
                    num_posterior_samples=50, prior=TOY.prior())
        for _ in range(2)
    ]
    after = global_states()
    assert torch.equal(before[0], after[0])
    assert np.array_equal(before[1], after[1])
    assert before[2] == after[2]
    first, second = runs
    assert first.table() == second.table()
    assert first.verdict == second.verdict
    assert first.checks.keys() == second.checks.keys() == {*cl.diagnosis.CHECKS} - {
        "lc2st", "coverage_is", "balance", "interval_coverage"}
    for name in first.checks:
        assert_identical(first.checks[name], second.checks[name], name)
    other = cl.diagnose(posterior, theta, x, seed=8, num_posterior_samples=50,
                        checks=("ranks", "tarp"))  # fmt: skip
    assert float(other.checks["ranks"].p_value) != float(first.checks["ranks"].p_value)
    assert float(other.checks["tarp"].p_value) != float(first.checks["tarp"].p_value)


def test_a_checks_numbers_do_not_depend_on_the_other_checks():
    theta, x = TOY.sample(200, torch.Generator().manual_seed(2))
    posterior = TOY.posterior()
    alone = cl.diagnose(posterior, theta, x, checks=("tarp",), num_posterior_samples=30)
    together = cl.diagnose(posterior, theta, x, checks=("kccsd", "ranks", "tarp"),
                           num_posterior_samples=30)  # fmt: skip
    assert_identical(alone.checks["tarp"], together.checks["tarp"], "tarp")


def test_seeded_forks_and_restores_every_global_generator():
    before = global_states()
    with seeded(3, 1, 2) as stream:
        assert stream == derived_seed(3, 1, 2)
        first = (torch.rand(3), np.random.rand(3), random.random())  # noqa: NPY002
    with seeded(3, 1, 2):
        again = (torch.rand(3), np.random.rand(3), random.random())  # noqa: NPY002
    with seeded(3, 1, 3):
        other = torch.rand(3)
    after = global_states()
    assert torch.equal(first[0], again[0])
    assert not torch.equal(first[0], other)
    assert np.array_equal(first[1], again[1])
    assert first[2] == again[2]
    assert torch.equal(before[0], after[0])
    assert np.array_equal(before[1], after[1])
    assert before[2] == after[2]
    assert cuda_devices(torch.zeros(1), torch.nn.Linear(2, 2), None) == []


MODULE = '''
import lightning as L
import torch
import zuko


class ToyNPE(L.LightningModule):
    def __init__(self, features: int = 2):
        super().__init__()
        self.save_hyperparameters()
        self.flow = zuko.flows.MAF(features, features, transforms=2, hidden_features=(16,))

    def training_step(self, batch, batch_idx):
        theta, x = batch
        return -self.flow(x).log_prob(theta).mean()

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)
'''


def test_command_line_passes_the_seed_through(tmp_path, monkeypatch, capsys):
    (tmp_path / "repro_npe.py").write_text(textwrap.dedent(MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    from repro_npe import ToyNPE

    theta, x = TOY.sample(256, torch.Generator().manual_seed(1))
    trainer = L.Trainer(max_epochs=1, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=tmp_path)  # fmt: skip
    trainer.fit(ToyNPE(), DataLoader(TensorDataset(theta, x), batch_size=128))
    trainer.save_checkpoint(tmp_path / "last.ckpt")
    cal_theta, cal_x = TOY.sample(100, torch.Generator().manual_seed(2))
    torch.save({"theta": cal_theta, "x": cal_x}, tmp_path / "cal.pt")

    def run(seed: int, out: str) -> dict:
        code = main([
            "diagnose", "--module", "repro_npe:ToyNPE", "--checkpoint",
            str(tmp_path / "last.ckpt"), "--data", str(tmp_path / "cal.pt"), "--out",
            str(tmp_path / out), "--num-posterior-samples", "30", "--checks", "ranks,tarp",
            "--seed", str(seed),
        ])  # fmt: skip
        assert code == 0
        summary = json.loads((tmp_path / out / "summary.json").read_text())
        return [{k: v for k, v in row.items() if k != "seconds"} for row in summary["checks"]]

    first, second, other = run(5, "a"), run(5, "b"), run(6, "c")
    printed = capsys.readouterr().out
    assert first == second
    assert first != other
    module = ToyNPE.load_from_checkpoint(tmp_path / "last.ckpt", map_location="cpu").eval()
    with torch.no_grad():
        direct = cl.diagnose(module.flow, cal_theta, cal_x, checks=("ranks", "tarp"),
                             num_posterior_samples=30, seed=5)  # fmt: skip
    assert direct.table() in printed  # the command line's numbers are diagnose's, seed 5


class DropoutNPE(L.LightningModule):
    """A tiny flow behind a dropout layer: training draws from the global generator
    (dropout masks, shuffled batches), so a check that touched it would change the
    weights."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Sequential(torch.nn.Linear(2, 8), torch.nn.Dropout(0.2))
        self.net = zuko.flows.MAF(2, 8, transforms=1, hidden_features=(16,))

    def flow(self, x):
        return self.net(self.embed(x))

    def training_step(self, batch, batch_idx):
        theta, x = batch
        return -self.flow(x).log_prob(theta).mean()

    def validation_step(self, batch, batch_idx):
        theta, x = batch
        self.log("val_loss", -self.flow(x).log_prob(theta).mean())

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


def train(callbacks: list, seed: int = 0) -> DropoutNPE:
    L.seed_everything(seed, verbose=False)
    model = DropoutNPE()
    theta, x = TOY.sample(128, torch.Generator().manual_seed(3))
    val = TOY.sample(64, torch.Generator().manual_seed(4))
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_epochs=3, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, callbacks=callbacks,
    )  # fmt: skip
    trainer.fit(model, DataLoader(TensorDataset(theta, x), batch_size=32, shuffle=True),
                DataLoader(TensorDataset(*val), batch_size=64))  # fmt: skip
    return model


def calibration_callbacks() -> list:
    theta, x = TOY.sample(100, torch.Generator().manual_seed(5))
    common = {"log_figures": False, "estimator": lambda module: module.flow}
    return [
        RankCalibrationCallback(theta, x, metric=cl.RankCalibration(20, num_dims=2), **common),
        TARPCallback(theta, x, metric=cl.TARP(num_posterior_samples=20), **common),
        KCCSDCallback(theta, x, metric=cl.KCCSD(num_null=50, base_points=8), **common),
    ]


def test_callbacks_log_identical_numbers_and_leave_the_training_unchanged():
    plain = train([])
    first, second = calibration_callbacks(), calibration_callbacks()
    with_checks, again = train(first), train(second)
    for a, b in zip(first, second, strict=True):
        assert a.epochs == b.epochs == [0, 1, 2]
        assert a.history.keys() == b.history.keys()
        for key in a.history:
            assert np.array_equal(a.history[key], b.history[key], equal_nan=True), key
    # the sampling checks draw fresh numbers at every epoch (seeded by the epoch)
    assert len(set(first[0].history["p_value"])) > 1
    for model in (with_checks, again):
        for (name, p), q in zip(plain.state_dict().items(), model.state_dict().values(),
                                strict=True):  # fmt: skip
            assert torch.equal(p, q), name


def test_another_callback_seed_gives_other_draws():
    theta, x = TOY.sample(100, torch.Generator().manual_seed(5))
    histories = []
    for seed in (0, 1):
        callback = RankCalibrationCallback(
            theta, x, metric=cl.RankCalibration(20, num_dims=2), log_figures=False,
            estimator=lambda module: module.flow, seed=seed,
        )  # fmt: skip
        train([callback])
        histories.append(callback.history["p_value"])
    assert histories[0] != histories[1]


def test_every_callback_takes_a_seed():
    from calib_lightning.callbacks import LatentCalibrationCallback, LC2STNFCallback

    theta, x = TOY.sample(10, torch.Generator().manual_seed(5))
    callbacks = [
        LatentCalibrationCallback(theta, x, seed=3),
        LC2STNFCallback(theta, x, observations=x[:2], seed=3),
        RankCalibrationCallback(theta, x, seed=3),
        TARPCallback(theta, x, seed=3),
        KCCSDCallback(theta, x, seed=3),
    ]
    assert [c.seed for c in callbacks] == [3] * 5
