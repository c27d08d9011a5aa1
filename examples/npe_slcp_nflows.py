"""Neural posterior estimation on SLCP with an nflows masked autoregressive flow.

The same workflow as ``npe_two_moons.py`` with the other flow library: an nflows
``Flow`` (affine MADE layers, conditioned on standardized ``x`` through its
embedding net) is trained on the SLCP task (5 parameters, 8-dimensional
observations, a four-mode posterior) while calibration callbacks check it on
held-out pairs. The callbacks find the flow at ``pl_module.flow`` and wrap it with
:func:`calib_lightning.as_posterior`, which recognizes nflows flows.

Run (about a minute on two CPU cores):

    python examples/npe_slcp_nflows.py
    tensorboard --logdir lightning_logs

``--smoke``: tiny sizes (seconds), logs in a temporary folder. The model and the
checks are in ``examples/_npe.py`` and ``examples/_common.py``; only the public API of
calib_lightning is used.
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # run as a file (python examples/x.py): make `examples` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from calib_lightning.tasks import SLCP
from examples._common import calibration_callbacks, fit_and_report, parse_arguments, simulate
from examples._npe import NPE, masked_autoregressive_flow

LABELS = [f"theta_{i}" for i in range(1, 6)]


def main(argv: list[str] | None = None) -> None:
    args = parse_arguments(__doc__.split("\n")[0], num_observations=2, argv=argv)
    task = SLCP()
    data, _ = simulate(task, args)
    low, high = task.prior_bounds
    flow = masked_autoregressive_flow(
        task.theta_dim,
        data.x.mean(0),
        data.x.std(0),
        torch.full((task.theta_dim,), low),
        torch.full((task.theta_dim,), high),
    )
    # SLCP has no tractable posterior: L-C2ST-NF runs without reference samples
    checks = calibration_callbacks(
        data.theta_cal, data.x_cal, args.every_n_epochs, data.theta_o, data.x_o, LABELS,
        checks=args.checks,
    )  # fmt: skip
    fit_and_report(NPE(flow, epochs=args.epochs), checks, data, args, "npe_slcp_nflows", "slcp")


if __name__ == "__main__":
    main()
