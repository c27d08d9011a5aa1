"""Same data, same verdict? The p-value of each randomized check over seeds, on fixed data.

A check with internal randomness (TARP's reference points, the joint classifier's split
and initialization, KCCSD's base points and bootstrap, the local tests' classifiers) is
valid for every seed, but a user who reruns it with another seed should not see
"not rejected" turn into "rejected". For each case below, ONE calibration set (pairs and
the posterior draws every sampling check shares) is drawn and kept; each check is then
run with ``--seeds`` seeds as ``cl.diagnose`` runs it, and the table gives the 5-95 %
range of its p-value over the seeds and the decision agreement (the share of seeds that
agree with the majority decision at level 0.05). Beside it, ``--power-datasets`` fresh
calibration sets (the check at its default seed) give the check's power at that case,
so that agreement can be read against it: where the power is below 0.1 or above 0.9 the
decision should not depend on the seed.

Cases (the NPT Gaussian problem, :class:`calib_lightning.tasks.NPTGaussian`, ``D = 3``,
``N`` pairs, ``M`` posterior draws per pair, 3 observations for the local tests):

* ``exact``: the exact posterior;
* ``over-confident``: the exact mean, covariance x ``--overconfident`` (0.85);
* ``biased``: the mean x (1 + ``--shift``) (0.08), the NPT suite's mean shift;
* ``extra mode``: a reflected mode of weight ``--extra`` (0.08), the NPT suite's extra
  mode (a mixture: no latents, so L-C2ST runs where L-C2ST-NF cannot).

Checks and how each is called (the calls ``cl.diagnose`` makes, with the seed varied):
``tarp`` ``functional.tarp(samples, theta, generator=Generator(seed))``;
``joint_c2st`` ``metrics.joint_c2st.joint_c2st(theta, x, samples, seed=seed)``;
``kccsd`` ``KCCSD(seed=seed)``; ``lc2st_nf`` ``LC2STNF(observations, seed=seed,
num_null=local_num_null(3, 0.05))`` (global p-value); ``lc2st`` the same with ``LC2ST``;
``diagnose`` the overall p-value of ``cl.diagnose(..., seed=seed)`` without observations
(KCCSD, ranks, TARP, joint classifier; its posterior draws change with the seed too).

    python examples/benchmarks/seed_stability.py --name seed_stability_before
    python examples/benchmarks/seed_stability.py --smoke
    python examples/benchmarks/seed_stability.py --compare BEFORE.json AFTER.json

Writes ``examples/benchmarks/results/NAME.md`` and ``NAME.json`` (every p-value);
``--compare`` writes ``seed_stability.md``: both runs side by side, a check the second run
did not repeat (its code unchanged) shown with the first run's numbers, and the goals:
decision agreement >= 0.9 wherever the power is below 0.1 or above 0.9.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import time
from pathlib import Path
from typing import Any

import torch

import calib_lightning as cl
from calib_lightning.diagnosis.checks import local_num_null
from calib_lightning.functional.tarp import tarp
from calib_lightning.metrics.joint_c2st import joint_c2st
from calib_lightning.tasks import NPTGaussian

LEVEL = 0.05
RESULTS = Path(__file__).parent / "results"
CHECKS = ("tarp", "joint_c2st", "kccsd", "lc2st_nf", "lc2st", "diagnose")


def cases(task: NPTGaussian, args: argparse.Namespace) -> dict[str, tuple[Any, Any]]:
    """``name -> (truth, estimate)``."""
    exact = task.case("mean_shift", 0.0)[0]
    return {
        "exact": (exact, exact),
        "over-confident": (exact, task._gaussian(covariance_factor=args.overconfident)),
        "biased": task.case("mean_shift", args.shift),
        "extra mode": task.case("extra_mode", args.extra),
    }


def dataset(task: NPTGaussian, truth: Any, estimate: Any, args: argparse.Namespace,
            seed: int) -> dict[str, Any]:  # fmt: skip
    """Pairs, observations and ``M`` shared posterior draws, all from ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    theta, x = task.sample(args.n, truth, generator)
    observations = task.sample_x(3, generator)
    with torch.random.fork_rng():
        torch.manual_seed(seed + 1)
        samples = estimate(x).sample((args.draws,))
    return {"theta": theta, "x": x, "observations": observations, "samples": samples,
            "posterior": estimate}  # fmt: skip


def run_check(name: str, data: dict[str, Any], seed: int, args: argparse.Namespace) -> float:
    """The check's verdict p-value on ``data`` with ``seed``."""
    theta, x, samples, post = data["theta"], data["x"], data["samples"], data["posterior"]
    obs = data["observations"]
    with torch.random.fork_rng():
        torch.manual_seed(10_000 + seed)  # checks that draw from the global generator
        if name == "tarp":
            generator = torch.Generator().manual_seed(seed)
            return float(tarp(samples, theta, generator=generator).p_value)
        if name == "joint_c2st":
            return float(joint_c2st(theta, x, samples, seed=seed).p_value)
        if name == "kccsd":
            metric = cl.KCCSD(seed=seed)
            metric.update(post, theta, x)
            return float(metric.compute().p_value)
        if name in ("lc2st_nf", "lc2st"):
            cls = cl.LC2STNF if name == "lc2st_nf" else cl.LC2ST
            num_null = args.local_num_null or local_num_null(obs.shape[0], LEVEL)
            metric = cls(observations=obs, seed=seed, level=LEVEL, num_null=num_null)
            metric.update(post, theta, x)
            return float(metric.compute().global_p_value)
        if name == "diagnose":
            report = cl.diagnose(post, theta, x, checks=("kccsd", "ranks", "tarp", "joint_c2st"),
                                 seed=seed, num_posterior_samples=args.draws)  # fmt: skip
            return float(report.overall_p_value)
    raise ValueError(name)


def applies(check: str, case: str) -> bool:
    return not (check == "lc2st_nf" and case == "extra mode")


def summarize(p: list[float]) -> dict[str, float]:
    values = torch.tensor(p, dtype=torch.float64)
    rejected = float((values < LEVEL).double().mean())
    low, median, high = torch.quantile(values, torch.tensor([0.05, 0.5, 0.95], dtype=torch.float64))
    return {"low": float(low), "median": float(median), "high": float(high),
            "rejected": rejected, "agreement": max(rejected, 1 - rejected)}  # fmt: skip


def fmt(p: float) -> str:
    return f"{p:.2g}" if p >= 1e-3 else f"{p:.1e}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=1000)
    parser.add_argument("--draws", type=int, default=100)
    parser.add_argument("--seeds", type=int, default=50)
    parser.add_argument("--power-datasets", type=int, default=50)
    parser.add_argument("--overconfident", type=float, default=0.85)
    parser.add_argument("--shift", type=float, default=0.08)
    parser.add_argument("--extra", type=float, default=0.08)
    parser.add_argument("--checks", nargs="+", default=list(CHECKS), choices=CHECKS)
    parser.add_argument("--cases", nargs="+", default=None)
    parser.add_argument("--data-seed", type=int, default=2026)
    parser.add_argument("--name", default="seed_stability")
    parser.add_argument("--local-num-null", type=int, default=None,
                        help="null classifiers of the local tests (default: as diagnose)")
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--level", type=int, default=0, metavar="DATASETS",
                        help="only the level: the checks at the default seed on DATASETS "
                        "fresh sets of the exact posterior; writes NAME.md")  # fmt: skip
    parser.add_argument("--compare", nargs=2, type=Path, default=None,
                        metavar=("BEFORE", "AFTER"))  # fmt: skip
    args = parser.parse_args()
    if args.compare is not None:
        (RESULTS / "seed_stability.md").write_text(comparison(*args.compare))
        return
    if args.level:
        level(args)
        return
    if args.smoke:
        args.n, args.draws, args.seeds, args.power_datasets = 100, 20, 2, 1
        args.cases, args.local_num_null = ["exact", "extra mode"], 10
    torch.set_num_threads(1)
    task = NPTGaussian(dim=3)
    all_cases = cases(task, args)
    names = args.cases or list(all_cases)
    out: dict[str, Any] = {"args": vars(args), "cases": {}}
    start = time.perf_counter()
    for case in names:
        truth, estimate = all_cases[case]
        fixed = dataset(task, truth, estimate, args, args.data_seed)
        results = out["cases"].setdefault(case, {})
        for check in (c for c in args.checks if applies(c, case)):
            t0 = time.perf_counter()
            seeds = [run_check(check, fixed, s, args) for s in range(args.seeds)]
            fresh = [run_check(check, dataset(task, truth, estimate, args, 100 + k), 0, args)
                     for k in range(args.power_datasets)]  # fmt: skip
            results[check] = {"seeds": seeds, "fresh": fresh,
                              "seconds": time.perf_counter() - t0}  # fmt: skip
            s = summarize(seeds)
            power = summarize(fresh)["rejected"] if fresh else float("nan")
            print(f"{case:15s} {check:11s} p 5-95% {fmt(s['low'])}..{fmt(s['high'])} "
                  f"agreement {s['agreement']:.2f} power {power:.2f} "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)  # fmt: skip
    out["seconds"] = time.perf_counter() - start
    if args.smoke:
        return
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.name}.json").write_text(json.dumps(out))
    (RESULTS / f"{args.name}.md").write_text(table(out, args))


def table(out: dict[str, Any], args: argparse.Namespace) -> str:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, check=False).stdout.strip()  # fmt: skip
    lines = [
        f"# Seed stability: {args.name}", "",
        f"Written by `python examples/benchmarks/seed_stability.py --name {args.name}` at "
        f"commit {commit} ({platform.processor() or platform.machine()}, one thread, "
        f"{out['seconds'] / 60:.0f} min). NPT Gaussian D = 3, N = {args.n} pairs, "
        f"M = {args.draws} shared posterior draws, 3 observations; {args.seeds} seeds on "
        f"one fixed calibration set per case, {args.power_datasets} fresh sets (default "
        "seed) for the power. Agreement: share of seeds with the majority decision at 0.05.",
        "", "| case | check | p 5 % | p median | p 95 % | rejected over seeds | agreement "
        "| power (fresh sets) |", "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]  # fmt: skip
    for case, checks in out["cases"].items():
        for check, res in checks.items():
            s = summarize(res["seeds"])
            power = summarize(res["fresh"])["rejected"] if res["fresh"] else float("nan")
            lines.append(f"| {case} | {check} | {fmt(s['low'])} | {fmt(s['median'])} | "
                         f"{fmt(s['high'])} | {s['rejected']:.2f} | {s['agreement']:.2f} | "
                         f"{power:.2f} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def level(args: argparse.Namespace) -> None:
    """``--level``: the rejection rate of each check on fresh exact-posterior sets, with
    its 99 % binomial band (the power column's ``exact`` row has 50 sets only)."""
    from scipy import stats

    torch.set_num_threads(1)
    task = NPTGaussian(dim=3)
    truth, estimate = cases(task, args)["exact"]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, check=False).stdout.strip()  # fmt: skip
    start, rows = time.perf_counter(), []
    for check in args.checks:
        p = torch.tensor([run_check(check, dataset(task, truth, estimate, args, 10_000 + k), 0,
                                    args) for k in range(args.level)])  # fmt: skip
        low, high = stats.binom.ppf([0.005, 0.995], args.level, LEVEL) / args.level
        rate = float((p < LEVEL).double().mean())
        rows.append(f"| {check} | {args.level} | {rate:.3f} | [{low:.3f}, {high:.3f}] | "
                    f"{stats.kstest(p.numpy(), 'uniform').pvalue:.2g} |")  # fmt: skip
        print(rows[-1], flush=True)
    text = "\n".join([
        f"# Level of the randomized checks: {args.name}", "",
        f"Written by `python examples/benchmarks/seed_stability.py --level {args.level} "
        f"--checks {' '.join(args.checks)} --name {args.name}` at commit {commit} (one "
        f"thread, {(time.perf_counter() - start) / 60:.0f} min): NPT Gaussian D = 3, "
        f"N = {args.n}, M = {args.draws}, the exact posterior, a fresh set each, default "
        "seed.", "", "| check | datasets | rejection rate at 0.05 | 99 % band | KS p |",
        "| --- | --- | --- | --- | --- |", *rows, "",
    ])  # fmt: skip
    if not args.smoke:
        (RESULTS / f"{args.name}.md").write_text(text)


def comparison(before_path: Path, after_path: Path) -> str:
    """The before/after table (``--compare``)."""
    before, after = (json.loads(p.read_text()) for p in (before_path, after_path))
    lines = [
        "# Seed stability: the same data, the same verdict?", "",
        f"`python examples/benchmarks/seed_stability.py --compare {before_path.name} "
        f"{after_path.name}`: the runs [{before_path.stem}]({before_path.stem}.md) (before "
        f"issue 42) and [{after_path.stem}]({after_path.stem}.md) (after), each with its "
        "command, commit and machine. One fixed calibration set per case (NPT Gaussian "
        f"D = 3, N = {after['args']['n']}, M = {after['args']['draws']} shared draws), "
        f"{after['args']['seeds']} seeds each; power on {after['args']['power_datasets']} "
        "fresh sets at the default seed (at `exact` it is the level, with its binomial "
        "noise: 50 sets). Agreement: share of seeds with the majority decision at 0.05. "
        "Goal: agreement >= 0.9 wherever the power is below 0.1 or above 0.9. A check the "
        "second run did not repeat, its code unchanged, shows the first run's numbers "
        "(marked `=`).", "",
        "| case | check | p 5-95 % before | p 5-95 % after | agreement before | agreement "
        "after | power before | power after | goal |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]  # fmt: skip
    for case, checks in before["cases"].items():
        for check, old in checks.items():
            new = after["cases"].get(case, {}).get(check)
            same = new is None
            new = old if same else new
            s0, s1 = summarize(old["seeds"]), summarize(new["seeds"])
            p0, p1 = (summarize(r["fresh"])["rejected"] for r in (old, new))
            applies = p1 < 0.1 or p1 > 0.9
            goal = ("met" if s1["agreement"] >= 0.9 else "MISSED") if applies else "-"
            mark = " =" if same else ""
            lines.append(f"| {case} | {check} | {fmt(s0['low'])}..{fmt(s0['high'])} | "
                         f"{fmt(s1['low'])}..{fmt(s1['high'])}{mark} | {s0['agreement']:.2f} | "
                         f"{s1['agreement']:.2f}{mark} | {p0:.2f} | {p1:.2f}{mark} | {goal} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
