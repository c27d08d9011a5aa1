"""Reference samples in ``cl.diagnose``: where exact posterior samples at the observations
are known (MCMC, a known posterior), the distances of the posterior's draws to them."""

from __future__ import annotations

from typing import Any

import torch

from calib_lightning.diagnosis._check import Check, Inputs, Outcome
from calib_lightning.evaluation import draws
from calib_lightning.functional.reference import compare_to_reference
from calib_lightning.posteriors.base import Posterior

__all__ = ["ReferenceCheck"]


class ReferenceCheck(Check):
    """:func:`~calib_lightning.functional.compare_to_reference` of ``S_ref`` draws at each
    observation (MMD with its p-value, Fréchet distance, density and coverage); it runs
    whenever reference samples are given, not a name for ``checks=``."""

    name = "reference"
    title = "Reference samples (MMD test per observation)"
    words = "the reference distances"
    stream = 8
    at_observations = True
    in_overall = False
    selectable = False
    needs_samples = True

    def applies_by_default(self, posterior: Posterior, inputs: Inputs) -> bool:
        return inputs.reference_samples is not None

    def run(self, posterior: Posterior, inputs: Inputs, common: Any, outcome: Outcome) -> Any:
        assert inputs.reference_samples is not None
        assert inputs.observations is not None
        samples = draws(posterior, inputs.observations, inputs.reference_samples.shape[0])
        generator = torch.Generator().manual_seed(int(torch.randint(2**62, ())))
        return compare_to_reference(
            samples, inputs.reference_samples.to(samples), vendi=False, generator=generator
        )

    def row(self, row: dict[str, Any], result: Any) -> dict[str, Any]:
        # one MMD test per observation: the smallest p-value
        return {
            **row,
            "p_value": float(result.mmd_p_value.min()),
            "verdict": "see p-values per observation",
        }
