"""TARP: our exact Monte Carlo test against sbi 0.27's ``_run_tarp`` + ``check_tarp``.

GaussianToy (theta ~ N(0, I_2), x = theta + N(0, 0.5^2 I), exact posterior
N(0.8 x, 0.2 I)), N calibration pairs, M = 1000 posterior samples per pair, on the
exact posterior and on wrong ones (variance x2, x0.5, mean shifted). Both methods get
the *same* posterior samples; each draws its own reference points (sbi: uniform on the
box of theta, then min-max rescaled; ours: uniform on the box of the standardized
theta). Reported per case, over R datasets: the rejection rate at 0.05 (ours: our
p-value; sbi: the KS p-value of ``check_tarp``), the mean ATC of each, and the time of
each check as a ratio to the time of drawing the samples it needs (same run).

Run:  python examples/benchmarks/tarp_vs_sbi.py [--reps 20] [--n 1000]
Writes examples/benchmarks/results/tarp_vs_sbi.md. Needs sbi (the benchmark extra).
``--smoke``: 2 datasets of 100 pairs, 100 samples, written to a temporary folder.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

if not __package__:  # run as a file (python examples/x.py): make `examples` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
import zuko
from sbi.diagnostics.tarp import _run_tarp, check_tarp, get_tarp_references

from calib_lightning.functional import tarp
from calib_lightning.tasks import GaussianToy
from examples._smoke import add_smoke_argument, output_folder

RESULTS = Path(__file__).parent / "results"
CASES = {
    "exact posterior": {},
    "variance x2 (too wide)": {"variance_scale": 2.0},
    "variance x0.5 (too narrow)": {"variance_scale": 0.5},
    "mean shifted by 0.3": {"shift": 0.3},
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--n", type=int, default=1000)
    parser.add_argument("--samples", type=int, default=1000)
    add_smoke_argument(parser)
    args = parser.parse_args(argv)
    if args.smoke:
        args.reps, args.n, args.samples = 2, 100, 100
    results = output_folder(RESULTS, args.smoke)
    toy = GaussianToy(dim=2)
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    rows = []
    for name, kwargs in CASES.items():
        ours_reject, sbi_reject, ours_atc, sbi_atc = [], [], [], []
        t_sample = t_ours = t_sbi = 0.0
        for _ in range(args.reps):
            theta, x = toy.sample(args.n, g)
            start = time.perf_counter()
            samples = toy.posterior(**kwargs)(x).sample((args.samples,))
            t_sample += time.perf_counter() - start

            start = time.perf_counter()
            out = tarp(samples, theta, generator=g)
            t_ours += time.perf_counter() - start
            ours_reject.append(float(out.p_value) <= 0.05)
            ours_atc.append(float(out.coverage_error))

            start = time.perf_counter()
            ecp, alpha = _run_tarp(samples, theta, get_tarp_references(theta),
                                   z_score_theta=True)
            atc, ks_p = check_tarp(ecp, alpha)
            t_sbi += time.perf_counter() - start
            sbi_reject.append(ks_p <= 0.05)
            sbi_atc.append(atc)
        rows.append((name, sum(ours_reject) / args.reps, sum(sbi_reject) / args.reps,
                     sum(ours_atc) / args.reps, sum(sbi_atc) / args.reps,
                     t_ours / t_sample, t_sbi / t_sample, t_sample / args.reps))
        print(rows[-1], flush=True)

    lines = [
        "# TARP: exact Monte Carlo test vs sbi 0.27 `check_tarp`",
        "",
        f"GaussianToy D = 2, N = {args.n} pairs, M = {args.samples} posterior samples per pair, "
        f"{args.reps} datasets per case, same samples for both. "
        "Command: `python examples/benchmarks/tarp_vs_sbi.py`.",
        "Rejection = p-value <= 0.05 (ours: Monte Carlo test of the sup deviation, B = 1000; "
        "sbi: its KS p-value between the ECP curve and the alpha grid). "
        "Time = time of the check / time of drawing the samples, same run.",
        "",
        "| case | reject (ours) | reject (sbi) | mean ATC (ours) | mean ATC (sbi) "
        "| time / sampling (ours) | time / sampling (sbi) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, r_ours, r_sbi, a_ours, a_sbi, q_ours, q_sbi, _ in rows:
        lines.append(f"| {name} | {r_ours:.2f} | {r_sbi:.2f} | {a_ours:+.4f} | {a_sbi:+.4f} "
                     f"| {q_ours:.2f} | {q_sbi:.2f} |")
    flow = zuko.flows.NSF(features=2, context=2, transforms=3, hidden_features=(64, 64))
    theta, x = toy.sample(args.n, g)
    start = time.perf_counter()
    with torch.no_grad():
        flow(x).sample((args.samples,))
    t_flow = time.perf_counter() - start
    t_check = rows[1][5] * rows[1][-1]
    lines += [
        "",
        f"Sampling time per dataset: {rows[0][-1]:.3f} s from the exact Gaussian posterior, "
        f"{t_flow:.2f} s from a zuko NSF (3 transforms, 64x64 hidden units, untrained); "
        f"our check ({t_check:.3f} s per dataset) is {t_check / t_flow:.3f} x the flow's "
        "sampling time.",
    ]
    (results / "tarp_vs_sbi.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print("wrote", results / "tarp_vs_sbi.md")


if __name__ == "__main__":
    main()
