"""Local-HPD (Zhao et al. 2021): the local coverage baseline that L-C2ST is compared against.

Benchmark-only implementation of the local coverage test on HPD values, as seed 001
(Linhart et al. 2023, section 4 and appendix C) runs it against L-C2ST(-NF).

For each calibration pair the HPD value is the posterior mass of the region denser
than the truth, estimated with ``M`` samples:

    h_i = (1/M) #{k : q(theta_k | x_i) > q(theta*_i | x_i)},   theta_k ~ q(. | x_i).

Under local consistency at x, h | x ~ U(0, 1). For each level alpha on a grid
(``num_alphas`` = 11 interior levels 1/12, ..., 11/12), a classifier regresses
W_alpha = 1[h <= alpha] on x, estimating r_alpha(x) = P(h <= alpha | x). At an
observation x_o the statistic is

    T(x_o) = (1/A) sum_alpha (r_alpha(x_o) - alpha)^2,

and its null comes from refitting every classifier on h ~ U(0, 1) drawn independently
of x, ``num_null`` times: p = (1 + #{T_b >= T}) / (1 + B). Classifier: scikit-learn
``MLPClassifier(alpha=0, max_iter=25000)`` as in the L-C2ST authors' runs. The null
classifiers depend only on the calibration x's, so they are fitted once per set of x's
and reused for every posterior and observation (the same amortization L-C2ST-NF uses).

Experiment (GaussianToy, theta ~ N(0, I_2), x = theta + N(0, 0.5^2 I)): the calibration
x's are drawn once; every run redraws theta*_i | x_i from the exact posterior (a valid
draw from the joint given the x's), so one null serves all runs. Posterior estimators:
the exact posterior; variance x2; mean shifted by 0.3; and a *local* defect, variance
x4 only where x_1 > 0.5. Observations x_o: four points, two inside the defect region.
Reported: rejection rate at 0.05 per (estimator, x_o) over ``--runs`` runs; the time of
one statistic (HPD values + ``num_alphas`` fits) and of the null (``num_alphas * B``
fits), measured in the same run.

L-C2ST-NF (``calib_lightning.LC2STNF``, default batched MLP classifiers) runs beside it
through the same three methods, timed in the same run.

Run:  python examples/benchmarks/local_hpd.py [--n 1000] [--runs 20] [--num-null 100]
Writes examples/benchmarks/results/local_hpd.md (``--smoke``: 100 pairs, 1 run, 2 null
refits, written to a temporary folder).

References:
    Zhao, Dalmasso, Izbicki, Lee. "Diagnostics for conditional density models and
    Bayesian inference algorithms." UAI 2021.
    Linhart, Gramfort, Rodrigues. "L-C2ST: Local Diagnostics for Posterior
    Approximations in Simulation-Based Inference." NeurIPS 2023.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

if not __package__:  # run as a file (python examples/x.py): make `examples` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np
import torch
from sklearn.base import clone
from sklearn.neural_network import MLPClassifier
from torch.distributions import Independent, Normal

import calib_lightning as cl
from calib_lightning import as_posterior
from calib_lightning.tasks import GaussianToy
from examples._smoke import add_smoke_argument, output_folder

RESULTS = Path(__file__).parent / "results"
OBSERVATIONS = torch.tensor([[1.5, 0.0], [1.0, -1.0], [-1.0, 0.0], [-0.5, 1.5]])


def hpd_values(posterior: object, theta: torch.Tensor, x: torch.Tensor, num_samples: int):
    """HPD values h_i (N,) from ``num_samples`` posterior samples per pair."""
    post = as_posterior(posterior)
    _, log_q = post.sample_and_log_prob(x, num_samples)
    with torch.no_grad():
        log_q_true = post.log_prob(theta, x)
    return (log_q > log_q_true).double().mean(0).numpy()


class LocalHPD:
    """Local coverage test on HPD values with one classifier per level alpha."""

    name = "local-HPD"

    def __init__(self, num_alphas: int = 11, num_samples: int = 1000, num_null: int = 100,
                 seed: int = 0, max_iter: int = 25000) -> None:
        self.alphas = np.linspace(0.0, 1.0, num_alphas + 2)[1:-1]
        self.num_samples, self.num_null, self.seed = num_samples, num_null, seed
        self.classifier = MLPClassifier(alpha=0.0, max_iter=max_iter)
        self.null: np.ndarray | None = None
        self.time_null = 0.0

    def _fit_predict(self, x: np.ndarray, hpd: np.ndarray, x_obs: np.ndarray, seed: int):
        """r_alpha(x_o) for every alpha: (K, A)."""
        out = np.empty((x_obs.shape[0], self.alphas.size))
        for j, alpha in enumerate(self.alphas):
            labels = (hpd <= alpha).astype(int)
            if labels.min() == labels.max():  # one class only: the constant predictor
                out[:, j] = labels[0]
                continue
            model = clone(self.classifier).set_params(random_state=seed)
            out[:, j] = model.fit(x, labels).predict_proba(x_obs)[:, 1]
        return out

    def _statistic(self, r: np.ndarray) -> np.ndarray:
        return ((r - self.alphas) ** 2).mean(-1)

    def fit_null(self, x_cal: torch.Tensor, x_obs: torch.Tensor) -> None:
        """Null statistics (B, K) from h ~ U(0, 1) independent of x; depends on x's only."""
        rng = np.random.default_rng(self.seed)
        x, xo = x_cal.numpy(), x_obs.numpy()
        start = time.perf_counter()
        self.null = np.stack([
            self._statistic(self._fit_predict(x, rng.uniform(size=x.shape[0]), xo, b))
            for b in range(self.num_null)
        ])
        self.time_null = time.perf_counter() - start

    def statistic(self, posterior: object, theta: torch.Tensor, x: torch.Tensor,
                  x_obs: torch.Tensor) -> np.ndarray:
        hpd = hpd_values(posterior, theta, x, self.num_samples)
        return self._statistic(self._fit_predict(x.numpy(), hpd, x_obs.numpy(), self.seed))

    def p_values(self, statistic: np.ndarray) -> np.ndarray:
        return (1.0 + (self.null >= statistic).sum(0)) / (1.0 + self.null.shape[0])


class LC2STNFMethod:
    """L-C2ST-NF (calib_lightning.LC2STNF) behind the same three methods as LocalHPD."""

    name = "L-C2ST-NF"

    def __init__(self, num_null: int = 100, seed: int = 0) -> None:
        self.num_null, self.seed = num_null, seed
        self.time_null = 0.0

    def fit_null(self, x_cal: torch.Tensor, x_obs: torch.Tensor) -> None:
        self.metric = cl.LC2STNF(observations=x_obs, num_null=self.num_null, seed=self.seed)
        start = time.perf_counter()
        null = self.metric.null.fit(x_cal, dim=x_cal.shape[1])  # the classifiers, then
        null.statistics(self.metric.flat_observations, self.metric.pp_grid)  # their statistics
        self.time_null = time.perf_counter() - start

    def statistic(self, posterior: object, theta: torch.Tensor, x: torch.Tensor,
                  x_obs: torch.Tensor) -> np.ndarray:
        self.metric.reset()
        self.metric.update(posterior, theta, x)
        self._out = self.metric.compute()
        return self._out.statistic.numpy()

    def p_values(self, statistic: np.ndarray) -> np.ndarray:
        return self._out.p_value.numpy()


class LocalDefect:
    """Exact GaussianToy posterior, with its variance x``factor`` where x_1 > ``threshold``."""

    def __init__(self, toy: GaussianToy, factor: float = 4.0, threshold: float = 0.5) -> None:
        self.toy, self.factor, self.threshold = toy, factor, threshold

    def __call__(self, x: torch.Tensor) -> Independent:
        var = self.toy.weight * self.toy.noise_std**2
        scale = torch.where(x[:, :1] > self.threshold, self.factor, 1.0) * var
        return Independent(Normal(self.toy.weight * x, scale.sqrt().expand_as(x)), 1)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=1000, help="calibration pairs")
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--num-null", type=int, default=100)
    parser.add_argument("--num-samples", type=int, default=1000, help="samples per HPD value")
    add_smoke_argument(parser)
    args = parser.parse_args(argv)
    hpd_options = {}  # the full run: 11 levels, classifiers trained to convergence
    if args.smoke:
        args.n, args.runs, args.num_null, args.num_samples = 100, 1, 2, 50
        hpd_options = {"num_alphas": 3, "max_iter": 50}
    results = output_folder(RESULTS, args.smoke)
    torch.manual_seed(0)
    toy = GaussianToy(dim=2)
    g = torch.Generator().manual_seed(0)
    _, x_cal = toy.sample(args.n, g)
    estimators = {
        "exact posterior": toy.posterior(),
        "variance x2": toy.posterior(variance_scale=2.0),
        "mean shifted by 0.3": toy.posterior(shift=0.3),
        "variance x4 where x_1 > 0.5": LocalDefect(toy),
    }
    methods = [
        LocalHPD(num_samples=args.num_samples, num_null=args.num_null, **hpd_options),
        LC2STNFMethod(num_null=args.num_null),
    ]
    for method in methods:
        method.fit_null(x_cal, OBSERVATIONS)
        print(f"{method.name}: null of {args.num_null} in {method.time_null:.1f} s", flush=True)

    exact = toy.posterior()
    rejections = {(m.name, e): np.zeros(len(OBSERVATIONS)) for m in methods for e in estimators}
    times = {m.name: [] for m in methods}
    for run in range(args.runs):
        theta = exact(x_cal).sample()  # theta* | x from the true posterior
        for name, estimator in estimators.items():
            for method in methods:
                start = time.perf_counter()
                statistic = method.statistic(estimator, theta, x_cal, OBSERVATIONS)
                times[method.name].append(time.perf_counter() - start)
                rejections[(method.name, name)] += method.p_values(statistic) <= 0.05
        print(f"run {run + 1}/{args.runs}", flush=True)

    obs = [f"x_o = ({a:+.1f}, {b:+.1f})" for a, b in OBSERVATIONS.tolist()]
    inside = ["yes" if a > 0.5 else "no" for a, _ in OBSERVATIONS.tolist()]
    lines = [
        "# Local-HPD baseline (Zhao et al. 2021) vs L-C2ST-NF on the GaussianToy",
        "",
        f"GaussianToy D = 2, N = {args.n} calibration pairs (x's fixed, theta* redrawn per run), "
        f"M = {args.num_samples} samples per HPD value, {methods[0].alphas.size} levels, "
        f"B = {args.num_null} null refits, {args.runs} runs, sklearn MLPClassifier(alpha=0, "
        f"max_iter={methods[0].classifier.max_iter}). "
        "Command: `python examples/benchmarks/local_hpd.py`"
        f" --n {args.n} --runs {args.runs} --num-null {args.num_null}.",
        "",
        "## Rejection rate at 0.05 per observation",
        "",
        "| estimator | method | " + " | ".join(obs) + " |",
        "| --- | --- | " + " | ".join("---" for _ in obs) + " |",
        "| (x_o inside the local defect) | | " + " | ".join(inside) + " |",
    ]
    for name in estimators:
        for method in methods:
            rates = rejections[(method.name, name)] / args.runs
            lines.append(f"| {name} | {method.name} | "
                         + " | ".join(f"{r:.2f}" for r in rates) + " |")
    lines += [
        "",
        "## Run time (same run, seconds)",
        "",
        "| method | one statistic (all x_o) | null, once per calibration x's | null / statistic |",
        "| --- | --- | --- | --- |",
    ]
    for method in methods:
        one = float(np.mean(times[method.name]))
        lines.append(f"| {method.name} | {one:.2f} | {method.time_null:.1f} "
                     f"| {method.time_null / one:.0f} |")
    (results / "local_hpd.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print("wrote", results / "local_hpd.md")


if __name__ == "__main__":
    main()
