"""How much of the joint classifier test is the data, and how much the seed?

Issue 49 asks the joint classifier test (``cl.JointC2ST``) to keep its decision over
seeds: a 5-95 % range of its p-value over seeds of at most one decade on its
over-confident and biased cases of ``seed_stability.py``. This script measures the
quantity every such goal depends on: the variance of one cross-fitted repetition's
statistic (two folds, the default classifier, one posterior draw per training pair),

* ``v_w``: over seeds on a fixed dataset (the folds, initializations and mini-batches:
  what another seed changes), and
* ``v_b``: over datasets, of the repetition's expectation given the data (what the
  data decides),

from ``--reps`` single repetitions (``joint_c2st(..., repeats=1, seed=s)``) per dataset:
on ``--datasets`` fresh exact-posterior datasets (the null: ``v_w``, ``v_b`` and the
folds' correlation ``rho = 2 Var(z) - 1``), and on the fixed over-confident and biased
datasets of ``seed_stability.py`` (``v_w`` and the mean statistic there).

An average of ``R`` repetitions has null variance ``v_b + v_w / R`` and seed variance
``v_w / R``. With the null variance known exactly (the best case: a real test has to
estimate it, by retraining on null datasets, which adds spread), the table gives, for
each ``R``, the z-score of each fixed dataset, the 5-95 % range of its p-value over seeds
in decades, and the classifiers trained. NPT Gaussian ``D = 3``, ``N = 1,000``,
``M = 100``, as ``seed_stability.py``.

    python examples/benchmarks/joint_c2st_variance.py [--smoke]

Writes examples/benchmarks/results/joint_c2st_variance.md.
"""

from __future__ import annotations

import argparse
import math
import platform
import subprocess
import sys
import time
from pathlib import Path

if not __package__:  # run as a file (python examples/x.py): make `examples` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
from scipy import stats

from calib_lightning.metrics.joint_c2st import joint_c2st
from calib_lightning.tasks import NPTGaussian
from examples._smoke import add_smoke_argument, output_folder
from examples.benchmarks.seed_stability import cases, dataset

RESULTS = Path(__file__).resolve().parent / "results"
AVERAGED = (1, 4, 16, 64, 256)


def repetitions(data: dict, reps: int, first_seed: int) -> list[float]:
    """``reps`` single cross-fitted repetitions' statistics (mean of the two folds' Z)."""
    return [
        float(joint_c2st(data["theta"], data["x"], data["samples"], seed=s, repeats=1).statistic)
        for s in range(first_seed, first_seed + reps)
    ]


def decades(z: float, seed_sd: float) -> float:
    """log10 of p(z - 1.645 sd) / p(z + 1.645 sd), two-sided normal p-values."""
    log_p = [
        math.log10(2) + stats.norm.logsf(abs(v)) / math.log(10)
        for v in (max(z - 1.645 * seed_sd, 0.0), z + 1.645 * seed_sd)
    ]
    return log_p[0] - log_p[1]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--datasets", type=int, default=60)
    parser.add_argument("--reps", type=int, default=16)
    parser.add_argument(
        "--groups",
        type=int,
        default=20,
        help="groups of --reps seeds per fixed dataset",
    )
    add_smoke_argument(parser)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    setup = argparse.Namespace(n=1000, draws=100, overconfident=0.85, shift=0.08, extra=0.08)
    if args.smoke:
        setup.n, setup.draws, args.datasets, args.reps, args.groups = 100, 20, 3, 2, 2
    task = NPTGaussian(dim=3)
    named = cases(task, setup)
    start = time.perf_counter()
    null = torch.tensor(
        [
            repetitions(dataset(task, *named["exact"], setup, 100_000 + d), args.reps, 0)
            for d in range(args.datasets)
        ],
        dtype=torch.float64,
    )
    per_rep = (time.perf_counter() - start) / null.numel()
    v_w = float(null.var(1).mean())
    v_b = float(null.mean(1).var()) - v_w / args.reps
    total = float(null.var())
    fixed = {}
    for name in ("over-confident", "biased"):
        data = dataset(task, *named[name], setup, 2026)
        z = torch.tensor(
            [repetitions(data, args.reps, 1000 + g * args.reps) for g in range(args.groups)],
            dtype=torch.float64,
        )
        fixed[name] = (float(z.mean()), float(z.var(1).mean()))
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    minutes = (time.perf_counter() - start) / 60
    lines = [
        "# The joint classifier test: the data's variance and the seed's",
        "",
        f"Written by `python examples/benchmarks/joint_c2st_variance.py"
        f"{' --smoke' if args.smoke else ''}` at commit {commit} "
        f"({platform.processor() or platform.machine()}, one thread, {minutes:.1f} min). "
        f"NPT Gaussian D = 3, N = {setup.n}, M = {setup.draws}; one repetition = two folds, "
        f"the default classifier, {per_rep:.2f} s.",
        "",
        f"Null (exact posterior, {args.datasets} fresh datasets x {args.reps} seeds): "
        f"v_w = {v_w:.3f} (seed), v_b = {v_b:.3f} (data), Var(z) = {total:.3f}, so the "
        f"two folds correlate by rho = {2 * total - 1:.2f}; {v_w / total:.0%} of a "
        "repetition's null variance is the seed's.",
        "",
        "Fixed datasets of `seed_stability.py` (data seed 2026; "
        f"{args.groups} x {args.reps} seeds): "
        + "; ".join(f"{name}: mean z {m:.2f}, v_w {w:.3f}" for name, (m, w) in fixed.items())
        + ".",
        "",
        "With R repetitions averaged and the null variance v_b + v_w / R known exactly "
        "(a lower bound on any real test's spread):",
        "",
        "| R | classifiers | seconds | null sd | case | z-score | seed sd of the z-score "
        "| p at the mean | p 5-95 % range over seeds, decades |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for reps in AVERAGED:
        null_sd = math.sqrt(max(v_b, 0.0) + v_w / reps)
        for name, (mean, within) in fixed.items():
            score, spread = mean / null_sd, math.sqrt(within / reps) / null_sd
            p = 2 * stats.norm.sf(abs(score))
            lines.append(
                f"| {reps} | {2 * reps} | {per_rep * reps:.1f} | {null_sd:.3f} | {name} | "
                f"{score:.2f} | {spread:.2f} | {p:.2g} | {decades(score, spread):.2f} |"
            )
    lines += [
        "",
        "The range in decades grows with the z-score (d log10 p / dz is about z / 2.3), so "
        "a test that rejects strongly needs a seed sd far below what keeps a borderline "
        "decision: the goal of one decade on the biased case needs a seed sd of about "
        "0.7 / z-score. The seed sd of the z-score falls only as "
        "sqrt(v_w / (R v_b + v_w)), because the seed's share v_w is most of a repetition's "
        "null variance.",
    ]
    out = output_folder(RESULTS, args.smoke)
    (out / "joint_c2st_variance.md").write_text("\n".join(lines) + "\n")
    print("wrote", out / "joint_c2st_variance.md")


if __name__ == "__main__":
    main()
