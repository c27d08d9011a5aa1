r"""The model-evaluation layer: the one place where the package runs an estimator.

Metrics, losses, callbacks and the report call these functions to turn a posterior
(anything :func:`calib_lightning.as_posterior` accepts) and calibration pairs into
tensors: scores, latents, draws and log-densities. The functional core
(:mod:`calib_lightning.functional`) then works on those tensors only.

The rules, in one place:

* **Gradients.** Draws, log-densities of draws and latents are evaluated without
  gradient (``torch.no_grad``). Scores switch gradients on locally (they are
  gradients); with ``create_graph=True`` they stay differentiable in the estimator's
  parameters, which the calibration losses need.
* **Memory.** Scores, draws and latents (one ODE solve per pair for sbi's vector-field
  estimators) come in chunks sized from the memory budget
  (:func:`calib_lightning.set_memory_budget`) by the measured peak of the first chunks
  (:mod:`calib_lightning.evaluation._memory`), unless a ``chunk_size`` /
  ``max_chunk_elements`` is given; what a caller keeps meanwhile counts against it.
* **Sharing.** Handed a :class:`SharedDraws` (what the callbacks pass when several check
  in one epoch, and ``cl.diagnose`` to its sampling checks), :func:`draws` and
  :func:`draw_chunks` serve the draws it already holds at the same ``x`` (the first
  ``n``) and keep new ones.
* **Dtype and device.** The adapters cast inputs to the model's dtype and return the
  caller's dtype (:mod:`calib_lightning.posteriors`); nothing here moves tensors.
* **Checks.** Every output is checked finite; a failure raises a ``ValueError`` that
  names the quantity and counts the pairs affected.
"""

from __future__ import annotations

from calib_lightning.evaluation._draw_cache import (
    MAX_SHARED_ELEMENTS,
    SharedDraws,
    release_shared_draws,
    shared_draws_for,
)
from calib_lightning.evaluation._draws import (
    DrawChunk,
    checked_samples,
    chunk_sizer,
    draw_chunks,
    draws,
    draws_and_log_probs,
    reparameterized_draws,
)
from calib_lightning.evaluation._event_size import check_event_size
from calib_lightning.evaluation._features import embed
from calib_lightning.evaluation._fit_check import check_fits
from calib_lightning.evaluation._ratios import log_ratio_function, log_ratio_matrix
from calib_lightning.evaluation._scores import (
    base_scores,
    latents,
    log_prob_and_latent,
    pair_and_base_scores,
    scores,
)

__all__ = [
    "MAX_SHARED_ELEMENTS",
    "DrawChunk",
    "SharedDraws",
    "base_scores",
    "check_event_size",
    "check_fits",
    "checked_samples",
    "chunk_sizer",
    "draw_chunks",
    "draws",
    "draws_and_log_probs",
    "embed",
    "latents",
    "log_prob_and_latent",
    "log_ratio_function",
    "log_ratio_matrix",
    "pair_and_base_scores",
    "release_shared_draws",
    "reparameterized_draws",
    "scores",
    "shared_draws_for",
]
