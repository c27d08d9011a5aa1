"""The balance of a ratio estimator (Delaunoy et al. 2022): closed forms, the test's level
on the exact ratio, power and sign on tempered and shifted ratios, the callback.

Model: theta ~ N(0, 1), x | theta ~ N(theta, s^2) in D = 1, whose exact log-ratio is
log N(x; theta, s^2) - log N(x; 0, 1 + s^2).
"""

import math

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from scipy import stats
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import calib_lightning as cl
from calib_lightning.callbacks import RatioBalanceCallback
from calib_lightning.functional import balance_from_sums, balance_sums, ratio_balance

S = 0.5
#: (s, N, datasets): from a vague (s = 2) to a sharp (s = 0.1) posterior
LEVEL_CASES = [(2.0, 20, 2000), (0.5, 20, 2000), (0.1, 100, 2000), (2.0, 200, 1000),
               (0.5, 200, 1000), (0.1, 200, 1000)]  # fmt: skip


def exact_log_ratio(s=S, tau=1.0, shift=0.0):
    """The exact log r of the Gaussian model, tempered by tau and shifted by shift."""

    def log_r(theta, x):
        theta, x = theta[..., 0], x[..., 0]
        log_lik = -0.5 * ((x - theta) / s) ** 2 - math.log(s)
        log_evidence = -0.5 * x**2 / (1 + s * s) - 0.5 * math.log(1 + s * s)
        return tau * (log_lik - log_evidence) + shift

    return log_r


def pairs(shape, seed, s=S):
    """Fresh joint pairs theta, x of shape (*shape, 1), float64."""
    g = torch.Generator().manual_seed(seed)
    theta = torch.randn(*shape, 1, generator=g, dtype=torch.float64)
    return theta, theta + s * torch.randn(*shape, 1, generator=g, dtype=torch.float64)


def all_pairs(log_r, theta, x):
    """log r(theta_j, x_i) at [..., i, j], (*, N, N), for datasets theta, x of (*, N, 1)."""
    n = theta.shape[-2]
    lead = theta.shape[:-2]
    return log_r(theta[..., None, :, :].expand(*lead, n, n, 1),
                 x[..., :, None, :].expand(*lead, n, n, 1))  # fmt: skip


def band(reps, level=0.05):
    """The 99 % binomial band of the rejection count at ``level``."""
    return stats.binom.ppf(0.005, reps, level), stats.binom.ppf(0.995, reps, level)


# -- closed forms -----------------------------------------------------------------------
@pytest.mark.parametrize("s", [0.3, 1.0, 3.0])
def test_exact_ratio_is_balanced_by_quadrature(s):
    """E_joint[sigmoid(log r)] + E_marginal[sigmoid(log r)] = 1 for the exact ratio, by
    the trapezoid rule on a fine grid in float64 (over theta and the noise, or theta' and x)."""
    nodes = torch.linspace(-9, 9, 1801, dtype=torch.float64)  # trapezoid: spectral here
    weights = torch.exp(-0.5 * nodes**2) / math.sqrt(2 * math.pi) * (nodes[1] - nodes[0])
    a, b = nodes[:, None], nodes[None, :]
    w = weights[:, None] * weights[None, :]
    log_r = exact_log_ratio(s)
    joint = (w * torch.sigmoid(log_r(a[..., None], (a + s * b)[..., None]))).sum()
    marginal_x = math.sqrt(1 + s * s) * b  # x ~ N(0, 1 + s^2), theta' ~ N(0, 1) apart
    marginal = (w * torch.sigmoid(log_r(a[..., None], marginal_x[..., None]))).sum()
    assert abs(float(joint + marginal) - 1) < 1e-6
    tempered = exact_log_ratio(s, tau=1.5)
    over = (w * torch.sigmoid(tempered(a[..., None], (a + s * b)[..., None]))).sum() + (
        w * torch.sigmoid(tempered(a[..., None], marginal_x[..., None]))
    ).sum()
    assert float(over) - 1 > 1e-4  # tempering unbalances it (sign: test_sign_and_power)


def test_statistic_and_standard_error_by_hand():
    """B = mean of the diagonal's sigmoid + mean of the off-diagonal's - 1; the variance
    of the projection psi_i = d_ii + row mean_i + column mean_i plus the residuals' term,
    by hand."""
    g = torch.Generator().manual_seed(0)
    n = 24
    f = torch.randn(n, n, generator=g, dtype=torch.float64)
    out = ratio_balance(f)
    d = torch.sigmoid(f)
    off = ~torch.eye(n, dtype=torch.bool)
    b = d.diag().mean() + d[off].mean() - 1
    psi = d.diag() + torch.stack([d[i][off[i]].mean() for i in range(n)]) + torch.stack(
        [d[:, j][off[:, j]].mean() for j in range(n)])
    e = d - torch.stack([d[i][off[i]].mean() for i in range(n)])[:, None] - torch.stack(
        [d[:, j][off[:, j]].mean() for j in range(n)])[None, :] + d[off].mean()
    se = (psi.var() / n + (e[off] ** 2).mean() / (n * (n - 1))).sqrt()
    torch.testing.assert_close(out.statistic, b, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out.standard_error, se, rtol=1e-12, atol=1e-12)
    assert float(out.p_value) == pytest.approx(2 * stats.t.sf(abs(float(b / se)), n - 1))
    half = stats.t.ppf(0.975, n - 1) * float(se)
    assert float(out.upper - out.lower) == pytest.approx(2 * half, rel=1e-10)
    torch.testing.assert_close(out.joint, d.diag().mean())
    torch.testing.assert_close(out.marginal, d[off].mean())
    # two batches: the sums add; B-hat is the pairs-weighted mean of the batches' B-hats
    first, second = ratio_balance(f[:10, :10]), ratio_balance(f[10:, 10:])
    both = balance_from_sums(balance_sums(f[:10, :10]) + balance_sums(f[10:, 10:]))
    torch.testing.assert_close(both.statistic, (10 * first.statistic + 14 * second.statistic) / 24)
    torch.testing.assert_close(both.standard_error**2, (100 * first.standard_error**2
                                                        + 196 * second.standard_error**2) / 576)


# -- level ----------------------------------------------------------------------------
@pytest.mark.parametrize(("s", "n", "reps"), LEVEL_CASES)
def test_level_on_the_exact_ratio(s, n, reps):
    """Fresh datasets, vectorized: rejections at 0.05 at most the 99 % binomial band's top
    (the test is conservative for small N), inside the band from N = 200 on, the interval
    misses 0 as often, and there the standard error matches the statistic's spread."""
    theta, x = pairs((reps, n), seed=int(100 * s) + n, s=s)
    out = ratio_balance(all_pairs(exact_log_ratio(s), theta, x))
    low, high = band(reps)
    low = low if n >= 200 else 0
    rejections = int((out.p_value < 0.05).sum())
    assert low <= rejections <= high, (rejections, low, high)
    misses = int(((out.lower > 0) | (out.upper < 0)).sum())
    assert low <= misses <= high
    ratio = float(out.statistic.std() / out.standard_error.mean())
    assert (0.9 if n >= 200 else 0.8) < ratio < 1.1, ratio


def test_level_of_the_public_class_with_default_arguments():
    """cl.RatioBalance(), default arguments, 400 fresh datasets of 100 pairs (two updates
    of 50 each): rejections at 0.05 inside the 99 % band."""
    reps, n = 400, 100
    theta, x = pairs((reps, n), seed=7)
    log_r = exact_log_ratio()
    metric = cl.RatioBalance()
    p = []
    for r in range(reps):
        metric.reset()
        metric.update(log_r, theta[r, :50], x[r, :50])
        metric.update(log_r, theta[r, 50:], x[r, 50:])
        p.append(float(metric.compute().p_value))
    low, high = band(reps)
    rejections = sum(v < 0.05 for v in p)
    assert low <= rejections <= high, (rejections, low, high)


# -- power and sign -----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("tau", "shift", "sign"),
    [(1.5, 0.0, 1), (0.6, 0.0, -1), (1.0, 0.3, 1), (1.0, -0.3, -1)],
)
def test_sign_and_power(tau, shift, sign):
    """Over-confident (tau = 1.5) and up-shifted ratios are positively unbalanced,
    under-confident (tau = 0.6) and down-shifted ones negatively: 400 fresh datasets of
    200 pairs, rejected with that sign (never the other), and through the public class."""
    reps, n = 400, 200
    theta, x = pairs((reps, n), seed=11)
    log_r = exact_log_ratio(tau=tau, shift=shift)
    out = ratio_balance(all_pairs(log_r, theta, x))
    power = float(((out.p_value < 0.05) & (out.statistic * sign > 0)).double().mean())
    assert power > 0.95, power
    assert not bool(((out.p_value < 0.05) & (out.statistic * sign < 0)).any())
    metric = cl.RatioBalance()
    metric.update(log_r, theta[0], x[0])
    one = metric.compute()
    assert float(one.statistic) * sign > 0
    assert float(one.p_value) < 0.05
    assert float(one.lower if sign > 0 else -one.upper) > 0


# -- adapters -------------------------------------------------------------------------
def test_sbi_ratio_estimator_and_its_unnormalized_posterior_agree():
    pytest.importorskip("sbi")
    from sbi.neural_nets import classifier_nn
    from sbi.utils import BoxUniform

    torch.manual_seed(0)
    theta, x = pairs((64,), seed=3)
    theta, x = theta.float().repeat(1, 2), x.float().repeat(1, 2)
    estimator = classifier_nn("mlp")(theta, x)
    prior = BoxUniform(-5 * torch.ones(2), 5 * torch.ones(2))
    outs = []
    for obj in (estimator, cl.UnnormalizedPosterior(estimator, prior=prior),
                lambda t, y: estimator.unnormalized_log_ratio(t, y)):  # fmt: skip
        metric = cl.RatioBalance()
        metric.update(obj, theta, x)
        outs.append(metric.compute())
    for out in outs[1:]:
        torch.testing.assert_close(out.statistic, outs[0].statistic)
        torch.testing.assert_close(out.p_value, outs[0].p_value)


# -- bad inputs --------------------------------------------------------------------------
def test_bad_inputs_name_the_argument():
    theta, x = pairs((20,), seed=0)
    f = torch.zeros(20, 20, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"floating tensor of shape \(\*, N, N\)"):
        ratio_balance(f[:, :10])
    with pytest.raises(ValueError, match="log_ratio must be a floating tensor"):
        ratio_balance(f.long())
    with pytest.raises(ValueError, match="log_ratio must be finite"):
        ratio_balance(f.clone().fill_(float("nan")))
    with pytest.raises(ValueError, match="at least 10 pairs"):
        ratio_balance(f[:5, :5])
    with pytest.raises(ValueError, match="confidence"):
        ratio_balance(f, confidence=1.0)
    with pytest.raises(ValueError, match="confidence"):
        cl.RatioBalance(confidence=1.5)
    with pytest.raises(ValueError, match="max_pairs_per_call"):
        cl.RatioBalance(max_pairs_per_call=0)
    metric = cl.RatioBalance()
    with pytest.raises(ValueError, match="needs at least one update"):
        metric.compute()
    with pytest.raises(ValueError, match="theta"):
        metric.update(exact_log_ratio(), theta[:1], x[:1])
    with pytest.raises(ValueError, match=r"estimator must return log r of shape \(M,\)"):
        metric.update(lambda t, y: t, theta, x)
    with pytest.raises(ValueError, match="estimator returned 400 non-finite"):
        metric.update(lambda t, y: t[:, 0] / 0.0, theta, x)
    with pytest.raises(ValueError, match="estimator must be a ratio estimator"):
        metric.update(cl.tasks.GaussianToy(dim=1).posterior(), theta.float(), x.float())
    with pytest.raises(ValueError, match="estimator must be a ratio estimator"):
        metric.update(object(), theta, x)


def test_a_likelihood_posterior_is_refused():
    pytest.importorskip("sbi")
    from sbi.neural_nets import likelihood_nn
    from sbi.utils import BoxUniform

    theta, x = pairs((32,), seed=1)
    theta, x = theta.float(), x.float()
    estimator = likelihood_nn("mdn")(theta, x)
    post = cl.UnnormalizedPosterior(estimator, prior=BoxUniform(-torch.ones(1), torch.ones(1)))
    with pytest.raises(ValueError, match=r"estimator must be a ratio estimator.*likelihood"):
        cl.RatioBalance().update(post, theta, x)


# -- callback ---------------------------------------------------------------------------
class _Ratio(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(2, 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, theta, x):
        return self.net(torch.cat([theta, x], -1))[:, 0]


class _NRE(L.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.ratio = _Ratio()

    def training_step(self, batch, batch_idx):
        theta, x = batch
        joint = self.ratio(theta, x)
        marginal = self.ratio(theta.roll(1, 0), x)
        loss = nn.functional.softplus(-joint).mean() + nn.functional.softplus(marginal).mean()
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


def test_callback_logs_statistic_and_p_value(tmp_path):
    theta, x = pairs((256,), seed=5)
    theta_cal, x_cal = pairs((200,), seed=6)
    callback = RatioBalanceCallback(theta_cal.float(), x_cal.float(), estimator="ratio",
                                    log_figures=False)  # fmt: skip
    trainer = L.Trainer(max_epochs=2, logger=CSVLogger(tmp_path), callbacks=[callback],
                        enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False)  # fmt: skip
    trainer.fit(_NRE(), DataLoader(TensorDataset(theta.float(), x.float()), batch_size=64))
    assert callback.epochs == [0, 1]
    rows = (tmp_path / "lightning_logs" / "version_0" / "metrics.csv").read_text().splitlines()
    header = rows[0].split(",")
    for key in ("statistic", "p_value", "standard_error", "lower", "upper"):
        column = header.index(f"calibration/balance/{key}")
        values = [float(r.split(",")[column]) for r in rows[1:] if r.split(",")[column]]
        assert len(values) == 2
        assert all(math.isfinite(v) for v in values)
    assert len(callback.history["statistic"]) == 2
    last = callback.last_result
    assert float(last.lower) <= float(last.statistic) <= float(last.upper)


def test_callback_setup_raises_on_a_missing_or_wrong_estimator(tmp_path):
    theta_cal, x_cal = pairs((50,), seed=6)
    for estimator, match in (("nothing", "estimator must name an attribute"),
                             (lambda m: object(), "estimator must be a ratio estimator")):
        callback = RatioBalanceCallback(theta_cal.float(), x_cal.float(), estimator=estimator)
        trainer = L.Trainer(max_epochs=1, logger=False, callbacks=[callback],
                            enable_progress_bar=False, enable_model_summary=False,
                            enable_checkpointing=False)  # fmt: skip
        data = DataLoader(TensorDataset(theta_cal.float(), x_cal.float()), batch_size=25)
        with pytest.raises(ValueError, match=match):
            trainer.fit(_NRE(), data)
