"""After training: one call to diagnose a neural posterior, fix it, and an HTML report.

Trains a zuko NSF on Two Moons (the shared :class:`NPE` of ``examples/_npe.py``),
recalibrates it with :func:`calib_lightning.recalibrate` (``method="auto"``) on 1,000
validation pairs, then calls :func:`calib_lightning.diagnose` on 1,000 other held-out
pairs and three observations, for the recalibrated flow with the trained one as
``before``: KCCSD, rank calibration, TARP, recovery plots, L-C2ST-NF at each observation
and the misspecification test of each observation (here with one deliberately impossible
observation), sharing one set of posterior draws, and with the task's prior the support
check (draws outside the prior's box, where the true posterior has none). It prints both
verdicts and the table of the recalibrated flow and writes ``report/report.html`` (before
and after side by side; open it in a browser), each flow's own report in
``report/before/`` and ``report/after/``, ``report/summary.json`` and the figures.

Run (about two minutes on two cores)::

    python examples/diagnose_posthoc.py
    python examples/diagnose_posthoc.py --out my_report --epochs 5

(``--smoke``: tiny sizes, seconds, the report in a temporary folder.) For a model saved
by Lightning, the command line does the same::

    python -m calib_lightning diagnose --module my_project.model:NPE \\
        --checkpoint last.ckpt --data calibration.pt --out report/
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if not __package__:  # run as a file (python examples/x.py): make `examples` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

import calib_lightning as cl
from calib_lightning.tasks import TwoMoons
from examples._npe import NPE, build_flow
from examples._smoke import add_smoke_argument, output_folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("report"))
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--simulations", type=int, default=20_000)
    parser.add_argument("--pairs", type=int, default=1_000)
    parser.add_argument("--seed", type=int, default=0)
    add_smoke_argument(parser)
    args = parser.parse_args()
    if args.smoke:
        args.epochs, args.simulations, args.pairs = 1, 512, 64
    out = output_folder(args.out, args.smoke)

    L.seed_everything(args.seed, verbose=False)
    task = TwoMoons()
    generator = torch.Generator().manual_seed(args.seed)
    theta, x = task.sample(args.simulations, generator)
    theta_cal, x_cal = task.sample(args.pairs, generator)  # held out
    observations = torch.cat([task.sample(2, generator)[1], torch.tensor([[3.0, -3.0]])])
    theta_val, x_val = task.sample(args.pairs, generator)  # held out, for the recalibration

    model = NPE(build_flow(theta, x))
    trainer = L.Trainer(max_epochs=args.epochs, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    trainer.fit(model, DataLoader(TensorDataset(theta, x), batch_size=256, shuffle=True))

    model.eval()
    fixed = cl.recalibrate(model.flow, theta_val, x_val, method="auto", seed=args.seed)
    print(f"recalibrate(method='auto') picked {fixed.method!r}")
    report = cl.diagnose(
        fixed, theta_cal, x_cal, observations=observations, labels=["theta_1", "theta_2"],
        num_posterior_samples=20 if args.smoke else 100, seed=args.seed, before=model.flow,
        prior=task.prior(),
    )  # fmt: skip
    page = report.save(out)
    print(f"Verdict before: {report.before.verdict}")
    print(f"Verdict: {report.verdict}")
    print(report.table())
    print("before and after:")
    print(report.comparison.table())
    print(f"report: {page}")


if __name__ == "__main__":
    main()
