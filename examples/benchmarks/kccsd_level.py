"""KCCSD's level on the exact posterior of the NPT Gaussian, many fresh datasets (issue 23).

The power curves at D = 50, N = 1,000 saw KCCSD reject 11 of 100 exact datasets. This
script measures the level with more datasets, as a user runs the check: a fresh dataset
per repetition (``NPTGaussian(dim).sample``), and either the public class at its
defaults (``--via class``: ``cl.KCCSD()``, bootstrap seed 0) or ``cl.diagnose(...,
checks=("kccsd",), seed=rep)`` as the power curves call it (``--via diagnose``). Prints
and writes the rejection rate at 0.01 / 0.05 / 0.10 with its 95 % Clopper-Pearson
interval, the binomial test against 0.05, the Kolmogorov-Smirnov test of uniformity and
the largest excess of the p-values' ECDF over the uniform.

    python examples/benchmarks/kccsd_level.py --via class --reps 1000
    python examples/benchmarks/kccsd_level.py --via diagnose --reps 800 --seed 1

(``--smoke``: D = 3, N = 50, 4 datasets, the table in a temporary folder)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
from scipy import stats

if not __package__:  # run as a file (python examples/x.py): make `examples` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import calib_lightning as cl
from calib_lightning.tasks import NPTGaussian
from examples._smoke import add_smoke_argument, output_folder

RESULTS = Path(__file__).resolve().parent / "results"


def p_value(via: str, estimate: object, theta: torch.Tensor, x: torch.Tensor, rep: int) -> float:
    if via == "class":
        metric = cl.KCCSD()
        metric.update(estimate, theta, x)
        return float(metric.compute().p_value)
    report = cl.diagnose(estimate, theta, x, checks=("kccsd",), seed=rep)
    return float(report.checks["kccsd"].p_value)


def summary(p: np.ndarray) -> dict:
    out: dict = {"datasets": len(p)}
    for alpha in (0.01, 0.05, 0.10):
        k = int((p <= alpha).sum())
        ci = stats.binomtest(k, len(p)).proportion_ci()
        out[f"{alpha:g}"] = (k / len(p), ci.low, ci.high)
    out["binomial p at 0.05"] = stats.binomtest(int((p <= 0.05).sum()), len(p), 0.05).pvalue
    out["KS p"] = stats.kstest(p, "uniform").pvalue
    alphas = np.linspace(0.01, 1.0, 100)
    out["max ECDF excess"] = float(((p[None] <= alphas[:, None]).mean(1) - alphas).max())
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--via", choices=["class", "diagnose"], default="class")
    parser.add_argument("--dim", type=int, default=50)
    parser.add_argument("--n", type=int, default=1000)
    parser.add_argument("--reps", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0, help="the datasets' stream")
    add_smoke_argument(parser)
    args = parser.parse_args()
    if args.smoke:
        args.dim, args.n, args.reps = 3, 50, 4
    torch.set_num_threads(1)
    task = NPTGaussian(dim=args.dim)
    truth, exact = task.case("covariance", 0.0)
    start, p = time.perf_counter(), []
    for rep in range(args.reps):
        g = torch.Generator().manual_seed(args.seed * 1_000_003 + rep)
        theta, x = task.sample(args.n, truth, g)
        p.append(p_value(args.via, exact, theta, x, rep))
    seconds = time.perf_counter() - start
    out = summary(np.asarray(p))
    command = " ".join(["python examples/benchmarks/kccsd_level.py", *sys.argv[1:]])
    lines = [f"# KCCSD's level on the exact NPT Gaussian, D = {args.dim}, N = {args.n}", "",
             f"Written by `{command}` ({seconds:.0f} s, one thread).", "",
             "| alpha | rejected | 95 % interval |", "| ---: | ---: | --- |"]  # fmt: skip
    for alpha in ("0.01", "0.05", "0.1"):
        rate, low, high = out[alpha]
        lines.append(f"| {alpha} | {rate:.3f} | {low:.3f}-{high:.3f} |")
    lines += ["", f"{out['datasets']} datasets; binomial test against 0.05 at 0.05: p = "
              f"{out['binomial p at 0.05']:.3g}; Kolmogorov-Smirnov against the uniform: "
              f"p = {out['KS p']:.3g}; largest ECDF excess over the uniform: "
              f"{out['max ECDF excess']:.3f}.", ""]  # fmt: skip
    folder = output_folder(RESULTS, args.smoke)
    name = f"kccsd_level_d{args.dim}_n{args.n}_{args.via}"
    (folder / f"{name}.md").write_text("\n".join(lines))
    (folder / f"{name}.json").write_text(json.dumps({"args": vars(args), "p": p}))
    print("\n".join(lines))
    print(f"wrote {folder / f'{name}.md'} {folder / f'{name}.json'}")


if __name__ == "__main__":
    main()
