"""RankCalibration against sbi's run_sbc + check_sbc, and against the cost of sampling.

Toy: theta ~ N(0, I_2), x = theta + N(0, 0.5^2 I); exact posterior N(0.8 x, 0.2 I) and a
variance-inflated (x2) one; N in {1000, 5000} calibration pairs, M = 1000 draws each.

Timed in one run as CPU time of this process (``time.process_time``), single-threaded,
so that other processes on a shared machine barely move the numbers; of ours, the
repeat with the median ``update / floor`` of --repeats is reported:

* floor: drawing the samples the check needs: the time spent inside the posterior's
  ``sample_and_log_prob`` (M draws per pair) and ``log_prob`` (at the truth) during
  the update, measured by a wrapper around the posterior, so floor and update come
  from the same calls;
* sampling alone: the same chunks drawn by ``evaluation.draw_chunks`` and dropped, no
  ranking (what the update would cost with free ranks: the floor plus allocating,
  freeing and sizing the chunks);
* ours: ``RankCalibration.update`` (sampling, ranks, histograms, moments) and
  ``compute`` (chi-square and exact ECDF tests, simultaneous band; its cache is
  cleared before each repeat so the band is paid for every time);
* sbi 0.27: ``run_sbc`` for the marginal ranks, ``run_sbc(reduce_fns=log_prob)`` for
  the expected-coverage ranks, and ``check_sbc`` (KS, C2ST on ranks, C2ST prior vs
  data-averaged posterior), each timed once (sampling included).

Ratios: ``update / floor``, ``update / sampling alone`` and ``(update + compute) /
floor``; the goal is ``update / floor`` <= 1.10.
``compute`` is a fixed cost (tests and the exact simultaneous band: it grows with N
and the number of ECDF levels, not with M or the sampler's cost, and the band is
cached across computes with the same N). A last row times the same check on an
untrained zuko NSF posterior (N = 250), where drawing a sample costs what it does
for a real neural posterior (ratio only; calibration there is meaningless).

Run:  python examples/benchmarks/ranks_vs_sbi.py [--sizes 1000 5000]
Writes examples/benchmarks/results/ranks_vs_sbi.md (``--smoke``: N = 100, M = 100, one
repeat, written to a temporary folder).
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

if not __package__:  # run as a file (python examples/x.py): make `examples` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch

import calib_lightning as cl
from calib_lightning.evaluation import draw_chunks
from calib_lightning.functional import bands
from calib_lightning.tasks import GaussianToy
from examples._smoke import add_smoke_argument, output_folder

RESULTS = Path(__file__).parent / "results"
M = 1000
FLOW_PAIRS = 250


class SbiPosterior:
    """The two methods sbi's ``run_sbc`` calls on a posterior, over a toy model."""

    def __init__(self, model):
        self.model = model

    def sample_batched(self, sample_shape, x, show_progress_bars=False, **kwargs):
        return self.model(x).sample(sample_shape)

    def log_prob(self, theta, x):  # run_sbc passes one observation x of shape (X,)
        return self.model(x.reshape(-1, x.shape[-1])).log_prob(theta)


def timed(fn):
    start = time.process_time()
    out = fn()
    return time.process_time() - start, out


class TimedPosterior(cl.Posterior):
    """Forwards to a posterior and adds up the CPU time spent drawing from it."""

    def __init__(self, posterior):
        super().__init__(posterior)
        self.inner, self.seconds = cl.as_posterior(posterior), 0.0

    def sample_and_log_prob(self, x, num_samples):
        seconds, out = timed(lambda: self.inner.sample_and_log_prob(x, num_samples))
        self.seconds += seconds
        return out

    def log_prob(self, theta, x):
        seconds, out = timed(lambda: self.inner.log_prob(theta, x))
        self.seconds += seconds
        return out


def ours(posterior, theta, x):
    """CPU seconds of sampling (the floor), update and compute, the result, and the CPU
    seconds of drawing the same chunks alone (no ranking)."""
    metric = cl.RankCalibration(num_posterior_samples=M)
    timed_posterior = TimedPosterior(posterior)
    t_update, _ = timed(lambda: metric.update(timed_posterior, theta, x))
    bands._adjusted_gamma.cache_clear()
    t_compute, out = timed(metric.compute)
    t_alone, _ = timed(lambda: sum(1 for _ in draw_chunks(posterior, theta, x, M)))
    return timed_posterior.seconds, t_update, t_compute, out, t_alone


def median(runs):
    """The repeat with the median update / floor ratio."""
    return sorted(runs, key=lambda run: run[1] / run[0])[len(runs) // 2]


def sbi_check(posterior, theta, x):
    from sbi.diagnostics.sbc import check_sbc, check_uniformity_frequentist, run_sbc

    sbi_post = SbiPosterior(posterior)
    prior = torch.randn(theta.shape, generator=torch.Generator().manual_seed(1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t_sample, _ = timed(lambda: sbi_post.sample_batched((M,), x))
        t_marg, (ranks, dap) = timed(lambda: run_sbc(
            theta, x, sbi_post, M, show_progress_bar=False))  # fmt: skip
        t_cov, (cov_ranks, _) = timed(lambda: run_sbc(
            theta, x, sbi_post, M, reduce_fns=sbi_post.log_prob,
            show_progress_bar=False))  # fmt: skip
        t_check, checks = timed(lambda: check_sbc(ranks, prior, dap, M))
        t_cov_ks, cov_ks = timed(lambda: check_uniformity_frequentist(cov_ranks, M))
    return {
        "sample": t_sample, "marginal": t_marg, "coverage": t_cov, "check": t_check,
        "coverage_ks": t_cov_ks, "ks": checks["ks_pvals"], "c2st_ranks": checks["c2st_ranks"],
        "c2st_dap": checks["c2st_dap"], "cov_ks": cov_ks,
    }  # fmt: skip


def fmt(values):
    return ", ".join(f"{float(v):.2g}" for v in torch.as_tensor(values).flatten())


def main(argv: list[str] | None = None) -> None:
    global M, FLOW_PAIRS
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", type=int, nargs="+", default=[1000, 5000])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--skip-sbi", action="store_true")
    parser.add_argument("--skip-flow", action="store_true")
    add_smoke_argument(parser)
    args = parser.parse_args(argv)
    if args.smoke:
        args.sizes, args.repeats, M, FLOW_PAIRS = [100], 1, 100, 20
    torch.set_num_threads(args.threads)
    args.results = output_folder(RESULTS, args.smoke)
    toy = GaussianToy(dim=2, noise_std=0.5)
    models = {"exact": toy.posterior(), "variance x2": toy.posterior(variance_scale=2.0)}
    speed, detect = [], []
    for n in args.sizes:
        theta, x = toy.sample(n, torch.Generator().manual_seed(n))
        for name, model in models.items():
            torch.manual_seed(0)
            f, u, c, out, a = median([ours(model, theta, x) for _ in range(args.repeats)])
            skip = args.skip_sbi or (args.smoke and name != "exact")  # smoke: sbi runs once
            sbi = None if skip else sbi_check(model, theta, x)
            speed.append((n, name, f, a, u, c, sbi))
            detect.append((n, name, out, sbi))
            print(f"N={n} {name}: floor {f:.3f}s alone {a:.3f}s update {u:.3f}s compute "
                  f"{c:.3f}s ratio {u / f:.3f} / {u / a:.3f} / {(u + c) / f:.3f}",
                  flush=True)  # fmt: skip
    flow_row = None if args.skip_flow else flow_ratio(min(args.repeats, 3))
    write(speed, detect, args, flow_row)


def flow_ratio(repeats):
    import zuko

    torch.manual_seed(0)
    flow = zuko.flows.NSF(2, 2, transforms=3, hidden_features=(64, 64)).eval()
    theta, x = GaussianToy(dim=2).sample(FLOW_PAIRS, torch.Generator().manual_seed(3))
    f, u, c, _, a = median([ours(flow, theta, x) for _ in range(repeats)])
    print(f"zuko NSF N={FLOW_PAIRS}: floor {f:.3f}s alone {a:.3f}s update {u:.3f}s compute "
          f"{c:.3f}s ratio {u / f:.3f} / {u / a:.3f} / {(u + c) / f:.3f}", flush=True)  # fmt: skip
    return FLOW_PAIRS, "zuko NSF (untrained)", f, a, u, c


def write(speed, detect, args, flow_row) -> None:
    lines = [
        "# RankCalibration vs sbi 0.27 `run_sbc` + `check_sbc`",
        "",
        f"Toy theta ~ N(0, I_2), x = theta + N(0, 0.25 I), M = {M} draws per pair; "
        f"{args.threads} thread(s), CPU seconds of the process (`time.process_time`); "
        f"ours: the median of {args.repeats} repeats (by update / floor), sbi timed once. "
        "Produced by "
        "`PYTHONPATH=. python examples/benchmarks/ranks_vs_sbi.py`.",
        "",
        "## CPU time (seconds)",
        "",
        "| N | posterior | floor: sampling inside update | sampling alone: the same chunks "
        "| ours: update | ours: compute | update / floor | update / sampling alone "
        "| (update + compute) / floor | sbi: sampling | sbi: run_sbc marginals | "
        "sbi: run_sbc coverage | sbi: check_sbc |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for n, name, f, a, u, c, sbi in speed:
        tail = ("| - | - | - | - |" if sbi is None else
                f"| {sbi['sample']:.3f} | {sbi['marginal']:.2f} | {sbi['coverage']:.2f} "
                f"| {sbi['check'] + sbi['coverage_ks']:.2f} |")  # fmt: skip
        lines.append(f"| {n} | {name} | {f:.3f} | {a:.3f} | {u:.3f} | {c:.3f} | {u / f:.3f} "
                     f"| {u / a:.3f} | {(u + c) / f:.3f} {tail}")  # fmt: skip
    if flow_row is not None:
        n, name, f, a, u, c = flow_row
        lines.append(f"| {n} | {name} | {f:.3f} | {a:.3f} | {u:.3f} | {c:.3f} | {u / f:.3f} "
                     f"| {u / a:.3f} | {(u + c) / f:.3f} | - | - | - | - |")  # fmt: skip
    lines += [
        "",
        "## What each detects (p-values; small = miscalibrated)",
        "",
        "| N | posterior | ours: joint energy p (chi2) | ours: marginal p (chi2) "
        "| ours: ECDF-band p (dims, joint) | ours: coverage_error | ours: contraction "
        "| sbi: KS p (marginals) | sbi: C2ST ranks acc. | sbi: C2ST prior vs DAP acc. "
        "| sbi: KS p (coverage ranks) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for n, name, out, sbi in detect:
        tail = ("| - | - | - | - |" if sbi is None else
                f"| {fmt(sbi['ks'])} | {fmt(sbi['c2st_ranks'])} | {fmt(sbi['c2st_dap'])} "
                f"| {fmt(sbi['cov_ks'])} |")  # fmt: skip
        lines.append(
            f"| {n} | {name} | {fmt(out.p_value)} | {fmt(out.marginal_p_values)} "
            f"| {fmt(out.ecdf_p_values)} | {float(out.coverage_error):+.3f} "
            f"| {fmt(out.contraction)} {tail}"
        )
    (args.results / "ranks_vs_sbi.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print("wrote", args.results / "ranks_vs_sbi.md")


if __name__ == "__main__":
    main()
