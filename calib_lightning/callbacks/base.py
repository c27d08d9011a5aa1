"""The shared base of the calibration callbacks: when to check, on which data, where results go.

A :class:`CalibrationCallback` owns one metric and held-out calibration pairs. At the end
of chosen epochs of ``Trainer.fit`` it evaluates the estimator in eval mode under
``torch.no_grad``, logs the result's scalars through ``pl_module.log_dict`` (so
``EarlyStopping`` and ``ModelCheckpoint`` can monitor them), keeps a history saved with
the checkpoint (:mod:`._history`), and on rank zero writes figures and histograms to
TensorBoard. A failing check warns and logs NaN by default (``on_error="warn"``). The
verdict of a check is one p-value at the callback's ``level``
(:meth:`CalibrationCallback.verdict_key`).

A diagnostic subclass only says which metric to build and which figures to draw
(:meth:`~CalibrationCallback.figures`, :meth:`~CalibrationCallback.histograms`,
:meth:`~CalibrationCallback.extra_results`). ``docs/callbacks.md`` tells the whole story.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any, ClassVar

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.trainer.states import TrainerFn
from matplotlib.figure import Figure
from torch import Tensor, nn

from calib_lightning._utils.validation import check_choice, check_positive, check_probability
from calib_lightning.callbacks._figures import write_figures
from calib_lightning.callbacks._history import CheckHistory
from calib_lightning.callbacks._plumbing import (
    STAGES,
    CostWarning,
    DrawSharing,
    SetupCheck,
    SetupError,
    check_data,
    epoch_check_seconds,
    eval_mode,
    find_estimator,
    last_epoch,
    local_batches,
    seeded_check,
    share_draws,
    tensor_scalars,
    to_cpu,
)
from calib_lightning.callbacks._scalars import logged_scalars
from calib_lightning.callbacks._unnormalized import (
    callback_posterior,
    check_capabilities,
    check_unnormalized_fits,
)
from calib_lightning.plots.history import plot_history
from calib_lightning.posteriors import Posterior, UnnormalizedPosterior
from calib_lightning.results import Result

__all__ = ["CalibrationCallback"]

Estimator = str | Callable[[LightningModule], Any]


class CalibrationCallback(CheckHistory, CostWarning, DrawSharing, SetupCheck):
    """Run a calibration metric on held-out pairs during ``Trainer.fit`` and log it.

    During ``fit`` the check runs at the end of the validation epoch, or at the end of
    the training epoch when no validation ran in that epoch (no validation loop,
    ``limit_val_batches=0``, ``check_val_every_n_epoch > 1``); at most once per epoch,
    never during the sanity check. The last epoch of ``fit`` is always checked, whatever
    ``every_n_epochs`` (``max_epochs``, ``max_steps``, ``EarlyStopping``), so the model
    saved at the end has a verdict. With ``check_on`` including ``"validate"`` or
    ``"test"``, ``trainer.validate`` / ``trainer.test`` run a check and log it too.

    Figures go to every logger in the form it stores images (TensorBoard, W&B, MLflow,
    Comet), and as PNG files ``{log_dir}/{prefix}/{name}/{figure}/epoch=EEEE.png`` for
    any other logger (``CSVLogger``) or none (:mod:`calib_lightning.callbacks._figures`).

    Under DDP each process feeds its shard of the pairs, the metric syncs in ``compute``
    (all ranks log the same values) and rank zero draws the figures. Callbacks checking
    in one epoch share posterior draws at the same ``x`` (docs/callbacks.md).

    Arguments:
        metric: the metric, with ``update(posterior, theta, x)`` and ``compute()``
            returning a :class:`~calib_lightning.results.Result` (or a dict of tensors);
            the callback resets it before each check.
        theta: calibration parameters ``(N, D)``, drawn from the prior and never used
            for training.
        x: their simulated observations ``(N, *X)``.
        dataloader: instead of ``theta`` and ``x``, an iterable of ``(theta, x)`` batches.
        every_n_epochs: check after epochs ``k - 1, 2k - 1, ...`` (0-based), after the
            first epoch of each ``fit`` (so monitors find the value from the start) and
            after the last.
        estimator: attribute of the LightningModule holding the conditional flow
            (dotted paths such as ``"net.flow"`` work), or a function
            ``pl_module -> estimator``; the result goes through
            :func:`calib_lightning.as_posterior`, or is a ratio or likelihood with ``prior``.
        prior: the prior :math:`p(\\theta)` when ``estimator`` is a ratio or likelihood
            estimator, not a posterior: an sbi ``RatioEstimator`` or likelihood estimator
            (``NLE``), or any callable ``(theta (M, D), x (M, *X)) -> (M,)`` returning
            :math:`\\log r(\\theta, x)` or :math:`\\log q(x \\mid \\theta)`; the callback
            then checks :class:`~calib_lightning.UnnormalizedPosterior` ``(estimator, prior)``
            (scores only: :mod:`~calib_lightning.callbacks._unnormalized`).
        prefix: first part of every tag.
        name: second part of every tag and the callback's checkpoint key; defaults to
            the class's ``name``. Give two callbacks of one kind different names.
        batch_size: pairs per ``update`` (tensors only; ``None``: a shard in one call).
        log_figures: draw figures and send them to the loggers (``False`` also skips
            work done only for figures, such as probability maps).
        level: test level of the verdict (:meth:`verdict_key`), plots and summaries.
        on_error: ``"warn"`` (default): a failing check warns, logs and records NaN,
            and training goes on; ``"raise"`` ends ``Trainer.fit`` (use it under DDP).
            Errors in the callback's own setup (a missing ``estimator`` attribute, a
            ``dataloader`` that does not yield pairs) always raise.
        check_on: the stages that run checks: ``"fit"`` (the schedule above),
            ``"validate"``, ``"test"``; at the start of each, data that do not fit the
            estimator raise the metrics' ``ValueError`` (:class:`~._plumbing.SetupCheck`).
        seed: seeds each check, in a forked random state (:func:`~._plumbing.seeded_check`):
            identical runs log identical numbers; the training's weights do not change.

    Scalars are logged in float64, and every p-value also as its log10 under
    ``log10_{key}`` (e.g. ``calibration/ranks/log10_p_value``), which is exact: a
    p-value's own tag is floored at float32's smallest normal number (about ``1.2e-38``,
    read it as "at most"), so that TensorBoard's float32 shows what the other loggers
    show (:mod:`calib_lightning.callbacks._scalars`). ``history`` keeps the unfloored
    float64 p-values (not their log10).

    Attributes:
        history: scalar key -> its value at each check (``nan`` where it was missing
            or the check failed).
        epochs: the epoch of each check. ``history`` and ``epochs`` are saved with the
            checkpoint and continue after a resume.
        stages: the stage of each check: ``"fit"``, ``"validate"`` or ``"test"``.
        seconds: wall-clock seconds of each check (metric, logging and figures); a check
            in ``fit`` longer than a quarter of its epoch's training (the epoch less every
            calibration callback's checks) warns once with both numbers.
        last_result: the metric's result at the latest check, on the CPU (``None``
            before the first check and after a failed one).
        last_extras: what :meth:`extra_results` returned at the latest check, on the CPU.
        errors: ``(epoch, message)`` of each check that failed under ``on_error="warn"``
            (saved with the checkpoint, like ``history``).
    """

    name: ClassVar[str] = "calibration"
    #: ``history_keys`` (:class:`~._history.CheckHistory`) not drawn in the ``history`` figure
    unplotted_keys: ClassVar[tuple[str, ...]] = ()
    #: the ``history`` figure's panel titles by key (first part): which test a p-value is
    history_titles: ClassVar[dict[str, str]] = {}
    #: the metric class a subclass requires (``None``: any metric with update/compute).
    metric_type: ClassVar[type | None] = None
    #: the posterior capabilities the check needs (:data:`calib_lightning.posteriors.
    #: CAPABILITIES`); a posterior without them fails at setup, saying what to use
    needs: ClassVar[tuple[str, ...]] = ()

    def __init__(
        self,
        metric: nn.Module,
        theta: Tensor | None = None,
        x: Tensor | None = None,
        *,
        dataloader: Iterable[Any] | None = None,
        every_n_epochs: int = 1,
        estimator: Estimator = "flow",
        prefix: str = "calibration",
        name: str | None = None,
        batch_size: int | None = None,
        log_figures: bool = True,
        level: float = 0.05,
        on_error: str = "warn",
        check_on: Iterable[str] = ("fit",),
        seed: int = 0,
        prior: Any = None,
    ) -> None:
        super().__init__()
        if self.metric_type is not None and not isinstance(metric, self.metric_type):
            raise ValueError(
                f"metric must be a calib_lightning.{self.metric_type.__name__}, "
                f"got {type(metric).__name__}"
            )
        if not (
            callable(getattr(metric, "update", None)) and callable(getattr(metric, "compute", None))
        ):
            raise ValueError(
                "metric must have update(posterior, theta, x) and compute(), "
                f"got {type(metric).__name__}"
            )
        check_data(theta, x, dataloader)
        check_positive("every_n_epochs", every_n_epochs, integer=True)
        if batch_size is not None:
            check_positive("batch_size", batch_size, integer=True)
        if not (isinstance(estimator, str) or callable(estimator)):
            raise ValueError(
                "estimator must be an attribute name or a function pl_module -> estimator, "
                f"got {type(estimator).__name__}"
            )
        check_probability("level", level)
        check_choice("on_error", on_error, ("warn", "raise"))
        self.check_on = tuple(check_on) if not isinstance(check_on, str) else (check_on,)
        for stage in self.check_on:
            check_choice("check_on", stage, STAGES)
        self.metric = metric
        self.theta, self.x, self.dataloader = theta, x, dataloader
        self.every_n_epochs, self.estimator, self.batch_size = every_n_epochs, estimator, batch_size
        self.prior = prior
        self.prefix = prefix.rstrip("/")
        self.tag_name = name if name is not None else self.name
        self.log_figures, self.level, self.on_error, self.seed = log_figures, level, on_error, seed
        self.last_result: Result | dict[str, Tensor] | None = None
        self.last_extras: dict[str, Tensor] = {}
        self._checked_epoch: int | None = None
        self._first_epoch = 0

    def scalars(self, result: Result | dict[str, Tensor]) -> dict[str, Tensor]:
        """The scalars to log, keyed without prefix.

        Default: the result's ``logged`` fields (:meth:`Result.scalars
        <calib_lightning.results.Result.scalars>`; for a dict result, every 0-d entry and
        each entry ``i`` of a 1-d one as ``key/i``), then those of :attr:`last_extras`.
        """
        out = result.scalars() if isinstance(result, Result) else tensor_scalars(result)
        out.update(tensor_scalars(self.last_extras))
        return out

    def figures(self, result: Result | dict[str, Tensor]) -> dict[str, Figure]:
        """Figures to write, keyed by tag suffix. Default: the history of ``history_keys``.

        Called on rank zero only, and only when a TensorBoard logger will receive them.
        """
        keys = [k for k in self.headline_keys() if k.split("/")[0] not in self.unplotted_keys]
        if not keys or not self.epochs:
            return {}
        title = f"{self.tag_name}: calibration over training"
        history = {k: self.history[k] for k in keys}
        figure = plot_history(
            self.epochs, history, level=self.level, title=title, titles=self.history_titles
        )
        return {"history": figure}

    def histograms(self, result: Result | dict[str, Tensor]) -> dict[str, Tensor]:
        """Tensors to write with ``add_histogram``, keyed by tag suffix. Default: none."""
        return {}

    def extra_results(self, trainer: Trainer, posterior: Posterior) -> dict[str, Tensor]:
        """More outputs computed from the posterior after the metric, in the same eval-mode,
        ``no_grad`` context (e.g. samples for a figure), kept in :attr:`last_extras`; their
        0-d and 1-d tensors are logged too. Runs on every process. Default: none."""
        return {}

    def extra_state(self) -> dict[str, Any]:
        """More state to save with the checkpoint (besides histories and the metric's)."""
        return {}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`extra_state` saved."""

    @property
    def state_key(self) -> str:
        return self._generate_state_key(prefix=self.prefix, name=self.tag_name)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._first_epoch = trainer.current_epoch  # > 0 when resuming from a checkpoint
        self._checked_epoch = None

    def on_validation_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.sanity_checking:
            return
        if trainer.state.fn == TrainerFn.VALIDATING:
            if "validate" in self.check_on:
                self._run(trainer, pl_module, "validate")
        else:
            self._maybe_check(trainer, pl_module, final=last_epoch(trainer))

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # epochs in which no validation ran, and the last epoch whatever the schedule
        # (EarlyStopping and max_steps decide that only now)
        self._maybe_check(trainer, pl_module, final=last_epoch(trainer, stopping=True))

    def on_test_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if "test" in self.check_on:
            self._run(trainer, pl_module, "test")

    def state_dict(self) -> dict[str, Any]:
        """The record of the checks (:class:`~._history.CheckHistory`), the metric's state
        and :meth:`extra_state`."""
        return {
            **super().state_dict(),
            "metric": self.metric.state_dict(),
            "extra": self.extra_state(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self.metric.load_state_dict(state_dict["metric"])
        self.load_extra_state(state_dict.get("extra", {}))

    def _maybe_check(self, trainer: Trainer, pl_module: LightningModule, final: bool) -> None:
        epoch = trainer.current_epoch
        if trainer.state.fn != TrainerFn.FITTING or self._checked_epoch == epoch:
            return
        if final or epoch == self._first_epoch or (epoch + 1) % self.every_n_epochs == 0:
            self._checked_epoch = epoch
            self._run(trainer, pl_module, "fit")

    def _run(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        checks, start = len(self.epochs), time.perf_counter()
        before = epoch_check_seconds(trainer)  # other callbacks' checks: not training
        try:
            with seeded_check(self.seed, trainer, pl_module, stage):
                self._check(trainer, pl_module, stage)
            self.warn_cost(start, time.perf_counter() - start, stage, before)
        except Exception as error:
            if self.on_error == "raise" or isinstance(error, SetupError):
                raise
            self._fail(
                trainer,
                pl_module,
                error,
                recorded=len(self.epochs) > checks,
                seconds=time.perf_counter() - start,
                stage=stage,
            )
        finally:
            self.add_check_seconds(time.perf_counter() - start, stage)

    def _fail(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        error: Exception,
        *,
        recorded: bool,
        seconds: float,
        stage: str,
    ) -> None:
        """``on_error="warn"``: warn, log and record NaN, keep the history, train on."""
        epoch = trainer.current_epoch
        kind = type(error).__name__
        if isinstance(error, ValueError) and kind != "ValueError":  # NonFinitePairs and kin
            kind = f"ValueError ({kind})"
        reason = f"{kind}: {error}"
        self.errors.append((epoch, reason))
        what = (
            "its figures failed after the scalars were logged"
            if recorded
            else "failed and is recorded as NaN"
        )
        warnings.warn(
            f"{type(self).__name__} ({self.tag_name}) check at epoch {epoch} {what}; "
            f"training goes on (on_error='raise' stops it). {reason}",
            RuntimeWarning,
            stacklevel=2,
        )
        self.last_result, self.last_extras = None, {}
        if recorded:  # the scalars went out; a figure failed afterwards
            return
        keys = list(self.history) or list(self.history_keys)
        nan = torch.tensor(math.nan)
        pl_module.log_dict(
            {
                f"{self.prefix}/{self.tag_name}/{k}": v
                for k, v in logged_scalars(dict.fromkeys(keys, nan)).items()
            },
            on_step=False,
            on_epoch=True,
        )
        self._record(epoch, dict.fromkeys(keys, math.nan), stage)
        self.seconds.append(seconds)

    def _check(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        """Run the metric, log and record the result (all processes call it: the metric syncs)."""
        start = time.perf_counter()
        result, self.last_extras = self._compute(trainer, pl_module)
        scalars = {k: v.detach().reshape(()) for k, v in self.scalars(result).items()}
        logged = {
            f"{self.prefix}/{self.tag_name}/{k}": v for k, v in logged_scalars(scalars).items()
        }
        pl_module.log_dict(
            logged,
            on_step=False,
            on_epoch=True,
            sync_dist=True,  # equal on all ranks: mean is a no-op
        )
        self._record(trainer.current_epoch, {k: float(v) for k, v in scalars.items()}, stage)
        self.last_result = to_cpu(result)
        self.last_extras = to_cpu(self.last_extras)
        if self.log_figures and trainer.is_global_zero:
            self._write_figures(trainer, self.last_result)
        self.seconds.append(time.perf_counter() - start)

    def _compute(
        self, trainer: Trainer, pl_module: LightningModule
    ) -> tuple[Result | dict[str, Tensor], dict[str, Tensor]]:
        estimator = self._find_estimator(pl_module)
        posterior = callback_posterior(estimator, self.prior)
        shared = (
            None
            if isinstance(posterior, UnnormalizedPosterior)
            else share_draws(trainer, pl_module, estimator, posterior, self.dataloader is None)
        )  # nothing to draw
        device = pl_module.device
        with eval_mode(pl_module, estimator), torch.inference_mode(False), torch.no_grad():
            self.metric.to(device)
            self.metric.reset()
            for theta, x in self._local_batches(trainer, device, pl_module.dtype, shared):
                self.metric.update(shared or posterior, theta, x)
            result = self.metric.compute()
            return result, dict(self.extra_results(trainer, shared or posterior))

    def check_setup(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Raise now if the estimator cannot be checked (:class:`~._plumbing.SetupCheck`):
        a capability in :attr:`needs` it lacks, data that do not fit it."""
        estimator = self._find_estimator(pl_module)
        posterior = callback_posterior(estimator, self.prior)
        check_capabilities(self, posterior, self.needs)
        if not isinstance(posterior, UnnormalizedPosterior):
            return super().check_setup(trainer, pl_module)
        batch = next(iter(self._local_batches(trainer, pl_module.device, pl_module.dtype)), None)
        if batch is not None:
            with eval_mode(pl_module, estimator):
                check_unnormalized_fits(posterior, *batch)

    def _find_estimator(self, pl_module: LightningModule) -> Any:
        return find_estimator(pl_module, self.estimator)

    def _local_batches(
        self, trainer: Trainer, device: torch.device, dtype: torch.dtype, shared: Any = None
    ) -> Iterator[tuple[Tensor, Tensor]]:
        """This process's share of the pairs, on the module's device and floating dtype."""
        return local_batches(
            self.theta,
            self.x,
            self.dataloader,
            self.batch_size,
            rank=trainer.global_rank,
            world=trainer.world_size,
            device=device,
            dtype=dtype,
            shared=shared,
        )

    def _write_figures(self, trainer: Trainer, result: Result | dict[str, Tensor]) -> None:
        """Send the figures and histograms to every logger (:mod:`._figures`)."""
        base = f"{self.prefix}/{self.tag_name}"
        write_figures(trainer, base, self.figures(result), self.histograms(result))
