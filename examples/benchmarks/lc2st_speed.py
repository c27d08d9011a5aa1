"""L-C2ST-NF against sbi's ``LC2ST`` on the same estimators, repeated and interleaved.

On the estimators of ``estimator_cost.py`` (sbi 0.27 ``FMPE`` and ``NPSE`` trained
briefly, optionally zuko ``CNF`` and ``NSF`` untrained) at D = 2 and 10, with ``N``
fresh pairs, each side is timed ``--repeats`` times in turn and the fastest run kept
(one torch thread):

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

import calib_lightning as cl
from calib_lightning.tasks import GaussianToy
from examples._smoke import add_smoke_argument, output_folder
from examples.benchmarks.estimator_cost import estimators, record, sbi_lc2st

RESULTS = Path(__file__).resolve().parent / "results"
PARTS = ("latents", "null", "check", "LC2STNF", "later check", "sbi LC2ST")
warnings.filterwarnings("ignore")


def ours(post: Any, theta: torch.Tensor, x: torch.Tensor, draws: int) -> dict[str, float]:
    """Seconds of a first check (latents, null, check) and of a later one."""
    metric = cl.LC2STNF(observations=x[:1], num_posterior_samples=draws)
    start = time.perf_counter()
    metric.update(post, theta, x)
    latents = time.perf_counter()
    metric.null.fit(torch.cat(metric.x), theta.shape[1])
    null = time.perf_counter()
    metric.compute()
    end = time.perf_counter()
    metric.reset()
    metric.update(post, theta, x)
    metric.compute()
    later = time.perf_counter() - end
    return {"latents": latents - start, "null": null - latents, "check": end - null,
            "LC2STNF": end - start, "later check": later}  # fmt: skip


def machine() -> str:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=Path(__file__).parent).stdout.strip()  # fmt: skip
    return (f"commit {commit or 'unknown'}, {platform.machine()}, {os.cpu_count()} cores "
            f"shared with other jobs (load average {os.getloadavg()[0]:.1f} at the end), "
            f"torch {torch.__version__}, one torch thread")  # fmt: skip


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
    for dim in args.dims:
        theta, x = GaussianToy(dim=dim).sample(args.pairs, torch.Generator().manual_seed(1))
        for name, (posterior, sbi_posterior) in estimators(dim, args.smoke).items():
            if name.split()[1] not in args.estimators:
                continue
            post, best = cl.as_posterior(posterior), dict.fromkeys(PARTS, float("inf"))
            for _ in range(args.repeats):  # ours and sbi's in turn
                torch.manual_seed(2)
                times = ours(post, theta, x, args.draws)
                torch.manual_seed(2)
                start = time.perf_counter()
                sbi_lc2st(sbi_posterior, theta, x, args.draws)
                times["sbi LC2ST"] = time.perf_counter() - start
                best = {part: min(best[part], times[part]) for part in PARTS}
            record(rows, name, dim, best, lambda: write(results, rows, args))
    print("wrote", results)


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
        "",
        "| estimator | D | latents | null | check | LC2STNF | later check | sbi LC2ST | "
        "sbi LC2ST / LC2STNF | sbi LC2ST / later check |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, dim, b in rows:
        cells = " | ".join(f"{b[part]:.2f}" for part in PARTS)
        lines.append(f"| {name} | {dim} | {cells} | {b['sbi LC2ST'] / b['LC2STNF']:.1f} | "
                     f"{b['sbi LC2ST'] / b['later check']:.1f} |")  # fmt: skip
    results.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
