"""L-C2ST-NF's sensitivity against the number of calibration pairs, beside sbi (issue 23).

At 10,000 simulations the sbibm validation's local tests miss most clearly wrong
posteriors (sensitivity 0.38, sbi's ``LC2ST_NF`` 0.16, on 1,000 calibration pairs). The
oracle sees each observation through 500 reference samples; a local test sees it only
through the amortized calibration pairs near it, so the number of calibration pairs is the
first thing a user can change. This script puts side by side ``sbibm_validation.py`` runs
that differ only in ``--num-cal``: the same estimators (its cache), the same observations
and oracle (the oracle is recomputed in each run, and must agree: the script says how far
it does), ``cl.LC2STNF`` and sbi's ``LC2ST_NF`` with their nulls retrained on each set of
calibration ``x``.

Per task and number of calibration pairs: sensitivity (share of observations with oracle
>= 0.6 rejected at 0.05, no multiplicity correction), alarm rate (oracle <= 0.55),
within-task Spearman correlation of the statistic with the oracle, and the seconds of
the null (once per task) and of one check of the 10 observations, ours and sbi's.

The committed runs (2026-11-27, 2 cores, two processes side by side, each a pair of
tasks)::

    PYTHONPATH=. python examples/benchmarks/sbibm_validation.py --tasks TASK1 TASK2 \\
        --budgets 10000 --estimators sbi_maf zuko_nsf --seeds 0 --num-cal N \\
        --num-oracle 500 --max-epochs 30 --sbi-lc2st-null 0 --num-null-ours 100 \\
        --results examples/benchmarks/results/lc2st_calibration_N.jsonl

for N = 2,000 and 4,000 (at 4,000 also ``--budgets 1000``). The 1,000-pair run is
``lc2st_training_source.jsonl``: the same command with ``--num-cal 1000`` and both
budgets, which made the cache of estimators. Then::

    PYTHONPATH=. python examples/benchmarks/lc2st_calibration_size.py --repeat --leakage
    python examples/benchmarks/lc2st_calibration_size.py --smoke   (sbibm_validation's
        smoke, read as two runs, and the oracle repeated; a temp folder)

The classifier's own randomness at each size: ``lc2st_training.py --variants default
--seeds 0 1 2`` on each run (``lc2st_training.md`` at 1,000 pairs,
``lc2st_training_2000.md``, ``lc2st_training_4000.md``; the last also with
``num_ensemble=5``: their headers give the commands).

``--runs N=CASES.jsonl ...`` names other runs. Writes
examples/benchmarks/results/lc2st_calibration_size.md and .png (sensitivity against the
calibration pairs, ours and sbi's, a line per task, a panel per budget).

The oracle is itself a noisy estimate (a classifier on 500 samples a side). ``--repeat``
computes it a second time at the largest budget, on other samples (reference samples
500-999, estimator draws under another seed; the estimators from
``sbibm_validation.py``'s ``--cache``) and keeps it in
``lc2st_calibration_oracle.jsonl``: the within-task Spearman correlation of the two
oracles is as high as any statistic's correlation with one of them can be expected to go.

``--leakage`` draws 10,000 samples of each estimator of the largest run at the 10
observations and keeps the share outside the support of sbibm's prior (the estimators
are diagnosed as trained, without sbi's rejection to the prior's support, and so are the
oracle's draws), and runs ``cl.diagnose``'s support check on the run's calibration pairs,
in ``lc2st_calibration_leakage.jsonl``; the report sets them beside the oracle and the
statistics.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

if not __package__:  # run as a file (python examples/x.py): make `examples` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np
import torch

from examples._smoke import add_smoke_argument, has_sbibm, output_folder

RESULTS = Path(__file__).parent / "results"
DEFAULT_RUNS = {1000: RESULTS / "lc2st_training_source.jsonl",
                2000: RESULTS / "lc2st_calibration_2000.jsonl",
                4000: RESULTS / "lc2st_calibration_4000.jsonl"}  # fmt: skip
#: ``lc2st_training.py``'s cases on each run: the default at metric seeds 0, 1, 2
SEED_CASES = {1000: RESULTS / "lc2st_training.jsonl",
              2000: RESULTS / "lc2st_training_2000.jsonl",
              4000: RESULTS / "lc2st_training_4000.jsonl"}  # fmt: skip
SEED_VARIANTS = ("default", "default, seed 1", "default, seed 2")
TESTS = {"ours_nf": "ours L-C2ST-NF", "sbi_nf": "sbi LC2ST_NF"}
KEY = ("task", "estimator", "budget", "seed")


def load(path: Path) -> dict[tuple, dict]:
    rows = (json.loads(line) for line in path.read_text().splitlines() if line.strip())
    return {tuple(r[k] for k in KEY): r for r in rows}


def count(pairs: Any, wrong: bool = True) -> tuple[int, int]:
    """Among ``(oracle, p-value)`` pairs called wrong (oracle >= 0.6; ``wrong=False``: right,
    <= 0.55), how many the test rejects at 0.05, and how many there are."""
    from examples.benchmarks.sbibm_validation import LEVEL, RIGHT, WRONG

    chosen = [p for value, p in pairs if ((value >= WRONG) if wrong else (value <= RIGHT))]
    return sum(p <= LEVEL for p in chosen), len(chosen)


def paired(rows: list[dict], test: str) -> list[tuple[float, float]]:
    """``(oracle, p-value)`` of ``test`` at every observation of ``rows``."""
    return [vp for r in rows for vp in zip(r["oracle"], r[f"{test}_p"], strict=True)]


def rate(rows: list[dict], test: str, wrong: bool) -> str:
    hits, total = count(paired(rows, test), wrong)
    return f"{hits / total:.2f} ({hits}/{total})" if total else "-"


def repeat_oracle(
    keys: list[tuple], cache: Path, path: Path, size: int = 500
) -> dict[tuple, list[float]]:
    """The oracle once more at each key's 10 observations, on ``size`` other samples a side
    (resumed from ``path``)."""
    from sbibm.metrics import c2st

    import calib_lightning as cl
    from examples.benchmarks.sbibm_validation import task_data, train

    lines = path.read_text().splitlines() if path.exists() else []
    out = {tuple(r["key"]): r["oracle"] for r in map(json.loads, lines)}
    for key in (k for k in keys if k not in out):
        data = task_data(key[0], 1, 2 * size)
        reference = data["reference"][:, size:]  # the run's oracle used [:size]
        if not (cache / "{}_{}_{}_{}.pt".format(*key)).exists():  # train() would retrain
            raise ValueError(f"cache: no estimator {key} in {cache}; run sbibm_validation.py")
        post = cl.as_posterior(train(*key, cache, 100))
        torch.manual_seed(1)  # the run drew under seed 0
        with torch.no_grad():
            samples = post.sample(data["x_o"], reference.shape[1]).transpose(0, 1)
        out[key] = [float(c2st(reference[o], samples[o])[0]) for o in range(10)]
        with path.open("a") as f:
            f.write(json.dumps({"key": list(key), "oracle": out[key]}) + "\n")
        print("oracle repeated:", key, flush=True)
    return out


def prior_leakage(
    keys: list[tuple], cache: Path, path: Path, num_cal: int, size: int = 10_000
) -> dict[tuple, dict]:
    """Each key's estimator's mass outside the prior's support: at the task's 10
    observations, the share of ``size`` draws (seed 0) outside the support of sbibm's
    prior; and ``cl.diagnose``'s support check (its default 100 draws a
    pair) on the run's ``num_cal`` calibration pairs (resumed from ``path``)."""
    import sbibm

    import calib_lightning as cl
    from calib_lightning._utils.prior import outside_support
    from examples.benchmarks.sbibm_validation import task_data, train

    lines = path.read_text().splitlines() if path.exists() else []
    out = {tuple(r["key"]): r for r in map(json.loads, lines)}
    for key in (k for k in keys if k not in out):
        if not (cache / "{}_{}_{}_{}.pt".format(*key)).exists():  # train() would retrain
            raise ValueError(f"cache: no estimator {key} in {cache}; run sbibm_validation.py")
        prior, data = sbibm.get_task(key[0]).get_prior_dist(), task_data(key[0], num_cal, 1)
        post = cl.as_posterior(train(*key, cache, 100))
        torch.manual_seed(0)
        outside = outside_support(prior, post.sample(data["x_o"], size))  # (S, 10)
        check = cl.diagnose(post, data["theta"], data["x"], checks=("support",),
                            prior=prior).checks["support"]  # fmt: skip
        out[key] = {"key": list(key), "leakage": outside.double().mean(0).tolist(),
                    "pairs_leakage": float(check.statistic),
                    "support_p": float(check.p_value)}  # fmt: skip
        with path.open("a") as f:
            f.write(json.dumps(out[key]) + "\n")
        print("prior leakage:", key, flush=True)
    return out


def leakage_lines(rows: dict[tuple, dict], leaks: dict[tuple, dict], pairs: int) -> list[str]:
    """What the oracle sees: the estimators' mass outside the prior's support."""
    from examples.benchmarks.sbibm_validation import spearman

    keys = sorted((k for k in rows if k in leaks), key=lambda k: (k[0], -k[2], k[1]))
    if not keys:
        return []
    lines = [
        "",
        "## What the oracle sees: mass outside the prior's support",
        "",
        "The estimators are diagnosed as trained, without the rejection to the prior's "
        "support that sbi's `DirectPosterior` adds when sampling (`cl.as_posterior`'s sbi "
        "adapter, `docs/diagnostics.md`), and so are the oracle's draws. Leakage: the share "
        "of the draws at each observation (10,000; 200 in `--smoke`) outside the support "
        "of sbibm's prior "
        "(`--leakage`, kept in `lc2st_calibration_leakage.jsonl`); Spearman over the "
        f"estimator's 10 observations; statistics of the {pairs:,}-pair run. Under the true "
        "posterior the leakage is 0, and a draw outside the support is a sample the "
        "reference can never produce, which a classifier separates at once. Last column: "
        "`cl.diagnose(..., checks=('support',), prior=task.get_prior_dist())` on the "
        f"run's {pairs:,} calibration pairs (100 draws a pair): the share of its draws "
        "outside, and its exact p-value (0: a draw outside, the verdict rejects).",
        "",
        "| task | simulations | estimator | leakage (min-max) | oracle (min-max) | "
        "Spearman: leakage vs oracle | ours vs oracle | ours vs leakage | sbi vs leakage | "
        "support check on the pairs |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for key in keys:
        leak, row = leaks[key]["leakage"], rows[key]
        check = f"{leaks[key]['pairs_leakage']:.1%} (p = {leaks[key]['support_p']:g})"
        lines.append(
            f"| {key[0]} | {key[2]:,} | {key[1]} | {min(leak):.3f}-{max(leak):.3f} | "
            f"{min(row['oracle']):.2f}-{max(row['oracle']):.2f} | "
            f"{spearman(leak, row['oracle']):.2f} | "
            f"{spearman(row['ours_nf_stat'], row['oracle']):.2f} | "
            f"{spearman(row['ours_nf_stat'], leak):.2f} | "
            f"{spearman(row['sbi_nf_stat'], leak):.2f} | {check} |"
        )
    return lines


def report(
    runs: dict[int, dict[tuple, dict]], names: dict[int, str],
    repeated: dict[tuple, list[float]] | None = None, seed_cases: dict | None = None,
    leaks: dict[tuple, dict] | None = None,
) -> str:  # fmt: skip
    """One row per group (task and budget, all tasks per budget, everything) and number of
    calibration pairs, for the runs that hold every estimator of the group."""
    from examples.benchmarks.sbibm_validation import RIGHT, WRONG, spearman

    keys = sorted(set().union(*runs.values()))
    shared = [k for k in keys if sum(k in r for r in runs.values()) > 1]
    if not shared:
        raise ValueError("runs: no estimator is in two runs (task, estimator, budget, seed)")
    gap = max(
        abs(a - b) for k in shared for x in runs.values() for y in runs.values()
        if k in x and k in y for a, b in zip(x[k]["oracle"], y[k]["oracle"], strict=True)
    )  # fmt: skip
    budgets = sorted({k[2] for k in shared}, reverse=True)
    groups = [(t, b) for b in budgets for t in sorted({k[0] for k in shared if k[2] == b})]
    groups += [("all", b) for b in budgets] + ([("all", "all")] if len(budgets) > 1 else [])
    lines = [
        "# L-C2ST-NF's sensitivity and the number of calibration pairs, beside sbi",
        "",
        "`python examples/benchmarks/lc2st_calibration_size.py`: `sbibm_validation.py` runs "
        "that differ only in the number of calibration pairs: "
        + ", ".join(f"{n:,} (`{names[n]}`)" for n in runs)
        + f". Estimators ({', '.join(sorted({k[1] for k in shared}))}; seed "
        f"{sorted({k[3] for k in shared})}) and sbibm's 10 observations each; a row lists "
        "a number of calibration pairs when its run holds every estimator of the row. Both "
        "libraries' nulls are retrained on each set of calibration x. The oracle (sbibm's "
        f"`c2st`, recomputed in each run) differs between the runs by at most {gap:.3f}.",
        "",
        "Sensitivity: share of observations with oracle >= 0.6 rejected at 0.05 (no "
        "multiplicity correction); alarm: the same among oracle <= 0.55; Spearman: of the "
        "statistic with the oracle over the task's observations at the budget.",
        "",
        "| task | simulations | calibration pairs | wrong | right | "
        + " | ".join(f"{n} sens. | alarm | Spearman" for n in TESTS.values())
        + " | s null: ours / sbi | s check: ours / sbi |",
        "| --- | --- | --- | --- | --- | "
        + " | ".join("--- | --- | ---" for _ in TESTS)
        + " | --- | --- |",
    ]
    for task, budget in groups:
        want = [k for k in shared if task in ("all", k[0]) and budget in ("all", k[2])]
        for n, rows in runs.items():
            if not all(k in rows for k in want):
                continue
            group = [rows[k] for k in want]
            oracle = [v for r in group for v in r["oracle"]]
            cells = []
            for test in TESTS:
                rho = "-"
                if task != "all":
                    rho = f"{spearman(oracle, [v for r in group for v in r[f'{test}_stat']]):.2f}"
                cells += [rate(group, test, True), rate(group, test, False), rho]
            null = {t: np.mean(list({r["task"]: r[f"s_{t}_null"] for r in group}.values()))
                    for t in ("ours", "sbi")}  # fmt: skip
            check = {t: np.mean([r[f"s_{t}_nf"] for r in group]) for t in ("ours", "sbi")}
            size = f"{budget:,}" if budget != "all" else "all"
            lines.append(
                f"| {task} | {size} | {n:,} | {sum(v >= WRONG for v in oracle)} | "
                f"{sum(v <= RIGHT for v in oracle)} | " + " | ".join(cells)
                + f" | {null['ours']:.0f} / {null['sbi']:.0f} | "
                f"{check['ours']:.1f} / {check['sbi']:.1f} |"
            )
    first = runs[min(runs)]
    lines += seeds(runs, seed_cases or {})
    lines += ceiling(first, [k for k in shared if k in first], repeated)
    return "\n".join(lines + leakage_lines(runs[max(runs)], leaks or {}, max(runs))) + "\n"


def seeds(runs: dict[int, dict[tuple, dict]], cases: dict[int, Path]) -> list[str]:
    """The default at three classifier seeds: observations with oracle >= 0.6 rejected,
    pooled over the seeds, per budget."""
    rows = []
    for n, path in cases.items():
        if n not in runs or not path.exists():
            continue
        found = [json.loads(line) for line in path.read_text().splitlines()]
        found = [c for c in found if c["variant"] in SEED_VARIANTS]
        for budget in {c["budget"] for c in found}:
            hits = {v: [0, 0] for v in SEED_VARIANTS}
            for c in (c for c in found if c["budget"] == budget):
                oracle = runs[n][tuple(c[k] for k in KEY)]["oracle"]
                h, t = count(zip(oracle, c["p"], strict=True))
                hits[c["variant"]] = [hits[c["variant"]][0] + h, hits[c["variant"]][1] + t]
            pooled = [sum(h[i] for h in hits.values()) for i in (0, 1)]
            per_seed = ", ".join(f"{h}/{t}" for h, t in hits.values())
            rows.append(((-budget, -n), f"| {budget:,} | {n:,} | {per_seed} | "
                         f"{pooled[0] / pooled[1]:.2f} ({pooled[0]}/{pooled[1]}) |"))  # fmt: skip
    if not rows:
        return []
    head = ["", "## Three classifier seeds", "",
            "The default `cl.LC2STNF` at metric seeds 0, 1, 2 (`lc2st_training.py --variants "
            "default --seeds 0 1 2` on each run; seed 0 is the run's own): observations with "
            "oracle >= 0.6 rejected at 0.05, per seed and pooled.", "",
            "| simulations | calibration pairs | seeds 0, 1, 2 | pooled |",
            "| --- | --- | --- | --- |"]  # fmt: skip
    return head + [line for _, line in sorted(rows)]


def figure(runs: dict[int, dict[tuple, dict]], path: Path) -> None:
    """Sensitivity against the number of calibration pairs, a panel per budget, a line per
    task and library (the runs that hold the task's every estimator)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    first = runs[min(runs)]
    budgets = sorted({k[2] for k in first}, reverse=True)
    fig, axes = plt.subplots(1, len(budgets), figsize=(4.2 * len(budgets), 3.4), squeeze=False)
    for ax, budget in zip(axes[0], budgets, strict=True):
        tasks = sorted({k[0] for k in first if k[2] == budget})
        for color, task in enumerate(tasks):
            keys = [k for k in first if k[0] == task and k[2] == budget]
            sizes = [n for n in runs if all(k in runs[n] for k in keys)]
            for test, style in (("ours_nf", "-o"), ("sbi_nf", ":x")):
                counts = [count(paired([runs[n][k] for k in keys], test)) for n in sizes]
                share = [h / max(t, 1) for h, t in counts]
                ax.plot(sizes, share, style, color=f"C{color}",
                        label=f"{task}, {TESTS[test]}")  # fmt: skip
        ax.set(xscale="log", ylim=(-0.03, 1.03), xlabel="calibration pairs",
               title=f"{budget:,} simulations")  # fmt: skip
        ax.set_xticks(list(runs), [f"{n:,}" for n in runs])
        ax.minorticks_off()
    axes[0][0].set_ylabel("share of wrong posteriors rejected")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)


def ceiling(rows: dict[tuple, dict], shared: list[tuple], repeated: dict | None) -> list[str]:
    """The oracle against itself on other samples, within task and budget."""
    from examples.benchmarks.sbibm_validation import WRONG, spearman

    keys = [k for k in shared if k in (repeated or {})]
    if not keys:
        return []
    lines = [
        "",
        "## The oracle against itself",
        "",
        "The oracle computed again on other samples (reference samples 500-999, estimator "
        "draws under another seed; `--repeat`): within-task Spearman correlation of the two "
        "oracles (the ceiling of a statistic's correlation with one of them), their mean "
        "absolute difference, and how many observations change side of 0.6.",
        "",
        "| task | simulations | observations | oracle range | Spearman, oracle vs repeat | "
        "mean abs. difference | cross 0.6 |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for task, budget in sorted({k[:3:2] for k in keys}, key=lambda g: (-g[1], g[0])):
        mine = [k for k in keys if k[0] == task and k[2] == budget]
        first = [v for k in mine for v in rows[k]["oracle"]]
        again = [v for k in mine for v in repeated[k]]
        cross = sum((a >= WRONG) != (b >= WRONG) for a, b in zip(first, again, strict=True))
        lines.append(
            f"| {task} | {budget:,} | {len(first)} | {min(first):.2f}-{max(first):.2f} | "
            f"{spearman(first, again):.2f} | "
            f"{np.mean(np.abs(np.subtract(first, again))):.3f} | {cross} |"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", nargs="*", help="N=CASES.jsonl: a sbibm_validation run")
    parser.add_argument("--budgets", nargs="*", type=int, help="simulations (default: all)")
    parser.add_argument("--repeat", action="store_true", help="compute the oracle again")
    parser.add_argument("--leakage", action="store_true", help="the mass outside the prior")
    parser.add_argument("--cache", type=Path, default=Path("/tmp/sbibm_validation_cache"))
    add_smoke_argument(parser)
    args = parser.parse_args()
    if not has_sbibm():
        return
    folder = output_folder(RESULTS, args.smoke)
    bad = [item for item in args.runs or [] if not re.fullmatch(r"\d+=.+", item)]
    if bad:
        raise ValueError(f"--runs: expected N=CASES.jsonl (N the calibration pairs), got {bad}")
    runs = {int(n): Path(p) for n, p in (item.split("=", 1) for item in args.runs or [])}
    runs = runs or DEFAULT_RUNS
    if args.smoke:  # sbibm_validation's smoke, read twice: exercises the report only
        script = str(Path(__file__).with_name("sbibm_validation.py"))
        out = subprocess.run(
            [sys.executable, script, "--smoke"], capture_output=True, text=True, check=True
        )
        cases = Path(out.stdout.strip().splitlines()[-1].split()[-1]).with_suffix(".jsonl")
        runs, args.cache = {300: cases, 600: cases}, cases.parent / "cache"
        args.repeat = args.leakage = True
    loaded = {n: load(p) for n, p in runs.items()}
    if args.budgets:
        loaded = {n: {k: r for k, r in rows.items() if k[2] in args.budgets}
                  for n, rows in loaded.items()}  # fmt: skip
    path = folder / "lc2st_calibration_oracle.jsonl"
    repeated = None
    if args.repeat or path.exists():
        keys = [k for k in loaded[min(loaded)] if sum(k in r for r in loaded.values()) > 1]
        keys = sorted(k for k in keys if k[2] == max(j[2] for j in keys))  # the largest budget
        torch.set_num_threads(1)
        size = 100 if args.smoke else 500
        repeated = repeat_oracle(keys if args.repeat else [], args.cache, path, size)
    path = folder / "lc2st_calibration_leakage.jsonl"
    leaks = None
    if args.leakage or path.exists():
        keys = sorted(loaded[max(loaded)]) if args.leakage else []
        leaks = prior_leakage(keys, args.cache, path, max(loaded), 200 if args.smoke else 10_000)
    text = report(loaded, {n: p.name for n, p in runs.items()}, repeated,
                  {} if args.smoke else SEED_CASES, leaks)  # fmt: skip
    text += "\n![sensitivity against the calibration pairs](lc2st_calibration_size.png)\n"
    (folder / "lc2st_calibration_size.md").write_text(text)
    figure(loaded, folder / "lc2st_calibration_size.png")
    print(text)
    print(f"wrote {folder / 'lc2st_calibration_size.md'}")


if __name__ == "__main__":
    main()
