"""Level and power audit of every calibration test the package offers.

Each test runs as users run it after training: one fresh metric object per calibration
set, built with its DEFAULT arguments (default seed included), on a fresh calibration
set drawn from a model whose exact posterior is known. Under H0 (the exact posterior)
the rejection rate at alpha = 0.05 must lie in the 99 % binomial band of the number of
datasets; under three alternatives (over-confident, under-confident, biased) it is the
power.

Cases (``--cases``; N calibration pairs per dataset, O reference observations for the
local tests):

* ``corr2``: Gaussian linear, D = 2, prior N(0, [[1, .8], [.8, 1]]), x = theta + N(0, .25 I);
  correlated Gaussian posterior (MultivariateNormal).
* ``flow2``: non-Gaussian. A zuko MAF trained briefly on Two Moons defines the joint
  x ~ Two Moons simulator, theta ~ q_flow(. | x); the flow is then exactly the posterior
  of that joint, so calibrated by construction (theta drawn in float64, see
  ``FlowJoint``; the tests get the float32 flow, as users do). (MAF, not NSF: zuko's spline inverse
  makes NSF sampling about 5x slower, and the sampling tests draw 10^6 points per set.)
* ``diag6``: Gaussian linear, D = 6, prior variances 0.5 .. 2, x = theta + N(0, .25 I);
  diagonal Gaussian posterior, so the closed-form SKCE test applies too.
* ``gauss1``, ``gauss3``, ``gauss20``, ``gauss50``: the same diagonal Gaussian linear model
  at D = 1, 3, 20, 50 (prior variances linspace(0.5, 2, D)).
* ``t3``: heavy tails. x ~ N(0, I_2), theta | x ~ x + 0.5 t_3 (independent Student-t
  coordinates, 3 degrees of freedom): the exact posterior is that product of t_3
  (torch ``Independent(StudentT)``; samples, log-densities and scores exact).
* ``bounded``: a bounded posterior. x ~ N(0, I_2), theta | x = sigmoid(x + 0.5 N(0, I)):
  a logit-normal on (0, 1)^2 (torch ``TransformedDistribution`` with a sigmoid; its
  latent map is exact).
* ``n30``: ``gauss3`` with N = 30 calibration pairs per dataset.

Alternatives (posterior given to the tests; data always from the true joint):
over-confident = variance x 0.5, under-confident = variance x 2 (for the flow and the
logit-normal: base N(0, s^2 I) with s^2 = 0.5 or 2, a temperature in latent space; for
t3 the scale), biased = mean + 0.5 posterior standard deviation in every dimension
(flow: theta shifted by 0.5 x the average marginal posterior sd; t3: 0.5 scale;
logit-normal: 0.5 base sd in logit space).

Tests and p-values: KCCSD ``p_value``; SKCE (``baselines.skce_test`` on
``skce_matrix_gaussian``, defaults; diagonal Gaussian posteriors only); RankCalibration
``p_value`` (joint energy rank), ``marginal_p_values``, ``ecdf_p_values`` (marginals,
then joint), ``global_p_value``; TARP ``p_value`` (one test, so no global p-value);
LatentCalibration (posteriors with a latent map: Gaussians, flows, the logit-normal)
``p_value``, marginal and ECDF p-values, ``global_p_value``; LC2ST and LC2STNF ``p_value``
per observation and ``global_p_value``. A test that does not apply to a case is n/a
with the reason. For D > 6 the per-dimension p-values are pooled into one row (rate
over D x datasets, band for that count: the posteriors' coordinates are independent),
with the range of the per-dimension rates and how many dimensions leave their own band
(about 1 % of them by chance).

TARP's reference construction (issue 22): beside the metric's default (``tarp``: box
and scale fitted on one value per pair picked among its theta and samples), the same
draws are tested with the box and scale fitted on the tested theta themselves
(``tarp[box on theta]``, the default before) and on an independent draw of the
model's joint (``tarp[independent box]``, the oracle of references from the prior).

Cost: the "heavy" tests (LC2ST, LC2STNF, and the flow's RankCalibration and TARP) run
--heavy-datasets datasets under H0 and --heavy-power-datasets per alternative, each
rate with the band for its own number; the others --datasets and --power-datasets.

Run:   python examples/benchmarks/level_audit.py [--datasets 400] [--n 500]
       [--power-datasets 100] [--heavy-datasets 100] [--heavy-power-datasets 20]
       [--cases corr2 ...] [--only ranks tarp] [--tarp-rows all] [--workers 2]
       [--smoke]
Writes examples/benchmarks/results/level_audit.md: one section per case, each with the
command, date, machine and wall time of the run that made it; a run with ``--cases``
replaces only those sections (``--smoke``: tiny sizes and reduced metric settings, only
to exercise the code; prints the table and writes nothing unless ``--output`` is given).
"""

from __future__ import annotations

import argparse
import copy
import io
import math
import multiprocessing as mp
import os
import platform
import re
import sys
import time
from collections import defaultdict
from datetime import datetime, timezone
from pathlib import Path

import torch
from scipy import stats
from torch.distributions import (
    Distribution,
    Independent,
    MultivariateNormal,
    Normal,
    SigmoidTransform,
    StudentT,
    TransformedDistribution,
)

import calib_lightning as cl
from calib_lightning.baselines import skce_matrix_gaussian, skce_test
from calib_lightning.evaluation import draws
from calib_lightning.functional.tarp import tarp, tarp_fit_scale, tarp_references
from calib_lightning.tasks import TwoMoons

RESULTS = Path(__file__).parent / "results" / "level_audit.md"
ALPHA = 0.05
TESTS = ("kccsd", "skce", "ranks", "tarp", "latent", "lc2st", "lc2stnf")
LOCAL_TESTS = ("lc2st", "lc2stnf")
SAMPLING_TESTS = ("ranks", "tarp")  # 10^6 posterior draws per dataset: heavy for the flow
CASES = ("corr2", "flow2", "diag6", "gauss1", "gauss3", "gauss20", "gauss50", "t3", "bounded",
         "n30")
VARIANTS = {  # name: (variance scale, shift in posterior sds)
    "calibrated": (1.0, 0.0),
    "over-confident": (0.5, 0.0),
    "under-confident": (2.0, 0.0),
    "biased": (1.0, 0.5),
}
POOL_ABOVE = 6  # per-dimension p-values of larger D are pooled into one row


# -- models ----------------------------------------------------------------------------
class LinearGaussian:
    """theta ~ N(0, prior_cov), x = theta + noise_std * N(0, I); exact Gaussian posterior."""

    latent = None  # Gaussians have an exact latent map

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


class ConditionalJoint:
    """x ~ N(0, I_D), theta | x from a known conditional family: it is the exact posterior.

    ``family="t3"``: theta = x + 0.5 t_3 per coordinate; ``"logit-normal"``: theta =
    sigmoid(x + 0.5 N(0, I)), on (0, 1)^D. Data are drawn in float64 from the family
    itself; the tests get float32 distributions.
    """

    diagonal = False

    def __init__(self, family: str, dim: int = 2, scale: float = 0.5) -> None:
        self.family, self.dim, self.scale = family, dim, scale
        # t3: no latent map (torch's StudentT has no quantile function)
        self.latent = "no latent map: torch's StudentT has no quantile" if family == "t3" else None

    def _dist(self, x: torch.Tensor, variance_scale: float = 1.0, shift: float = 0.0):
        scale = self.scale * variance_scale**0.5
        loc = x + shift * self.scale
        if self.family == "t3":
            return Independent(StudentT(3.0, loc, torch.full_like(x, scale)), 1)
        base = Independent(Normal(loc, torch.full_like(x, scale)), 1)
        return TransformedDistribution(base, [SigmoidTransform()])

    def sample_x(self, n: int, generator: torch.Generator) -> torch.Tensor:
        return torch.randn(n, self.dim, generator=generator, dtype=torch.float64).float()

    def sample(self, n: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        # Every draw from ``generator``: the global generator is seeded with the same
        # number per dataset, so drawing theta from it would reuse x's normals as its
        # noise (theta = x + 0.5 x / ..., a joint the tests rightly reject).
        x = self.sample_x(n, generator)
        noise = torch.randn(n, self.dim, generator=generator, dtype=torch.float64)
        if self.family == "t3":  # t_3 = N(0, 1) / sqrt(chi2_3 / 3), chi2_3 = 3 squared normals
            chi2 = torch.randn(3, n, self.dim, generator=generator, dtype=torch.float64)
            noise = noise / (chi2.square().sum(0) / 3).sqrt()
            theta = x.double() + self.scale * noise
        else:
            theta = torch.sigmoid(x.double() + self.scale * noise)
        return theta.float(), x

    def posterior(self, variance_scale: float = 1.0, shift: float = 0.0):
        def conditional(x: torch.Tensor) -> Distribution:
            return self._dist(x, variance_scale, shift)

        return conditional


class FlowJoint:
    """x ~ Two Moons simulator, theta ~ q_flow(. | x): the flow is the exact posterior."""

    diagonal = False
    latent = None

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
    gauss = re.fullmatch(r"gauss(\d+)", name)
    if name == "corr2":
        return LinearGaussian(torch.tensor([[1.0, 0.8], [0.8, 1.0]]))
    if name == "diag6" or gauss or name == "n30":
        dim = 6 if name == "diag6" else 3 if name == "n30" else int(gauss.group(1))
        return LinearGaussian(torch.diag(torch.linspace(0.5, 2.0, dim)))
    if name == "flow2":
        return FlowJoint(flow_state, flow_steps)
    if name == "t3":
        return ConditionalJoint("t3")
    if name == "bounded":
        return ConditionalJoint("logit-normal")
    raise ValueError(f"unknown case {name!r}; choose from {CASES}")


def not_applicable(case: str, test: str, model) -> str | None:
    """Why ``test`` does not apply to ``case`` (``None``: it applies)."""
    if test == "skce" and not model.diagonal:
        return "closed form for diagonal Gaussian posteriors only"
    if test in ("latent", "lc2stnf") and model.latent is not None:
        return model.latent
    return None


# -- one dataset, one test -----------------------------------------------------------------
def _scalar(out: dict, key: str) -> float:
    value = out.get(key)
    return math.nan if value is None else float(value)


def _many(result: dict, out, name: str) -> None:
    """Per-dimension p-values, then the last one named ``joint`` for ECDF tests."""
    values = getattr(out, name).tolist()
    if name == "ecdf_p_values":
        values, joint = values[:-1], values[-1]
    for d, p in enumerate(values):
        result[f"{name}[{d}]"] = p
    if name == "ecdf_p_values":
        result[f"{name}[joint]"] = joint


def run_test(test: str, model, posterior, theta, x, observations, smoke: bool,
             oracle: bool | None = True) -> dict:
    """Named p-values of one test on one calibration set (NaN: key not returned)."""
    small = {"num_posterior_samples": 100} if smoke else {}
    local = {"num_null": 19, "num_posterior_samples": 500} if smoke else {}
    if test == "kccsd":
        out = cl.KCCSD(**({"num_null": 99} if smoke else {}))
        out.update(posterior, theta, x)
        return {"p_value": float(out.compute().p_value)}
    if test == "skce":
        dist = posterior(x)
        out = skce_test(skce_matrix_gaussian(theta, dist.mean, dist.variance))
        return {"p_value": float(out.p_value)}
    if test in ("ranks", "latent"):
        metric = cl.RankCalibration(**small) if test == "ranks" else cl.LatentCalibration()
        metric.update(posterior, theta, x)
        out = metric.compute()
        result = {"p_value": _scalar(out, "p_value")}
        _many(result, out, "marginal_p_values")
        _many(result, out, "ecdf_p_values")
        result["global_p_value"] = _scalar(out, "global_p_value")
        return result
    if test == "tarp":
        metric = cl.TARP(**small)  # one set of draws for the three constructions
        samples = draws(posterior, x, metric.num_posterior_samples)
        metric.update(samples, theta, x)
        result = {"p_value": float(metric.compute().p_value)}
        g = torch.Generator().manual_seed(int(1e6 * float(theta[0, 0])) % 2**31)
        if oracle is not None:
            n = theta.shape[0]
            refs = tarp_references(theta.amin(0), theta.amax(0), n, generator=g)
            old = tarp(samples, theta, references=refs, scale=tarp_fit_scale(theta),
                       generator=g)  # fmt: skip
            result["p_value[box on theta]"] = float(old.p_value)
        if oracle:
            fresh = model.sample(theta.shape[0], g)[0]  # an independent draw of the joint
            refs = tarp_references(fresh.amin(0), fresh.amax(0), fresh.shape[0], generator=g)
            independent = tarp(samples, theta, references=refs, scale=tarp_fit_scale(fresh),
                               generator=g)  # fmt: skip
            result["p_value[independent box]"] = float(independent.p_value)
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


def _dataset_seed(case: str, rep: int) -> int:
    return 1_000_003 * (CASES.index(case) + 1) + rep


def case_n(case: str, n: int) -> int:
    return 30 if case == "n30" else n


def run_job(job: tuple) -> tuple:
    case, test, variant, reps = job
    sizes = _STATE["sizes"]
    model = _model(case)
    posterior = model.posterior(*VARIANTS[variant])
    results, seconds, cpu = defaultdict(list), 0.0, 0.0
    for rep in reps:
        seed = _dataset_seed(case, rep)
        g = torch.Generator().manual_seed(seed)
        torch.manual_seed(seed)  # model draws and the metrics' sampling use the global RNG
        theta, x = model.sample(case_n(case, sizes["n"]), g)
        observations = model.sample_x(sizes["observations"], g)
        start, start_cpu = time.perf_counter(), time.process_time()
        out = run_test(test, model, posterior, theta, x, observations, sizes["smoke"],
                       sizes["tarp_oracle"])
        seconds += time.perf_counter() - start
        cpu += time.process_time() - start_cpu
        for key, p in out.items():
            results[key].append(p)
    return case, test, variant, dict(results), (seconds, cpu), len(reps)


# -- summary -------------------------------------------------------------------------------
def band(n: int, alpha: float = ALPHA, coverage: float = 0.99) -> tuple[float, float]:
    """Central ``coverage`` binomial range of the rejection rate of ``n`` level-alpha tests."""
    tail = (1 - coverage) / 2
    return stats.binom.ppf(tail, n, alpha) / n, stats.binom.ppf(1 - tail, n, alpha) / n


def summarize(pvals: list[float]) -> tuple[float, float, int]:
    """Rejection rate at ALPHA, KS p-value against U(0, 1), and the count (NaN if n/a)."""
    t = torch.tensor(pvals, dtype=torch.float64)
    t = t[~t.isnan()]
    if t.numel() == 0:
        return math.nan, math.nan, 0
    rate = float((t <= ALPHA).double().mean())
    return rate, float(stats.kstest(t.numpy(), "uniform").pvalue), t.numel()


def _groups(keys: list[str]) -> list[tuple[str, list[str]]]:
    """Rows of the table: each key alone, except per-dimension families of more than
    POOL_ABOVE dimensions, pooled into one row."""
    families: dict[str, list[str]] = defaultdict(list)
    for key in keys:
        m = re.fullmatch(r"(\w+)\[(\d+)\]", key)
        if m:
            families[m.group(1)].append(key)
    rows, done = [], set()
    for key in keys:
        m = re.fullmatch(r"(\w+)\[(\d+)\]", key)
        if m and len(families[m.group(1)]) > POOL_ABOVE:
            family = m.group(1)
            if family not in done:
                done.add(family)
                rows.append((f"{family}[0..{len(families[family]) - 1}]", families[family]))
            continue
        rows.append((key, [key]))
    return rows


def _cells(collected: dict, case: str, test: str, keys: list[str]) -> tuple[list[str], bool]:
    """H0 cells (rate, band, KS) of a row, and whether it is inside its band."""
    values = [collected[(case, test, "calibrated")][k] for k in keys]
    rate, ks, n = summarize([p for v in values for p in v])
    if n == 0:
        return ["n/a", "", "n/a"], True
    lo, hi = band(n)
    inside = lo <= rate <= hi
    text = f"{rate:.3f}{'' if inside else ' **!**'}"
    if len(keys) > 1:  # pooled: the range over dimensions and how many leave their band
        rates = [summarize(v) for v in values]
        outside = sum(not (band(m)[0] <= r <= band(m)[1]) for r, _, m in rates)
        text += (f" (per dim {min(r for r, _, _ in rates):.3f}-"
                 f"{max(r for r, _, _ in rates):.3f}, {outside} of {len(keys)} outside their "
                 f"band [{band(rates[0][2])[0]:.3f}, {band(rates[0][2])[1]:.3f}])")
    return [text, f"[{lo:.3f}, {hi:.3f}] ({n})", f"{ks:.3f}"], inside


def table(case: str, collected: dict, seconds: dict, skipped: dict) -> tuple[str, list[str]]:
    """The case's markdown table and the rows outside their band."""
    head = "| test | p-value | H0 rate | 99 % band (n) | KS p (H0) | " + " | ".join(
        list(VARIANTS)[1:]
    ) + " | s / dataset (CPU) |"
    lines = [head, "|" + " --- |" * (len(VARIANTS) + 5)]
    outside = []
    for test in TESTS:
        if (case, test) in skipped:
            lines.append(f"| {test} | n/a: {skipped[(case, test)]} |" + " |" * (len(VARIANTS) + 3))
            continue
        keys = list(collected.get((case, test, "calibrated"), {}))
        if not keys:
            continue
        wall, cpu, count = seconds.get((case, test), (0.0, 0.0, 0))
        cost = f"{wall / max(count, 1):.2f} ({cpu / max(count, 1):.2f})"
        for name, group in _groups(keys):
            cells, inside = _cells(collected, case, test, group)
            if not inside:
                outside.append(f"{case} {test} {name}: {cells[0]} outside {cells[1]}")
            power = []
            for variant in list(VARIANTS)[1:]:
                got = collected.get((case, test, variant), {})
                r, _, m = summarize([p for k in group for p in got.get(k, [])])
                power.append("n/a" if m == 0 else f"{r:.2f} ({m})")
            lines.append(f"| {test} | {name} | " + " | ".join(cells + power) + f" | {cost} |")
    return "\n".join(lines), outside


def is_heavy(case: str, test: str) -> bool:
    """Tests too slow to run --datasets times at their defaults (see the module docstring)."""
    return test in LOCAL_TESTS or (case == "flow2" and test in SAMPLING_TESTS)


def make_jobs(args: argparse.Namespace, models: dict) -> tuple[list[tuple], dict]:
    jobs, skipped = [], {}
    for case in args.cases:
        for test in args.only or TESTS:
            reason = not_applicable(case, test, models[case])
            if reason is not None:
                skipped[(case, test)] = reason
                continue
            heavy = is_heavy(case, test)
            for variant in VARIANTS:
                if variant == "calibrated":
                    count = args.heavy_datasets if heavy else args.datasets
                else:
                    count = args.heavy_power_datasets if heavy else args.power_datasets
                reps = list(range(count))
                for start in range(0, count, args.chunk):
                    jobs.append((case, test, variant, reps[start : start + args.chunk]))
    # H0 first (cheap tests, then heavy), power last, each in the order of --only, then
    # of --cases: a partial report has the H0 rows of the tests named first
    tests = list(args.only or TESTS)
    return sorted(jobs, key=lambda j: (j[2] != "calibrated", is_heavy(j[0], j[1]),
                                       tests.index(j[1]), args.cases.index(j[0]))), skipped


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--datasets", type=int, default=400, help="datasets under H0")
    parser.add_argument("--power-datasets", type=int, default=100,
                        help="datasets per alternative")
    parser.add_argument("--heavy-datasets", type=int, default=100,
                        help="datasets under H0 for LC2ST, LC2STNF and the flow's ranks, TARP")
    parser.add_argument("--heavy-power-datasets", type=int, default=20,
                        help="datasets per alternative for those tests")
    parser.add_argument("--n", type=int, default=500,
                        help="calibration pairs per dataset (n30: 30)")
    parser.add_argument("--observations", type=int, default=2, help="local tests' x_o")
    parser.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES),
                        help="cases to run; the results file keeps the sections of the others")
    parser.add_argument("--only", nargs="+", choices=TESTS, default=None)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    parser.add_argument("--chunk", type=int, default=10, help="datasets per job")
    parser.add_argument("--flow-steps", type=int, default=1500)
    parser.add_argument("--tarp-rows", choices=("all", "old", "default"), default="all",
                        help="TARP constructions: the default, the box on theta and an "
                        "independent box (all); the first two (old); the default only")
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
    if "flow2" in args.cases:
        flow_state = build_model("flow2", flow_steps=args.flow_steps).flow.state_dict()
    train_seconds = time.perf_counter() - start
    models = {case: build_model(case, flow_state) for case in args.cases}
    oracle = {"all": True, "old": False, "default": None}[args.tarp_rows]
    sizes = {"n": args.n, "observations": args.observations, "smoke": args.smoke,
             "tarp_oracle": oracle}
    jobs, skipped = make_jobs(args, models)
    collected: dict = defaultdict(lambda: defaultdict(list))
    seconds: dict = defaultdict(lambda: (0.0, 0.0, 0))
    path = args.output if args.output is not None else (None if args.smoke else RESULTS)

    def add(result: tuple, done: int) -> str:
        case, test, variant, out, (wall, cpu), count = result
        for key, values in out.items():
            collected[(case, test, variant)][key].extend(values)
        old = seconds[(case, test)]
        seconds[(case, test)] = (old[0] + wall, old[1] + cpu, old[2] + count)
        elapsed = time.perf_counter() - start
        text = render(args, argv, collected, seconds, skipped, elapsed, train_seconds, done,
                      len(jobs), path)  # fmt: skip
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


INTRO = (
    "# Level and power audit of the calibration tests\n\n"
    "Script: `examples/benchmarks/level_audit.py` (its docstring defines the cases, "
    "alternatives and tests). Each dataset: N fresh calibration pairs from the case's "
    "joint (N = 500, n30: N = 30) and O = 2 reference observations x_o from its simulator; "
    "one fresh metric per dataset with default arguments. Rejection at p <= 0.05. H0 "
    "rate: the posterior given is the exact one; **!** marks a rate outside the central "
    "99 % binomial range of n level-0.05 tests. KS p: Kolmogorov-Smirnov test of the H0 "
    "p-values against U(0, 1) (permutation and bootstrap p-values are discrete, so a "
    "small KS p alone is not a failure). Alternatives: variance x 0.5 (over-confident), "
    "x 2 (under-confident), mean + 0.5 posterior sd (biased); power with the number of "
    "datasets in brackets. s / dataset: wall seconds of one metric (update + compute), "
    "averaged over all variants, and in brackets the CPU seconds of its process (steadier "
    "on a shared machine). Per-dimension p-values of D > 6 are pooled into one row "
    "(rate over D x n tests, with the range over dimensions). TARP rows: `p_value` is "
    "the metric's default; `[box on theta]` the construction it replaced (issue 22); "
    "`[independent box]` box and scale from an independent draw of the joint, on the "
    "same draws.\n\n"
)


def render(args: argparse.Namespace, argv: list[str] | None, collected: dict, seconds: dict,
           skipped: dict, wall: float, train_seconds: float, done: int, total: int,
           path: Path | None) -> str:
    """The results file: this run's sections, and those of earlier runs for other cases."""
    command = "python examples/benchmarks/level_audit.py " + " ".join(
        argv if argv is not None else sys.argv[1:]
    )
    when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    progress = "" if done == total else f" **Partial: {done} of {total} jobs done.**"
    run = (
        f"Command: `{command.strip()}`, {when}. Machine: {platform.machine()}, "
        f"{os.cpu_count()} cores shared with other jobs (load average "
        f"{os.getloadavg()[0]:.1f} at the end), torch {torch.__version__}, "
        f"{args.workers} worker processes x {args.threads} torch thread(s). Wall time of "
        f"the run {wall:.0f} s (flow training {train_seconds:.0f} s).{progress} Datasets: "
        f"{args.datasets} under H0 and {args.power_datasets} per alternative; LC2ST, "
        f"LC2STNF (and ranks, TARP on flow2) {args.heavy_datasets} under H0 and "
        f"{args.heavy_power_datasets} per alternative."
    )
    sections = {}
    if path is not None and path.exists():  # keep the sections of the cases not rerun
        for block in re.split(r"\n(?=### )", path.read_text()):
            m = re.match(r"### (\w+)\n", block)
            if m and m.group(1) in CASES and m.group(1) not in args.cases:
                sections[m.group(1)] = block.strip()
    outside_all = []
    for case in args.cases:
        text, outside = table(case, collected, seconds, skipped)
        outside_all += outside
        verdict = ("Outside their band: " + "; ".join(outside) + "." if outside
                   else "Every H0 rate inside its band.")
        sections[case] = f"### {case}\n\n{run}\n\n{verdict}\n\n{text}"
    report = io.StringIO()
    report.write(INTRO)
    for case in CASES:
        if case in sections:
            report.write(sections[case] + "\n\n")
    return report.getvalue()


if __name__ == "__main__":
    main()
