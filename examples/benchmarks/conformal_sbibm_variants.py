"""Partition variants of the local conformal region on sbibm (issue 25), from a cache.

The local region's tree (``cl.ConformalRegion(local=True)``) splits the held-out pairs on
features of ``x``; this script compares which features and which leaf size, on the flows
of ``conformal_sbibm.py`` (same simulations, training recipe and seeds):

* ``x``: ``x`` flattened (``embedding=None``);
* ``summary``: the posterior summary of ``embedding="posterior"``: per-coordinate mean
  and standard deviation of the flow's 1,000 draws at ``x`` and their mean log-density;
* ``x+summary``: both; ``scale``: the standard deviations and mean log-density only;
* ``min_leaf_size`` 50, 100 and 200 for each;
* ``... early-stopping tree``: the tree fitted on the flow's early-stopping pairs
  (``fit_partition``: 10 % of the training pairs, 800, never used for its weights), so
  that all 2,000 held-out pairs calibrate the leaves, for ``x`` and ``summary``;
* ``... regression``: ``local="regression"`` in place of the tree (a linear location-scale
  regression of the log-density score on the summary; normalized split conformal), on a
  split of the held-out pairs or on the early-stopping pairs.

Per (task, seed) the cache keeps the trained flow, the held-out pairs' scores and summary
features (from the scoring draws, as ``fit`` takes them), per sbibm observation the flow
credibilities of its 10,000 reference samples and its features (from other draws, as at
new ``x``), and 2,000 fresh prior-predictive pairs (credibility and features). Every
variant is then a tree fit (seconds). Two numbers per variant:

* ``error``: mean over sbibm's 10 observations of |coverage(x_o) - 0.9| (reference
  posteriors: the benchmark's number);
* ``pinball``: the 0.9-pinball loss of the region's level against the fresh pairs'
  credibilities, a held-out score of the level as an estimate of the conditional 0.9
  quantile of the credibility given ``x`` (lower: closer to conditional coverage), which
  needs no reference posterior; and the fresh pairs' marginal coverage.

Run (sbibm venv)::

    PYTHONPATH=. /work/venv-bench/bin/python examples/benchmarks/conformal_sbibm_variants.py \\
        --cache /tmp/aloc/cache
    PYTHONPATH=. /work/venv-bench/bin/python examples/benchmarks/conformal_sbibm_variants.py --smoke

Writes examples/benchmarks/results/conformal_sbibm_variants.json, which
``conformal_sbibm.py`` shows as its "Variants tried" table.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
from pathlib import Path
from typing import NamedTuple

if not __package__:  # run as a file (python examples/x.py): make `examples` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
from torch.distributions import Independent, Normal

import calib_lightning as cl
from calib_lightning import evaluation
from calib_lightning.recalibration._draw_stats import count_above, posterior_summary
from examples._smoke import add_smoke_argument, has_sbibm, output_folder
from examples.benchmarks import conformal_sbibm as cs

LEVEL = 0.9
KINDS = ("x", "summary", "x+summary", "scale")


class Variant(NamedTuple):
    """One region: its features (``None``: global), leaf size, and whether its model is
    fitted on the early-stopping pairs, on the log-density score, or is the regression."""

    name: str
    kind: str | None
    leaf: int
    stop: bool = False
    raw: bool = False
    regression: bool = False


def _score(flow: object, theta: torch.Tensor, x: torch.Tensor, seed: int, draws: int) -> dict:
    """Draws at each pair: how many beat the truth's density, and the summary features
    (``ConformalRegion.fit``'s own counting, from the same draws)."""
    torch.manual_seed(seed)
    above, feats = count_above(cl.as_posterior(flow), "density", theta, x, draws, summary=True)
    return {"above": above, "feats": feats}


def cache_run(task_name: str, seed: int, args: argparse.Namespace, folder: Path) -> dict:
    """Train (or load) the seed's flow and score what the variants need; cached."""
    import sbibm

    path = folder / f"{task_name}_{seed}.pt"
    task = sbibm.get_task(task_name)
    theta, x = cs.simulate(task, args.budget, seed)
    n_cal = int(args.calib * args.budget)
    if path.exists():
        out = torch.load(path)
        if "stop" not in out or "raw" not in out:  # cached before these variants
            flow, _ = cs.trained(task_name, seed, theta[n_cal:], x[n_cal:], args.max_epochs,
                                 folder)  # fmt: skip
            if "stop" not in out:
                out["stop"] = _stopping_pairs(flow, theta[n_cal:], x[n_cal:], seed,
                                              args.samples)  # fmt: skip
            out["raw"] = _raw_scores(flow, task, out, args, seed)
            torch.save(out, path)
        return out
    flow, _ = cs.trained(task_name, seed, theta[n_cal:], x[n_cal:], args.max_epochs, folder)
    s = args.samples
    held = _score(flow, theta[:n_cal], x[:n_cal], seed, s)
    noise = torch.rand(n_cal, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    post = cl.as_posterior(flow)
    obs = []
    for k in range(1, args.observations + 1):
        x_o = task.get_observation(num_observation=k).float()
        reference = task.get_reference_posterior_samples(num_observation=k).float()
        torch.manual_seed(seed * 100 + k)
        draws = evaluation.draws(post, x_o, s)
        with torch.no_grad():
            ell, ell_ref = post.log_prob(draws, x_o), post.log_prob(reference[:, None], x_o)
        cred = (ell[:, None] > ell_ref[None]).sum(0).double()[:, 0] / (s + 1)
        torch.manual_seed(10_000 + seed * 100 + k)  # features from other draws, as at new x
        draws = evaluation.draws(post, x_o, s)
        with torch.no_grad():
            feat = posterior_summary(draws, post.log_prob(draws, x_o))[0]
        obs.append({"x": x_o, "cred": cred.float(), "feat": feat})
    theta_new, x_new = cs.simulate(task, args.fresh, 5000 + seed)
    fresh = _score(flow, theta_new, x_new, 6000 + seed, s)
    out = {"theta_cal": theta[:n_cal], "x_cal": x[:n_cal], "feats": held["feats"],
           "scores": (held["above"] + noise) / (s + 1), "obs": obs,
           "fresh": {"x": x_new, "cred": fresh["above"] / (s + 1), "feats": fresh["feats"]},
           "stop": _stopping_pairs(flow, theta[n_cal:], x[n_cal:], seed, s)}
    out["raw"] = _raw_scores(flow, task, out, args, seed)
    torch.save(out, path)
    return out


def _raw_scores(flow: object, task: object, run: dict, args: argparse.Namespace,
                seed: int) -> dict:  # fmt: skip
    """The log-density score ``-log q(theta | x)`` (CP4SBI's HPD score; no draws) of the
    held-out, early-stopping and fresh pairs and of each observation's reference samples."""
    theta_new, x_new = cs.simulate(task, args.fresh, 5000 + seed)
    if not torch.equal(x_new, run["fresh"]["x"]):
        raise ValueError("the fresh pairs differ from the cached ones: clear the cache")
    with torch.no_grad():
        def score(theta: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
            return -flow(x).log_prob(theta).double()

        obs = []
        for k, o in enumerate(run["obs"], 1):
            reference = task.get_reference_posterior_samples(num_observation=k).float()
            obs.append(score(reference[: len(o["cred"])], o["x"]))
        return {"held": score(run["theta_cal"], run["x_cal"]), "obs": obs,
                "stop": score(run["stop"]["theta"], run["stop"]["x"]),
                "fresh": score(theta_new, x_new)}  # fmt: skip


def _stopping_pairs(flow: object, theta: torch.Tensor, x: torch.Tensor, seed: int,
                    draws: int) -> dict:  # fmt: skip
    """The early-stopping pairs of the flow (``cs.train``'s split of its training pairs):
    their observations, randomized scores and summary features."""
    rows, _ = cs.early_stopping_split(len(theta), torch.Generator().manual_seed(seed))
    scored = _score(flow, theta[rows], x[rows], 7000 + seed, draws)
    noise = torch.rand(len(rows), generator=torch.Generator().manual_seed(8000 + seed),
                       dtype=torch.float64)  # fmt: skip
    return {"theta": theta[rows], "x": x[rows], "scores": (scored["above"] + noise) / (draws + 1),
            "feats": scored["feats"]}  # fmt: skip


def _features(kind: str, x: torch.Tensor, summary: torch.Tensor) -> torch.Tensor:
    x, summary, d = x.reshape(len(x), -1).double(), summary.double(), (summary.shape[1] - 1) // 2
    return {"x": x, "summary": summary, "x+summary": torch.cat([x, summary], 1),
            "scale": summary[:, d:]}[kind]  # fmt: skip


def evaluate(run: dict, seed: int, kind: str | None, leaf: int, stop: bool = False,
             raw: bool = False, regression: bool = False) -> dict:  # fmt: skip
    """One variant (``kind=None``: the global region) on one cached run; ``stop``: the
    tree fitted on the early-stopping pairs, every held-out pair calibrating; ``raw``: the
    log-density score instead of the credibility (a region ``{-log q <= t}``, ``t`` the
    calibrated quantile; no pinball loss: its scale is not the credibility's)."""
    obs, fresh, early = run["obs"], run["fresh"], run["stop"]
    scores = run["raw"] if raw else {"held": run["scores"], "stop": early["scores"],
                                     "fresh": fresh["cred"], "obs": [o["cred"] for o in obs]}
    xs = [run["x_cal"], fresh["x"], early["x"], *[o["x"] for o in obs]]
    xs = torch.cat([v.reshape(len(v), -1) for v in xs])
    feats = torch.cat([run["feats"], fresh["feats"], early["feats"],
                       *[o["feat"][None] for o in obs]])  # fmt: skip
    table = dict(zip([r.numpy().tobytes() for r in xs.float()],
                     _features(kind or "x", xs, feats), strict=True))  # fmt: skip

    def lookup(x: torch.Tensor) -> torch.Tensor:  # the cached features of these x
        return torch.stack([table[r.numpy().tobytes()] for r in x.reshape(len(x), -1).float()])

    d = run["theta_cal"].shape[1]

    def unused(x: torch.Tensor) -> Independent:  # scores are given: never sampled
        return Independent(Normal(torch.zeros(len(x), d), 1.0), 1)

    local = "regression" if regression else kind is not None
    region = cl.ConformalRegion(unused, local=local, min_leaf_size=leaf,
                                embedding=lookup, seed=seed,
                                conformity="log_density" if raw else "credibility")  # fmt: skip
    if stop:
        region.fit_partition(early["theta"], early["x"], scores=scores["stop"].double())
    region.fit(run["theta_cal"], run["x_cal"], scores=scores["held"].double())

    def inside(score: torch.Tensor, a: torch.Tensor | float) -> torch.Tensor:
        return (score.double() <= a) if raw else (score.double() < a)

    def level_at(x: torch.Tensor) -> torch.Tensor:  # the calibrated score: t, or a credibility
        return -region.threshold(x, LEVEL) if raw else region.calibrated_level(LEVEL, x)

    levels = [float(level_at(o["x"]).reshape(-1)[0]) for o in obs]
    error = statistics.fmean(abs(float(inside(c, a).double().mean()) - LEVEL)
                             for c, a in zip(scores["obs"], levels, strict=True))  # fmt: skip
    a_new = level_at(fresh["x"]).double()
    u = scores["fresh"].double() - a_new
    pinball = None if raw else float(torch.where(u >= 0, LEVEL * u, (LEVEL - 1) * u).mean())
    coverage = float(inside(scores["fresh"], a_new).double().mean())
    leaves = len(region._leaf_index) if kind is not None else 1
    return {"error": error, "pinball": pinball, "fresh_coverage": coverage, "leaves": leaves}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tasks", nargs="+", default=["slcp", "two_moons"])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--cache", type=Path, default=None, help="default: a temporary folder")
    parser.add_argument("--budget", type=int, default=10_000)
    parser.add_argument("--calib", type=float, default=0.2)
    parser.add_argument("--max-epochs", type=int, default=300)
    parser.add_argument("--observations", type=int, default=10)
    parser.add_argument("--fresh", type=int, default=2000)
    parser.add_argument("--samples", type=int, default=cs.NUM_POSTERIOR_SAMPLES)
    parser.add_argument("--leaves", type=int, nargs="+", default=[50, 100, 200])
    parser.add_argument("--out", default="conformal_sbibm_variants.json",
                        help="the json's name in the results folder")  # fmt: skip
    add_smoke_argument(parser)
    args = parser.parse_args()
    if not has_sbibm():
        return
    if args.smoke:
        args.tasks, args.seeds, args.budget, args.max_epochs = ["two_moons"], [0], 1200, 2
        args.observations, args.fresh, args.cache, args.samples = 2, 200, None, 100
        args.leaves = [20, 40]
    torch.set_num_threads(1)
    cache = args.cache or Path(tempfile.mkdtemp(prefix="conformal_variants_"))
    cache.mkdir(parents=True, exist_ok=True)
    variants = [Variant("global", None, 1)]
    variants += [Variant(f"{k} leaf {m}", k, m) for k in KINDS for m in args.leaves]
    variants += [Variant(f"{k} leaf {m}, early-stopping tree", k, m, stop=True)
                 for k in ("x", "summary") for m in args.leaves]  # fmt: skip
    leaf = args.leaves[len(args.leaves) // 2]  # the package's default, 100
    raw = "log-density score: "
    variants += [
        Variant(raw + "global", None, 1, raw=True),
        Variant(raw + f"summary leaf {leaf}", "summary", leaf, raw=True),
        Variant(raw + f"x leaf {leaf}, early-stopping tree", "x", leaf, stop=True, raw=True),
        Variant(raw + f"summary leaf {leaf}, early-stopping tree", "summary", leaf, stop=True,
                raw=True),
        Variant(raw + "summary regression", "summary", leaf, raw=True, regression=True),
        Variant(raw + "summary regression, early-stopping pairs", "summary", leaf, stop=True,
                raw=True, regression=True),
    ]  # fmt: skip
    out: dict = {}
    for task_name in args.tasks:
        for seed in args.seeds:
            run = cache_run(task_name, seed, args, cache)
            for v in variants:
                result = evaluate(run, seed, v.kind, v.leaf, v.stop, v.raw, v.regression)
                out.setdefault(task_name, {}).setdefault(v.name, []).append({"seed": seed,
                                                                             **result})
    folder = output_folder(Path(__file__).parent / "results", args.smoke)
    (folder / args.out).write_text(json.dumps(out, indent=1))
    for task_name, rows in out.items():
        print(f"## {task_name}")
        for name, rs in rows.items():
            print(f"{name:20s} " + "  ".join(f"{key} {_mean_se([r[key] for r in rs])}"
                                             for key in ("error", "pinball", "fresh_coverage")
                                             if rs[0][key] is not None))
    print(f"wrote {folder / args.out}")


def _mean_se(values: list[float]) -> str:
    if len(values) < 2:
        return f"{values[0]:.4f}"
    se = statistics.stdev(values) / math.sqrt(len(values))
    return f"{statistics.fmean(values):.4f} ± {se:.4f}"


if __name__ == "__main__":
    main()
