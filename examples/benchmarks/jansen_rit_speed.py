"""Simulations per second of ``calib_lightning.tasks.JansenRit`` on one CPU thread.

Each batch size ``B`` (one chunk: ``chunk_size = B``) simulates ``B`` draws from the
prior (10,232 Strang steps of 1/1024 s: 2 s of burn-in and 8 s kept, float64, with the
33-feature log-PSD), timed ``--repeats`` times, the fastest kept. The time of 50,000
simulations is extrapolated from the best rate (the cost is linear in the number of
chunks); ``--full`` also simulates the 50,000 and times them.

Run: python examples/benchmarks/jansen_rit_speed.py [--batches 256 1024 4096]
[--repeats 2] [--full] (``--smoke``: B = 4, one repeat, the table in a temporary folder)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

if not __package__:  # run as a file (python examples/x.py): make `examples` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch

from calib_lightning.tasks import JansenRit
from examples._smoke import add_smoke_argument, output_folder
from examples.benchmarks.jansen_rit import machine

RESULTS = Path(__file__).resolve().parent / "results"


def seconds(task: JansenRit, batch: int, repeats: int) -> float:
    """Fastest wall seconds of ``repeats`` simulations of ``batch`` prior draws."""
    gen = torch.Generator().manual_seed(0)
    theta = task.sample_prior(batch, gen)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        task.simulate(theta, gen)
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--full", action="store_true", help="also time 50,000 simulations")
    add_smoke_argument(parser)
    args = parser.parse_args()
    if args.smoke:
        args.batches, args.repeats, args.full = [4], 1, False
    torch.set_num_threads(1)
    results = output_folder(RESULTS, args.smoke) / "jansen_rit_speed.md"
    rows, rates = [], []
    for batch in args.batches:
        time_s = seconds(JansenRit(chunk_size=batch), batch, args.repeats)
        rates.append(batch / time_s)
        rows.append(
            f"| {batch} | {time_s:.2f} | {batch / time_s:.0f} "
            f"| {50_000 * time_s / batch / 60:.1f} |"
        )
        print(rows[-1], flush=True)
    best = max(range(len(rates)), key=rates.__getitem__)
    lines = [
        "# Jansen-Rit simulator speed",
        "",
        f"{machine('')}. Command: `python examples/benchmarks/jansen_rit_speed.py"
        f"{' --full' if args.full else ''}`.",
        "",
        "One chunk of B prior draws: 10,232 Strang steps of 1/1024 s (2 s burn-in + 8 s, "
        "float64, noise drawn in blocks of 256 steps) and the 33-feature log-PSD; fastest of "
        f"{args.repeats}. The last column is extrapolated: 50,000 / B chunks of that time.",
        "",
        "| B | seconds | simulations / s | 50,000 simulations (min, extrapolated) |",
        "| --- | --- | --- | --- |",
        *rows,
        "",
        f"Best: B = {args.batches[best]}, {rates[best]:.0f} simulations per second on one "
        f"thread, 50,000 in about {50_000 / rates[best] / 60:.1f} minutes (extrapolated).",
    ]
    if args.full:
        task = JansenRit(chunk_size=args.batches[best])
        gen = torch.Generator().manual_seed(1)
        theta = task.sample_prior(50_000, gen)
        start = time.perf_counter()
        task.simulate(theta, gen)
        lines.append(
            f"Measured: 50,000 simulations in {(time.perf_counter() - start) / 60:.1f} minutes."
        )
    results.write_text("\n".join(lines) + "\n")
    print("wrote", results)


if __name__ == "__main__":
    main()
