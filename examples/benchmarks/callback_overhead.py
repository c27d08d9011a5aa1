"""Overhead of the calibration callbacks in the two NPE examples, per check.

Trains each example's model for a few epochs with its calibration callbacks
checking after every epoch, and reports the time of one check and its ratio to
one epoch without checks (training and validation). Two clocks are read by
callbacks placed around the calibration callbacks: wall time, and the process's
CPU time, which drifts less on a shared machine. Ratios are taken within one run;
medians over epochs 2.. drop the first epoch's one-off costs (allocations,
matplotlib fonts). Writes ``examples/benchmarks/results/callback_overhead.md``.

Run: python examples/benchmarks/callback_overhead.py [--epochs 6] [--threads 1 2]
(``--smoke``: 2 tiny epochs, checks without figures, the table in a temporary folder)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

if not __package__:  # run as a file (python examples/x.py): make `examples` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning as L
import torch
import zuko
from lightning.pytorch.loggers import TensorBoardLogger
from torch.utils.data import DataLoader, TensorDataset

from calib_lightning.tasks import SLCP, TwoMoons
from examples._common import CHECKS, SMOKE_CHECKS, calibration_callbacks
from examples._npe import NPE, masked_autoregressive_flow
from examples._smoke import add_smoke_argument, output_folder

RESULTS = Path(__file__).resolve().parent / "results"


def clocks() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


class Clock(L.Callback):
    """Reads both clocks at epoch start/end and around the validation-end hooks."""

    def __init__(self, store: dict, when: str) -> None:
        self.store, self.when = store, when

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        if self.when == "before":
            self.store.setdefault("epoch_start", []).append(clocks())

    def on_validation_epoch_end(self, trainer, pl_module) -> None:
        if not trainer.sanity_checking:
            self.store.setdefault(f"check_{self.when}", []).append(clocks())

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        if self.when == "after":
            self.store.setdefault("epoch_end", []).append(clocks())


def two_moons_model(x):
    return NPE(zuko.flows.NSF(2, 2, transforms=3, hidden_features=(64, 64)), epochs=100)


def slcp_model(x):
    low, high = SLCP.prior_bounds
    flow = masked_autoregressive_flow(5, x.mean(0), x.std(0), torch.full((5,), low),
                                      torch.full((5,), high))
    return NPE(flow, epochs=100)


def measure(example_name, task, make_model, num_observations, args, log_dir):
    """The example's model and checks (``examples/_npe.py``, ``examples/_common.py``),
    a check after every epoch; medians of check and epoch times over epochs 2.."""
    L.seed_everything(0, verbose=False)
    generator = torch.Generator().manual_seed(0)
    theta, x = task.sample(args.num_simulations, generator)
    theta_val, x_val = task.sample(args.num_validation, generator)
    theta_cal, x_cal = task.sample(args.num_calibration, generator)
    theta_o, x_o = task.sample(num_observations, generator)
    try:  # exact posterior samples at x_o (Two Moons), as in the example
        reference = task.reference_posterior_samples(x_o, args.checks["num_reference"], generator)
    except NotImplementedError:
        reference = None
    labels = [f"theta_{i}" for i in range(1, task.theta_dim + 1)]
    checks = calibration_callbacks(
        theta_cal, x_cal, 1, theta_o, x_o, labels, reference, args.checks,
        log_figures=not args.smoke,
    )
    store: dict = {}
    trainer = L.Trainer(
        max_epochs=args.epochs, accelerator="cpu",
        logger=TensorBoardLogger(log_dir, name=example_name),
        callbacks=[Clock(store, "before"), *checks, Clock(store, "after")],
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
    )
    trainer.fit(
        make_model(x),
        DataLoader(TensorDataset(theta, x), batch_size=256, shuffle=True),
        DataLoader(TensorDataset(theta_val, x_val), batch_size=2_000),
    )
    row = {}
    for clock, name in ((0, "wall"), (1, "cpu")):
        check = [b[clock] - a[clock] for a, b in zip(store["check_before"], store["check_after"],
                                                     strict=True)]
        epoch = [e[clock] - s[clock] - c for s, e, c in zip(store["epoch_start"],
                                                           store["epoch_end"], check, strict=True)]
        row[name] = (statistics.median(check[1:]), statistics.median(epoch[1:]))
    return [(example_name, "+".join(c.tag_name for c in checks), row)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--threads", type=int, nargs="+", default=[1])
    parser.add_argument("--num-simulations", type=int, default=30_000)
    parser.add_argument("--num-calibration", type=int, default=1_000)
    add_smoke_argument(parser)
    parser.set_defaults(num_validation=2_000, checks=CHECKS)
    args = parser.parse_args(argv)
    if args.smoke:  # tiny sizes, no figures; 2 epochs leave one for the medians over 2..
        args.epochs, args.num_simulations, args.num_validation = 2, 256, 128
        args.num_calibration, args.checks = 64, SMOKE_CHECKS
    results = output_folder(RESULTS, args.smoke) / "callback_overhead.md"
    lines = [
        "# Calibration callback overhead per check",
        "",
        f"`python examples/benchmarks/callback_overhead.py --epochs {args.epochs} --threads "
        f"{' '.join(map(str, args.threads))}`: {args.num_simulations} training pairs (batch "
        f"256), {args.num_calibration} calibration pairs, 2,000 validation pairs, a check "
        f"after every epoch, medians over epochs 2..{args.epochs}. Machine: {os.cpu_count()} "
        f"CPU cores, torch {torch.__version__}. Epoch = training + validation, checks excluded.",
        "",
        "| example | callbacks | torch threads | load avg | s / check | s / epoch "
        "| check / epoch | CPU s / check | CPU s / epoch | check / epoch (CPU) |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    with tempfile.TemporaryDirectory() as log_dir:  # figures are written, then dropped
        for threads in args.threads:
            torch.set_num_threads(threads)
            for name, task, make_model, num_observations in (
                ("npe_two_moons", TwoMoons(), two_moons_model, 3),
                ("npe_slcp_nflows", SLCP(), slcp_model, 2),
            ):  # as in the examples: model, checks and reference observations
                load = os.getloadavg()[0]
                for example, tags, row in measure(
                    name, task, make_model, num_observations, args, log_dir
                ):
                    (wc, we), (cc, ce) = row["wall"], row["cpu"]
                    lines.append(
                        f"| {example} | {tags} | {threads} | {load:.1f} | {wc:.2f} | {we:.2f} | "
                        f"{wc / we:.1%} | {cc:.2f} | {ce:.2f} | {cc / ce:.1%} |"
                    )
                    print(lines[-1], flush=True)
    results.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print("wrote", results)


if __name__ == "__main__":
    main()
