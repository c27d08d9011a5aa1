"""Local and global checks on sbibm's reference posteriors, side by side with sbi 0.27.

Issue 23, Build item 1. Tasks (sbibm 1.1.0, reference posteriors shipped with it): Two
Moons, Gaussian Linear Uniform, Gaussian Mixture, SLCP. Estimators, per task, budget
(1,000 and 10,000 simulations) and seed: sbi 0.27's default NPE (``NPE(prior)`` with
``density_estimator="maf"``, trained by sbi with its early stopping; it goes through
calib_lightning's sbi adapter) and a zuko neural spline flow trained by the package's
examples code (``examples._npe.NPE`` + ``build_flow``, Lightning, early stopping on a
10 % validation split). Trained estimators are cached in ``--cache`` (not in git).

Per task, one set of ``--num-cal`` calibration pairs (prior + simulator, seeded) serves
every estimator and both libraries, and sbibm's 10 observations are the reference
observations. At each observation:

* oracle: sbibm's ``c2st(reference, estimator)`` (the standard, seed 1) on
  ``--num-oracle`` reference samples and as many estimator samples;
* ours: ``cl.LC2STNF`` (its null trained once per task on the calibration ``x`` and
  reused through ``state_dict``) and ``cl.LC2ST`` (permutation null), at defaults;
* sbi: ``LC2ST_NF`` (its null trained once per task, ``trained_clfs_null``; the inverse
  is calib_lightning's adapter ``to_latent``, which embeds ``x`` first: sbi's own
  ``inverse_transform`` skips the embedding net) and ``LC2ST`` (permutation null,
  ``--sbi-lc2st-null`` trials);
* ``cl.diagnose(posterior, theta, x, observations)``: its verdict and its L-C2ST-NF
  p-values (Holm over the 10 observations, as the verdict reads them).

Per estimator, the global checks on the calibration pairs: ``cl.diagnose``'s (KCCSD,
ranks, TARP, overall), and sbi's ``check_sbc`` (KS p-values of the marginal ranks,
Bonferroni over the dimensions) and ``check_tarp`` (its KS p-value), on one set of
``--num-draws`` posterior draws per pair. Every step is timed (wall clock, one thread).

Report (``--report``, also after every case): sensitivity = share of observations with
oracle >= 0.6 that a local test rejects at 0.05; alarm rate = share with oracle <= 0.55
that it rejects; within-task Spearman correlation of each local statistic with the
oracle; the mean statistic per budget (the L-C2ST paper's Figure 2); seconds per check.

Install sbibm into its own environment (it pins old packages, hence ``--no-deps``; no
``pip`` extra can express that)::

    pip install sbi==0.27.0 lightning torchmetrics zuko nflows threadpoolctl matplotlib
    pip install --no-deps sbibm==1.1.0
    pip install pandas pyro-ppl opt_einsum pyro-api future autograd

Run:  PYTHONPATH=. python examples/benchmarks/sbibm_validation.py   (resumes from
          examples/benchmarks/results/sbibm_validation.jsonl; --tasks, --budgets,
          --estimators, --seeds select cases; each case appends one line)
      PYTHONPATH=. python examples/benchmarks/sbibm_validation.py --report  (table only)
      python examples/benchmarks/sbibm_validation.py --smoke   (a minute; temp folder)
Writes examples/benchmarks/results/sbibm_validation.md and sbibm_validation.png.

The committed results are a subset, run on a 2-core machine shared with other jobs
(load 10-20): one process per task, each with
``--budgets 10000 1000 --sbi-lc2st-null 0 --num-cal 1000 --num-oracle 500
--max-epochs 30`` (what finished by the deadline is in the jsonl), then ``--report``
with the same size arguments.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
import warnings
from pathlib import Path
from typing import Any

if not __package__:  # run as a file (python examples/x.py): make `examples` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np
import torch

from examples._smoke import add_smoke_argument, has_sbibm, output_folder

TASKS = ("two_moons", "gaussian_linear_uniform", "gaussian_mixture", "slcp")
ESTIMATORS = ("sbi_maf", "zuko_nsf")
LOCAL = ("ours_nf", "ours_perm", "sbi_nf", "sbi_perm")
LOCAL_NAMES = {
    "ours_nf": "ours L-C2ST-NF", "ours_perm": "ours L-C2ST", "sbi_nf": "sbi LC2ST_NF",
    "sbi_perm": "sbi LC2ST", "diagnose": "cl.diagnose (Holm)",
}  # fmt: skip
LEVEL, WRONG, RIGHT = 0.05, 0.6, 0.55
GLOBAL = ("kccsd", "ranks", "tarp", "recovery", "misspecification")
warnings.filterwarnings("ignore")


def timed(fn: Any) -> tuple[Any, float]:
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


# -- data and estimators -------------------------------------------------------------------
def task_data(name: str, num_cal: int, num_oracle: int) -> dict[str, Any]:
    """Calibration pairs (seeded), sbibm's 10 observations and reference samples."""
    import sbibm

    task = sbibm.get_task(name)
    torch.manual_seed(12345)
    theta = task.get_prior()(num_samples=num_cal)
    x = task.get_simulator()(theta)
    x_o = torch.cat([task.get_observation(num_observation=i) for i in range(1, 11)])
    reference = torch.stack(
        [task.get_reference_posterior_samples(num_observation=i)[:num_oracle] for i in range(1, 11)]
    )  # (10, S, D)
    return {"task": task, "theta": theta, "x": x, "x_o": x_o, "reference": reference}


def train(name: str, kind: str, budget: int, seed: int, cache: Path, max_epochs: int) -> Any:
    """The trained estimator, from ``cache`` when it is there."""
    path = cache / f"{name}_{kind}_{budget}_{seed}.pt"
    if path.exists():
        return torch.load(path, weights_only=False)
    import sbibm

    task = sbibm.get_task(name)
    torch.manual_seed(1000 * seed + budget)
    theta = task.get_prior()(num_samples=budget)
    x = task.get_simulator()(theta)
    torch.manual_seed(seed)
    if kind == "sbi_maf":
        from sbi.inference import NPE

        inference = NPE(prior=task.get_prior_dist(), density_estimator="maf")
        estimator = inference.append_simulations(theta, x).train(
            max_num_epochs=max_epochs, show_train_summary=False
        )
    else:
        import lightning as L
        from lightning.pytorch.callbacks import EarlyStopping
        from torch.utils.data import DataLoader, TensorDataset

        from examples._npe import NPE, build_flow

        order = torch.randperm(budget)
        val, fit = order[: budget // 10], order[budget // 10 :]
        module = NPE(build_flow(theta[fit], x[fit]), lr=1e-3)
        trainer = L.Trainer(
            max_epochs=max_epochs, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False,
            callbacks=[EarlyStopping("val/nll", patience=20)],
        )  # fmt: skip
        loaders = [
            DataLoader(TensorDataset(theta[i], x[i]), batch_size=200, shuffle=shuffle)
            for i, shuffle in ((fit, True), (val, False))
        ]
        trainer.fit(module, *loaders)
        estimator = module.flow
    estimator = estimator.eval()
    cache.mkdir(parents=True, exist_ok=True)
    torch.save(estimator, path)
    return estimator


# -- the checks ----------------------------------------------------------------------------
def ours_nf_null(data: dict, cache: Path, args: Any) -> tuple[dict, float]:
    """``cl.LC2STNF``'s null on the task's calibration x: trained once, kept in ``cache``."""
    import calib_lightning as cl

    key = f"{data['task'].name}_{len(data['x'])}"
    path = cache / f"ours_null_{key}_{args.num_null_ours}.pt"
    if path.exists():
        return torch.load(path, weights_only=False)
    metric = cl.LC2STNF(
        data["x_o"], num_null=args.num_null_ours, num_posterior_samples=args.num_eval
    )
    dim = data["theta"].shape[1]
    _, seconds = timed(
        lambda: metric.null.fit(data["x"], dim=dim).statistics(
            metric.flat_observations, metric.pp_grid
        )
    )
    out = (metric.state_dict(), seconds)
    cache.mkdir(parents=True, exist_ok=True)
    torch.save(out, path)
    return out


def sbi_nf(
    data: dict, post: Any, drawn: torch.Tensor, null: Any, num_eval: int, num_null: int
) -> Any:
    from sbi.diagnostics.lc2st import LC2ST_NF
    from torch.distributions import MultivariateNormal

    dim = data["theta"].shape[1]
    return LC2ST_NF(
        prior_samples=data["theta"], xs=data["x"], posterior_samples=drawn,
        flow_inverse_transform=lambda t, c: post.to_latent(t, c).detach(),
        flow_base_dist=MultivariateNormal(torch.zeros(dim), torch.eye(dim)),
        num_eval=num_eval, trained_clfs_null=null, num_trials_null=num_null,
    )  # fmt: skip


def sbi_nf_null(data: dict, post: Any, drawn: torch.Tensor, cache: Path, args: Any) -> Any:
    """sbi's LC2ST_NF null on the task's calibration x: trained once, kept in ``cache``."""
    import pickle

    path = cache / f"sbi_null_{data['task'].name}_{len(data['x'])}.pkl"
    if path.exists():
        return pickle.loads(path.read_bytes())
    out = train_sbi_nf_null(data, post, drawn, args)
    path.write_bytes(pickle.dumps(out))
    return out


def train_sbi_nf_null(data: dict, post: Any, drawn: torch.Tensor, args: Any) -> tuple:
    """sbi's LC2ST_NF null classifiers, trained now, and the seconds it took."""
    test = sbi_nf(data, post, drawn, None, args.num_eval, args.num_null)
    np.random.seed(0)  # noqa: NPY002 - sbi's classifiers draw from numpy's global state
    _, seconds = timed(lambda: test.train_under_null_hypothesis(verbosity=0))
    return test.trained_clfs_null, seconds


def sbi_nf_check(data: dict, post: Any, drawn: torch.Tensor, null: Any, args: Any) -> tuple:
    """sbi's ``LC2ST_NF`` check with a trained null: its statistics and p-values at the 10
    observations."""
    np.random.seed(1)  # noqa: NPY002 - sbi's classifiers draw from numpy's global state
    test = sbi_nf(data, post, drawn, null, args.num_eval, args.num_null)
    test.train_on_observed_data(verbosity=0)
    x_o = data["x_o"]
    stats = [float(test.get_statistic_on_observed_data(x_o[o])) for o in range(10)]
    return stats, [float(test.p_value(x_o[o])) for o in range(10)]


def global_sbi(post: Any, data: dict, samples: torch.Tensor) -> dict[str, Any]:
    """sbi's ``check_sbc`` and ``check_tarp`` on draws ``samples (M, N, D)``."""
    from sbi.diagnostics.sbc import check_sbc
    from sbi.diagnostics.tarp import _run_tarp, check_tarp, get_tarp_references

    theta = data["theta"]
    ranks = (samples < theta).sum(0).float()  # (N, D) marginal ranks, as run_sbc's
    dap = samples[0]  # one draw per pair: the data-averaged posterior
    prior = data["task"].get_prior()(num_samples=len(theta))
    sbc, s_sbc = timed(lambda: check_sbc(ranks, prior, dap, samples.shape[0]))
    ks = [float(p) for p in sbc["ks_pvals"]]
    (ecp, alpha), s_tarp = timed(
        lambda: _run_tarp(samples, theta, get_tarp_references(theta), z_score_theta=True)
    )
    (_, tarp_p), s_check = timed(lambda: check_tarp(ecp, alpha))
    return {"sbi_sbc_ks": ks, "sbi_sbc_p": min(1.0, len(ks) * min(ks)), "s_sbi_sbc": s_sbc,
            "sbi_tarp_p": float(tarp_p), "s_sbi_tarp": s_tarp + s_check}  # fmt: skip


def run_case(data: dict, estimator: Any, args: argparse.Namespace, nulls: dict) -> dict:
    """Every check on one estimator; the row of the results file (lists over the 10 x_o)."""
    from sbi.diagnostics.lc2st import LC2ST as SbiLC2ST
    from sbibm.metrics import c2st

    import calib_lightning as cl

    post = cl.as_posterior(estimator)
    theta, x, x_o, reference = data["theta"], data["x"], data["x_o"], data["reference"]
    row: dict[str, Any] = {}
    torch.manual_seed(0)
    with torch.no_grad():
        samples = post.sample(x_o, reference.shape[1]).transpose(0, 1)  # (10, S, D)
        drawn = post.sample(x, 1)[0]  # one draw per calibration pair, both libraries
        eval_theta = post.sample(x_o, args.num_eval)  # (N_v, 10, D), for L-C2ST
    oracle = [timed(lambda o=o: float(c2st(reference[o], samples[o])[0])) for o in range(10)]
    row["oracle"], row["s_oracle"] = [v for v, _ in oracle], sum(s for _, s in oracle) / 10

    metric = cl.LC2STNF(x_o, num_null=args.num_null_ours, num_posterior_samples=args.num_eval)
    metric.load_state_dict(nulls["ours"][0])  # the task's null, no retraining

    def ours_nf() -> Any:
        metric.update(post, theta, x)
        return metric.compute()

    out, row["s_ours_nf"] = timed(ours_nf)
    row["ours_nf_stat"], row["ours_nf_p"] = out.statistic.tolist(), out.p_value.tolist()
    perm = cl.LC2ST(x_o, num_posterior_samples=args.num_eval, seed=1)

    def ours_perm() -> Any:
        perm.update(post, theta, x)
        return perm.compute()

    out, row["s_ours_perm"] = timed(ours_perm)
    row["ours_perm_stat"], row["ours_perm_p"] = out.statistic.tolist(), out.p_value.tolist()

    (row["sbi_nf_stat"], row["sbi_nf_p"]), row["s_sbi_nf"] = timed(
        lambda: sbi_nf_check(data, post, drawn, nulls["sbi"][0], args)
    )

    if args.sbi_lc2st_null > 0:

        def sbi_perm_check() -> tuple[list, list]:
            np.random.seed(1)  # noqa: NPY002
            test = SbiLC2ST(theta, x, drawn, num_trials_null=args.sbi_lc2st_null)
            test.train_on_observed_data(verbosity=0)
            test.train_under_null_hypothesis(verbosity=0)
            stats = [float(test.get_statistic_on_observed_data(eval_theta[:, o], x_o[o]))
                     for o in range(10)]  # fmt: skip
            return stats, [float(test.p_value(eval_theta[:, o], x_o[o])) for o in range(10)]

        (row["sbi_perm_stat"], row["sbi_perm_p"]), row["s_sbi_perm"] = timed(sbi_perm_check)

    report, row["s_diagnose"] = timed(
        lambda: cl.diagnose(post, theta, x, x_o, checks=GLOBAL, seed=0)
    )
    row["verdict"], row["overall_p"] = report.verdict, float(report.overall_p_value)
    for name in ("kccsd", "ranks", "tarp"):
        result = report.checks.get(name)
        if result is not None:
            row[f"diag_{name}_p"] = float(getattr(result, type(result).verdict))
            row[f"s_diag_{name}"] = report.seconds.get(name)
    # diagnose's local verdict: its L-C2ST-NF (num_null = local_num_null(10, 0.05) = 400,
    # the configuration of ours_nf here) read with Holm over the 10 observations
    row["diagnose_p"] = cl.functional.holm_adjust(torch.tensor(row["ours_nf_p"])).tolist()
    with torch.no_grad():
        draws = post.sample(x, args.num_draws)  # (M, N, D)
    row.update(global_sbi(post, data, draws))
    return row


# -- report -------------------------------------------------------------------------------
def spearman(a: list[float], b: list[float]) -> float:
    from scipy.stats import spearmanr

    value = spearmanr(a, b).statistic
    return float("nan") if value is None or math.isnan(value) else float(value)


def cell(hits: int, total: int) -> str:
    return f"{hits / total:.2f} ({hits}/{total})" if total else "-"


def report(rows: list[dict], args: argparse.Namespace, folder: Path) -> str:
    tests = [t for t in (*LOCAL, "diagnose") if any(f"{t}_p" in r for r in rows)]
    lines = [
        "# Local and global checks on sbibm's reference posteriors, beside sbi 0.27",
        "",
        f"`python examples/benchmarks/sbibm_validation.py` (resumable; cases in "
        f"`sbibm_validation.jsonl`). {len(rows)} estimators: "
        + ", ".join(sorted({f"{r['estimator']}" for r in rows}))
        + f"; budgets {sorted({r['budget'] for r in rows})}; seeds "
        f"{sorted({r['seed'] for r in rows})}. {args.num_cal} calibration pairs per task "
        f"(the same for every estimator and both libraries), sbibm's 10 observations, "
        f"oracle: sbibm 1.1.0 `c2st` on {args.num_oracle} reference vs {args.num_oracle} "
        f"estimator samples; L-C2ST(-NF): {args.num_eval} evaluation points; null "
        f"classifiers: ours L-C2ST-NF {args.num_null_ours} (cl.diagnose's number for 10 "
        f"observations), ours L-C2ST 100, sbi's LC2ST_NF {args.num_null}"
        + (
            f", sbi's LC2ST {args.sbi_lc2st_null}"
            if args.sbi_lc2st_null
            else " (sbi's LC2ST not run: `--sbi-lc2st-null 0`)"
        )
        + f". Estimators trained for at most {args.max_epochs} epochs. cl.diagnose ran its "
        "global checks (KCCSD, ranks, TARP, recovery, misspecification); its local verdict "
        "is its L-C2ST-NF read with Holm over the 10 observations, here taken from ours "
        "L-C2ST-NF, which has cl.diagnose's configuration but a null trained once per task. "
        f"{platform.machine()}, one thread, 2 cores shared with other jobs (load about 10), "
        f"torch {torch.__version__}.",
        "",
        f"Sensitivity: share of observations with oracle >= {WRONG} that the test rejects at "
        f"{LEVEL} (no multiplicity correction, except cl.diagnose: Holm over the 10 "
        f"observations, as its verdict); alarm rate: the same for oracle <= {RIGHT}.",
        "",
        "## Sensitivity and alarm rate",
        "",
        "| task | budget | wrong (oracle >= 0.6) | right (<= 0.55) | "
        + " | ".join(f"{LOCAL_NAMES[t]} sens. | alarm" for t in tests)
        + " |",
        "| --- | --- | --- | --- | " + " | ".join("--- | ---" for _ in tests) + " |",
    ]
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["task"], r["budget"]), []).append(r)
        groups.setdefault(("all", r["budget"]), []).append(r)
        groups.setdefault(("all", "all"), []).append(r)
    for (task, budget), group in groups.items():
        obs = [(r, o) for r in group for o in range(10)]
        wrong = [(r, o) for r, o in obs if r["oracle"][o] >= WRONG]
        right = [(r, o) for r, o in obs if r["oracle"][o] <= RIGHT]
        cells = []
        for t in tests:
            w = [(r, o) for r, o in wrong if f"{t}_p" in r]
            g = [(r, o) for r, o in right if f"{t}_p" in r]
            cells += [cell(sum(r[f"{t}_p"][o] <= LEVEL for r, o in w), len(w)),
                      cell(sum(r[f"{t}_p"][o] <= LEVEL for r, o in g), len(g))]  # fmt: skip
        lines.append(
            f"| {task} | {budget} | {len(wrong)} | {len(right)} | " + " | ".join(cells) + " |"
        )
    stats = [t for t in (*LOCAL, "diagnose") if any(f"{t}_stat" in r for r in rows)]
    lines += [
        "",
        "## Within-task Spearman correlation of each local statistic with the oracle",
        "",
        "Over the task's observations of every estimator at the budget (10 per estimator).",
        "",
        "| task | budget | points | " + " | ".join(LOCAL_NAMES[t] for t in stats) + " |",
        "| --- | --- | --- | " + " | ".join("---" for _ in stats) + " |",
    ]
    for (task, budget), group in groups.items():
        if task == "all":
            continue
        oracle = [v for r in group for v in r["oracle"]]
        cells = [
            f"{spearman(oracle, [v for r in group for v in r[f'{t}_stat']]):.2f}"
            if all(f"{t}_stat" in r for r in group) else "-"
            for t in stats
        ]  # fmt: skip
        lines.append(f"| {task} | {budget} | {len(oracle)} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "## Mean statistic and oracle per budget (the L-C2ST paper's Figure 2)",
        "",
        "| task | estimator | budget | oracle | "
        + " | ".join(LOCAL_NAMES[t] for t in stats)
        + " |",
        "| --- | --- | --- | --- | " + " | ".join("---" for _ in stats) + " |",
    ]
    for r in sorted(rows, key=lambda r: (r["task"], r["estimator"], r["budget"], r["seed"])):
        cells = [f"{np.mean(r[f'{t}_stat']):.4f}" if f"{t}_stat" in r else "-" for t in stats]
        lines.append(
            f"| {r['task']} | {r['estimator']} (seed {r['seed']}) | {r['budget']} | "
            f"{np.mean(r['oracle']):.3f} | " + " | ".join(cells) + " |"
        )
    lines += [
        "",
        "## Global checks per estimator (p-values) and cl.diagnose's verdict",
        "",
        "| task | estimator | budget | oracle mean | KCCSD | ranks | TARP | overall | "
        "sbi check_sbc (Bonferroni KS) | sbi check_tarp | verdict |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in sorted(rows, key=lambda r: (r["task"], r["estimator"], r["budget"], r["seed"])):
        ps = [r.get(f"diag_{k}_p") for k in ("kccsd", "ranks", "tarp")]
        cells = " | ".join("-" if p is None else f"{p:.3g}" for p in ps)
        lines.append(
            f"| {r['task']} | {r['estimator']} (seed {r['seed']}) | {r['budget']} | "
            f"{np.mean(r['oracle']):.3f} | {cells} | {r['overall_p']:.3g} | "
            f"{r['sbi_sbc_p']:.3g} | {r['sbi_tarp_p']:.3g} | {r['verdict'][:90]} |"
        )
    wrong_est = [r for r in rows if np.mean(r["oracle"]) >= WRONG]
    if wrong_est:
        lines += [
            "",
            f"Estimators with mean oracle >= {WRONG}: {len(wrong_est)}; rejected by the "
            f"overall verdict of cl.diagnose: {sum(r['overall_p'] <= LEVEL for r in wrong_est)}, "
            f"by sbi's check_sbc: {sum(r['sbi_sbc_p'] <= LEVEL for r in wrong_est)}, by sbi's "
            f"check_tarp: {sum(r['sbi_tarp_p'] <= LEVEL for r in wrong_est)}.",
        ]
    seconds = sorted({k for r in rows for k in r if k.startswith("s_")})
    lines += [
        "",
        "## Seconds per check (mean over estimators; wall clock, one thread, shared machine)",
        "",
        "Local checks: all 10 observations at once (oracle: per observation); ours "
        "L-C2ST-NF and sbi's LC2ST_NF without their null (trained once per task: "
        + ", ".join(
            f"{r['task']} ours {r['s_ours_null']:.1f} s, sbi {r['s_sbi_null']:.1f} s"
            for r in {r["task"]: r for r in rows}.values()
        )
        + ").",
        "",
        "| check | seconds |",
        "| --- | --- |",
    ]
    for k in seconds:
        values = [r[k] for r in rows if r.get(k) is not None]
        lines.append(f"| {k[2:]} | {np.mean(values):.2f} |")
    figure(rows, folder / "sbibm_validation.png")
    lines += ["", "![statistics against the oracle and the budget](sbibm_validation.png)", ""]
    return "\n".join(lines)


def figure(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = [t for t in TASKS if any(r["task"] == t for r in rows)]
    fig, axes = plt.subplots(2, len(tasks), figsize=(4 * len(tasks), 7), squeeze=False)
    for k, task in enumerate(tasks):
        group = [r for r in rows if r["task"] == task]
        ax = axes[0, k]
        for t, marker in (("ours_nf", "o"), ("sbi_nf", "x")):
            for r in group:
                reject = np.array(r[f"{t}_p"]) <= LEVEL
                color = "C0" if t == "ours_nf" else "C3"
                ax.scatter(np.array(r["oracle"])[reject], np.array(r[f"{t}_stat"])[reject],
                           marker=marker, color=color, s=18)  # fmt: skip
                ax.scatter(np.array(r["oracle"])[~reject], np.array(r[f"{t}_stat"])[~reject],
                           marker=marker, color=color, s=18, alpha=0.3)  # fmt: skip
        ax.axvline(WRONG, color="grey", lw=0.8, ls="--")
        ax.set_yscale("log")
        ax.set_title(f"{task}: o ours L-C2ST-NF, x sbi LC2ST_NF", fontsize=9)
        ax.set_xlabel("oracle C2ST accuracy (sbibm)")
        ax.set_ylabel("local statistic (faint: not rejected)")
        ax = axes[1, k]
        for j, (t, name) in enumerate((("oracle", "oracle"), ("ours_nf_stat", "L-C2ST-NF"))):
            for e, est in enumerate(ESTIMATORS):
                pts = sorted((r["budget"], np.mean(r[t])) for r in group if r["estimator"] == est)
                if pts:
                    style = "-" if j == 0 else "--"
                    ax.plot(*zip(*pts, strict=True), style, marker="o", color=f"C{e}",
                            label=f"{est}: {name}")  # fmt: skip
        ax.set_xscale("log")
        ax.set_xlabel("simulation budget")
        ax.set_ylabel("mean over observations")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


# -- main ---------------------------------------------------------------------------------
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", nargs="*", default=list(TASKS))
    parser.add_argument("--budgets", nargs="*", type=int, default=[1000, 10_000])
    parser.add_argument("--estimators", nargs="*", default=list(ESTIMATORS))
    parser.add_argument("--seeds", nargs="*", type=int, default=[0])
    parser.add_argument("--num-cal", type=int, default=2000)
    parser.add_argument("--num-oracle", type=int, default=1000)
    parser.add_argument("--num-eval", type=int, default=10_000)
    parser.add_argument("--num-draws", type=int, default=100, help="draws per pair, global")
    parser.add_argument("--sbi-lc2st-null", type=int, default=20, help="sbi LC2ST trials")
    parser.add_argument("--num-null", type=int, default=100, help="sbi LC2ST_NF null")
    parser.add_argument("--num-null-ours", type=int, default=400, help="as cl.diagnose")
    parser.add_argument("--max-epochs", type=int, default=100)
    parser.add_argument("--cache", type=Path, default=Path("/tmp/sbibm_validation_cache"))
    parser.add_argument("--results", type=Path, help="JSON lines of cases (resumed)")
    parser.add_argument("--report", action="store_true", help="rewrite the table only")
    add_smoke_argument(parser)
    args = parser.parse_args()
    if not has_sbibm():
        return
    folder = output_folder(Path(__file__).parent / "results", args.smoke)
    if args.smoke:
        args.tasks, args.budgets, args.estimators = ["two_moons"], [300], list(ESTIMATORS)
        args.num_cal, args.num_oracle, args.num_eval, args.num_draws = 300, 200, 500, 20
        args.sbi_lc2st_null, args.max_epochs, args.cache = 5, 3, folder / "cache"
        args.num_null, args.num_null_ours = 5, 20
    results = args.results or folder / "sbibm_validation.jsonl"
    lines = results.read_text().splitlines() if results.exists() else []
    rows = [json.loads(line) for line in lines if line.strip()]
    done = {(r["task"], r["estimator"], r["budget"], r["seed"]) for r in rows}
    torch.set_num_threads(1)
    from threadpoolctl import threadpool_limits

    with threadpool_limits(1):
        for name in [] if args.report else args.tasks:
            todo = [(e, b, s) for e in args.estimators for b in args.budgets for s in args.seeds
                    if (name, e, b, s) not in done]  # fmt: skip
            if not todo:
                continue
            data = task_data(name, args.num_cal, args.num_oracle)
            nulls: dict[str, Any] = {}
            for kind, budget, seed in todo:
                estimator, s_train = timed(
                    lambda n=name, k=kind, b=budget, s=seed: train(
                        n, k, b, s, args.cache, args.max_epochs
                    )
                )
                if not nulls:
                    import calib_lightning as cl

                    nulls["ours"] = ours_nf_null(data, args.cache, args)
                    post = cl.as_posterior(estimator)
                    with torch.no_grad():
                        drawn = post.sample(data["x"], 1)[0]
                    nulls["sbi"] = sbi_nf_null(data, post, drawn, args.cache, args)
                row = {"task": name, "estimator": kind, "budget": budget, "seed": seed,
                       "s_train": s_train, "s_ours_null": nulls["ours"][1],
                       "s_sbi_null": nulls["sbi"][1]}  # fmt: skip
                row.update(run_case(data, estimator, args, nulls))
                rows.append(row)
                with results.open("a") as f:
                    f.write(json.dumps(row) + "\n")
                print(json.dumps({k: v for k, v in row.items() if not isinstance(v, list)}),
                      flush=True)  # fmt: skip
                (folder / "sbibm_validation.md").write_text(report(rows, args, folder))
    if rows:
        (folder / "sbibm_validation.md").write_text(report(rows, args, folder))
        print(report(rows, args, folder))
    print(f"wrote {folder / 'sbibm_validation.md'}")


if __name__ == "__main__":
    main()
