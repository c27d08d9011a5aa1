"""L-C2ST-NF against sbi's ``LC2ST`` on the same estimators, repeated and interleaved.

On the estimators of ``estimator_cost.py`` (sbi 0.27 ``FMPE`` and ``NPSE`` trained
briefly, optionally zuko ``CNF`` and ``NSF`` untrained) at D = 2 and 10, with ``N``
fresh pairs, each side is timed ``--repeats`` times in turn and the fastest run kept, in
wall and in CPU seconds of this process (torch and BLAS held to one thread for both
libraries):

* ours: a fresh ``cl.LC2STNF`` at one observation with ``M`` evaluation points,
  ``update`` (the latents: an inverse ODE solve on the vector-field estimators) then
  ``compute`` (its null of 100 classifiers, trained once, and the check's classifier),
  split into latents, null and check; and a later check of the same metric (``reset``,
  ``update``, ``compute``: the null is reused);
* sbi: ``LC2ST`` as in ``estimator_cost.py`` (one posterior draw per pair,
  ``train_on_observed_data``, ``train_under_null_hypothesis`` with its 100 null trials,
  ``p_value`` on ``M`` draws at the observation).

Ratios above 1: ours is faster.

Run: python examples/benchmarks/lc2st_speed.py [--pairs 1000] [--draws 20] [--repeats 3]
[--estimators FMPE NPSE] (``--smoke``: D = 2, N = 20, M = 10, one repeat, the table in a
temporary folder)
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

if not __package__:  # run as a file (python examples/x.py): make `examples` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
from threadpoolctl import threadpool_limits

import calib_lightning as cl
from calib_lightning.tasks import GaussianToy
from examples._smoke import add_smoke_argument, output_folder
from examples.benchmarks.estimator_cost import estimators, sbi_lc2st

RESULTS = Path(__file__).resolve().parent / "results"
PARTS = ("latents", "null", "check", "LC2STNF", "later check", "sbi LC2ST")
warnings.filterwarnings("ignore")


def clock() -> torch.Tensor:
    """Wall and CPU seconds of this process, ``(2,)``."""
    return torch.tensor([time.perf_counter(), time.process_time()], dtype=torch.float64)


def ours(post: Any, theta: torch.Tensor, x: torch.Tensor, draws: int) -> dict[str, torch.Tensor]:
    """Wall and CPU seconds ``(2,)`` of a first check (latents, null, check) and of a later
    one."""
    metric = cl.LC2STNF(observations=x[:1], num_posterior_samples=draws)
    start = clock()
    metric.update(post, theta, x)
    latents = clock()
    metric.null.fit(torch.cat(metric.x), theta.shape[1])
    null = clock()
    metric.compute()
    end = clock()
    metric.reset()
    metric.update(post, theta, x)
    metric.compute()
    later = clock() - end
    return {"latents": latents - start, "null": null - latents, "check": end - null,
            "LC2STNF": end - start, "later check": later}  # fmt: skip


def machine() -> str:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=Path(__file__).parent).stdout.strip()  # fmt: skip
    return (f"commit {commit or 'unknown'}, {platform.machine()}, {os.cpu_count()} cores "
            f"shared with other jobs (load average {os.getloadavg()[0]:.1f} at the end), "
            f"torch {torch.__version__}, torch and BLAS held to one thread, "
            f"{time.strftime('%Y-%m-%d')}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pairs", type=int, default=1000)
    parser.add_argument("--draws", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dims", type=int, nargs="+", default=[2, 10])
    parser.add_argument("--estimators", nargs="+", default=["FMPE", "NPSE"],
                        choices=["FMPE", "NPSE", "CNF", "NSF"])  # fmt: skip
    parser.add_argument("--output", default="lc2st_speed.md")
    add_smoke_argument(parser)
    args = parser.parse_args()
    if args.smoke:
        args.pairs, args.draws, args.repeats, args.dims = 20, 10, 1, [2]
    torch.set_num_threads(1)
    results = output_folder(RESULTS, args.smoke) / args.output
    rows = []
    with threadpool_limits(1):  # scikit-learn's BLAS too (sbi's classifiers)
        run(args, results, rows)
    print("wrote", results)


def run(args: Any, results: Path, rows: list) -> None:
    """Time both sides on every estimator and dimension, rewriting the table after each."""
    for dim in args.dims:
        theta, x = GaussianToy(dim=dim).sample(args.pairs, torch.Generator().manual_seed(1))
        for name, (posterior, sbi_posterior) in estimators(dim, args.smoke).items():
            if name.split()[1] not in args.estimators:
                continue
            post = cl.as_posterior(posterior)
            best = {part: torch.full((2,), float("inf"), dtype=torch.float64) for part in PARTS}
            for _ in range(args.repeats):  # ours and sbi's in turn
                torch.manual_seed(2)
                times = ours(post, theta, x, args.draws)
                torch.manual_seed(2)
                start = clock()
                sbi_lc2st(sbi_posterior, theta, x, args.draws)
                times["sbi LC2ST"] = clock() - start
                best = {part: torch.minimum(best[part], times[part]) for part in PARTS}
            wall = {part: float(best[part][0]) for part in PARTS}
            cpu = {part: float(best[part][1]) for part in PARTS}
            for clock_name, seconds in (("", wall), (" CPU", cpu)):
                print(f"  {name} D={dim}{clock_name}: "
                      + ", ".join(f"{k} {v:.2f} s" for k, v in seconds.items()), flush=True)
            rows.append((name, dim, (wall, cpu)))
            write(results, rows, args)  # after each estimator: a long run keeps its rows


def write(results: Path, rows: list, args: Any) -> None:
    command = (f"examples/benchmarks/lc2st_speed.py --pairs {args.pairs} --draws {args.draws} "
               f"--repeats {args.repeats} --dims {' '.join(map(str, args.dims))} "
               f"--estimators {' '.join(args.estimators)}")  # fmt: skip
    lines = [
        "# L-C2ST-NF against sbi's LC2ST, repeated and interleaved",
        "",
        f"Written by `{command}`: N = {args.pairs} pairs, M = {args.draws} evaluation points "
        f"(ours) and draws at the observation (sbi's), the fastest of {args.repeats} runs of "
        "each, ours and sbi's in turn. Ours: a fresh `cl.LC2STNF` (latents, its null of 100 "
        "classifiers, the check's classifier; `LC2STNF` is their sum) and a later check "
        "reusing the null. Ratios above 1: ours is faster. Each part is the fastest of its "
        f"own runs, so the parts need not add up to the total. Machine: {machine()}.",
    ]
    for index, clock_name in enumerate(("Wall", "CPU")):
        lines += [
            "",
            f"{clock_name} seconds:",
            "",
            "| estimator | D | latents | null | check | LC2STNF | later check | sbi LC2ST | "
            "sbi LC2ST / LC2STNF | sbi LC2ST / later check |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for name, dim, both in rows:
            b = both[index]
            cells = " | ".join(f"{b[part]:.2f}" for part in PARTS)
            lines.append(f"| {name} | {dim} | {cells} | {b['sbi LC2ST'] / b['LC2STNF']:.1f} | "
                         f"{b['sbi LC2ST'] / b['later check']:.1f} |")  # fmt: skip
    results.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
