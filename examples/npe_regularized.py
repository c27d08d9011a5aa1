"""Neural posterior estimation with a calibration term, in Lightning.

Two ways to act on calibration, both printed at the end on held-out pairs:

1. A regularizer on every training batch, ``loss = nll + weight * regularizer``, the
   terms logged separately (``train/nll``, ``train/regularizer``, ``train/loss``), early
   stopping on the validation NLL. The flow runs once per batch: the shared
   :class:`NPE` module (``examples/_npe.py``) calls
   :func:`calib_lightning.losses.log_prob_and_latent` and hands the latent to the
   regularizer (here :class:`calib_lightning.LatentCoverageLoss`)::

       log_q, latent = cl.losses.log_prob_and_latent(self.flow, theta, x)
       nll = -log_q.mean()
       reg = self.regularizer(self.flow, theta, x, latent=latent)
       self.log_dict({"train/nll": nll, "train/regularizer": reg})
       return nll + self.weight * reg

2. Plain NPE, then :class:`calib_lightning.LatentScale` fitted on the validation split
   that early stopping keeps aside (see the regularizer study in
   ``examples/benchmarks/README.md``; when simulations allow, pairs apart from the
   early-stopping ones are better: the flow kept fits those better than new pairs,
   ``examples/benchmarks/results/calibration_split.md``)::

       calibrated = cl.LatentScale(flow).fit(theta_val, x_val)

Run (about a minute on one core)::

    python examples/npe_regularized.py --weight 5
    tensorboard --logdir lightning_logs

(``--smoke``: tiny sizes, seconds, logs in a temporary folder.)

It trains on Two Moons (1,000 simulations by default) and prints the held-out NLL,
expected-coverage error and joint-rank p-value (``cl.RankCalibration``) of each.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if not __package__:  # run as a file (python examples/x.py): make `examples` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lightning as L
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

import calib_lightning as cl
from calib_lightning.losses import LatentCoverageLoss
from calib_lightning.tasks import TwoMoons
from examples._npe import NPE, build_flow
from examples._smoke import add_smoke_argument, output_folder


def train(
    theta: Tensor, x: Tensor, regularizer: nn.Module | None, weight: float, seed: int,
    max_epochs: int = 200, patience: int = 20, log_dir: Path | str = "lightning_logs",
) -> tuple[nn.Module, Tensor]:  # fmt: skip
    """Fit a standardized NSF with early stopping on a 10% validation split; returns the
    flow and the validation split's indices."""
    L.seed_everything(seed, verbose=False)
    order = torch.randperm(len(theta))
    n_val = len(theta) // 10
    val, fit = order[:n_val], order[n_val:]
    flow = build_flow(theta[fit], x[fit])
    model = NPE(flow, regularizer, weight)
    stop = L.pytorch.callbacks.EarlyStopping("val/nll", patience=patience)
    best = L.pytorch.callbacks.ModelCheckpoint(monitor="val/nll", save_weights_only=True)
    trainer = L.Trainer(
        max_epochs=max_epochs, callbacks=[stop, best], enable_progress_bar=False,
        enable_model_summary=False, gradient_clip_val=5.0, log_every_n_steps=1,
        logger=L.pytorch.loggers.TensorBoardLogger(log_dir, name="npe_regularized"),
    )  # fmt: skip
    trainer.fit(
        model,
        DataLoader(TensorDataset(theta[fit], x[fit]), batch_size=128, shuffle=True),
        DataLoader(TensorDataset(theta[val], x[val]), batch_size=len(val)),
    )
    state = torch.load(best.best_model_path, weights_only=True)["state_dict"]
    model.load_state_dict(state)
    return model.flow.eval(), val


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-simulations", type=int, default=1000)
    parser.add_argument("--num-test", type=int, default=1000)
    parser.add_argument("--weight", type=float, default=5.0)
    parser.add_argument("--max-epochs", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-dir", type=Path, default=Path("lightning_logs"))
    add_smoke_argument(parser)
    args = parser.parse_args(argv)
    num_posterior_samples = 200
    if args.smoke:  # the same run at tiny sizes, logs in a temporary folder
        args.num_simulations, args.num_test, args.max_epochs = 200, 100, 2
        args.log_dir, num_posterior_samples = output_folder(args.log_dir, smoke=True), 20
    torch.set_num_threads(1)
    task = TwoMoons()
    theta, x = task.sample(args.num_simulations, torch.Generator().manual_seed(args.seed))
    theta_test, x_test = task.sample(
        args.num_test, torch.Generator().manual_seed(10_000 + args.seed)
    )
    def report(name: str, flow: nn.Module) -> None:
        with torch.no_grad():
            nll = -flow(x_test).log_prob(theta_test).mean()
        ranks = cl.RankCalibration(num_posterior_samples=num_posterior_samples)
        ranks.update(flow, theta_test, x_test)
        out = ranks.compute()
        print(
            f"{name:30s} held-out NLL {float(nll):7.3f}   coverage error "
            f"{float(out.coverage_error):+.3f} (< 0: over-confident)   "
            f"joint-rank p-value {float(out.p_value):.3f}"
        )

    for name, regularizer, weight in [
        ("plain NPE", None, 0.0),
        (f"NPE + {args.weight:g} * latent coverage", LatentCoverageLoss(), args.weight),
    ]:
        flow, val = train(theta, x, regularizer, weight, args.seed, args.max_epochs,
                          log_dir=args.log_dir)  # fmt: skip
        report(name, flow)
        if regularizer is None:  # the recommended step: latent scales from the validation split
            scaled = cl.LatentScale(flow).fit(theta[val], x[val])
            report("plain NPE + LatentScale (val)", scaled)


if __name__ == "__main__":
    main()
