"""Calibration regularizers for NPE: plain NPE vs the coverage regularizer vs KCCSD.

Tasks Gaussian Linear Uniform (D = 10), Two Moons (D = 2), SLCP (D = 5); simulation
budgets 1,000 and 4,000; 5 seeds. Every method trains the same flow (zuko NSF with
coupling layers, 3 transforms, 2 x 64 hidden, on standardized theta and x) from the
same initialization on the same simulations: Adam (lr 1e-3), batches of 128,
gradient clipping at 5, early stopping on the NLL of a 10 % validation split
(patience 20 epochs, at most ``MAX_EPOCHS``), best validation state restored. The
regularized loss is ``examples/_npe.py``'s ``regularized_loss`` (a manual loop here,
the Lightning module ``NPE`` in ``examples/npe_regularized.py``: same loss, less
overhead on a shared CPU).

Held-out metrics on 1,000 fresh pairs per (task, seed): expected-coverage error and
the joint energy-rank p-value of ``cl.RankCalibration`` (``coverage_error`` is the
signed area between the expected-coverage curve and the diagonal, negative =
over-confident; the table reports its absolute value and sign), held-out NLL, and,
where exact posterior samples exist (Two Moons, Gaussian Linear Uniform), the C2ST
accuracy of flow samples against them at 5 observations (0.5 = indistinguishable; an
sklearn MLP as in sbibm, 2-fold cross-validation, 1,000 samples per class). Time per
epoch is the median over the training epochs of one run, and its ratio to plain NPE on
the same (task, budget, seed).

Every finished run is cached in ``results/regularizer_study_runs.json``; a rerun skips
them, so the study can be stopped and resumed. Run::

    PYTHONPATH=. python examples/benchmarks/regularizer_study.py            # everything
    PYTHONPATH=. python examples/benchmarks/regularizer_study.py --seeds 1 --tasks two_moons
    PYTHONPATH=. python examples/benchmarks/regularizer_study.py --reverse  # 2nd process
    PYTHONPATH=. python examples/benchmarks/regularizer_study.py --timing   # epoch times
    PYTHONPATH=. python examples/benchmarks/regularizer_study.py --report   # table + plot
    python examples/benchmarks/regularizer_study.py --smoke  # seconds, temporary folder

Per-run epoch times on a shared machine mostly measure the neighbours' load;
``--timing`` measures each method's epoch time against plain NPE's with epochs
interleaved round by round (``results/regularizer_study_timing.json``), and the goal
check uses those ratios.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import fcntl
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

if not __package__:  # run as a file (python examples/x.py): make `examples` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np
import torch
from torch import nn

import calib_lightning as cl
from calib_lightning.losses import (
    BalancingLoss,
    CoverageLoss,
    KCCSDLoss,
    LatentCoverageLoss,
)
from calib_lightning.recalibration import LatentScale
from calib_lightning.tasks import SLCP, GaussianLinearUniform, TwoMoons
from examples._npe import build_flow, regularized_loss
from examples._smoke import add_smoke_argument, output_folder

RESULTS = Path(__file__).resolve().parent / "results"
CACHE = RESULTS / "regularizer_study_runs.json"
TIMING = RESULTS / "regularizer_study_timing.json"
# while the file named by $PAUSE_FILE exists, the study waits between runs (so that another
# process can time something on a quiet machine)
PAUSE = os.environ.get("PAUSE_FILE")
TASKS = {"gaussian_linear_uniform": GaussianLinearUniform, "two_moons": TwoMoons, "slcp": SLCP}
BUDGETS = (1000, 4000)
# name -> (regularizer factory of the task, weight, where its batches come from):
# "train": the NLL's training batch, one pass of the flow shared with the NLL
# (``examples/_npe.py``'s ``regularized_loss``, the path docs/regularizers.md documents);
# "lampe": lampe's own DCPNPELoss (NLL and regularizer) through a thin wrapper;
# "val-scale": plain NPE, then ``cl.LatentScale`` fitted on the validation split.
Factory = Callable[[object], nn.Module | None]
METHODS: dict[str, tuple[Factory, float, str]] = {
    "npe": (lambda task: None, 0.0, "train"),
    "latent-scale (val)": (lambda task: None, 0.0, "val-scale"),
    "latent-scale shared (val)": (lambda task: None, 0.0, "val-scale"),
    "latent-scale hpd (val)": (lambda task: None, 0.0, "val-scale"),
    "balanced (100)": (lambda task: BalancingLoss(task.prior()), 100.0, "train"),
    "lampe dcp (5)": (lambda task: None, 5.0, "lampe"),
    "coverage (5)": (lambda task: CoverageLoss(), 5.0, "train"),
    "coverage-conservative (5)": (lambda task: CoverageLoss(conservative=True), 5.0, "train"),
    "kccsd (10)": (lambda task: KCCSDLoss(), 10.0, "train"),
    "latent (5)": (lambda task: LatentCoverageLoss(), 5.0, "train"),
    "latent-conservative (5)": (
        lambda task: LatentCoverageLoss(conservative=True), 5.0, "train"),
}
MAX_EPOCHS, PATIENCE, BATCH, LR = 300, 20, 128, 1e-3
NUM_TEST, NUM_RANK_SAMPLES, NUM_C2ST_OBS, NUM_C2ST_SAMPLES = 1000, 200, 5, 1000


class _LampeEstimator(nn.Module):
    """What lampe's DCPNPELoss expects of an estimator: ``self(theta, x)`` the
    log-density and ``self.flow(x)`` a zuko distribution with ``rsample_and_log_prob``."""

    def __init__(self, flow: nn.Module) -> None:
        super().__init__()
        self.flow = flow

    def forward(self, theta: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.flow(x).log_prob(theta)


def _lampe_dcp(flow: nn.Module, weight: float) -> nn.Module:
    """lampe's DCPNPELoss (conservative, its defaults) on our flow. lampe sorts with
    ``torchsort.soft_sort``, which does not build here; its module attribute is swapped
    for ``torch.sort`` (gradients pass to the sorted values, as in CoverageLoss)."""
    import types

    from lampe.inference import dcp

    dcp.torchsort = types.SimpleNamespace(soft_sort=lambda v, **_: torch.sort(v, dim=-1).values)
    return dcp.DCPNPELoss(_LampeEstimator(flow), lmbda=weight)


class _Run:
    """One method's training state: splits, flow, optimizer, regularizer."""

    def __init__(
        self, theta: torch.Tensor, x: torch.Tensor, method: str, seed: int, task: object
    ) -> None:
        factory, self.weight, self.source = METHODS[method]
        self.regularizer = factory(task)
        self.theta, self.x = theta, x
        self.generator = torch.Generator().manual_seed(seed)
        order = torch.randperm(len(theta), generator=self.generator)
        n_val = len(theta) // 10
        self.val, self.train = order[:n_val], order[n_val:]
        torch.manual_seed(seed)  # same initialization for every method
        self.flow = build_flow(theta[self.train], x[self.train])
        if self.source == "lampe":
            self.regularizer = _lampe_dcp(self.flow, self.weight)
        self.optimizer = torch.optim.Adam(self.flow.parameters(), lr=LR)

    def epoch(self) -> float:
        """One pass over the training split; returns its wall time in seconds."""
        theta, x, flow, generator = self.theta, self.x, self.flow, self.generator
        start = time.perf_counter()
        flow.train()
        for rows in torch.randperm(len(self.train), generator=generator).split(BATCH):
            if len(rows) < 2:
                continue
            index = self.train[rows]
            if self.source == "lampe":
                loss = self.regularizer(theta[index], x[index])
            else:
                loss, _, _ = regularized_loss(
                    flow, self.regularizer, self.weight, theta[index], x[index]
                )
            self.optimizer.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(flow.parameters(), 5.0)
            self.optimizer.step()
        return time.perf_counter() - start

    def validation_nll(self) -> float:
        self.flow.eval()
        with torch.no_grad():
            return float(-self.flow(self.x[self.val]).log_prob(self.theta[self.val]).mean())


_PLAIN: dict[tuple, tuple[nn.Module, dict, torch.Tensor]] = {}  # plain NPE flows, per process


def fit(
    theta: torch.Tensor, x: torch.Tensor, method: str, seed: int, task: object,
    max_epochs: int = MAX_EPOCHS,
) -> tuple[nn.Module, dict]:  # fmt: skip
    """Train one flow; returns it (best validation state) and training statistics.

    ``latent-scale (val)`` trains plain NPE (or reuses this process's plain NPE flow of
    the same simulations and seed) and fits ``cl.LatentScale`` on the validation split.
    """
    key = (type(task).__name__, len(theta), seed, float(theta.sum()))
    if METHODS[method][2] == "val-scale":
        if key not in _PLAIN:
            fit(theta, x, "npe", seed, task, max_epochs)
        flow, stats, val = _PLAIN[key]
        start = time.perf_counter()
        scaled = LatentScale(copy.deepcopy(flow), shared="shared" in method)
        scaled.fit(theta[val], x[val], target="hpd" if "hpd" in method else "latent")
        return scaled.eval(), dict(stats, fit_seconds=time.perf_counter() - start)
    if method == "npe" and key in _PLAIN:
        return _PLAIN[key][:2]
    run = _Run(theta, x, method, seed, task)
    best, best_state, stale, epoch_times = math.inf, None, 0, []
    for _ in range(max_epochs):
        epoch_times.append(run.epoch())
        val_nll = run.validation_nll()
        if val_nll < best:
            best, best_state, stale = val_nll, copy.deepcopy(run.flow.state_dict()), 0
        else:
            stale += 1
            if stale >= PATIENCE:
                break
    run.flow.load_state_dict(best_state)
    stats = {"epochs": len(epoch_times), "val_nll": best,
             "epoch_seconds": statistics.median(epoch_times)}  # fmt: skip
    if method == "npe":
        _PLAIN.clear()  # keep one: the next run is usually its latent-scale twin
        _PLAIN[key] = (run.flow.eval(), stats, run.val)
    return run.flow.eval(), stats


def epoch_time_ratios(task_name: str, budget: int = 1000, rounds: int = 7) -> dict[str, float]:
    """Epoch time of each method over plain NPE's, epochs interleaved round by round on the
    same simulations (first round dropped as warm-up); median over rounds. On a shared
    machine only such same-moment ratios are meaningful."""
    task = TASKS[task_name]()
    theta, x = task.sample(budget, torch.Generator().manual_seed(0))
    runs = {method: _Run(theta, x, method, 0, task) for method in METHODS}
    ratios: dict[str, list[float]] = {method: [] for method in METHODS}
    for round_index in range(rounds + 1):
        seconds = {method: run.epoch() for method, run in runs.items()}
        if round_index:
            for method in METHODS:
                ratios[method].append(seconds[method] / seconds["npe"])
    return {method: statistics.median(values) for method, values in ratios.items()}


def c2st_accuracy(reference: np.ndarray, samples: np.ndarray, seed: int) -> float:
    """Oracle C2ST: 2-fold cross-validated accuracy of an MLP telling the two sets apart
    (z-scored by the reference; sbibm's classifier: 2 hidden layers of 10 D units)."""
    from sklearn.model_selection import cross_val_score
    from sklearn.neural_network import MLPClassifier

    mean, std = reference.mean(0), reference.std(0) + 1e-12
    data = (np.concatenate([reference, samples]) - mean) / std
    labels = np.r_[np.zeros(len(reference)), np.ones(len(samples))]
    dim = reference.shape[1]
    classifier = MLPClassifier(
        hidden_layer_sizes=(10 * dim, 10 * dim), activation="relu", max_iter=1000,
        solver="adam", random_state=seed, early_stopping=True,
    )  # fmt: skip
    folds = cross_val_score(classifier, data, labels, cv=2, scoring="accuracy")
    return float(folds.mean())


def evaluate(flow: nn.Module, task: object, seed: int) -> dict:
    """Held-out NLL, RankCalibration summary, and the oracle C2ST where possible."""
    theta, x = task.sample(NUM_TEST, torch.Generator().manual_seed(10_000 + seed))
    with torch.no_grad():
        nll = float(-flow(x).log_prob(theta).mean())
    torch.manual_seed(seed)
    ranks = cl.RankCalibration(num_posterior_samples=NUM_RANK_SAMPLES)
    ranks.update(flow, theta, x)
    out = ranks.compute()
    result = {
        "nll": nll,
        "coverage_error": float(out.coverage_error),
        "p_value": float(out.p_value),
        "contraction": float(out.contraction.mean()),
    }
    latent = cl.LatentCalibration()
    latent.update(flow, theta, x)
    result["latent_coverage_error"] = float(latent.compute().coverage_error)
    try:
        reference = task.reference_posterior_samples(
            x[:NUM_C2ST_OBS], NUM_C2ST_SAMPLES, torch.Generator().manual_seed(seed)
        )
    except NotImplementedError:
        return result
    samples = cl.as_posterior(flow).sample(x[:NUM_C2ST_OBS], NUM_C2ST_SAMPLES)
    result["c2st"] = statistics.fmean(
        c2st_accuracy(reference[:, i].numpy(), samples[:, i].numpy(), seed)
        for i in range(NUM_C2ST_OBS)
    )
    return result


def run_key(task: str, budget: int, seed: int, method: str) -> str:
    return f"{task}|{budget}|{seed}|{method}"


def load_cache() -> dict:
    return json.loads(CACHE.read_text()) if CACHE.exists() else {}


@contextlib.contextmanager
def _locked() -> Iterator[None]:
    """Exclusive lock on the cache, so that processes running other tasks can share it."""
    RESULTS.mkdir(exist_ok=True)
    with open(CACHE.with_suffix(".lock"), "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def save_cache(cache: dict) -> None:
    RESULTS.mkdir(exist_ok=True)
    tmp = CACHE.with_suffix(".tmp")
    tmp.write_text(json.dumps(cache, indent=1, sort_keys=True))
    tmp.replace(CACHE)  # atomic: a crash never leaves a half-written cache


def run_study(
    tasks: list[str],
    budgets: list[int],
    seeds: list[int],
    methods: list[str],
    max_epochs: int = MAX_EPOCHS,
    reverse: bool = False,
) -> None:
    cache = load_cache()
    todo = [(t, b, s, m) for t in tasks for b in budgets for s in seeds for m in methods
            if run_key(t, b, s, m) not in cache]  # fmt: skip
    print(f"{len(todo)} runs to do ({len(cache)} cached)", flush=True)
    if reverse:
        todo.reverse()
    for i, (task_name, budget, seed, method) in enumerate(todo, 1):
        while PAUSE and os.path.exists(PAUSE):
            time.sleep(10)
        if run_key(task_name, budget, seed, method) in load_cache():
            continue  # finished meanwhile by another process
        start = time.perf_counter()
        task = TASKS[task_name]()
        theta, x = task.sample(budget, torch.Generator().manual_seed(seed))
        flow, stats = fit(theta, x, method, seed, task, max_epochs)
        stats.update(evaluate(flow, task, seed))
        stats["run_seconds"] = time.perf_counter() - start
        with _locked():  # another process may have added runs meanwhile
            cache = load_cache()
            cache[run_key(task_name, budget, seed, method)] = stats
            save_cache(cache)
        print(
            f"[{i}/{len(todo)}] {task_name} n={budget} seed={seed} {method:13s} "
            f"epochs {stats['epochs']:3d}  nll {stats['nll']:7.3f}  "
            f"cov.err {stats['coverage_error']:+.3f}  p {stats['p_value']:.3f}  "
            f"c2st {stats.get('c2st', float('nan')):.3f}  "
            f"{stats['epoch_seconds'] * 1e3:6.1f} ms/epoch  ({stats['run_seconds']:.0f} s)",
            flush=True,
        )


def _aggregate(cache: dict) -> dict:
    """(task, budget, method) -> {metric: list over seeds}, with per-seed time ratios."""
    table: dict = {}
    for key, stats in cache.items():
        task, budget, seed, method = key.split("|")
        row = table.setdefault((task, int(budget), method), {})
        plain = cache.get(run_key(task, int(budget), int(seed), "npe"))
        values = dict(stats, abs_coverage_error=abs(stats["coverage_error"]), seed=int(seed))
        if plain is not None:
            values["time_ratio"] = stats["epoch_seconds"] / plain["epoch_seconds"]
            values["nll_change"] = (stats["nll"] - plain["nll"]) / abs(plain["nll"])
        for name, value in values.items():
            row.setdefault(name, []).append(value)
    return table


def _cell(values: list[float] | None, digits: int = 3) -> str:
    if not values:
        return "-"
    mean = statistics.fmean(values)
    if len(values) < 2:
        return f"{mean:.{digits}f}"
    se = statistics.stdev(values) / math.sqrt(len(values))
    return f"{mean:.{digits}f} ± {se:.{digits}f}"


def run_timing(tasks: list[str], budgets: list[int]) -> None:
    timing = json.loads(TIMING.read_text()) if TIMING.exists() else {}
    for task in tasks:
        for budget in budgets:
            print(f"timing {task} n={budget} ...", flush=True)
            timing[f"{task}|{budget}"] = epoch_time_ratios(task, budget)
            print(json.dumps(timing[f"{task}|{budget}"]), flush=True)
            TIMING.write_text(json.dumps(timing, indent=1, sort_keys=True))


def report() -> None:
    table = _aggregate(load_cache())
    timing = json.loads(TIMING.read_text()) if TIMING.exists() else {}
    for (task, budget, method), row in table.items():
        ratio = timing.get(f"{task}|{budget}", {}).get(method)
        if ratio is not None:
            row["interleaved_time_ratio"] = [ratio]
    columns = [("abs_coverage_error", "abs. coverage error"), ("coverage_error", "signed"),
               ("latent_coverage_error", "latent, signed"), ("p_value", "rank p-value"),
               ("nll", "held-out NLL"), ("c2st", "C2ST"),
               ("epochs", "epochs"), ("fit_seconds", "scale fit (s)"),
               ("time_ratio", "epoch time / NPE (per run)"),
               ("interleaved_time_ratio", "epoch time / NPE (interleaved)")]  # fmt: skip
    intro = ("Mean ± standard error over seeds; the protocol is in the module docstring of "
             "`regularizer_study.py`.")  # fmt: skip
    lines = ["# Calibration regularizers for NPE", "", intro, ""]
    lines += ["| task | budget | method | n | " + " | ".join(c[1] for c in columns) + " |",
              "|---" * (len(columns) + 4) + "|"]  # fmt: skip
    for (task, budget, method), row in sorted(table.items()):
        cells = [_cell(row.get(name), 1 if name == "epochs" else 3) for name, _ in columns]
        lines.append(f"| {task} | {budget} | {method} | {len(row['nll'])} | " + " | ".join(cells)
                     + " |")  # fmt: skip
    lines += ["", "## Summary at 1,000 simulations", "", *summary(table)]
    lines += ["", "## Goal check (1,000 simulations)", "", *goal_check(table)]
    (RESULTS / "regularizer_study.md").write_text("\n".join(lines) + "\n")
    plot(table).savefig(RESULTS / "regularizer_study.png", dpi=120, bbox_inches="tight")
    print("\n".join(lines))
    print("wrote", RESULTS / "regularizer_study.md", RESULTS / "regularizer_study.png")


def _paired(row: dict, plain: dict, name: str) -> tuple[float, float]:
    """Mean and standard error of the per-seed difference method - plain NPE."""
    reference = dict(zip(plain["seed"], plain[name], strict=True))
    diffs = [
        v - reference[s] for s, v in zip(row["seed"], row[name], strict=True) if s in reference
    ]
    se = statistics.stdev(diffs) / math.sqrt(len(diffs)) if len(diffs) > 1 else math.nan
    return statistics.fmean(diffs), se


ANCHORS = ("balanced (100)", "lampe dcp (5)")


def summary(table: dict, budget: int = 1000) -> list[str]:
    """Paired change of |coverage error| against plain NPE per task (mean ± s.e. over
    seeds, and relative to plain NPE's mean), the NLL change and the epoch-time ratio."""
    lines = ["| method | " + " | ".join(TASKS) + " | NLL change | epoch time / NPE |",
             "|---" * (len(TASKS) + 3) + "|"]  # fmt: skip
    for method in [m for m in METHODS if m != "npe"]:
        cells, nll, times = [], [], []
        for task in TASKS:
            plain, row = table.get((task, budget, "npe")), table.get((task, budget, method))
            if not plain or not row or len(row["seed"]) < 2:
                cells.append("-")
                continue
            diff, se = _paired(row, plain, "abs_coverage_error")
            relative = 100 * diff / statistics.fmean(plain["abs_coverage_error"])
            bold = "**" if diff + 2 * se < 0 else ""
            cells.append(f"{bold}{diff:+.3f} ± {se:.3f}{bold} ({relative:+.0f} %)")
            nll.append(100 * statistics.fmean(row["nll_change"]))
            times.append(statistics.median(row.get("interleaved_time_ratio", row["time_ratio"])))
        if not nll:
            continue
        lines.append(f"| {method} | " + " | ".join(cells) + f" | {min(nll):+.1f} .. "
                     f"{max(nll):+.1f} % | {min(times):.2f}-{max(times):.2f}x |")  # fmt: skip
    return lines


def goal_check(table: dict) -> list[str]:
    """The issue's goal at 1,000 simulations, per method and task: held-out |coverage error|
    at least 30 % below plain NPE's and below it by more than two standard errors of the
    paired per-seed difference; at most the anchors' (balanced NPE, lampe's DCP) mean;
    held-out NLL at most 5 % worse; epoch time at most 1.3x plain NPE (interleaved timing
    where measured). Met when all hold on at least two of the three tasks.
    """
    lines = []
    for method in [m for m in METHODS if m != "npe"]:
        wins = []
        for task in TASKS:
            plain, row = table.get((task, 1000, "npe")), table.get((task, 1000, method))
            if not plain or not row:
                continue
            diff, se = _paired(row, plain, "abs_coverage_error")
            relative = diff / statistics.fmean(plain["abs_coverage_error"])
            clearly = relative <= -0.3 and diff + 2 * se < 0
            anchors = [statistics.fmean(table[(task, 1000, a)]["abs_coverage_error"])
                       for a in ANCHORS if (task, 1000, a) in table]  # fmt: skip
            own = statistics.fmean(row["abs_coverage_error"])
            vs_anchors = all(own <= a for a in anchors)
            nll_change = statistics.fmean(row["nll_change"])
            nll_ok = nll_change <= 0.05
            ratio = statistics.median(row.get("interleaved_time_ratio", row["time_ratio"]))
            time_ok = ratio <= 1.3
            wins.append(clearly and vs_anchors and nll_ok and time_ok)
            lines.append(
                f"- {method}, {task}: |coverage error| {diff:+.3f} ± {se:.3f} "
                f"({100 * relative:+.0f} %; >= 30 % lower by > 2 s.e.: {clearly}); "
                f"<= anchors: {vs_anchors}; NLL {100 * nll_change:+.1f} % (<= 5 %: {nll_ok}); "
                f"epoch time {ratio:.2f}x (<= 1.3x: {time_ok})"
            )
        lines.append(f"- **{method}: goal met on {sum(wins)} of {len(wins)} tasks**")
    return lines


def plot(table: dict, budget: int = 1000) -> object:
    """Per task (columns) and metric (rows), each method's seeds (dots) and mean ± s.e.,
    methods on the vertical axis, at one budget."""
    from matplotlib.figure import Figure

    metrics = [("coverage_error", "signed coverage error, HPD (< 0: over-confident)"),
               ("latent_coverage_error", "signed latent coverage error"),
               ("nll", "held-out NLL"), ("c2st", "C2ST accuracy (0.5: exact)")]  # fmt: skip
    methods = [m for m in METHODS if any((t, budget, m) in table for t in TASKS)]
    fig = Figure(figsize=(4.2 * len(TASKS), 0.32 * len(methods) * len(metrics) + 1.5))
    axes = fig.subplots(len(metrics), len(TASKS), squeeze=False, sharey=True)
    for col, task in enumerate(TASKS):
        for row_i, (name, label) in enumerate(metrics):
            ax = axes[row_i, col]
            for i, method in enumerate(methods):
                values = table.get((task, budget, method), {}).get(name)
                if not values:
                    continue
                color = {"latent-scale (val)": "C3", "npe": "C0"}.get(method, "0.35")
                ax.scatter(values, [i] * len(values), s=9, alpha=0.45, color=color)
                se = statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else 0
                ax.errorbar(statistics.fmean(values), i, xerr=se, fmt="o", color=color,
                            markeredgecolor="k", markersize=5)  # fmt: skip
            if name.endswith("coverage_error"):
                ax.axvline(0.0, color="gray", lw=0.8)
            if not ax.has_data():
                ax.text(0.5, 0.5, "no exact posterior samples", ha="center", va="center",
                        transform=ax.transAxes, color="0.4")  # fmt: skip
            ax.set_yticks(range(len(methods)), methods, fontsize=8)
            if col == 0 and row_i == 0:  # shared y: once inverts every panel
                ax.invert_yaxis()
            ax.set_xlabel(label, fontsize=8)
            ax.tick_params(axis="x", labelsize=8)
            if row_i == 0:
                ax.set_title(f"{task}, {budget:,} simulations", fontsize=10)
    fig.tight_layout()
    return fig


def main(argv: list[str] | None = None) -> None:
    global RESULTS, CACHE, TIMING, PATIENCE, NUM_TEST, NUM_RANK_SAMPLES, NUM_C2ST_OBS
    global NUM_C2ST_SAMPLES
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    parser.add_argument("--budgets", nargs="+", type=int, default=list(BUDGETS))
    parser.add_argument("--seeds", type=int, default=5, help="seeds 0 .. SEEDS-1")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--max-epochs", type=int, default=MAX_EPOCHS)
    parser.add_argument("--cache", type=Path, default=CACHE, help="JSON file of finished runs")
    parser.add_argument("--reverse", action="store_true", help="last run first (for a 2nd process)")
    parser.add_argument("--timing", action="store_true", help="only the interleaved epoch timing")
    parser.add_argument("--report", action="store_true", help="only write the table and plot")
    add_smoke_argument(parser)
    args = parser.parse_args(argv)
    if args.smoke:  # every method once on a tiny Two Moons run, all files in a temporary folder
        args.tasks, args.budgets, args.seeds, args.max_epochs = ["two_moons"], [100], 1, 2
        RESULTS = output_folder(RESULTS, smoke=True)
        args.cache, TIMING = RESULTS / CACHE.name, RESULTS / TIMING.name
        PATIENCE, NUM_TEST, NUM_RANK_SAMPLES, NUM_C2ST_OBS, NUM_C2ST_SAMPLES = 1, 100, 20, 1, 50
    CACHE = args.cache
    torch.set_num_threads(1)
    if args.timing:
        run_timing(args.tasks, args.budgets)
    elif not args.report:
        run_study(
            args.tasks,
            args.budgets,
            list(range(args.seeds)),
            args.methods,
            args.max_epochs,
            args.reverse,
        )
    report()


if __name__ == "__main__":
    main()
