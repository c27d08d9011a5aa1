"""Ratio and likelihood estimators checked without MCMC, beside sbi's run_sbc with MCMC.

Task: theta ~ BoxUniform(-2, 2)^2, x ~ N(theta, 0.3^2 I). sbi 0.27 trains an NRE_C and an
NLE on the same 3,000 simulations (30 epochs at most). Each estimator is checked as
trained (tau = 1) and tempered, log r -> tau log r (or the log-likelihood), tau = 1.5
(over-confident) and 0.6 (under-confident), on fresh calibration pairs (N = 100 per
repetition), the same pairs for both libraries in the repetitions sbi runs:

* sbi: the posterior ``trainer.build_posterior(estimator)`` gives (an ``MCMCPosterior``,
  ``slice_np_vectorized``, 20 chains, 200 warmup steps: sbi's defaults), tempered through
  its potential; ``run_sbc(..., num_posterior_samples=100)`` (sbi's default is 1,000: ten
  times the time below) and ``check_sbc``; rejected when the smallest of the D marginal
  KS p-values times D is at most 0.05 (Bonferroni).
* ours: ``cl.KCCSD()``, ``cl.ImportanceCoverage`` twice: with the prior as proposal
  (``num_proposal_samples=4000``: fewer leave the median ESS under 50 here) and with
  ``proposal="adaptive"`` (1,000 draws, half of them fitting a Gaussian per pair), and,
  for the NRE, ``cl.RatioBalance()``, each at 0.05; "any": the Bonferroni combination of
  KCCSD, the adaptive coverage test and the balance. Seconds per check include KCCSD
  and the balance.

Run: ``PYTHONPATH=. python examples/benchmarks/unnormalized_vs_sbi.py`` (about 45 min on
one thread; result: results/unnormalized_vs_sbi.md); ``--smoke``: tiny sizes, seconds.
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import subprocess
import time
import warnings

import torch
from scipy import stats

import calib_lightning as cl
from examples._smoke import add_smoke_argument, output_folder

RESULTS = __file__.rsplit("/", 1)[0] + "/results"
S = 0.3
TAUS = (1.0, 1.5, 0.6)


def tempered_potential(potential, tau):
    """sbi's potential ``log r + log p`` (or ``log q + log p``) as ``tau log r + log p``."""
    base = type(potential)

    class Tempered(base):
        def __call__(self, theta, track_gradients=True):
            out = base.__call__(self, theta, track_gradients)
            log_p = self.prior.log_prob(theta)
            return tau * (out - log_p) + log_p

    copied = copy.copy(potential)
    copied.__class__ = Tempered
    return copied


def train(kind, prior, n, epochs):
    from sbi.inference import NLE, NRE_C

    g = torch.Generator().manual_seed(0)
    theta = prior.sample((n,))
    x = theta + S * torch.randn(theta.shape, generator=g)
    torch.manual_seed(0)
    trainer = (NRE_C if kind == "NRE_C" else NLE)(prior, show_progress_bars=False)
    estimator = trainer.append_simulations(theta, x).train(
        max_num_epochs=epochs, show_train_summary=False)
    return trainer, estimator


def ours(estimator, kind, tau, prior, theta, x, draws, adaptive_draws):
    """p-values of our checks and seconds: KCCSD, ImportanceCoverage with the prior
    (``draws``) and with the adaptive proposal (``adaptive_draws``), RatioBalance (NRE)."""
    trained = cl.as_posterior(estimator, prior=prior)
    post = cl.UnnormalizedPosterior(lambda t, xx: tau * trained.log_likelihood(t, xx),
                                    prior=prior)  # fmt: skip
    seconds = {}
    start = time.perf_counter()
    kccsd = cl.KCCSD()
    kccsd.update(post, theta, x)
    p = {"kccsd": float(kccsd.compute().p_value)}
    if kind == "NRE_C":
        balance = cl.RatioBalance()
        balance.update(post, theta, x)
        p["balance"] = float(balance.compute().p_value)
    shared = time.perf_counter() - start
    for name, kwargs in (("coverage", {"num_proposal_samples": draws}),
                         ("adaptive", {"num_proposal_samples": adaptive_draws,
                                       "proposal": "adaptive"})):  # fmt: skip
        start = time.perf_counter()
        cov = cl.ImportanceCoverage(**kwargs)
        cov.update(post, theta, x)
        out = cov.compute()
        p[name] = float(out.global_p_value) if out.cannot_judge is None else float("nan")
        seconds[name] = shared + time.perf_counter() - start
    finite = [v for k, v in p.items() if k != "coverage" and v == v]
    p["any"] = min(1.0, len(finite) * min(finite))
    return p, seconds


def sbi_check(posterior, theta, x, samples):
    from sbi.diagnostics import check_sbc, run_sbc

    start = time.perf_counter()
    ranks, dap = run_sbc(theta, x, posterior, num_posterior_samples=samples,
                         show_progress_bar=False)  # fmt: skip
    checks = check_sbc(ranks, theta, dap, num_posterior_samples=samples)
    p = float(checks["ks_pvals"].min()) * theta.shape[1]
    return min(1.0, p), time.perf_counter() - start


def interval(k, n):
    if n == 0:
        return "n/a"
    low, high = stats.binomtest(k, n).proportion_ci(0.95, method="exact")
    return f"{k / n:.2f} [{low:.2f}, {high:.2f}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=40, help="repetitions of ours")
    parser.add_argument("--sbi-reps", type=int, nargs=2, default=[3, 2],
                        help="repetitions of sbi's run_sbc per variant: NRE_C, NLE")
    parser.add_argument("--pairs", type=int, default=100)
    parser.add_argument("--sbi-samples", type=int, default=100)
    parser.add_argument("--draws", type=int, default=4000, help="prior draws per pair")
    parser.add_argument("--adaptive-draws", type=int, default=1000,
                        help="draws per pair of the adaptive proposal")
    add_smoke_argument(parser)
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    from sbi.inference import MCMCPosterior
    from sbi.utils import BoxUniform

    sims, epochs = 3000, 30
    if args.smoke:
        args.reps, args.sbi_reps, args.pairs, args.sbi_samples = 2, [1, 0], 20, 10
        sims, epochs, args.draws, args.adaptive_draws = 300, 2, 500, 200
    prior = BoxUniform(-2 * torch.ones(2), 2 * torch.ones(2))
    rows = []
    for kind, sbi_reps in zip(("NRE_C", "NLE"), args.sbi_reps, strict=True):
        trainer, estimator = train(kind, prior, sims, epochs)
        built = trainer.build_posterior(estimator)
        for i, tau in enumerate(TAUS if not args.smoke else TAUS[:2]):
            posterior = built if tau == 1.0 else MCMCPosterior(
                tempered_potential(built.potential_fn, tau), proposal=prior,
                theta_transform=built.theta_transform, method="slice_np_vectorized")  # fmt: skip
            gen = torch.Generator().manual_seed(1000 * i + (kind == "NLE"))
            counts = {}
            seconds = {"coverage": [], "adaptive": [], "sbi": []}
            for rep in range(max(args.reps, sbi_reps)):
                theta = torch.rand(args.pairs, 2, generator=gen) * 4 - 2  # the prior
                x = theta + S * torch.randn(theta.shape, generator=gen)
                if rep < args.reps:
                    p, sec = ours(estimator, kind, tau, prior, theta, x, args.draws,
                                  args.adaptive_draws)  # fmt: skip
                    for name, value in sec.items():
                        seconds[name].append(value)
                    for name, value in p.items():
                        n_done, k = counts.get(name, (0, 0))
                        judged = value == value
                        counts[name] = (n_done + judged, k + (judged and value <= 0.05))
                if rep < sbi_reps:
                    p_sbi, sec = sbi_check(posterior, theta, x, args.sbi_samples)
                    seconds["sbi"].append(sec)
                    n_done, k = counts.get("sbi", (0, 0))
                    counts["sbi"] = (n_done + 1, k + (p_sbi <= 0.05))
                    print(kind, tau, "sbi rep", rep, f"p={p_sbi:.3g}", f"{sec:.1f} s", flush=True)
            rows.append((kind, tau, counts, seconds))
            print(kind, tau, counts, flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, check=False).stdout.strip()  # fmt: skip
    load = os.getloadavg()[0]
    lines = [
        "# Ratio and likelihood estimators without MCMC, beside sbi's run_sbc with MCMC",
        "",
        f"Command: `PYTHONPATH=. python examples/benchmarks/unnormalized_vs_sbi.py` at commit "
        f"{commit}, {time.strftime('%Y-%m-%d')}. Machine: {platform.machine()}, 2 cores shared "
        f"with other jobs (load {load:.1f} at the end), one torch thread for both libraries, "
        f"torch {torch.__version__}.",
        "",
        f"{__doc__.split(chr(10), 2)[2].split('Run:')[0].strip()}",
        "",
        "Rejection rates at 0.05 with exact 95 % binomial intervals (tau = 1: the trained "
        "estimator, whose true rate is unknown; tau = 1.5 and 0.6: power against a known "
        "miscalibration of it). Seconds: mean per check of N pairs; the ratio is sbi's time "
        "over ours, both measured in this run.",
        "",
        "| estimator | tau | sbi run_sbc + check_sbc (MCMC) | ours: KCCSD | ours: coverage, "
        f"prior, {args.draws:,} | ours: coverage, adaptive, {args.adaptive_draws:,} | "
        "ours: balance | ours: any (Bonferroni of KCCSD, adaptive coverage, balance) | sbi s | "
        "ours s (prior) | ours s (adaptive) | sbi / ours (prior) | sbi / ours (adaptive) |",
        "| --- | ---: | --- | --- | --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for kind, tau, counts, seconds in rows:
        cell = {name: interval(counts[name][1], counts[name][0]) if name in counts else "n/a"
                for name in ("sbi", "kccsd", "coverage", "adaptive", "balance", "any")}  # fmt: skip
        mean = {name: sum(v) / len(v) if v else float("nan") for name, v in seconds.items()}
        lines.append(
            f"| {kind} | {tau:g} | {cell['sbi']} | {cell['kccsd']} | {cell['coverage']} | "
            f"{cell['adaptive']} | {cell['balance']} | {cell['any']} | {mean['sbi']:.1f} | "
            f"{mean['coverage']:.3f} | {mean['adaptive']:.3f} | "
            f"{mean['sbi'] / mean['coverage']:.0f} | {mean['sbi'] / mean['adaptive']:.0f} |"
        )
    path = output_folder(RESULTS, args.smoke) / "unnormalized_vs_sbi.md"
    path.write_text("\n".join(lines) + "\n")
    print(path.read_text())


if __name__ == "__main__":
    main()
