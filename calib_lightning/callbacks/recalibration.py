"""A callback that recalibrates the estimator on the validation pairs when ``fit`` ends.

:class:`RecalibrationCallback` runs :func:`calib_lightning.recalibrate` once, at the end of
``Trainer.fit``, logs the calibration before and after (held-out, cross-fitted) to every
logger, and keeps the fitted latent map in its state, so that a checkpoint saved after
``fit`` (``trainer.save_checkpoint``) holds it and :meth:`RecalibrationCallback.posterior`
rebuilds the recalibrated posterior from a reloaded estimator.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import Tensor

from calib_lightning._utils.prior import check_prior
from calib_lightning._utils.random import seeded
from calib_lightning._utils.validation import check_pairs
from calib_lightning.callbacks._plumbing import eval_mode, find_estimator, selecting_monitors
from calib_lightning.callbacks._scalars import with_deprecated_aliases
from calib_lightning.posteriors import Posterior, as_posterior
from calib_lightning.recalibration import (
    LatentMap,
    RecalibratedPosterior,
    TruncatedPosterior,
    recalibrate,
)
from calib_lightning.recalibration.api import AUTO_CANDIDATES, MIN_PAIRS, cross_fit_scores

__all__ = ["RENAMED_TAGS", "RecalibrationCallback"]

#: scores renamed in 0.2.0 (new name -> old name): the coverage error of the flow's
#: latent-ball regions, beside ``hpd_coverage_error_*``, read as the HPD one.
#: **Deprecated**: the old keys are logged too, with the same values, until 0.3.0.
RENAMED_TAGS = {
    "latent_coverage_error_before": "coverage_error_before",
    "latent_coverage_error_after": "coverage_error_after",
}


class RecalibrationCallback(Callback):
    r"""Fit :func:`calib_lightning.recalibrate` on held-out pairs at the end of ``fit``.

    Logged under ``{prefix}/{name}/`` at the last global step, to every logger:
    ``latent_coverage_error_before`` / ``_after`` and ``nll_before`` / ``_after`` (the
    held-out coverage error of the flow's latent-ball regions and the NLL of
    :func:`~calib_lightning.recalibration.api.cross_fit_scores`: each half of the pairs
    scored by the map fitted on the other half, so "after" is not measured on the pairs
    it was fitted on), and ``fit_seconds``. ``method="auto"`` also logs which method won
    (``method_index``: its position in ``AUTO_CANDIDATES``) and the cross-fitted
    coverage error of the HPD regions it chose by (``hpd_coverage_error_before`` /
    ``_after``, the regions of ``ranks/coverage_error``). **Deprecated**:
    ``coverage_error_before`` / ``_after``, the old names of the latent ones (which
    read as the HPD coverage error), are logged too until 0.3.0 (:data:`RENAMED_TAGS`).

    Arguments:
        theta: held-out parameters ``(n, D)``, never trained on and apart from the pairs
            that ``EarlyStopping`` or ``ModelCheckpoint`` monitor (the model kept fits
            those better than new pairs; it warns when they are the validation data).
        x: their observations ``(n, *X)``.
        method: passed to :func:`~calib_lightning.recalibrate` (``"auto"`` by default).
        estimator: attribute of the LightningModule holding the estimator (dotted paths
            work) or a function ``pl_module -> estimator``.
        prefix: first part of the logged keys.
        name: second part, and the callback's checkpoint key.
        seed: the cross-fitting split and any random draw of the fit.
        prior: the prior the pairs' ``theta`` were drawn from; when given, the recalibrated
            posterior is then restricted to its support
            (:class:`~calib_lightning.TruncatedPosterior`: ``recalibrate(..., prior=prior)``,
            whose HPD scale and HPD scores measure the restricted posterior; the logged
            latent coverage and NLL are the map's, before the restriction), and two more
            scalars are logged at the held-out ``x``: ``support_mass_outside`` (the mean
            mass of the map's posterior outside the support, removed) and
            ``support_nll_gain`` (the mean of :math:`-\log Z(x)`, by which the restriction
            lowers the expected NLL). The prior is not saved in the checkpoint: give it
            again to the callback that calls :meth:`posterior`.
        options: more arguments of :func:`~calib_lightning.recalibrate` (``band``,
            ``scale_target``).

    Attributes:
        recalibrated: the recalibrated posterior after ``fit`` (``None`` before).
        scores: the logged scalars (empty before).
    """

    def __init__(
        self,
        theta: Tensor,
        x: Tensor,
        *,
        method: str = "auto",
        estimator: str | Callable[[LightningModule], Any] = "flow",
        prefix: str = "calibration",
        name: str = "recalibration",
        seed: int = 0,
        prior: Any = None,
        **options: Any,
    ) -> None:
        super().__init__()
        check_pairs(theta, x, min_rows=2)
        if prior is not None:
            check_prior(prior, theta)
        self.prior = prior
        self.theta, self.x, self.method, self.estimator = theta, x, method, estimator
        self.prefix, self.name, self.seed, self.options = prefix.rstrip("/"), name, seed, options
        self.recalibrated: Posterior | None = None
        self.scores: dict[str, float] = {}
        self._state: dict[str, Any] = {}

    @property
    def state_key(self) -> str:
        return self._generate_state_key(prefix=self.prefix, name=self.name)

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        monitors = selecting_monitors(trainer, self.theta)
        if monitors:
            warnings.warn(
                f"RecalibrationCallback's pairs are the validation data that chose the model "
                f"kept ({', '.join(monitors)} monitored there): it fits them better than new "
                "pairs, so they are not new to it and the guarantees of the recalibration do "
                "not apply; give it pairs apart from the ones early stopping and checkpoints "
                "monitor",
                stacklevel=2,
            )
        estimator = find_estimator(pl_module, self.estimator)
        post = as_posterior(estimator)
        device = post.device or pl_module.device
        dtype = post.dtype or torch.get_default_dtype()
        theta, x = self.theta.to(device, dtype), self.x.to(device)
        start = time.perf_counter()
        with eval_mode(pl_module, estimator), seeded(self.seed), torch.no_grad():
            fixed = recalibrate(
                post, theta, x, self.method, seed=self.seed, prior=self.prior, **self.options
            )
            seconds = time.perf_counter() - start
            mapped = fixed.inner if isinstance(fixed, TruncatedPosterior) else fixed
            scores = self._before_after(post, mapped, theta, x)
            if isinstance(mapped, RecalibratedPosterior):
                selection = None if mapped.selection is None else mapped.selection.state()
                self._state = {
                    "method": mapped.method,
                    "selection": selection,  # plain values
                    "map": mapped.latent_map.state_dict(),
                    "dim": theta.shape[1],
                }
            if isinstance(fixed, TruncatedPosterior):
                log_z = fixed.log_normalizer(x)
                scores["support_mass_outside"] = float(1 - log_z.exp().mean())
                scores["support_nll_gain"] = float(-log_z.mean())
        scores["fit_seconds"] = seconds
        self.recalibrated, self.scores = fixed, scores
        metrics = {f"{self.prefix}/{self.name}/{key}": value for key, value in scores.items()}
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)
            logger.save()

    def _before_after(self, post: Any, fixed: Any, theta: Tensor, x: Tensor) -> dict[str, float]:
        """Held-out scores of the identity and of the fitted method (when it is a latent map
        and there are pairs enough for two halves)."""
        method = getattr(fixed, "method", None)
        if method not in AUTO_CANDIDATES or theta.shape[0] < 2 * MIN_PAIRS:
            return {}
        selection = getattr(fixed, "selection", None)
        if selection is None:
            z, log_prob = post.to_latent(theta, x), post.log_prob(theta, x)
            selection = cross_fit_scores(
                z, log_prob, ("none", method), seed=self.seed, band=self.options.get("band")
            )
        out = {
            "latent_coverage_error_before": selection["none"]["latent_coverage_error"],
            "latent_coverage_error_after": selection[method]["latent_coverage_error"],
            "nll_before": selection["none"]["nll"],
            "nll_after": selection[method]["nll"],
        }
        if "hpd_coverage_error" in selection[method]:  # "auto" scored HPD coverage too
            out["hpd_coverage_error_before"] = selection["none"]["hpd_coverage_error"]
            out["hpd_coverage_error_after"] = selection[method]["hpd_coverage_error"]
        if self.method == "auto":
            out["method_index"] = float(AUTO_CANDIDATES.index(method))
        return with_deprecated_aliases(out, RENAMED_TAGS)

    def posterior(self, estimator: Any) -> Posterior:
        """The recalibrated posterior of ``estimator`` (e.g. reloaded from a checkpoint)
        with the latent map this callback fitted or loaded, restricted to the support of
        the callback's ``prior`` when it has one."""
        if not self._state:
            raise ValueError(
                "the callback has no fitted map: it fits at the end of Trainer.fit, or loads "
                "one with load_state_dict from a checkpoint saved after fit"
            )
        latent_map = LatentMap(self._state["dim"])
        latent_map.load_state_dict(self._state["map"])
        post = as_posterior(estimator)
        if post.device is not None:
            latent_map = latent_map.to(post.device)
        fixed = RecalibratedPosterior(
            post, latent_map, self._state["method"], self._state["selection"]
        )
        return fixed if self.prior is None else TruncatedPosterior(fixed, self.prior)

    def state_dict(self) -> dict[str, Any]:
        return {"recalibration": dict(self._state), "scores": dict(self.scores)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._state = dict(state_dict.get("recalibration", {}))
        self.scores = dict(state_dict.get("scores", {}))
