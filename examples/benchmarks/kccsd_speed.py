"""Speed of the KCCSD test against the matmul floor, measured in the same run.

For each n the test (statistic + B = 500 wild-bootstrap draws) runs on precomputed
scores (d = 5, m = 64 base points). The floor is the two matrix products no
implementation can avoid: the n x (m d) Gram product of the score features and the
n x n x B bootstrap product. We report both times and their ratio; the goal is a
ratio within 3 at n = 4096. A naive O(n^2) Python double loop is timed at the smallest
n for reference.

Run:  python examples/benchmarks/kccsd_speed.py [--sizes 256 512 1024 2048 4096 8192] [--threads 1]
Writes examples/benchmarks/results/kccsd_speed.md (``--smoke``: n = 64 only, written to
a temporary folder).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

if not __package__:  # run as a file (python examples/x.py): make `examples` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch

from calib_lightning.functional import kccsd, rademacher
from calib_lightning.kernels import stein_kernel
from examples._smoke import add_smoke_argument, output_folder

RESULTS = Path(__file__).parent / "results"
D, M, B = 5, 64, 500


def best_of(fn, repeats):
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def naive_loop(theta, score, features, ell, sigma):
    n = theta.shape[0]
    total = 0.0
    for i in range(n):
        for j in range(n):
            if i != j:
                h = stein_kernel(theta[i : i + 1], score[i : i + 1], theta[j : j + 1],
                                 score[j : j + 1], "rbf", ell)  # fmt: skip
                gfd = ((features[i] - features[j]) ** 2).sum() / M
                total += float(torch.exp(-gfd / (2 * sigma**2)) * h)
    return total / (n * (n - 1))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", type=int, nargs="+", default=[256, 512, 1024, 2048, 4096, 8192])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    add_smoke_argument(parser)
    args = parser.parse_args(argv)
    n0 = 64  # size of the naive-loop comparison
    if args.smoke:
        args.sizes, args.repeats, n0 = [64], 1, 8
    if args.threads:
        torch.set_num_threads(args.threads)
    results = output_folder(RESULTS, args.smoke)
    g = torch.Generator().manual_seed(0)
    rows = []
    for n in args.sizes:
        theta = torch.randn(n, D, generator=g)
        score = -theta + 0.1 * torch.randn(n, D, generator=g)
        features = torch.randn(n, M, D, generator=g)
        flat = features.flatten(1)
        weights = rademacher((n, B), g)
        square = torch.randn(n, n, generator=g)

        def ours(theta=theta, score=score, features=features):
            kccsd(theta, score, features, num_null=B, generator=g)

        def floor(flat=flat, square=square, weights=weights):
            flat @ flat.T
            square @ weights

        ours()  # warm-up
        floor()
        t_ours = best_of(ours, args.repeats)
        t_floor = best_of(floor, args.repeats)
        rows.append((n, t_ours, t_floor, t_ours / t_floor))
        print(f"n={n}: ours {t_ours:.4f} s, floor {t_floor:.4f} s, ratio {t_ours / t_floor:.2f}")

    theta, score = torch.randn(n0, D, generator=g), torch.randn(n0, D, generator=g)
    features = torch.randn(n0, M, D, generator=g)
    t_naive = best_of(lambda: naive_loop(theta, score, features, 1.0, 1.0), 1)
    fixed = {"bandwidth": 1.0, "distribution_bandwidth": 1.0, "num_null": 1}
    t_vec = best_of(lambda: kccsd(theta, score, features, **fixed), args.repeats)

    lines = [
        "# KCCSD test speed vs the matmul floor",
        "",
        f"d = {D}, m = {M} base points, B = {B} bootstrap draws, float32, "
        f"{torch.get_num_threads()} threads, best of {args.repeats}. "
        f"Command: `python examples/benchmarks/kccsd_speed.py --threads {args.threads}`."
        if args.threads
        else "Command: `python examples/benchmarks/kccsd_speed.py`.",
        "Floor = the n x (m d) feature Gram product + the n x n x B bootstrap product, "
        "timed in the same run.",
        "",
        "| n | KCCSD test (s) | matmul floor (s) | ratio |",
        "| --- | --- | --- | --- |",
        *[f"| {n} | {a:.4f} | {b:.4f} | {r:.2f} |" for n, a, b, r in rows],
        "",
        f"Naive Python double loop at n = {n0} (statistic only): {t_naive:.2f} s; "
        f"vectorized: {t_vec:.5f} s ({t_naive / t_vec:.0f}x faster).",
    ]
    (results / "kccsd_speed.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print("wrote", results / "kccsd_speed.md")


if __name__ == "__main__":
    main()
