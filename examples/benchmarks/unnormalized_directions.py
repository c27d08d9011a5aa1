"""Does ``cl.diagnose`` name the right direction on a posterior known up to a constant?

The posterior is ``exp f(theta, x) p(theta)`` with the Gaussian likelihood
``x ~ N(theta, 0.5^2 I)``, D = 2, a box prior ``U(-2, 2)^2`` or a standard normal prior,
given to ``cl.diagnose`` as ``cl.UnnormalizedPosterior(f, prior=prior)`` with every
argument at its default (KCCSD, the importance-sampled coverage test; one fresh dataset
of N pairs per repetition, the default seed). The verdict names a direction only when a
one-sided test of it rejects: the t-tests of the mean importance-sampled credibility
(above 1/2: "over-confident or biased", below: "under-confident"), Holm-corrected and
gated by the overall verdict and the coverage check's own verdict.

Rows: the exact ``f`` (how often a direction is named: at most the level, with the 99 %
binomial band beside it), ``tau * f`` with tau = 1.5 (over-confident) and 0.6
(under-confident), and ``f(theta - 0.25, x)`` (shifted: "over-confident or biased" is
the only true reading). Columns: the share of datasets rejected, each direction named,
and the mean seconds per ``cl.diagnose``.

Run: ``PYTHONPATH=. python examples/benchmarks/unnormalized_directions.py`` (about 25 min
on one thread; result: results/unnormalized_directions.md); ``--smoke``: 3 datasets a row.
"""

from __future__ import annotations

import argparse
import platform
import subprocess
import time

import torch
from scipy import stats
from torch.distributions import Independent, Normal, Uniform

import calib_lightning as cl
from examples._smoke import add_smoke_argument, output_folder

RESULTS = __file__.rsplit("/", 1)[0] + "/results"
SIGMA = 0.5
OVER, UNDER = "over-confident or biased", "under-confident"


def prior_of(kind: str) -> Independent:
    if kind == "box":
        return Independent(Uniform(-2 * torch.ones(2), 2 * torch.ones(2)), 1)
    return Independent(Normal(torch.zeros(2), torch.ones(2)), 1)


def log_lik(tau: float = 1.0, shift: float = 0.0):
    def f(theta, x):
        return -0.5 * tau * (((x - theta + shift) / SIGMA) ** 2).sum(-1)

    return f


def run_row(kind: str, reps: int, n: int, seed: int, tau: float = 1.0, shift: float = 0.0):
    prior = prior_of(kind)
    post = cl.UnnormalizedPosterior(log_lik(tau, shift), prior=prior)
    torch.manual_seed(seed)
    rejected = over = under = 0
    seconds = 0.0
    for _ in range(reps):
        theta = prior.sample((n,))
        x = theta + SIGMA * torch.randn_like(theta)
        start = time.perf_counter()
        report = cl.diagnose(post, theta, x)
        seconds += time.perf_counter() - start
        named = {d.words for d in report.findings.directions if d.named}
        rejected += report.verdict.startswith("miscalibrated")
        over += OVER in named
        under += UNDER in named
    return {"rejected": rejected / reps, "over": over / reps, "under": under / reps,
            "seconds": seconds / reps}  # fmt: skip


def band(reps: int) -> str:
    low, high = stats.binom.interval(0.99, reps, 0.05)
    return f"[{low / reps:.3f}, {high / reps:.3f}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=400, help="datasets per exact row")
    parser.add_argument("--power-reps", type=int, default=100, help="datasets per other row")
    parser.add_argument("--pairs", type=int, default=300)
    add_smoke_argument(parser)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.smoke:
        args.reps, args.power_reps, args.pairs = 3, 3, 50
    cases = [("exact", {}, args.reps), ("tau = 1.5", {"tau": 1.5}, args.power_reps),
             ("tau = 0.6", {"tau": 0.6}, args.power_reps),
             ("shift 0.25", {"shift": 0.25}, args.power_reps)]  # fmt: skip
    rows = []
    for i, (case, kwargs, reps) in enumerate(cases[:2] if args.smoke else cases):
        for j, kind in enumerate(("box",) if args.smoke else ("box", "gaussian")):
            result = run_row(kind, reps, args.pairs, 700 + 10 * i + j, **kwargs)
            rows.append((case, kind, reps, result))
            print(rows[-1], flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, check=False).stdout.strip()  # fmt: skip
    lines = [
        "# Unnormalized posteriors: the direction the verdict names",
        "",
        "Command: `PYTHONPATH=. python examples/benchmarks/unnormalized_directions.py` at "
        f"commit {commit}, {time.strftime('%Y-%m-%d')}. Machine: {platform.machine()}, 2 "
        f"cores shared with other jobs, one torch thread, torch {torch.__version__}.",
        "",
        "`cl.diagnose(cl.UnnormalizedPosterior(f, prior=prior), theta, x)` at its defaults, "
        f"one fresh dataset of N = {args.pairs} pairs per repetition, `x ~ N(theta, 0.5^2 I)`,"
        " D = 2, box prior `U(-2, 2)^2` or `N(0, I)`. A direction is named when the "
        "one-sided t-test of the mean importance-sampled credibility rejects after Holm's "
        "correction and the overall and coverage verdicts reject. `rejected`: the overall "
        "verdict at 0.05; the two direction columns: the share of datasets whose sentence "
        "names it (on the exact posterior, any naming is an error: the 99 % band of the "
        "level beside it). Seconds: mean per `cl.diagnose`.",
        "",
        "| case | prior | datasets | rejected | names over-confident or biased | names "
        "under-confident | 99 % band at the level | s per diagnose |",
        "| --- | --- | ---: | ---: | ---: | ---: | --- | ---: |",
    ]
    for case, kind, reps, r in rows:
        lines.append(
            f"| {case} | {kind} | {reps} | {r['rejected']:.3f} | {r['over']:.3f} | "
            f"{r['under']:.3f} | {band(reps) if case == 'exact' else ''} | "
            f"{r['seconds']:.2f} |"
        )
    path = output_folder(RESULTS, args.smoke) / "unnormalized_directions.md"
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
