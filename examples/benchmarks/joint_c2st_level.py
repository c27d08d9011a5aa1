"""Level of the joint classifier test at its defaults, thousands of fresh datasets at once.

Gaussian model (theta ~ N(0, I_D), x = theta + 0.5 noise, exact posterior N(0.8 x, 0.2 I)),
``M = 20`` exact posterior draws per pair, a fresh dataset per repetition. Every dataset
is tested as ``cl.JointC2ST()`` tests it (``FOLDS`` x ``REPEATS`` cross-fit, the default
classifier, the folds' p-values combined by Cauchy), the datasets batched into one
ensemble fit (``classifiers.joint_c2st_test``, the function the metric calls). For each
(N, D): the rejection rate at 0.05 with its 99 % binomial band and the KS p-value of the
p-values.

    python examples/benchmarks/joint_c2st_level.py [--smoke]

Writes examples/benchmarks/results/joint_c2st_level.md.
"""

from __future__ import annotations

import argparse
import platform
import subprocess
import time
from pathlib import Path

import torch
from scipy import stats

from calib_lightning.classifiers import joint_c2st_folds, joint_c2st_test, make_ensemble
from calib_lightning.metrics.joint_c2st import FOLDS, REPEATS

RESULTS = Path(__file__).parent / "results"
CASES = ((100, 10, 2000), (100, 3, 2000), (300, 3, 1500), (1000, 3, 800))  # N, D, datasets


def level(reps: int, n: int, dim: int, draws: int, seed: int) -> tuple[float, float]:
    """Rejection rate at 0.05 and the KS p-value of ``reps`` fresh datasets' p-values."""
    g = torch.Generator().manual_seed(seed)
    theta = torch.randn(reps, n, dim, generator=g)
    x = theta + 0.5 * torch.randn(reps, n, dim, generator=g)
    weight = 1 / 1.25
    noise = torch.randn(reps, draws, n, dim, generator=g)
    samples = weight * x[:, None] + (weight * 0.25) ** 0.5 * noise
    folds = joint_c2st_folds(n, FOLDS, REPEATS, torch.Generator().manual_seed(seed + 1))
    classifier = make_ensemble("mlp", reps * FOLDS * REPEATS, seed=seed + 2)
    _, p, _, _ = joint_c2st_test(theta, x, samples, classifier, folds,
                                 torch.Generator().manual_seed(seed + 3))  # fmt: skip
    return float((p < 0.05).double().mean()), float(stats.kstest(p.numpy(), "uniform").pvalue)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    cases = ((50, 2, 20),) if args.smoke else CASES
    rows, start = [], time.perf_counter()
    for n, dim, reps in cases:
        begin = time.perf_counter()
        rate, ks = level(reps, n, dim, 20, 7 + n + dim)
        low, high = stats.binom.ppf([0.005, 0.995], reps, 0.05) / reps
        inside = "yes" if low <= rate <= high else "NO"
        rows.append(f"| {n} | {dim} | {reps} | {rate:.3f} | [{low:.3f}, {high:.3f}] | {inside} "
                    f"| {ks:.2g} | {time.perf_counter() - begin:.0f} |")  # fmt: skip
        print(rows[-1], flush=True)
    if args.smoke:
        return
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, check=False).stdout.strip()  # fmt: skip
    text = "\n".join([
        "# Level of the joint classifier test at its defaults", "",
        f"Written by `python examples/benchmarks/joint_c2st_level.py` at commit {commit} "
        f"({platform.machine()}, one thread, {(time.perf_counter() - start) / 60:.0f} min). "
        f"Folds {FOLDS}, repetitions {REPEATS}, the default classifier, M = 20 exact "
        "posterior draws per pair, a fresh dataset per repetition.", "",
        "| N | D | datasets | rejection rate at 0.05 | 99 % band | inside | KS p | seconds |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |", *rows, "",
        "At commit 92d481c all ranks were summed into one statistic instead: the folds learn "
        "each other's chance patterns, and with the same construction (300-800 datasets) "
        "that statistic's standard deviation was 1.10-1.14 at N = 100-1,000 under H0, its "
        "rejection rate 0.077-0.083.", "",
    ])  # fmt: skip
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "joint_c2st_level.md").write_text(text)


if __name__ == "__main__":
    main()
