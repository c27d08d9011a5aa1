"""Costs and power at the sizes of real SBI problems: many parameters, image observations.

Part 1, many parameters (``GaussianToy(dim=D)``: x = theta + noise, exact Gaussian
posteriors), D = 10 and 50, N = 1,000 pairs:

* seconds per check of KCCSD, LatentCalibration, RankCalibration (100 draws per pair)
  and TARP (100 draws per pair) on an autoregressive zuko MAF (3 transforms, 64 x 64
  hidden units; untrained: cost does not depend on training), each alone, and ranks +
  TARP sharing one set of draws; against the floors of one log-prob pass and one
  sampling pass of 100 draws per pair, measured in the same run;
* power at equal N against posteriors with 0.8x and 1.25x the exact covariance, and the
  level on the exact one (rejection rates at 0.05 over ``--reps`` fresh datasets).

Part 2, images (``GaussianBlob``, 32 x 32, three parameters): a CNN embedding trained
with a zuko NSF (``examples/_image_npe.py``); L-C2ST-NF with the flow's embedding at
N = 2,000 pairs and 100 null classifiers: wall and CPU seconds of the null plus the first
check and of a later check (same calibration x: the null is reused), for the default
classifier and for the unbounded ``10 (D + F)`` width it had before, and for sbi 0.27's
``LC2ST_NF`` given the same features and latents (its default classifier, one thread).
Level and power over ``--image-reps`` datasets of truths drawn from the trained flow
itself (the flow is then the exact posterior), tested against the flow, the flow with
its latent spread 1.5x and with its latent shifted by 0.2: with one calibration x and
its null reused (sbi's protocol; ours and sbi on the same datasets), and for ours with
fresh calibration x and a new null per dataset.

Run:  python examples/benchmarks/scale.py [--reps 20] [--image-reps 20] [--no-sbi]
Writes examples/benchmarks/results/scale.md (with the load average of the machine at the
start of each part); ``--smoke`` runs tiny sizes in seconds.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

if not __package__:  # run as a file (python examples/x.py): make `examples` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
import zuko
from threadpoolctl import threadpool_limits
from torch import Tensor, nn
from torch.distributions import Distribution

import calib_lightning as cl
from calib_lightning.evaluation import draws, embed, latents
from calib_lightning.evaluation._draw_cache import SharedDraws
from calib_lightning.functional import combine_p_values
from calib_lightning.tasks import GaussianBlob, GaussianToy
from examples._image_npe import train_image_npe
from examples._smoke import add_smoke_argument, output_folder

RESULTS = Path(__file__).parent / "results"
CHECKS = ("kccsd", "latent", "ranks", "tarp")


def make_metric(name: str) -> object:
    return {
        "kccsd": lambda: cl.KCCSD(),
        "latent": lambda: cl.LatentCalibration(),
        "ranks": lambda: cl.RankCalibration(num_posterior_samples=100),
        "tarp": lambda: cl.TARP(num_posterior_samples=100),
    }[name]()


def verdict(name: str, result: object) -> float:
    field = "global_p_value" if name in ("latent", "ranks") else "p_value"
    return float(getattr(result, field))


def timed(run: Callable[[], object]) -> tuple[object, float, float]:
    """``run()``, its wall seconds and its process CPU seconds."""
    wall, cpu = time.perf_counter(), time.process_time()
    out = run()
    return out, time.perf_counter() - wall, time.process_time() - cpu


def check(name: str, posterior: object, theta: Tensor, x: Tensor) -> object:
    metric = make_metric(name)
    metric.update(posterior, theta, x)
    return metric.compute()


FLOWS = {"MAF": zuko.flows.MAF, "NSF": zuko.flows.NSF}


def costs(dim: int, pairs: int, kind: str) -> dict[str, tuple[float, float, float]]:
    """(wall seconds of ``update``, wall and CPU seconds of the whole check) of each check and
    of the floors, on an untrained zuko ``kind`` flow at ``dim`` (cost does not depend on
    training)."""
    torch.manual_seed(0)
    flow = FLOWS[kind](dim, dim, transforms=3, hidden_features=(64, 64)).eval()
    theta, x = GaussianToy(dim=dim).sample(pairs, torch.Generator().manual_seed(1))
    out: dict[str, tuple[float, float, float]] = {}
    for name in CHECKS:  # warm up (first calls pay lazy initialisation): not timed
        check(name, flow, theta[:16], x[:16])
    with torch.no_grad():
        _, wall, cpu = timed(lambda: flow(x).log_prob(theta))
        out["log-prob pass (floor)"] = (wall, wall, cpu)
        rows = max(1, 2**20 // (100 * dim))  # the chunks RankCalibration samples in
        _, wall, cpu = timed(lambda: draws(flow, x, 100, chunk_size=rows))
        out["sampling pass, 100 draws (floor)"] = (wall, wall, cpu)  # chunked like ranks
    for name in CHECKS:
        metric = make_metric(name)
        _, update, update_cpu = timed(lambda metric=metric: metric.update(flow, theta, x))
        _, wall, cpu = timed(metric.compute)
        out[name] = (update, update + wall, update_cpu + cpu)

    def shared() -> None:
        posterior = SharedDraws(cl.as_posterior(flow))
        for name in ("ranks", "tarp"):
            check(name, posterior, theta, x)

    _, wall, cpu = timed(shared)
    out["ranks + TARP, shared draws"] = (wall, wall, cpu)
    return out


def power(dim: int, pairs: int, reps: int) -> dict[tuple[str, float], float]:
    """Rejection rate at 0.05 of each check against covariance scales 1 (level), 0.8, 1.25."""
    toy, out = GaussianToy(dim=dim), {}
    generator = torch.Generator().manual_seed(2)
    datasets = [toy.sample(pairs, generator) for _ in range(reps)]
    for scale in (1.0, 0.8, 1.25):
        posterior = toy.posterior(variance_scale=scale)
        for name in CHECKS:
            torch.manual_seed(3)
            rejected = [verdict(name, check(name, posterior, t, x)) < 0.05 for t, x in datasets]
            out[name, scale] = sum(rejected) / reps
    return out


class Perturbed(nn.Module):
    """The flow with its latent spread by ``scale`` and shifted by ``shift`` (every
    coordinate): theta = T(shift + scale * z; x). Its latents of the flow's own draws are
    (z - shift) / scale: not N(0, I) unless scale = 1 and shift = 0."""

    def __init__(self, model: nn.Module, scale: float = 1.0, shift: float = 0.0) -> None:
        super().__init__()
        self.model, self.scale, self.shift = model, scale, shift

    def forward(self, x: Tensor) -> Distribution:
        dist = self.model(x)
        ones = torch.ones(x.shape[0], dist.event_shape[-1], dtype=x.dtype)
        base = zuko.distributions.DiagNormal(self.shift * ones, self.scale * ones)
        return zuko.distributions.NormalizingFlow(dist.transform, base)


def scenarios(model: nn.Module) -> dict[str, nn.Module]:
    """The posteriors tested on the flow's own draws: exact (level) and two alternatives."""
    return {"exact (level)": model, "latent x1.5 (power)": Perturbed(model, scale=1.5),
            "latent +0.2 (power)": Perturbed(model, shift=0.2)}  # fmt: skip


def ours_check(metric: cl.LC2STNF, posterior: nn.Module, theta: Tensor, x: Tensor) -> float:
    """One L-C2ST-NF check (update: embedding and latent pass; compute): global p-value."""
    metric.reset()
    metric.update(posterior, theta, x)
    return float(metric.compute().global_p_value)


def sbi_check(
    model: nn.Module,
    posterior: nn.Module,
    theta: Tensor,
    x: Tensor,
    observations: Tensor,
    num_null: int,
    null: dict | None = None,
) -> tuple:
    """sbi 0.27's ``LC2ST_NF`` on the same embedding: the features and latents are computed
    here as ours computes them (``embed``, ``latents``) and handed over with the identity as
    ``flow_inverse_transform``; class 0 is N(0, I) draws (the latents of the flow's own
    draws). Trains the null unless one is given; returns (Cauchy combination of the
    observations' p-values, the null classifiers)."""
    from sbi.diagnostics.lc2st import LC2ST_NF  # optional: only for this comparison

    features = embed(model.embedding, x)
    latent = latents(posterior, theta, x)
    dim = latent.shape[1]
    base = torch.distributions.MultivariateNormal(torch.zeros(dim), torch.eye(dim))
    test = LC2ST_NF(prior_samples=latent, xs=features, posterior_samples=base.sample((len(x),)),
                    flow_inverse_transform=lambda z, _: z, flow_base_dist=base,
                    num_trials_null=num_null, trained_clfs_null=null)  # fmt: skip
    if null is None:
        test.train_under_null_hypothesis(verbosity=0)
    test.train_on_observed_data()
    obs = embed(model.embedding, observations)
    p_values = torch.tensor([float(test.p_value(o[None])) for o in obs])
    return float(combine_p_values(p_values)), test.trained_clfs_null


class ImageTask:
    """The image part: a trained NPE, calibration x, reference observations, the metrics."""

    def __init__(self, simulations: int, epochs: int, pairs: int, num_null: int) -> None:
        self.task, self.num_null = GaussianBlob(size=32), num_null
        self.generator = torch.Generator().manual_seed(4)
        theta, x = self.task.sample(simulations, self.generator)
        self.model, wall, cpu = timed(lambda: train_image_npe(theta, x, epochs))
        self.costs = [("training the NPE (CNN + NSF)", wall, cpu)]
        self.observations = self.task.sample(3, self.generator)[1]
        _, self.x = self.task.sample(pairs, self.generator)
        self.metrics: dict[str, cl.LC2STNF] = {}
        self.sbi_null: dict | None = None

    def truths(self, x: Tensor) -> Tensor:
        """theta ~ q(theta | x): the trained flow is the exact posterior of these truths."""
        with torch.no_grad():
            return self.model(x).sample()

    def metric(self, **classifier_kwargs: object) -> cl.LC2STNF:
        return cl.LC2STNF(observations=self.observations, embedding=self.model.embedding,
                          num_null=self.num_null, classifier_kwargs=classifier_kwargs)  # fmt: skip

    def time_checks(self, with_sbi: bool) -> list[tuple[str, float, float]]:
        """Wall and CPU seconds of the null + first check and of a later check (new truths,
        same calibration x and null): ours (default classifier, and the 10 (D + F) units it
        had before the width bound) and sbi's LC2ST_NF."""
        first, later = self.truths(self.x), self.truths(self.x)
        features = embed(self.model.embedding, self.observations).shape[1]
        width = 10 * (first.shape[1] + features)
        for name, kwargs in (("ours", {}), (f"ours, {width} units (before)",
                                            {"hidden_features": (width, width)})):  # fmt: skip
            metric = self.metrics[name] = self.metric(**kwargs)
            for step, truth in (("null + first check", first), ("later check", later)):
                _, wall, cpu = timed(lambda m=metric, t=truth: ours_check(m, self.model, t, self.x))
                self.costs.append((f"{name}: {step}", wall, cpu))
        if with_sbi:
            with threadpool_limits(1):  # sbi's scikit-learn MLPs on one thread, as ours
                (_, self.sbi_null), wall, cpu = timed(lambda: self.sbi(self.model, first))
                self.costs.append(("sbi LC2ST_NF: null + first check", wall, cpu))
                _, wall, cpu = timed(lambda: self.sbi(self.model, later, self.sbi_null))
                self.costs.append(("sbi LC2ST_NF: later check (null reused)", wall, cpu))
        return self.costs

    def sbi(self, posterior: nn.Module, theta: Tensor, null: dict | None = None) -> tuple:
        return sbi_check(self.model, posterior, theta, self.x, self.observations, self.num_null,
                         null)  # fmt: skip

    def rates(self, reps: int) -> dict[tuple[str, str], float]:
        """Rejection rates at 0.05 keyed by (protocol, scenario), after :meth:`time_checks`."""
        rates: dict[tuple[str, str], float] = {}
        # one calibration x and its null (sbi's protocol): fresh truths given that x
        sets = [self.truths(self.x) for _ in range(reps)]
        for label, posterior in scenarios(self.model).items():
            for name, metric in self.metrics.items():
                p = [ours_check(metric, posterior, t, self.x) for t in sets]
                rates[f"{name}, one x (one null)", label] = sum(v < 0.05 for v in p) / reps
            if self.sbi_null is not None:
                with threadpool_limits(1):
                    p = [self.sbi(posterior, t, self.sbi_null)[0] for t in sets]
                rates["sbi LC2ST_NF, one x (one null)", label] = sum(v < 0.05 for v in p) / reps
        # fresh datasets: new calibration x (and a new null) for every repetition
        fresh = dict.fromkeys(scenarios(self.model), 0.0)
        for _ in range(reps):
            _, x = self.task.sample(len(self.x), self.generator)
            theta, metric = self.truths(x), self.metric()
            for label, posterior in scenarios(self.model).items():  # one null serves the three
                fresh[label] += (ours_check(metric, posterior, theta, x) < 0.05) / reps
        rates.update({("ours, fresh x (new null each)", k): v for k, v in fresh.items()})
        return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pairs", type=int, default=1000)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--dims", type=int, nargs="+", default=[10, 50])
    parser.add_argument("--flows", nargs="+", default=["MAF", "NSF"], choices=sorted(FLOWS))
    parser.add_argument(
        "--max-nsf-dim",
        type=int,
        default=10,
        help="NSF costs only up to this D (sampling an NSF at D = 50 takes minutes per check)",
    )
    parser.add_argument("--image-simulations", type=int, default=10_000)
    parser.add_argument("--image-epochs", type=int, default=8)
    parser.add_argument("--image-pairs", type=int, default=2000)
    parser.add_argument("--image-reps", type=int, default=20)
    parser.add_argument("--num-null", type=int, default=100)
    parser.add_argument("--no-sbi", action="store_true", help="skip sbi's LC2ST_NF")
    parser.add_argument("--images-only", action="store_true", help="only part 2")
    add_smoke_argument(parser)
    args = parser.parse_args()
    if args.smoke:
        args.pairs, args.reps, args.dims = 64, 2, [3]
        args.image_simulations, args.image_epochs, args.image_pairs = 256, 1, 64
        args.image_reps, args.num_null = 1, 5
    folder = output_folder(RESULTS, args.smoke)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    loads = []  # (part, 1-minute load average when it started)

    lines, dims = [], [] if args.images_only else args.dims
    cost_tables = {}
    for dim in dims:  # first every timing (run them on a quiet machine), then the rates
        for kind in args.flows if dim <= args.max_nsf_dim else ["MAF"]:
            loads.append((f"D = {dim} {kind}", os.getloadavg()[0]))
            cost_tables[dim, kind] = costs(dim, args.pairs, kind)
    loads.append(("images", os.getloadavg()[0]))
    image = ImageTask(args.image_simulations, args.image_epochs, args.image_pairs, args.num_null)
    timings = image.time_checks(not args.no_sbi)
    loads.append(("after the timings", os.getloadavg()[0]))
    print("timings done", flush=True)
    for dim in dims:
        for kind in args.flows if dim <= args.max_nsf_dim else ["MAF"]:
            cost = cost_tables[dim, kind]
            logp = cost["log-prob pass (floor)"][0]
            sample = cost["sampling pass, 100 draws (floor)"][1]
            lines += [f"## D = {dim}: seconds per check (untrained zuko {kind}, 3 transforms, "
                      f"64 x 64; N = {args.pairs})", "",
                      "| check | update (s) | whole check (s) | whole check, CPU (s) | "
                      "update / log-prob pass | check / sampling pass |",
                      "| --- | --- | --- | --- | --- | --- |"]  # fmt: skip
            for name, (update, whole, cpu) in cost.items():
                lines.append(f"| {name} | {update:.3f} | {whole:.3f} | {cpu:.3f} | "
                             f"{update / logp:.1f} | {whole / sample:.2f} |")  # fmt: skip
            lines.append("")
            print("\n".join(lines[-(len(cost) + 4) :]), flush=True)
        rates = power(dim, args.pairs, args.reps)
        lines += ["", f"Rejection rate at 0.05 (D = {dim}, exact Gaussian posteriors scaled):", "",
                  "| check | exact (level) | 0.8x covariance | 1.25x covariance |",
                  "| --- | --- | --- | --- |"]  # fmt: skip
        for name in CHECKS:
            lines.append(f"| {name} | {rates[name, 1.0]:.2f} | {rates[name, 0.8]:.2f} | "
                         f"{rates[name, 1.25]:.2f} |")  # fmt: skip
        lines.append("")
        print("\n".join(lines[-(len(CHECKS) + 6) :]), flush=True)
    rates = image.rates(args.image_reps)
    lines += ["## Images: L-C2ST-NF with the flow's CNN embedding (GaussianBlob 32 x 32)", "",
              f"{args.image_simulations} simulations, {args.image_epochs} epochs; N = "
              f"{args.image_pairs} pairs, {args.num_null} null classifiers, 3 observations, "
              "10,000 evaluation points; every classifier on one thread. A check is the "
              "embedding and latent pass plus the test; sbi gets the same features and "
              "latents (its `LC2ST_NF`, default `MLPClassifier` of `10 * D` units, "
              "`num_trials_null` null classifiers).", "",
              "| step | wall (s) | CPU (s) |", "| --- | --- | --- |"]  # fmt: skip
    lines += [f"| {name} | {wall:.2f} | {cpu:.2f} |" for name, wall, cpu in timings]
    labels = list(dict.fromkeys(label for _, label in rates))
    protocols = list(dict.fromkeys(protocol for protocol, _ in rates))
    lines += ["", f"Rejection rate at 0.05 of the global p-value (Cauchy combination over the 3 "
              f"observations), {args.image_reps} datasets of truths drawn from the trained flow "
              "(the exact posterior), tested as it is and perturbed in its latent space:", "",
              "| protocol | " + " | ".join(labels) + " |",
              "| --- |" + " --- |" * len(labels)]  # fmt: skip
    lines += [f"| {protocol} | " + " | ".join(f"{rates[protocol, label]:.2f}" for label in labels)
              + " |" for protocol in protocols]  # fmt: skip
    header = ["# Scale: many parameters and image observations", "",
              f"`python examples/benchmarks/scale.py` ({args.pairs} pairs; {args.reps} datasets "
              f"per power cell), started {started} on {os.cpu_count()} CPU cores shared with "
              "other jobs; all timings first, then the rejection rates. 1-minute load average "
              "at the start of each timed part: "
              + ", ".join(f"{part} {load:.1f}" for part, load in loads)
              + ". Wall seconds and process CPU seconds (`time.process_time`, all threads) "
              "are both given.", ""]  # fmt: skip
    text = "\n".join(header + lines) + "\n"
    print(text)
    (folder / "scale.md").write_text(text)
    print(f"wrote {folder / 'scale.md'}")


if __name__ == "__main__":
    main()
