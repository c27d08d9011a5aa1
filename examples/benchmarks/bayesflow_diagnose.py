"""``cl.diagnose`` on a trained BayesFlow approximator, beside BayesFlow's own diagnostics.

A BayesFlow 2 ``ContinuousApproximator`` (a coupling flow, Keras' torch backend) is trained
with ``fit`` on ``GaussianToy(dim=2)`` (``theta ~ N(0, I_2)``, ``x = theta + N(0, 0.5^2)``;
2,000 simulations, 20 epochs). On ``N`` held-out pairs with ``M`` draws per pair:

* ours: ``cl.diagnose(approximator, theta, x, observations=x_o)``, every check that applies
  (ranks, TARP, the joint classifier test, recovery, KCCSD, L-C2ST-NF at the ``O``
  observations, the misspecification test), its whole table, and the wall seconds;
* BayesFlow's: ``approximator.sample`` (the ``M`` draws at every pair), then on those draws
  ``calibration_log_gamma``, ``calibration_error``, ``posterior_contraction``,
  ``posterior_z_score`` and ``root_mean_squared_error`` (wall seconds each);
* on the same BayesFlow draws, the package's ranks (``functional.sbc.rank_calibration``
  with the distance rank: no densities) beside ``calibration_log_gamma`` per parameter
  (log gamma < 0 rejects uniform ranks at 5 %), once on the draws as they are and once on
  draws shrunk to half their spread around their mean (over-confident).

Run: KERAS_BACKEND=torch python examples/benchmarks/bayesflow_diagnose.py [--pairs 500]
[--draws 100] (``--smoke``: tiny sizes, the table in a temporary folder). Without bayesflow
installed it says so and writes nothing.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time
import warnings
from pathlib import Path

if not __package__:  # run as a file (python examples/x.py): make `examples` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np
import torch

import calib_lightning as cl
from calib_lightning.functional.sbc import rank_calibration
from calib_lightning.tasks import GaussianToy
from examples._smoke import add_smoke_argument, output_folder

RESULTS = Path(__file__).resolve().parent / "results"
warnings.filterwarnings("ignore")


def train(bf, keras, toy: GaussianToy, num: int, epochs: int):
    """A coupling flow approximator fitted with Keras' ``fit`` (seconds)."""
    theta, x = toy.sample(num, torch.Generator().manual_seed(0))
    data = {"theta": theta.numpy(), "x": x.numpy()}
    keras.utils.set_random_seed(0)
    adapter = bf.ContinuousApproximator.build_adapter(
        inference_variables=["theta"], inference_conditions=["x"]
    )
    approximator = bf.ContinuousApproximator(
        inference_network=bf.networks.CouplingFlow(depth=4, subnet_kwargs={"widths": (64, 64)}),
        adapter=adapter,
    )
    approximator.compile(optimizer=keras.optimizers.Adam(1e-3))
    dataset = bf.datasets.OfflineDataset(data, batch_size=128, adapter=adapter)
    approximator.fit(dataset=dataset, epochs=epochs, verbose=0)
    return approximator


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--pairs", type=int, default=500)
    parser.add_argument("--draws", type=int, default=100)
    parser.add_argument("--observations", type=int, default=2)
    add_smoke_argument(parser)
    args = parser.parse_args()
    if importlib.util.find_spec("bayesflow") is None:
        print("bayesflow is not installed (pip install 'calib_lightning[bayesflow]'): skipped")
        return
    os.environ.setdefault("KERAS_BACKEND", "torch")
    grad = torch.is_grad_enabled()
    import bayesflow as bf
    import keras

    torch.set_grad_enabled(grad)  # bayesflow turns autograd off when it is imported
    torch.set_num_threads(1)
    pairs, draws, num_obs = (
        (40, 20, 1) if args.smoke else (args.pairs, args.draws, args.observations)
    )
    toy = GaussianToy(dim=2)
    approximator, train_seconds = timed(
        lambda: train(bf, keras, toy, 200 if args.smoke else 2000, 2 if args.smoke else 20)
    )
    generator = torch.Generator().manual_seed(1)
    theta, x = toy.sample(pairs, generator)
    observations = toy.sample(num_obs, generator)[1]

    report, diagnose_seconds = timed(
        lambda: cl.diagnose(
            approximator, theta, x, observations=observations, num_posterior_samples=draws
        )
    )
    print(report.table())

    samples, sample_seconds = timed(
        lambda: approximator.sample(num_samples=draws, conditions={"x": x.numpy()})["theta"]
    )
    samples = samples.astype("float32")  # (N, M, D)
    truth = theta.numpy()
    metrics = bf.diagnostics.metrics
    theirs = {}
    names = ("calibration_error", "posterior_contraction", "posterior_z_score")
    for name in (*names, "root_mean_squared_error"):
        out, seconds = timed(lambda name=name: getattr(metrics, name)(samples, truth))
        theirs[name] = (np.asarray(out["values"]), seconds)

    mean = samples.mean(1, keepdims=True)
    shrunk = mean + 0.5 * (samples - mean)
    agreement = []
    for label, cloud in (("as drawn", samples), ("shrunk to half their spread", shrunk)):
        np.random.seed(0)  # noqa: NPY002 - BayesFlow's null draws from numpy's global generator
        gamma, gamma_seconds = timed(
            lambda cloud=cloud: metrics.calibration_log_gamma(cloud, truth)
        )
        draws_t = torch.from_numpy(cloud).transpose(0, 1)  # (M, N, D)
        ours, ours_seconds = timed(
            lambda draws_t=draws_t: rank_calibration(draws_t, None, theta, None)
        )
        agreement.append((label, np.asarray(gamma["values"]), gamma_seconds, ours, ours_seconds))
        if label == "as drawn":
            theirs["calibration_log_gamma"] = (np.asarray(gamma["values"]), gamma_seconds)

    results = output_folder(RESULTS, args.smoke) / "bayesflow_diagnose.md"
    bf_total = sample_seconds + sum(seconds for _, seconds in theirs.values())
    lines = [
        "# cl.diagnose on a BayesFlow approximator, beside BayesFlow's diagnostics",
        "",
        f"Written by `examples/benchmarks/bayesflow_diagnose.py --pairs {pairs} --draws "
        f"{draws} --observations {num_obs}`{' --smoke' if args.smoke else ''}: bayesflow "
        f"{bf.__version__}, keras {keras.__version__} (torch backend), torch "
        f"{torch.__version__}; a coupling flow (4 couplings, 64-unit subnets) trained with "
        f"`fit` on GaussianToy(dim=2) in {train_seconds:.1f} s; N = {pairs} held-out pairs, "
        f"M = {draws} draws per pair, O = {num_obs} observations. Wall seconds of one run "
        "each, one torch thread, a 2-core machine shared with other jobs (a single time "
        "moves by up to 3x with the load).",
        "",
        "## cl.diagnose: the whole table",
        "",
        f"`cl.diagnose(approximator, theta, x, observations=x_o, num_posterior_samples={draws})`"
        f" took {diagnose_seconds:.2f} s. Verdict: {report.verdict}",
        "",
        "```",
        report.table(),
        "```",
        "",
        "## BayesFlow's own diagnostics on its draws",
        "",
        "| diagnostic | values (per parameter) | seconds |",
        "| --- | --- | ---: |",
        f"| `approximator.sample` ({draws} draws at each of the {pairs} pairs) | | "
        f"{sample_seconds:.2f} |",
    ]
    for name, (values, seconds) in theirs.items():
        shown = ", ".join(f"{v:.3f}" for v in np.atleast_1d(values))
        lines.append(f"| `{name}` | {shown} | {seconds:.2f} |")
    lines += [
        f"| all of them, with the sampling | | {bf_total:.2f} |",
        "",
        f"`cl.diagnose` / BayesFlow's (sampling and five metrics): "
        f"{diagnose_seconds / bf_total:.1f}x, for the tests BayesFlow has not: TARP, the "
        "joint classifier test, KCCSD, L-C2ST-NF at each observation and the "
        "misspecification test, each with a p-value, and one verdict.",
        "",
        "## The same draws: the package's ranks beside BayesFlow's log gamma",
        "",
        "log gamma < 0 rejects uniform ranks at 5 % (per parameter); the package's ECDF "
        "p-values test the same marginal ranks (per parameter), its global p-value combines "
        "every marginal and the joint (distance) rank test.",
        "",
        "| draws | log gamma (BayesFlow) | ECDF p-values (ours) | global p-value (ours) | "
        "seconds BayesFlow / ours |",
        "| --- | --- | --- | ---: | ---: |",
    ]
    for label, gamma, gamma_seconds, ours, ours_seconds in agreement:
        p_values = ", ".join(f"{float(p):.3g}" for p in ours.ecdf_p_values[:2])
        lines.append(
            f"| {label} | {', '.join(f'{g:.3f}' for g in gamma)} | {p_values} | "
            f"{float(ours.global_p_value):.3g} | {gamma_seconds:.2f} / {ours_seconds:.2f} |"
        )
    results.write_text("\n".join(lines) + "\n")
    print("wrote", results)


if __name__ == "__main__":
    main()
