"""The Keras callback during a BayesFlow ``fit``: the Lightning callbacks' scalars and
figures, under their tags, in TensorBoard (read back with ``EventAccumulator``) and in
Keras' logs. Skipped without bayesflow."""

import os

import numpy as np
import pytest
import torch

os.environ.setdefault("KERAS_BACKEND", "torch")
_GRAD = torch.is_grad_enabled()
bf = pytest.importorskip("bayesflow")
torch.set_grad_enabled(_GRAD)  # bayesflow turns autograd off when it is imported
keras = pytest.importorskip("keras")

import calib_lightning as cl  # noqa: E402
from calib_lightning.callbacks import RankCalibrationCallback, TARPCallback  # noqa: E402
from calib_lightning.keras import KerasCalibrationCallback  # noqa: E402


def simulate(n: int, seed: int) -> dict[str, np.ndarray]:
    g = np.random.default_rng(seed)
    theta = g.normal(size=(n, 2))
    return {"theta": theta, "x": theta + 0.5 * g.normal(size=(n, 2))}


def test_the_callback_writes_scalars_and_figures_to_tensorboard_during_fit(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    keras.utils.set_random_seed(0)
    adapter = bf.ContinuousApproximator.build_adapter(
        inference_variables=["theta"], inference_conditions=["x"]
    )
    approximator = bf.ContinuousApproximator(
        inference_network=bf.networks.CouplingFlow(depth=2, subnet_kwargs={"widths": (16, 16)}),
        adapter=adapter,
    )
    approximator.compile(optimizer=keras.optimizers.Adam(1e-3))
    held_out = simulate(100, seed=2)
    theta = torch.from_numpy(held_out["theta"]).float()
    x = torch.from_numpy(held_out["x"]).float()
    ranks = RankCalibrationCallback(theta, x, metric=cl.RankCalibration(num_posterior_samples=20))
    tarp = TARPCallback(theta, x, metric=cl.TARP(num_posterior_samples=20))
    callback = KerasCalibrationCallback([ranks, tarp], log_dir=str(tmp_path), every_n_epochs=2)
    dataset = bf.datasets.OfflineDataset(simulate(300, seed=1), batch_size=100, adapter=adapter)
    history = approximator.fit(dataset=dataset, epochs=3, verbose=0, callbacks=[callback])
    assert ranks.epochs == [0, 1, 2]  # the first, every second, the last
    assert "calibration/ranks/global_p_value" in history.history
    events = EventAccumulator(str(tmp_path), size_guidance={"images": 0, "scalars": 0})
    events.Reload()
    tags = events.Tags()
    for tag in (
        "calibration/ranks/global_p_value",
        "calibration/ranks/log10_global_p_value",
        "calibration/tarp/p_value",
    ):
        assert tag in tags["scalars"], (tag, tags["scalars"])
        assert [e.step for e in events.Scalars(tag)] == [0, 1, 2]
    value = events.Scalars("calibration/ranks/global_p_value")[-1].value
    assert value == pytest.approx(ranks.history["global_p_value"][-1], rel=1e-6)
    for tag in ("calibration/ranks/ecdf", "calibration/ranks/history", "calibration/tarp/coverage"):
        assert tag in tags["images"], (tag, tags["images"])
    assert "calibration/ranks/rank/joint" in tags["histograms"]


def test_the_callback_refuses_what_is_not_a_calibration_callback():
    with pytest.raises(ValueError, match="checks must be calib_lightning calibration callbacks"):
        KerasCalibrationCallback([object()])
