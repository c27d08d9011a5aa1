"""KCCSDLoss on a ratio estimator: NRE vs balanced NRE vs NRE + KCCSD, held-out calibration.

On a ratio estimator the KCCSD term needs no sampling: the posterior's score is the
gradient of :math:`\\log r(\\theta, x) + \\log p(\\theta)` in :math:`\\theta` (in
:math:`u = T^{-1}(\\theta)` for a box prior), taken with ``create_graph=True``. This study
adds ``cl.KCCSDLoss(prior=prior, condition="x")`` to NRE-A's classifier loss and compares
it with plain NRE-A and balanced NRE (Delaunoy et al. 2022, :math:`\\lambda = 100`).

Tasks (both with the prior :math:`U(-1, 1)^2`): ``gauss_box``, :math:`x \\sim N(\\theta,
0.1 I_2)` (the posterior is a Gaussian truncated to the box); ``two_moons``
(``calib_lightning.tasks.TwoMoons``, a bimodal crescent). Every method trains the same MLP
on standardized ``(theta, x)`` (2 x 64 SiLU) from the same initialization on the same
``NUM_SIMULATIONS`` simulations: Adam (lr 1e-3), batches of 128, ``EPOCHS`` epochs; the
marginal pairs of a batch pair each ``x_i`` with :math:`\\theta_{i-1}`. The KCCSD weight is
chosen by a sweep on a validation seed (``SWEEP_SEED``, not in the table) and a validation
set: the weight with the smallest validation ``|coverage error|`` among those whose
validation NLL is at most 0.1 nats above plain NRE's on that seed.

Held-out metrics on one test set of ``NUM_TEST`` fresh pairs per task, shared by all runs:
expected-coverage error of ``cl.ImportanceCoverage`` (the prior as proposal,
``NUM_PROPOSAL`` draws per pair; negative = over-confident), the NLL of the true theta under
the posterior normalized numerically on a ``GRID`` x ``GRID`` midpoint grid of the box, the
balance of ``cl.RatioBalance`` (positive: the over-confident side), the p-value of
``cl.KCCSD`` (defaults; in the unconstrained space, as it does for a box prior), and the
training seconds (the neighbours' load on a shared machine moves these; the ratio to NRE
in the same run is the number to read). ``gauss_box`` also has the exact ratio as a row.

Run: ``PYTHONPATH=. python examples/benchmarks/kccsd_loss_nre.py`` (result:
``results/kccsd_loss_nre.md``); ``--smoke``: tiny sizes, seconds, a temporary folder.
"""

from __future__ import annotations

import argparse
import math
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

if not __package__:  # run as a file (python examples/x.py): make `examples` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
from torch import Tensor, nn
from torch.nn.functional import logsigmoid

import calib_lightning as cl
from calib_lightning.tasks import GaussianLinearUniform, TwoMoons
from examples._smoke import add_smoke_argument, output_folder

HERE = Path(__file__).parent
SEEDS, SWEEP_SEED, TEST_SEED, VALIDATION_SEED = (0, 1, 2, 3, 4), 100, 999, 998
WEIGHTS = (0.3, 1.0, 3.0, 10.0, 100.0)  # the KCCSD weights of the validation sweep
BALANCE_WEIGHT = 100.0  # Delaunoy et al. 2022
SIZES = {  # simulation budgets, epochs, test pairs, grid side, proposal draws
    "full": ((1000, 3000), 30, 500, 100, 4000),
    "smoke": ((200,), 2, 40, 16, 200),
}


class GaussBox(GaussianLinearUniform):
    """``GaussianLinearUniform`` in D = 2: :math:`\\theta \\sim U(-1, 1)^2`,
    :math:`x \\sim N(\\theta, 0.1 I)`."""

    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        super().__init__(dtype=dtype)
        self.theta_dim = self.x_dim = 2  # an instance attribute where the parent takes dim=

    def log_ratio(self, theta: Tensor, x: Tensor) -> Tensor:
        """The exact :math:`\\log p(x \\mid \\theta) - \\log p(x)`, ``(N,)``."""
        std = math.sqrt(self.noise_var)
        normal = torch.distributions.Normal(0.0, 1.0)
        log_lik = torch.distributions.Normal(theta, std).log_prob(x).sum(-1)
        mass = normal.cdf((1 - x) / std) - normal.cdf((-1 - x) / std)
        return log_lik - (mass / 2).log().sum(-1)


TASKS = {"gauss_box": GaussBox, "two_moons": TwoMoons}


class Ratio(nn.Module):
    """:math:`\\log r(\\theta, x)`: an MLP on ``(theta, x)`` standardized by training stats."""

    def __init__(self, theta: Tensor, x: Tensor, hidden: int = 64) -> None:
        super().__init__()
        data = torch.cat([theta, x], -1)
        self.register_buffer("mean", data.mean(0))
        self.register_buffer("std", data.std(0))
        self.net = nn.Sequential(
            nn.Linear(data.shape[1], hidden), nn.SiLU(), nn.Linear(hidden, hidden), nn.SiLU(),
            nn.Linear(hidden, 1),
        )  # fmt: skip

    def forward(self, theta: Tensor, x: Tensor) -> Tensor:
        return self.net((torch.cat([theta, x], -1) - self.mean) / self.std)[:, 0]


def nre_loss(ratio: Ratio, theta: Tensor, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """NRE-A's binary cross-entropy and the logits of the joint and marginal pairs."""
    joint, marginal = ratio(theta, x), ratio(theta.roll(1, 0), x)
    return -(logsigmoid(joint) + logsigmoid(-marginal)).mean(), joint, marginal


def train(
    method: str, weight: float, task_name: str, seed: int, size: str, num_sims: int
) -> tuple[Ratio, float]:
    """Train one ratio estimator on ``num_sims`` simulations; returns it and its training
    seconds."""
    epochs = SIZES[size][1]
    task = TASKS[task_name]()
    theta, x = task.sample(num_sims, torch.Generator().manual_seed(seed))
    torch.manual_seed(seed)
    ratio = Ratio(theta, x)
    optimizer = torch.optim.Adam(ratio.parameters(), lr=1e-3)
    kccsd = cl.KCCSDLoss(prior=task.prior(), condition="x")
    order = torch.Generator().manual_seed(seed + 1)
    start = time.perf_counter()
    for _ in range(epochs):
        for rows in torch.randperm(num_sims, generator=order).split(128):
            if len(rows) < 2:
                continue
            loss, joint, marginal = nre_loss(ratio, theta[rows], x[rows])
            if method == "bnre":
                balance = torch.sigmoid(joint).mean() + torch.sigmoid(marginal).mean() - 1
                loss = loss + weight * balance**2
            elif method == "kccsd":
                loss = loss + weight * kccsd(ratio, theta[rows], x[rows])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return ratio, time.perf_counter() - start


def grid_nll(log_ratio: Callable, theta: Tensor, x: Tensor, side: int) -> Tensor:
    """Mean NLL of ``theta`` under :math:`r p / Z`, Z by the midpoint rule on the box."""
    edges = (torch.arange(side) + 0.5) / side * 2 - 1
    grid = torch.cartesian_prod(edges, edges)  # (G, 2)
    log_cell = math.log((2 / side) ** 2)
    out = []
    with torch.no_grad():
        for i in range(0, len(x), 25):
            xs = x[i : i + 25]
            values = log_ratio(grid.repeat(len(xs), 1), xs.repeat_interleave(len(grid), 0))
            log_z = torch.logsumexp(values.view(len(xs), -1), -1) + log_cell  # prior 1/4 cancels
            out.append(log_z - log_ratio(theta[i : i + 25], xs))
    return torch.cat(out).mean()


def evaluate(log_ratio: Callable, task_name: str, size: str) -> dict[str, float]:
    """Held-out coverage error, NLL, balance and KCCSD p-value on the task's test set."""
    num_test, side, num_proposal = SIZES[size][2:]
    task = TASKS[task_name]()
    theta, x = task.sample(num_test, torch.Generator().manual_seed(TEST_SEED))
    post = cl.UnnormalizedPosterior(log_ratio, prior=task.prior())
    coverage = cl.ImportanceCoverage(num_proposal_samples=num_proposal, seed=0)
    balance, kccsd = cl.RatioBalance(), cl.KCCSD(seed=0)
    with torch.no_grad():
        coverage.update(post, theta, x)
        balance.update(log_ratio, theta, x)
    kccsd.update(post, theta, x)
    cov, bal = coverage.compute(), balance.compute()
    return {"coverage_error": float(cov.coverage_error), "ess": float(cov.ess_median),
            "nll": float(grid_nll(log_ratio, theta, x, side)),
            "balance": float(bal.statistic), "kccsd_p": float(kccsd.compute().p_value)}  # fmt: skip


def validation_score(ratio: Ratio, task_name: str, size: str) -> tuple[float, float]:
    """``(coverage error, NLL)`` on the validation set (``VALIDATION_SEED``)."""
    num_test, side, num_proposal = SIZES[size][2:]
    task = TASKS[task_name]()
    theta, x = task.sample(num_test, torch.Generator().manual_seed(VALIDATION_SEED))
    post = cl.UnnormalizedPosterior(ratio, prior=task.prior())
    coverage = cl.ImportanceCoverage(num_proposal_samples=num_proposal, seed=0, min_ess=0)
    with torch.no_grad():
        coverage.update(post, theta, x)
    return float(coverage.compute().coverage_error), float(grid_nll(ratio, theta, x, side))


def sweep(task_name: str, num_sims: int, size: str, lines: list[str]) -> float:
    """The KCCSD weight chosen on the validation seed (rule in the module docstring)."""
    nre = validation_score(train("nre", 0.0, task_name, SWEEP_SEED, size, num_sims)[0],
                           task_name, size)  # fmt: skip
    lines.append(f"| {task_name} | {num_sims} | NRE | - | {nre[0]:+.3f} | {nre[1]:.3f} |")
    scores = {}
    for weight in WEIGHTS:
        ratio = train("kccsd", weight, task_name, SWEEP_SEED, size, num_sims)[0]
        scores[weight] = ce, nll = validation_score(ratio, task_name, size)
        lines.append(f"| {task_name} | {num_sims} | NRE + KCCSD | {weight:g} | {ce:+.3f} | "
                     f"{nll:.3f} |")  # fmt: skip
    allowed = [w for w in WEIGHTS if scores[w][1] <= nre[1] + 0.1] or list(WEIGHTS)
    return min(allowed, key=lambda w: abs(scores[w][0]))


def blindness(lines: list[str]) -> None:
    """z of the mean loss over 100 batches of 128 exact pairs of gauss_box, exact and
    tempered ratios, with and without the kernel on x."""
    task = GaussBox(dtype=torch.float64)
    theta, x = task.sample(100 * 128, torch.Generator().manual_seed(7))
    for condition in (None, "x"):
        loss, cells = cl.KCCSDLoss(prior=task.prior(), condition=condition), []
        null_se = None
        for tau in (1.0, 0.5, 2.0):

            def f(t: Tensor, y: Tensor, tau: float = tau) -> Tensor:
                return tau * task.log_ratio(t, y)

            values = torch.stack([loss(f, t, y).detach() for t, y in
                                  zip(theta.split(128), x.split(128), strict=True)])  # fmt: skip
            null_se = null_se or float(values.std()) / math.sqrt(len(values))
            cells.append(f"{float(values.mean()) / null_se:+.1f}")
        lines.append(f"| {condition} | " + " | ".join(cells) + " |")


def summary(values: list[float], digits: int = 3) -> str:
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    return f"{statistics.mean(values):.{digits}f} ± {statistics.stdev(values):.{digits}f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_smoke_argument(parser)
    args = parser.parse_args()
    size = "smoke" if args.smoke else "full"
    seeds = SEEDS[:1] if args.smoke else SEEDS
    torch.set_num_threads(1)
    folder = output_folder(HERE / "results", args.smoke)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=HERE, check=False).stdout.strip() or "-"  # fmt: skip
    budgets, epochs, num_test, side, num_proposal = SIZES[size]
    out = [
        "# KCCSDLoss on a ratio estimator: NRE vs balanced NRE vs NRE + KCCSD",
        "",
        "Command: `PYTHONPATH=. python examples/benchmarks/kccsd_loss_nre.py"
        + (" --smoke`" if args.smoke else "`")
        + f"; commit {commit}; {platform.machine()} CPU, 1 torch thread, 2 cores shared "
        f"with other jobs; torch {torch.__version__}.",
        "",
        f"{' and '.join(map(str, budgets))} simulations, {epochs} epochs, batches of 128, "
        "the same MLP (2 x 64 SiLU) and initialization for every method; seeds "
        f"{', '.join(map(str, seeds))}. Held-out: "
        f"{num_test} test pairs per task; coverage error from `cl.ImportanceCoverage` with "
        f"the prior as proposal ({num_proposal} draws per pair; negative = over-confident); "
        f"NLL of the true theta under the posterior normalized on a {side} x {side} "
        "midpoint grid of the box; balance from `cl.RatioBalance` (0 for the exact ratio); "
        "p-value of `cl.KCCSD` (defaults, unconstrained space); training seconds. "
        "Mean ± sd over the seeds.",
        "",
        "## Why `condition=\"x\"`: z of the mean loss on exact pairs (gauss_box)",
        "",
        "100 batches of 128 pairs; the mean loss in units of its standard error under the "
        "exact ratio (tau = 1); the tempered log-ratio is tau times the exact one.",
        "",
        "| condition | tau = 1 (exact) | tau = 0.5 | tau = 2 |",
        "|---|---|---|---|",
    ]
    blindness(out)
    out += ["", "## Validation sweep of the KCCSD weight (seed "
            f"{SWEEP_SEED}, validation set seed {VALIDATION_SEED})", "",
            "| task | simulations | method | weight | val. coverage error | val. NLL |",
            "|---|---|---|---|---|---|"]  # fmt: skip
    cases = [(name, num_sims) for name in TASKS for num_sims in budgets]
    chosen = {case: WEIGHTS[2] if args.smoke else sweep(*case, size, out) for case in cases}
    out += ["", "## Held-out results", "",
            "Paired: the method's abs coverage error minus NRE's on the same seed (negative: "
            "closer to calibrated than NRE), and the seeds where it is below NRE's.", "",
            "| task | simulations | method | abs coverage error | coverage error | paired "
            "vs NRE | below NRE | NLL | balance | KCCSD p | median ESS | train s | "
            "train s / NRE |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for name, num_sims in cases:
        if name == "gauss_box" and num_sims == budgets[0]:  # one test set for both budgets
            exact = evaluate(GaussBox().log_ratio, name, size)
            out.append(f"| {name} | {num_sims} | exact ratio | "
                       f"{abs(exact['coverage_error']):.3f} | {exact['coverage_error']:+.3f} | "
                       f"- | - | {exact['nll']:.3f} | {exact['balance']:+.3f} | "
                       f"{exact['kccsd_p']:.2f} | {exact['ess']:.0f} | - | - |")  # fmt: skip
        weight = chosen[name, num_sims]
        methods = {"NRE": ("nre", 0.0), f"BNRE (lambda = {BALANCE_WEIGHT:g})":
                   ("bnre", BALANCE_WEIGHT), f"NRE + {weight:g} KCCSD":
                   ("kccsd", weight)}  # fmt: skip
        runs: dict[str, list[dict[str, float]]] = {label: [] for label in methods}
        for seed in seeds:
            for label, (method, w) in methods.items():
                ratio, seconds = train(method, w, name, seed, size, num_sims)
                runs[label].append({**evaluate(ratio, name, size), "seconds": seconds})
                print(f"{name} {num_sims} seed {seed} {label}: {runs[label][-1]}", flush=True)
        for label, rows in runs.items():
            col = {key: [row[key] for row in rows] for key in rows[0]}
            pairs = list(zip(rows, runs["NRE"], strict=True))
            paired = [abs(r["coverage_error"]) - abs(n["coverage_error"]) for r, n in pairs]
            ratio_s = [r["seconds"] / n["seconds"] for r, n in pairs]
            below = "-" if label == "NRE" else f"{sum(d < 0 for d in paired)}/{len(paired)}"
            out.append(f"| {name} | {num_sims} | {label} | "
                       f"{summary([abs(v) for v in col['coverage_error']])} | "
                       f"{summary(col['coverage_error'])} | "
                       f"{'-' if label == 'NRE' else summary(paired)} | {below} | "
                       f"{summary(col['nll'])} | {summary(col['balance'])} | "
                       f"{summary(col['kccsd_p'], 2)} | {summary(col['ess'], 0)} | "
                       f"{summary(col['seconds'], 1)} | {summary(ratio_s, 1)} |")  # fmt: skip
    path = folder / "kccsd_loss_nre.md"
    path.write_text("\n".join(out) + "\n")
    print("\n".join(out))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
