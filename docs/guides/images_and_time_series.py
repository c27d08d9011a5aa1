# %% [markdown]
# # Images and time series: an embedding network
#
# When observations are images or time series, the flow conditions on the features of
# an embedding network trained with it. Every check takes `x` of any shape: the
# posterior maps `(N, *X)` observations to `q(theta | x)` and the checks never look
# inside. What the embedding changes is the local test at an observation, whose
# classifiers should see the embedding's features rather than raw pixels.
#
# Two simulators of `calib_lightning.tasks`: `GaussianBlob`, a noisy 16 x 16 image of a
# blob whose centre and width are the parameters, and `Oscillator`, a noisy damped
# oscillation at 50 times whose frequency, damping and amplitude are the parameters. The
# budgets are small (2,000 simulations, 8 epochs, 300 held-out pairs) so that the guide
# runs in about a minute on a laptop CPU: the posteriors are only roughly trained.

# %%
from pathlib import Path

import matplotlib.pyplot as plt
import torch
import zuko
from torch import nn

import calib_lightning as cl
from calib_lightning.plots import plot_rank_ecdf
from calib_lightning.tasks import GaussianBlob, Oscillator

torch.manual_seed(0)
figures = Path("figures")
figures.mkdir(exist_ok=True)

# %% [markdown]
# ## An embedded flow
#
# One module: `self.embedding` maps an observation to 16 features, `self.flow` is a
# conditional zuko NSF on them, and `forward(x)` returns the distribution
# `q(theta | x)`. A module called `x -> Distribution` is what `cl.as_posterior` (so
# every metric, callback and `cl.diagnose`) takes as it is.


# %%
class EmbeddedFlow(nn.Module):
    def __init__(self, embedding: nn.Module, theta_dim: int, features: int = 16) -> None:
        super().__init__()
        self.embedding = embedding
        self.flow = zuko.flows.NSF(theta_dim, features, transforms=3, hidden_features=(64, 64))

    def forward(self, x: torch.Tensor) -> torch.distributions.Distribution:
        return self.flow(self.embedding(x))


def train(
    model: nn.Module, theta: torch.Tensor, x: torch.Tensor, epochs: int = 8, batch_size: int = 128
) -> nn.Module:
    """Maximum likelihood with Adam: a plain PyTorch loop (Lightning works the same)."""
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    for _ in range(epochs):
        for batch in torch.randperm(len(theta)).split(batch_size):
            loss = -model(x[batch]).log_prob(theta[batch]).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return model.eval()


# %% [markdown]
# ## Images
#
# A small CNN embeds the `(N, 1, 16, 16)` images:

# %%
blob = GaussianBlob(size=16)
generator = torch.Generator().manual_seed(0)
theta, x = blob.sample(2_000, generator)
theta_cal, x_cal = blob.sample(300, generator)  # held out
theta_o, x_o = blob.sample(2, generator)  # the observations to analyse
print("images:", tuple(x.shape))

cnn = nn.Sequential(
    nn.Conv2d(1, 8, 3, stride=2, padding=1), nn.ReLU(),
    nn.Conv2d(8, 16, 3, stride=2, padding=1), nn.ReLU(),
    nn.Flatten(), nn.Linear(16 * 4 * 4, 16),
)
image_model = train(EmbeddedFlow(cnn, theta_dim=3), theta, x)

# %% [markdown]
# `cl.diagnose` takes the model and the images as they are. Its `embedding` argument
# gives the misspecification test (does each `x_o` look like a simulation?) the
# embedding's features instead of standardized raw pixels.

# %%
labels = ["centre_1", "centre_2", "log_width"]
report = cl.diagnose(
    image_model, theta_cal, x_cal, observations=x_o, labels=labels,
    embedding=image_model.embedding, num_posterior_samples=50,
    checks=["kccsd", "ranks", "recovery", "lc2st_nf", "misspecification"],
)
print(report.verdict)
print(report.table())

# %% [markdown]
# The local test alone, as a metric: `cl.LC2STNF(..., embedding=net)` gives its
# classifiers the network's features of `x` next to the flow's latents (the same in
# `LC2STNFCallback(embedding="embedding")`, by attribute name). A network that trains
# along makes the callback retrain the null at each check; a frozen copy
# (`copy.deepcopy(net)`) keeps one.

# %%
local = cl.LC2STNF(observations=x_o, embedding=image_model.embedding, num_null=30)
local.update(image_model, theta_cal, x_cal)
result = local.compute()
print("L-C2ST-NF p-value at each observation:", [f"{p:.3g}" for p in result.p_value])

# %% [markdown]
# With 30 null classifiers (100 by default), the smallest p-value this test can give is
# 1/31 = 0.032. Read it beside the L-C2ST-NF row of `cl.diagnose` above, whose
# classifiers get the observations themselves (`cl.diagnose`'s `embedding` goes to the
# misspecification test only): the two are different tests of the same posterior.

# %% [markdown]
# What the flow learned: its posterior at the first observation, beside the image and
# the true blob.

# %%
with torch.no_grad():
    draws = image_model(x_o[:1]).sample((1_000,))[:, 0]  # (1000, 3)
fig, (left, right) = plt.subplots(1, 2, figsize=(7, 3.2))
left.imshow(x_o[0, 0], cmap="gray", extent=(0, 1, 1, 0))
left.set_title("observation 0")
right.scatter(draws[:, 1], draws[:, 0], s=2, alpha=0.3, label="posterior draws")
right.plot(theta_o[0, 1], theta_o[0, 0], "r*", markersize=12, label="true centre")
right.set(xlim=(0.1, 0.9), ylim=(0.9, 0.1), xlabel="centre_2 (column)",
          ylabel="centre_1 (row)", title="posterior of the centre")
right.legend(fontsize=8, loc="lower right")
fig.tight_layout()
fig.savefig(figures / "blob_posterior.png", dpi=100)
report.figures["recovery_mean_vs_truth"].savefig(figures / "blob_recovery.png", dpi=100)

# %% [markdown]
# ![an observed image and the posterior of its centre](figures/blob_posterior.png)
#
# **Recovery**: the posterior mean against the true parameter for each held-out pair
# (error bars: one posterior standard deviation), on the diagonal when the posterior
# has learned the parameter.
#
# ![recovery on the images](figures/blob_recovery.png)
#
# ## Time series
#
# The same with a 1-D convolutional embedding of the `(N, 50)` series (a channel
# dimension added inside the network):

# %%
oscillator = Oscillator(length=50)
theta, x = oscillator.sample(2_000, generator)
theta_cal, x_cal = oscillator.sample(300, generator)
print("series:", tuple(x.shape))

conv = nn.Sequential(
    nn.Unflatten(1, (1, 50)),
    nn.Conv1d(1, 8, 5, stride=2, padding=2), nn.ReLU(),
    nn.Conv1d(8, 16, 5, stride=2, padding=2), nn.ReLU(),
    nn.Flatten(), nn.Linear(16 * 13, 16),
)
series_model = train(EmbeddedFlow(conv, theta_dim=3), theta, x)

# %% [markdown]
# Sampling-free first: `cl.LatentCalibration` tests the truths' latent points
# `z* = T_x^-1(theta*)` for a standard normal (one inverse pass per pair, no posterior
# draws), the cheap check to run often when the flow or `D` is large. Then the ranks,
# with 50 draws per pair:

# %%
latent = cl.LatentCalibration()
latent.update(series_model, theta_cal, x_cal)
z_check = latent.compute()
print(f"latent calibration: global p-value {z_check.global_p_value:.3g}")
print("latent means (0 if calibrated):", [f"{m:+.2f}" for m in z_check.latent_mean])
print("latent standard deviations (1 if calibrated):", [f"{s:.2f}" for s in z_check.latent_std])

ranks = cl.RankCalibration(num_posterior_samples=50)
ranks.update(series_model, theta_cal, x_cal)
rank_check = ranks.compute()
print(f"rank calibration: global p-value {rank_check.global_p_value:.3g}, "
      f"coverage error {rank_check.coverage_error:+.3f}")

names = ["frequency", "damping", "amplitude"]
plot_rank_ecdf(rank_check, labels=names, figsize=(9, 3.5)).savefig(
    figures / "oscillator_ranks_ecdf.png", dpi=100
)

# %% [markdown]
# **ECDF of the ranks** for each parameter and the joint rank: inside the grey band when
# calibrated.
#
# ![rank ECDF on the time series](figures/oscillator_ranks_ecdf.png)
#
# More on large problems (many parameters, memory, the cost of each check):
# [many parameters, images, time series](../scale.md).
