"""How long ``cl.recalibrate`` takes to fit, per method, against one pass of the flow.

Two flows:

* ``issue``: the issue's set-up, a zuko ``NSF(3, 3)`` (autoregressive, 3 transforms,
  2 x 64 hidden; sampling inverts it in 3 passes per transform) trained ``EPOCHS`` epochs
  on 10,000 pairs of a 3-parameter Gaussian-linear task with a box prior (theta uniform
  on [-1, 1]^3, x = theta + N(0, 0.1 I)), held-out pairs n = 100, 400 and 1,000 (the
  1,000 and 4,000 simulations of docs/recalibration.md, and the issue's 1,000
  calibration pairs);
* ``study``: docs/recalibration.md's sizes for its fit-time claim, the recalibration study's flow
  (``examples._npe.build_flow``: zuko NSF with 3 coupling transforms, 2 x 64 hidden,
  standardized) on Gaussian Linear Uniform (D = 10) at 4,000 simulations: 400 pairs.

Methods: ``scale`` (per-coordinate latent scales), ``scale hpd`` (``scale_target="hpd"``),
``radial``, ``scale+radial``, ``auto``, each without and with ``prior=`` (the task's box).
Each fit is timed once (wall and process CPU seconds, 2 torch threads on a shared 2-core
machine); the machine-independent number is the ratio of the wall time to one
``flow(x).log_prob(theta)`` pass over the same ``n`` pairs (no gradient), the median of
5 passes measured right before each fit. ``scale hpd (before)``: the HPD scale as the
code before this benchmark drew it, 100 draws per pair and proposal scale, ``from_latent``
then ``log_prob`` (one more flow pass), with the scale it picks beside the current one's
(20 draws per pair and scale at n = 1,000, the log-density from the sampling pass).

    PYTHONPATH=. python examples/benchmarks/recalibration_fit_time.py
    PYTHONPATH=. python examples/benchmarks/recalibration_fit_time.py --compare-hpd
    python examples/benchmarks/recalibration_fit_time.py --smoke   # seconds, temporary folder
"""

from __future__ import annotations

import argparse
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path

if not __package__:  # run as a file (python examples/x.py): make `examples` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
import zuko
from torch.distributions import Independent, Uniform

import calib_lightning as cl
from calib_lightning.posteriors import WrappedPosterior
from calib_lightning.recalibration._hpd import latent_draws, on_cpu
from calib_lightning.recalibration.scale import shared_hpd_log_scale
from examples._npe import build_flow
from examples._smoke import add_smoke_argument, output_folder
from examples.benchmarks.regularizer_study import TASKS

RESULTS = Path(__file__).resolve().parent / "results"
EPOCHS, NUM_TRAIN = 10, 10_000
METHODS = {  # name -> recalibrate's arguments
    "scale": {"method": "scale"},
    "scale hpd": {"method": "scale", "scale_target": "hpd"},
    "radial": {"method": "radial"},
    "scale+radial": {"method": "scale+radial"},
    "auto": {"method": "auto"},
}


def box(dim: int) -> Independent:
    return Independent(Uniform(-torch.ones(dim), torch.ones(dim)), 1)


def gaussian_linear(n: int, dim: int, generator: torch.Generator) -> tuple[torch.Tensor, ...]:
    theta = 2 * torch.rand(n, dim, generator=generator) - 1
    return theta, theta + math.sqrt(0.1) * torch.randn(n, dim, generator=generator)


def train(flow: torch.nn.Module, theta: torch.Tensor, x: torch.Tensor, epochs: int) -> None:
    optimizer = torch.optim.Adam(flow.parameters(), lr=1e-3)
    for _ in range(epochs):
        for rows in torch.randperm(len(theta)).split(128):
            loss = -flow(x[rows]).log_prob(theta[rows]).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    flow.eval()


def log_prob_pass(flow: torch.nn.Module, theta: torch.Tensor, x: torch.Tensor) -> float:
    """Median wall seconds of 5 passes of ``flow(x).log_prob(theta)``."""
    times = []
    with torch.no_grad():
        for _ in range(5):
            start = time.perf_counter()
            flow(x).log_prob(theta)
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def timed(fit, *args, **kwargs) -> tuple[object, float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    out = fit(*args, **kwargs)
    return out, time.perf_counter() - wall, time.process_time() - cpu


class TwoPasses(WrappedPosterior):
    """The flow's posterior without the one-pass path of zuko flows: ``from_latent``,
    then ``log_prob``."""

    def log_prob(self, theta: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.inner.log_prob(theta, x)

    def to_latent(self, theta: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.inner.to_latent(theta, x)

    def from_latent(self, z: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.inner.from_latent(z, x)


def hpd_scale_before(flow: torch.nn.Module, theta: torch.Tensor, x: torch.Tensor) -> float:
    """The HPD scale as drawn before: 100 draws per pair and scale, ``from_latent`` then
    ``log_prob``; returns the scale picked."""
    with torch.no_grad():
        draws = latent_draws(TwoPasses(flow), theta, x, 100)
    return float(shared_hpd_log_scale(on_cpu(draws)).exp())


def fits(name: str, flow: torch.nn.Module, theta: torch.Tensor, x: torch.Tensor,
         prior: Independent, before: bool) -> list[str]:  # fmt: skip
    """Table rows of every method on one flow and one set of held-out pairs."""
    rows, n = [], len(theta)
    for method, arguments in METHODS.items():
        for with_prior in (False, True):
            unit = log_prob_pass(flow, theta, x)
            fixed, wall, cpu = timed(cl.recalibrate, flow, theta, x, **arguments,
                                     prior=prior if with_prior else None)  # fmt: skip
            inner = fixed.inner if with_prior else fixed
            picked = inner.method
            if "scale" in picked and inner.scale_target == "hpd":
                picked += f" (scale {float(inner.latent_map.log_scale[0].exp()):.3f})"
            label = method + (" + prior" if with_prior else "")
            rows.append(f"| {name} | {n} | {label} | {wall:.2f} | {cpu:.2f} | {unit * 1e3:.1f} "
                        f"| {wall / unit:.0f} | {picked} |")  # fmt: skip
            print(rows[-1], flush=True)
    if before:
        unit = log_prob_pass(flow, theta, x)
        scale, wall, cpu = timed(hpd_scale_before, flow, theta, x)
        rows.append(f"| {name} | {n} | scale hpd (before) | {wall:.2f} | {cpu:.2f} | "
                    f"{unit * 1e3:.1f} | {wall / unit:.0f} | scale {scale:.3f} |")  # fmt: skip
        print(rows[-1], flush=True)
    return rows


def compare_hpd(out: Path, smoke: bool) -> None:
    """``--compare-hpd``: one torch thread (no thread of ours waits on another, so CPU
    seconds count work, whatever the neighbours do), the issue's flow at 1,000 pairs: a
    log_prob pass, the HPD scale now and as drawn before; printed and appended to the
    results file."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    theta, x = gaussian_linear(500 if smoke else NUM_TRAIN, 3, torch.Generator().manual_seed(0))
    flow = zuko.flows.NSF(3, 3)
    train(flow, theta, x, 1 if smoke else EPOCHS)
    n = 50 if smoke else 1000
    theta_val, x_val = gaussian_linear(n, 3, torch.Generator().manual_seed(n))
    passes = []
    with torch.no_grad():
        for _ in range(5):
            cpu = time.process_time()
            flow(x_val).log_prob(theta_val)
            passes.append(time.process_time() - cpu)
    unit = statistics.median(passes)
    now, wall_now, cpu_now = timed(cl.recalibrate, flow, theta_val, x_val, method="scale",
                                   scale_target="hpd")  # fmt: skip
    before, wall_before, cpu_before = timed(hpd_scale_before, flow, theta_val, x_val)
    lines = ["", f"## One torch thread, n = {n} (`--compare-hpd`)", "",
             "| | CPU s | wall s | CPU / one log_prob pass | scale |", "|---|---|---|---|---|",
             f"| one log_prob pass | {unit:.4f} | | 1 | |",
             f"| scale hpd (now) | {cpu_now:.2f} | {wall_now:.2f} | {cpu_now / unit:.0f} | "
             f"{float(now.latent_map.log_scale[0].exp()):.3f} |",
             f"| scale hpd (before) | {cpu_before:.2f} | {wall_before:.2f} | "
             f"{cpu_before / unit:.0f} | {before:.3f} |"]  # fmt: skip
    print("\n".join(lines), flush=True)
    path = out / "recalibration_fit_time.md"
    with open(path, "a") as handle:
        handle.write("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_smoke_argument(parser)
    parser.add_argument("--compare-hpd", action="store_true", help=compare_hpd.__doc__)
    args = parser.parse_args(argv)
    out = output_folder(RESULTS, args.smoke)
    if args.compare_hpd:
        compare_hpd(out, args.smoke)
        return
    sizes, epochs, num_train = ((50,), 1, 500) if args.smoke else ((100, 400, 1000), EPOCHS,
                                                                    NUM_TRAIN)  # fmt: skip
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, check=False).stdout.strip()  # fmt: skip
    lines = ["# `cl.recalibrate`: fit time per method", "",
             f"`PYTHONPATH=. python examples/benchmarks/recalibration_fit_time.py` at commit "
             f"{commit} (the numbers below came from this commit's code; protocol in the "
             f"module docstring), {torch.get_num_threads()} torch threads on a shared 2-core "
             "machine (other jobs ran beside it: the wall seconds move with them, the ratio "
             "to a log_prob pass measured just before each fit less so).", "",
             "| flow | n | method | wall s | CPU s | one log_prob pass, ms | wall / pass "
             "| fitted |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(0)
    theta, x = gaussian_linear(num_train, 3, generator)
    flow = zuko.flows.NSF(3, 3)
    train(flow, theta, x, epochs)
    for n in sizes:
        theta_val, x_val = gaussian_linear(n, 3, torch.Generator().manual_seed(n))
        lines += fits("issue: zuko NSF(3, 3)", flow, theta_val, x_val, box(3),
                      before=n == max(sizes))  # fmt: skip
    if not args.smoke:
        task = TASKS["gaussian_linear_uniform"]()
        theta, x = task.sample(4000, torch.Generator().manual_seed(0))
        torch.manual_seed(0)
        study_flow = build_flow(theta, x)
        train(study_flow, theta[:3600], x[:3600], 5)
        lines += fits("study: coupling NSF, GLU D = 10", study_flow, theta[3600:], x[3600:],
                      task.prior(), before=True)  # fmt: skip
    path = out / "recalibration_fit_time.md"
    path.write_text("\n".join(lines) + "\n")
    print("wrote", path)


if __name__ == "__main__":
    main()
