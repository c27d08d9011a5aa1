"""Level and power of RankCalibration's ``global_p_value`` with its default arguments.

Level: 1,000 fresh datasets (N = 200 pairs, D = 5, M = 1000 draws, the defaults) from
two calibrated models with their exact posteriors, ``GaussianToy(dim=5)`` and a
correlated prior :math:`\\Sigma_{ij} = 0.8^{|i - j|}`: rejection rate of the global
p-value at 0.05 (Cauchy, the default, and Holm on the same tests), its KS distance to
the uniform, and how often at least one of the 12 single tests falls below 0.05.
Power: 200 datasets per small error of ``GaussianToy(dim=5)``, rejection rates of the
default and of the combinations it was chosen over.

Run:  python examples/benchmarks/global_p_value.py [--level-reps 1000] [--power-reps 200]
Writes examples/benchmarks/results/global_p_value.md (about 5 minutes on one core);
``--smoke`` runs a few datasets and writes to a temporary folder.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if not __package__:  # run as a file (python examples/x.py): make `examples` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
from scipy import stats
from torch.distributions import MultivariateNormal

import calib_lightning as cl
from calib_lightning.functional import combine_p_values
from calib_lightning.tasks import GaussianToy
from examples._smoke import add_smoke_argument, output_folder

RESULTS = Path(__file__).parent / "results"
DIM, PAIRS = 5, 200


class CorrelatedToy:
    """theta ~ N(0, Sigma), Sigma_ij = 0.8^|i-j|; x = theta + N(0, 0.25 I); exact posterior."""

    def __init__(self, rho: float = 0.8, noise_var: float = 0.25) -> None:
        i = torch.arange(DIM, dtype=torch.float64)
        prior = rho ** (i[:, None] - i[None, :]).abs()
        self.noise_var, self.chol = noise_var, torch.linalg.cholesky(prior)
        self.cov = torch.linalg.inv(torch.linalg.inv(prior) + torch.eye(DIM) / noise_var)

    def sample(self, n: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        theta = torch.randn(n, DIM, generator=generator, dtype=torch.float64) @ self.chol.T
        noise = torch.randn(theta.shape, generator=generator, dtype=torch.float64)
        return theta.float(), (theta + self.noise_var**0.5 * noise).float()

    def posterior(self, x: torch.Tensor) -> MultivariateNormal:
        mean = x.double() @ self.cov.T / self.noise_var
        return MultivariateNormal(mean.float(), self.cov.float())


def checks(model, posterior, reps: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Global p-values ``(R,)`` and the 12 single p-values ``(R, 12)`` of ``reps`` checks."""
    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed + 1)
    metric = cl.RankCalibration()
    global_p, single = [], []
    for _ in range(reps):
        theta, x = model.sample(PAIRS, generator)
        metric.reset()
        metric.update(posterior, theta, x)
        out = metric.compute()
        global_p.append(out.global_p_value)
        single.append(torch.cat([out.marginal_p_values, out.p_value[None],
                                 out.ecdf_p_values]))  # fmt: skip
    return torch.stack(global_p), torch.stack(single)


def rate(p: torch.Tensor) -> str:
    return f"{float((p < 0.05).double().mean()):.3f}"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--level-reps", type=int, default=1000)
    parser.add_argument("--power-reps", type=int, default=200)
    add_smoke_argument(parser)
    args = parser.parse_args()
    if args.smoke:
        args.level_reps, args.power_reps = 4, 2
    torch.set_num_threads(1)
    toy = GaussianToy(dim=DIM)
    low, high = stats.binom.ppf([0.005, 0.995], args.level_reps, 0.05) / args.level_reps
    lines = [
        f"# global_p_value of RankCalibration() (N = {PAIRS}, D = {DIM}, M = 1000)", "",
        f"Level over {args.level_reps} datasets (99% band around 0.05: {low:.3f} to {high:.3f})",
        "", "| model | Cauchy | Holm | KS distance | some single test < 0.05 |",
        "| --- | --- | --- | --- | --- |",
    ]  # fmt: skip
    correlated = CorrelatedToy()
    models = (("GaussianToy(dim=5)", toy, toy.posterior()),
              ("correlated prior", correlated, correlated.posterior))  # fmt: skip
    for name, model, posterior in models:
        global_p, single = checks(model, posterior, args.level_reps, seed=100)
        ks = stats.kstest(global_p.numpy(), "uniform").statistic
        anyone = float((single < 0.05).any(1).double().mean())
        holm = combine_p_values(single, method="holm")
        lines.append(f"| {name} | {rate(global_p)} | {rate(holm)} | {ks:.3f} | {anyone:.2f} |")
        print(lines[-1], flush=True)
    lines += ["", f"Power over {args.power_reps} datasets of GaussianToy(dim=5)", "",
              "| posterior | Cauchy, all 12 | Holm, all 12 | Cauchy, chi-square | Cauchy, ECDF "
              "| joint p_value |", "| --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for name, kwargs in (("variance x0.85", {"variance_scale": 0.85}),
                         ("variance x1.2", {"variance_scale": 1.2}),
                         ("mean shift 0.07", {"shift": 0.07})):  # fmt: skip
        global_p, single = checks(toy, toy.posterior(**kwargs), args.power_reps, seed=200)
        lines.append(
            f"| {name} | {rate(global_p)} | {rate(combine_p_values(single, method='holm'))} "
            f"| {rate(combine_p_values(single[:, :6]))} | {rate(combine_p_values(single[:, 6:]))} "
            f"| {rate(single[:, 5])} |"
        )
        print(lines[-1], flush=True)
    path = output_folder(RESULTS, args.smoke) / "global_p_value.md"
    path.write_text("\n".join(lines) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
