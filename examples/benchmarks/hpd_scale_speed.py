"""The HPD-targeted latent scale: fit time before and after shared draws.

``LatentScale.fit(target="hpd")`` picks one shared scale on a 41-point log grid over
``[1/2, 2]``. Before (the implementation replaced in issue 25, reproduced here as
``grid_pass_fit``): one sampling pass of the flow per grid scale, 100 draws per pair, with
common random numbers. After (``calib_lightning.recalibration.scale.hpd_log_scale``):
100 draws per pair at each of three proposal scales, reused for the whole grid by
importance weighting.

Set-up of ``regularizer_study.py`` at 4,000 simulations: its zuko NSF (3 coupling
transforms, 2 x 64 hidden, standardized), trained ``EPOCHS`` epochs (the cost of a pass
does not depend on training), 400 validation pairs. The 2-core machine is shared, so the
script reports process CPU seconds (what the fit costs, whatever the neighbours do) beside
wall seconds. The grid-pass fit costs one identical pass per grid scale; it is measured on
``MEASURED_SCALES`` of the 41 grid scales and scaled by 41 / ``MEASURED_SCALES`` (stated in
the table).

    PYTHONPATH=. python examples/benchmarks/hpd_scale_speed.py
    python examples/benchmarks/hpd_scale_speed.py --smoke   # seconds, temporary folder
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

if not __package__:  # run as a file (python examples/x.py): make `examples` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch

import calib_lightning as cl
from calib_lightning import evaluation
from calib_lightning.recalibration.scale import hpd_log_scale
from examples._npe import build_flow
from examples._smoke import add_smoke_argument, output_folder
from examples.benchmarks.regularizer_study import TASKS

RESULTS = Path(__file__).resolve().parent / "results"
NUM_SCALES, DRAWS, EPOCHS, MEASURED_SCALES = 41, 100, 5, 6


def grid_pass_fit(flow: torch.nn.Module, theta: torch.Tensor, x: torch.Tensor,
                  grid: torch.Tensor) -> list[float]:  # fmt: skip
    """The replaced fit: per grid scale, one sampling pass; returns each scale's gap."""
    scaled = cl.LatentScale(flow)
    n = theta.shape[0]
    quantiles = (torch.arange(n, dtype=torch.float64) + 0.5) / n
    gaps = []
    for log_s in grid:
        scaled.log_scale = torch.full((theta.shape[1],), float(log_s))
        above = torch.zeros(n, dtype=torch.float64)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            for chunk in evaluation.draw_chunks(scaled, theta, x, DRAWS):
                rows = slice(chunk.start, chunk.start + chunk.theta.shape[0])
                above[rows] += (chunk.log_prob > chunk.log_prob_theta).double().sum(0)
        gaps.append(float((torch.sort(above / DRAWS).values - quantiles).pow(2).mean()))
    return gaps


def trained_flow(task: object, budget: int, epochs: int) -> tuple:
    theta, x = task.sample(budget, torch.Generator().manual_seed(0))
    val, train = slice(0, budget // 10), slice(budget // 10, None)
    torch.manual_seed(0)
    flow = build_flow(theta[train], x[train])
    optimizer = torch.optim.Adam(flow.parameters(), lr=1e-3)
    for _ in range(epochs):
        for rows in torch.randperm(budget - budget // 10).split(128):
            loss = -flow(x[train][rows]).log_prob(theta[train][rows]).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return flow.eval(), theta[val], x[val]


def timed(fn: object, *args: object) -> tuple[object, float, float]:
    """``fn(*args)``, its process CPU seconds and its wall seconds."""
    cpu, wall = time.process_time(), time.perf_counter()
    out = fn(*args)
    return out, time.process_time() - cpu, time.perf_counter() - wall


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    add_smoke_argument(parser)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    budget, epochs = (400, 1) if args.smoke else (4000, EPOCHS)
    out = output_folder(RESULTS, smoke=args.smoke)
    grid = torch.linspace(-math.log(2.0), math.log(2.0), NUM_SCALES, dtype=torch.float64)
    measured = grid[torch.linspace(0, NUM_SCALES - 1, MEASURED_SCALES).round().long()]
    factor = NUM_SCALES / MEASURED_SCALES
    lines = ["# HPD-targeted latent scale: fit time", "",
             f"Protocol in the module docstring of `hpd_scale_speed.py`; {budget} simulations, "
             f"{budget // 10} validation pairs, one torch thread. Grid-pass times are measured "
             f"on {MEASURED_SCALES} of the {NUM_SCALES} grid scales and multiplied by "
             f"{factor:.2f}.", "",
             "| task | D | grid-pass fit CPU s (x41/6) | wall s (x41/6) | shared-draw fit CPU s "
             "| wall s | CPU speed-up | scale chosen (shared draws) |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for name in args.tasks:
        flow, theta, x = trained_flow(TASKS[name](), budget, epochs)
        with torch.no_grad():
            _, old_cpu, old_wall = timed(grid_pass_fit, flow, theta, x, measured)
            new, new_cpu, new_wall = timed(hpd_log_scale, flow, theta, x, DRAWS, NUM_SCALES)
        old_cpu, old_wall = old_cpu * factor, old_wall * factor
        lines.append(f"| {name} | {theta.shape[1]} | {old_cpu:.1f} | {old_wall:.1f} | "
                     f"{new_cpu:.1f} | {new_wall:.1f} | {old_cpu / new_cpu:.1f}x | "
                     f"{float(new.exp()):.3f} |")  # fmt: skip
        print(lines[-1], flush=True)
    (out / "hpd_scale_speed.md").write_text("\n".join(lines) + "\n")
    print("wrote", out / "hpd_scale_speed.md")


if __name__ == "__main__":
    main()
