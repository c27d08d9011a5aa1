"""How large the miscalibration a check of a diagnosis measures is, in its own units."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from calib_lightning.diagnosis._verdict import LOCAL_TESTS, Verdict

__all__ = ["quantile", "size"]


def quantile(values: Tensor, q: float) -> list[float]:
    """The ``q`` quantile of ``values`` along the first dimension, as floats."""
    return torch.quantile(values.double(), q, dim=0).tolist()


def size(name: str, result: Any, findings: Verdict, level: float) -> str:
    """How large the miscalibration a check measures is, in its own units."""
    if name == "ranks":
        joint = [d for d in findings.directions if d.parameter is None]
        return joint[0].size() if joint else ""
    if name == "tarp":
        return (f"largest coverage gap {float(result.statistic):.3f} (band "
                f"{float(result.band):.3f}); ATC {float(result.coverage_error):+.3f}")  # fmt: skip
    if name in LOCAL_TESTS:
        null = quantile(result.null_statistics, 1 - level)
        ratio = [float(t) / max(q, 1e-300) for t, q in zip(result.statistic, null, strict=True)]
        worst = max(range(len(ratio)), key=ratio.__getitem__)
        return (f"L-C2ST statistic {float(result.statistic[worst]):.3g} at observation "
                f"{worst}, {ratio[worst]:.2g} times its null {1 - level:.0%} quantile "
                f"{null[worst]:.3g} (the largest ratio)")  # fmt: skip
    if name == "joint_c2st":
        return (f"mean conformal rank {float(result.mean_rank):.3f} over {result.ranks.numel()} "
                "held-out pairs (0.5 if calibrated)")  # fmt: skip
    if name == "support":
        text = (f"{float(result.statistic):.2%} of {int(result.num_draws)} draws outside the "
                f"prior's support (at most {float(result.leakage.max()):.0%} of a pair's)")
        at = result.observation_leakage
        if at is not None:
            text += f"; at the observations {float(at.min()):.0%}-{float(at.max()):.0%}"
        return text
    if name == "coverage_is":  # its one-sided tests name a direction, as the ranks' do
        tested = [d for d in findings.directions if d.check == "coverage_is"]
        named = [d.words for d in tested if d.named]
        error = f"coverage error {float(result.coverage_error):+.3f}"
        error = tested[0].size() if tested else error
        reading = f" ({named[0]})" if named else ""
        return f"{error}{reading}; median effective sample size {float(result.ess_median):.0f}"
    if name == "balance":
        return (f"balance {float(result.statistic):+.4f}, 95 % "
                f"interval [{float(result.lower):+.4f}, {float(result.upper):+.4f}] "
                "(0 for a balanced classifier)")  # fmt: skip
    if name == "misspecification":
        return (f"smallest p {float(result.p_value.min()):.3g} over {result.p_value.shape[0]} "
                f"observations (attainable: {result.smallest_p_value:.2g})")  # fmt: skip
    return ""
