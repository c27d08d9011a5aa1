"""Lightning callback testing the expected coverage of a ratio or likelihood estimator
(an unnormalized posterior) while it trains, by importance sampling: no MCMC."""

from __future__ import annotations

import warnings
from typing import Any, ClassVar

from lightning.pytorch import LightningModule, Trainer
from matplotlib.figure import Figure
from torch import Tensor

from calib_lightning.callbacks._plumbing import SetupError
from calib_lightning.callbacks._unnormalized import callback_posterior
from calib_lightning.callbacks.base import CalibrationCallback
from calib_lightning.metrics.importance import ImportanceCoverage, ImportanceCoverageResult
from calib_lightning.plots.importance import plot_importance_coverage
from calib_lightning.posteriors import UnnormalizedPosterior

__all__ = ["ImportanceCoverageCallback"]


class ImportanceCoverageCallback(CalibrationCallback):
    r"""Expected coverage of an unnormalized posterior every ``every_n_epochs`` epochs.

    For a LightningModule that trains a ratio estimator :math:`\log r(\theta, x)` or a
    likelihood estimator :math:`\log q(x \mid \theta)`: with ``prior=`` (and ``estimator=``
    the network, a callable ``(theta (M, D), x (M, *X)) -> (M,)``, an sbi
    ``RatioEstimator`` or NLE density estimator) the callback checks the posterior
    :math:`\propto \exp f(\theta, x)\, p(\theta)` with :class:`calib_lightning.ImportanceCoverage`:
    the highest-density credibility of each true parameter by self-normalized importance
    sampling from the prior (or the metric's ``proposal``). An sbi ``MCMCPosterior`` needs
    no ``prior=`` (its potential has one).

    Logs, under ``{prefix}/importance_coverage/``, the ``logged`` fields of
    :class:`~calib_lightning.functional.importance.ImportanceCoverageResult`:
    ``global_p_value`` (the verdict: the chi-square and ECDF tests combined),
    ``p_value``, ``ecdf_p_value``, ``coverage_error`` (**negative = over-confident**,
    as every coverage check of the package) and ``ess_min`` and ``ess_median`` (effective
    sample size of the importance weights). When the median ESS is below the metric's
    ``min_ess`` the p-values and ``coverage_error`` are NaN (the ESS is still logged) and
    the callback warns once with the reason (``last_result.cannot_judge``). Figures:
    ``expected_coverage`` (:func:`~calib_lightning.plots.plot_importance_coverage`) and
    ``history`` (the verdict, the coverage error and the median ESS against the epoch).

    Arguments:
        theta: calibration parameters ``(N, D)``, drawn from the prior, never trained on.
        x: their observations ``(N, *X)``.
        metric: a configured :class:`calib_lightning.ImportanceCoverage` (its
            ``num_proposal_samples``, ``proposal``, ``min_ess``, ``seed``, ...); default
            ``ImportanceCoverage()``.
        **kwargs: :class:`~calib_lightning.callbacks.CalibrationCallback` arguments
            (``prior``, ``estimator``, ``dataloader``, ``every_n_epochs``, ...).

    Example:
        >>> import torch
        >>> from torch.distributions import Independent, Uniform
        >>> prior = Independent(Uniform(-3 * torch.ones(2), 3 * torch.ones(2)), 1)
        >>> theta = prior.sample((256,))
        >>> x = theta + torch.randn(256, 2)
        >>> callback = ImportanceCoverageCallback(theta, x, estimator="ratio", prior=prior,
        ...                                       metric=ImportanceCoverage(min_ess=20))
        >>> callback.metric.min_ess, callback.state_key
        (20, "ImportanceCoverageCallback{'prefix': 'calibration', 'name': 'importance_coverage'}")

    References:
        Hermans et al. "A trust crisis in simulation-based inference? Your posterior
        approximations can be unfaithful." TMLR (2022).
    """

    name: ClassVar[str] = "importance_coverage"
    history_keys: ClassVar[tuple[str, ...]] = ("global_p_value", "coverage_error", "ess_median")
    history_titles: ClassVar[dict[str, str]] = {
        "global_p_value": "coverage tests combined (verdict)",
        "coverage_error": "HPD coverage error",
        "ess_median": "median effective sample size",
    }
    metric_type: ClassVar[type] = ImportanceCoverage
    needs: ClassVar[tuple[str, ...]] = ("score",)

    def __init__(
        self,
        theta: Tensor | None = None,
        x: Tensor | None = None,
        *,
        metric: ImportanceCoverage | None = None,
        **kwargs: Any,
    ) -> None:
        metric = metric if metric is not None else ImportanceCoverage()
        super().__init__(metric, theta, x, **kwargs)
        self.judge_warned = False

    def check_setup(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Raise now unless the estimator is an unnormalized posterior (a ratio or
        likelihood estimator with ``prior=``), then the checks of every callback."""
        posterior = callback_posterior(self._find_estimator(pl_module), self.prior)
        if not isinstance(posterior, UnnormalizedPosterior):
            raise SetupError(
                f"ImportanceCoverageCallback checks a ratio or likelihood estimator: pass "
                f"prior= (the estimator is then read as log r(theta, x) or log q(x | theta)), "
                f"got {posterior!r} and no prior; for a posterior that samples use "
                "RankCalibrationCallback"
            )
        super().check_setup(trainer, pl_module)

    def scalars(self, result: ImportanceCoverageResult) -> dict[str, Tensor]:
        """The result's ``logged`` fields; warns once when the result cannot judge."""
        if result.cannot_judge is not None and not self.judge_warned:
            self.judge_warned = True
            warnings.warn(
                f"ImportanceCoverageCallback ({self.tag_name}) cannot judge, so its p-values "
                f"and coverage_error are logged as NaN: {result.cannot_judge}. This warning "
                "is shown once.",
                RuntimeWarning,
                stacklevel=2,
            )
        return super().scalars(result)

    def figures(self, result: ImportanceCoverageResult) -> dict[str, Figure]:
        figures = super().figures(result)
        figures["expected_coverage"] = plot_importance_coverage(result, level=self.level)
        return figures
