"""The radial map's band: what a tighter guarantee costs in held-out log-density.

On calibrated latents (``z ~ N(0, I_D)``, the case where recalibration should change
nothing), the radial map is fitted on ``n`` held-out norms with band ``w`` and scored on
4,000 fresh latents: the mean change of log-density it causes (its NLL penalty, in nats;
0 for a map that leaves a calibrated flow alone), its number of knots, and the largest
coverage gap of its latent balls on the fresh latents, against the bound ``w / (n + 1)``.
Mean over 20 repetitions; D = 2 and 5, n = 100 and 400.

    PYTHONPATH=. python examples/benchmarks/radial_band.py
    python examples/benchmarks/radial_band.py --smoke   # seconds, temporary folder
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

if not __package__:  # run as a file (python examples/x.py): make `examples` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch

from calib_lightning.functional.radial import latent_ball_levels, radial_knots
from calib_lightning.recalibration import LatentMap
from calib_lightning.recalibration.api import default_band
from calib_lightning.recalibration.radial import standard_normal_log_prob
from examples._smoke import add_smoke_argument, output_folder

RESULTS = Path(__file__).resolve().parent / "results"


def measure(dim: int, n: int, band: int, reps: int, fresh: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    penalty, knots, gaps = [], [], []
    levels = torch.linspace(0.05, 0.95, 19, dtype=torch.float64)
    for _ in range(reps):
        z = torch.randn(n, dim, generator=g, dtype=torch.float64)
        latent_map = LatentMap(dim, None, radial_knots(z.norm(dim=-1), dim, band))
        test = torch.randn(fresh, dim, generator=g, dtype=torch.float64)
        u, log_det = latent_map(test)
        change = standard_normal_log_prob(u) + log_det - standard_normal_log_prob(test)
        penalty.append(float(-change.mean()))
        knots.append(latent_map.knots.shape[1])
        coverage = (latent_ball_levels(u)[:, None] <= levels).double().mean(0)
        gaps.append(float((coverage - levels).abs().max()))
    return {"penalty": statistics.fmean(penalty), "knots": statistics.fmean(knots),
            "gap": statistics.fmean(gaps), "bound": band / (n + 1)}  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_smoke_argument(parser)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    out = output_folder(RESULTS, smoke=args.smoke)
    reps, fresh = (2, 500) if args.smoke else (20, 4000)
    lines = ["# Radial map: band vs held-out NLL penalty on calibrated latents", "",
             "Protocol in the module docstring of `radial_band.py`. `default` is "
             "`default_band(n)` = round(sqrt(n) / 2).", "",
             "| D | n | band | knots | NLL penalty (nats) | largest coverage gap, given the "
             "fitted map | marginal bound w/(n+1) |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for dim in (2, 5):
        for n in (100, 400):
            for band in (1, 2, 4, default_band(n), 16):
                row = measure(dim, n, band, reps, fresh)
                name = f"{band} (default)" if band == default_band(n) else str(band)
                lines.append(f"| {dim} | {n} | {name} | {row['knots']:.0f} | {row['penalty']:.3f} "
                             f"| {row['gap']:.3f} | {row['bound']:.3f} |")  # fmt: skip
                print(lines[-1], flush=True)
    (out / "radial_band.md").write_text("\n".join(lines) + "\n")
    print("wrote", out / "radial_band.md")


if __name__ == "__main__":
    main()
