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
N = 2,000 pairs: seconds for the null plus the first check and for a later check
(same calibration x, new flow parameters are not needed: the null is reused), and level
and power over ``--image-reps`` datasets drawn from the trained flow itself (the flow is
then the exact posterior) and from the flow with its latent spread 1.5x.

Run:  python examples/benchmarks/scale.py [--reps 20] [--image-reps 10]
Writes examples/benchmarks/results/scale.md; ``--smoke`` runs tiny sizes in seconds.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

if not __package__:  # run as a file (python examples/x.py): make `examples` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
import zuko
from torch import Tensor, nn
from torch.distributions import Distribution

import calib_lightning as cl
from calib_lightning._draw_cache import SharedDraws
from calib_lightning.evaluation import draws
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


def seconds(run: object) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def check(name: str, posterior: object, theta: Tensor, x: Tensor) -> object:
    metric = make_metric(name)
    metric.update(posterior, theta, x)
    return metric.compute()


FLOWS = {"MAF": zuko.flows.MAF, "NSF": zuko.flows.NSF}


def costs(dim: int, pairs: int, kind: str) -> dict[str, tuple[float, float]]:
    """(seconds of ``update``, seconds of the whole check) of each check and of the floors,
    on an untrained zuko ``kind`` flow at ``dim`` (cost does not depend on training)."""
    torch.manual_seed(0)
    flow = FLOWS[kind](dim, dim, transforms=3, hidden_features=(64, 64)).eval()
    theta, x = GaussianToy(dim=dim).sample(pairs, torch.Generator().manual_seed(1))
    out: dict[str, tuple[float, float]] = {}
    with torch.no_grad():
        logp = seconds(lambda: flow(x).log_prob(theta))
        out["log-prob pass (floor)"] = (logp, logp)
        rows = max(1, 2**20 // (100 * dim))  # the chunks RankCalibration samples in
        sample = seconds(lambda: draws(flow, x, 100, chunk_size=rows))
        out["sampling pass, 100 draws (floor)"] = (sample, sample)  # chunked like ranks
    for name in CHECKS:
        metric = make_metric(name)
        update = seconds(lambda metric=metric: metric.update(flow, theta, x))
        out[name] = (update, update + seconds(metric.compute))

    def shared() -> None:
        posterior = SharedDraws(cl.as_posterior(flow))
        for name in ("ranks", "tarp"):
            check(name, posterior, theta, x)

    both = seconds(shared)
    out["ranks + TARP, shared draws"] = (both, both)
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


class Spread(nn.Module):
    """The flow with its latent spread by ``factor``: theta = T(factor * z; x)."""

    def __init__(self, model: nn.Module, factor: float) -> None:
        super().__init__()
        self.model, self.factor = model, factor

    def forward(self, x: Tensor) -> Distribution:
        dist = self.model(x)
        loc = torch.zeros(x.shape[0], dist.event_shape[-1], dtype=x.dtype)
        base = zuko.distributions.DiagNormal(loc, self.factor * torch.ones_like(loc))
        return zuko.distributions.NormalizingFlow(dist.transform, base)


def images(
    simulations: int, epochs: int, pairs: int, reps: int, num_null: int
) -> dict[str, float]:
    """L-C2ST-NF with the flow's CNN embedding on 32 x 32 images: costs, level, power."""
    task = GaussianBlob(size=32)
    generator = torch.Generator().manual_seed(4)
    theta, x = task.sample(simulations, generator)
    out: dict[str, float] = {}
    start = time.perf_counter()
    model = train_image_npe(theta, x, epochs)
    out["training (s)"] = time.perf_counter() - start
    observations = task.sample(3, generator)[1]
    _, x_cal = task.sample(pairs, generator)
    with torch.no_grad():
        theta_cal = model(x_cal).sample()  # the trained flow is the exact posterior here
    metric = cl.LC2STNF(observations=observations, embedding=model.embedding, num_null=num_null)
    metric.update(model, theta_cal, x_cal)
    out["null + first check (s)"] = seconds(metric.compute)
    metric.reset()
    metric.update(model, theta_cal, x_cal)
    out["later check (s)"] = seconds(metric.compute)
    for label, posterior in (("level (exact)", model), ("power (latent x1.5)", Spread(model, 1.5))):
        rejected = 0
        for _ in range(reps):
            _, x_rep = task.sample(pairs, generator)
            with torch.no_grad():
                theta_rep = model(x_rep).sample()
            local = cl.LC2STNF(observations=observations, embedding=model.embedding,
                               num_null=num_null)  # fmt: skip
            local.update(posterior, theta_rep, x_rep)
            rejected += float(local.compute().global_p_value) < 0.05
        out[label] = rejected / reps
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pairs", type=int, default=1000)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--dims", type=int, nargs="+", default=[10, 50])
    parser.add_argument("--flows", nargs="+", default=["MAF", "NSF"], choices=sorted(FLOWS))
    parser.add_argument("--max-nsf-dim", type=int, default=10,
                        help="NSF costs only up to this D (sampling an NSF at D = 50 takes "
                        "minutes per check)")
    parser.add_argument("--image-simulations", type=int, default=10_000)
    parser.add_argument("--image-epochs", type=int, default=8)
    parser.add_argument("--image-pairs", type=int, default=2000)
    parser.add_argument("--image-reps", type=int, default=10)
    parser.add_argument("--num-null", type=int, default=100)
    add_smoke_argument(parser)
    args = parser.parse_args()
    if args.smoke:
        args.pairs, args.reps, args.dims = 64, 2, [3]
        args.image_simulations, args.image_epochs, args.image_pairs = 256, 1, 64
        args.image_reps, args.num_null = 1, 5
    folder = output_folder(RESULTS, args.smoke)
    torch.set_num_threads(max(1, torch.get_num_threads()))

    lines = ["# Scale: many parameters and image observations", "",
             f"`python examples/benchmarks/scale.py` ({args.pairs} pairs; {args.reps} datasets "
             "per power cell; 2 CPU cores)", ""]  # fmt: skip
    for dim in args.dims:
        for kind in args.flows if dim <= args.max_nsf_dim else ["MAF"]:
            cost = costs(dim, args.pairs, kind)
            logp = cost["log-prob pass (floor)"][0]
            sample = cost["sampling pass, 100 draws (floor)"][0]
            lines += [f"## D = {dim}: seconds per check (untrained zuko {kind}, 3 transforms, "
                      f"64 x 64; N = {args.pairs})", "",
                      "| check | update (s) | whole check (s) | update / log-prob pass | "
                      "check / sampling pass |", "| --- | --- | --- | --- | --- |"]  # fmt: skip
            for name, (update, whole) in cost.items():
                lines.append(f"| {name} | {update:.3f} | {whole:.3f} | {update / logp:.1f} | "
                             f"{whole / sample:.2f} |")  # fmt: skip
            lines.append("")
            print("\n".join(lines[-(len(cost) + 4):]), flush=True)
        rates = power(dim, args.pairs, args.reps)
        lines += ["", f"Rejection rate at 0.05 (D = {dim}, exact Gaussian posteriors scaled):", "",
                  "| check | exact (level) | 0.8x covariance | 1.25x covariance |",
                  "| --- | --- | --- | --- |"]  # fmt: skip
        for name in CHECKS:
            lines.append(f"| {name} | {rates[name, 1.0]:.2f} | {rates[name, 0.8]:.2f} | "
                         f"{rates[name, 1.25]:.2f} |")  # fmt: skip
        lines.append("")
        print("\n".join(lines[-(len(CHECKS) + 6):]), flush=True)
    image = images(args.image_simulations, args.image_epochs, args.image_pairs, args.image_reps,
                   args.num_null)  # fmt: skip
    lines += ["## Images: L-C2ST-NF with the flow's CNN embedding (GaussianBlob 32 x 32)", "",
              f"{args.image_simulations} simulations, {args.image_epochs} epochs; N = "
              f"{args.image_pairs} pairs, {args.num_null} null classifiers, 3 observations; "
              f"level and power over {args.image_reps} datasets.", "",
              "| quantity | value |", "| --- | --- |"]  # fmt: skip
    lines += [f"| {key} | {value:.3g} |" for key, value in image.items()]
    text = "\n".join(lines) + "\n"
    print(text)
    (folder / "scale.md").write_text(text)
    print(f"wrote {folder / 'scale.md'}")


if __name__ == "__main__":
    main()
