"""Rejection rates of KCCSD (GFD, KGFD) and SKCE vs n on the seed's synthetic models.

Reproduces Figure 1 of Glaser et al. (UAI 2023): MGM and LGM calibrated (the rate is
the type-I error), MGM shifted, HGM and QGM miscalibrated (the rate is the power),
alpha = 0.05, B = 500 wild-bootstrap draws, median-heuristic bandwidths, Gaussian
kernel on parameters. Every (model, n) cell tests all repetitions in one batched call.

Run:  python examples/benchmarks/kccsd_rejection.py [--reps 100] [--sizes 32 64 128 256 512]
Writes examples/benchmarks/results/kccsd_rejection.{md,png} (``--smoke``: 2 repetitions
at n = 32, written to a temporary folder).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

if not __package__:  # run as a file (python examples/x.py): make `examples` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import torch

from calib_lightning.baselines import skce_matrix_gaussian, skce_test
from calib_lightning.evaluation import pair_and_base_scores
from calib_lightning.functional import gaussian_base_points, kccsd
from calib_lightning.tasks import HGM, LGM, MGM, QGM
from examples._smoke import add_smoke_argument, output_folder

RESULTS = Path(__file__).parent / "results"
CASES = {
    "MGM (calibrated)": (MGM(0.0), MGM(0.0)),
    "LGM (calibrated)": (LGM(0.0), LGM(0.0)),
    "MGM (delta=0.1, c=1)": (MGM(0.0), MGM(0.1)),
    "HGM (delta=1)": (HGM(0.0), HGM(1.0)),
    "QGM (delta=1)": (QGM(0.0), QGM(1.0)),
}
TESTS = ("KCCSD-GFD", "KCCSD-KGFD", "SKCE-W", "SKCE-MMD")


def rejection_rates(truth, model, n, reps, seed, num_base_points=32):
    g = torch.Generator().manual_seed(seed)
    theta, x = truth.sample(n * reps, g)
    d = theta.shape[1]
    shaped = theta.reshape(reps, n, d)
    base = gaussian_base_points(theta, num_base_points, g)
    score, base_scores = pair_and_base_scores(model, theta, x, base)
    rates = {}
    for name, kind in (("KCCSD-GFD", "gfd"), ("KCCSD-KGFD", "kgfd")):
        out = kccsd(
            shaped, score.reshape(reps, n, d), base_scores.reshape(reps, n, -1, d), base,
            distribution_kernel=kind, num_null=500, generator=g, block_size=128,
        )  # fmt: skip
        rates[name] = float((out.p_value <= 0.05).float().mean())
    dist = model(x)
    mean, var = dist.mean.reshape(reps, n, d), dist.variance.reshape(reps, n, d)
    for name, kind in (("SKCE-W", "wasserstein"), ("SKCE-MMD", "mmd")):
        matrix = skce_matrix_gaussian(shaped, mean, var, distribution_kernel=kind)
        out = skce_test(matrix, 500, g)
        rates[name] = float((out.p_value <= 0.05).float().mean())
    return rates


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=100)
    parser.add_argument("--sizes", type=int, nargs="+", default=[32, 64, 128, 256, 512])
    add_smoke_argument(parser)
    args = parser.parse_args(argv)
    if args.smoke:
        args.reps, args.sizes = 2, [32]
    results = output_folder(RESULTS, args.smoke)
    start = time.perf_counter()
    table = {}
    for case, (truth, model) in CASES.items():
        for n in args.sizes:
            table[case, n] = rejection_rates(truth, model, n, args.reps, seed=1000 + n)
            print(case, n, table[case, n], flush=True)
    elapsed = time.perf_counter() - start

    lines = [
        "# KCCSD and SKCE rejection rates (alpha = 0.05)",
        "",
        f"{args.reps} datasets per cell, B = 500, 32 base points, median heuristic. "
        f"Total run time {elapsed:.0f} s on this machine. "
        "Command: `python examples/benchmarks/kccsd_rejection.py`.",
        "For the calibrated models the rate is the type-I error (should be about 0.05; "
        f"the 95% binomial range for {args.reps} datasets is about 0.01-0.10).",
        "",
        "| model | n | " + " | ".join(TESTS) + " |",
        "| --- | --- | " + " | ".join("---" for _ in TESTS) + " |",
    ]
    for (case, n), rates in table.items():
        lines.append(f"| {case} | {n} | " + " | ".join(f"{rates[t]:.2f}" for t in TESTS) + " |")
    (results / "kccsd_rejection.md").write_text("\n".join(lines) + "\n")

    fig, axes = plt.subplots(1, len(CASES), figsize=(4 * len(CASES), 3.4), sharey=True)
    for ax, case in zip(axes, CASES, strict=True):
        for test in TESTS:
            ax.plot(args.sizes, [table[case, n][test] for n in args.sizes], marker="o", label=test)
        ax.axhline(0.05, color="k", lw=0.8, ls="--")
        ax.set(title=case, xscale="log", xlabel="n", ylim=(-0.02, 1.02))
        ax.set_xticks(args.sizes, [str(n) for n in args.sizes])
    axes[0].set_ylabel("rejection rate")
    axes[-1].legend(loc="center right")
    fig.tight_layout()
    fig.savefig(results / "kccsd_rejection.png", dpi=110)
    print((results / "kccsd_rejection.md").read_text())
    print("wrote", results / "kccsd_rejection.md", results / "kccsd_rejection.png")


if __name__ == "__main__":
    main()
