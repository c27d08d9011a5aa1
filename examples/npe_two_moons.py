"""Neural posterior estimation on Two Moons, with calibration checked while it trains.

A zuko neural spline flow q(theta | x) is fit by maximum likelihood on simulated
pairs (theta, x). Calibration callbacks test it on held-out pairs every few
epochs, log scalars and figures to TensorBoard, and the script ends with a
calibration summary and the time each check cost.

Run (about a minute on two CPU cores):

    python examples/npe_two_moons.py
    tensorboard --logdir lightning_logs

Options: ``--epochs``, ``--num-simulations``, ``--num-calibration``,
``--every-n-epochs``, ``--save-figures DIR`` (writes each callback's last figures as
PNG), ``--seed``, ``--threads`` (default 1), ``--log-dir`` (default ``lightning_logs``),
``--smoke`` (tiny sizes, seconds; logs and figures in a temporary folder). The model
and the checks are in ``examples/_npe.py`` and ``examples/_common.py``; only the public
API of calib_lightning is used.
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # run as a file (python examples/x.py): make `examples` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import zuko

from calib_lightning.tasks import TwoMoons
from examples._common import calibration_callbacks, fit_and_report, parse_arguments, simulate
from examples._npe import NPE

LABELS = ["theta_1", "theta_2"]


def main(argv: list[str] | None = None) -> None:
    args = parse_arguments(__doc__.split("\n")[0], num_observations=3, argv=argv)
    task = TwoMoons()
    data, generator = simulate(task, args)
    reference = task.reference_posterior_samples(  # exact posterior samples at x_o
        data.x_o, args.checks["num_reference"], generator
    )
    checks = calibration_callbacks(
        data.theta_cal, data.x_cal, args.every_n_epochs, data.theta_o, data.x_o, LABELS,
        reference, args.checks,
    )  # fmt: skip
    flow = zuko.flows.NSF(task.theta_dim, task.x_dim, transforms=3, hidden_features=(64, 64))
    model = NPE(flow, epochs=args.epochs)
    fit_and_report(model, checks, data, args, "npe_two_moons", "two_moons")


if __name__ == "__main__":
    main()
