# %% [markdown]
# # Diagnose an sbi posterior after training
#
# Train a posterior with sbi's `NPE` (sbi 0.27), then check it with one call,
# `cl.diagnose`: every check the posterior supports, one verdict sentence, a table, and
# an HTML report with every figure. The budget is small so that the guide runs in about
# a minute on a laptop CPU (2,000 simulations, at most 30 epochs, 300 held-out pairs,
# 50 posterior draws per pair): the posterior is only roughly trained, which gives the
# diagnosis something to find.

# %%
import json
import warnings
from pathlib import Path

import torch
from sbi.inference import NPE
from sbi.utils import BoxUniform

import calib_lightning as cl
from calib_lightning.tasks import TwoMoons

torch.manual_seed(0)

# %% [markdown]
# ## Train with sbi
#
# Two Moons has a box-uniform prior on `[-1, 1]^2`; sbi's `BoxUniform` is that prior.
# sbi trains on `(theta, x)` pairs and `build_posterior()` returns a `DirectPosterior`.

# %%
task = TwoMoons()
prior = BoxUniform(-torch.ones(2), torch.ones(2))
generator = torch.Generator().manual_seed(0)
theta, x = task.sample(2_000, generator)

inference = NPE(prior=prior, density_estimator="nsf", show_progress_bars=False)
with warnings.catch_warnings():  # sbi's notes on its defaults
    warnings.simplefilter("ignore")
    inference.append_simulations(theta, x).train(max_num_epochs=30, show_train_summary=False)
posterior = inference.build_posterior()
print(type(posterior).__name__, "trained for", inference.epoch, "epochs")

# %% [markdown]
# ## One call
#
# `cl.diagnose` takes the posterior as sbi returns it (or its density estimator), pairs
# `(theta, x)` it never trained on, and optionally the observations you will analyse
# (for the local tests at each) and the prior (for the support check: the true posterior
# has no mass outside the prior's box). The sampling checks share one set of
# `num_posterior_samples` draws per pair (100 by default).
#
# Here the third observation is deliberately impossible for the simulator: the
# misspecification test should flag it.

# %%
theta_cal, x_cal = task.sample(300, generator)  # held out
observations = torch.cat([task.sample(2, generator)[1], torch.tensor([[3.0, -3.0]])])

report = cl.diagnose(
    posterior, theta_cal, x_cal, observations=observations, prior=prior,
    labels=["theta_1", "theta_2"], num_posterior_samples=50,
)
print(report.verdict)

# %% [markdown]
# The verdict sentence only says what a test found: calibrated or not (the Bonferroni
# combination of the checks' verdicts), a direction only when a one-sided test of that
# direction rejects, and the observations where the posterior is wrong or that look
# outside the simulator (Holm-corrected). The table has each check's statistic, its
# p-value, its verdict and the size of what it found:

# %%
print(report.table())
print("overall p-value:", f"{report.overall_p_value:.3g}")
print("skipped:", report.skipped)

# %% [markdown]
# ## The report
#
# `report.save(folder)` writes `report.html` (self-contained, the images embedded: open
# it in a browser), `summary.json` (the verdict, the table and the findings, for
# scripts) and every figure as `figures/<name>.png`:

# %%
page = report.save("report")
print(page.name, sorted(path.name for path in page.parent.iterdir()))
summary = json.loads((page.parent / "summary.json").read_text())
print("summary.json keys:", sorted(summary))
print("figures:", sorted(report.figures))

# %% [markdown]
# `report.figures` holds the same figures as matplotlib figures; a few of them:

# %%
figures = Path("figures")
figures.mkdir(exist_ok=True)
for key in ["ranks_expected_coverage", "tarp_coverage", "lc2st_probability_map_0"]:
    report.figures[key].savefig(figures / f"{key}.png", dpi=100)

# %% [markdown]
# **Expected coverage of the credible regions** (rank check): on the diagonal when
# calibrated, below it over-confident.
#
# ![expected coverage](figures/ranks_expected_coverage.png)
#
# **TARP** coverage, with the band of its exact test:
#
# ![TARP coverage](figures/tarp_coverage.png)
#
# **L-C2ST-NF probability map** at the first observation: where the posterior puts too
# much (red) or too little (blue) mass.
#
# ![probability map](figures/lc2st_probability_map_0.png)
#
# When the diagnosis rejects, [fix the posterior](fix_a_posterior.md) with held-out
# pairs. How the verdict is built: [after training, `cl.diagnose`](../diagnose.md).
