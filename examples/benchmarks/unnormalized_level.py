"""Level and power of the checks of unnormalized posteriors, through the public classes.

The posterior is known only up to its constant, ``exp f(theta, x) p(theta)``, with the
Gaussian likelihood ``x ~ N(theta, 0.5^2 I)`` and a box prior ``U(-2, 2)^D`` or a standard
normal prior, D = 1, 2, 5. Each row runs ``cl.KCCSD()`` and ``cl.ImportanceCoverage()`` with
their default arguments (KCCSD's default seed 0; ImportanceCoverage's prior proposal and
1,000 draws) on R fresh datasets of N pairs, as a user runs them one dataset at a time.

* Level rows: the exact ``f`` (the true log-likelihood); the 99 % binomial band of the
  rejection rate at 0.05 beside it.
* "theta space": KCCSD on the box posterior without the unconstrained transform (the
  untruncated Gaussian ``N(x, 0.5^2)``, whose score is the box posterior's inside the box).
* "proposal": ImportanceCoverage with ``proposal=`` a Gaussian ``N(x, 1)`` in place of the
  prior, for D = 5, where the prior as proposal leaves a median ESS of a few draws and the
  metric says it cannot judge (the share of datasets it could not judge is a column).
* "adaptive": ImportanceCoverage with ``proposal="adaptive"`` (a Gaussian fitted per pair
  from x alone, mixed with the prior; other arguments at their defaults), level at
  D = 1, 2, 5 and power at D = 5, where the prior as proposal cannot judge.
* Power rows: ``tau * f`` (tau = 1.5 over-confident, 0.6 under-confident) and a shifted
  likelihood ``f(theta - 0.25, x)`` (the posterior moved by 0.25 in every coordinate);
  ``coverage < 0`` is the share of rejections whose coverage error is negative
  (over-confident by the package's convention).

Run: ``PYTHONPATH=. python examples/benchmarks/unnormalized_level.py`` (about 35 min on
one thread; result: results/unnormalized_level.md); ``--only-adaptive``: the adaptive rows
alone (about 8 min; results/unnormalized_level_adaptive.md); ``--smoke``: a few rows of 3
datasets.
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


def prior_of(kind: str, d: int) -> Independent:
    if kind == "box":
        return Independent(Uniform(-2 * torch.ones(d), 2 * torch.ones(d)), 1)
    return Independent(Normal(torch.zeros(d), torch.ones(d)), 1)


def log_lik(tau: float = 1.0, shift: float = 0.0):
    def f(theta, x):
        return -0.5 * tau * (((x - theta + shift) / SIGMA) ** 2).sum(-1)

    return f


def proposal(x):
    return Independent(Normal(x, torch.ones_like(x)), 1)


def untruncated(x):
    return Independent(Normal(x, SIGMA * torch.ones_like(x)), 1)


def run_row(kind, d, reps, n, seed, *, tau=1.0, shift=0.0, theta_space=False, use_proposal=False,
            adaptive=False):  # fmt: skip
    prior = prior_of(kind, d)
    post = cl.UnnormalizedPosterior(log_lik(tau, shift), prior=prior)
    torch.manual_seed(seed)
    kccsd_rej = ic_rej = ic_judged = ic_negative = 0
    seconds = {"kccsd": 0.0, "coverage": 0.0}
    for _ in range(reps):
        theta = prior.sample((n,))
        x = theta + SIGMA * torch.randn_like(theta)
        start = time.perf_counter()
        metric = cl.KCCSD()
        metric.update(untruncated if theta_space else post, theta, x)
        kccsd_rej += float(metric.compute().p_value) <= 0.05
        seconds["kccsd"] += time.perf_counter() - start
        if theta_space:
            continue
        start = time.perf_counter()
        cov = cl.ImportanceCoverage(proposal=proposal if use_proposal else
                                    "adaptive" if adaptive else None)  # fmt: skip
        cov.update(post, theta, x)
        out = cov.compute()
        seconds["coverage"] += time.perf_counter() - start
        if out.cannot_judge is None:
            ic_judged += 1
            if float(out.global_p_value) <= 0.05:
                ic_rej += 1
                ic_negative += float(out.coverage_error) < 0
    return {
        "kccsd": kccsd_rej / reps,
        "coverage": None if theta_space else (ic_rej / ic_judged if ic_judged else float("nan")),
        "judged": None if theta_space else ic_judged / reps,
        "negative": ic_negative / ic_rej if ic_rej else float("nan"),
        "seconds": {k: v / reps for k, v in seconds.items()},
    }


def adaptive_rows(args):
    """Level (D = 1, 2, 5, both priors) and power (D = 5) with ``proposal="adaptive"``."""
    rows = []
    for i, (kind, d) in enumerate([("box", 5)] if args.smoke else
                                  [(k, d) for k in ("box", "gaussian") for d in (1, 2, 5)]):
        result = run_row(kind, d, args.reps, args.pairs, 500 + i, adaptive=True)
        rows.append(("exact, adaptive", kind, d, args.pairs, args.reps, result))
        print(rows[-1], flush=True)
    cases = [("tau = 1.5, adaptive", {"tau": 1.5}), ("tau = 0.6, adaptive", {"tau": 0.6}),
             ("shift 0.25, adaptive", {"shift": 0.25})]  # fmt: skip
    for name, kwargs in cases[:1] if args.smoke else cases:
        for kind in ("box",) if args.smoke else ("box", "gaussian"):
            result = run_row(kind, 5, args.power_reps, args.pairs, 600, adaptive=True, **kwargs)
            rows.append((name, kind, 5, args.pairs, args.power_reps, result))
            print(rows[-1], flush=True)
    return rows


def band(reps):
    low, high = stats.binom.interval(0.99, reps, 0.05)
    return f"[{low / reps:.3f}, {high / reps:.3f}]"


def fmt(value):
    return "" if value is None else "n/a" if value != value else f"{value:.3f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=400)
    parser.add_argument("--power-reps", type=int, default=100)
    parser.add_argument("--pairs", type=int, default=100)
    parser.add_argument("--power-pairs", type=int, nargs="+", default=[100, 500])
    parser.add_argument("--only-adaptive", action="store_true",
                        help="the adaptive proposal's rows alone")
    add_smoke_argument(parser)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.smoke:
        args.reps, args.power_reps, args.pairs, args.power_pairs = 3, 3, 30, [30]
    rows = []
    level = [(k, d) for k in ("box", "gaussian") for d in (1, 2, 5)]
    for i, (kind, d) in enumerate([] if args.only_adaptive else level[:1] if args.smoke else
                                  level):  # fmt: skip
        rows.append(("exact", kind, d, args.pairs, args.reps,
                     run_row(kind, d, args.reps, args.pairs, 100 + i)))  # fmt: skip
        print(rows[-1], flush=True)
    if not args.smoke and not args.only_adaptive:
        for d in (1, 2, 5):
            result = run_row("box", d, args.reps, args.pairs, 200 + d, theta_space=True)
            rows.append(("exact, theta space", "box", d, args.pairs, args.reps, result))
            print(rows[-1], flush=True)
        for kind in ("box", "gaussian"):
            result = run_row(kind, 5, args.reps, args.pairs, 300, use_proposal=True)
            rows.append(("exact, proposal N(x, 1)", kind, 5, args.pairs, args.reps, result))
            print(rows[-1], flush=True)
    cases = [("tau = 1.5", {"tau": 1.5}), ("tau = 0.6", {"tau": 0.6}),
             ("shift 0.25", {"shift": 0.25})]  # fmt: skip
    for name, kwargs in [] if args.only_adaptive else cases[:1] if args.smoke else cases:
        for n in args.power_pairs:
            for d in (1, 2) if not args.smoke else (1,):
                result = run_row("box", d, args.power_reps, n, 400 + n + d, **kwargs)
                rows.append((name, "box", d, n, args.power_reps, result))
                print(rows[-1], flush=True)
    rows += adaptive_rows(args)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, check=False).stdout.strip()  # fmt: skip
    lines = [
        "# Unnormalized posteriors: level and power of KCCSD and ImportanceCoverage",
        "",
        f"Command: `PYTHONPATH=. python examples/benchmarks/unnormalized_level.py` at commit "
        f"{commit}, {time.strftime('%Y-%m-%d')}. Machine: {platform.machine()}, 2 cores shared "
        f"with other jobs, one torch thread, torch {torch.__version__}.",
        "",
        "Public classes at their default arguments (`cl.KCCSD()`, `cl.ImportanceCoverage()`; "
        "`proposal=\"adaptive\"` in the adaptive rows),"
        " one fresh dataset of N pairs per repetition, `x ~ N(theta, 0.5^2 I)`, box prior "
        "`U(-2, 2)^D` or `N(0, I)`. Rejection rates at 0.05. ImportanceCoverage's rate is over"
        " the datasets it could judge (median ESS >= 50); `judged` is their share, "
        "`coverage < 0` the share of its rejections with a negative coverage error "
        "(over-confident). Seconds: mean per dataset.",
        "",
        "| case | prior | D | N | datasets | KCCSD | ImportanceCoverage | judged | coverage < 0 "
        "| 99 % band at the level | KCCSD s | coverage s |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: |",
    ]
    for case, kind, d, n, reps, r in rows:
        lines.append(
            f"| {case} | {kind} | {d} | {n} | {reps} | {fmt(r['kccsd'])} | {fmt(r['coverage'])} "
            f"| {fmt(r['judged'])} | {fmt(r['negative'] if r['coverage'] is not None else None)} "
            f"| {band(reps) if case.startswith('exact') else ''} | {r['seconds']['kccsd']:.3f} "
            f"| {r['seconds']['coverage']:.3f} |"
        )
    name = "unnormalized_level_adaptive.md" if args.only_adaptive else "unnormalized_level.md"
    if args.only_adaptive:
        lines[0] += ": the adaptive proposal"
        lines[2] = lines[2].replace("unnormalized_level.py`", "unnormalized_level.py "
                                    "--only-adaptive`")  # fmt: skip
    path = output_folder(RESULTS, args.smoke) / name
    path.write_text("\n".join(lines) + "\n")
    print(path.read_text())


if __name__ == "__main__":
    main()
