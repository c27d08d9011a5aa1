"""L-C2ST-NF's classifier training on sbibm's reference posteriors (issue 23, item 4).

The L-C2ST and L-C2ST-NF classifiers (``MLPEnsemble``: Adam at 1e-2, mini-batches of
64, stop after 2 epochs without improvement of a 10 % held-out loss, two layers of
min(10 x inputs, 96) units; 3 epochs, 128 units and 10,000 evaluation points before
2026-11-27: ``PREVIOUS``, from which every variant but ``default`` starts) stop early;
sbi's train up to 1,000 epochs with patience 50. Each variant below trains ``cl.LC2STNF``'s
null (100 classifiers, once per task, on the task's calibration ``x``) and its observed
classifier with other ``classifier_kwargs``, on the estimators, calibration pairs and
observations of ``sbibm_validation.py`` (its cases file gives the oracle and sbi's
``LC2ST_NF`` p-values; its cache, the trained estimators: run it first). A variant's
``num_ensemble`` (classifiers averaged per statistic, in the null too) and ``norm_feature``
(the latent's norm as a feature) are the metric's arguments, not classifier settings.

Per variant: sensitivity (share of observations with oracle >= 0.6 rejected at 0.05),
alarm rate (oracle <= 0.55), within-task Spearman correlation of the statistic with the
oracle, seconds (null; one check of 10 observations) beside sbi's LC2ST_NF of the same
cases, and the mean epochs the null and the observed classifiers trained. ``--seeds``
repeats variants with other metric seeds (other classifier initialisations, splits and
batch orders; the same estimators and pairs): a difference between variants smaller than
between seeds is classifier noise. The level of a variant is not measured here
(tests/test_lc2st_level.py measures the defaults').

Run:  PYTHONPATH=. python examples/benchmarks/lc2st_training.py   (after sbibm_validation)
      --source CASES.jsonl --num-cal N: another sbibm_validation run's cases (give its
          --num-cal: the calibration pairs are redrawn from it); --tasks, --variants,
          --seeds select (resumes from lc2st_training.jsonl, keyed by task and variant)
      --sbi: time sbi's LC2ST_NF (null once per task, one check per case) in this run,
          on the same inputs, for the ratio column (otherwise the source run's seconds)
      python examples/benchmarks/lc2st_training.py --smoke       (runs sbibm_validation's
          smoke first; a temp folder)
Writes examples/benchmarks/results/lc2st_training.md (cases in lc2st_training.jsonl;
``--name NAME``: NAME.md and NAME.jsonl).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

if not __package__:  # run as a file (python examples/x.py): make `examples` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np
import torch

from examples._smoke import add_smoke_argument, output_folder

#: the package's settings before the local tests got theirs (LOCAL_TEST_SETTINGS and 2,000
#: evaluation points, 2026-11-27): every variant but "default" starts from them, as it ran
#: then, so the earlier results files' "default" rows are the first variant below
PREVIOUS = {"num_eval": 10_000, "patience": 3, "max_width": 128}
PREVIOUS_NAME = "previous defaults (10,000 evaluation points, patience 3, up to 128 units)"
VARIANTS: dict[str, dict[str, Any]] = {
    "default": {},
    PREVIOUS_NAME: PREVIOUS,
    **{name: {**PREVIOUS, **settings} for name, settings in {
        "patience 20": {"patience": 20},
        "lr 1e-3, patience 20": {"learning_rate": 1e-3, "patience": 20},
        "lr 1e-3, patience 50, 1000 epochs (sbi's stopping)": {
            "learning_rate": 1e-3, "patience": 50, "max_epochs": 1000,
        },
        "patience 10, batch 128": {"patience": 10, "batch_size": 128},
        "lr 1e-3, patience 10": {"learning_rate": 1e-3, "patience": 10},
        "lr 3e-3, patience 5": {"learning_rate": 3e-3, "patience": 5},
        "20 % held out, patience 5": {"validation_fraction": 0.2, "patience": 5},
        "default, 3 classifiers averaged (num_ensemble=3)": {"num_ensemble": 3},
        "default, 5 classifiers averaged (num_ensemble=5)": {"num_ensemble": 5},
        "default + the latent's norm (norm_feature=True)": {"norm_feature": True},
        "lr 1e-3, patience 20, two layers of 256": {
            "learning_rate": 1e-3, "patience": 20, "hidden_features": (256, 256),
        },
        "sbi's width (two layers of 10 x dim(theta))": {"width_per_parameter": 10},
        "two layers of 5 x inputs": {"width_per_input": 5},
        "two layers of min(10 x inputs, 64)": {"max_width": 64},
        "2,000 evaluation points": {"num_eval": 2000},
        "min(10 x inputs, 64), 2,000 evaluation points": {"max_width": 64, "num_eval": 2000},
        "2,000 evaluation points, second layer half as wide": {"num_eval": 2000, "taper": 2},
        "2,000 evaluation points, one layer of min(20 x inputs, 256)": {
            "num_eval": 2000, "one_layer": 256,
        },
        "2,000 evaluation points, patience 2": {"num_eval": 2000, "patience": 2},
        "2,000 evaluation points, min(10 x inputs, 96)": {"num_eval": 2000, "max_width": 96},
        "2,000 evaluation points, patience 2, min(10 x inputs, 96)": {
            "num_eval": 2000, "patience": 2, "max_width": 96,
        },
    }.items()},
}  # fmt: skip
NUM_NULL = 100
KEY = ("task", "estimator", "budget", "seed")


def run_variant(
    data: dict, rows: list[dict], name: str, kwargs: dict, args: Any, seed: int = 0
) -> list[dict]:
    """One variant on every case of one task: its null once, then one check per case;
    ``seed`` is the metric's (the classifiers' randomness)."""
    import calib_lightning as cl
    from examples.benchmarks.sbibm_validation import train

    kwargs = dict(kwargs)
    ensemble = kwargs.pop("num_ensemble", 1)  # metric arguments, not classifier ones
    norm_feature = kwargs.pop("norm_feature", False)
    num_eval = kwargs.pop("num_eval", args.num_eval)  # None: the metric's default
    points = {} if num_eval is None else {"num_posterior_samples": num_eval}
    dim = data["theta"].shape[1]  # widths per parameter (sbi's) or per input (D + dim x)
    inputs = dim + data["x"][0].numel()
    if "width_per_parameter" in kwargs:
        kwargs["hidden_features"] = (kwargs.pop("width_per_parameter") * dim,) * 2
    if "width_per_input" in kwargs:
        kwargs["hidden_features"] = (kwargs.pop("width_per_input") * inputs,) * 2
    if "taper" in kwargs:  # the first layer of min(10 x inputs, max_width), a narrower second
        width = min(10 * inputs, kwargs["max_width"])
        kwargs["hidden_features"] = (width, width // kwargs.pop("taper"))
    if "one_layer" in kwargs:
        kwargs["hidden_features"] = (min(20 * inputs, kwargs.pop("one_layer")),)

    def metric() -> cl.LC2STNF:
        return cl.LC2STNF(data["x_o"], num_null=args.num_null, **points,
                          num_ensemble=ensemble, classifier_kwargs=kwargs or None,
                          seed=seed, norm_feature=norm_feature)  # fmt: skip

    base = metric()
    start = time.perf_counter()
    base.null.fit(data["x"], dim=dim).statistics(
        base.flat_observations, base.pp_grid
    )
    s_null = time.perf_counter() - start
    out = []
    for row in rows:
        estimator = train(
            row["task"], row["estimator"], row["budget"], row["seed"], args.cache, 100
        )  # fmt: skip: from the cache
        check = metric()
        check.load_state_dict(base.state_dict())
        start = time.perf_counter()
        check.update(cl.as_posterior(estimator), data["theta"], data["x"])
        result = check.compute()
        out.append({
            **{k: row[k] for k in ("task", "estimator", "budget", "seed")},
            "variant": name, "s_null": s_null, "s_check": time.perf_counter() - start,
            "stat": result.statistic.tolist(), "p": result.p_value.tolist(),
            "null_epochs": base.null.classifier.epochs.float().mean().item(),
            "check_epochs": check.classifier.epochs.float().mean().item(),
        })  # fmt: skip
    return out


def sbi_timings(data: dict, rows: list[dict], args: Any) -> list[dict]:
    """sbi's ``LC2ST_NF`` on one task's cases, timed in this run (``--sbi``): its null once,
    then one check per case, as ``sbibm_validation.py`` runs them (the same draws: its
    seed, ``--num-oracle`` draws at the observations first). Its decisions are compared with
    the source run's."""
    import calib_lightning as cl
    from examples.benchmarks.sbibm_validation import sbi_nf_check, timed, train, train_sbi_nf_null

    args = argparse.Namespace(**{**vars(args), "num_null": NUM_NULL})  # as the source run
    args.num_eval = args.num_eval or 10_000  # sbi's default, and the source run's
    out, null = [], None
    for row in rows:
        key = (row["task"], row["estimator"], row["budget"], row["seed"])
        post = cl.as_posterior(train(*key, args.cache, 100))  # from the cache
        torch.manual_seed(0)
        with torch.no_grad():
            post.sample(data["x_o"], args.num_oracle)  # the source run's oracle draws
            drawn = post.sample(data["x"], 1)[0]
        if null is None:
            null, s_null = train_sbi_nf_null(data, post, drawn, args)
        (_, p), s_check = timed(
            lambda post=post, drawn=drawn, null=null: sbi_nf_check(data, post, drawn, null, args)
        )
        out.append({**dict(zip(KEY, key, strict=True)), "s_sbi_null": s_null, "s_sbi_nf": s_check,
                    "sbi_nf_p": p, "same_rejections": sum(
                        (a <= 0.05) == (b <= 0.05) for a, b in zip(p, row["sbi_nf_p"], strict=True)
                    )})  # fmt: skip
    return out


def report(cases: list[dict], rows: dict, args: Any) -> str:
    from examples.benchmarks.sbibm_validation import RIGHT, WRONG, spearman

    tasks = sorted({c["task"] for c in cases})
    budgets = sorted({c["budget"] for c in cases})
    kinds = sorted({c["estimator"] for c in cases})
    lines = [
        "# L-C2ST-NF classifier training on sbibm's reference posteriors",
        "",
        f"`python examples/benchmarks/lc2st_training.py`: the estimators, calibration pairs "
        f"and oracle of a `sbibm_validation.py` run (cases: `{args.source_name}`); tasks "
        f"{', '.join(tasks)}; budgets {budgets}; estimators {', '.join(kinds)}; "
        f"{len({tuple(c[k] for k in KEY) for c in cases})} estimators, 10 observations each; "
        f"{args.num_cal} calibration pairs per task; "
        + (f"{args.num_eval} evaluation points" if args.num_eval else
           "the metric's default number of evaluation points")
        + " unless a variant says otherwise; "
        f"`cl.LC2STNF` with {args.num_null} null classifiers and `classifier_kwargs` per variant "
        "(null trained once per task); "
        f"{platform.machine()}, one thread, 2 shared cores, torch {torch.__version__}. "
        "sbi: its LC2ST_NF in the `sbibm_validation.py` run (100 null classifiers), on the "
        "same cases. Spearman: within task and budget, averaged over the tasks.",
        *([f"sbi's seconds were measured in this run (`--sbi`): its null and then its checks "
           "ran in this process, before ours on each task, on the same inputs; its decisions "
           "at 0.05 agree with the source run's at "
           f"{sum(r['same_rejections'] for r in args.sbi_rows)} of {10 * len(args.sbi_rows)} "
           "observations (its null draws its normal samples from torch's global generator, "
           "whose state differs between the runs)."] if args.sbi_rows else []),
        "",
        *([args.note, ""] if args.note else []),
        "| variant | sensitivity (oracle >= 0.6) | at 10,000 sims | alarm rate (oracle <= 0.55) | "
        "Spearman, 10,000 sims | Spearman, 1,000 sims | s null (mean per task) | "
        "s check | epochs: null / check | sbi: sensitivity | at 10,000 sims | "
        "sbi: s null + check / ours |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name in dict.fromkeys(c["variant"] for c in cases):
        group = [c for c in cases if c["variant"] == name]
        hits = {k: [0, 0] for k in ("wrong", "wrong10", "right", "sbi", "sbi10")}
        for c in group:
            row = rows[(c["task"], c["estimator"], c["budget"], c["seed"])]
            for o, value in enumerate(row["oracle"]):
                if value >= WRONG:
                    for key, p in (("wrong", c["p"][o]), ("sbi", row["sbi_nf_p"][o])):
                        for k in (key, key + "10") if c["budget"] == 10_000 else (key,):
                            hits[k][0] += p <= 0.05
                            hits[k][1] += 1
                elif value <= RIGHT:
                    hits["right"][0] += c["p"][o] <= 0.05
                    hits["right"][1] += 1
        rho = {}
        for budget in (10_000, 1000):
            values = []
            for task in dict.fromkeys(c["task"] for c in group):
                sub = [c for c in group if c["task"] == task and c["budget"] == budget]
                oracle = [v for c in sub for v in rows[(c["task"], c["estimator"], c["budget"],
                                                        c["seed"])]["oracle"]]  # fmt: skip
                if len(oracle) > 2:
                    values.append(spearman(oracle, [v for c in sub for v in c["stat"]]))
            rho[budget] = f"{np.nanmean(values):.2f} ({len(values)} tasks)" if values else "-"
        s_null = np.mean(list({c["task"]: c["s_null"] for c in group}.values()))
        s_check = np.mean([c["s_check"] for c in group])
        sbi = [rows[(c["task"], c["estimator"], c["budget"], c["seed"])] for c in group]
        sbi_time = np.mean([r["s_sbi_null"] for r in sbi]) + np.mean([r["s_sbi_nf"] for r in sbi])
        cells = [f"{h / n:.2f} ({h}/{n})" if n else "-" for h, n in hits.values()]
        epochs = " / ".join(
            f"{np.mean([c[k] for c in group]):.0f}" if all(k in c for c in group) else "-"
            for k in ("null_epochs", "check_epochs")
        )
        lines.append(
            f"| {name} | {cells[0]} | {cells[1]} | {cells[2]} | {rho[10_000]} | {rho[1000]} | "
            f"{s_null:.1f} | {s_check:.2f} | {epochs} | {cells[3]} | {cells[4]} | "
            f"{sbi_time / (s_null + s_check):.0f}x |"
        )
    holm = holm_lines(cases, rows) if args.num_null >= 200 else []
    return "\n".join(lines + per_task(cases, rows) + pooled(cases, rows) + holm) + "\n"


def holm_lines(cases: list[dict], rows: dict) -> list[str]:
    """``cl.diagnose``'s reading of the local test: Holm over each estimator's 10
    observations (it needs enough null classifiers: with 100 the smallest p-value, 1/101,
    is never below 0.05 / 10)."""
    import calib_lightning as cl
    from examples.benchmarks.sbibm_validation import WRONG

    lines = ["", "Read as `cl.diagnose` reads it: Holm over each estimator's 10 observations "
             "(observations with oracle >= 0.6 rejected at 0.05).", "",
             "| variant | all budgets | 10,000 sims |", "| --- | --- | --- |"]  # fmt: skip
    for name in dict.fromkeys(c["variant"] for c in cases):
        hits = {k: [0, 0] for k in ("all", "10k")}
        for c in (c for c in cases if c["variant"] == name):
            adjusted = cl.functional.holm_adjust(torch.tensor(c["p"])).tolist()
            for value, p in zip(rows[tuple(c[k] for k in KEY)]["oracle"], adjusted,
                                strict=True):  # fmt: skip
                for k in ("all", "10k") if c["budget"] == 10_000 else ("all",):
                    hits[k][0] += value >= WRONG and p <= 0.05
                    hits[k][1] += value >= WRONG
        cells = [f"{h / n:.2f} ({h}/{n})" if n else "-" for h, n in hits.values()]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def pooled(cases: list[dict], rows: dict) -> list[str]:
    """Sensitivity of the variants run at several seeds, pooled over the seeds."""
    import re

    from examples.benchmarks.sbibm_validation import WRONG

    base = {c["variant"]: re.sub(r", seed \d+$", "", c["variant"]) for c in cases}
    seeds = {b: sum(v == b or base[v] == b for v in dict.fromkeys(base)) for b in base.values()}
    names = [b for b in dict.fromkeys(base.values()) if seeds[b] > 1]
    if not names:
        return []
    lines = ["", "Pooled over the metric seeds (observations with oracle >= 0.6 rejected).", "",
             "| variant | seeds | all budgets | 10,000 sims | SLCP 10,000 |",
             "| --- | --- | --- | --- | --- |"]  # fmt: skip
    for name in names:
        hits = {k: [0, 0] for k in ("all", "10k", "slcp")}
        for c in (c for c in cases if base[c["variant"]] == name):
            row = rows[tuple(c[k] for k in KEY)]
            for o, value in enumerate(row["oracle"]):
                if value < WRONG:
                    continue
                keys = ["all"] + (["10k"] if c["budget"] == 10_000 else [])
                keys += ["slcp"] if c["budget"] == 10_000 and c["task"] == "slcp" else []
                for k in keys:
                    hits[k][0] += c["p"][o] <= 0.05
                    hits[k][1] += 1
        cells = [f"{h / n:.2f} ({h}/{n})" if n else "-" for h, n in hits.values()]
        lines.append(f"| {name} | {seeds[name]} | " + " | ".join(cells) + " |")
    return lines


def per_task(cases: list[dict], rows: dict) -> list[str]:
    """Rejections among observations with oracle >= 0.6, per variant, task and budget."""
    from examples.benchmarks.sbibm_validation import WRONG

    groups = sorted({(c["task"], c["budget"]) for c in cases}, key=lambda g: (g[0], -g[1]))
    lines = [
        "",
        "Per task and budget: observations with oracle >= 0.6 rejected at 0.05 (sbi: its "
        "LC2ST_NF).",
        "",
        "| variant | " + " | ".join(f"{t} {b}" for t, b in groups) + " |",
        "| --- | " + " | ".join("---" for _ in groups) + " |",
    ]
    names = ["sbi LC2ST_NF", *dict.fromkeys(c["variant"] for c in cases)]
    for name in names:
        cells = []
        for group in groups:
            hit = total = 0
            first = next(c["variant"] for c in cases)
            for c in cases:
                if (c["task"], c["budget"]) != group or c["variant"] != (
                    first if name == "sbi LC2ST_NF" else name
                ):
                    continue
                row = rows[tuple(c[k] for k in KEY)]
                p = row["sbi_nf_p"] if name == "sbi LC2ST_NF" else c["p"]
                for o, value in enumerate(row["oracle"]):
                    hit += value >= WRONG and p[o] <= 0.05
                    total += value >= WRONG
            cells.append(f"{hit}/{total}" if total else "-")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", nargs="*", default=list(VARIANTS))
    parser.add_argument("--tasks", nargs="*")
    parser.add_argument("--seeds", nargs="*", type=int, default=[0], help="metric seeds")
    parser.add_argument("--note", default="", help="a paragraph for the report (the source)")
    parser.add_argument("--num-eval", type=int, help="evaluation points (default: the metric's)")
    parser.add_argument("--num-cal", type=int, default=2000, help="as sbibm_validation's")
    parser.add_argument("--source", type=Path, help="sbibm_validation's cases (jsonl)")
    parser.add_argument("--cache", type=Path, default=Path("/tmp/sbibm_validation_cache"))
    parser.add_argument("--name", default="lc2st_training", help="NAME.md and NAME.jsonl")
    parser.add_argument("--num-null", type=int, default=NUM_NULL, help="null classifiers")
    parser.add_argument("--sbi", action="store_true", help="time sbi's LC2ST_NF in this run")
    parser.add_argument("--num-oracle", type=int, default=500, help="the source run's")
    add_smoke_argument(parser)
    args = parser.parse_args()
    try:  # not a test dependency
        import sbibm  # noqa: F401
    except ImportError:
        print("sbibm is not installed: skipped (see sbibm_validation.py)")
        return
    from examples.benchmarks.sbibm_validation import task_data

    folder = output_folder(Path(__file__).parent / "results", args.smoke)
    source = args.source or Path(__file__).parent / "results" / "sbibm_validation.jsonl"
    if args.smoke and args.source is None:  # sbibm_validation's smoke: cases and cache
        import subprocess

        script = str(Path(__file__).with_name("sbibm_validation.py"))
        out = subprocess.run(
            [sys.executable, script, "--smoke"], capture_output=True, text=True, check=True
        )
        source = Path(out.stdout.strip().splitlines()[-1].split()[-1]).with_suffix(".jsonl")
    if args.smoke:
        args.cache, args.num_eval, args.num_cal = source.parent / "cache", 500, 300
        args.variants = args.variants[:2]
    args.source_name = source.name
    rows = {(r["task"], r["estimator"], r["budget"], r["seed"]): r
            for r in map(json.loads, source.read_text().splitlines())}  # fmt: skip
    path, md = folder / f"{args.name}.jsonl", folder / f"{args.name}.md"
    cases = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    done = {(c["task"], c["variant"]) for c in cases}
    timing = folder / f"{args.name}_sbi.jsonl"  # sbi's seconds measured in this run
    lines = timing.read_text().splitlines() if timing.exists() else []
    args.sbi_rows = [json.loads(line) for line in lines]
    torch.set_num_threads(1)
    from threadpoolctl import threadpool_limits

    with threadpool_limits(1):
        for task in args.tasks or dict.fromkeys(k[0] for k in rows):
            named = [
                (f"{v}, seed {s}" if s else v, v, s) for s in args.seeds for v in args.variants
            ]
            todo = [(name, v, s) for name, v, s in named if (task, name) not in done]
            timed_sbi = args.sbi and all(r["task"] != task for r in args.sbi_rows)
            if not todo and not timed_sbi:
                continue
            task_rows = [r for k, r in rows.items() if k[0] == task]
            data = task_data(task, args.num_cal, 1)  # sbibm_validation's calibration pairs
            if timed_sbi:
                new_rows = sbi_timings(data, task_rows, args)
                args.sbi_rows += new_rows
                with timing.open("a") as f:
                    f.writelines(json.dumps(r) + "\n" for r in new_rows)
                print(task, "sbi timed", flush=True)
            for name, variant, seed in todo:
                new = run_variant(data, task_rows, name, VARIANTS[variant], args, seed)
                cases += new
                with path.open("a") as f:
                    f.writelines(json.dumps(c) + "\n" for c in new)
                print(task, name, flush=True)
                md.write_text(report(cases, rows, args))
    for r in args.sbi_rows:  # sbi's seconds of this run replace the source run's
        rows[tuple(r[k] for k in KEY)].update(s_sbi_null=r["s_sbi_null"], s_sbi_nf=r["s_sbi_nf"])
    text = report(cases, rows, args)
    md.write_text(text)
    print(text)
    print(f"wrote {md}")


if __name__ == "__main__":
    main()
