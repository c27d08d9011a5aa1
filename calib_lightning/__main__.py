"""Command line: ``python -m calib_lightning diagnose ...`` on a saved Lightning checkpoint.

Example::

    python -m calib_lightning diagnose --module my_project.model:NPE \\
        --checkpoint lightning_logs/version_0/checkpoints/last.ckpt \\
        --data calibration.pt --out report/

``--data`` is a file written with ``torch.save`` holding a dict with ``theta`` ``(N, D)``
and ``x`` ``(N, *X)`` (held-out calibration pairs) and optionally ``observations``
``(O, *X)``; it is read with ``weights_only=True``. ``--seed`` (default 0) seeds every
check (:func:`calib_lightning.diagnose`): the same seed gives the same report.

``--prior pkg.mod:NAME`` names the prior the calibration ``theta`` were drawn from (a
torch ``Distribution``, or a function of no argument that returns one): it adds the
support check (posterior draws outside the prior's support); for a ratio or likelihood
estimator it is the estimator's prior, and the posterior it implies is checked.

``--kind posterior|likelihood|ratio`` says what the estimator estimates where it cannot
tell (an sbi density estimator with ``dim theta = dim x``): with ``likelihood`` or
``ratio``, ``--prior`` is its prior and the posterior it implies is checked
(:func:`calib_lightning.as_posterior`).

``--recalibrated`` diagnoses the recalibrated posterior that a
:class:`~calib_lightning.callbacks.RecalibrationCallback` saved in the checkpoint, beside
the estimator before it (one report, before and after side by side).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["main"]


def _load(spec: str, option: str = "--module", what: str = "ClassName") -> Any:
    """The attribute ``spec = 'package.module:Name'`` names (a ValueError naming ``option``)."""
    module_name, _, name = spec.partition(":")
    if not module_name or not name:
        raise ValueError(f"{option} must be 'package.module:{what}', got {spec!r}")
    module = importlib.import_module(module_name)
    try:
        return getattr(module, name)
    except AttributeError:
        raise ValueError(f"{option}: {module_name} has no attribute {name!r}") from None


def _load_prior(spec: str | None) -> Any:
    """The prior ``--prior`` names: the object, or what a function of no argument returns."""
    if spec is None:
        return None
    prior = _load(spec, "--prior", "NAME")
    return prior() if callable(prior) and not hasattr(prior, "log_prob") else prior


def _load_data(path: str) -> dict[str, torch.Tensor]:
    data = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(data, dict) or "theta" not in data or "x" not in data:
        kind = sorted(data) if isinstance(data, dict) else type(data).__name__
        raise ValueError(
            f"--data must hold a dict with 'theta' and 'x' (and optionally "
            f"'observations'), got {kind}"
        )
    return data


def _recalibrated(checkpoint: str, estimator: Any, theta: torch.Tensor, x: torch.Tensor) -> Any:
    """The recalibrated posterior of ``estimator`` from the one RecalibrationCallback state
    in ``checkpoint`` (a ValueError naming ``--recalibrated`` if there is none or several)."""
    from calib_lightning.callbacks import RecalibrationCallback

    states = torch.load(checkpoint, map_location="cpu", weights_only=False).get("callbacks", {})
    found = [
        state
        for key, state in states.items()
        if str(key).startswith("RecalibrationCallback")
        and isinstance(state, dict)
        and state.get("recalibration")
    ]
    if len(found) != 1:
        raise ValueError(
            "--recalibrated needs the checkpoint to hold one fitted RecalibrationCallback "
            f"(saved after Trainer.fit), got {len(found)}"
        )
    callback = RecalibrationCallback(theta, x)
    callback.load_state_dict(found[0])
    return callback.posterior(estimator)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m calib_lightning")
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("diagnose", help="diagnose a trained posterior, write a report")
    run.add_argument("--module", required=True, help="the LightningModule, 'pkg.mod:Class'")
    run.add_argument("--checkpoint", required=True, help="a checkpoint of that module")
    run.add_argument("--data", required=True, help="torch file: dict with theta, x[, observations]")
    run.add_argument("--out", default="report", help="folder for report.html (default: report)")
    run.add_argument("--estimator", default="flow", help="attribute path of the estimator")
    run.add_argument("--num-posterior-samples", type=int, default=100)
    run.add_argument("--checks", default=None, help="comma-separated subset of the checks")
    run.add_argument("--labels", default=None, help="comma-separated parameter names")
    run.add_argument("--level", type=float, default=0.05)
    run.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seeds every check's randomness: one seed, the same report (default: 0)",
    )
    run.add_argument(
        "--prior",
        default=None,
        help="'pkg.mod:NAME': the prior (or a function returning it); adds the support check",
    )
    run.add_argument(
        "--kind",
        default=None,
        choices=("posterior", "likelihood", "ratio"),
        help="what the estimator estimates, where it cannot tell; with "
        "likelihood or ratio, --prior is its prior",
    )
    run.add_argument(
        "--recalibrated",
        action="store_true",
        help="diagnose the RecalibrationCallback's posterior in the checkpoint, "
        "beside the estimator before it",
    )
    args = parser.parse_args(argv)

    from calib_lightning.callbacks._plumbing import find_estimator
    from calib_lightning.diagnosis import diagnose

    module = _load(args.module).load_from_checkpoint(args.checkpoint, map_location="cpu")
    module.eval()
    data = _load_data(args.data)
    estimator, before = find_estimator(module, args.estimator), None
    prior = _load_prior(args.prior)
    if args.kind is not None:
        from calib_lightning.posteriors import as_posterior

        unnormalized = args.kind != "posterior"
        estimator = as_posterior(estimator, kind=args.kind, prior=prior if unnormalized else None)
        prior = None if unnormalized else prior
    if args.recalibrated:
        before = estimator
        estimator = _recalibrated(args.checkpoint, estimator, data["theta"], data["x"])
    with torch.no_grad():
        diagnosis = diagnose(
            estimator,
            data["theta"],
            data["x"],
            observations=data.get("observations"),
            checks=args.checks.split(",") if args.checks else None,
            labels=args.labels.split(",") if args.labels else None,
            num_posterior_samples=args.num_posterior_samples,
            level=args.level,
            seed=args.seed,
            before=before,
            prior=prior,
        )
    page = diagnosis.save(args.out)
    print(diagnosis.verdict[0].upper() + diagnosis.verdict[1:])
    print(diagnosis.table())
    print(f"report: {page}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
