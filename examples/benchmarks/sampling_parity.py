"""The sampling checks against sbi's on the same estimators, repeated and interleaved.

``estimator_cost.py`` times each check once; on a shared machine one timing moves by a
factor of two or three with the load. Here only the checks that cost a sampling pass are
timed, ours and sbi's in turn, ``--repeats`` times each: ``RankCalibration`` against
``run_sbc`` and ``TARP`` against ``run_tarp``, ``M`` draws for each of ``N`` pairs, on
the estimators of
``estimator_cost.py`` (sbi 0.27 ``FMPE`` and ``NPSE`` trained briefly, zuko ``CNF`` and
``NSF`` untrained) at D = 2 and 10. On the ODE estimators our rank check ranks jointly
by distance (``joint="auto"``), so both sides pay one sampling pass.

Repeat ``r`` seeds torch with ``r`` before every check, so both sides draw with the same
seeds; each check's time is its mean over the repeats and the ratio is that of the means.
Beside it, the paired ratio: the geometric mean over repeats of ours / sbi's on the same
seed, with a 95 % t-interval (on the log-ratios): an interval wholly above 1 is a check
measurably slower than sbi's, one containing 1 a difference within the noise.
The mean over seeds, not the fastest run: the ODE solver of FMPE and NPSE adapts its
steps to the draws, so one call's time depends on its seed (``post.sample(x, 20)`` of
the FMPE at D = 10, N = 1,000: 5.4-6.8 s over 4 seeds), and the two libraries turn one
seed into different draws; the fastest of a few runs on one seed compares two draws'
step counts, not two implementations.

Run: python examples/benchmarks/sampling_parity.py [--pairs 1000] [--draws 20] [--repeats 5]
(``--smoke``: D = 2, N = 20, M = 10, one repeat, the table in a temporary folder)
"""

from __future__ import annotations

import argparse
import math
import statistics
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
from examples.benchmarks.estimator_cost import estimators, record

RESULTS = Path(__file__).resolve().parent / "results"
warnings.filterwarnings("ignore")


def checks(post: Any, sbi_posterior: Any, theta: torch.Tensor, x: torch.Tensor,
           draws: int) -> dict[str, Any]:  # fmt: skip
    """name -> a function running one check once."""
    from sbi.diagnostics import run_sbc, run_tarp

    def ours(metric: Any) -> Any:
        metric.update(post, theta, x)
        return metric.compute()

    return {
        "ranks": lambda: ours(cl.RankCalibration(draws)),
        "run_sbc": lambda: run_sbc(theta, x, sbi_posterior, draws, show_progress_bar=False),
        "TARP": lambda: ours(cl.TARP(draws)),
        "run_tarp": lambda: run_tarp(theta, x, sbi_posterior, num_posterior_samples=draws,
                                     show_progress_bar=False),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pairs", type=int, default=1000)
    parser.add_argument("--draws", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dims", type=int, nargs="+", default=[2, 10])
    add_smoke_argument(parser)
    args = parser.parse_args()
    if args.smoke:
        args.pairs, args.draws, args.repeats, args.dims = 20, 10, 1, [2]
    torch.set_num_threads(1)
    results = output_folder(RESULTS, args.smoke) / "sampling_parity.md"
    rows = []
    for dim in args.dims:
        theta, x = GaussianToy(dim=dim).sample(args.pairs, torch.Generator().manual_seed(1))
        for name, (posterior, sbi_posterior) in estimators(dim, args.smoke).items():
            runs = checks(cl.as_posterior(posterior), sbi_posterior, theta, x, args.draws)
            times: dict[str, list[float]] = {check: [] for check in runs}
            for repeat in range(args.repeats):
                for check, run in runs.items():  # ours and sbi's in turn, the same seed
                    torch.manual_seed(repeat)
                    start = time.perf_counter()
                    run()
                    times[check].append(time.perf_counter() - start)
            mean = {check: statistics.fmean(seconds) for check, seconds in times.items()}
            mean |= {f"{a} paired": paired(times[a], times[b]) for a, b in PAIRS}
            record(rows, name, dim, mean, lambda: write(results, rows, args))
    print("wrote", results)


#: (ours, sbi's) checks compared
PAIRS = (("ranks", "run_sbc"), ("TARP", "run_tarp"))


def paired(ours: list[float], theirs: list[float]) -> tuple[float, float, float]:
    """Geometric mean of ``ours / theirs`` over paired repeats and its 95 % t-interval
    (NaN bounds with one repeat: no interval)."""
    from scipy.stats import t

    logs = [math.log(a / b) for a, b in zip(ours, theirs, strict=True)]
    centre = statistics.fmean(logs)
    if len(logs) < 2:
        return math.exp(centre), math.nan, math.nan
    half = t.ppf(0.975, len(logs) - 1) * statistics.stdev(logs) / math.sqrt(len(logs))
    return math.exp(centre), math.exp(centre - half), math.exp(centre + half)


def write(results: Path, rows: list, args: Any) -> None:
    lines = [
        "# The sampling checks against sbi's, repeated and interleaved",
        "",
        f"Written by `examples/benchmarks/sampling_parity.py --pairs {args.pairs} --draws "
        f"{args.draws} --repeats {args.repeats}`: N = {args.pairs} pairs, M = {args.draws} "
        f"draws per pair, mean seconds over {args.repeats} runs of each check (run r "
        "seeded r on both sides), ours and sbi's in turn (one torch thread, 2-core machine "
        "shared with other jobs). Ratios below 1: ours is faster.",
        "",
        "| estimator | D | ranks | sbi run_sbc | ranks / run_sbc | paired (95 % interval) | "
        "TARP | sbi run_tarp | TARP / run_tarp | paired (95 % interval) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    slower = []
    for name, dim, b in rows:
        cells = []
        for a, c in PAIRS:
            centre, low, high = b[f"{a} paired"]
            cells.append(f"{b[a]:.2f} | {b[c]:.2f} | {b[a] / b[c]:.2f} | "
                         f"{centre:.3f} ({low:.3f}-{high:.3f})")  # fmt: skip
            if low > 1:  # (False for NaN: one repeat says nothing)
                slower.append(f"{a} on {name} at D = {dim}")
        lines.append(f"| {name} | {dim} | " + " | ".join(cells) + " |")
    lines += ["", f"Measurably slower than sbi's (paired interval over {args.repeats} repeats "
              "wholly above 1): "
              + (", ".join(slower) or "none") + "."]  # fmt: skip
    results.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
