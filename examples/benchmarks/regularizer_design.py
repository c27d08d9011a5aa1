"""Evidence for the design of ``KCCSDLoss``: what the statistic sees, its gradient at a
calibrated model, and what each option costs per training step.

Three measurements, written to ``examples/benchmarks/results/regularizer_design.md``:

1. Sensitivity. Exact Gaussian posteriors of the conjugate toy (``GaussianToy``,
   noise 0.3: posterior sd 0.29 under an N(0, I) prior), and the same posterior with
   its sd scaled by ``c`` or its mean moved by half a posterior sd. For each loss
   variant: mean of the loss over ``R`` batches of ``n = 128`` divided by its sd
   under the calibrated model (signal-to-noise per batch).
2. Gradient at the calibrated model, and where the expected loss is minimal. A
   Gaussian model ``N(w x, exp(2 s))`` with a learnable log-sd ``s``: mean and standard
   error of ``d loss / d s`` at the true ``s`` over ``R`` batches (negative = the loss
   asks for a wider posterior), and the variance scale minimizing the mean loss on a
   grid.
3. Cost. Seconds per optimizer step of the study's flow on batches of 128, NLL alone
   and NLL plus each regularizer (``regularized_loss`` of ``examples/_npe.py``),
   interleaved in one process; ratios to NLL alone.

Run: ``PYTHONPATH=. python examples/benchmarks/regularizer_design.py`` (about 5 min on
one core; ``--quick``: fewer repetitions; ``--smoke``: tiny sizes, seconds, written to a
temporary folder).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

if not __package__:  # run as a file (python examples/x.py): make `examples` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
from torch.distributions import Independent, Normal

from calib_lightning.losses import CoverageLoss, KCCSDLoss
from calib_lightning.tasks import GaussianLinearUniform, GaussianToy, TwoMoons
from examples._npe import build_flow, regularized_loss
from examples._smoke import add_smoke_argument, output_folder

RESULTS = Path(__file__).resolve().parent / "results"
NOISE = 0.3
BATCH = 128

VARIANTS = {
    "latent": {"space": "latent"},
    "latent, x-kernel": {"space": "latent", "condition": "x"},
    "latent, V-stat": {"space": "latent", "estimator": "v"},
    "latent, raw (not normalized)": {"space": "latent", "normalize": False},
    "parameter": {"space": "parameter"},
    "parameter, x-kernel": {"space": "parameter", "condition": "x"},
    "parameter, GFD (m=8)": {"space": "parameter", "condition": "gfd", "num_base_points": 8},
    "parameter, V-stat": {"space": "parameter", "estimator": "v"},
    "parameter, raw (not normalized)": {"space": "parameter", "normalize": False},
}


def sensitivity(reps: int, dims: tuple[int, ...]) -> list[str]:
    cases = {"sd x0.6": (0.36, 0.0), "sd x0.8": (0.64, 0.0), "sd x1.25": (1.5625, 0.0),
             "mean +0.5 sd": (1.0, 0.5)}  # fmt: skip
    lines = ["| variant | D | " + " | ".join(cases) + " |", "|---" * (len(cases) + 2) + "|"]
    for dim in dims:
        toy = GaussianToy(dim=dim, noise_std=NOISE, dtype=torch.float64)
        sd = math.sqrt(toy.weight) * NOISE
        g = torch.Generator().manual_seed(dim)
        batches = [toy.sample(BATCH, g) for _ in range(reps)]
        for name, kwargs in VARIANTS.items():
            if "V-stat" in name or "raw" in name:
                continue
            loss = KCCSDLoss(**kwargs)
            torch.manual_seed(0)
            null = torch.stack([loss(toy.posterior(), t, x) for t, x in batches])
            cells = []
            for scale, shift in cases.values():
                post = toy.posterior(variance_scale=scale, shift=shift * sd)
                values = torch.stack([loss(post, t, x) for t, x in batches])
                cells.append(f"{float(values.detach().mean() / null.detach().std()):.1f}")
            lines.append(f"| {name} | {dim} | " + " | ".join(cells) + " |")
            print(lines[-1], flush=True)
    return lines


class _ScaleModel(torch.nn.Module):
    def __init__(self, weight: float, log_sd: float) -> None:
        super().__init__()
        self.weight = weight
        self.log_sd = torch.nn.Parameter(torch.tensor(log_sd, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> Independent:
        return Independent(Normal(self.weight * x, self.log_sd.exp().expand_as(x)), 1)


def gradient_bias(reps: int, dim: int) -> list[str]:
    toy = GaussianToy(dim=dim, noise_std=NOISE, dtype=torch.float64)
    true_log_sd = 0.5 * math.log(toy.weight * NOISE**2)
    g = torch.Generator().manual_seed(7)
    batches = [toy.sample(BATCH, g) for _ in range(reps)]
    grid = torch.linspace(-0.6, 0.6, 13).tolist()  # log-sd offsets
    lines = [
        f"D = {dim}, n = {BATCH}, {reps} batches. Gradient in the log-sd at the truth "
        "(negative: the loss asks for a wider posterior); sd-scale of the grid point "
        "(exp(offset), offsets -0.6..0.6 by 0.1) with the smallest mean loss.",
        "",
        "| variant | mean d loss / d log-sd | standard error | z | argmin sd-scale |",
        "|---|---|---|---|---|",
    ]
    for name, kwargs in VARIANTS.items():
        if "GFD" in name:
            continue
        loss = KCCSDLoss(**kwargs)
        model = _ScaleModel(toy.weight, true_log_sd)
        grads = []
        for theta, x in batches:
            model.zero_grad()
            loss(model, theta, x).backward()
            grads.append(float(model.log_sd.grad))
        grads_t = torch.tensor(grads)
        mean, se = float(grads_t.mean()), float(grads_t.std() / len(grads) ** 0.5)
        means = []
        with torch.no_grad():
            for offset in grid:
                model.log_sd.fill_(true_log_sd + offset)
                means.append(statistics.fmean(float(loss(model, t, x)) for t, x in batches))
        best = math.exp(grid[min(range(len(grid)), key=means.__getitem__)])
        lines.append(f"| {name} | {mean:+.4g} | {se:.2g} | {mean / se:+.1f} | {best:.2f} |")
        print(lines[-1], flush=True)
    return lines


def cost(steps: int, rounds: int) -> list[str]:
    regularizers = {
        "KCCSD latent": KCCSDLoss(),
        "KCCSD latent, x-kernel": KCCSDLoss(condition="x"),
        "KCCSD parameter": KCCSDLoss(space="parameter"),
        "KCCSD parameter, GFD m=8": KCCSDLoss(space="parameter", condition="gfd"),
        "coverage L=16": CoverageLoss(),
    }
    lines = [
        f"Median over {rounds} interleaved rounds of {steps} steps (batch {BATCH}, the study's "
        "flow: standardized coupling NSF, 3 transforms, 2x64 hidden; the loss of "
        "`examples/npe_regularized.py`, which shares the flow pass between the NLL and the "
        "latent KCCSD or the coverage loss); ratio to the NLL step in the same round.",
        "",
        "| task (D) | " + " | ".join(regularizers) + " |",
        "|---" * (len(regularizers) + 1) + "|",
    ]
    for task in (TwoMoons(), GaussianLinearUniform()):
        torch.manual_seed(0)
        theta, x = task.sample(BATCH * steps, torch.Generator().manual_seed(0))
        flow = build_flow(theta, x)
        optimizer = torch.optim.Adam(flow.parameters(), 1e-3)

        def run(regularizer: torch.nn.Module | None, flow=flow, theta=theta, x=x,
                optimizer=optimizer) -> float:  # fmt: skip
            start = time.perf_counter()
            for i in range(steps):
                t, c = theta[i * BATCH : (i + 1) * BATCH], x[i * BATCH : (i + 1) * BATCH]
                loss, _, _ = regularized_loss(flow, regularizer, 1.0, t, c)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
            return time.perf_counter() - start

        ratios: dict[str, list[float]] = {name: [] for name in regularizers}
        run(None)  # warm-up
        for _ in range(rounds):
            base = run(None)
            for name, regularizer in regularizers.items():
                ratios[name].append(run(regularizer) / base)
        cells = [f"{statistics.median(r):.2f}x" for r in ratios.values()]
        lines.append(f"| {type(task).__name__} ({task.theta_dim}) | " + " | ".join(cells) + " |")
        print(lines[-1], flush=True)
    return lines


def main(argv: list[str] | None = None) -> None:
    global BATCH
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few repetitions")
    add_smoke_argument(parser)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    reps, dims, steps, rounds = 200, (2, 10), 10, 5
    if args.quick:
        reps, steps, rounds = 20, 5, 2
    if args.smoke:
        reps, dims, steps, rounds, BATCH = 2, (2,), 1, 1, 32
    out = ["# KCCSDLoss design measurements", "", "Produced by "
           "`PYTHONPATH=. python examples/benchmarks/regularizer_design.py`.", ""]  # fmt: skip
    out += ["## 1. Signal-to-noise per batch (mean / null sd)", ""]
    out += [*sensitivity(reps, dims), ""]
    out += ["## 2. Gradient at the calibrated model", ""]
    out += [*gradient_bias(reps * 2, 2), ""]
    out += ["## 3. Cost per training step", ""]
    out += [*cost(steps=steps, rounds=rounds), ""]
    results = output_folder(RESULTS, args.smoke)
    name = "regularizer_design_quick.md" if args.quick else "regularizer_design.md"
    (results / name).write_text("\n".join(out))
    print(f"wrote {results / name}")


if __name__ == "__main__":
    main()
