"""What reaches the loggers: tiny p-values without underflow, read back from the files.

What must hold: a p-value of 1e-100 arrives in a CSVLogger file and in a TensorBoard
event file (float32, where 1e-100 is 0) as the same readable floor, float32's smallest
normal number, and as its exact log10; every p-value tag, vector entries included, has
its ``log10_`` tag and no count does; a failed check logs NaN for both; the history and
the summary table keep and print the tiny value.
"""

import csv
import math
from contextlib import nullcontext

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger, MLFlowLogger, TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from calib_lightning.callbacks import CalibrationCallback, summary_table
from calib_lightning.callbacks._scalars import P_VALUE_TAG_FLOOR, is_p_value, logged_scalars
from calib_lightning.functional.bands import P_VALUE_FLOOR
from calib_lightning.tasks import GaussianToy

TINY = 1e-100


class FixedResult(nn.Module):
    """A metric whose result is fixed: p-values far below float32's range."""

    def __init__(self, fail=False):
        super().__init__()
        self.fail = fail

    def reset(self):
        pass

    def update(self, posterior, theta, x):
        if self.fail:
            raise RuntimeError("this check fails")

    def compute(self):
        f64 = torch.float64
        return {
            "global_p_value": torch.tensor(TINY, dtype=f64),
            "p_value": torch.tensor(4.7e-156, dtype=f64),
            "marginal_p_values": torch.tensor([TINY, 0.5, 0.0], dtype=f64),
            "statistic": torch.tensor(3.25, dtype=f64),
        }


class Fixed(CalibrationCallback):
    name = "fixed"
    history_keys = ("global_p_value", "p_value")


class Module(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(()))
        self.flow = GaussianToy(dim=2).posterior()

    def training_step(self, batch, batch_idx):
        return self.weight**2

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit(loggers, metric=None):
    theta, x = GaussianToy(dim=2).sample(8, torch.Generator().manual_seed(0))
    callback = Fixed(metric or FixedResult(), theta, x, log_figures=False)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_epochs=1, logger=loggers, callbacks=[callback],
        log_every_n_steps=1, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=False,
    )  # fmt: skip
    failing = metric is not None and metric.fail
    with pytest.warns(RuntimeWarning, match="this check fails") if failing else nullcontext():
        trainer.fit(Module(), DataLoader(TensorDataset(theta, x), batch_size=8))
    return callback


def csv_row(logger):
    with open(f"{logger.log_dir}/metrics.csv") as f:
        (row,) = [r for r in csv.DictReader(f) if r.get("calibration/fixed/p_value")]
    return row


def tensorboard_scalars(logger):
    acc = EventAccumulator(logger.log_dir, size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: acc.Scalars(tag)[-1].value for tag in acc.Tags()["scalars"]}


def test_a_p_value_of_1e_100_reaches_csv_and_tensorboard(tmp_path):
    csv_logger = CSVLogger(tmp_path, name="csv", version=0)
    tensorboard = TensorBoardLogger(tmp_path, name="tb", version=0)
    callback = fit([csv_logger, tensorboard])

    row = csv_row(csv_logger)
    tag = "calibration/fixed/"
    # every logger stores the same floor for the p-value, and its exact log10
    assert float(row[tag + "global_p_value"]) == P_VALUE_TAG_FLOOR
    assert float(row[tag + "p_value"]) == P_VALUE_TAG_FLOOR
    assert float(row[tag + "marginal_p_values/0"]) == P_VALUE_TAG_FLOOR
    assert float(row[tag + "marginal_p_values/1"]) == 0.5
    assert float(row[tag + "log10_global_p_value"]) == pytest.approx(-100.0, abs=1e-12)
    assert float(row[tag + "log10_p_value"]) == pytest.approx(math.log10(4.7e-156), abs=1e-12)
    # a p-value of exactly 0 (a metric of one's own) gets the float64 floor, not -inf
    assert float(row[tag + "log10_marginal_p_values/2"]) == pytest.approx(
        math.log10(P_VALUE_FLOOR), abs=1e-9
    )
    assert float(row[tag + "statistic"]) == 3.25
    assert tag + "log10_statistic" not in row

    scalars = tensorboard_scalars(tensorboard)
    # TensorBoard stores float32: the floor is its smallest normal number, not 0 ...
    assert scalars[tag + "global_p_value"] == pytest.approx(P_VALUE_TAG_FLOOR, rel=1e-6)
    assert scalars[tag + "global_p_value"] == pytest.approx(float(row[tag + "global_p_value"]))
    # ... and its log10 is exact
    assert scalars[tag + "log10_global_p_value"] == -100.0
    assert scalars[tag + "log10_marginal_p_values/0"] == -100.0
    assert scalars[tag + "log10_marginal_p_values/1"] == pytest.approx(math.log10(0.5))
    assert scalars[tag + "log10_p_value"] == pytest.approx(math.log10(4.7e-156), abs=1e-4)

    # the history and the summary table keep the float64 value and print it
    assert callback.history["global_p_value"] == [TINY]
    assert "log10_global_p_value" not in callback.history
    table = summary_table([callback])
    assert "1e-100" in table
    assert " rejected" in table


def test_mlflow_stores_the_floor_and_the_exact_log10(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # a file store: no database to set up
    logger = MLFlowLogger(experiment_name="logs", tracking_uri=f"file:{tmp_path / 'mlruns'}")
    fit([logger])
    history = logger.experiment.get_metric_history(logger.run_id, "calibration/fixed/p_value")
    assert [m.value for m in history] == [P_VALUE_TAG_FLOOR]
    history = logger.experiment.get_metric_history(
        logger.run_id, "calibration/fixed/log10_global_p_value"
    )
    assert [m.value for m in history] == [pytest.approx(-100.0)]


def test_a_failed_check_logs_nan_for_the_p_value_and_its_log10(tmp_path):
    logger = CSVLogger(tmp_path, name="csv", version=0)
    fit([logger], metric=FixedResult(fail=True))
    with open(f"{logger.log_dir}/metrics.csv") as f:
        (row,) = [r for r in csv.DictReader(f) if r.get("calibration/fixed/global_p_value")]
    assert math.isnan(float(row["calibration/fixed/global_p_value"]))
    assert math.isnan(float(row["calibration/fixed/log10_global_p_value"]))


def test_p_value_keys_and_their_log10():
    keys = ["p_value", "global_p_value", "p_value/3", "marginal_p_values/0",
            "ecdf_p_values/joint", "ecdf_p_values/min", "mmd_p_value/1",
            "misspecification_p_value/0", "statistic_ecdf_p_values/mean"]  # fmt: skip
    others = ["statistic", "coverage_error", "marginal_p_values/num_rejected", "oracle_c2st/0"]
    assert all(is_p_value(k) for k in keys)
    assert not any(is_p_value(k) for k in others)
    scalars = {k: torch.tensor(1e-3) for k in keys + others}
    out = logged_scalars(scalars)
    assert set(out) == set(scalars) | {f"log10_{k}" for k in keys}
    assert all(v.dtype == torch.float64 for v in out.values())
    assert float(out["log10_p_value/3"]) == pytest.approx(-3.0, abs=1e-6)  # from float32 1e-3
    nan = logged_scalars({"p_value": torch.tensor(math.nan)})
    assert math.isnan(float(nan["log10_p_value"]))


def test_summary_table_prints_tiny_p_values_of_every_p_value_field():
    theta, x = GaussianToy(dim=2).sample(8, torch.Generator().manual_seed(0))

    class Marginal(CalibrationCallback):
        name = "marginal"
        history_keys = ("marginal_p_values", "statistic")

    callback = Marginal(FixedResult(), theta, x)
    callback.epochs = [0, 3]
    callback.history = {"marginal_p_values/0": [0.5, TINY], "marginal_p_values/1": [0.5, 0.0],
                        "statistic": [1e-100, 2.0]}  # fmt: skip
    rows = {line.split()[1]: line for line in summary_table([callback]).splitlines()[1:]}
    assert rows["marginal_p_values/0"].split()[-1] == "1e-100"
    assert "< 2.2e-308" in rows["marginal_p_values/1"]  # never 0
    assert rows["statistic"].split()[2] == "1e-100"


def test_renamed_recalibration_scores_are_logged_under_both_names(tmp_path):
    """``latent_coverage_error_before`` / ``_after`` (the latent-ball regions, beside the
    ``hpd_`` ones) and, until 0.3.0, their old names with the same values."""
    import zuko

    from calib_lightning.callbacks import RecalibrationCallback
    from calib_lightning.callbacks.recalibration import RENAMED_TAGS

    class NPE(L.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.flow = zuko.flows.MAF(2, 2, transforms=1, hidden_features=(16, 16))

        def training_step(self, batch, batch_idx):
            return -self.flow(batch[1]).log_prob(batch[0]).mean()

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-2)

    toy = GaussianToy(dim=2)
    theta, x = toy.sample(200, torch.Generator().manual_seed(8))
    callback = RecalibrationCallback(*toy.sample(100, torch.Generator().manual_seed(9)),
                                     method="scale+radial")  # fmt: skip
    logger = CSVLogger(tmp_path, name="csv", version=0)
    trainer = L.Trainer(max_epochs=2, logger=logger, callbacks=[callback],
                        enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False)  # fmt: skip
    trainer.fit(NPE(), DataLoader(TensorDataset(theta, x), batch_size=50))
    with open(f"{logger.log_dir}/metrics.csv") as f:
        (row,) = [r for r in csv.DictReader(f) if r.get("calibration/recalibration/nll_after")]
    assert set(RENAMED_TAGS) == {"latent_coverage_error_before", "latent_coverage_error_after"}
    for new, old in RENAMED_TAGS.items():
        assert row[f"calibration/recalibration/{new}"] != ""
        assert row[f"calibration/recalibration/{old}"] == row[f"calibration/recalibration/{new}"]
        assert callback.scores[old] == callback.scores[new]
