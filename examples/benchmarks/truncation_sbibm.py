"""Restricting sbibm estimators to the prior's support, judged by the oracle (issues 23, 25).

``cl.diagnose(..., prior=prior)`` finds that sbibm estimators put 3-78 % of their draws
outside the prior's box (``lc2st_calibration_size.py --leakage``). The fix the package
offers is ``cl.recalibrate(..., prior=prior)`` (``cl.TruncatedPosterior``): reject the
draws outside and renormalize, which never raises the expected NLL. This script measures
what it does on the estimators of ``sbibm_validation.py``'s cache (4 tasks, sbi's default
MAF and the package's zuko NSF, 1,000 and 10,000 simulations, seed 0), against sbibm's
reference posteriors:

* the oracle (sbibm's ``c2st``, its defaults) of ``--num-samples`` draws at each of the 10
  observations against as many reference samples, raw and truncated, in the same run
  (draws under seed 0 each);
* the share of the raw draws outside the support at the observations;
* the expected NLL gain on the validation's 1,000 calibration pairs: the mean of
  :math:`-\\log \\hat Z(x)` (the truncated posterior's NLL is the flow's minus it);
* seconds to draw at the 10 observations, raw and truncated (rejection, and the
  normalizer of each observation, 1,000 draws or more).

Install sbibm as ``sbibm_validation.py`` says; the estimators come from its ``--cache``
(``/tmp/sbibm_validation_cache`` by default: run it first). The committed table::

    PYTHONPATH=. python examples/benchmarks/truncation_sbibm.py --tasks two_moons slcp &
    PYTHONPATH=. python examples/benchmarks/truncation_sbibm.py \\
        --tasks gaussian_linear_uniform gaussian_mixture
    PYTHONPATH=. python examples/benchmarks/truncation_sbibm.py --report-only

(two processes side by side on 2 cores, each appending to
``results/truncation_sbibm.jsonl``). ``--smoke``: Two Moons, a small zuko flow trained
for 2 epochs into a temporary cache, 100 draws; a temporary folder.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

if not __package__:  # run as a file (python examples/x.py): make `examples` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch

from examples._smoke import add_smoke_argument, has_sbibm, output_folder

RESULTS = Path(__file__).parent / "results"
TASKS = ("two_moons", "gaussian_linear_uniform", "gaussian_mixture", "slcp")
ESTIMATORS = ("sbi_maf", "zuko_nsf")
BUDGETS = (1000, 10000)


def measure(key: tuple, cache: Path, num_samples: int, num_cal: int, max_epochs: int) -> dict:
    """The oracle raw and truncated, the leakage, the NLL gain and the seconds of one
    estimator."""
    from sbibm.metrics import c2st

    import calib_lightning as cl
    from calib_lightning._utils.prior import outside_support
    from examples.benchmarks.sbibm_validation import task_data, train

    data = task_data(key[0], num_cal, num_samples)
    prior = data["task"].get_prior_dist()
    flow = cl.as_posterior(train(*key, cache, max_epochs))
    truncated = cl.recalibrate(flow, data["theta"], data["x"], method="none", prior=prior)
    out: dict = {"key": list(key)}
    for name, post in (("raw", flow), ("truncated", truncated)):
        torch.manual_seed(0)
        start = time.perf_counter()
        with torch.no_grad():
            draws = post.sample(data["x_o"], num_samples).transpose(0, 1)  # (10, S, D)
        out[f"seconds_{name}"] = time.perf_counter() - start
        out[f"oracle_{name}"] = [float(c2st(data["reference"][o], draws[o])[0])
                                 for o in range(draws.shape[0])]  # fmt: skip
        if name == "raw":
            out["leakage"] = outside_support(prior, draws).double().mean(1).tolist()
    torch.manual_seed(1)
    out["nll_gain"] = float(-truncated.log_normalizer(data["x"]).mean())
    return out


def report(rows: list[dict], num_samples: int) -> str:
    from scipy.stats import binomtest

    lines = [
        "# sbibm estimators restricted to the prior's support",
        "",
        "`PYTHONPATH=. python examples/benchmarks/truncation_sbibm.py` (module docstring: "
        f"the commands); sbibm 1.1.0, torch {torch.__version__}, 2 shared cores. Oracle: "
        f"sbibm's `c2st` of {num_samples} draws against as many reference samples at each "
        "of the 10 observations (0.5: indistinguishable), raw and truncated "
        "(`cl.recalibrate(flow, theta_cal, x_cal, method='none', prior=prior)`), mean over "
        "the observations, and in how many of the 10 the truncated one reads lower. Leakage: "
        "share of the raw draws at the observations outside the prior's support. NLL gain: "
        "mean of -log Z(x) over the 1,000 calibration pairs (the truncated posterior's "
        "expected NLL is lower by this, as the true posterior has no mass outside). "
        "Seconds: drawing at the 10 observations.",
        "",
        "| task | estimator | simulations | leakage | oracle raw | oracle truncated | "
        "difference | lower in | NLL gain (nats) | s raw | s truncated |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        raw, cut = r["oracle_raw"], r["oracle_truncated"]
        diff = [b - a for a, b in zip(raw, cut, strict=True)]
        task, kind, budget, _ = r["key"]
        lines.append(
            f"| {task} | {kind} | {budget:,} | {statistics.mean(r['leakage']):.1%} | "
            f"{statistics.mean(raw):.3f} | {statistics.mean(cut):.3f} | "
            f"{statistics.mean(diff):+.3f} | {sum(d < 0 for d in diff)}/{len(diff)} | "
            f"{r['nll_gain']:.3f} | {r['seconds_raw']:.2f} | {r['seconds_truncated']:.2f} |"
        )
    if rows:
        raw = [v for r in rows for v in r["oracle_raw"]]
        cut = [v for r in rows for v in r["oracle_truncated"]]
        lower = sum(b < a for a, b in zip(raw, cut, strict=True))
        sign = binomtest(lower, len(raw)).pvalue
        lines += [
            "",
            f"Over all {len(raw)} observations: oracle {statistics.mean(raw):.3f} raw, "
            f"{statistics.mean(cut):.3f} truncated; lower at {lower} (two-sided sign test "
            f"p = {sign:.2g}); at or above 0.6 "
            f"(clearly wrong) {sum(v >= 0.6 for v in raw)} raw, "
            f"{sum(v >= 0.6 for v in cut)} truncated.",
        ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", nargs="*", default=list(TASKS))
    parser.add_argument("--cache", type=Path, default=Path("/tmp/sbibm_validation_cache"))
    parser.add_argument("--num-samples", type=int, default=1000)
    parser.add_argument("--report-only", action="store_true")
    add_smoke_argument(parser)
    args = parser.parse_args()
    if not has_sbibm():
        return
    folder = output_folder(RESULTS, args.smoke)
    path = folder / "truncation_sbibm.jsonl"
    keys = [(t, e, b, 0) for t in args.tasks for e in ESTIMATORS for b in BUDGETS]
    num_cal, max_epochs = 1000, 100
    if args.smoke:
        keys, args.cache, args.num_samples = [("two_moons", "zuko_nsf", 200, 0)], folder, 100
        num_cal, max_epochs = 200, 2
    done = {tuple(json.loads(line)["key"]) for line in path.read_text().splitlines()
            if line.strip()} if path.exists() else set()  # fmt: skip
    for key in keys if not args.report_only else []:
        if key in done:
            continue
        if not args.smoke and not (args.cache / "{}_{}_{}_{}.pt".format(*key)).exists():
            raise ValueError(f"cache: no estimator {key} in {args.cache}; run sbibm_validation.py")
        row = measure(key, args.cache, args.num_samples, num_cal, max_epochs)
        with path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        print("done:", key, flush=True)
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    order = {key: i for i, key in enumerate((t, e, b, 0) for t in TASKS for e in ESTIMATORS
                                            for b in BUDGETS)}  # fmt: skip
    rows.sort(key=lambda r: order.get(tuple(r["key"]), len(order)))
    text = report(rows, args.num_samples)
    (folder / "truncation_sbibm.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
