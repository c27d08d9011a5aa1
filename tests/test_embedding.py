"""Embedding networks for L-C2ST and L-C2ST-NF, and image-shaped ``x`` in every metric.

What must hold: the identity embedding gives exactly the raw path; a module with
BatchNorm and Dropout gives deterministic features and keeps its train/eval modes; images
``(N, 1, 8, 8)`` run through a small CNN in both metrics and in a Lightning fit whose flow
conditions on the embedding; the L-C2ST-NF null is retrained when the embedded features
change and reused when they do not; L-C2ST-NF with an embedding keeps its level on an
exact posterior; bad embeddings raise a ``ValueError`` naming the argument.
"""

import copy

import lightning as L
import pytest
import torch
import zuko
from scipy import stats
from torch import nn
from torch.distributions import MultivariateNormal

import calib_lightning as cl
from calib_lightning.callbacks import LC2STNFCallback
from calib_lightning.classifiers import MLPEnsemble
from calib_lightning.evaluation import embed
from calib_lightning.tasks import GaussianToy

FAST = {"num_null": 20, "num_posterior_samples": 500}


class ImageToy:
    r"""Two parameters seen through an 8 x 8 image: :math:`x = W\theta + s\,\epsilon`,
    :math:`\theta \sim N(0, I_2)`, reshaped to ``(N, 1, 8, 8)``; the exact posterior is
    :math:`N(C W^T x / s^2, C)`, :math:`C = (I + W^T W / s^2)^{-1}`."""

    def __init__(self, noise_std: float = 0.5) -> None:
        self.s = noise_std
        self.weight = torch.randn(64, 2, generator=torch.Generator().manual_seed(0)) / 4
        cov = torch.linalg.inv(torch.eye(2) + self.weight.T @ self.weight / self.s**2)
        self.gain, self.tril = cov @ self.weight.T / self.s**2, torch.linalg.cholesky(cov)

    def sample(self, n: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        theta = torch.randn(n, 2, generator=g)
        x = theta @ self.weight.T + self.s * torch.randn(n, 64, generator=g)
        return theta, x.reshape(n, 1, 8, 8)

    def posterior(self, variance_scale: float = 1.0):
        def model(x: torch.Tensor) -> MultivariateNormal:
            loc = x.reshape(x.shape[0], -1) @ self.gain.T.to(x)
            return MultivariateNormal(loc, scale_tril=self.tril.to(x) * variance_scale**0.5)

        return model


class CNN(nn.Module):
    """A small embedding network for ``(n, 1, 8, 8)`` images: ``(n, features)``."""

    def __init__(self, features: int = 8, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.net = nn.Sequential(
            nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Dropout(0.5),
            nn.Flatten(), nn.Linear(4 * 6 * 6, features),
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


IMAGES = ImageToy()


@pytest.fixture
def fit_log(monkeypatch):
    """Records the number of members of every MLPEnsemble.fit call."""
    calls = []
    original = MLPEnsemble.fit

    def counting(self, features, labels):
        calls.append(self.num_members)
        return original(self, features, labels)

    monkeypatch.setattr(MLPEnsemble, "fit", counting)
    return calls


def _run(metric, posterior, theta, x, seed=0):
    torch.manual_seed(seed)  # L-C2ST's posterior draws use the global generator
    metric.update(posterior, theta, x)
    return metric.compute()


@pytest.mark.parametrize("metric_type", [cl.LC2STNF, cl.LC2ST])
def test_identity_embedding_equals_the_raw_path(metric_type):
    toy = GaussianToy(dim=2)
    theta, x = toy.sample(300, torch.Generator().manual_seed(0))
    # an inflation every observation's test sees with 20 null classifiers (at 3.0 the
    # permutation test reached its smallest p-value, 1/21, at one observation of three)
    for posterior in (toy.posterior(), toy.posterior(variance_scale=4.0)):
        raw = _run(metric_type(x[:3], **FAST), posterior, theta, x)
        same = _run(metric_type(x[:3], embedding=nn.Identity(), **FAST), posterior, theta, x)
        for key in ("statistic", "p_value", "null_statistics", "probabilities", "pp_band"):
            assert torch.equal(raw[key], same[key]), key
    assert float(raw.global_p_value) < 0.05  # the inflated posterior: the test can fail
    # images: nn.Flatten equals the raw path, which flattens
    theta, x = IMAGES.sample(200, torch.Generator().manual_seed(1))
    raw = _run(metric_type(x[:2], **FAST), IMAGES.posterior(), theta, x)
    flat = _run(metric_type(x[:2], embedding=nn.Flatten(), **FAST), IMAGES.posterior(), theta, x)
    assert torch.equal(raw.p_value, flat.p_value)
    assert torch.equal(raw.statistic, flat.statistic)


def test_embed_is_deterministic_chunked_gradient_free_and_restores_modes():
    _, x = IMAGES.sample(50, torch.Generator().manual_seed(0))
    cnn = CNN()
    cnn.train()
    cnn.net[3].eval()  # a submodule the user keeps in eval mode
    modes = [m.training for m in cnn.modules()]
    first, chunked = embed(cnn, x), embed(cnn, x, batch_size=7)
    assert first.shape == (50, 8)
    assert not first.requires_grad
    assert [m.training for m in cnn.modules()] == modes
    torch.testing.assert_close(first, chunked)
    assert torch.equal(first, embed(cnn, x))
    with torch.no_grad():
        expected = copy.deepcopy(cnn).eval()(x)
    torch.testing.assert_close(first, expected)
    assert not torch.allclose(cnn(x), first)  # train mode: batch statistics and dropout
    # float64 x through a float32 network: features in x's dtype
    assert embed(cnn, x.double()).dtype == torch.float64
    assert torch.equal(embed(None, x), x.reshape(50, 64))


def test_images_with_a_cnn_embedding_in_both_metrics_and_power_from_a_summary():
    g = torch.Generator().manual_seed(2)
    theta, x = IMAGES.sample(400, g)
    x_o = IMAGES.sample(2, g)[1]
    cnn = CNN().train()
    for metric_type in (cl.LC2STNF, cl.LC2ST):
        outs = {}
        for variance_scale in (1.0, 4.0):
            metric = metric_type(x_o, embedding=cnn, **FAST)
            outs[variance_scale] = out = _run(metric, IMAGES.posterior(variance_scale), theta, x)
            assert out.p_value.shape == (2,)
            assert out.probabilities.shape == (2, 500)
            assert all(m.training for m in cnn.modules())
            assert not any("net" in key for key in metric.state_dict())  # held, not owned
        if metric_type is cl.LC2STNF:  # latents carry the error: any embedding works
            # (its level with an embedding: the level test below, over fresh datasets; one
            # dataset at 20 null classifiers cannot tell, and this one sits at 1 / 21)
            assert float(outs[4.0].global_p_value) < 0.05
            assert bool((outs[4.0].statistic > 2 * outs[1.0].statistic).all())
    nf = cl.LC2STNF(x_o, embedding=cnn, **FAST)
    _run(nf, IMAGES.posterior(4.0), theta, x)
    maps = nf.probability_map(IMAGES.posterior(4.0), 100)
    assert maps.samples.shape == (2, 100, 2)
    assert maps.probabilities.shape == (2, 100)
    # L-C2ST must learn the posterior mean from (theta, x): 64 raw pixels and 400 pairs are
    # too few to see a doubled posterior width, the 2 numbers of a sufficient summary are not
    # (three classifiers averaged per statistic: one classifier stopped early at seed 0
    # and missed it, p = 0.205, where seeds 1-7 reject at the floor 1 / 21)
    summary = lambda v: v.flatten(1) @ IMAGES.gain.T  # noqa: E731 (the posterior mean)
    wide, three = IMAGES.posterior(4.0), {**FAST, "num_ensemble": 3}
    assert float(_run(cl.LC2ST(x_o, **three), wide, theta, x).global_p_value) > 0.05
    summarized = _run(cl.LC2ST(x_o, embedding=summary, **three), wide, theta, x)
    assert float(summarized.global_p_value) < 0.05
    exact = _run(cl.LC2ST(x_o, embedding=summary, **three), IMAGES.posterior(), theta, x)
    assert float(exact.global_p_value) > 0.05


def test_null_is_refit_when_the_features_change_and_reused_when_not(fit_log):
    g = torch.Generator().manual_seed(3)
    theta, x = IMAGES.sample(200, g)
    cnn = CNN()
    metric = cl.LC2STNF(IMAGES.sample(2, g)[1], embedding=cnn, **FAST)
    first = _run(metric, IMAGES.posterior(), theta, x)
    metric.reset()
    _run(metric, IMAGES.posterior(), theta.flip(0), x.flip(0))  # same x, other order
    assert fit_log == [20, 1, 1]
    with torch.no_grad():  # "trained further": the features change
        cnn.net[5].weight.add_(0.1)
    metric.reset()
    changed = _run(metric, IMAGES.posterior(), theta, x)
    assert fit_log == [20, 1, 1, 20, 1]
    assert not torch.equal(changed.null_statistics, first.null_statistics)
    assert metric.null.trained_on(embed(cnn, x))  # the fingerprint is of the features
    metric.set_embedding(copy.deepcopy(cnn))  # a copy: the same features, the same null
    metric.set_observations(x[:3])  # new observations, embedded too: the same null
    metric.reset()
    moved = _run(metric, IMAGES.posterior(), theta, x)
    assert fit_log == [20, 1, 1, 20, 1, 1]
    assert moved.p_value.shape == (3,)
    # without an embedding, other calibration x still raise (nothing silently retrains)
    raw = cl.LC2STNF(x[:2], **FAST)
    _run(raw, IMAGES.posterior(), theta, x)
    raw.reset()
    raw.update(IMAGES.posterior(), theta[1:], x[1:])
    with pytest.raises(ValueError, match="differ from the x the null classifiers"):
        raw.compute()


def test_lc2stnf_level_with_an_embedding_on_an_exact_posterior():
    """100 fresh image datasets, a fresh metric with default arguments and a fixed CNN
    embedding per dataset: rejection rate at 0.05 inside the 99 % binomial band, p-values
    uniform (KS p > 0.01)."""
    reps, g = 100, torch.Generator().manual_seed(4)
    cnn = CNN(features=4)
    p_values = []
    for _ in range(reps):
        theta, x = IMAGES.sample(200, g)
        metric = cl.LC2STNF(observations=IMAGES.sample(1, g)[1], embedding=cnn)
        p_values.append(_run(metric, IMAGES.posterior(), theta, x).p_value[0])
    p = torch.stack(p_values)
    low, high = stats.binom.ppf([0.005, 0.995], reps, 0.05) / reps
    rate = float((p <= 0.05).double().mean())
    assert low <= rate <= high, f"rejection rate {rate} outside [{low}, {high}]"
    assert stats.kstest(p.double().numpy(), "uniform").pvalue > 0.01


class ImageNPE(L.LightningModule):
    """A zuko flow conditioned on the features of a CNN, trained together by NLL."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = CNN()
        self.flow = zuko.flows.MAF(2, 8, transforms=1, hidden_features=(16,))

    def posterior(self, x: torch.Tensor):
        return self.flow(self.embedding(x))

    def training_step(self, batch, batch_idx):
        theta, x = batch
        return -self.posterior(x).log_prob(theta).mean()

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


@pytest.mark.parametrize("frozen", [False, True])
def test_callback_with_an_embedding_trained_with_the_flow(fit_log, frozen):
    g = torch.Generator().manual_seed(5)
    theta, x = IMAGES.sample(256, g)
    theta_cal, x_cal = IMAGES.sample(200, g)
    module = ImageNPE()
    embedding = copy.deepcopy(module.embedding) if frozen else "embedding"
    callback = LC2STNFCallback(
        theta_cal, x_cal, observations=x_cal[:2], estimator=lambda m: m.posterior,
        embedding=embedding, log_figures=False,
        metric=cl.LC2STNF(x_cal[:2], num_null=10, num_posterior_samples=200),
    )  # fmt: skip
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(theta, x), batch_size=64)
    L.Trainer(
        accelerator="cpu", devices=1, max_epochs=2, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, callbacks=[callback],
    ).fit(module, data)  # fmt: skip
    assert callback.epochs == [0, 1]
    assert callback.last_result.p_value.shape == (2,)
    # trained with the flow: new features, a new null at every check; frozen: one null
    assert fit_log == ([10, 1, 1] if frozen else [10, 1, 10, 1])
    assert module.embedding.training  # the module's modes are back


def test_callback_rejects_a_missing_embedding_attribute():
    theta, x = IMAGES.sample(20, torch.Generator().manual_seed(6))
    with pytest.raises(ValueError, match=r"embedding must be an nn\.Module"):
        LC2STNFCallback(theta, x, observations=x[:2], embedding=3)
    callback = LC2STNFCallback(theta, x, observations=x[:2], embedding="missing")
    with pytest.raises(ValueError, match=r"embedding must name an attribute.*\['embedding'"):
        callback._compute(None, ImageNPE())


def test_bad_embeddings_raise_value_errors_naming_the_argument():
    theta, x = IMAGES.sample(50, torch.Generator().manual_seed(7))
    posterior = IMAGES.posterior()
    with pytest.raises(ValueError, match=r"embedding must be an nn\.Module"):
        cl.LC2STNF(x[:2], embedding="cnn")
    with pytest.raises(ValueError, match="embedding_batch_size must be a positive integer"):
        cl.LC2ST(x[:2], embedding=CNN(), embedding_batch_size=0)
    for bad, match in (
        (lambda v: v[:1].flatten(1), r"embedding must map x of shape \(n, \*X\).*n = 50"),
        (lambda v: v.flatten(1).sum(1).tolist(), "features \\(n, F\\).*got list"),
        (lambda v: v.flatten(1) * float("nan"), r"embedding\(x\) must be finite.*50 of 50 rows"),
    ):
        for metric_type in (cl.LC2STNF, cl.LC2ST):
            with pytest.raises(ValueError, match=match):
                metric_type(x[:2], embedding=bad, **FAST).update(posterior, theta, x)
    normalized = lambda v: v.flatten(1) / v.flatten(1).abs().sum(1, keepdim=True)  # noqa: E731
    nan_at_observations = cl.LC2STNF(torch.zeros(2, 1, 8, 8), embedding=normalized, **FAST)
    nan_at_observations.update(posterior, theta, x)
    with pytest.raises(ValueError, match=r"embedding\(observations\) must be finite"):
        nan_at_observations.compute()
    metric = cl.LC2STNF(x[:2], embedding=CNN(), **FAST)
    with pytest.raises(ValueError, match=r"x must have the observations' shape \(N, 1, 8, 8\)"):
        metric.update(posterior, theta, x.reshape(50, 1, 4, 16))
    widths = iter([4, 5])
    metric = cl.LC2STNF(x[:2], embedding=lambda v: v.flatten(1)[:, : next(widths)], **FAST)
    metric.update(posterior, theta, x)
    with pytest.raises(ValueError, match="keep its width F = 4 across updates, got F = 5"):
        metric.update(posterior, theta, x)
    with pytest.raises(ValueError, match=r"observations must have shape \(O, \*X\)"):
        cl.LC2STNF(x[:2], embedding=CNN(), **FAST).set_observations(x[:2].reshape(2, 64))


@pytest.mark.parametrize("metric_type", [cl.KCCSD, cl.RankCalibration, cl.TARP])
def test_image_shaped_x_equals_flattened_x_in_the_other_metrics(metric_type):
    """Image x ``(N, 1, 8, 8)`` through a posterior whose context is the flattened image:
    the same result as the same pairs with x flattened to ``(N, 64)``."""
    theta, x = IMAGES.sample(200, torch.Generator().manual_seed(8))
    results = [_run(metric_type(), IMAGES.posterior(), theta, v) for v in (x, x.flatten(1))]
    for key in results[0].logged:
        torch.testing.assert_close(results[0][key], results[1][key], rtol=0, atol=0, msg=key)
    wide = _run(metric_type(), IMAGES.posterior(4.0), theta, x)  # the check can fail
    assert float(getattr(wide, wide.verdict)) < 0.05
