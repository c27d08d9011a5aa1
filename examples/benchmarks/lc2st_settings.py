"""The local tests' settings against the previous ones, for L-C2ST as well (issue 23).

``lc2st_training.py`` chose the local tests' settings (2,000 evaluation points, early
stopping after 2 epochs, hidden layers of ``min(10 x inputs, 96)``) on L-C2ST-NF and
sbibm's reference posteriors. L-C2ST (the permutation test, which retrains its null at
every check) shares them. This script runs both tests, as a user runs them, with the
current defaults and with the previous settings (10,000 evaluation points, patience 3,
up to 128 units: ``classifier_kwargs`` and ``num_posterior_samples``), on the same fresh
datasets of ``GaussianToy(dim=2)``: ``--reps`` datasets of ``--pairs`` calibration pairs
and 3 reference observations per model (an exact posterior, inflated and deflated
variances, a shifted mean), the metric's default seed. Rejections of the global p-value
at 0.05, and the seconds of each setting (one torch thread, one setting after the other).

    python examples/benchmarks/lc2st_settings.py --reps 40

(``--smoke``: 2 datasets of 100 pairs, the table in a temporary folder)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

if not __package__:  # run as a file (python examples/x.py): make `examples` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import calib_lightning as cl
from calib_lightning.tasks import GaussianToy
from examples._smoke import add_smoke_argument, output_folder

SETTINGS = {
    "defaults": {},
    "previous (10,000 points, patience 3, up to 128 units)": {
        "classifier_kwargs": {"patience": 3, "max_width": 128},
        "num_posterior_samples": 10_000,
    },
}
TOY = GaussianToy(dim=2)
MODELS = {
    "exact": TOY.posterior(),
    "variance x 3": TOY.posterior(variance_scale=3.0),
    "variance x 0.3": TOY.posterior(variance_scale=0.3),
    "mean shifted by 0.3": TOY.posterior(shift=0.3),
}


def rejections(metric_type: type, settings: dict, posterior: object, args: argparse.Namespace):
    """Global rejections at 0.05 over ``args.reps`` fresh datasets (seeded as in every
    setting, so each setting sees the same data), and the seconds they took."""
    g = torch.Generator().manual_seed(123)
    hits, start = 0, time.perf_counter()
    for rep in range(args.reps):
        theta, x = TOY.sample(args.pairs, g)
        _, x_o = TOY.sample(3, g)
        torch.manual_seed(rep)  # L-C2ST's posterior draws use the global generator
        metric = metric_type(x_o, **settings)
        metric.update(posterior, theta, x)
        hits += float(metric.compute().global_p_value) <= 0.05
    return hits, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=40)
    parser.add_argument("--pairs", type=int, default=300)
    add_smoke_argument(parser)
    args = parser.parse_args()
    if args.smoke:
        args.reps, args.pairs = 2, 100
    torch.set_num_threads(1)
    lines = [
        "# The local tests' settings against the previous ones",
        "",
        f"`python examples/benchmarks/lc2st_settings.py --reps {args.reps} --pairs "
        f"{args.pairs}`: `GaussianToy(dim=2)`, {args.reps} fresh datasets of {args.pairs} "
        "pairs and 3 observations per model, the same datasets for both settings; global "
        "p-value <= 0.05; one torch thread, torch " + torch.__version__ + ".",
        "",
        "| test | settings | " + " | ".join(MODELS) + " | seconds |",
        "| --- | --- | " + " | ".join("---" for _ in MODELS) + " | --- |",
    ]
    for metric_type in (cl.LC2ST, cl.LC2STNF):
        for name, settings in SETTINGS.items():
            cells, seconds = [], 0.0
            for posterior in MODELS.values():
                hits, spent = rejections(metric_type, settings, posterior, args)
                cells.append(f"{hits}/{args.reps}")
                seconds += spent
            lines.append(f"| {metric_type.__name__} | {name} | {' | '.join(cells)} | "
                         f"{seconds:.0f} |")  # fmt: skip
            print(lines[-1], flush=True)
    path = output_folder(Path(__file__).parent / "results", args.smoke) / "lc2st_settings.md"
    path.write_text("\n".join(lines) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
