"""What ``cl.recalibrate(method="auto")`` picks when the right answer is known.

Gaussian toy posteriors (``GaussianToy(dim=2)``, exact posterior known): the exact one
(the right pick is ``"none"``), and the exact one with its variance times 0.25 or 2
(a latent scale fixes it; so does the radial map, the error being isotropic). For each,
``REPS`` seeded repetitions at ``n`` held-out pairs: how often each candidate is picked
by :func:`calib_lightning.recalibration.api.select_method` with ``k`` = 2 (the default)
and 1 standard errors, and the wall time of one ``"auto"`` fit (draws, cross-fitting
and the final fit).

    PYTHONPATH=. python examples/benchmarks/auto_selection.py
    python examples/benchmarks/auto_selection.py --smoke   # seconds, temporary folder
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

if not __package__:  # run as a file (python examples/x.py): make `examples` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch

import calib_lightning as cl
from calib_lightning.recalibration import api
from calib_lightning.recalibration._hpd import latent_draws
from calib_lightning.tasks import GaussianToy
from examples._smoke import add_smoke_argument, output_folder

RESULTS = Path(__file__).resolve().parent / "results"
CASES = {"exact (none)": 1.0, "variance x 0.25 (scale)": 0.25, "variance x 2 (scale)": 2.0}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--sizes", type=int, nargs="+", default=[100, 400])
    add_smoke_argument(parser)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.smoke:
        args.reps, args.sizes = 2, [40]
    out = output_folder(RESULTS, args.smoke)
    toy = GaussianToy(dim=2)
    lines = ["# What `method=\"auto\"` picks on Gaussian toys", "",
             f"`python examples/benchmarks/auto_selection.py --reps {args.reps}`: "
             f"{args.reps} repetitions per row (pairs seeded 100 + rep, the cross-fitting "
             "split and the draws by rep); picks of `select_method` with k standard "
             "errors; fit: wall seconds of one `cl.recalibrate(method=\"auto\")` (mean).",
             "", "| posterior (right pick) | n | k = 2 (default) | k = 1 | fit (s) |",
             "| --- | --- | --- | --- | --- |"]  # fmt: skip
    for label, variance_scale in CASES.items():
        post = cl.as_posterior(toy.posterior(variance_scale=variance_scale))
        for n in args.sizes:
            picks = {2.0: collections.Counter(), 1.0: collections.Counter()}
            seconds = 0.0
            for rep in range(args.reps):
                theta, x = toy.sample(n, torch.Generator().manual_seed(100 + rep))
                start = time.perf_counter()
                fixed = cl.recalibrate(post, theta, x, method="auto", seed=rep)
                seconds += time.perf_counter() - start
                picks[2.0][fixed.method] += 1
                with torch.no_grad():
                    z, log_prob = post.to_latent(theta, x), post.log_prob(theta, x)
                    draws = latent_draws(post, theta, x, api.AUTO_NUM_POSTERIOR_SAMPLES, seed=rep)
                    chosen = api.select_method(z, log_prob, draws, seed=rep,
                                               num_standard_errors=1.0)[0]
                picks[1.0][chosen] += 1  # fmt: skip
            cells = [", ".join(f"{name} {count}" for name, count in picks[k].most_common())
                     for k in (2.0, 1.0)]  # fmt: skip
            lines.append(f"| {label} | {n} | {cells[0]} | {cells[1]} | "
                         f"{seconds / args.reps:.2f} |")  # fmt: skip
            print(lines[-1], flush=True)
    path = out / "auto_selection.md"
    path.write_text("\n".join(lines) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
