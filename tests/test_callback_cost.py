"""The cost warning of the calibration callbacks: each check against the epoch's training.

What must hold: a check is compared with the epoch's training and validation, never
with the checks of other calibration callbacks that ran before it in the same epoch
(a second callback used to read the first one's check as "epoch"); the ratio reads as
words ("about as long as", "2.4x"), never "1 times an epoch's".
"""

import re
import time
import warnings

import lightning as L
import pytest
import torch
import zuko
from torch.utils.data import DataLoader, TensorDataset

from calib_lightning.callbacks import CalibrationCallback
from calib_lightning.callbacks._plumbing import cost_words
from calib_lightning.tasks import GaussianToy

CHECK_SECONDS = 0.6


class Slow(torch.nn.Module):
    """A metric whose check sleeps ``CHECK_SECONDS``, far longer than the tiny epoch."""

    def update(self, posterior, theta, x):
        time.sleep(CHECK_SECONDS)

    def compute(self):
        return {"p_value": torch.tensor(0.5)}

    def reset(self):
        pass


class Module(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.flow = zuko.flows.MAF(2, 2)

    def training_step(self, batch, batch_idx):
        return -self.flow(batch[1]).log_prob(batch[0]).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-3)


_EPOCH = re.compile(r"\(([0-9.e+-]+) s: training and validation")


def test_each_check_is_compared_with_the_training_without_the_other_checks(tmp_path):
    theta, x = GaussianToy(dim=2).sample(16, torch.Generator().manual_seed(0))
    first, second, third = (CalibrationCallback(Slow(), theta, x, log_figures=False,
                                                name=n) for n in ("a", "b", "c"))  # fmt: skip
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False, callbacks=[first, second, third],
                        default_root_dir=tmp_path)  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(Module(), DataLoader(TensorDataset(theta, x), batch_size=16))
    messages = [str(w.message) for w in caught if "one check took" in str(w.message)]
    assert len(messages) == 3, messages  # each check is long next to a one-batch epoch
    epochs = [float(_EPOCH.search(m).group(1)) for m in messages]
    # the second and third checks see the epoch's training only: before the fix, 0.6 s
    # (the first check) and 1.2 s (two checks) more than the first one did
    assert max(epochs) < min(epochs) + CHECK_SECONDS / 2, (epochs, messages)
    assert max(epochs) < CHECK_SECONDS / 2, messages
    for callback in (first, second, third):  # each its own check, nothing else
        assert CHECK_SECONDS <= callback.seconds[0] < 2 * CHECK_SECONDS
        assert CHECK_SECONDS <= callback.epoch_check_seconds < 2 * CHECK_SECONDS
    assert all("x an epoch's training" in m for m in messages), messages


def test_the_cost_warning_subtracts_earlier_checks_and_says_the_ratio_in_words():
    callback = CalibrationCallback(Slow(), *GaussianToy(dim=2).sample(4, torch.Generator()))
    callback._epoch_start = 100.0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        callback.warn_cost(110.0, 2.0, "fit", 2.0)  # 0.25 of 8 s of training: quiet
    # started 10 s into the epoch, 6 s of which were other callbacks' checks: 4 s training
    with pytest.warns(RuntimeWarning, match=r"took 9.6 s, 2.4x an epoch's training \(4 s: "):
        callback.warn_cost(110.0, 9.6, "fit", 6.0)
    fresh = CalibrationCallback(Slow(), *GaussianToy(dim=2).sample(4, torch.Generator()))
    fresh._epoch_start = 100.0
    with pytest.warns(RuntimeWarning, match=r"took 10 s, about as long as an epoch's training"):
        fresh.warn_cost(110.0, 10.0, "fit")


@pytest.mark.parametrize(
    ("seconds", "words"),
    [
        (3.0, "30% of an epoch's training"),
        (9.4, "about as long as an epoch's training"),
        (10.0, "about as long as an epoch's training"),
        (11.4, "about as long as an epoch's training"),
        (12.0, "1.2x an epoch's training"),
        (24.4, "2.4x an epoch's training"),
        (99.0, "9.9x an epoch's training"),
        (9400.0, "940x an epoch's training"),
    ],
)
def test_cost_words_read_as_a_share_a_match_or_a_multiple(seconds, words):
    assert cost_words(seconds, 10.0) == words


def test_cost_words_of_an_instant_epoch():
    assert cost_words(1.0, 0.0) == "longer than an epoch's training"
