# %% [markdown]
# # Train with calibration callbacks and read TensorBoard
#
# Train a neural posterior estimator (a zuko neural spline flow on Two Moons) with three
# calibration checks that run while it trains, then read what they logged: the scalars
# and figures in TensorBoard, the same scalars from the event files in Python, and the
# summary table. The sizes are small so that the guide runs in about a minute on a
# laptop CPU (4,000 simulations, 4 epochs, 300 held-out pairs): the flow is not trained
# to convergence, and the checks are expected to find it miscalibrated. For a real run,
# see `examples/npe_two_moons.py` (30,000 simulations, 30 epochs).

# %%
from pathlib import Path

import lightning as L
import matplotlib.pyplot as plt
import torch
import zuko
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch.utils.data import DataLoader, TensorDataset

import calib_lightning as cl
from calib_lightning.callbacks import (
    KCCSDCallback,
    LC2STNFCallback,
    RankCalibrationCallback,
    summary_table,
)
from calib_lightning.tasks import TwoMoons

L.seed_everything(0, verbose=False)

# %% [markdown]
# ## The estimator and the data
#
# The callbacks find the estimator at `pl_module.flow` (change it with `estimator=`):
# anything `cl.as_posterior` accepts, here a conditional zuko flow `x -> q(theta | x)`.
# Hold out pairs the estimator never trains on: only the callbacks see `theta_cal,
# x_cal`. `x_o` are the observations you will analyse; L-C2ST-NF tests the posterior at
# each of them.


# %%
class NPE(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.flow = zuko.flows.NSF(2, 2, transforms=3, hidden_features=(64, 64))

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        theta, x = batch
        loss = -self.flow(x).log_prob(theta).mean()
        self.log("train/nll", loss, on_epoch=True, on_step=False)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3)


task = TwoMoons()
generator = torch.Generator().manual_seed(0)
theta, x = task.sample(4_000, generator)
theta_cal, x_cal = task.sample(300, generator)  # held out: only the callbacks see them
theta_o, x_o = task.sample(2, generator)  # the observations you will analyse

# %% [markdown]
# ## The callbacks
#
# Each callback checks after the first epoch, every `every_n_epochs` epochs and after
# the last one, and logs under `calibration/<name>/`:
#
# - `KCCSDCallback`: the kernel calibration-conditional Stein discrepancy test, from the
#   flow's scores (`num_null` bootstrap draws; 500 by default, 200 here).
# - `RankCalibrationCallback`: simulation-based calibration, the ranks of each true
#   parameter among posterior draws (50 draws per pair here, 1,000 by default).
# - `LC2STNFCallback`: the local test at each observation `x_o`, with classifiers on the
#   flow's latent space (30 null classifiers here, 100 by default).

# %%
labels = ["theta_1", "theta_2"]
callbacks = [
    KCCSDCallback(theta_cal, x_cal, every_n_epochs=2, metric=cl.KCCSD(num_null=200)),
    RankCalibrationCallback(
        theta_cal, x_cal, every_n_epochs=2, labels=labels,
        metric=cl.RankCalibration(num_posterior_samples=50),
    ),
    LC2STNFCallback(
        theta_cal, x_cal, every_n_epochs=2, labels=labels, truths=theta_o,
        metric=cl.LC2STNF(observations=x_o, num_null=30, num_posterior_samples=500),
    ),
]
logger = TensorBoardLogger("lightning_logs", name="two_moons", version=0)
trainer = L.Trainer(
    max_epochs=4, logger=logger, callbacks=callbacks, enable_checkpointing=False,
    enable_progress_bar=False, enable_model_summary=False,
)
loader = DataLoader(TensorDataset(theta, x), batch_size=256, shuffle=True)
trainer.fit(NPE(), loader)
print(summary_table(trainer.callbacks))

# %% [markdown]
# `summary_table` gives the first and the last value of each check's scalars, and one
# verdict per check under H0 "the estimator is calibrated": a small p-value means
# miscalibrated. A bootstrap or permutation p-value cannot go below `1 / (B + 1)` for `B`
# null draws: 1/201 = 0.005 for KCCSD here, 1/31 = 0.032 for L-C2ST-NF, so the sizes
# of this guide show rejections at those floors. Each check has one verdict tag: `kccsd/p_value`,
# `ranks/global_p_value` and `lc2st_nf/global_p_value` (the tests a check runs,
# combined so that the verdict keeps its level).
#
# ## Where the logs are, and TensorBoard
#
# The `TensorBoardLogger` writes event files under `lightning_logs/two_moons/version_0/`.
# Open them with
#
# ```bash
# tensorboard --logdir lightning_logs
# ```
#
# - *Scalars*: the `calibration/...` curves, one point per check (`train/nll` too).
# - *Images*: each check's figures, `calibration/<name>/<figure>`; the step slider goes
#   through the checks.
# - *Histograms*: the raw ranks, `calibration/ranks/rank/<d>`.
#
# The same tags can be read in Python, with TensorBoard's event reader:

# %%
events = EventAccumulator(logger.log_dir, size_guidance={"images": 0, "scalars": 0})
events.Reload()
tags = events.Tags()
verdicts = [
    "calibration/kccsd/p_value",
    "calibration/ranks/global_p_value",
    "calibration/lc2st_nf/global_p_value",
]
print("scalar tags:", len(tags["scalars"]))
print("  e.g.", ", ".join(sorted(tags["scalars"])[:6]))
print("image tags:", ", ".join(sorted(tags["images"])))
for tag in verdicts:
    values = [f"{event.value:.3g}" for event in events.Scalars(tag)]
    print(f"{tag}: {values}")

# %% [markdown]
# TensorBoard keeps scalars in float32, where a p-value below about 1e-38 reads 0; every
# p-value also has a `log10_` tag (`calibration/ranks/log10_global_p_value`) that keeps
# it. The steps of the scalars are Lightning's global steps, one point per check. Here
# are the three verdicts against the epoch, from the event files:

# %%
figures = Path("figures")
figures.mkdir(exist_ok=True)
steps_per_epoch = len(loader)
fig, ax = plt.subplots(figsize=(6, 3.2))
for tag in verdicts:
    points = events.Scalars(
        tag.replace("/global_p_value", "/log10_global_p_value").replace(
            "kccsd/p_value", "kccsd/log10_p_value"
        )
    )
    epochs = [(point.step + 1) / steps_per_epoch - 1 for point in points]
    ax.plot(epochs, [10**point.value for point in points], "o-", label=tag.split("/", 1)[1])
ax.axhline(0.05, color="grey", linestyle="--", label="level 0.05")
ax.set(yscale="log", xlabel="epoch", ylabel="p-value (small: miscalibrated)")
ax.set_xticks(range(trainer.max_epochs))
ax.legend(fontsize=8)
fig.tight_layout()
fig.savefig(figures / "verdicts_from_tensorboard.png", dpi=110)

# %% [markdown]
# ![The verdicts against the epoch, from the event files](figures/verdicts_from_tensorboard.png)
#
# ## The figures
#
# Each callback draws its figures for TensorBoard's *Images* tab; `callback.figures(
# callback.last_result)` gives the figures of the last check, to save or show:

# %%
kccsd, ranks, lc2st = trainer.callbacks[:3]
for callback, key in [
    (kccsd, "history"),
    (ranks, "ecdf"),
    (ranks, "expected_coverage"),
    (lc2st, "probability_map/0"),
]:
    figure = callback.figures(callback.last_result)[key]
    figure.savefig(figures / f"{callback.tag_name}_{key.replace('/', '_')}.png", dpi=110)
print(sorted(ranks.figures(ranks.last_result)))

# %% [markdown]
# **History** (`calibration/kccsd/history`): the KCCSD p-value on a log axis (level
# dashed, rejections in red) and the statistic (dotted line at 0, calibrated) at each
# check.
#
# ![KCCSD history](figures/kccsd_history.png)
#
# **ECDF of the ranks** (`calibration/ranks/ecdf`): calibrated curves stay inside the
# grey simultaneous band. The joint curve below 0 means the truths are less probable
# than the posterior's own draws (over-confident), above 0 more probable (too wide).
#
# ![rank ECDF](figures/ranks_ecdf.png)
#
# **Expected coverage** (`calibration/ranks/expected_coverage`): on the diagonal when
# calibrated; below it the credible regions cover the truth less often than they claim.
#
# ![expected coverage](figures/ranks_expected_coverage.png)
#
# **Probability map** (`calibration/lc2st_nf/probability_map/0`) at the first
# observation: red where the flow puts too much mass, blue too little, white consistent,
# with the posterior's 50 % and 90 % regions and the true parameter (the star).
#
# ![L-C2ST-NF probability map](figures/lc2st_nf_probability_map_0.png)
#
# How to read every tag: [what each tag means](../callbacks.md#what-each-tag-means);
# every figure: [reading the figures](../getting-started.md#reading-the-figures).
