"""BayesFlow 2 on Keras' torch backend: a ``ContinuousApproximator`` with a summary network,
read through its ``Adapter``, agrees with BayesFlow's own densities and calibration
statistics, and ``cl.diagnose`` runs every check on it with L-C2ST-NF at observations.

The parametrized adapter properties (latents of the model's own draws, the change of
variables, conformal levels, support, truncation) run over a BayesFlow coupling flow and a
flow-matching network in ``tests/test_adapters.py``. Skipped without bayesflow.
"""

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
from calib_lightning.functional.ranks import marginal_ranks  # noqa: E402
from calib_lightning.functional.sbc import rank_calibration  # noqa: E402
from calib_lightning.posteriors import BayesFlowPosterior, UnsupportedError  # noqa: E402

D, SET, NOISE = 2, 10, 1.0  # theta ~ N(0, I_2), SET observations theta + N(0, NOISE^2)


def simulate(n: int, seed: int) -> dict[str, np.ndarray]:
    """The Gaussian toy as a simulator's dict: ``theta (n, 2)`` and a set ``x (n, 10, 2)``."""
    g = np.random.default_rng(seed)
    theta = g.normal(size=(n, D))
    x = theta[:, None, :] + NOISE * g.normal(size=(n, SET, D))
    return {"theta": theta.astype("float32"), "x": x.astype("float32")}


class MeanSummary(bf.networks.SummaryNetwork):
    """The set's mean through one dense layer: a summary network that trains in seconds."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(4)

    def call(self, x, **kwargs):
        return self.dense(keras.ops.mean(x, axis=1))


def train(adapter=None, epochs: int = 6) -> object:
    """A coupling flow with a summary network, trained for seconds."""
    keras.utils.set_random_seed(0)
    if adapter is None:
        adapter = bf.ContinuousApproximator.build_adapter(
            inference_variables=["theta"], summary_variables=["x"]
        )
    approximator = bf.ContinuousApproximator(
        inference_network=bf.networks.CouplingFlow(depth=2, subnet_kwargs={"widths": (32, 32)}),
        summary_network=MeanSummary(),
        adapter=adapter,
    )
    approximator.compile(optimizer=keras.optimizers.Adam(3e-3))
    dataset = bf.datasets.OfflineDataset(simulate(1000, seed=1), batch_size=100, adapter=adapter)
    approximator.fit(dataset=dataset, epochs=epochs, verbose=0)
    return approximator


@pytest.fixture(scope="module")
def approximator():
    return train()


def tensors(data: dict[str, np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.from_numpy(data["theta"]), torch.from_numpy(data["x"])


def test_names_and_widths_come_from_the_adapter(approximator):
    post = cl.as_posterior(approximator)
    assert isinstance(post, BayesFlowPosterior)
    assert post.parameters == ["theta"]
    assert post.conditions == ["x"]
    assert post.event_size() == D
    assert post.costly == frozenset()
    assert "to_latent" in post.capabilities
    _, x = tensors(simulate(7, seed=2))
    torch.manual_seed(0)
    draws = post.sample(x, 5)
    assert draws.shape == (5, 7, D)
    assert draws.dtype == torch.float32
    torch.manual_seed(0)
    torch.testing.assert_close(post.sample(x, 5), draws)  # torch's generator seeds it
    with pytest.raises(ValueError, match="theta must have D = 2"):
        post.log_prob(torch.zeros(7, 3), x)


def test_log_prob_is_bayesflows_and_the_latents_invert(approximator):
    post = cl.as_posterior(approximator)
    data = simulate(50, seed=3)
    theta, x = tensors(data)
    expected = torch.from_numpy(np.asarray(approximator.log_prob(data)))
    torch.testing.assert_close(post.log_prob(theta, x), expected, rtol=1e-5, atol=1e-5)
    log_prob, z = post.log_prob_and_latent(theta, x)
    torch.testing.assert_close(log_prob, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(post.from_latent(z, x), theta, rtol=1e-4, atol=1e-4)
    stacked = post.log_prob(torch.stack([theta, theta + 0.1]), x)  # (*, N, D)
    assert stacked.shape == (2, 50)
    score = post.score(theta, x)  # autograd through the flow and the standardization
    step = 1e-2 * torch.eye(D)[0]
    numeric = (post.log_prob(theta + step, x) - post.log_prob(theta - step, x)) / 2e-2
    torch.testing.assert_close(score[:, 0], numeric, rtol=2e-2, atol=2e-2)


def test_latents_of_own_draws_are_standard_normal_with_the_summary_network(approximator):
    from scipy import stats

    post = cl.as_posterior(approximator)
    _, x = tensors(simulate(1000, seed=4))
    torch.manual_seed(5)
    with torch.no_grad():
        z = post.to_latent(post.sample(x, 1)[0], x).double()
    assert z.mean(0).abs().max() < 4 / 1000**0.5
    assert min(stats.kstest(z[:, d].numpy(), "norm").pvalue for d in range(D)) > 1e-3 / D


def test_ranks_on_bayesflows_draws_agree_with_its_log_gamma(approximator):
    """On BayesFlow's own draws: the package's marginal ranks are BayesFlow's, and the
    package's ECDF test and BayesFlow's ``calibration_log_gamma`` (log gamma < 0: reject
    at 5 %) agree: neither rejects when each pair's theta is one of the approximator's own
    draws (calibrated by construction), both reject draws shrunk to half their spread."""
    n, draws = 200, 100
    data = simulate(n, seed=6)
    samples = approximator.sample(num_samples=draws + 1, conditions={"x": data["x"]})["theta"]
    samples = samples.astype("float32")  # (the adapter converts float32 back to float64)
    truth, estimates = samples[:, 0], samples[:, 1:]  # (n, D), (n, draws, D)
    shrunk = estimates.mean(1, keepdims=True) + 0.5 * (estimates - estimates.mean(1, keepdims=True))
    for cloud, calibrated in ((estimates, True), (shrunk, False)):
        ours = marginal_ranks(torch.from_numpy(cloud).transpose(0, 1), torch.from_numpy(truth))
        theirs = (cloud < truth[:, None]).sum(1)
        assert np.array_equal(ours.numpy(), theirs)
        np.random.seed(0)  # noqa: NPY002 - BayesFlow's null draws from numpy's global generator
        log_gamma = bf.diagnostics.metrics.calibration_log_gamma(cloud, truth)["values"]
        fixed = torch.from_numpy(cloud).transpose(0, 1)  # (draws, n, D)
        result = rank_calibration(fixed, None, torch.from_numpy(truth), None)
        p_values = result.ecdf_p_values[:D]
        assert bool((log_gamma > 0).all()) == calibrated, log_gamma
        assert bool((p_values > 0.05).all()) == calibrated, p_values


def test_diagnose_runs_every_check_with_lc2st_nf_at_observations(approximator):
    post = cl.as_posterior(approximator)
    theta, x = tensors(simulate(200, seed=7))
    _, observations = tensors(simulate(2, seed=8))
    report = cl.diagnose(
        approximator, theta, x, observations=observations, num_posterior_samples=50, seed=0
    )
    assert "lc2st_nf" in report.checks, report.table()
    for name in ("ranks", "tarp", "joint_c2st", "recovery", "kccsd", "misspecification"):
        assert name in report.checks, (name, report.table())
    assert report.verdict.split(":")[0] in ("calibrated", "miscalibrated")
    assert cl.diagnose(post, theta, x, checks=("ranks",), num_posterior_samples=20).checks


def test_an_adapter_that_transforms_the_parameters_gives_densities_without_a_score():
    adapter = (
        bf.Adapter()
        .to_array()
        .convert_dtype("float64", "float32")
        .scale("theta", by=2.0)
        .concatenate(["theta"], into="inference_variables")
        .concatenate(["x"], into="summary_variables")
        .keep(["inference_variables", "summary_variables"])
    )
    approximator = train(adapter, epochs=1)
    post = cl.as_posterior(approximator)
    assert not post.arranged
    assert "score" not in post.capabilities
    data = simulate(20, seed=9)
    theta, x = tensors(data)
    expected = torch.from_numpy(np.asarray(approximator.log_prob(data), dtype="float32"))
    torch.testing.assert_close(post.log_prob(theta, x), expected, rtol=1e-5, atol=1e-5)
    torch.manual_seed(0)
    draws = post.sample(x, 300)
    assert draws.shape == (300, 20, D)
    torch.testing.assert_close(
        post.from_latent(post.to_latent(theta, x), x), theta, rtol=1e-4, atol=1e-4
    )
    with pytest.raises(UnsupportedError, match="transforms the parameters in NumPy"):
        post.score(theta, x)


def test_another_keras_backend_is_refused_with_the_reason(approximator, monkeypatch):
    monkeypatch.setattr(keras.backend, "backend", lambda: "jax")
    with pytest.raises(ValueError, match=r"torch backend.*got the 'jax' backend"):
        cl.as_posterior(approximator)


def test_level_on_its_own_draws_and_power_when_tempered(approximator):
    """Through the public classes with their default arguments, a fresh set of pairs per
    repetition: where each truth is one of the approximator's own draws at its x, the
    approximator is calibrated by construction, and ``cl.RankCalibration`` and
    ``cl.LatentCalibration`` reject at most at their level (binomial tail over the
    repetitions); where the truths spread twice as far from the draws' mean, the
    approximator is over-confident and both reject nearly always."""
    from scipy import stats

    post = cl.as_posterior(approximator)
    repetitions, n = 40, 100
    rejected = {(name, tempered): 0 for name in ("ranks", "latent") for tempered in (0, 1)}
    for r in range(repetitions):
        _, x = tensors(simulate(n, seed=1000 + r))
        torch.manual_seed(r)
        with torch.no_grad():
            draws = post.sample(x, 65)  # (65, n, D): one for the truth, 64 for the mean
        own, mean = draws[0], draws[1:].mean(0)
        for tempered, truth in ((0, own), (1, mean + 2.0 * (own - mean))):
            for name, metric in (
                ("ranks", cl.RankCalibration()),
                ("latent", cl.LatentCalibration()),
            ):
                metric.update(post, truth, x)
                rejected[name, tempered] += int(metric.compute().global_p_value < 0.05)
    for name in ("ranks", "latent"):
        level = stats.binom.sf(rejected[name, 0] - 1, repetitions, 0.05)
        assert level > 1e-3, (name, rejected)  # at most the level: 5 or fewer of 40
        assert rejected[name, 1] >= 0.9 * repetitions, (name, rejected)
