"""Bad input against the model: every metric and adapter works or names what is wrong.

Issue 12, item 5. For each backend (zuko NSF and MAF, nflows, sbi, torch.distributions),
theta of the wrong width, x narrower than the context, float64 pairs with a float32
model (and the reverse) and integer x either work, with the same numbers as the
well-typed call, or raise a ValueError naming the argument, the expected and the
received value; never torch's "mat1 and mat2" RuntimeError.
"""

import pytest
import torch
import zuko
from nflows.distributions.normal import StandardNormal
from nflows.flows.base import Flow
from nflows.transforms import MaskedAffineAutoregressiveTransform
from torch.distributions import Independent, Normal

import calib_lightning as cl
from calib_lightning._utils.validation import check_pairs, model_errors
from calib_lightning.evaluation import check_event_size

D, X, N = 3, 2, 24


class LinearGaussian(torch.nn.Module):
    """A conditional Gaussian ``x -> Independent(Normal)``: a module with parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.mean = torch.nn.Linear(X, D)

    def forward(self, x):
        return Independent(Normal(self.mean(x), 1.0), 1)


WEIGHT = torch.randn(D, X, generator=torch.Generator().manual_seed(9))


def closure_gaussian(x):
    """A plain callable, no parameters: its dtype is that of the captured tensor."""
    return Independent(Normal(x @ WEIGHT.to(x.dtype).T, 0.5), 1)


def fixed_closure(x):
    """A plain callable whose captured tensor keeps float32 (no cast on the user's side)."""
    return Independent(Normal(x @ WEIGHT.T, 0.5), 1)


def zuko_model(kind="nsf"):
    torch.manual_seed(0)
    make = zuko.flows.NSF if kind == "nsf" else zuko.flows.MAF
    return make(features=D, context=X, transforms=1, hidden_features=(8,))


def nflows_model():
    torch.manual_seed(0)
    transform = MaskedAffineAutoregressiveTransform(
        features=D, hidden_features=8, context_features=X
    )
    return Flow(transform, StandardNormal([D]))


def sbi_model():
    from sbi.neural_nets.net_builders import build_maf

    torch.manual_seed(0)
    return build_maf(torch.randn(50, D), torch.randn(50, X), hidden_features=8, num_transforms=1)


MODELS = {
    "zuko-nsf": lambda: zuko_model("nsf"),
    "zuko-maf": lambda: zuko_model("maf"),
    "nflows": nflows_model,
    "sbi": sbi_model,
    "torch-module": lambda: (torch.manual_seed(0), LinearGaussian())[1],
    "torch-callable": lambda: closure_gaussian,
}
# backends whose context width the adapter reads from the model (the others are caught
# when the model fails on x)
KNOWS_CONTEXT = {"zuko-nsf", "zuko-maf", "nflows", "sbi"}


def pairs(dtype=torch.float32, n=N):
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, D, generator=g).to(dtype), torch.randn(n, X, generator=g).to(dtype)


def calls(post, theta, x):
    """The adapter's four entry points, seeded so that sampling is repeatable."""
    torch.manual_seed(2)
    return {
        "log_prob": post.log_prob(theta, x),
        "score": post.score(theta, x),
        "to_latent": post.to_latent(theta, x),
        "sample": post.sample(x, 3),
    }


def wrong_width(shape):
    """The message for theta of shape ``shape`` against a posterior with D = 3."""
    expected = r"theta must have D = 3 columns like the posterior's event shape \(3,\)"
    return rf"{expected}, got shape \({shape}\)"


def model_in(name, dtype):
    model = MODELS[name]()
    return model.to(dtype) if isinstance(model, torch.nn.Module) else model


# -- the adapter ------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("width", [2, 4])
@pytest.mark.parametrize("method", ["log_prob", "score", "to_latent"])
def test_theta_of_the_wrong_width_is_named(name, width, method):
    post = cl.as_posterior(MODELS[name]())
    x = pairs()[1]
    bad = torch.randn(N, width)
    with pytest.raises(ValueError, match=wrong_width(f"24, {width}")):
        getattr(post, method)(bad, x)
    with pytest.raises(ValueError, match=wrong_width(f"5, 24, {width}")):
        getattr(post, method)(bad.expand(5, N, width), x)


@pytest.mark.parametrize("name", list(MODELS))
def test_x_narrower_than_the_context_is_named(name):
    post = cl.as_posterior(MODELS[name]())
    theta, x = pairs()
    narrow = x[:, :1]
    if name in KNOWS_CONTEXT:
        match = r"x must have shape \(N, 2\) for this posterior's context, got \(24, 1\)"
    else:
        match = r"x must have one observation of the width .* got x with shape \(24, 1\)"
    for call in (
        lambda: post.log_prob(theta, narrow),
        lambda: post.score(theta, narrow),
        lambda: post.to_latent(theta, narrow),
        lambda: post.sample(narrow, 2),
    ):
        with pytest.raises(ValueError, match=match) as info:
            call()
        assert "mat1" not in str(info.value)


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize(
    ("model_dtype", "data_dtype"),
    [(torch.float32, torch.float64), (torch.float64, torch.float32)],
)
def test_pairs_are_cast_to_the_model_and_results_to_the_pairs(name, model_dtype, data_dtype):
    post = cl.as_posterior(model_in(name, model_dtype))
    theta, x = pairs(model_dtype)
    expected = calls(post, theta, x)
    got = calls(post, theta.to(data_dtype), x.to(data_dtype))
    if name == "torch-callable":
        # no parameters: the model is built in x's dtype, and torch draws different
        # normal variates in float32 and float64
        del got["sample"], expected["sample"]
    for key, value in got.items():
        assert value.dtype == data_dtype, key
        tol = 1e-5 if torch.float32 in (model_dtype, data_dtype) else 1e-12
        torch.testing.assert_close(value, expected[key].to(data_dtype), rtol=tol, atol=tol)


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool])
def test_integer_x_is_cast_like_float_x(name, dtype):
    post = cl.as_posterior(MODELS[name]())
    theta, x = pairs()
    x = x.round().clamp(0, 1) if dtype == torch.bool else x.round()
    expected = calls(post, theta, x)
    got = calls(post, theta, x.to(dtype))
    for key, value in got.items():
        assert value.dtype == torch.float32, key
        torch.testing.assert_close(value, expected[key])


def test_a_callable_with_fixed_float32_tensors_names_the_dtype():
    # the adapter cannot read the dtype of tensors captured by a plain function:
    # torch's dtype error is translated, naming x's and theta's dtypes
    post = cl.as_posterior(fixed_closure)
    theta, x = pairs(torch.float64)
    with pytest.raises(
        ValueError,
        match=r"x and theta must have the dtype of the tensors .*"
        r"x with shape \(24, 2\) and dtype torch\.float64",
    ) as info:
        post.log_prob(theta, x)
    assert isinstance(info.value.__cause__, RuntimeError)
    with pytest.raises(ValueError, match=r"dtype torch\.float64"):
        post.sample(x, 2)


def test_a_model_that_mixes_dtypes_is_named():
    model = LinearGaussian()
    model.mean.bias.data = model.mean.bias.data.double()  # weight float32, bias float64
    theta, x = pairs()
    with pytest.raises(ValueError, match=r"model must hold its parameters and buffers in one"):
        cl.as_posterior(model).log_prob(theta, x)


def test_shape_errors_blame_theta_and_x_when_the_event_size_is_unknown():
    theta, x = torch.zeros(4, 2), torch.zeros(4, 3)
    match = r"theta and x must have the widths .* theta with shape \(4, 2\) and dtype"
    with pytest.raises(ValueError, match=match), model_errors(theta, x):
        theta @ torch.zeros(3, 3)
    match = r"x must have one observation of shape \(5,\) per row, got x with shape \(4, 3\)"
    with (
        pytest.raises(ValueError, match=match),
        model_errors(theta, x, context="shape (5,)", event_size=2),
    ):
        theta @ torch.zeros(3, 3)


def test_other_runtime_errors_pass_unchanged():
    def broken(x):
        raise RuntimeError("CUDA error: device-side assert triggered")

    with pytest.raises(RuntimeError, match="device-side assert"):
        cl.as_posterior(broken).sample(torch.zeros(3, X), 1)


def test_integer_theta_is_refused():
    post = cl.as_posterior(zuko_model())
    for method in ("log_prob", "score", "to_latent"):
        with pytest.raises(ValueError, match=r"theta must have a floating dtype, got torch\.int64"):
            getattr(post, method)(torch.zeros(N, D, dtype=torch.long), pairs()[1])


def test_check_pairs_casts_integer_x_to_theta():
    theta, x = pairs(torch.float64)
    _, cast = check_pairs(theta, x.round().long())
    assert cast.dtype == torch.float64
    with pytest.raises(ValueError, match=r"x must have the same dtype as theta \(torch\.float64\)"):
        check_pairs(theta, x.float())


def test_check_event_size():
    theta, x = pairs()
    check_event_size(zuko_model(), theta, x)
    check_event_size(torch.zeros(5, N, 2), theta, x)  # samples: nothing to read
    for model in (zuko_model(), nflows_model(), closure_gaussian):
        with pytest.raises(ValueError, match=wrong_width("24, 2")):
            check_event_size(model, theta[:, :2], x)


# -- the metrics ------------------------------------------------------------------------


METRICS = {
    "KCCSD": lambda obs: cl.KCCSD(num_null=50, base_points=8),
    "RankCalibration": lambda obs: cl.RankCalibration(num_posterior_samples=9),
    "LC2STNF": lambda obs: cl.LC2STNF(observations=obs, num_null=3, num_posterior_samples=16),
    "LC2ST": lambda obs: cl.LC2ST(observations=obs, num_null=3, num_posterior_samples=16),
    "TARP": lambda obs: cl.TARP(num_posterior_samples=9, num_null=20),
    "LatentCalibration": lambda obs: cl.LatentCalibration(),
}


def run_metric(name, model, theta, x, observations, *, states=False):
    torch.manual_seed(3)
    metric = METRICS[name](observations)
    metric.update(model, theta, x)
    out = metric.compute()
    return (out, metric) if states else out


def assert_same_results(got, expected, rtol, atol):
    assert got.keys() == expected.keys()
    for key, value in got.items():
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            torch.testing.assert_close(
                value.double(), expected[key].double(), rtol=rtol, atol=atol, msg=key
            )
        elif isinstance(value, torch.Tensor):
            assert torch.equal(value, expected[key]), key


@pytest.mark.parametrize("metric", list(METRICS))
@pytest.mark.parametrize("model", ["zuko-nsf", "nflows"])
@pytest.mark.parametrize("width", [2, 4])
def test_metrics_name_theta_of_the_wrong_width(metric, model, width):
    x = pairs()[1]
    with pytest.raises(ValueError, match=wrong_width(f"24, {width}")):
        run_metric(metric, MODELS[model](), torch.randn(N, width), x, x[:2])


@pytest.mark.parametrize("metric", list(METRICS))
@pytest.mark.parametrize("model", ["zuko-maf", "sbi"])
def test_metrics_name_x_narrower_than_the_context(metric, model):
    theta, x = pairs()
    # the local tests too: x is checked against the context before the observations
    match = r"x must have shape \(N, 2\) for this posterior's context, got \(24, 1\)"
    with pytest.raises(ValueError, match=match):
        run_metric(metric, MODELS[model](), theta, x[:, :1], x[:2])


@pytest.mark.parametrize("metric", ["LC2STNF", "LC2ST"])
@pytest.mark.parametrize("model", ["zuko-maf", "sbi"])
def test_local_metrics_name_observations_narrower_than_x(metric, model):
    """Issue 22: x fits the posterior, the observations do not; the error names them."""
    theta, x = pairs()
    match = r"observations must have shape \(O, 2\) like x and the posterior's context, got \(2"
    with pytest.raises(ValueError, match=match):
        run_metric(metric, MODELS[model](), theta, x, x[:2, :1])


@pytest.mark.parametrize("model", ["zuko-maf", "torch-callable"])
def test_diagnose_names_observations_of_the_wrong_width(model):
    """Issue 22: ``cl.diagnose(flow, theta, x, observations=x_o[:, :1])`` blames the
    observations, whether or not the adapter can read the context width."""
    theta, x = pairs()
    match = r"observations must have shape \(O, 2\) like x \(24, 2\).*got \(2, 1\)"
    with pytest.raises(ValueError, match=match):
        cl.diagnose(MODELS[model](), theta, x, observations=x[:2, :1])
    with pytest.raises(ValueError, match=wrong_width("24, 2")):
        cl.diagnose(MODELS[model](), theta[:, :2], x, observations=x[:2])


@pytest.mark.parametrize("metric", list(METRICS))
@pytest.mark.parametrize(
    ("model_dtype", "data_dtype"),
    [(torch.float32, torch.float64), (torch.float64, torch.float32)],
)
def test_metrics_work_with_pairs_in_another_dtype(metric, model_dtype, data_dtype):
    model = model_in("zuko-nsf", model_dtype)
    theta, x = pairs(model_dtype)
    expected, reference = run_metric(metric, model, theta, x, x[:2], states=True)
    theta, x = theta.to(data_dtype), x.to(data_dtype)
    got, checked = run_metric(metric, model, theta, x, x[:2], states=True)
    assert got["p_value"].dtype in (data_dtype, torch.float64)
    if metric in ("LC2STNF", "LC2ST"):
        # What the model gives (latents z* = T^-1(theta; x), or posterior draws) is the
        # same; the classifiers' random streams are keyed by the data's values, which
        # differ by the rounding of float32, so the statistic may differ.
        state = "latent" if metric == "LC2STNF" else "posterior_theta"
        torch.testing.assert_close(
            getattr(checked, state)[0].double(), getattr(reference, state)[0].double(),
            rtol=1e-4, atol=1e-4,
        )
        assert getattr(checked, state)[0].dtype == data_dtype
        assert ((got["p_value"] >= 0) & (got["p_value"] <= 1)).all()
    else:
        assert_same_results(got, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("metric", list(METRICS))
def test_metrics_accept_integer_x_like_float_x(metric):
    model = zuko_model()
    theta, x = pairs()
    x = x.round()
    expected = run_metric(metric, model, theta, x, x[:2])
    got = run_metric(metric, model, theta, x.long(), x[:2])
    assert_same_results(got, expected, rtol=0, atol=0)


@pytest.mark.parametrize("metric_type", [cl.RankCalibration, cl.LatentCalibration])
def test_num_dims_that_disagree_with_theta_and_the_posterior_name_num_dims(metric_type):
    """theta fits the posterior (D = 3): the metric's num_dims is what is wrong."""
    theta, x = pairs()
    with pytest.raises(ValueError, match=r"num_dims must equal theta's D = 3, got num_dims = 2"):
        metric_type(num_dims=2).update(zuko_model(), theta, x)
    with pytest.raises(ValueError, match=wrong_width("24, 2")):  # theta against the posterior
        metric_type(num_dims=2).update(zuko_model(), theta[:, :2], x)


def test_reference_samples_of_the_wrong_width_are_named_before_any_check():
    theta, x = pairs()
    with pytest.raises(ValueError, match=r"reference_samples must have shape \(S_ref, O, D\) "
                                         r"for the O observations and D = 3 parameters, got "
                                         r"\(10, 2, 2\)"):  # fmt: skip
        cl.diagnose(zuko_model(), theta, x, observations=x[:2],
                    reference_samples=torch.zeros(10, 2, 2))  # fmt: skip


# -- a log-density without a gradient, data on another device (issue 24, item 6) ----------


class NoGradNormal(Normal):
    """A Normal whose log_prob runs under torch.no_grad (an estimator evaluated so)."""

    def log_prob(self, value):
        with torch.no_grad():
            return super().log_prob(value)


NOT_DIFFERENTIABLE = {
    # piecewise constant in theta: autograd's graph has no path to theta
    "box-uniform": lambda x: Independent(torch.distributions.Uniform(x - 5.0, x + 5.0), 1),
    "no-grad": lambda x: Independent(NoGradNormal(0.8 * x, 0.2**0.5), 1),  # exact
}
NEEDS_A_GRADIENT = "needs a log-density differentiable in theta"


@pytest.mark.parametrize("name", list(NOT_DIFFERENTIABLE))
def test_kccsd_and_its_loss_need_a_differentiable_log_density(name):
    theta, x = cl.tasks.GaussianToy(dim=2).sample(20, torch.Generator().manual_seed(0))
    posterior = NOT_DIFFERENTIABLE[name]
    with pytest.raises(ValueError, match=NEEDS_A_GRADIENT):
        cl.KCCSD(num_null=20).update(posterior, theta, x)
    with pytest.raises(ValueError, match=NEEDS_A_GRADIENT):
        cl.KCCSDLoss(space="parameter")(posterior, theta, x)


@pytest.mark.parametrize("name", list(NOT_DIFFERENTIABLE))
def test_diagnose_skips_kccsd_without_a_differentiable_log_density(name):
    toy = cl.tasks.GaussianToy(dim=2)
    theta, x = toy.sample(100, torch.Generator().manual_seed(0))
    report = cl.diagnose(NOT_DIFFERENTIABLE[name], theta, x, num_posterior_samples=20,
                         checks=("kccsd", "ranks", "tarp"))  # fmt: skip
    assert set(report.checks) == {"ranks", "tarp"}
    assert NEEDS_A_GRADIENT in report.skipped["kccsd"]
    assert f"skipped kccsd: the score (KCCSD, KCCSDLoss) {NEEDS_A_GRADIENT}" in report.table()
    # the verdict comes from the checks that ran: the no-grad Normal is the exact
    # posterior (calibrated), the box of half-width 5 is far too wide (rejected)
    calibrated = report.verdict.startswith("calibrated")
    assert calibrated == (name == "no-grad"), report.verdict


DEVICE_METRICS = ["KCCSD", "RankCalibration", "TARP", "LatentCalibration", "LC2STNF"]
MISPLACED = {
    "theta-on-meta": (
        "meta", "cpu", r"theta and x must be on one device \(the model's\), got theta on "
        r"meta and x on cpu"),
    "x-on-meta": (
        "cpu", "meta", r"theta and x must be on one device \(the model's\), got theta on "
        r"cpu and x on meta"),
    "both-on-meta": ("meta", "meta", r"theta must hold values .* got a tensor on the meta"),
}  # fmt: skip


def _diagnose(model, theta, x, observations):
    return cl.diagnose(model, theta, x, observations=observations, num_posterior_samples=9,
                       checks=("kccsd", "ranks", "tarp", "lc2st_nf"))  # fmt: skip


@pytest.mark.parametrize("entry", [*DEVICE_METRICS, "diagnose"])
@pytest.mark.parametrize("case", list(MISPLACED))
def test_data_on_another_device_is_named(entry, case):
    theta_device, x_device, match = MISPLACED[case]
    theta, x = pairs()
    model = zuko_model("maf")  # on the cpu
    theta, x = theta.to(theta_device), x.to(x_device)
    run = _diagnose if entry == "diagnose" else lambda *args: run_metric(entry, *args)
    with pytest.raises(ValueError, match=match):
        run(model, theta, x, pairs()[1][:2])


@pytest.mark.parametrize("entry", [*DEVICE_METRICS, "diagnose"])
def test_a_model_on_another_device_than_the_data_is_named(entry):
    theta, x = pairs()
    model = zuko_model("maf").to("meta")
    match = r"x must be on the posterior's device meta \(where its parameters are\), got x on cpu"
    run = _diagnose if entry == "diagnose" else lambda *args: run_metric(entry, *args)
    with pytest.raises(ValueError, match=match):
        run(model, theta, x, x[:2])


def test_diagnose_skips_lc2st_nf_when_the_base_is_not_normal():
    """A box uniform has no score and no standard-normal latents: both checks are skipped
    with the adapter's reason, the sampling checks, L-C2ST in L-C2ST-NF's place and the
    misspecification test run."""
    theta, x = cl.tasks.GaussianToy(dim=2).sample(100, torch.Generator().manual_seed(0))
    report = cl.diagnose(NOT_DIFFERENTIABLE["box-uniform"], theta, x, observations=x[:2],
                         num_posterior_samples=20)  # fmt: skip
    assert set(report.skipped) == {"kccsd", "lc2st_nf"}
    assert "to_latent needs a flow or a Gaussian" in report.skipped["lc2st_nf"]
    assert {"ranks", "tarp", "recovery", "lc2st", "misspecification"} <= set(report.checks)
    assert "skipped lc2st_nf: to_latent needs" in report.table()
