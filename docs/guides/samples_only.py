# %% [markdown]
# # Posteriors known only by their samples
#
# An estimator that can only draw (ABC, MCMC chains, BayesFlow, a home-grown sampler)
# has no density, no score and no latent space. `cl.SamplePosterior(fn)` wraps it, with
# `fn(x, num_samples)` returning draws of shape `(S, N, D)` for observations `x` of shape
# `(N, *X)`; every check that needs only draws then runs on it, and the others are
# skipped with the reason.
#
# The sampler here is rejection ABC on the conjugate Gaussian toy (`theta ~ N(0, I_2)`,
# `x = theta + N(0, 0.5^2 I_2)`): the draws at `x` are the parameters of the simulations
# whose output lies nearest to `x`. With a tolerance that is too wide the ABC posterior
# is too wide; the diagnosis should say so. Sizes are small so that the guide runs in
# under a minute on a laptop CPU (20,000 simulations in the ABC pool, 300 held-out
# pairs, 50 draws per pair).

# %%
from collections.abc import Callable
from pathlib import Path

import torch

import calib_lightning as cl
from calib_lightning.tasks import GaussianToy

task = GaussianToy(dim=2)
generator = torch.Generator().manual_seed(0)
pool_theta, pool_x = task.sample(20_000, generator)  # the ABC reference table

# %% [markdown]
# ## The sampler
#
# `abc(keep)` returns a sampler that, at each observation, keeps the `keep` simulations
# nearest to it and draws `num_samples` of their parameters. Keeping 50 of 20,000 is a
# small tolerance; keeping 6,000 a wide one.


# %%
def abc(keep: int) -> Callable[[torch.Tensor, int], torch.Tensor]:
    def sample(x: torch.Tensor, num_samples: int) -> torch.Tensor:
        nearest = torch.cdist(x, pool_x).topk(keep, largest=False).indices  # (N, keep)
        pick = torch.randint(keep, (num_samples, len(x)), generator=generator)
        return pool_theta[nearest.gather(1, pick.T).T]  # (S, N, D)

    return sample


narrow = cl.SamplePosterior(abc(keep=50), num_dims=2)
wide = cl.SamplePosterior(abc(keep=6_000), num_dims=2)
print("capabilities:", sorted(narrow.capabilities))
theta_cal, x_cal = task.sample(300, generator)  # held out
x_o = task.sample(2, generator)[1]  # two observations to analyse
print("draws:", tuple(narrow.sample(x_cal, 50).shape))

# %% [markdown]
# Asking a samples-only posterior for a density raises a `ValueError` (its subclass
# `UnsupportedError`) that names what is missing and which checks need it:

# %%
try:
    narrow.log_prob(theta_cal, x_cal)
except ValueError as error:
    print(type(error).__name__, ":", str(error)[:200], "...")

# %% [markdown]
# ## Diagnose both
#
# `cl.diagnose` runs the rank check (its joint rank is the *distance rank*, which needs
# no density: the truth's standardized distance to the centre of the draws, ranked among
# the draws' own), TARP, the joint classifier test and the recovery plots, and lists
# KCCSD (it needs the score) and L-C2ST-NF (it needs latents) as skipped, with the
# reason. At the `observations`, L-C2ST, the local test from draws, runs in L-C2ST-NF's
# place.

# %%
reports = {}
for name, posterior in [("narrow", narrow), ("wide", wide)]:
    reports[name] = cl.diagnose(
        posterior, theta_cal, x_cal, observations=x_o, labels=["theta_1", "theta_2"],
        num_posterior_samples=50,
    )
    print(f"== ABC, {name} tolerance: {reports[name].verdict}")
    print(reports[name].table())
    print()
print("skipped:", reports["wide"].skipped)

# %% [markdown]
# The sign convention is the package's everywhere: a coverage error above 0 is
# under-confident (credible regions too wide, they cover the truth too often), below 0
# over-confident.

# %%
figures = Path("figures")
figures.mkdir(exist_ok=True)
reports["narrow"].figures["ranks_expected_coverage"].savefig(
    figures / "narrow_expected_coverage.png", dpi=100
)
reports["wide"].figures["ranks_expected_coverage"].savefig(
    figures / "wide_expected_coverage.png", dpi=100
)
reports["wide"].figures["ranks_rank_histograms"].savefig(
    figures / "wide_rank_histograms.png", dpi=100
)

# %% [markdown]
# **Expected coverage**, small tolerance, then wide tolerance: the wide one lies above
# the diagonal, its credible regions cover the truth more often than they claim.
#
# ![expected coverage, small tolerance](figures/narrow_expected_coverage.png)
# ![expected coverage, wide tolerance](figures/wide_expected_coverage.png)
#
# **Rank histograms** of the wide tolerance: the marginal ones lean ∩-shaped (the truths
# fall in the middle of the draws too often) and the joint distance rank piles up on
# the left (the truths lie closer to the centre of the draws than the draws do): the
# posterior is too wide.
#
# ![rank histograms, wide tolerance](figures/wide_rank_histograms.png)
#
# Which check runs on which estimator:
# [estimators and shapes](../estimators.md#samples-only-posteriors).
