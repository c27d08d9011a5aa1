# %% [markdown]
# # A real model: the Jansen-Rit neural mass model
#
# The stochastic Jansen-Rit neural mass model produces signals like an EEG recording: a
# cortical column of pyramidal cells and excitatory and inhibitory interneurons, driven by
# noisy input. The L-C2ST paper (Linhart, Gramfort and Rodrigues 2023, section 4.2) uses
# it to show what a local diagnostic tells a scientist on a model like theirs.
# `calib_lightning.tasks.JansenRit` simulates it in torch (the Strang splitting of
# Ableidinger, Buckwar and Hinterleitner 2017: 2 s of burn-in, 8 s at 128 Hz, float64,
# vectorized over the batch), with the paper's prior on
# `theta = (C, mu, sigma, g)` (connectivity, mean and scale of the input, gain in dB)
# and the paper's summary, the log power spectral density (33 features, `LogPSD`).
#
# The budget here is small (2,000 simulations, a few epochs, 500 held-out pairs) so that
# the guide runs in a few minutes on a laptop CPU; the paper's budget (50,000
# simulations) and our full run are in
# [the Jansen-Rit benchmark](../../examples/benchmarks/results/jansen_rit.md)
# (`examples/benchmarks/jansen_rit.py`).

# %%
from pathlib import Path

import matplotlib.pyplot as plt
import torch
import zuko
from torch import nn

import calib_lightning as cl
from calib_lightning.plots import plot_pp, plot_probability_map, plot_rank_ecdf
from calib_lightning.tasks import JansenRit, LogPSD

torch.manual_seed(0)
figures = Path("figures")
figures.mkdir(exist_ok=True)

# %% [markdown]
# ## The simulator and its summary
#
# `JansenRit(summary=False)` returns the 1,024-sample series; the default returns its
# log-PSD. At the paper's default parameters the spectrum peaks in the alpha band
# (about 10 Hz); the gain `g` multiplies the signal by `10^(g/10)`, so it shifts the
# log10-PSD by `g / 5` and leaves its shape alone.

# %%
task = JansenRit()
default = torch.tensor([[135.0, 220.0, 2000.0, 0.0], [135.0, 220.0, 2000.0, 10.0]])
simulator = JansenRit(summary=False)
# one seed for both rows: the same noise, so the two series differ by the gain only
series = torch.cat(
    [simulator.simulate(row[None], torch.Generator().manual_seed(0)) for row in default]
)
summary = LogPSD()(series)
freqs = LogPSD().frequencies()
print("series:", tuple(series.shape), "summary:", tuple(summary.shape))
print(f"peak of the PSD at {freqs[1:][summary[0, 1:].argmax()]:.1f} Hz")
print(f"log-PSD shift for g = 10: {(summary[1] - summary[0]).mean():.3f} (g / 5 = 2)")

fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3))
time = torch.arange(256) / 128
left.plot(time, series[0, :256])
left.set(xlabel="time (s)", ylabel="X2 - X3 (mV)", title="2 s of the signal, g = 0")
right.plot(freqs, summary[0], label="g = 0")
right.plot(freqs, summary[1], label="g = 10")
right.set(xlabel="frequency (Hz)", ylabel="log10 PSD", title="the summary x (33 features)")
right.legend()
fig.tight_layout()
fig.savefig(figures / "signal_and_summary.png", dpi=100)

# %% [markdown]
# ![a simulated signal and its log-PSD](figures/signal_and_summary.png)
#
# ## A neural posterior
#
# A zuko masked autoregressive flow with 10 layers, as in the paper, on standardized
# `theta` and `x`; a plain maximum-likelihood loop (Lightning works the same).

# %%
generator = torch.Generator().manual_seed(1)
theta, x = task.sample(2_000, generator)
theta_cal, x_cal = task.sample(500, generator)  # held out
gains = [-20.0, -10.0, 0.0, 10.0, 20.0]
theta_o = torch.tensor([[135.0, 220.0, 2000.0, g] for g in gains])
x_o = task.simulate(theta_o, generator)  # the observations to analyse


class Standardized(nn.Module):
    """A conditional flow on standardized theta and x, as a distribution in raw units."""

    def __init__(self, theta: torch.Tensor, x: torch.Tensor) -> None:
        super().__init__()
        self.flow = zuko.flows.MAF(4, 33, transforms=10, hidden_features=(50, 50))
        self.register_buffer("shift", theta.mean(0))
        self.register_buffer("scale", theta.std(0))
        self.register_buffer("x_mean", x.mean(0))
        self.register_buffer("x_std", x.std(0))

    def forward(self, x: torch.Tensor) -> torch.distributions.Distribution:
        inner = self.flow((x - self.x_mean) / self.x_std)
        affine = torch.distributions.AffineTransform(-self.shift / self.scale, 1 / self.scale)
        return zuko.distributions.NormalizingFlow(
            zuko.transforms.ComposedTransform(affine, inner.transform), inner.base
        )


model = Standardized(theta, x)
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
for _ in range(20):
    for batch in torch.randperm(len(theta)).split(128):
        loss = -model(x[batch]).log_prob(theta[batch]).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
model.eval()

# %% [markdown]
# ## Global checks
#
# `cl.diagnose` on the held-out pairs: the marginal and joint rank calibration (the
# paper's SBC ranks and HPD rank), KCCSD, TARP, the joint classifier test, recovery,
# and with the prior the support check (a flow has mass outside the prior's box; the
# true posterior has none).

# %%
labels = ["C", "mu", "sigma", "g"]
report = cl.diagnose(
    model,
    theta_cal,
    x_cal,
    labels=labels,
    prior=task.prior(),
    num_posterior_samples=50,
    checks=["kccsd", "ranks", "tarp", "joint_c2st", "support"],
)
print(report.verdict)
print(report.table())
plot_rank_ecdf(report.checks["ranks"], labels=labels, figsize=(10, 3.5)).savefig(
    figures / "ranks_ecdf.png", dpi=100
)

# %% [markdown]
# **Rank ECDFs** minus the identity, per parameter and for the joint (HPD-like) rank:
# inside the grey band when calibrated. The paper's Figure 3 (left) finds the joint rank
# outside while the marginal ranks stay inside.
#
# ![rank ECDFs](figures/ranks_ecdf.png)
#
# ## Local checks: L-C2ST-NF across the gain
#
# The paper's question: at which observations is the posterior wrong? L-C2ST-NF at five
# observations with `(C, mu, sigma) = (135, 220, 2000)` and a gain from -20 to 20 dB.
# 100 null classifiers: the smallest p-value it can give is 1/101.

# %%
local = cl.LC2STNF(observations=x_o, num_null=100, num_posterior_samples=2_000)
local.update(model, theta_cal, x_cal)
result = local.compute()
for g, t, p in zip(gains, result.statistic, result.p_value, strict=True):
    print(f"g = {g:+5.0f} dB: statistic {t:.4f}, p-value {p:.3g}")

shown = gains.index(10.0)
maps = local.probability_map(model, num_posterior_samples=2_000)
plot_pp(result, observations=[shown], names=["g = 10"]).savefig(figures / "pp_g10.png", dpi=100)
plot_probability_map(
    maps.samples[shown],
    maps.probabilities[shown],
    labels=labels,
    truth=theta_o[shown],
    title="L-C2ST-NF probability map at g = 10",
).savefig(figures / "map_g10.png", dpi=80)

# %% [markdown]
# **PP-plot** at `g = 10`: the ECDF of the classifier's output at the observation (blue)
# against the band of the null classifiers (grey); outside the band, the posterior is
# inconsistent there.
#
# ![PP-plot at g = 10](figures/pp_g10.png)
#
# **Probability map** at `g = 10`: the flow's draws at the observation, each bin coloured
# by the classifier's mean output (red: the flow puts too much mass there, blue: too
# little, white: consistent), the true parameter as a crosshair. This is the paper's
# Figure 4.
#
# ![probability map at g = 10](figures/map_g10.png)
#
# With this small budget the numbers are not the paper's; the full run, the paper's
# findings beside ours and where they differ are in the benchmark's results file.
