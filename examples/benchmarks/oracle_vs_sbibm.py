"""Oracle C2ST against sbibm's ``c2st`` on identical samples (issue 23, Build item 2).

Cases: four sbibm tasks with reference posteriors (Two Moons, Gaussian Linear Uniform,
Gaussian Mixture, SLCP) x observations 1..10. For each, the 10,000 reference samples that
ship inside sbibm are split: the first ``n`` rows are the reference sample, rows
5,000..5,000 + n, perturbed, are the "estimator" sample. The perturbation cycles with the
observation over ten of varied strength: none, scaling about the mean by 1.05, 1.1, 1.25
and 1.5, shifts by 0.1, 0.25 and 0.5 standard deviations (every coordinate), and a share of
0.1 and 0.25 of the rows replaced by prior draws.

On each pair: sbibm's ``c2st(reference, estimator)`` at its default seed 1 (the standard),
sbibm's ``c2st`` again at seed 2 (how much sbibm disagrees with itself: the noise floor of
any comparison with one sbibm run), ``cl.baselines.oracle_c2st(estimator, reference)`` at
its defaults (sbibm's protocol written with scikit-learn's public API, seed 1) and with
``classifier="mlp", seed=0`` (the batched torch ensemble, the default before issue 23).
One process, torch and BLAS held to one thread.

Install sbibm (it pins old packages, hence ``--no-deps``)::

    pip install --no-deps sbibm==1.1.0
    pip install pandas pyro-ppl opt_einsum pyro-api future autograd

Run:  PYTHONPATH=. python examples/benchmarks/oracle_vs_sbibm.py   (about an hour, 2 cores)
      python examples/benchmarks/oracle_vs_sbibm.py --smoke         (seconds; temp folder)
Writes examples/benchmarks/results/oracle_vs_sbibm.md (rewritten after every case); the
committed table was run in parts, its cases kept in results/oracle_vs_sbibm.jsonl:
      PYTHONPATH=. python examples/benchmarks/oracle_vs_sbibm.py --resume \
          examples/benchmarks/results/oracle_vs_sbibm.jsonl   (rewrites the table only)
      add --rerun-ours to recompute the default oracle on resumed cases (issue 23's rerun:
      the earlier torch-ensemble reading is kept as ours_mlp)
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
from pathlib import Path

if not __package__:  # run as a file (python examples/x.py): make `examples` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
from threadpoolctl import threadpool_limits
from torch import Tensor

from calib_lightning.baselines import oracle_c2st
from examples._smoke import add_smoke_argument, has_sbibm, output_folder

TASKS = ("two_moons", "gaussian_linear_uniform", "gaussian_mixture", "slcp")
PERTURBATIONS = (
    ("none", 0.0), ("scale", 1.05), ("scale", 1.1), ("scale", 1.25), ("scale", 1.5),
    ("shift", 0.1), ("shift", 0.25), ("shift", 0.5), ("prior", 0.1), ("prior", 0.25),
)  # fmt: skip


def perturb(samples: Tensor, kind: str, strength: float, prior: Tensor) -> Tensor:
    """``samples (n, D)`` scaled about their mean, shifted, or partly replaced by ``prior``."""
    mean, std = samples.mean(0), samples.std(0)
    if kind == "scale":
        return mean + strength * (samples - mean)
    if kind == "shift":
        return samples + strength * std
    if kind == "prior":
        out = samples.clone()
        count = round(strength * len(samples))
        out[:count] = prior[:count]
        return out
    return samples


def timed(fn, *args, **kwargs) -> tuple[float, float]:
    start = time.perf_counter()
    value = float(torch.as_tensor(fn(*args, **kwargs)).reshape(-1)[0])
    return value, time.perf_counter() - start


def mlp_cells(group: list[dict]) -> str:
    """Mean and max |ours with classifier='mlp' - sbibm (seed 1)| as two cells."""
    diff = [abs(r["ours_mlp"] - r["sbibm"]) for r in group if "ours_mlp" in r]
    return f"{statistics.mean(diff):.4f} | {max(diff):.4f}" if diff else "- | -"


def table(rows: list[dict], n: int) -> str:
    lines = [
        "# Oracle C2ST vs sbibm's c2st on identical samples",
        "",
        f"`python examples/benchmarks/oracle_vs_sbibm.py` (run in parts joined by `--resume`); "
        f"{n} samples per side, 5 folds, one thread, {platform.machine()} (2 shared cores), "
        f"sbibm 1.1.0, torch {torch.__version__}. diff: ours (`oracle_c2st` at its defaults: "
        "sbibm's protocol written with scikit-learn, seed 1) - sbibm's `c2st` (seed 1); diff "
        "mlp: `oracle_c2st(..., classifier='mlp', seed=0)` (the batched torch ensemble, the "
        "default before issue 23) - sbibm's `c2st` (seed 1); floor: sbibm seed 2 - sbibm "
        "seed 1 on the same samples (on the cases given in parentheses): how far sbibm is "
        "from itself. Seconds: one call, wall clock on a shared machine; in the committed "
        "table, s ours comes from the issue-23 rerun (`--rerun-ours`, 2 cores at load 15-20, "
        "several processes) and s mlp and s sbibm from the earlier, less loaded run: compare "
        "them within a column only (ours runs sbibm's protocol, so it costs what sbibm costs).",
        "",
        "| task | cases | mean \\|diff\\| | max \\|diff\\| | mean diff | mean \\|floor\\| | "
        "max \\|floor\\| | mean \\|diff mlp\\| | max \\|diff mlp\\| | s ours | s mlp | "
        "s sbibm |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    groups = {task: [r for r in rows if r["task"] == task] for task in TASKS}
    groups["all"] = rows
    groups["all but two_moons"] = [r for r in rows if r["task"] != "two_moons"]
    for task, group in groups.items():
        if not group:
            continue
        diff = [r["ours"] - r["sbibm"] for r in group]
        floor = [r["sbibm_seed2"] - r["sbibm"] for r in group if r["sbibm_seed2"] is not None]
        floor_cells = (
            f"{statistics.mean(map(abs, floor)):.4f} ({len(floor)}) | {max(map(abs, floor)):.4f}"
            if floor
            else "- | -"
        )
        lines.append(
            f"| {task} | {len(group)} | {statistics.mean(map(abs, diff)):.4f} | "
            f"{max(map(abs, diff)):.4f} | {statistics.mean(diff):+.4f} | "
            f"{floor_cells} | {mlp_cells(group)} | "
            f"{statistics.mean(r['s_ours'] for r in group):.1f} | "
            f"{statistics.mean(r.get('s_ours_mlp', math.nan) for r in group):.1f} | "
            f"{statistics.mean(r['s_sbibm'] for r in group):.1f} |"
        )
    diff = [abs(r["ours"] - r["sbibm"]) for r in rows]
    floor = {r["task"]: 0.0 for r in rows}
    for r in rows:
        if r["sbibm_seed2"] is not None:
            floor[r["task"]] = max(floor[r["task"]], abs(r["sbibm_seed2"] - r["sbibm"]))
    worst = max(floor, key=floor.get)
    mean, top = statistics.mean(diff), max(diff)
    lines += [
        "",
        f"Goal (issue 23): mean \\|diff\\| <= 0.01 ({mean:.5f}: "
        f"{'met' if mean <= 0.01 else 'not met'}) and max <= 0.03 ({top:.5f}: "
        f"{'met' if top <= 0.03 else 'not met'}) over all {len(rows)} cases. sbibm's c2st "
        f"itself moves by up to {floor[worst]:.4f} ({worst}) when only its seed changes: "
        "differences of that size between two runs of one protocol are the classifier's "
        "training noise, not a difference of protocol. The default oracle runs sbibm's "
        "protocol itself, so at sbibm's seed it reads what sbibm reads.",
    ]
    lines += [
        "",
        "## Cases",
        "",
        "| task | observation | perturbation | sbibm (seed 1) | sbibm (seed 2) | ours | "
        "ours, mlp |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    lines += [
        f"| {r['task']} | {r['observation']} | {r['kind']} {r['strength']:g} | "
        f"{r['sbibm']:.4f} | "
        f"{'-' if r['sbibm_seed2'] is None else format(r['sbibm_seed2'], '.4f')} | "
        f"{r['ours']:.4f} | {r.get('ours_mlp', math.nan):.4f} |"
        for r in rows
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-samples", type=int, default=1500, help="samples per side")
    parser.add_argument("--tasks", nargs="*", default=list(TASKS), help="tasks to run")
    parser.add_argument(
        "--observations", nargs="*", type=int, default=list(range(1, 11)),
        help="observations to run (parts of a run in parallel processes, joined by --resume)",
    )  # fmt: skip
    parser.add_argument(
        "--floor-tasks", nargs="*", default=list(TASKS),
        help="tasks on which sbibm's c2st runs a second time (seed 2) for the noise floor",
    )  # fmt: skip
    parser.add_argument(
        "--rerun-ours", action="store_true",
        help="recompute ours on resumed cases (an earlier ours, if it has no ours_mlp yet, "
        "becomes ours_mlp: the batched torch ensemble, classifier='mlp')",
    )  # fmt: skip
    parser.add_argument(
        "--resume", type=Path,
        help="JSON lines of cases already run (printed by this script): skipped, or given "
        "their floor if their task is in --floor-tasks and they lack it",
    )  # fmt: skip
    add_smoke_argument(parser)
    args = parser.parse_args()
    if not has_sbibm():
        return
    import sbibm
    from sbibm.metrics import c2st
    n, observations = (300, (1, 10)) if args.smoke else (args.num_samples, args.observations)
    tasks = TASKS[:1] if args.smoke else args.tasks
    folder = output_folder(Path(__file__).parent / "results", args.smoke)
    torch.set_num_threads(1)
    rows: list[dict] = []
    if args.resume is not None:
        rows = [json.loads(line) for line in args.resume.read_text().splitlines() if line]
    done = {(r["task"], r["observation"]): r for r in rows}
    with threadpool_limits(1):
        for name in tasks:
            task = sbibm.get_task(name)
            prior = task.get_prior()
            for obs in observations:
                floor = name in args.floor_tasks
                row = done.get((name, obs))
                rerun = row is not None and args.rerun_ours and not row.get("rerun")
                if row is not None and not rerun and (row["sbibm_seed2"] is not None or not floor):
                    continue
                reference = task.get_reference_posterior_samples(num_observation=obs)
                torch.manual_seed(obs)
                kind, strength = PERTURBATIONS[(obs - 1) % len(PERTURBATIONS)]
                estimator = perturb(reference[5000 : 5000 + n], kind, strength, prior(n))
                reference = reference[:n]
                if row is None:  # a new case (else: a resumed case that lacks its floor)
                    row = {"task": name, "observation": obs, "kind": kind, "strength": strength}
                    row["sbibm"], row["s_sbibm"] = timed(c2st, reference, estimator)
                    row["ours"], row["s_ours"] = timed(
                        lambda e, r: oracle_c2st(e, r).accuracy, estimator, reference
                    )
                    row["ours_mlp"], row["s_ours_mlp"] = timed(
                        lambda e, r: oracle_c2st(e, r, classifier="mlp", seed=0).accuracy,
                        estimator, reference,
                    )  # fmt: skip
                    row["sbibm_seed2"], row["rerun"] = None, True
                    rows.append(row)
                elif rerun:
                    if "ours_mlp" not in row:
                        row["ours_mlp"], row["s_ours_mlp"] = row["ours"], row["s_ours"]
                    row["ours"], row["s_ours"] = timed(
                        lambda e, r: oracle_c2st(e, r).accuracy, estimator, reference
                    )
                    row["rerun"] = True
                if floor and row["sbibm_seed2"] is None:
                    row["sbibm_seed2"], _ = timed(c2st, reference, estimator, seed=2)
                print(json.dumps(row), flush=True)
                (folder / "oracle_vs_sbibm.md").write_text(table(rows, n))
    (folder / "oracle_vs_sbibm.md").write_text(table(rows, n))
    print(table(rows, n))
    print(f"wrote {folder / 'oracle_vs_sbibm.md'}")


if __name__ == "__main__":
    main()
