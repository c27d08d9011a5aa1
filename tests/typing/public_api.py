"""A user's code against the public API, checked by mypy (tests/test_typing.py): the
package ships ``py.typed``, so these calls type-check against its annotations, and a
wrong one (last block) is an error. Importing it runs nothing: the calls sit in a
function that mypy checks, the annotated locals are what it checks them against."""

# ruff: noqa: F841

from __future__ import annotations

import torch
import zuko
from torch import Tensor

import calib_lightning as cl
import calib_lightning.functional as F
from calib_lightning.callbacks import KCCSDCallback, RankCalibrationCallback, summary_table
from calib_lightning.tasks import GaussianToy


def usage() -> None:
    """Type-checked by mypy (annotated: its body is checked), never called."""
    toy = GaussianToy(dim=2)
    theta, x = toy.sample(200, torch.Generator().manual_seed(0))
    flow = zuko.flows.NSF(2, 2, transforms=2)

    ranks = cl.RankCalibration(num_posterior_samples=100)
    ranks.update(flow, theta, x)
    ranks_result = ranks.compute()
    global_p: Tensor = ranks_result.global_p_value

    kccsd = cl.KCCSD(seed=1)
    kccsd.update(flow, theta, x)
    kccsd_p: Tensor = kccsd.compute().p_value

    tarp = cl.TARP(num_posterior_samples=100, num_references=8)
    joint = cl.JointC2ST(folds=2, repeats=2)
    local = cl.LC2STNF(x[:2], num_null=20)

    posterior: cl.Posterior = cl.as_posterior(flow)
    report: cl.Diagnosis = cl.diagnose(flow, theta, x, checks=("kccsd", "ranks"), seed=0)
    verdict: str = report.verdict
    table: str = report.table()
    fixed = cl.recalibrate(flow, theta, x, method="scale")
    again: cl.Diagnosis = cl.diagnose(fixed, theta, x, before=flow)

    callbacks = [KCCSDCallback(theta, x), RankCalibrationCallback(theta, x)]
    text: str = summary_table(callbacks)
    loss = cl.KCCSDLoss()

    p_values: Tensor = F.combine_p_values(torch.tensor([0.01, 0.5]), method="holm")

    # a wrong call: mypy must report it (the test checks that it does, at this line only)
    cl.KCCSD(seed="zero")  # WRONG
