"""The L-C2ST paper's Jansen-Rit case study (section 4.2, Figures 3 and 4), with the public API.

The stochastic Jansen-Rit neural mass model (:class:`calib_lightning.tasks.JansenRit`:
``theta = (C, mu, sigma, g)``, the 33-feature log-PSD as ``x``) is simulated from its
prior; a zuko masked autoregressive flow with 10 layers (the paper's NPE) is trained on
``--simulations`` pairs by maximum likelihood (theta and x standardized, Adam, early
stopping on 10 % of them); then on held-out pairs:

* global: :func:`calib_lightning.diagnose` (marginal and joint rank calibration, KCCSD,
  TARP, the joint classifier test, recovery, the prior-support check, and the
  misspecification test of the observations);
* local: :class:`calib_lightning.LC2STNF` at the paper's 11 observations
  ``(C, mu, sigma) = (135, 220, 2000)``, ``g = -25, -20, ..., 25`` (the outer two outside
  the prior), its statistic, null quantile and p-value at each, the PP-plot and the
  probability map at ``g = 10``.

Simulations are cached under ``/tmp/jansen/`` (one file per set and seed). It writes
``examples/benchmarks/results/jansen_rit.md`` and its figures ``jansen_rit_*.png``.

Run (about 25 minutes on two shared cores)::

    python examples/benchmarks/jansen_rit.py [--simulations 20000] [--pairs 5000]
        [--null 440] [--eval-points 10000] [--train-minutes 10]

(``--smoke``: 64 simulations, one epoch, tiny tests, outputs in a temporary folder.)
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

if not __package__:  # run as a file (python examples/x.py): make `examples` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import torch
import zuko

import calib_lightning as cl
from calib_lightning.tasks import JansenRit
from examples._npe import StandardizedFlow
from examples._smoke import add_smoke_argument, output_folder

RESULTS = Path(__file__).resolve().parent / "results"
CACHE = Path("/tmp/jansen")
LABELS = ["C", "mu", "sigma", "g"]
GAINS = list(range(-25, 30, 5))
SHOWN_GAIN = 10


def simulated(
    task: JansenRit, name: str, theta: torch.Tensor, seed: int, cache: Path | None
) -> torch.Tensor:
    """``task.simulate(theta)`` with a seed, read from ``cache`` when it holds this set."""
    path = None if cache is None else cache / f"{name}_{theta.shape[0]}_seed{seed}.pt"
    if path is not None and path.is_file():
        stored = torch.load(path)
        if torch.equal(stored["theta"], theta):
            return stored["x"]
    x = task.simulate(theta, torch.Generator().manual_seed(seed))
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"theta": theta, "x": x}, path)
    return x


def train(
    theta: torch.Tensor, x: torch.Tensor, max_epochs: int, minutes: float, seed: int
) -> tuple[StandardizedFlow, int]:
    """A 10-layer MAF q(theta | x) fit by maximum likelihood; the epochs it ran."""
    torch.manual_seed(seed)
    valid = theta.shape[0] // 10
    flow = StandardizedFlow(
        zuko.flows.MAF(theta.shape[1], x.shape[1], transforms=10, hidden_features=(50, 50)),
        theta[valid:],
        x[valid:],
    )
    optimizer = torch.optim.Adam(flow.parameters(), lr=5e-4)
    best, best_state, patience, start, epochs = float("inf"), None, 0, time.perf_counter(), 0
    while epochs < max_epochs:
        epochs += 1
        flow.train()
        for batch in torch.randperm(theta.shape[0] - valid).split(200):
            i = batch + valid
            loss = -flow(x[i]).log_prob(theta[i]).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        flow.eval()
        with torch.no_grad():
            val = -flow(x[:valid]).log_prob(theta[:valid]).mean().item()
        if val < best:
            best, patience = val, 0
            best_state = {k: v.clone() for k, v in flow.state_dict().items()}
        else:
            patience += 1
        if patience >= 20 or time.perf_counter() - start > 60 * minutes:
            break
    if best_state is not None:
        flow.load_state_dict(best_state)
    flow.eval()
    return flow, epochs


class Laps:
    """Seconds of each step, in order: ``laps("name")`` ends the step begun at the last call."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._clock = time.perf_counter()

    def __call__(self, name: str) -> None:
        now = time.perf_counter()
        self.seconds[name] = now - self._clock
        self._clock = now
        print(f"{name}: {self.seconds[name]:.0f} s", flush=True)


def training_and_calibration(
    task: JansenRit, simulations: int, pairs: int, seed: int, cache: Path | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The training set (seed ``seed``) and the held-out calibration pairs (``seed + 1``)."""
    theta = task.sample_prior(simulations, torch.Generator().manual_seed(seed))
    x = simulated(task, "train", theta, seed, cache)
    theta_cal = task.sample_prior(pairs, torch.Generator().manual_seed(seed + 1))
    x_cal = simulated(task, "calibration", theta_cal, seed + 1, cache)
    return theta, x, theta_cal, x_cal


def machine(libraries: str = f"zuko {zuko.__version__}, ") -> str:
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
        cwd=Path(__file__).parent,
    ).stdout.strip()
    return (
        f"commit {commit or 'unknown'}, {platform.machine()}, {os.cpu_count()} cores shared "
        f"with other jobs (load average {os.getloadavg()[0]:.1f} at the end), torch "
        f"{torch.__version__}, {libraries}one thread, {time.strftime('%Y-%m-%d')}"
    )


def local_figure(result: cl.metrics.lc2st.LC2STResult, level: float) -> plt.Figure:
    """The paper's Figure 3 (right): the L-C2ST-NF statistic against g, the null's quantiles."""
    stat = result.statistic.numpy()
    null = result.null_statistics
    high = torch.quantile(null, 1 - level, dim=0).numpy()
    low = torch.quantile(null, level, dim=0).numpy()
    fig, ax = plt.subplots(figsize=(5.0, 3.2))
    ax.fill_between(
        GAINS, low, high, color="0.85", label=f"null, {level:.0%}-{1 - level:.0%} quantiles"
    )
    ax.plot(GAINS, stat, "o-", color="C0", label="L-C2ST-NF statistic")
    ax.axvspan(-27, -20, color="C3", alpha=0.08, label="outside the prior")
    ax.axvspan(20, 27, color="C3", alpha=0.08)
    ax.set_xlim(-27, 27)
    ax.set_xlabel("g (dB) of the observation, (C, mu, sigma) = (135, 220, 2000)")
    ax.set_ylabel("T(x_o)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--simulations", type=int, default=20_000)
    parser.add_argument("--pairs", type=int, default=5_000)
    parser.add_argument("--null", type=int, default=440)
    parser.add_argument("--eval-points", type=int, default=10_000)
    parser.add_argument("--draws", type=int, default=100, help="posterior draws per pair")
    parser.add_argument("--epochs", type=int, default=300)
    parser.add_argument("--train-minutes", type=float, default=10.0)
    parser.add_argument("--seed", type=int, default=0, help="seed of the simulations")
    parser.add_argument("--flow-seed", type=int, default=0, help="seed of the flow's training")
    parser.add_argument("--name", default="jansen_rit", help="prefix of the written files")
    add_smoke_argument(parser)
    args = parser.parse_args()
    if args.smoke:
        args.simulations, args.pairs, args.null, args.eval_points = 64, 64, 20, 100
        args.draws, args.epochs = 20, 1
    torch.set_num_threads(1)
    out = output_folder(RESULTS, args.smoke)
    cache = None if args.smoke else CACHE
    lap = Laps()
    task = JansenRit()
    prior = task.prior()
    theta, x, theta_cal, x_cal = training_and_calibration(
        task, args.simulations, args.pairs, args.seed, cache
    )
    lap(f"simulate {args.simulations} training and {args.pairs} held-out pairs")
    theta_o = torch.tensor([[135.0, 220.0, 2000.0, float(g)] for g in GAINS])
    x_o = simulated(task, "observations", theta_o, args.seed + 2, cache)
    lap(f"simulate {len(GAINS)} observations")

    flow, epochs = train(theta, x, args.epochs, args.train_minutes, args.flow_seed)
    lap(f"train the MAF ({epochs} epochs)")

    report = cl.diagnose(
        flow,
        theta_cal,
        x_cal,
        observations=x_o,
        labels=LABELS,
        prior=prior,
        seed=args.seed,
        num_posterior_samples=args.draws,
        checks=("kccsd", "ranks", "tarp", "joint_c2st", "recovery", "misspecification", "support"),
    )
    lap("cl.diagnose (global checks)")
    print(report.table())

    metric = cl.LC2STNF(
        observations=x_o, num_null=args.null, num_posterior_samples=args.eval_points, seed=args.seed
    )
    metric.update(flow, theta_cal, x_cal)
    local = metric.compute()
    lap(f"L-C2ST-NF at {len(GAINS)} observations ({args.null} null classifiers)")
    shown = GAINS.index(SHOWN_GAIN)
    maps = metric.probability_map(flow, num_posterior_samples=args.eval_points)
    lap("probability maps")

    figures = {
        "ranks": cl.plots.plot_rank_ecdf(report.checks["ranks"], labels=LABELS),
        "local": local_figure(local, report.level),
        "pp_g10": cl.plots.plot_pp(local, observations=[shown], names=[f"g = {SHOWN_GAIN}"]),
        "map_g10": cl.plots.plot_probability_map(
            maps.samples[shown],
            maps.probabilities[shown],
            labels=LABELS,
            truth=theta_o[shown],
            pp=(local.pp_grid, local.pp_ecdf[shown], local.pp_band[:, shown]),
            title=f"L-C2ST-NF probability map at g = {SHOWN_GAIN}",
        ),
    }
    for name, fig in figures.items():
        fig.savefig(out / f"{args.name}_{name}.png", dpi=110, bbox_inches="tight")
        print("wrote", out / f"{args.name}_{name}.png")
    write_results(out / f"{args.name}.md", args, report, local, lap.seconds, epochs)
    print("wrote", out / f"{args.name}.md")


def write_results(
    path: Path, args: argparse.Namespace, report, local, seconds: dict, epochs: int
) -> None:
    ranks = report.checks["ranks"]
    adjusted = cl.functional.combine.holm_adjust(local.p_value)
    null_q = torch.quantile(local.null_statistics, 1 - report.level, dim=0)
    lines = [
        "# The Jansen-Rit case study of the L-C2ST paper",
        "",
        f"{machine()}. Command: `python examples/benchmarks/jansen_rit.py"
        f" --simulations {args.simulations} --pairs {args.pairs} --null {args.null}"
        f" --eval-points {args.eval_points} --train-minutes {args.train_minutes:g}"
        f" --seed {args.seed} --flow-seed {args.flow_seed} --name {args.name}`.",
        "",
        f"NPE: zuko MAF, 10 layers of (50, 50) hidden units, trained on {args.simulations:,} "
        f"simulations ({epochs} epochs, batch 200, Adam 5e-4, best of 10 % validation). "
        f"Held-out: {args.pairs:,} pairs, {args.draws} posterior draws per pair; L-C2ST-NF "
        f"with {args.null} null classifiers and {args.eval_points:,} evaluation points. "
        "The paper: 50,000 training simulations, 10,000 calibration pairs, 10,000 "
        "evaluation points, 1,000 null trials.",
        "",
        "## Global checks (`cl.diagnose`)",
        "",
        "| check | statistic | p-value | verdict at 0.05 |",
        "| --- | --- | --- | --- |",
    ]
    for row in report.rows():
        p = row["global_p_value"] if row["global_p_value"] is not None else row["p_value"]
        stat = "" if row["statistic"] is None else f"{row['statistic']:.4g}"
        lines.append(
            f"| {row['check']} | {stat} | {'' if p is None else f'{p:.3g}'} | {row['verdict']} |"
        )
    marginal = ", ".join(
        f"{n} {float(p):.3g}" for n, p in zip(LABELS, ranks.marginal_p_values, strict=True)
    )
    ecdf = ", ".join(
        f"{n} {float(p):.3g}"
        for n, p in zip([*LABELS, "joint (HPD)"], ranks.ecdf_p_values, strict=True)
    )
    lines += [
        "",
        f"Rank calibration in detail: marginal chi-square p-values {marginal}; joint "
        f"(HPD) rank chi-square p-value {float(ranks.p_value):.3g}; ECDF-band p-values "
        f"{ecdf}.",
        "",
        "## Local checks (L-C2ST-NF) at (C, mu, sigma) = (135, 220, 2000)",
        "",
        f"| g (dB) | statistic | null {1 - report.level:.0%} quantile | p-value "
        "| Holm-adjusted | rejected at 0.05 (Holm) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for i, g in enumerate(GAINS):
        lines.append(
            f"| {g}{' (outside the prior)' if abs(g) > 20 else ''} "
            f"| {float(local.statistic[i]):.4g} "
            f"| {float(null_q[i]):.4g} | {float(local.p_value[i]):.3g} | {float(adjusted[i]):.3g} "
            f"| {'yes' if float(adjusted[i]) < report.level else 'no'} |"
        )
    lines += [
        "",
        f"Global p-value (Cauchy combination): {float(local.global_p_value):.3g}; smallest "
        f"attainable p-value 1 / (1 + {args.null}) = {local.smallest_p_value:.3g}.",
        "",
        "## Time of each step",
        "",
        "| step | seconds |",
        "| --- | --- |",
        *[f"| {name} | {s:.0f} |" for name, s in seconds.items()],
        "",
        f"Figures: `{args.name}_ranks.png` (rank ECDFs, marginal and joint), "
        f"`{args.name}_local.png` (statistic against g), `{args.name}_pp_g10.png`, "
        f"`{args.name}_map_g10.png`.",
    ]
    path.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
