"""Does ``cl.recalibrate`` fix what the global checks find on the Jansen-Rit flow?

The flow of :mod:`examples.benchmarks.jansen_rit` (a zuko MAF with 10 layers, trained by
that script's :func:`~examples.benchmarks.jansen_rit.train` on the same cached
simulations with the same seeds) is recalibrated on the 5,000 held-out calibration pairs
with ``cl.recalibrate(flow, theta, x, method="auto")``, once as it is and once restricted
to the prior's box (``prior=task.prior()``, a :class:`calib_lightning.TruncatedPosterior`
around the recalibrated flow). Then ``--fresh-pairs`` new pairs are simulated with another
seed (never seen by the training nor by the fix), and :func:`calib_lightning.diagnose`
runs its global checks (KCCSD, marginal and joint ranks, TARP, the joint classifier
test, the prior-support check) on the flow and each fix side by side, with the same seed
(``before=``: common random numbers).

Simulations are cached under ``/tmp/jansen/``. It writes
``examples/benchmarks/results/jansen_rit_fix.md``.

Run (about 15 minutes on two shared cores, most of it the flow's training)::

    python examples/benchmarks/jansen_rit_fix.py [--simulations 20000] [--pairs 5000]
        [--fresh-pairs 5000] [--train-minutes 10]

(``--smoke``: 64 simulations, one epoch, 64 pairs, outputs in a temporary folder.)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if not __package__:  # run as a file (python examples/x.py): make `examples` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch

import calib_lightning as cl
from calib_lightning.tasks import JansenRit
from examples._smoke import add_smoke_argument, output_folder
from examples.benchmarks.jansen_rit import (
    CACHE,
    LABELS,
    RESULTS,
    Laps,
    machine,
    simulated,
    train,
    training_and_calibration,
)

# KCCSD left out: on this flow its statistic is not finite in float32 and it raises
# (see the results file)
CHECKS = ("ranks", "tarp", "joint_c2st", "support")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--simulations", type=int, default=20_000)
    parser.add_argument("--pairs", type=int, default=5_000, help="pairs the fix is fitted on")
    parser.add_argument("--fresh-pairs", type=int, default=5_000, help="pairs it is judged on")
    parser.add_argument("--draws", type=int, default=100, help="posterior draws per pair")
    parser.add_argument("--epochs", type=int, default=300)
    parser.add_argument("--train-minutes", type=float, default=10.0)
    parser.add_argument("--seed", type=int, default=0, help="seed of the simulations")
    parser.add_argument("--flow-seed", type=int, default=0, help="seed of the flow's training")
    parser.add_argument("--name", default="jansen_rit_fix", help="name of the results file")
    parser.add_argument(
        "--kccsd64",
        action="store_true",
        help="only KCCSD on the fresh pairs, in float64, for the flow and both fixes (printed)",
    )
    add_smoke_argument(parser)
    args = parser.parse_args()
    if args.smoke:
        args.simulations, args.pairs, args.fresh_pairs = 64, 64, 64
        args.draws, args.epochs = 20, 1
    torch.set_num_threads(1)
    out = output_folder(RESULTS, args.smoke)
    cache = None if args.smoke else CACHE
    lap = Laps()
    task = JansenRit()
    prior = task.prior()
    # the sets of jansen_rit.py (seeds seed and seed + 1; seed + 2 are its observations)
    theta, x, theta_cal, x_cal = training_and_calibration(
        task, args.simulations, args.pairs, args.seed, cache
    )
    lap(f"simulate (or read) {args.simulations} training and {args.pairs} calibration pairs")
    fresh_seed = args.seed + 3
    theta_new = task.sample_prior(args.fresh_pairs, torch.Generator().manual_seed(fresh_seed))
    x_new = simulated(task, "fresh", theta_new, fresh_seed, cache)
    lap(f"simulate (or read) {args.fresh_pairs} fresh pairs (seed {fresh_seed})")

    # the trained flow is cached too (training is capped by wall time, so its epochs
    # depend on the load: a rerun reuses the flow rather than training another one)
    key = [args.simulations, args.seed, args.flow_seed, args.epochs, args.train_minutes]
    stored = cache / "fix_flow.pt" if cache is not None else None
    if stored is not None and stored.is_file() and torch.load(stored)["key"] == key:
        flow, epochs = train(theta, x, 0, args.train_minutes, args.flow_seed)  # untrained
        saved = torch.load(stored)
        flow.load_state_dict(saved["state"])
        epochs = saved["epochs"]
        lap(f"read the trained MAF ({epochs} epochs, {saved['seconds']:.0f} s to train)")
    else:
        flow, epochs = train(theta, x, args.epochs, args.train_minutes, args.flow_seed)
        lap(f"train the MAF ({epochs} epochs)")
        if stored is not None:
            state = {"state": flow.state_dict(), "epochs": epochs, "key": key}
            torch.save({**state, "seconds": lap.seconds[next(reversed(lap.seconds))]}, stored)

    fixed = cl.recalibrate(flow, theta_cal, x_cal, method="auto", seed=args.seed)
    lap(f"cl.recalibrate(method='auto') on {args.pairs} pairs")
    print(fixed.selection)
    truncated = cl.recalibrate(flow, theta_cal, x_cal, method="auto", seed=args.seed, prior=prior)
    lap(f"cl.recalibrate(method='auto', prior=prior) on {args.pairs} pairs")
    print(truncated.selection)

    if args.kccsd64:  # KCCSD only, every posterior in float64 (in float32 it raises)
        for name, post in (("recalibrated", fixed), ("recalibrated + truncated", truncated)):
            report = cl.diagnose(
                post.to(torch.float64),
                theta_new.double(),
                x_new.double(),
                checks=("kccsd",),
                seed=args.seed,
                before=flow.to(torch.float64),
            )
            flow.to(torch.float32)
            lap(f"KCCSD in float64, flow and {name}, {args.fresh_pairs} fresh pairs")
            for side, diagnosis in (("flow", report.before), (name, report)):
                kccsd = diagnosis.checks["kccsd"]
                print(f"{side}: KCCSD {float(kccsd.statistic):.4g}, p {float(kccsd.p_value):.3g}")
        return

    common = {
        "labels": LABELS,
        "prior": prior,
        "seed": args.seed,
        "num_posterior_samples": args.draws,
        "checks": CHECKS,
    }
    report_fixed = cl.diagnose(fixed, theta_new, x_new, before=flow, **common)
    lap(f"cl.diagnose: flow and recalibrated, {args.fresh_pairs} fresh pairs")
    print(report_fixed.comparison.table())
    report_truncated = cl.diagnose(
        truncated, theta_new, x_new, before=report_fixed.before, **common
    )
    lap(f"cl.diagnose: truncated, {args.fresh_pairs} fresh pairs")
    print(report_truncated.comparison.table())

    # truncation alone (no latent map), to tell its effect from the map's
    only = cl.TruncatedPosterior(flow, prior)
    report_only = cl.diagnose(only, theta_new, x_new, before=report_fixed.before, **common)
    lap(f"cl.diagnose: truncated only, {args.fresh_pairs} fresh pairs")
    print(report_only.comparison.table())

    reports = {
        "flow": report_fixed.before,
        f"recalibrated ({fixed.method})": report_fixed,
        f"recalibrated + truncated ({truncated.method})": report_truncated,
        f"truncated only ({only.method})": report_only,
    }
    path = out / f"{args.name}.md"
    write_results(path, args, epochs, reports, fixed, truncated, lap.seconds, fresh_seed)
    print("wrote", path)


def _p(value) -> str:
    return "" if value is None else f"{float(value):.3g}"


def write_results(
    path: Path,
    args: argparse.Namespace,
    epochs: int,
    reports: dict,
    fixed,
    truncated,
    seconds: dict,
    fresh_seed: int,
) -> None:
    names = list(reports)
    rows = {name: {row["check"]: row for row in report.rows()} for name, report in reports.items()}
    checks = list(dict.fromkeys(check for table in rows.values() for check in table))
    lines = [
        "# Recalibrating the Jansen-Rit flow: judged on fresh pairs",
        "",
        f"{machine()}. Command: `python examples/benchmarks/jansen_rit_fix.py"
        f" --simulations {args.simulations} --pairs {args.pairs}"
        f" --fresh-pairs {args.fresh_pairs} --train-minutes {args.train_minutes:g}"
        f" --seed {args.seed} --flow-seed {args.flow_seed}`.",
        "",
        f"The flow of [`jansen_rit.md`](jansen_rit.md) (zuko MAF, 10 layers, trained by "
        f"`jansen_rit.py`'s `train` on the same {args.simulations:,} simulations with the "
        f"same seed; {epochs} epochs here), recalibrated with `cl.recalibrate(flow, theta, "
        f"x, method='auto')` on the {args.pairs:,} calibration pairs of `jansen_rit.py`, "
        "with and without `prior=task.prior()` (truncation to the prior's box after the "
        "map), and the flow truncated without a map (`cl.TruncatedPosterior(flow, prior)`). "
        f"Judged on {args.fresh_pairs:,} fresh pairs (simulation seed {fresh_seed}), "
        f"by `cl.diagnose(..., prior=prior, before=flow)`, {args.draws} posterior draws per "
        f"pair, seed {args.seed} for every posterior (common random numbers).",
        "",
        "## Global checks on the fresh pairs (p-value, verdict at 0.05)",
        "",
        "| check | " + " | ".join(names) + " |",
        "| --- |" + " --- |" * len(names),
    ]
    for check in checks:
        cells = []
        for name in names:
            row = rows[name].get(check)
            if row is None:
                cells.append("")
                continue
            p = row["global_p_value"] if row["global_p_value"] is not None else row["p_value"]
            cells.append(f"{_p(p)}, {row['verdict']}" if p is not None else row["verdict"])
        lines.append(f"| {check} | " + " | ".join(cells) + " |")
    lines.append(
        "| overall p-value | "
        + " | ".join(_p(report.overall_p_value) for report in reports.values())
        + " |"
    )
    lines += [
        "",
        "## Prior support, coverage errors and rank details",
        "",
        "| quantity | " + " | ".join(names) + " |",
        "| --- |" + " --- |" * len(names),
    ]
    support = [report.checks.get("support") for report in reports.values()]
    lines.append(
        "| share of draws outside the prior | "
        + " | ".join("" if s is None else f"{float(s.statistic):.4f}" for s in support)
        + " |"
    )
    # the coverage errors of each posterior, from the before/after comparisons (public API)
    after = [report.comparison.coverage_rows() for report in list(reports.values())[1:]]
    errors = [{row["quantity"]: (row["description"], row["before"]) for row in after[0]}]
    errors += [{row["quantity"]: (row["description"], row["after"]) for row in a} for a in after]
    for key in dict.fromkeys(k for e in errors for k in e):
        description = next(e[key][0] for e in errors if key in e)
        lines.append(
            f"| `{key}` ({description}) | "
            + " | ".join(
                f"{e[key][1]:+.4f}" if key in e and e[key][1] is not None else "" for e in errors
            )
            + " |"
        )
    cells = []
    for report in reports.values():
        ranks = report.checks.get("ranks")
        cells.append(
            ""
            if ranks is None
            else ", ".join(
                f"{n} {float(v):.3g}" for n, v in zip(LABELS, ranks.marginal_p_values, strict=True)
            )
        )
    lines.append("| marginal rank chi-square p | " + " | ".join(cells) + " |")
    lines.append(
        "| joint (HPD) rank chi-square p | "
        + " | ".join(
            _p(report.checks["ranks"].p_value) if "ranks" in report.checks else ""
            for report in reports.values()
        )
        + " |"
    )
    lines += [
        "",
        "## What `method='auto'` chose (held-out, cross-fitted scores on the calibration pairs)",
        "",
        "Without `prior=`:",
        "",
        "```",
        str(fixed.selection),
        "```",
        "",
        "With `prior=task.prior()` (the HPD scores measure the truncated posterior):",
        "",
        "```",
        str(truncated.selection),
        "```",
        "",
        "## Time of each step",
        "",
        "| step | seconds |",
        "| --- | --- |",
        *[f"| {name} | {s:.0f} |" for name, s in seconds.items()],
    ]
    path.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
