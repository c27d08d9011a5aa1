# %% [markdown]
# # Flow matching and score estimators
#
# sbi 0.27's flow-matching (`FMPE`) and score-based (`NPSE`) estimators define the
# posterior through a probability-flow ODE. `cl.as_posterior` (and so every metric and
# `cl.diagnose`) evaluates that ODE with sbi's own network: sampling, the latent map
# (cheap), log-densities (an ODE with its trace: expensive) and scores. The checks take
# their cheap form on these estimators by default.
#
# The task is the conjugate Gaussian toy (`theta ~ N(0, I_2)`, `x = theta + N(0, 0.5^2
# I_2)`), whose exact posterior is known. The budgets are small so that the guide runs in
# about a minute on a laptop CPU (1,000 simulations, 20 epochs, 100 held-out pairs,
# 20 draws per pair): the estimators are only roughly trained.

# %%
import warnings
from pathlib import Path

import matplotlib.pyplot as plt
import torch
from sbi.inference import FMPE, NPSE
from torch.distributions import MultivariateNormal

import calib_lightning as cl
from calib_lightning.tasks import GaussianToy

torch.manual_seed(0)
task = GaussianToy(dim=2)
prior = MultivariateNormal(torch.zeros(2), torch.eye(2))
generator = torch.Generator().manual_seed(0)
theta, x = task.sample(1_000, generator)
theta_cal, x_cal = task.sample(100, generator)  # held out
theta_o, x_o = task.sample(1, generator)  # one observation to analyse
exact = task.posterior()(x_o).sample((500,))  # (500, 1, 2): the true posterior there

# %% [markdown]
# ## Train with sbi


# %%
def train(method: type) -> object:
    inference = method(prior=prior, show_progress_bars=False)
    with warnings.catch_warnings():  # sbi's notes on its defaults
        warnings.simplefilter("ignore")
        inference.append_simulations(theta, x).train(
            max_num_epochs=20, training_batch_size=100, show_train_summary=False
        )
        return inference.build_posterior()


fmpe = train(FMPE)
npse = train(NPSE)
print(type(fmpe).__name__, type(npse).__name__)

# %% [markdown]
# ## What the adapter provides, and what it costs
#
# `posterior.capabilities` lists what an adapter computes; `posterior.costly` those it
# computes at many times the cost of sampling. For FMPE the score is the gradient of
# the ODE's log-density (autograd through the solve); for NPSE it is the network's score
# at the smallest time, which is cheap.

# %%
for name, estimator in [("FMPE", fmpe), ("NPSE", npse)]:
    posterior = cl.as_posterior(estimator)
    print(f"{name}: {type(posterior).__name__}, capabilities {sorted(posterior.capabilities)}, "
          f"costly {sorted(posterior.costly)}")

# %% [markdown]
# ## The sampling-free checks: latents and scores
#
# The latent map is the cheap direction of the ODE (no trace), so
# `cl.LatentCalibration`, which tests the truths' latent points `z* = T_x^-1(theta*)` for
# a standard normal without drawing from the posterior, is the cheapest check here. On
# NPSE the score is the network's, so KCCSD is cheap as well (200 bootstrap draws here,
# 500 by default).

# %%
for name, estimator in [("FMPE", fmpe), ("NPSE", npse)]:
    latent = cl.LatentCalibration()
    latent.update(estimator, theta_cal, x_cal)
    result = latent.compute()
    print(
        f"{name} latent calibration: global p-value {result.global_p_value:.3g}, "
        f"latent std {[round(float(s), 2) for s in result.latent_std]} (1 if calibrated)"
    )

kccsd = cl.KCCSD(num_null=200)
kccsd.update(npse, theta_cal, x_cal)
print(f"NPSE KCCSD: p-value {kccsd.compute().p_value:.3g}")

# %% [markdown]
# ## One call
#
# `cl.diagnose` runs every check the estimator supports in its cheap form: the rank
# check ranks jointly by the distance rank (samples only, no ODE trace), L-C2ST-NF
# uses the latent map, and on FMPE KCCSD is left out by default (its score
# differentiates the ODE at every point), with the reason in the table; name `"kccsd"`
# in `checks=` to run it anyway. Here three of the checks on FMPE, with 20 draws per
# pair (100 by default):

# %%
report = cl.diagnose(
    fmpe, theta_cal, x_cal, checks=["ranks", "tarp", "recovery"],
    labels=["theta_1", "theta_2"], num_posterior_samples=20,
)
print(report.verdict)
print(report.table())

# %% [markdown]
# The numbers come from estimators trained for 20 epochs on 1,000 simulations: read
# them for what they show (which checks ran, in which form), not as a comparison of
# the two methods.
#
# ## Draws at the observation
#
# The adapters sample as sbi's posterior does (`sample_with="ode"` for FMPE, `"sde"` for
# NPSE by default), without sbi's rejection of draws outside the prior's support:

# %%
figures = Path("figures")
figures.mkdir(exist_ok=True)
fig, axes = plt.subplots(1, 2, figsize=(7, 3.4), sharex=True, sharey=True)
for ax, name, estimator in zip(axes, ["FMPE", "NPSE"], [fmpe, npse], strict=True):
    draws = cl.as_posterior(estimator).sample(x_o, 500)[:, 0]  # (500, 2)
    ax.scatter(exact[:, 0, 0], exact[:, 0, 1], s=4, alpha=0.4, color="black", label="exact")
    ax.scatter(draws[:, 0], draws[:, 1], s=4, alpha=0.4, color="tab:orange", label=name)
    ax.plot(*theta_o[0], "r*", markersize=10, label="true parameter")
    ax.set(title=name, xlabel="theta_1")
    ax.legend(fontsize=8, loc="lower right")
axes[0].set_ylabel("theta_2")
fig.tight_layout()
fig.savefig(figures / "draws_at_observation.png", dpi=100)
report.figures["ranks_ecdf"].savefig(figures / "fmpe_ranks_ecdf.png", dpi=90)

# %% [markdown]
# ![FMPE and NPSE draws beside exact draws](figures/draws_at_observation.png)
#
# **FMPE's rank ECDF**: the marginal ranks and the joint distance rank, inside the grey
# band when calibrated.
#
# ![rank ECDF of FMPE](figures/fmpe_ranks_ecdf.png)
#
# Details, costs and what each method computes: [sbi's flow-matching and score
# estimators][fmpe-npse].
#
# [fmpe-npse]: ../estimators.md#sbis-flow-matching-and-score-estimators-fmpe-npse
