"""Level and power audit of every calibration test the package offers.

Each test runs as users run it after training: one fresh metric object per calibration
set, built with its DEFAULT arguments (default seed included), on a fresh calibration
set drawn from a model whose exact posterior is known. Under H0 (the exact posterior)
the rejection rate at alpha = 0.05 must lie in the 99 % binomial band of the number of
datasets; under three alternatives (over-confident, under-confident, biased) it is the
power.

Models (N calibration pairs per dataset, O reference observations for the local tests):

* ``corr2``: Gaussian linear, D = 2, prior N(0, [[1, .8], [.8, 1]]), x = theta + N(0, .25 I);
  correlated Gaussian posterior (MultivariateNormal).
* ``flow2``: non-Gaussian. A zuko MAF trained briefly on Two Moons defines the joint
  x ~ Two Moons simulator, theta ~ q_flow(. | x); the flow is then exactly the posterior
  of that joint, so calibrated by construction (theta drawn in float64, see
  ``FlowJoint``; the tests get the float32 flow, as users do). (MAF, not NSF: zuko's spline inverse
  makes NSF sampling about 5x slower, and the sampling tests draw 10^6 points per set.)
* ``diag6``: Gaussian linear, D = 6, prior variances 0.5 .. 2, x = theta + N(0, .25 I);
  diagonal Gaussian posterior, so the closed-form SKCE test applies too.

Alternatives (posterior given to the tests; data always from the true joint):
over-confident = variance x 0.5, under-confident = variance x 2 (for the flow: base
N(0, s^2 I) with s^2 = 0.5 or 2, a temperature in latent space), biased = mean + 0.5
posterior standard deviation in every dimension (flow: theta shifted by 0.5 x the
average marginal posterior sd).

Tests and p-values: KCCSD ``p_value``; SKCE (``baselines.skce_test`` on
``skce_matrix_gaussian``, defaults; diagonal Gaussian posteriors only); RankCalibration
``p_value`` (joint energy rank), ``marginal_p_values``, ``ecdf_p_values`` (marginals,
then joint), ``global_p_value``; TARP ``p_value`` (one test, so no global p-value);
LC2ST and LC2STNF ``p_value`` per observation and ``global_p_value``. A key a metric does
not return is reported as n/a.

Cost (CPU seconds of one metric on one dataset, N = 500, one thread, measured in the
committed run): KCCSD 0.02-0.03, SKCE 0.06, RankCalibration 0.04-0.07 and TARP 0.06-0.09
on the Gaussians but 1.6 and 1.1 on the flow (5 x 10^5 MAF draws), LC2ST and LC2STNF
about 0.8 (a fresh null per dataset). Hence the "heavy" tests (LC2ST, LC2STNF, and the
flow's RankCalibration and TARP) run 200 datasets under H0 but only
--heavy-power-datasets per alternative, each rate with the band for its own number.
The defaults took about 25 minutes with 2 workers on 2 cores.

Run:   python examples/benchmarks/level_audit.py [--datasets 200] [--n 500]
       [--power-datasets 100] [--heavy-datasets 200] [--heavy-power-datasets 20]
       [--models corr2 flow2 diag6] [--only ranks tarp] [--workers 2] [--smoke]
Writes examples/benchmarks/results/level_audit.md (``--smoke``: tiny sizes and reduced
metric settings, only to exercise the code; prints the table and writes nothing unless
``--output`` is given).
"""

from __future__ import annotations

import argparse
import copy
import io
import math
import multiprocessing as mp
import os
import platform
import sys
import time
from collections import defaultdict
from datetime import datetime, timezone
from pathlib import Path

import torch
from scipy import stats
from torch.distributions import Distribution, Independent, MultivariateNormal, Normal

import calib_lightning as cl
from calib_lightning.baselines import skce_matrix_gaussian, skce_test
from calib_lightning.tasks import TwoMoons

RESULTS = Path(__file__).parent / "results" / "level_audit.md"
ALPHA = 0.05
TESTS = ("kccsd", "skce", "ranks", "tarp", "lc2st", "lc2stnf")
LOCAL_TESTS = ("lc2st", "lc2stnf")
SAMPLING_TESTS = ("ranks", "tarp")  # 10^6 posterior draws per dataset: heavy for the flow
MODELS = ("corr2", "flow2", "diag6")
VARIANTS = {  # name: (variance scale, shift in posterior sds)
    "calibrated": (1.0, 0.0),
    "over-confident": (0.5, 0.0),
    "under-confident": (2.0, 0.0),
    "biased": (1.0, 0.5),
}


# -- models ----------------------------------------------------------------------------
class LinearGaussian:
    """theta ~ N(0, prior_cov), x = theta + noise_std * N(0, I); exact Gaussian posterior."""

    def __init__(self, prior_cov: torch.Tensor, noise_std: float = 0.5) -> None:
        self.prior_cov = prior_cov.double()
        self.dim = prior_cov.shape[0]
        self.noise_std = noise_std
        self.prior_tril = torch.linalg.cholesky(self.prior_cov)
        eye = torch.eye(self.dim, dtype=torch.float64)
        self.cov = torch.linalg.inv(torch.linalg.inv(self.prior_cov) + eye / noise_std**2)
        self.gain = self.cov / noise_std**2  # posterior mean = gain @ x
        self.diagonal = bool((self.cov - torch.diag(self.cov.diagonal())).abs().max() < 1e-12)

    def sample(self, n: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        theta = torch.randn(n, self.dim, generator=generator, dtype=torch.float64)
        theta = theta @ self.prior_tril.T
        noise = torch.randn(n, self.dim, generator=generator, dtype=torch.float64)
        return theta.float(), (theta + self.noise_std * noise).float()

    def sample_x(self, n: int, generator: torch.Generator) -> torch.Tensor:
        return self.sample(n, generator)[1]

    def posterior(self, variance_scale: float = 1.0, shift: float = 0.0):
        sd = self.cov.diagonal().sqrt()
        offset = (shift * sd).float()
        gain = self.gain.float()
        if self.diagonal:
            std = (variance_scale**0.5 * sd).float()

            def diagonal(x: torch.Tensor) -> Distribution:
                return Independent(Normal(x @ gain.T + offset, std.expand(x.shape[0], -1)), 1)

            return diagonal
        tril = (variance_scale**0.5 * torch.linalg.cholesky(self.cov)).float()

        def full(x: torch.Tensor) -> Distribution:
            return MultivariateNormal(x @ gain.T + offset, scale_tril=tril)

        return full


class FlowJoint:
    """x ~ Two Moons simulator, theta ~ q_flow(. | x): the flow is the exact posterior."""

    def __init__(self, state: dict | None = None, steps: int = 1500) -> None:
        import zuko

        torch.manual_seed(0)
        self.flow = zuko.flows.MAF(2, 2, transforms=3, hidden_features=(32, 32))
        self.task = TwoMoons()
        if state is None:
            self._train(steps)
        else:
            self.flow.load_state_dict(state)
        self.flow.eval()
        for p in self.flow.parameters():
            p.requires_grad_(False)
        # The joint's theta are drawn by a float64 copy: float32 inverse passes of the
        # MAF are off by enough that KCCSD at N = 1000 rejects them (10 of 12 datasets).
        self.flow64 = copy.deepcopy(self.flow).double()
        with torch.no_grad():  # average marginal posterior sd, the unit of the bias
            x = self.sample_x(256, torch.Generator().manual_seed(1))
            self.sd = self.flow(x).sample((256,)).std(0).mean(0)
        self.dim = 2

    def _train(self, steps: int) -> None:
        g = torch.Generator().manual_seed(0)
        opt = torch.optim.Adam(self.flow.parameters(), lr=3e-3)
        for _ in range(steps):
            theta, x = self.task.sample(512, g)
            loss = -self.flow(x).log_prob(theta).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()

    def sample_x(self, n: int, generator: torch.Generator) -> torch.Tensor:
        return self.task.sample(n, generator)[1]

    def sample(self, n: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.sample_x(n, generator)
        with torch.no_grad():
            theta = self.flow64(x.double()).sample()  # global RNG, seeded per dataset
        return theta.float(), x

    def posterior(self, variance_scale: float = 1.0, shift: float = 0.0):
        if variance_scale == 1.0 and shift == 0.0:
            return self.flow
        from zuko.distributions import DiagNormal, NormalizingFlow
        from zuko.transforms import ComposedTransform, DependentTransform
        from zuko.transforms import MonotonicAffineTransform as Affine

        flow, scale, offset = self.flow, variance_scale**0.5, shift * self.sd

        def perturbed(x: torch.Tensor) -> Distribution:
            d = flow(x)
            zero = torch.zeros(x.shape[0], 2)
            transform = d.transform  # theta -> z; theta - offset -> z shifts q by +offset
            if shift:
                move = DependentTransform(Affine(-offset.expand(x.shape[0], 2), zero), 1)
                transform = ComposedTransform(move, transform)
            return NormalizingFlow(transform, DiagNormal(zero, scale + zero))

        return perturbed


def build_model(name: str, flow_state: dict | None = None, flow_steps: int = 1500):
    if name == "corr2":
        return LinearGaussian(torch.tensor([[1.0, 0.8], [0.8, 1.0]]))
    if name == "diag6":
        return LinearGaussian(torch.diag(torch.linspace(0.5, 2.0, 6)))
    if name == "flow2":
        return FlowJoint(flow_state, flow_steps)
    raise ValueError(f"unknown model {name!r}; choose from {MODELS}")


# -- one dataset, one test -----------------------------------------------------------------
def _scalar(out: dict, key: str) -> float:
    value = out.get(key)
    return math.nan if value is None else float(value)


def run_test(test: str, model, posterior, theta, x, observations, smoke: bool) -> dict:
    """Named p-values of one test on one calibration set (NaN: key not returned)."""
    small = {"num_posterior_samples": 100} if smoke else {}
    local = {"num_null": 19, "num_posterior_samples": 500} if smoke else {}
    if test == "kccsd":
        out = cl.KCCSD(**({"num_null": 99} if smoke else {}))
        out.update(posterior, theta, x)
        return {"p_value": float(out.compute().p_value)}
    if test == "skce":
        if not getattr(model, "diagonal", False):
            return {}
        dist = posterior(x)
        out = skce_test(skce_matrix_gaussian(theta, dist.mean, dist.variance))
        return {"p_value": float(out.p_value)}
    if test in ("ranks", "tarp"):
        metric = cl.RankCalibration(**small) if test == "ranks" else cl.TARP(**small)
        metric.update(posterior, theta, x)
        out = metric.compute()
        result = {"p_value": _scalar(out, "p_value")}
        if test == "ranks":
            for d, p in enumerate(out.marginal_p_values.tolist()):
                result[f"marginal_p_values[{d}]"] = p
            ecdf = out.ecdf_p_values.tolist()
            for d, p in enumerate(ecdf[:-1]):
                result[f"ecdf_p_values[{d}]"] = p
            result["ecdf_p_values[joint]"] = ecdf[-1]
            result["global_p_value"] = _scalar(out, "global_p_value")
        return result  # TARP runs one test: its p_value is the verdict
    metric_cls = cl.LC2ST if test == "lc2st" else cl.LC2STNF
    metric = metric_cls(observations=observations, **local)
    metric.update(posterior, theta, x)
    out = metric.compute()
    result = {f"p_value[obs {o}]": p for o, p in enumerate(out.p_value.tolist())}
    result["global_p_value"] = _scalar(out, "global_p_value")
    return result


# -- workers -------------------------------------------------------------------------------
_STATE: dict = {}


def _init(flow_state: dict | None, threads: int, sizes: dict) -> None:
    torch.set_num_threads(threads)
    _STATE.update(flow_state=flow_state, sizes=sizes, models={})


def _model(name: str):
    if name not in _STATE["models"]:
        _STATE["models"][name] = build_model(name, _STATE["flow_state"])
    return _STATE["models"][name]


def _dataset_seed(model: str, rep: int) -> int:
    return 1_000_003 * (MODELS.index(model) + 1) + rep


def run_job(job: tuple) -> tuple:
    model_name, test, variant, reps = job
    sizes = _STATE["sizes"]
    model = _model(model_name)
    posterior = model.posterior(*VARIANTS[variant])
    results, seconds, cpu = defaultdict(list), 0.0, 0.0
    for rep in reps:
        seed = _dataset_seed(model_name, rep)
        g = torch.Generator().manual_seed(seed)
        torch.manual_seed(seed)  # model draws and the metrics' sampling use the global RNG
        theta, x = model.sample(sizes["n"], g)
        observations = model.sample_x(sizes["observations"], g)
        start, start_cpu = time.perf_counter(), time.process_time()
        out = run_test(test, model, posterior, theta, x, observations, sizes["smoke"])
        seconds += time.perf_counter() - start
        cpu += time.process_time() - start_cpu
        for key, p in out.items():
            results[key].append(p)
    return model_name, test, variant, dict(results), (seconds, cpu), len(reps)


# -- summary -------------------------------------------------------------------------------
def band(n: int, alpha: float = ALPHA, coverage: float = 0.99) -> tuple[float, float]:
    """Central ``coverage`` binomial range of the rejection rate of ``n`` level-alpha tests."""
    tail = (1 - coverage) / 2
    return stats.binom.ppf(tail, n, alpha) / n, stats.binom.ppf(1 - tail, n, alpha) / n


def summarize(pvals: list[float]) -> tuple[float, float, int]:
    """Rejection rate at ALPHA, KS p-value against U(0, 1), and the count (NaN if n/a)."""
    t = torch.tensor(pvals, dtype=torch.float64)
    if t.numel() == 0 or bool(t.isnan().all()):
        return math.nan, math.nan, 0
    rate = float((t <= ALPHA).double().mean())
    return rate, float(stats.kstest(t.numpy(), "uniform").pvalue), t.numel()


def table(model: str, collected: dict, seconds: dict) -> str:
    head = "| test | p-value | H0 rate | 99 % band (n) | KS p (H0) | " + " | ".join(
        list(VARIANTS)[1:]
    ) + " | s / dataset (CPU) |"
    lines = [f"### {model}", "", head, "|" + " --- |" * (len(VARIANTS) + 5)]
    for test in TESTS:
        keys = list(collected.get((model, test, "calibrated"), {}))
        if not keys:
            continue
        wall, cpu, count = seconds.get((model, test), (0.0, 0.0, 0))
        cost = f"{wall / max(count, 1):.2f} ({cpu / max(count, 1):.2f})"
        for key in keys:
            rate, ks, n = summarize(collected[(model, test, "calibrated")][key])
            if n == 0:
                cells = ["n/a", "", "n/a"]
            else:
                lo, hi = band(n)
                mark = "" if lo <= rate <= hi else " **!**"
                cells = [f"{rate:.3f}{mark}", f"[{lo:.3f}, {hi:.3f}] ({n})", f"{ks:.3f}"]
            power = []
            for variant in list(VARIANTS)[1:]:
                r, _, m = summarize(collected.get((model, test, variant), {}).get(key, []))
                power.append("n/a" if m == 0 else f"{r:.2f} ({m})")
            lines.append(f"| {test} | {key} | " + " | ".join(cells + power) + f" | {cost} |")
    return "\n".join(lines)


def is_heavy(model: str, test: str) -> bool:
    """Tests too slow to run --datasets times at their defaults (see the module docstring)."""
    return test in LOCAL_TESTS or (model == "flow2" and test in SAMPLING_TESTS)


def make_jobs(args: argparse.Namespace) -> list[tuple]:
    jobs = []
    for model in args.models:
        for test in args.only or TESTS:
            if test == "skce" and model != "diag6":
                continue  # closed form only for diagonal Gaussian posteriors
            heavy = is_heavy(model, test)
            for variant in VARIANTS:
                if variant == "calibrated":
                    count = args.heavy_datasets if heavy else args.datasets
                else:
                    count = args.heavy_power_datasets if heavy else args.power_datasets
                reps = list(range(count))
                for start in range(0, count, args.chunk):
                    jobs.append((model, test, variant, reps[start : start + args.chunk]))
    # cheap jobs first, so that a partial report already has the many-dataset rows
    return sorted(jobs, key=lambda j: (is_heavy(j[0], j[1]), j[1] in LOCAL_TESTS))


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--datasets", type=int, default=200, help="datasets under H0")
    parser.add_argument("--power-datasets", type=int, default=100,
                        help="datasets per alternative")
    parser.add_argument("--heavy-datasets", type=int, default=200,
                        help="datasets under H0 for LC2ST, LC2STNF and the flow's ranks, TARP")
    parser.add_argument("--heavy-power-datasets", type=int, default=20,
                        help="datasets per alternative for those tests")
    parser.add_argument("--n", type=int, default=500, help="calibration pairs per dataset")
    parser.add_argument("--observations", type=int, default=2, help="local tests' x_o")
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--only", nargs="+", choices=TESTS, default=None)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    parser.add_argument("--chunk", type=int, default=10, help="datasets per job")
    parser.add_argument("--flow-steps", type=int, default=1500)
    parser.add_argument("--smoke", action="store_true",
                        help="seconds: tiny sizes and reduced metric settings, no results file")
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.smoke:
        args.datasets = args.power_datasets = args.heavy_datasets = 2
        args.heavy_power_datasets, args.workers = 1, 1
        args.n, args.flow_steps, args.chunk = 60, 20, 2
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    flow_state = None
    if "flow2" in args.models:
        flow_state = build_model("flow2", flow_steps=args.flow_steps).flow.state_dict()
    train_seconds = time.perf_counter() - start
    sizes = {"n": args.n, "observations": args.observations, "smoke": args.smoke}
    jobs = make_jobs(args)
    collected: dict = defaultdict(lambda: defaultdict(list))
    seconds: dict = defaultdict(lambda: (0.0, 0.0, 0))
    path = args.output if args.output is not None else (None if args.smoke else RESULTS)

    def add(result: tuple, done: int) -> str:
        model, test, variant, out, (wall, cpu), count = result
        for key, values in out.items():
            collected[(model, test, variant)][key].extend(values)
        old = seconds[(model, test)]
        seconds[(model, test)] = (old[0] + wall, old[1] + cpu, old[2] + count)
        elapsed = time.perf_counter() - start
        text = render(args, argv, collected, seconds, elapsed, train_seconds, done, len(jobs))
        if path is not None:  # rewritten after every job: a long run shows its progress
            path.write_text(text)
        return text

    text = ""
    if args.workers > 1:
        ctx = mp.get_context("spawn")
        with ctx.Pool(args.workers, _init, (flow_state, args.threads, sizes)) as pool:
            for done, result in enumerate(pool.imap_unordered(run_job, jobs), 1):
                text = add(result, done)
    else:
        _init(flow_state, args.threads, sizes)
        for done, job in enumerate(jobs, 1):
            text = add(run_job(job), done)
    print(text)
    return text


def render(args: argparse.Namespace, argv: list[str] | None, collected: dict, seconds: dict,
           wall: float, train_seconds: float, done: int, total: int) -> str:
    command = "python examples/benchmarks/level_audit.py " + " ".join(
        argv if argv is not None else sys.argv[1:]
    )
    report = io.StringIO()
    when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    progress = "" if done == total else f" **Partial: {done} of {total} jobs done.**"
    report.write(
        "# Level and power audit of the calibration tests\n\n"
        f"Command: `{command.strip()}`, {when}. Machine: {platform.machine()}, "
        f"{os.cpu_count()} cores shared with other jobs (load average "
        f"{os.getloadavg()[0]:.1f} at the end), torch {torch.__version__}, "
        f"{args.workers} worker processes x {args.threads} torch thread(s). Total wall time "
        f"{wall:.0f} s (flow training {train_seconds:.0f} s).{progress}\n\n"
        f"Each dataset: N = {args.n} fresh calibration pairs from the model's joint and "
        f"O = {args.observations} reference observations x_o from its simulator; one fresh "
        "metric per dataset with default arguments. Rejection at p <= 0.05. H0 rate: the "
        "posterior given is the exact one; **!** marks a rate outside the central 99 % "
        "binomial range of n level-0.05 tests. KS p: Kolmogorov-Smirnov test of the H0 "
        "p-values against U(0, 1) (permutation and bootstrap p-values are discrete, "
        "so a small KS p alone is not a failure). Alternatives: variance x 0.5 "
        "(over-confident), x 2 (under-confident), mean + 0.5 posterior sd (biased); "
        "power with the number of datasets in brackets. s / dataset: wall seconds of one "
        "metric (update + compute), averaged over all variants, and in brackets the CPU "
        "seconds of its process (steadier on a shared machine). LC2ST, LC2STNF (all "
        "models) and RankCalibration, TARP on flow2 (N x 1000 flow draws per dataset) are "
        f"the slow ones: they ran {args.heavy_datasets} datasets under H0 and "
        f"{args.heavy_power_datasets} per alternative, with the band for that number.\n\n"
    )
    for model in args.models:
        report.write(table(model, collected, seconds) + "\n\n")
    return report.getvalue()


if __name__ == "__main__":
    main()
