# %% [markdown]
# # Check a BayesFlow model
#
# BayesFlow 2 trains amortized estimators with Keras; on Keras' torch backend its
# inference networks are torch modules with a log-density, an inverse and gradients, so
# `cl.as_posterior(approximator)` takes a `ContinuousApproximator` as it takes an sbi or
# zuko flow, and every check runs on it: ranks, TARP, KCCSD, the latent checks and
# L-C2ST-NF at the observations you will analyse. This guide trains a small coupling flow
# with BayesFlow's `fit`, checks it while it trains with the package's Keras callback
# (TensorBoard scalars and figures under the Lightning callbacks' tags), and diagnoses it
# after training with `cl.diagnose`.
#
# It needs the extra `calib_lightning[bayesflow]` (bayesflow and Keras 3) and
# `KERAS_BACKEND=torch` set before bayesflow or keras is imported. The task is the
# conjugate Gaussian toy (`theta ~ N(0, I_2)`, `x = theta + N(0, 0.5^2 I_2)`); 2,000
# simulations and 10 epochs, so that the guide runs in about a minute on a laptop CPU.

# %%
import os

os.environ.setdefault("KERAS_BACKEND", "torch")  # before bayesflow and keras

from pathlib import Path

import torch

grad = torch.is_grad_enabled()
import bayesflow as bf  # noqa: E402
import keras  # noqa: E402

torch.set_grad_enabled(grad)  # bayesflow turns torch's autograd off when it is imported

import calib_lightning as cl  # noqa: E402
from calib_lightning.callbacks import RankCalibrationCallback, TARPCallback  # noqa: E402
from calib_lightning.keras import KerasCalibrationCallback  # noqa: E402
from calib_lightning.tasks import GaussianToy  # noqa: E402

task = GaussianToy(dim=2)
generator = torch.Generator().manual_seed(0)
theta_train, x_train = task.sample(2000, generator)
theta_cal, x_cal = task.sample(300, generator)  # held out: never trained on
x_o = task.sample(2, generator)[1]  # two observations to analyse
print("keras backend:", keras.backend.backend())

# %% [markdown]
# ## Train, and check while it trains
#
# The approximator's `Adapter` says what the parameters and the observations are: here
# `theta` is concatenated into `inference_variables` and `x` into
# `inference_conditions`. `cl.as_posterior` reads these names from it, so the checks take
# `theta (N, 2)` and `x (N, 2)` tensors as for any other estimator.
#
# `KerasCalibrationCallback` takes the package's Lightning calibration callbacks as the
# description of each check (metric, held-out pairs, tags, figures) and runs them at the
# end of every `every_n_epochs`-th epoch (and of the first and the last); it writes the
# scalars and figures to TensorBoard under the same tags as in Lightning
# (`calibration/ranks/global_p_value`, `calibration/ranks/ecdf`, ...) and puts the
# scalars in Keras' `logs`, so `approximator.fit`'s history has them too.

# %%
keras.utils.set_random_seed(0)
adapter = bf.ContinuousApproximator.build_adapter(
    inference_variables=["theta"], inference_conditions=["x"]
)
approximator = bf.ContinuousApproximator(
    inference_network=bf.networks.CouplingFlow(depth=4, subnet_kwargs={"widths": (64, 64)}),
    adapter=adapter,
)
approximator.compile(optimizer=keras.optimizers.Adam(1e-3))
data = {"theta": theta_train.numpy(), "x": x_train.numpy()}
dataset = bf.datasets.OfflineDataset(data, batch_size=128, adapter=adapter)
ranks = RankCalibrationCallback(
    theta_cal, x_cal, metric=cl.RankCalibration(num_posterior_samples=50)
)
tarp = TARPCallback(theta_cal, x_cal, metric=cl.TARP(num_posterior_samples=50))
checks = KerasCalibrationCallback([ranks, tarp], log_dir="tensorboard", every_n_epochs=5)
history = approximator.fit(dataset=dataset, epochs=10, verbose=0, callbacks=[checks])
print("checked after epochs:", ranks.epochs)
for epoch, value in zip(ranks.epochs, ranks.history["global_p_value"], strict=True):
    print(f"epoch {epoch}: ranks global p-value {value:.3g}")
print("in Keras' history:", "calibration/ranks/global_p_value" in history.history)

# %% [markdown]
# `tensorboard --logdir tensorboard` shows them; the same event files read back with
# TensorBoard's `EventAccumulator` (as `tests/test_keras.py` does):

# %%
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

events = EventAccumulator("tensorboard", size_guidance={"images": 0})
events.Reload()
print("scalars:", [t for t in events.Tags()["scalars"] if "p_value" in t][:4])
print("figures:", events.Tags()["images"][:4])

# %% [markdown]
# ## What the adapter gives
#
# A coupling flow has an exact log-density, BayesFlow's own (`approximator.log_prob`) to
# float32's precision, an inverse (the latents, standard normal at the model's own
# draws) and a score by autograd:

# %%
post = cl.as_posterior(approximator)
print(post, "capabilities:", sorted(post.capabilities))
with torch.no_grad():
    ours = post.log_prob(theta_cal[:5], x_cal[:5])
theirs = approximator.log_prob({"theta": theta_cal[:5].numpy(), "x": x_cal[:5].numpy()})
print(
    "largest log_prob difference from BayesFlow's:",
    float((ours - torch.from_numpy(theirs)).abs().max()),
)
print("latents:", tuple(post.to_latent(theta_cal, x_cal).shape))

# %% [markdown]
# ## Diagnose after training
#
# `cl.diagnose` runs every check that applies, with L-C2ST-NF at the two observations,
# and saves its figures:

# %%
report = cl.diagnose(approximator, theta_cal, x_cal, observations=x_o, num_posterior_samples=50)
print(report.verdict)
print(report.table())
figures = Path("figures")
figures.mkdir(exist_ok=True)
print("figures:", sorted(report.figures))
for key in ("ranks_ecdf", "lc2st_probability_map_0"):
    report.figures[key].savefig(figures / f"bayesflow_{key}.png", dpi=100)

# %% [markdown]
# The ranks' ECDF against the uniform (inside the band: no miscalibration the ranks can
# see) and L-C2ST-NF's probability map at the first observation (the classifier's
# probability that a latent point is the flow's, near 0.5 everywhere when the flow is
# right there):
#
# ![rank ECDF](figures/bayesflow_ranks_ecdf.png)
#
# ![probability map](figures/bayesflow_lc2st_probability_map_0.png)
