"""Latent checks on sbi's default NPE with x far from standardized (issue 22).

An sbi ``"maf"`` NPE (nflows ``NFlowsFlow``) trained on a 2-D Gaussian linear task,
x = 10 theta + 5 + 2 noise (5,000 simulations). Over fresh calibration sets, the rejection
rate at 0.05 and 0.01 of ``LatentCalibration`` and ``LC2STNF`` (3 fixed observations), both
at their defaults, with the adapter's latents (x through sbi's embedding net) and with the
latents of sbi 0.27's ``NFlowsFlow.inverse_transform`` (raw x: the former adapter), and the
KL divergence of the trained NPE from the exact posterior (what the level depends on).

Run: ``python examples/benchmarks/sbi_latent_level.py`` (``--smoke`` for a quick check).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.distributions import MultivariateNormal

import calib_lightning as cl
from calib_lightning.posteriors import SbiPosterior

D = 2
RESULTS = Path(__file__).parent / "results" / "sbi_latent_level.md"


def simulate(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    theta = torch.randn(n, D, generator=g)
    return theta, 10 * theta + 5 + 2 * torch.randn(n, D, generator=g)


def train(seed: int, num_simulations: int) -> tuple[object, int, float]:
    from sbi.inference import NPE

    prior = MultivariateNormal(torch.zeros(D), torch.eye(D))
    theta, x = simulate(num_simulations, seed)
    torch.manual_seed(seed)
    inference = NPE(prior=prior, density_estimator="maf", show_progress_bars=False)
    start = time.perf_counter()
    cwd = os.getcwd()
    with tempfile.TemporaryDirectory() as folder:  # sbi writes ./sbi-logs
        os.chdir(folder)
        try:
            estimator = inference.append_simulations(theta, x).train(
                training_batch_size=500, learning_rate=1e-3, stop_after_epochs=30
            )
        finally:
            os.chdir(cwd)
    return estimator, inference.summary["epochs_trained"][-1], time.perf_counter() - start


def kl_from_exact(estimator: object, n: int = 20_000) -> float:
    """Monte Carlo KL(p || q) over the joint, in nats: E[log p(theta | x) - log q(theta | x)]."""
    theta, x = simulate(n, seed=10**6)
    with torch.no_grad():
        log_q = cl.as_posterior(estimator, kind="posterior").log_prob(theta, x)
    mean, var = 10 * (x - 5) / 104, 1 / 26  # exact posterior N(10 (x - 5) / 104, I / 26)
    log_p = (-0.5 * (theta - mean) ** 2 / var - 0.5 * math.log(2 * math.pi * var)).sum(1)
    return float((log_p - log_q).mean())


class RawInverse(SbiPosterior):
    """The former adapter: sbi 0.27's ``NFlowsFlow.inverse_transform`` (skips the embedding)."""

    def to_latent(self, theta: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.module.inverse_transform(theta, x)


def exact_posterior(x: torch.Tensor) -> MultivariateNormal:
    """The task's exact posterior N(10 (x - 5) / 104, I / 26): the level's reference."""
    return MultivariateNormal(10 * (x - 5) / 104, torch.eye(D) / 26)


def global_p_values(post: cl.Posterior, theta: torch.Tensor, x: torch.Tensor, x_o: torch.Tensor):
    latent = cl.LatentCalibration()
    latent.update(post, theta, x)
    lc2st = cl.LC2STNF(observations=x_o)
    lc2st.update(post, theta, x)
    return float(latent.compute().global_p_value), float(lc2st.compute().global_p_value)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--train-seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--sizes", type=int, nargs="+", default=[500, 1000, 2000])
    parser.add_argument("--datasets", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)
    num_simulations = 5000
    if args.smoke:
        args.train_seeds, args.sizes, args.datasets, num_simulations = [0], [300], 2, 1000
    _, x_o = simulate(3, seed=999)
    lines = [
        "# Latent checks on sbi's default NPE, x = 10 theta + 5 + 2 noise",
        "",
        f"`python {' '.join(['examples/benchmarks/sbi_latent_level.py', *sys.argv[1:]])}`; "
        f'sbi `"maf"` NPE, {num_simulations} simulations, batch 500, lr 1e-3, '
        "stop_after_epochs 30; one torch thread. Each row: "
        f"{args.datasets} fresh calibration sets of N pairs; `LatentCalibration()` and "
        "`LC2STNF(observations=x_o)` (3 fixed observations) at their defaults; "
        "rejection rate of `global_p_value` at 0.05 / 0.01, and its median. "
        "`adapter`: the fixed `to_latent` (x through the embedding net); `raw inverse`: "
        "sbi 0.27's `NFlowsFlow.inverse_transform` (the former adapter). KL: Monte Carlo "
        "KL(exact posterior || NPE) over the joint, nats (20,000 pairs). First rows: the exact "
        "posterior (a `MultivariateNormal` callable) on the calibration sets of training seed 0.",
        "",
        "| training seed | epochs | train s | KL | N | latents | LatentCalibration rej. "
        "0.05 / 0.01 | median p | LC2STNF rej. 0.05 / 0.01 | median p |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    runs = [(None, None, None, 0.0, {"exact posterior": cl.as_posterior(exact_posterior)})]
    for seed in args.train_seeds:
        estimator, epochs, seconds = train(seed, num_simulations)
        posts = {
            "adapter": cl.as_posterior(estimator, kind="posterior"),
            "raw inverse": RawInverse(estimator),
        }
        runs.append((seed, epochs, f"{seconds:.0f}", kl_from_exact(estimator), posts))
    for seed, epochs, seconds, kl, posts in runs:
        for size in args.sizes:
            p = {name: [] for name in posts}
            for r in range(args.datasets):
                theta, x = simulate(size, seed=10_000 + 100 * (seed or 0) + r)
                for name, post in posts.items():
                    p[name].append(global_p_values(post, theta, x, x_o))
            for name, values in p.items():
                cells = []
                for k in range(2):
                    column = torch.tensor([v[k] for v in values], dtype=torch.float64)
                    rates = [float((column <= a).double().mean()) for a in (0.05, 0.01)]
                    cells += [f"{rates[0]:.2f} / {rates[1]:.2f}", f"{float(column.median()):.3g}"]
                row = (
                    f"| {'-' if seed is None else seed} | {epochs or '-'} | {seconds or '-'} | "
                    f"{kl:.4f} | {size} | {name} | " + " | ".join(cells) + " |"
                )
                lines.append(row)
                print(row, flush=True)
    text = "\n".join(lines) + "\n"
    if args.smoke:
        print(text)
    else:
        RESULTS.write_text(text)


if __name__ == "__main__":
    main()
