"""L-C2ST-NF and L-C2ST: calib_lightning against sbi 0.27's LC2ST_NF and LC2ST, same run.

Toy (sbi's documentation scale): theta ~ N(0, I_2), x = theta + N(0, 0.5^2 I); the exact
posterior N(0.8 x, 0.2 I) (an affine "flow") and a variance-inflated x2 one; N_cal in
{1000, 5000} calibration pairs, 100 null trials, 5 reference observations; each library
at its own defaults (ours: the local tests' settings, ``LOCAL_TEST_SETTINGS`` and 2,000
evaluation points; sbi: 10,000 evaluation points). Then a zuko neural spline flow
trained briefly on Two Moons, with the oracle C2ST (exact reference samples) beside the local tests.

Timed, wall clock and CPU, with torch and BLAS held to one thread for both libraries:
* null training: ours ``LC2STNFNull.fit`` (one batched fit of the 100 classifiers), plus
  ``LC2STNFNull.statistics`` (their statistics at the 5 observations, cached); sbi
  ``train_under_null_hypothesis``;
* one L-C2ST-NF check (what a training callback pays per epoch): ours ``update`` (one
  inverse pass of the flow) + ``compute`` (one classifier, 5 observations, p-values);
  sbi: building ``LC2ST_NF`` (inverse passes) + ``train_on_observed_data`` + 5 ``p_value``;
* one L-C2ST check: ours ``update`` + ``compute`` (1 + 100 classifiers in one batched
  fit); sbi ``train_on_observed_data`` + ``train_under_null_hypothesis`` + 5 ``p_value``.

Rejection rates at 0.05 over repetitions (each: fresh true parameters and classifier
seeds; p-values of all 5 observations pooled). Ours is run twice: with sbi's protocol
(one calibration x and its null, reused by every repetition), and with a fresh
calibration set and null per repetition. sbi's p-value is its own, mean(T_null > T).

Run:  PYTHONPATH=. python examples/benchmarks/lc2st_vs_sbi.py        (about 30 minutes)
      PYTHONPATH=. python examples/benchmarks/lc2st_vs_sbi.py --quick  (a few minutes)
      python examples/benchmarks/lc2st_vs_sbi.py --smoke  (seconds; temporary folder)
Writes examples/benchmarks/results/lc2st_vs_sbi.md (and two PNGs). Needs sbi.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

if not __package__:  # run as a file (python examples/x.py): make `examples` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np
import sbi
import torch
import zuko
from sbi.diagnostics.lc2st import LC2ST as SbiLC2ST
from sbi.diagnostics.lc2st import LC2ST_NF as SbiLC2STNF
from threadpoolctl import threadpool_limits
from torch.distributions import MultivariateNormal

import calib_lightning as cl
from calib_lightning.baselines import oracle_c2st
from calib_lightning.classifiers import LOCAL_TEST_SETTINGS, MLPEnsemble, lc2st_nf_null
from calib_lightning.classifiers._make import NUM_EVALUATION_POINTS
from calib_lightning.plots import plot_pp, plot_probability_map
from calib_lightning.tasks import GaussianToy, TwoMoons
from examples._smoke import add_smoke_argument, output_folder

RESULTS = Path(__file__).parent / "results"
NUM_NULL, NUM_OBS, NUM_ORACLE = 100, 5, 5000
# each library at its default number of evaluation points per observation
NUM_EVAL, NUM_EVAL_SBI = NUM_EVALUATION_POINTS, 10_000
BASE = MultivariateNormal(torch.zeros(2), torch.eye(2))
warnings.filterwarnings("ignore")


def timed(fn: Callable[[], Any]) -> tuple[Any, float, float]:
    """Result, wall seconds and CPU seconds of ``fn()``."""
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - wall, time.process_time() - cpu


def time_ours_null(row: dict, x: torch.Tensor, x_o: torch.Tensor) -> cl.LC2STNF:
    """Time the null's batched fit alone, then the metric's null: fit and statistics."""
    g = torch.Generator().manual_seed(0)
    _, row["ours_fit_wall"], row["ours_fit_cpu"] = timed(
        lambda: lc2st_nf_null(x, 2, NUM_NULL, MLPEnsemble(NUM_NULL, **LOCAL_TEST_SETTINGS), g)
    )
    metric = cl.LC2STNF(x_o, num_null=NUM_NULL, num_posterior_samples=NUM_EVAL)
    _, row["ours_null_wall"], row["ours_null_cpu"] = timed(
        lambda: metric.null.fit(x, dim=2).statistics(metric.flat_observations, metric.pp_grid)
    )
    return metric


def warm_up() -> None:
    """First calls pay for lazy initialisation in torch and scikit-learn: not timed."""
    toy = GaussianToy(dim=2)
    theta, x = toy.sample(200, torch.Generator().manual_seed(0))
    metric = cl.LC2STNF(x[:2], num_null=4, num_posterior_samples=100)
    ours_nf_check(metric, toy.posterior(), theta, x)
    test = sbi_nf(theta, x, toy.posterior())
    test.num_trials_null = 2
    test.train_under_null_hypothesis(verbosity=0)


def rate(p_values: list[Any]) -> float:
    return float(np.mean([float(p) <= 0.05 for p in p_values]))


# -- ours -------------------------------------------------------------------------------
def ours_nf_check(metric: cl.LC2STNF, posterior: Any, theta: torch.Tensor, x: torch.Tensor):
    metric.reset()
    metric.update(posterior, theta, x)
    return metric.compute()


def ours_nf_fixed_x(x_o, x, exact, posterior, reps, seed=0):
    """sbi's protocol: one null for the calibration x, reused by every repetition."""
    base = cl.LC2STNF(x_o, num_null=NUM_NULL, num_posterior_samples=NUM_EVAL, seed=seed)
    base.null.fit(x, dim=2)
    p_values = []
    for r in range(reps):
        metric = cl.LC2STNF(
            x_o, num_null=NUM_NULL, num_posterior_samples=NUM_EVAL, seed=seed + 1 + r
        )
        metric.load_state_dict(base.state_dict())  # the null travels, no retraining
        theta = cl.as_posterior(exact).sample(x, 1)[0]  # true parameters given x
        p_values += ours_nf_check(metric, posterior, theta, x).p_value.tolist()
    return p_values


def ours_nf_fresh(sample, x_o, posteriors, reps, seed=0):
    """A fresh calibration set (and so a fresh null) per repetition."""
    p_values: dict[str, list[float]] = {name: [] for name in posteriors}
    g = torch.Generator().manual_seed(seed)
    for r in range(reps):
        theta, x = sample(g)
        metric = cl.LC2STNF(x_o, num_null=NUM_NULL, num_posterior_samples=NUM_EVAL, seed=seed + r)
        for name, posterior in posteriors.items():
            p_values[name] += ours_nf_check(metric, posterior, theta, x).p_value.tolist()
    return p_values


def ours_permutation(sample, x_o, posterior, reps, seed=0):
    p_values, times = [], []
    g = torch.Generator().manual_seed(seed)
    for r in range(reps):
        theta, x = sample(g)
        torch.manual_seed(seed + r)
        metric = cl.LC2ST(x_o, num_null=NUM_NULL, num_posterior_samples=NUM_EVAL, seed=seed + r)

        def check(metric=metric, theta=theta, x=x):
            metric.update(posterior, theta, x)
            return metric.compute()

        out, wall, cpu = timed(check)
        p_values += out.p_value.tolist()
        times.append((wall, cpu))
    return p_values, times


# -- sbi --------------------------------------------------------------------------------
def sbi_nf(theta, x, posterior, null=None, seed=1):
    post = cl.as_posterior(posterior)
    with torch.no_grad():
        drawn = post.sample(x, 1)[0]
    return SbiLC2STNF(
        prior_samples=theta, xs=x, posterior_samples=drawn,
        flow_inverse_transform=lambda t, c: post.to_latent(t, c).detach(),
        flow_base_dist=BASE, num_eval=NUM_EVAL_SBI, num_trials_null=NUM_NULL,
        trained_clfs_null=null, seed=seed,
    )  # fmt: skip


def sbi_nf_check(theta, x, x_o, posterior, null, seed):
    np.random.seed(seed)  # noqa: NPY002 - sbi's classifiers draw from numpy's global state
    test = sbi_nf(theta, x, posterior, null, seed)
    test.train_on_observed_data(verbosity=0)
    return [test.p_value(x_o[i]) for i in range(len(x_o))]


def sbi_nf_fixed_x(theta, x, x_o, exact, posterior, null, reps):
    p_values = []
    for r in range(reps):
        theta_r = cl.as_posterior(exact).sample(x, 1)[0] if r else theta
        p_values += sbi_nf_check(theta_r, x, x_o, posterior, null, seed=100 + r)
    return p_values


def sbi_permutation_check(theta, x, x_o, posterior, seed):
    np.random.seed(seed)  # noqa: NPY002 - sbi's classifiers draw from numpy's global state
    torch.manual_seed(seed)
    post = cl.as_posterior(posterior)
    with torch.no_grad():
        drawn = post.sample(x, 1)[0]
        eval_theta = post.sample(x_o, NUM_EVAL_SBI)
    test = SbiLC2ST(theta, x, drawn, num_trials_null=NUM_NULL, seed=seed)
    test.train_on_observed_data(verbosity=0)
    test.train_under_null_hypothesis(verbosity=0)
    return [test.p_value(eval_theta[:, i], x_o[i]) for i in range(len(x_o))]


# -- the two settings ---------------------------------------------------------------------
def toy_section(n: int, reps: int, sbi_reps: int, sbi_perm_reps: int, lines: list[str]) -> dict:
    toy = GaussianToy(dim=2)
    exact, inflated = toy.posterior(), toy.posterior(variance_scale=2.0)
    g = torch.Generator().manual_seed(n)
    _, x_o = toy.sample(NUM_OBS, g)
    theta, x = toy.sample(n, g)
    out: dict[str, Any] = {"n": n}

    # timings: null training and one check
    ours = time_ours_null(out, x, x_o)
    _, out["ours_check_wall"], out["ours_check_cpu"] = timed(
        lambda: ours_nf_check(ours, inflated, theta, x)
    )
    null_test = sbi_nf(theta, x, exact)
    _, out["sbi_null_wall"], out["sbi_null_cpu"] = timed(
        lambda: null_test.train_under_null_hypothesis(verbosity=0)
    )
    null = null_test.trained_clfs_null
    _, out["sbi_check_wall"], out["sbi_check_cpu"] = timed(
        lambda: sbi_nf_check(theta, x, x_o, inflated, null, seed=0)
    )

    # rejection rates
    sample = lambda gen: toy.sample(n, gen)  # noqa: E731
    for name, post in (("exact", exact), ("var x2", inflated)):
        out[f"ours_fixed {name}"] = rate(ours_nf_fixed_x(x_o, x, exact, post, reps))
        out[f"sbi_fixed {name}"] = rate(sbi_nf_fixed_x(theta, x, x_o, exact, post, null, sbi_reps))
    fresh = ours_nf_fresh(sample, x_o, {"exact": exact, "var x2": inflated}, reps)
    for name, p_values in fresh.items():
        out[f"ours_fresh {name}"] = rate(p_values)

    perm_times, sbi_perm_times = [], []
    for name, post in (("exact", exact), ("var x2", inflated)):
        p_values, times = ours_permutation(sample, x_o, post, reps, seed=1)
        out[f"ours_perm {name}"] = rate(p_values)
        perm_times += times
        sbi_p = []
        for r in range(sbi_perm_reps):
            theta_r, x_r = toy.sample(n, torch.Generator().manual_seed(10_000 + r))
            p, wall, cpu = timed(lambda: sbi_permutation_check(theta_r, x_r, x_o, post, r))  # noqa: B023
            sbi_p += p
            sbi_perm_times.append((wall, cpu))
        out[f"sbi_perm {name}"] = rate(sbi_p)
    out["ours_perm_wall"] = statistics.median(t[0] for t in perm_times)
    out["ours_perm_cpu"] = statistics.median(t[1] for t in perm_times)
    out["sbi_perm_wall"] = statistics.median(t[0] for t in sbi_perm_times)
    out["sbi_perm_cpu"] = statistics.median(t[1] for t in sbi_perm_times)
    return out


def train_two_moons_nsf(num_simulations: int, epochs: int, seed: int = 0) -> torch.nn.Module:
    task = TwoMoons()
    theta, x = task.sample(num_simulations, torch.Generator().manual_seed(seed))
    torch.manual_seed(seed)
    flow = zuko.flows.NSF(2, 2, transforms=3, hidden_features=(64, 64))
    optimizer = torch.optim.Adam(flow.parameters(), lr=1e-3)
    for _ in range(epochs):
        for idx in torch.randperm(num_simulations).split(256):
            loss = -flow(x[idx]).log_prob(theta[idx]).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return flow.eval()


def two_moons_section(flow, ns, reps: int, sbi_reps: int, folder: Path) -> list[dict]:
    """Both libraries with sbi's protocol: one calibration x per N_cal and its null; each
    repetition draws new true parameters from the exact posterior given that x."""
    task = TwoMoons()
    g = torch.Generator().manual_seed(3)
    _, x_o = task.sample(NUM_OBS, g)
    post = cl.as_posterior(flow)
    with torch.no_grad():
        estimator = post.sample(x_o, NUM_ORACLE).transpose(0, 1)
    reference = task.reference_posterior_samples(x_o, NUM_ORACLE, g).transpose(0, 1)
    oracle = oracle_c2st(estimator, reference)
    rows = []
    for n in ns:
        row: dict[str, Any] = {"n": n, "oracle_accuracy": oracle.accuracy.tolist()}
        _, x = task.sample(n, torch.Generator().manual_seed(n))
        thetas = [
            task.reference_posterior_samples(x, 1, torch.Generator().manual_seed(r))[0]
            for r in range(max(reps, sbi_reps))
        ]
        base = time_ours_null(row, x, x_o)
        ours_p, check_times = [], []
        for r in range(reps):
            metric = cl.LC2STNF(x_o, num_null=NUM_NULL, num_posterior_samples=NUM_EVAL, seed=1 + r)
            metric.load_state_dict(base.state_dict())
            result, wall, cpu = timed(
                lambda m=metric, t=thetas[r], c=x: ours_nf_check(m, flow, t, c)
            )
            check_times.append((wall, cpu))
            ours_p.append(result.p_value)
            if r == 0 and n == ns[-1]:
                save_figures(metric, result, flow, x_o, folder)
        row["ours_rate"] = torch.stack(ours_p).le(0.05).double().mean(0).tolist()
        row["ours_check_wall"] = statistics.median(t[0] for t in check_times)
        row["ours_check_cpu"] = statistics.median(t[1] for t in check_times)
        null_test = sbi_nf(thetas[0], x, flow)
        _, row["sbi_null_wall"], row["sbi_null_cpu"] = timed(
            lambda t=null_test: t.train_under_null_hypothesis(verbosity=0)
        )
        sbi_p = [
            sbi_nf_check(thetas[r], x, x_o, flow, null_test.trained_clfs_null, seed=200 + r)
            for r in range(sbi_reps)
        ]
        row["sbi_rate"] = np.mean(np.array(sbi_p) <= 0.05, axis=0).tolist()
        rows.append(row)
        print(row, flush=True)
    return rows


def save_figures(metric, result, flow, x_o, folder: Path) -> None:
    plot_pp(result).savefig(folder / "lc2st_two_moons_pp.png", dpi=90)
    torch.manual_seed(0)
    drawn = metric.probability_map(flow, 2 * NUM_EVAL)  # 4,000 draws in the full run
    where = [round(v, 2) for v in x_o[0].tolist()]
    fig = plot_probability_map(
        drawn.samples[0],
        drawn.probabilities[0],
        bins=40,
        pp=(result.pp_grid, result.pp_ecdf[0], result.pp_band[:, 0]),
        title=f"Two Moons NSF at x_o = {where}: p = {float(result.p_value[0]):.3f}\n"
        "red: the flow puts too much mass there, blue: too little",
    )
    fig.savefig(folder / "lc2st_two_moons_map.png", dpi=90)


# -- report -----------------------------------------------------------------------------
def commit() -> str:
    """The checkout's short commit, ``+`` when its tracked files differ from it."""
    def git(*argv: str) -> str:
        return subprocess.run(
            ["git", *argv], capture_output=True, text=True, cwd=Path(__file__).parent
        ).stdout.strip()

    head = git("rev-parse", "--short", "HEAD") or "unknown"
    return head + ("+" if git("status", "--porcelain", "--untracked-files=no") else "")


def report(toy_rows, moons_rows, args, total, total_cpu) -> str:
    def t(row, who, what):
        return f"{row[f'{who}_{what}_wall']:.2f} s ({row[f'{who}_{what}_cpu']:.2f} s CPU)"

    def speedup(row):
        cpu = row["sbi_null_cpu"] / row["ours_fit_cpu"]
        return f"{cpu:.0f}x, {row['sbi_null_wall'] / row['ours_fit_wall']:.0f}x"

    lines = [
        "# L-C2ST-NF and L-C2ST: calib_lightning vs sbi 0.27",
        "",
        f"Command: `PYTHONPATH=. python examples/benchmarks/lc2st_vs_sbi.py"
        f"{' --quick' if args.quick else ''}` ({total / 60:.0f} min wall, "
        f"{total_cpu / 60:.0f} min CPU), at commit {commit()} on "
        f"{time.strftime('%Y-%m-%d')}. "
        f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores shared "
        f"with other jobs (load average {os.getloadavg()[0]:.1f} at the end); torch "
        f"{torch.__version__}, sbi {sbi.__version__}; torch and BLAS held to one thread for "
        "both libraries. Wall "
        "times on a shared machine are noisy; CPU times (in brackets) are steadier. "
        f"{NUM_NULL} null trials, {NUM_OBS} reference observations; each library at its "
        f"defaults: ours {NUM_EVAL} evaluation points per observation, batched MLP "
        f"classifiers with the local tests' settings ({LOCAL_TEST_SETTINGS}: two layers of "
        f"min(10 x inputs, {LOCAL_TEST_SETTINGS['max_width']}), Adam, early stopping after "
        f"{LOCAL_TEST_SETTINGS['patience']} epochs without improvement); sbi {NUM_EVAL_SBI} "
        "evaluation points, scikit-learn MLPClassifier, two layers of 10 x dim(theta), early "
        "stopping with patience 50.",
        "",
        "## Toy: theta ~ N(0, I_2), x = theta + N(0, 0.25 I)",
        "",
        "Null classifiers: training them (ours: one batched fit; sbi: 100 scikit-learn fits), "
        "and ours' total with their statistics at the 5 observations, computed once and "
        "cached (sbi recomputes them inside every `p_value`, so they are in its check time).",
        "",
        "| N_cal | null fit: ours | sbi LC2ST_NF | speed-up (CPU, wall) | ours incl. null "
        "statistics | one L-C2ST-NF check: ours | sbi | one L-C2ST check: ours | sbi |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in toy_rows:
        lines.append(
            f"| {row['n']} | {t(row, 'ours', 'fit')} | {t(row, 'sbi', 'null')} | "
            f"{speedup(row)} | {t(row, 'ours', 'null')} | {t(row, 'ours', 'check')} | "
            f"{t(row, 'sbi', 'check')} | {t(row, 'ours', 'perm')} | {t(row, 'sbi', 'perm')} |"
        )
    lines += [
        "",
        "Rejection rate at 0.05 (p-values of the 5 observations pooled over repetitions):",
        "",
        "| N_cal | posterior | L-C2ST-NF ours, sbi protocol "
        f"({args.reps} reps) | ours, fresh calibration set per rep ({args.reps} reps) | "
        f"sbi LC2ST_NF ({args.sbi_reps} reps) | L-C2ST ours ({args.reps} reps) | sbi LC2ST "
        f"({args.sbi_perm_reps} reps) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in toy_rows:
        for name in ("exact", "var x2"):
            lines.append(
                f"| {row['n']} | {name} | {row[f'ours_fixed {name}']:.2f} | "
                f"{row[f'ours_fresh {name}']:.2f} | {row[f'sbi_fixed {name}']:.2f} | "
                f"{row[f'ours_perm {name}']:.2f} | {row[f'sbi_perm {name}']:.2f} |"
            )
    lines += [
        "",
        f"sbi's permutation L-C2ST retrains its {NUM_NULL} null classifiers at every check, so "
        f"it ran {args.sbi_perm_reps} repetitions per case (ours: {args.reps}); its rates are "
        "correspondingly coarse. The sbi-protocol columns reuse one null per N_cal: their "
        "repetitions share it, so their rates vary more than independent runs would.",
        "",
        f"## Two Moons: zuko NSF trained on {args.moons_simulations} simulations, "
        f"{args.moons_epochs} epochs",
        "",
        "Per reference observation: oracle C2ST accuracy (5,000 estimator vs 5,000 exact "
        "posterior samples, 5-fold; 0.5 = indistinguishable) and L-C2ST-NF rejection rates.",
        "",
        "| N_cal | null fit: ours | sbi | speed-up (CPU, wall) | one check: ours | "
        f"observation | oracle C2ST accuracy | rejection ours ({args.reps} reps) | "
        f"sbi ({args.sbi_reps} reps) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in moons_rows:
        for i in range(NUM_OBS):
            head = (
                f"| {row['n']} | {t(row, 'ours', 'fit')} | {t(row, 'sbi', 'null')} | "
                f"{speedup(row)} | {t(row, 'ours', 'check')} "
                if i == 0
                else "| | | | | "
            )
            lines.append(
                f"{head}| {i} | {row['oracle_accuracy'][i]:.3f} | {row['ours_rate'][i]:.2f} | "
                f"{row['sbi_rate'][i]:.2f} |"
            )
    toy_big = toy_rows[-1]
    lines += [
        "",
        "Figures (Two Moons, largest N_cal, first repetition): `lc2st_two_moons_pp.png` "
        "(PP-plots with the null band), `lc2st_two_moons_map.png` (classifier output on the "
        "posterior samples at the first observation).",
        "",
        "## Goals",
        "",
        "* Null training at least 30x faster than sbi (fit; in brackets with the cached null "
        "statistics): "
        + ", ".join(
            f"{name} N_cal = {r['n']}: {r['sbi_null_cpu'] / r['ours_fit_cpu']:.0f}x CPU, "
            f"{r['sbi_null_wall'] / r['ours_fit_wall']:.0f}x wall "
            f"({r['sbi_null_cpu'] / r['ours_null_cpu']:.0f}x CPU)"
            for name, rows in (("toy", toy_rows), ("Two Moons", moons_rows))
            for r in rows
        )
        + ".",
        f"* One L-C2ST-NF check under 1 s at N_cal = {toy_big['n']}: toy "
        f"{toy_big['ours_check_wall']:.2f} s wall ({toy_big['ours_check_cpu']:.2f} s CPU)"
        + (
            f", Two Moons NSF {moons_rows[-1]['ours_check_wall']:.2f} s wall "
            f"({moons_rows[-1]['ours_check_cpu']:.2f} s CPU, median)."
            if moons_rows
            else "."
        ),
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    global NUM_NULL, NUM_OBS, NUM_EVAL, NUM_EVAL_SBI, NUM_ORACLE
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a small run (a few minutes)")
    add_smoke_argument(parser)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--sbi-reps", type=int, default=20)
    parser.add_argument("--sbi-perm-reps", type=int, default=2)
    parser.add_argument("--moons-simulations", type=int, default=10_000)
    parser.add_argument("--moons-epochs", type=int, default=100)
    args = parser.parse_args(argv)
    ns, moons_ns = [1000, 5000], [1000, 5000]
    if args.quick:
        ns, moons_ns = [1000], [1000]
        args.reps, args.sbi_reps, args.sbi_perm_reps = 2, 2, 1
        args.moons_simulations, args.moons_epochs = 2000, 3
    if args.smoke:
        ns, moons_ns = [100], [100]
        args.reps, args.sbi_reps, args.sbi_perm_reps = 1, 1, 1
        args.moons_simulations, args.moons_epochs = 256, 1
        NUM_NULL, NUM_OBS, NUM_EVAL, NUM_EVAL_SBI, NUM_ORACLE = 4, 2, 200, 200, 200
    results = output_folder(RESULTS, args.smoke)
    torch.set_num_threads(1)
    start, start_cpu = time.perf_counter(), time.process_time()
    with threadpool_limits(1):
        warm_up()
        toy_rows = []
        for n in ns:
            toy_rows.append(toy_section(n, args.reps, args.sbi_reps, args.sbi_perm_reps, []))
            print(toy_rows[-1], flush=True)
        flow = train_two_moons_nsf(args.moons_simulations, args.moons_epochs)
        moons_rows = two_moons_section(flow, moons_ns, args.reps, args.sbi_reps, results)
        print(moons_rows, flush=True)
    text = report(
        toy_rows, moons_rows, args, time.perf_counter() - start,
        time.process_time() - start_cpu,
    )
    (results / "lc2st_vs_sbi.md").write_text(text)
    print(text)
    print("wrote", results / "lc2st_vs_sbi.md")


if __name__ == "__main__":
    main()
