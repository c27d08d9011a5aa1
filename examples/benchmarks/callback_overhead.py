"""Overhead of the calibration callbacks in the two NPE examples, per check.

Trains each example's model for a few epochs with every callback checking after
every epoch, and reports, per callback, the median wall time of one check and its
ratio to the median epoch without checks (training and validation). Both numbers
come from the same run, so the ratio is meaningful on a shared machine where
absolute times drift. Writes ``examples/benchmarks/results/callback_overhead.md``.

Run: python examples/benchmarks/callback_overhead.py [--epochs 6]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import platform
import statistics
import sys
import tempfile
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from calib_lightning.tasks import SLCP, TwoMoons

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "callback_overhead.md"


def load_example(name: str):
    spec = importlib.util.spec_from_file_location(name, HERE.parent / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def two_moons_setup(example, theta, x):
    return example.NPE(2, 2, epochs=100)


def slcp_setup(example, theta, x):
    low, high = SLCP.prior_bounds
    flow = example.masked_autoregressive_flow(5, x.mean(0), x.std(0), torch.full((5,), low),
                                              torch.full((5,), high))
    return example.NPE(flow, epochs=100)


def measure(example_name, task, setup, epochs, num_simulations, num_calibration, log_dir):
    example = load_example(example_name)
    L.seed_everything(0, verbose=False)
    generator = torch.Generator().manual_seed(0)
    theta, x = task.sample(num_simulations, generator)
    theta_val, x_val = task.sample(2_000, generator)
    theta_cal, x_cal = task.sample(num_calibration, generator)
    checks = example.calibration_callbacks(theta_cal, x_cal, every_n_epochs=1)
    timer = example.EpochTimer()
    trainer = L.Trainer(
        max_epochs=epochs, accelerator="cpu",
        logger=L.pytorch.loggers.TensorBoardLogger(log_dir, name=example_name),
        callbacks=[*checks, timer], enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer.fit(
        setup(example, theta, x),
        DataLoader(TensorDataset(theta, x), batch_size=256, shuffle=True),
        DataLoader(TensorDataset(theta_val, x_val), batch_size=2_000),
    )
    # the first epoch and check pay one-off costs (allocations, matplotlib fonts)
    epoch_seconds = [
        seconds - sum(c.seconds[epoch] for c in checks)
        for epoch, seconds in enumerate(timer.seconds)
    ][1:]
    epoch = statistics.median(epoch_seconds)
    rows = []
    for check in checks:
        seconds = statistics.median(check.seconds[1:])
        rows.append((example_name, check.tag_name, len(check.seconds) - 1, seconds, epoch,
                     seconds / epoch, check.seconds[0]))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--num-simulations", type=int, default=20_000)
    parser.add_argument("--num-calibration", type=int, default=1_000)
    args = parser.parse_args()
    load_before = os.getloadavg()[0]
    rows = []
    with tempfile.TemporaryDirectory() as log_dir:  # figures are written, then dropped
        for name, task, setup in (("npe_two_moons", TwoMoons(), two_moons_setup),
                                  ("npe_slcp_nflows", SLCP(), slcp_setup)):
            rows += measure(name, task, setup, args.epochs, args.num_simulations,
                            args.num_calibration, log_dir)
    load_after = os.getloadavg()[0]
    lines = [
        "# Calibration callback overhead per check",
        "",
        f"`python examples/benchmarks/callback_overhead.py --epochs {args.epochs}`: "
        f"{args.num_simulations} training pairs (batch 256), {args.num_calibration} calibration "
        "pairs, 2,000 validation pairs, a check after every epoch; medians over epochs 2.."
        f"{args.epochs}. Machine: {os.cpu_count()} CPU cores, torch {torch.__version__} with "
        f"{torch.get_num_threads()} threads, {platform.processor() or platform.machine()}; "
        f"load average {load_before:.1f} before, {load_after:.1f} after.",
        "",
        "| example | callback | checks | s / check | s / epoch (no checks) "
        "| check / epoch | first check (s) |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    lines += [
        f"| {ex} | {cb} | {n} | {s:.2f} | {e:.2f} | {r:.1%} | {first:.2f} |"
        for ex, cb, n, s, e, r, first in rows
    ]
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print("wrote", RESULTS, file=sys.stderr)


if __name__ == "__main__":
    main()
