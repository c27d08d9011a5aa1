"""Latents right for every adapter: with ``x`` far from standardized (``x = 10 theta + 5``),
the latents of a model's own samples are standard normal and its ``log_prob`` is the change
of variables of its latents, for every backend ``cl.as_posterior`` wraps.

The flows are briefly fitted (a few full-batch Adam steps), so that they depend on ``x`` as
a trained estimator does; the property holds for any parameters.
"""

import math
import os
from collections.abc import Callable

import pytest
import torch
import zuko
from nflows.distributions.normal import ConditionalDiagonalNormal, StandardNormal
from nflows.flows.base import Flow
from nflows.transforms import CompositeTransform, MaskedAffineAutoregressiveTransform
from scipy import stats
from torch import nn
from torch.distributions import (
    AffineTransform,
    ExpTransform,
    Independent,
    MultivariateNormal,
    Normal,
    TransformedDistribution,
)

import calib_lightning as cl

D = 2
OFFSET, SCALE, NOISE = 5.0, 10.0, 2.0
NUM_TRAIN, NUM_FIT_STEPS = 1000, 30
NUM_SAMPLES = 2000  # pairs (x_i, theta_i ~ q(. | x_i)) in the normality checks
NUM_JACOBIAN = 40  # pairs in the change-of-variables check
KS_LEVEL = 1e-3  # family-wise over the D coordinates of one adapter (Bonferroni)


def simulate(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Gaussian linear task with ``x`` offset by 5 and scaled by 10, float64."""
    g = torch.Generator().manual_seed(seed)
    theta = torch.randn(n, D, generator=g, dtype=torch.float64)
    x = SCALE * theta + OFFSET + NOISE * torch.randn(n, D, generator=g, dtype=torch.float64)
    return theta, x


def fit(module: nn.Module, obj: object, steps: int = NUM_FIT_STEPS) -> None:
    """A few full-batch Adam steps on the NLL, through the adapter, so ``q`` depends on ``x``."""
    theta, x = simulate(NUM_TRAIN, seed=1)
    post = cl.as_posterior(obj)
    optimizer = torch.optim.Adam(module.parameters(), lr=1e-2)
    for _ in range(steps):
        optimizer.zero_grad()
        (-post.log_prob(theta, x).mean()).backward()
        optimizer.step()


def zuko_flow(name: str) -> object:
    torch.manual_seed(0)
    if name == "CNF":
        return zuko.flows.CNF(D, D, hidden_features=(16, 16)).double()  # untrained: slow
    flow = getattr(zuko.flows, name)(D, D, transforms=2, hidden_features=(32, 32)).double()
    fit(flow, flow)
    return flow


def nflows_flow(embedding: bool = False, conditional_base: bool = False) -> object:
    torch.manual_seed(0)
    width = 4 if embedding else D
    embedding_net = nn.Sequential(nn.Linear(D, width), nn.Tanh()) if embedding else None
    if embedding:
        with torch.no_grad():  # start in tanh's range for x of scale 10
            embedding_net[0].weight.div_(SCALE)
            embedding_net[0].bias.sub_(embedding_net[0].weight.sum(1) * OFFSET)
    transform = CompositeTransform(
        [
            MaskedAffineAutoregressiveTransform(D, hidden_features=32, context_features=width)
            for _ in range(2)
        ]
    )
    base = (
        ConditionalDiagonalNormal([D], context_encoder=nn.Linear(width, 2 * D))
        if conditional_base
        else StandardNormal([D])
    )
    flow = Flow(transform, base, embedding_net).double()
    fit(flow, flow)
    return flow


def sbi_estimator(model: str, direct_posterior: bool = False, declared: bool = True) -> object:
    """An sbi estimator from sbi's own builder, its z-scoring fitted on the offset, scaled x;
    ``declared``: as ``cl.as_posterior(estimator, kind="posterior")``, as a user must pass
    an estimator with ``dim theta = dim x``."""
    pytest.importorskip("sbi")
    from sbi.neural_nets import posterior_nn

    theta, x = simulate(NUM_TRAIN, seed=1)
    torch.manual_seed(0)
    build = posterior_nn(model=model, hidden_features=32, num_transforms=2)
    estimator = build(theta.float(), x.float()).double()
    fit(estimator, cl.as_posterior(estimator, kind="posterior"))
    if not direct_posterior:
        return cl.as_posterior(estimator, kind="posterior") if declared else estimator
    from sbi.inference.posteriors import DirectPosterior

    prior = MultivariateNormal(torch.zeros(D), torch.eye(D))
    return DirectPosterior(posterior_estimator=estimator, prior=prior)


def sbi_vector_field(method: str) -> object:
    """sbi's FMPE or NPSE estimator, trained briefly (seconds), float32 (sbi's dtype)."""
    pytest.importorskip("sbi")
    import warnings

    from sbi.inference import FMPE, NPSE

    theta, x = simulate(NUM_TRAIN, seed=1)
    torch.manual_seed(0)
    prior = MultivariateNormal(torch.zeros(D), torch.eye(D))
    inference = {"fmpe": FMPE, "npse": NPSE}[method](prior=prior, show_progress_bars=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        inference.append_simulations(theta.float(), x.float())
        return inference.train(max_num_epochs=20, training_batch_size=200)


def bayesflow_approximator(network: str) -> object:
    """A BayesFlow ``ContinuousApproximator`` on Keras' torch backend (float32: Keras'),
    trained briefly (seconds) with ``fit`` on the offset, scaled pairs, every variable
    standardized by the approximator; flow matching integrates with 10 fixed RK45 steps."""
    os.environ.setdefault("KERAS_BACKEND", "torch")
    grad = torch.is_grad_enabled()
    bf = pytest.importorskip("bayesflow")
    torch.set_grad_enabled(grad)  # bayesflow turns autograd off when it is imported
    import keras

    theta, x = simulate(NUM_TRAIN, seed=1)
    data = {"theta": theta.float().numpy(), "x": x.float().numpy()}
    keras.utils.set_random_seed(0)
    adapter = bf.ContinuousApproximator.build_adapter(
        inference_variables=["theta"], inference_conditions=["x"]
    )
    net = (
        bf.networks.CouplingFlow(depth=2, subnet_kwargs={"widths": (32, 32)})
        if network == "coupling"
        else bf.networks.FlowMatching(
            subnet_kwargs={"widths": (32, 32)}, integrate_kwargs={"method": "rk45", "steps": 10}
        )
    )
    approximator = bf.ContinuousApproximator(
        inference_network=net, adapter=adapter, standardize="all"
    )
    approximator.compile(optimizer=keras.optimizers.Adam(1e-3))
    dataset = bf.datasets.OfflineDataset(data, batch_size=100, adapter=adapter)
    approximator.fit(dataset=dataset, epochs=5, verbose=0)
    return approximator


def _loc(x: torch.Tensor) -> torch.Tensor:
    """The exact posterior mean of the task: a shrunken, standardized ``x``."""
    gain = SCALE / (SCALE**2 + NOISE**2)
    return gain * (x - OFFSET)


def independent_normal(x: torch.Tensor) -> Independent:
    sd = SCALE * NOISE / (SCALE**2 + NOISE**2) ** 0.5 / SCALE
    return Independent(Normal(_loc(x), torch.full_like(x, sd)), 1)


_TRIL = torch.tensor([[0.3, 0.0], [0.15, 0.2]], dtype=torch.float64)


def multivariate_normal(x: torch.Tensor) -> MultivariateNormal:
    mixing = torch.tensor([[1.0, 0.5], [-0.3, 1.0]], dtype=torch.float64)
    return MultivariateNormal(_loc(x) @ mixing.T, scale_tril=_TRIL.to(x))


def transformed(x: torch.Tensor) -> TransformedDistribution:
    """A log-normal-like posterior: ``exp(loc(x) + scale(x) z)``, non-linear in ``z``."""
    base = Independent(Normal(torch.zeros_like(x), torch.ones_like(x)), 1)
    scale = 0.3 + 0.1 * torch.sigmoid(_loc(x))
    affine = AffineTransform(0.5 * _loc(x), scale, event_dim=1)
    return TransformedDistribution(base, [affine, ExpTransform()])


ADAPTERS: dict[str, Callable[[], object]] = {
    "zuko-maf": lambda: zuko_flow("MAF"),
    "zuko-nsf": lambda: zuko_flow("NSF"),
    "zuko-cnf": lambda: zuko_flow("CNF"),
    "nflows": lambda: nflows_flow(),
    "nflows-embedding": lambda: nflows_flow(embedding=True),
    "nflows-embedding-conditional-base": lambda: nflows_flow(True, conditional_base=True),
    "sbi-maf": lambda: sbi_estimator("maf"),
    "sbi-nsf": lambda: sbi_estimator("nsf"),
    "sbi-zuko-maf": lambda: sbi_estimator("zuko_maf"),
    "sbi-zuko-nsf": lambda: sbi_estimator("zuko_nsf"),
    "sbi-direct-posterior": lambda: sbi_estimator("maf", direct_posterior=True),
    "sbi-fmpe": lambda: sbi_vector_field("fmpe"),
    "sbi-npse": lambda: sbi_vector_field("npse"),
    "bayesflow-coupling": lambda: bayesflow_approximator("coupling"),
    "bayesflow-flow-matching": lambda: bayesflow_approximator("flow_matching"),
    "transformed-distribution": lambda: transformed,
    "independent-normal": lambda: independent_normal,
    "multivariate-normal": lambda: multivariate_normal,
}
# an ODE per sample: fewer samples, looser change-of-variables tolerance
SLOW = {"zuko-cnf", "sbi-fmpe", "sbi-npse", "bayesflow-flow-matching"}
#: float32 models (Keras'): the change of variables to float32's precision
FLOAT32 = {"bayesflow-coupling", "bayesflow-flow-matching"}


def assert_standard_normal(z: torch.Tensor) -> None:
    """Mean, covariance and per-coordinate KS test of ``z (n, D)`` against N(0, I)."""
    n = z.shape[0]
    z = z.detach().double()
    assert torch.isfinite(z).all()
    mean = z.mean(0)
    assert mean.abs().max() < 4 / n**0.5, f"latent mean {mean.tolist()}"
    cov = torch.cov(z.T)
    error = (cov - torch.eye(D, dtype=z.dtype)).abs().max()
    assert error < 5 * (2 / n) ** 0.5, f"latent covariance {cov.tolist()}"
    p_values = [stats.kstest(z[:, d].numpy(), "norm").pvalue for d in range(D)]
    assert min(p_values) > KS_LEVEL / D, f"KS p-values {p_values}"


def change_of_variables(post: cl.Posterior, theta: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    r""":math:`\log N(z; 0, I) + \log|\det \partial z / \partial \theta|`, Jacobian by autograd.

    Each ``z_i`` depends on ``theta_i`` only, so ``D`` backward passes give every Jacobian.
    """
    theta = theta.detach().requires_grad_(True)
    z = post.to_latent(theta, x)
    rows = [torch.autograd.grad(z[:, d].sum(), theta, retain_graph=True)[0] for d in range(D)]
    jacobian = torch.stack(rows, dim=-2)  # (n, D, D): d z_d / d theta_e
    log_normal = -0.5 * z.square().sum(-1) - 0.5 * D * math.log(2 * math.pi)
    return (log_normal + torch.linalg.slogdet(jacobian)[1]).detach()


@pytest.fixture(scope="module", params=list(ADAPTERS))
def adapter(request: pytest.FixtureRequest) -> tuple[str, cl.Posterior]:
    return request.param, cl.as_posterior(ADAPTERS[request.param]())


def test_latents_of_own_samples_are_standard_normal(adapter):
    name, post = adapter
    n = 500 if name in SLOW else NUM_SAMPLES
    _, x = simulate(n, seed=2)  # one sample at each of n distinct, unstandardized x
    torch.manual_seed(3)
    theta = post.sample(x, 1)[0]
    with torch.no_grad():
        z = post.to_latent(theta, x)
    assert z.shape == (n, D)
    assert z.dtype == torch.float64
    assert_standard_normal(z)


def test_log_prob_is_the_change_of_variables_of_the_latents(adapter):
    name, post = adapter
    _, x = simulate(NUM_JACOBIAN, seed=4)
    torch.manual_seed(5)
    theta = post.sample(x, 1)[0]
    expected = change_of_variables(post, theta, x)
    tolerance = 1e-3 if name in SLOW | FLOAT32 else 1e-7
    torch.testing.assert_close(post.log_prob(theta, x), expected, rtol=tolerance, atol=tolerance)
    log_prob, z = post.log_prob_and_latent(theta, x)
    torch.testing.assert_close(log_prob, expected, rtol=tolerance, atol=tolerance)
    torch.testing.assert_close(z, post.to_latent(theta, x), rtol=tolerance, atol=tolerance)


def test_only_odes_declare_a_costly_log_prob_and_get_the_distance_rank(adapter):
    """Every adapter at once: the ODE estimators (a trace along the path for ``log_prob``)
    declare it costly, so the rank check draws samples only and ranks jointly by distance
    (at the cost of sampling); every other adapter keeps the energy rank."""
    name, post = adapter
    assert ("log_prob" in post.costly) == (name in SLOW)
    _, x = simulate(20, seed=6)
    torch.manual_seed(6)
    theta = post.sample(x, 1)[0]  # inside every adapter's support
    metric = cl.RankCalibration(num_posterior_samples=5)
    metric.update(post, theta, x)
    assert metric.compute().joint_statistic == ("distance" if name in SLOW else "energy")


def test_conformal_levels_of_every_adapter_are_nominal_on_its_own_draws(adapter):
    """Every adapter at once: pairs whose theta is the model's own draw are calibrated at
    every x, so the credibilities from its draws and log-densities are uniform given x and
    the conformal levels, global and per leaf of a tree grown on other pairs
    (``fit_partition``) over x or (not for the slow ODEs: the same code) over the posterior
    summary, are 0.9 up to their order statistics' spread (``conformity="credibility"``);
    the default region of every adapter (all have ``log_prob``) is the log-density one: the
    adapter's own log-density contour, covering its fresh draws."""
    name, post = adapter
    n, draws = (100, 20) if name in SLOW else (400, 100)
    _, x = simulate(2 * n, seed=7)
    torch.manual_seed(8)  # (seed 7 would draw theta's noise as x's own: theta tied to x)
    theta = post.sample(x, 1)[0]
    whole = cl.ConformalRegion(post, num_posterior_samples=draws, conformity="credibility")
    whole.fit(theta[:n], x[:n])
    assert abs(float(whole.calibrated_level(0.9)) - 0.9) < 4 * 0.3 / n**0.5
    for embedding in (None,) if name in SLOW else (None, "posterior"):
        region = cl.ConformalRegion(post, local=True, embedding=embedding,
                                    num_posterior_samples=draws, min_leaf_size=n // 4,
                                    conformity="credibility")  # fmt: skip
        region.fit_partition(theta[n:], x[n:])
        region.fit(theta[:n], x[:n], scores=None if embedding else whole.scores)  # fmt: skip
        spread = 0.3 / region.leaves.bincount().min() ** 0.5  # sd of a leaf's 0.9 quantile
        levels = region.calibrated_level(0.9, x[:n])
        assert levels.shape == (n,)
        assert float((levels - 0.9).abs().max()) < 5 * spread, (embedding, levels.unique())
    assert region.contains(theta[:3], x[:3]).shape == (3,)
    # the log-density threshold: the adapter's log_prob on (N, D) and (*, N, D) points
    raw = cl.ConformalRegion(post, num_posterior_samples=draws).fit(theta[:n], x[:n])
    assert raw.conformity == "log_density"
    inside = raw.contains(torch.stack([theta[n:], theta[:n]]), x[n:])
    assert inside.shape == (2, n)
    with torch.no_grad():
        assert torch.equal(inside[0], post.log_prob(theta[n:], x[n:]) >= raw.threshold(x[n:]))
    assert abs(float(inside[0].double().mean()) - 0.9) < 4 * (0.18 / n) ** 0.5  # fresh pairs
    # the location-scale regression (over the summary; over x for the slow ODEs) from the
    # other pairs, every held-out pair calibrating: 0.9 on fresh pairs of the adapter's own
    reg = cl.ConformalRegion(post, local="regression", num_posterior_samples=draws,
                             embedding=None if name in SLOW else "posterior")  # fmt: skip
    reg.fit_partition(theta[n:], x[n:]).fit(theta[:n], x[:n])
    _, x_new = simulate(n, seed=9)
    torch.manual_seed(10)
    theta_new = post.sample(x_new, 1)[0]
    cover = float(reg.contains(theta_new, x_new).double().mean())
    assert abs(cover - 0.9) < 4 * (0.09 / n) ** 0.5 + 1 / (n + 1), (name, cover)


def test_the_check_sees_a_flow_that_skips_its_embedding():
    """The defect of sbi 0.27's ``NFlowsFlow.inverse_transform``: raw ``x`` into the flow
    instead of the embedding net's z-scored ``x``. The normality check must reject it."""
    estimator = sbi_estimator("maf", declared=False)
    post = cl.as_posterior(estimator, kind="posterior")
    _, x = simulate(NUM_SAMPLES, seed=2)
    torch.manual_seed(3)
    theta = post.sample(x, 1)[0]
    with torch.no_grad():
        skipped, _ = estimator.net._transform(theta, context=x)  # no embedding net
        assert_standard_normal(post.to_latent(theta, x))
    with pytest.raises(AssertionError):
        assert_standard_normal(skipped)


def test_an_sbi_estimator_without_a_flow_has_no_latent():
    pytest.importorskip("sbi")
    from sbi.neural_nets import posterior_nn

    theta, x = simulate(200, seed=1)
    estimator = posterior_nn(model="mdn", hidden_features=8, num_components=2)(
        theta.float(), x.float()
    )
    post = cl.as_posterior(estimator, kind="posterior")
    assert post.sample(x[:5].float(), 2).shape == (2, 5, D)
    with pytest.raises(ValueError, match="to_latent needs an sbi flow estimator"):
        post.to_latent(theta[:5].float(), x[:5].float())


def test_the_support_check_counts_each_adapters_draws_outside_a_box(adapter):
    """Every adapter at once: ``cl.diagnose``'s support check (the calibration pairs whose
    theta lie in the box [-1, 1]^2, taken as the prior, which the adapter's draws overflow
    near its edges) reads the adapter's own mass outside the box, estimated apart from
    fresh draws, within Monte Carlo error; with a prior of full support it never rejects."""
    name, post = adapter
    n, draws = (40, 25) if name in SLOW else (200, 50)
    theta, x = simulate(4 * n, seed=11)
    bound = 1.0
    keep = (theta.abs() < bound).all(-1).nonzero()[:n, 0]
    theta, x = theta[keep], x[keep]
    box = Independent(torch.distributions.Uniform(torch.full((D,), -bound, dtype=torch.float64),
                                                  torch.full((D,), bound, dtype=torch.float64)),
                      1)  # fmt: skip
    report = cl.diagnose(post, theta, x, checks=("support",), prior=box,
                         num_posterior_samples=draws)  # fmt: skip
    result = report.checks["support"]
    assert result.leakage.shape == (n,)
    torch.manual_seed(12)
    fresh = post.sample(x, draws)  # (draws, n, D)
    expected = (fresh.abs() > bound).any(-1).double().mean()
    spread = (expected * (1 - expected) / (n * draws)) ** 0.5
    assert float(expected) > 0.02, (name, float(expected))  # the box cuts the draws
    assert abs(float(result.statistic) - float(expected)) < 5 * float(spread), name
    full = cl.diagnose(post, theta, x, checks=("support",), num_posterior_samples=5,
                       prior=MultivariateNormal(torch.zeros(D, dtype=torch.float64),
                                                torch.eye(D, dtype=torch.float64)))  # fmt: skip
    assert float(full.checks["support"].p_value) == 1.0


def test_every_adapter_truncated_to_a_box_samples_inside_with_one_normalizer(adapter):
    """Every adapter at once, restricted to the box [-1, 1]^2 (``cl.TruncatedPosterior``):
    its draws lie inside and keep the adapter's own distribution there (at each observation,
    the share in the box's left half is the adapter's among its fresh draws in the box,
    within Monte Carlo error); their log-densities are the adapter's minus one cached
    log-normalizer per observation (``sample_and_log_prob`` and ``log_prob`` agree); the
    support check passes it."""
    name, post = adapter
    n, draws = (10, 100) if name in SLOW else (40, 400)
    theta, x = simulate(4 * n, seed=13)
    keep = (theta.abs() < 1).all(-1).nonzero()[:n, 0]
    theta, x = theta[keep], x[keep]
    box = Independent(
        torch.distributions.Uniform(
            -torch.ones(D, dtype=torch.float64), torch.ones(D, dtype=torch.float64)
        ),
        1,
    )
    truncated = cl.TruncatedPosterior(post, box, num_normalizer_samples=draws)
    torch.manual_seed(14)
    inside, log_q = truncated.sample_and_log_prob(x, draws)
    assert inside.shape == (draws, n, D)
    assert bool((inside.abs() <= 1).all()), name
    with torch.no_grad():
        torch.testing.assert_close(log_q, truncated.log_prob(inside, x), rtol=1e-3, atol=1e-3)
        torch.testing.assert_close(
            log_q, post.log_prob(inside, x) - truncated.log_normalizer(x).to(log_q),
            rtol=1e-3, atol=1e-3)  # fmt: skip
    fresh = post.sample(x, 4 * draws)
    in_box = (fresh.abs() <= 1).all(-1)  # (4 draws, n)
    count = in_box.double().sum(0).clamp_min(1)
    left = ((fresh[..., 0] < 0) & in_box).double().sum(0) / count  # per observation
    share = (inside[..., 0] < 0).double().mean(0)
    spread = (left * (1 - left) * (1 / draws + 1 / count)).sum() ** 0.5 / n
    error = float((share - left).mean())
    assert abs(error) <= 5 * float(spread), (name, error, float(spread))
    report = cl.diagnose(truncated, theta, x, checks=("support",), prior=box,
                         num_posterior_samples=5)  # fmt: skip
    assert float(report.checks["support"].p_value) == 1.0
