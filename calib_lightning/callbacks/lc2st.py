"""Lightning callback running L-C2ST-NF local tests at reference observations while training."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import torch
from lightning.pytorch import LightningModule, Trainer
from matplotlib.figure import Figure
from torch import Tensor, nn

from calib_lightning._utils.validation import check_positive
from calib_lightning.baselines.c2st import oracle_c2st
from calib_lightning.callbacks._plumbing import describe as _describe
from calib_lightning.callbacks._plumbing import find_part
from calib_lightning.callbacks._scalars import with_deprecated_aliases
from calib_lightning.callbacks.base import CalibrationCallback
from calib_lightning.evaluation import draws
from calib_lightning.functional.reference import compare_to_reference
from calib_lightning.metrics.lc2st import LC2STNF, LC2STResult
from calib_lightning.misspecification import misspecification_test
from calib_lightning.plots._format import format_p_value
from calib_lightning.plots._grid import as_indices, select_parameters
from calib_lightning.plots.lc2st import MAX_MAP_PARAMETERS, plot_pp, plot_probability_map
from calib_lightning.posteriors import Posterior

__all__ = ["RENAMED_TAGS", "LC2STNFCallback"]

#: reference scores renamed in 0.2.0 (new name -> old name): density and coverage of
#: Naeem et al. (2020) compare the posterior draws with the reference samples, and the
#: old names read as a posterior density and as the coverage of credible regions (as in
#: ``ranks/coverage_error``). **Deprecated**: the old tags are logged as well, with the
#: same values, until 0.3.0 (:data:`~._scalars.ALIASES_REMOVED_IN`), then dropped.
RENAMED_TAGS = {"reference_density": "density", "reference_coverage": "coverage"}


class LC2STNFCallback(CalibrationCallback):
    r"""Local calibration at the observations you care about (L-C2ST-NF), every few epochs.

    The null classifiers depend only on the calibration ``x``: they are trained at the
    first check, in one batched fit, and kept in the checkpoint, so later checks and a
    resumed run cost one classifier fit and one inverse pass of the flow.

    Logs, under ``{prefix}/lc2st_nf/``, ``global_p_value`` (the verdict: the ``O``
    local tests combined into one p-value for "correct at every observation" that
    keeps its level), and one entry per reference
    observation ``o``: ``p_value/<o>`` (small = the posterior at :math:`x_o` is wrong) and
    ``statistic/<o>`` (:math:`T(x_o)`, 0 when the classifier cannot tell the flow's
    latents from normal draws). Figures: ``pp`` (PP-plots with the null band),
    ``probability_map/<o>`` (the classifier's probability over 1-D and 2-D marginals
    of posterior samples at :math:`x_o`, for the chosen ``parameters``: red where the
    estimator puts too much mass, blue too little, white consistent, hatched grey where
    it has no draws; contours of the posterior's 50 % and 90 % highest-density regions;
    with ``truths``, a crosshair and a star at the parameter that generated
    :math:`x_o`) and ``history``.

    With ``reference_samples`` (exact posterior samples at the observations, e.g. from a
    benchmark task or MCMC) it also logs, per observation, how the posterior's draws at
    :math:`x_o` compare with them: ``mmd`` and its permutation ``mmd_p_value``,
    ``frechet_distance``, ``reference_density`` and ``reference_coverage`` (density and
    coverage of Naeem et al. 2020: how densely the draws fill the nearest-neighbour balls
    of the reference samples, and the share of those balls holding a draw; about 1 and
    :math:`1 - 2^{-5}` for draws like the reference; not the coverage of credible
    regions) and ``oracle_c2st`` (accuracy of a classifier between estimator and
    reference samples; 0.5 = indistinguishable). **Deprecated**: ``density`` and
    ``coverage``, the old names of ``reference_density`` and ``reference_coverage``, are
    logged too until 0.3.0 (:data:`RENAMED_TAGS`).

    With ``misspecification=True`` (default) it also logs
    ``misspecification_p_value/<o>``: does :math:`x_o` look like an output of the
    simulator, judged against the calibration ``x``
    (:func:`calib_lightning.misspecification_test`; computed once, since neither
    changes while training). A small value warns that no calibration check on
    simulations vouches for the posterior at that observation.
    Samples for figures and reference scores are drawn under a fixed seed, so every
    process computes the same values; they are in ``last_extras`` after a check
    (:meth:`extra_results`), the metric's :class:`~calib_lightning.metrics.lc2st.LC2STResult`
    in ``last_result``.

    Arguments:
        theta: calibration parameters ``(N, D)``.
        x: calibration observations ``(N, *X)``.
        observations: reference observations :math:`x_o`, ``(O, *X)``; may be omitted
            when ``metric`` is given.
        metric: a configured :class:`calib_lightning.LC2STNF`; default
            ``LC2STNF(observations)`` (100 null classifiers, 2,000 evaluation points).
        truths: parameters that generated the observations ``(O, D)``, drawn on the maps
            as a labelled crosshair.
        reference_samples: exact posterior samples ``(S_ref, O, D)`` at the observations.
        labels: names of all ``D`` parameters, for the figures.
        parameters: indices of the parameters (at most six) whose marginals and pairs
            the probability maps draw; default the first four.
        map_num_posterior_samples: posterior samples per observation for the probability
            maps.
        oracle_kwargs: classifier settings of the oracle C2ST against ``reference_samples``
            (:func:`calib_lightning.baselines.oracle_c2st`); default: sbibm's ``c2st``
            protocol with scikit-learn (seconds per observation at 1,000 draws);
            ``{"classifier": "mlp"}`` trains the batched torch ensemble to convergence, and
            ``{"classifier": "mlp", "learning_rate": 1e-2, "patience": 3}`` is faster
            still but can read low.
        seed: seeds the checks (:class:`~calib_lightning.callbacks.CalibrationCallback`)
            and the samples drawn for figures and reference scores.
        misspecification: test each observation against the calibration ``x``
            (needs ``x`` as a tensor).
        embedding: the embedding network the classifiers see ``x`` through, resolved at
            every check like ``estimator``: an ``nn.Module``, an attribute path of the
            LightningModule (``"net.embedding"``) or a function ``pl_module -> embedding``
            (a plain ``x -> features`` function goes to the metric:
            ``LC2STNF(..., embedding=f)``). ``None`` keeps the metric's own. An embedding
            trained with the flow changes the features, so the null is retrained at every
            check (``num_null * num_ensemble`` classifiers instead of ``num_ensemble``);
            a frozen copy, ``copy.deepcopy(module.embedding)``, keeps one null.
        **kwargs: :class:`~calib_lightning.callbacks.CalibrationCallback` arguments.

    References:
        Linhart, Gramfort, Rodrigues. "L-C2ST: Local Diagnostics for Posterior
        Approximations in Simulation-Based Inference." NeurIPS 2023.
    """

    name: ClassVar[str] = "lc2st_nf"
    history_keys: ClassVar[tuple[str, ...]] = ("global_p_value", "p_value", "oracle_c2st")
    history_titles: ClassVar[dict[str, str]] = {
        "global_p_value": "L-C2ST-NF, all x_o combined (verdict)",
        "p_value": "L-C2ST-NF at one x_o",
        "oracle_c2st": "oracle C2ST accuracy",
    }
    metric_type: ClassVar[type] = LC2STNF
    needs: ClassVar[tuple[str, ...]] = ("sample", "to_latent")

    def __init__(
        self,
        theta: Tensor | None = None,
        x: Tensor | None = None,
        *,
        observations: Tensor | None = None,
        metric: LC2STNF | None = None,
        truths: Tensor | None = None,
        reference_samples: Tensor | None = None,
        labels: list[str] | None = None,
        parameters: list[int] | None = None,
        map_num_posterior_samples: int = 2000,
        seed: int = 0,
        misspecification: bool = True,
        embedding: str | nn.Module | Callable[[Any], Any] | None = None,
        oracle_kwargs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        if metric is None:
            if observations is None:
                raise ValueError("observations must be given (O, X) when no metric is, got None")
            metric = LC2STNF(observations=observations)
        super().__init__(metric, theta, x, seed=seed, **kwargs)
        if observations is not None and not torch.equal(
            observations.to(metric.observations), metric.observations
        ):
            raise ValueError(
                f"observations must equal metric.observations of shape "
                f"{tuple(metric.observations.shape)} (or be omitted), got a different "
                f"{_describe(observations)}"
            )
        num_obs = metric.observations.shape[0]
        num_dims = theta.shape[1] if isinstance(theta, Tensor) and theta.ndim == 2 else None
        for name, value, ndim, expected in (
            ("truths", truths, 2, "(O, D)"),
            ("reference_samples", reference_samples, 3, "(S_ref, O, D)"),
        ):
            if value is not None and (
                not isinstance(value, Tensor)
                or value.ndim != ndim
                or value.shape[-2] != num_obs
                or num_dims not in (None, value.shape[-1])
            ):
                raise ValueError(
                    f"{name} must have shape {expected} with O = {num_obs} observations"
                    f"{'' if num_dims is None else f' and D = {num_dims} like theta'}, "
                    f"got {_describe(value)}"
                )
        check_positive("map_num_posterior_samples", map_num_posterior_samples, integer=True)
        self.truths, self.reference_samples, self.labels = truths, reference_samples, labels
        self.parameters = as_indices(parameters)
        if isinstance(theta, Tensor) and theta.ndim == 2:  # else the figure checks them
            select_parameters(
                theta.shape[1],
                [0] if parameters is None else parameters,
                labels,
                max_count=MAX_MAP_PARAMETERS,
            )
        self.map_num_posterior_samples, self.seed = map_num_posterior_samples, seed
        self.oracle_kwargs = dict(oracle_kwargs or {})
        self.misspecification = misspecification and self.x is not None
        self._misspecification: Tensor | None = None
        if embedding is not None and not (isinstance(embedding, str) or callable(embedding)):
            raise ValueError(
                "embedding must be an nn.Module, an attribute path of the LightningModule, a "
                f"function pl_module -> embedding or None, got {_describe(embedding)}"
            )
        self.embedding = embedding

    def _compute(
        self, trainer: Trainer, pl_module: LightningModule
    ) -> tuple[LC2STResult, dict[str, Tensor]]:
        if self.embedding is not None:  # resolved at every check: it may train with the flow
            self.metric.set_embedding(find_part(pl_module, self.embedding, "embedding"))
        return super()._compute(trainer, pl_module)

    def extra_results(self, trainer: Trainer, posterior: Posterior) -> dict[str, Tensor]:
        """Probability maps (rank zero, with figures) and reference scores, as tensors.

        Keys: ``misspecification_p_value`` ``(O,)`` (logged); ``map_samples``
        ``(O, S, D)`` and ``map_probabilities`` ``(O, S)`` (figures only); with
        ``reference_samples``, ``mmd``, ``mmd_p_value``, ``frechet_distance``,
        ``reference_density``, ``reference_coverage`` and ``oracle_c2st``, each ``(O,)``
        (logged; :meth:`scalars` adds the deprecated ``density`` and ``coverage``).
        """
        draw_maps = self.log_figures and trainer.is_global_zero
        out: dict[str, Tensor] = {}
        if self.misspecification:
            if self._misspecification is None:  # observations and x never change
                test = misspecification_test(
                    self.metric.observations.cpu(), self.x.cpu(), seed=self.seed
                )
                self._misspecification = test.p_value
            out["misspecification_p_value"] = self._misspecification
        if not draw_maps and self.reference_samples is None:
            return out
        observations = self.metric.observations
        with torch.random.fork_rng(devices=[]):  # same draws on every process
            torch.manual_seed(self.seed)
            if draw_maps:
                maps = self.metric.probability_map(posterior, self.map_num_posterior_samples)
                out["map_samples"], out["map_probabilities"] = maps.samples, maps.probabilities
            if self.reference_samples is not None:
                reference = self.reference_samples.to(observations)
                samples = draws(posterior, observations, reference.shape[0])  # (S_ref, O, D)
                scores = compare_to_reference(
                    samples,
                    reference,
                    vendi=False,
                    generator=torch.Generator().manual_seed(self.seed),
                )
                tag = {field: name for name, field in RENAMED_TAGS.items()}  # field -> tag
                out.update({tag.get(k, k): getattr(scores, k) for k in scores.logged})  # (O,)
                out["oracle_c2st"] = oracle_c2st(
                    samples.transpose(0, 1),
                    reference.transpose(0, 1),
                    seed=self.seed,
                    **self.oracle_kwargs,
                ).accuracy
        return out

    def scalars(self, result: LC2STResult) -> dict[str, Tensor]:
        """The result's and the extras' scalars, then the deprecated aliases of the
        renamed reference scores (:data:`RENAMED_TAGS`, logged until 0.3.0)."""
        return with_deprecated_aliases(super().scalars(result), RENAMED_TAGS)

    def figures(self, result: LC2STResult) -> dict[str, Figure]:
        figures = super().figures(result)
        figures["pp"] = plot_pp(result, level=self.level, test="L-C2ST-NF")
        if "map_samples" in self.last_extras:
            maps = zip(
                self.last_extras["map_samples"], self.last_extras["map_probabilities"], strict=True
            )
            for o, (samples, probs) in enumerate(maps):
                pp = (result.pp_grid, result.pp_ecdf[o], result.pp_band[:, o])
                truth = None if self.truths is None else self.truths[o].cpu()
                figures[f"probability_map/{o}"] = plot_probability_map(
                    samples,
                    probs,
                    labels=self.labels,
                    parameters=self.parameters,
                    truth=truth,
                    pp=pp,
                    title=f"observation {o}: L-C2ST-NF {format_p_value(result.p_value[o], 3)}",
                )
        return figures
