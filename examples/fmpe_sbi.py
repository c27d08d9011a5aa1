"""Diagnose sbi's flow-matching posterior (FMPE) with one call, and write the report.

Trains sbi's ``FMPE`` on the conjugate Gaussian toy (:class:`GaussianToy`,
:math:`\\theta \\sim N(0, I_2)`, :math:`x = \\theta + N(0, 0.5^2 I_2)`, raw ``x``: sbi
z-scores it inside the estimator), then hands sbi's ``VectorFieldPosterior`` to
:func:`calib_lightning.diagnose` with held-out pairs, three observations and exact
posterior draws at them (the toy's posterior is known). Every check FMPE supports runs
through its probability-flow ODE: KCCSD on the score of the ODE's log-density, rank
calibration, TARP, recovery, L-C2ST-NF on the ODE's latents, the misspecification test,
and the distances to the exact posterior. It prints the verdict and the table and
writes ``fmpe_report/report.html`` with the figures (and sbi's training logs in
``fmpe_report/sbi_logs``).

Run (a few minutes on two cores: the ODE's log-densities and scores dominate)::

    python examples/fmpe_sbi.py
    python examples/fmpe_sbi.py --out my_report --epochs 100

(``--smoke``: tiny sizes, seconds, the report in a temporary folder.)
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

if not __package__:  # run as a file (python examples/x.py): make `examples` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from torch.distributions import MultivariateNormal

import calib_lightning as cl
from calib_lightning.tasks import GaussianToy
from examples._smoke import add_smoke_argument, output_folder


def train_fmpe(theta: torch.Tensor, x: torch.Tensor, epochs: int, logs: Path) -> object:
    """sbi's ``VectorFieldPosterior`` of an ``FMPE`` trained on ``(theta, x)``; sbi's
    TensorBoard logs of the training go to ``logs``."""
    from sbi.inference import FMPE
    from sbi.utils.tracking import TensorBoardTracker
    from torch.utils.tensorboard import SummaryWriter

    prior = MultivariateNormal(torch.zeros(theta.shape[1]), torch.eye(theta.shape[1]))
    inference = FMPE(prior=prior, show_progress_bars=False,
                     tracker=TensorBoardTracker(SummaryWriter(str(logs))))  # fmt: skip
    with warnings.catch_warnings():  # sbi's notes on its defaults
        warnings.simplefilter("ignore")
        inference.append_simulations(theta, x).train(
            max_num_epochs=epochs, training_batch_size=200, show_train_summary=False
        )
        return inference.build_posterior()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("fmpe_report"))
    parser.add_argument("--epochs", type=int, default=50)
    parser.add_argument("--simulations", type=int, default=5_000)
    parser.add_argument("--pairs", type=int, default=500)
    parser.add_argument("--seed", type=int, default=0)
    add_smoke_argument(parser)
    args = parser.parse_args()
    if args.smoke:
        args.epochs, args.simulations, args.pairs = 3, 500, 48
    out = output_folder(args.out, args.smoke)

    torch.manual_seed(args.seed)
    task = GaussianToy(dim=2)
    generator = torch.Generator().manual_seed(args.seed)
    theta, x = task.sample(args.simulations, generator)
    theta_cal, x_cal = task.sample(args.pairs, generator)  # held out
    observations = task.sample(3, generator)[1]
    exact = task.posterior()(observations).sample((500 if args.smoke else 2_000,))

    posterior = train_fmpe(theta, x, args.epochs, out / "sbi_logs")
    report = cl.diagnose(
        posterior, theta_cal, x_cal, observations=observations, reference_samples=exact,
        labels=["theta_1", "theta_2"], num_posterior_samples=20 if args.smoke else 100,
        seed=args.seed,
    )  # fmt: skip
    page = report.save(out)
    print(f"Verdict: {report.verdict}")
    print(report.table())
    print(f"report: {page}")


if __name__ == "__main__":
    main()
