"""The shared base of the calibration callbacks: when to check, on which data, where results go.

A :class:`CalibrationCallback` owns one metric (anything with
``update(posterior, theta, x)`` and ``compute() -> dict``) and held-out calibration
pairs. After the first epoch and then every ``every_n_epochs`` epochs of ``Trainer.fit`` it

1. finds the estimator on the LightningModule and wraps it with
   :func:`calib_lightning.as_posterior`;
2. puts the module in eval mode, feeds its shard of the calibration pairs to the
   metric under ``torch.no_grad`` (posteriors switch gradients back on only to take
   scores), computes (synced across processes), and restores every submodule's mode;
3. logs each scalar with ``pl_module.log_dict`` as ``{prefix}/{name}/{key}``, so
   ``EarlyStopping`` and ``ModelCheckpoint`` can monitor it, and appends it to a
   history kept in the checkpoint;
4. on rank zero, writes figures (``add_figure``) and histograms (``add_histogram``)
   to every ``TensorBoardLogger``; without one it logs scalars only, warning once.

A check that fails (NaN log-probabilities of a diverging flow, a singular covariance)
does not end a long run by default (``on_error="warn"``): the callback warns with the
reason, logs NaN for its scalars, records NaN in the history and training goes on;
``on_error="raise"`` stops the run instead.

The verdict of a check is one p-value at the callback's ``level``
(:meth:`CalibrationCallback.verdict_key`): ``global_p_value`` for a metric that runs
several tests (rank calibration, L-C2ST), else its ``p_value``.

A diagnostic subclass only says which metric to build, which scalars to log and
which figures to draw (:meth:`~CalibrationCallback.scalars`,
:meth:`~CalibrationCallback.figures`, :meth:`~CalibrationCallback.histograms`).
"""

from __future__ import annotations

import functools
import math
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any, ClassVar

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_warn
from matplotlib.figure import Figure
from torch import Tensor, nn
from torch.utils.data import DistributedSampler

from calib_lightning._checks import check_choice, check_pairs, check_positive, check_probability
from calib_lightning.plots.history import plot_history
from calib_lightning.posteriors import Posterior, as_posterior

__all__ = ["CalibrationCallback"]

Estimator = str | Callable[[LightningModule], Any]


class CalibrationCallback(Callback):
    """Run a calibration metric on held-out pairs during ``Trainer.fit`` and log it.

    The check runs at the end of the validation epoch, or at the end of the training
    epoch when no validation ran in that epoch (no validation loop,
    ``limit_val_batches=0``, ``check_val_every_n_epoch > 1``); at most once per epoch,
    never during the sanity check, and only while fitting.

    Under DDP every process feeds its shard of the calibration pairs (row ``i`` to
    rank ``i mod world_size``; with a DataLoader, batch ``i``, unless it already has a
    ``DistributedSampler``), the metric syncs its states in ``compute``, so all ranks
    log the same values, and only rank zero draws figures.

    Arguments:
        metric: the metric, with ``update(posterior, theta, x)`` and ``compute()``
            returning a dict of tensors; the callback resets it before each check.
        theta: calibration parameters ``(N, D)``, drawn from the prior and never used
            for training.
        x: their simulated observations ``(N, *X)``.
        dataloader: instead of ``theta`` and ``x``, an iterable of ``(theta, x)`` batches.
        every_n_epochs: check after epochs ``k - 1, 2k - 1, ...`` (0-based), and after
            the first epoch of each ``fit`` (epoch 0, or the first epoch after a
            resume): the history gets a starting point and ``EarlyStopping`` /
            ``ModelCheckpoint`` find the monitored value from the first epoch on (in
            between, Lightning keeps the latest value).
        estimator: attribute of the LightningModule holding the conditional flow
            (dotted paths such as ``"net.flow"`` work), or a function
            ``pl_module -> estimator``; the result goes through
            :func:`calib_lightning.as_posterior`.
        prefix: first part of every tag.
        name: second part of every tag and the callback's checkpoint key; defaults to
            the class's ``name``. Give two callbacks of one kind different names.
        batch_size: calibration pairs per ``update`` when ``theta``/``x`` are tensors;
            ``None`` feeds each process's shard in one call.
        log_figures: write figures and histograms to TensorBoard.
        level: test level of the verdict (:meth:`verdict_key`), drawn on p-value plots
            and used by :func:`~calib_lightning.callbacks.summary_table`.
        on_error: what a failing check does: ``"warn"`` (default) warns with the
            reason, logs NaN for the scalars, records NaN in the history and lets
            training go on; ``"raise"`` re-raises, ending ``Trainer.fit``. Under DDP a
            check that fails on one process only cannot be recovered: use ``"raise"``.
            Errors in the callback's own setup (an ``estimator`` attribute that does
            not exist, a ``dataloader`` that does not yield pairs) always raise.

    Logged p-values are floored at the smallest normal float32 (about ``1.2e-38``),
    since loggers store float32 and would show an underflowed p-value as exactly 0;
    ``history`` keeps the float64 values.

    Attributes:
        history: scalar key -> its value at each check (``nan`` where it was missing
            or the check failed).
        epochs: the epoch of each check. ``history`` and ``epochs`` are saved with the
            checkpoint and continue after a resume.
        seconds: wall-clock seconds of each check (metric, logging and figures).
        last_result: the metric's output at the latest check, on the CPU (empty
            after a failed check).
        errors: ``(epoch, message)`` of each check that failed under ``on_error="warn"``
            (saved with the checkpoint, like ``history``).
    """

    name: ClassVar[str] = "calibration"
    #: history keys drawn in the ``history`` figure; subclasses choose.
    history_keys: ClassVar[tuple[str, ...]] = ("p_value",)
    #: the metric class a subclass requires (``None``: any metric with update/compute).
    metric_type: ClassVar[type | None] = None
    #: result keys logged by :meth:`scalars`, in this order (``None``: every scalar entry).
    scalar_keys: ClassVar[tuple[str, ...] | None] = None

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
    ) -> None:
        super().__init__()
        if self.metric_type is not None and not isinstance(metric, self.metric_type):
            raise ValueError(
                f"metric must be a calib_lightning.{self.metric_type.__name__}, "
                f"got {type(metric).__name__}"
            )
        if not (callable(getattr(metric, "update", None)) and callable(
            getattr(metric, "compute", None))):
            raise ValueError(
                "metric must have update(posterior, theta, x) and compute(), "
                f"got {type(metric).__name__}"
            )
        if (dataloader is None) == (theta is None and x is None):
            raise ValueError(
                "pass the calibration data either as tensors theta and x or as a dataloader, "
                f"got theta={_describe(theta)}, x={_describe(x)}, "
                f"dataloader={_describe(dataloader)}"
            )
        if dataloader is None:
            if theta is None or x is None:
                raise ValueError(
                    f"theta and x must both be given, got theta={_describe(theta)}, "
                    f"x={_describe(x)}"
                )
            check_pairs(theta, x, min_rows=2)
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
        self.metric = metric
        self.theta, self.x, self.dataloader = theta, x, dataloader
        self.every_n_epochs, self.estimator, self.batch_size = every_n_epochs, estimator, batch_size
        self.prefix = prefix.rstrip("/")
        self.tag_name = name if name is not None else self.name
        self.log_figures, self.level, self.on_error = log_figures, level, on_error
        self.history: dict[str, list[float]] = {}
        self.epochs: list[int] = []
        self.seconds: list[float] = []
        self.last_result: dict[str, Tensor] = {}
        self.errors: list[tuple[int, str]] = []
        self._warned_no_tensorboard = False
        self._handled_epoch: int | None = None
        self._first_epoch = 0

    # -- what a subclass customizes --------------------------------------------------
    def scalars(self, result: dict[str, Tensor]) -> dict[str, Tensor]:
        """The scalars to log, keyed without prefix.

        Default: every 0-d entry of ``result`` (of the keys in ``scalar_keys`` when
        set), and each entry ``i`` of a 1-d one as ``key/i`` (e.g. one p-value per
        dimension or per reference observation).
        """
        keys = result if self.scalar_keys is None else self.scalar_keys
        out: dict[str, Tensor] = {}
        for key in keys:
            value = result.get(key)
            if not isinstance(value, Tensor) or value.is_complex():
                continue
            if value.ndim == 0:
                out[key] = value
            elif value.ndim == 1:
                out.update({f"{key}/{i}": v for i, v in enumerate(value)})
        return out

    def figures(self, result: dict[str, Tensor]) -> dict[str, Figure]:
        """Figures to write, keyed by tag suffix. Default: the history of ``history_keys``.

        Called on rank zero only, and only when a TensorBoard logger will receive them.
        """
        keys = self.headline_keys()
        if not keys or not self.epochs:
            return {}
        title = f"{self.tag_name}: calibration over training"
        history = {k: self.history[k] for k in keys}
        return {"history": plot_history(self.epochs, history, level=self.level, title=title)}

    def verdict_key(self) -> str | None:
        """The history key the verdict of a check is read from, at ``level``.

        ``global_p_value`` when the metric reports one (several tests combined so that
        the verdict keeps its level), else a single ``p_value``; ``None`` if neither
        was logged.
        """
        for key in ("global_p_value", "p_value"):
            if key in self.history:
                return key
        return None

    def headline_keys(self) -> list[str]:
        """History keys whose first part is in ``history_keys``, in that order."""
        return sorted(  # stable: entries of one vector output stay together, in order
            (k for k in self.history if k.split("/")[0] in self.history_keys),
            key=lambda k: self.history_keys.index(k.split("/")[0]),
        )

    def histograms(self, result: dict[str, Tensor]) -> dict[str, Tensor]:
        """Tensors to write with ``add_histogram``, keyed by tag suffix. Default: none."""
        return {}

    def extra_results(self, trainer: Trainer, posterior: Posterior) -> dict[str, Tensor]:
        """More outputs computed from the posterior after the metric, in the same eval-mode,
        ``no_grad`` context (e.g. samples for a figure). Runs on every process. Default:
        none."""
        return {}

    def extra_state(self) -> dict[str, Any]:
        """More state to save with the checkpoint (besides histories and the metric's)."""
        return {}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`extra_state` saved."""

    # -- Lightning hooks ----------------------------------------------------------------
    @property
    def state_key(self) -> str:
        return self._generate_state_key(prefix=self.prefix, name=self.tag_name)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._first_epoch = trainer.current_epoch  # > 0 when resuming from a checkpoint
        self._handled_epoch = None

    def on_validation_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not trainer.sanity_checking:
            self._maybe_check(trainer, pl_module)

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._maybe_check(trainer, pl_module)  # epochs in which no validation ran

    def state_dict(self) -> dict[str, Any]:
        return {
            "history": {k: list(v) for k, v in self.history.items()},
            "epochs": list(self.epochs),
            "seconds": list(self.seconds),
            "errors": [list(error) for error in self.errors],
            "metric": self.metric.state_dict(),
            "extra": self.extra_state(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.history = {k: list(v) for k, v in state_dict["history"].items()}
        self.epochs = list(state_dict["epochs"])
        self.seconds = list(state_dict.get("seconds", []))
        self.errors = [(int(e), str(m)) for e, m in state_dict.get("errors", [])]
        self.metric.load_state_dict(state_dict["metric"])
        self.load_extra_state(state_dict.get("extra", {}))

    # -- the check ----------------------------------------------------------------------
    def _maybe_check(self, trainer: Trainer, pl_module: LightningModule) -> None:
        epoch = trainer.current_epoch
        if trainer.state.fn != TrainerFn.FITTING or self._handled_epoch == epoch:
            return
        self._handled_epoch = epoch
        if epoch == self._first_epoch or (epoch + 1) % self.every_n_epochs == 0:
            checks, start = len(self.epochs), time.perf_counter()
            try:
                self._check(trainer, pl_module)
            except Exception as error:
                if self.on_error == "raise" or isinstance(error, _SetupError):
                    raise
                self._fail(trainer, pl_module, error, recorded=len(self.epochs) > checks,
                           seconds=time.perf_counter() - start)  # fmt: skip

    def _fail(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        error: Exception,
        *,
        recorded: bool,
        seconds: float,
    ) -> None:
        """``on_error="warn"``: warn, log and record NaN, keep the history, train on."""
        epoch = trainer.current_epoch
        reason = f"{type(error).__name__}: {error}"
        self.errors.append((epoch, reason))
        what = ("its figures failed after the scalars were logged" if recorded
                else "failed and is recorded as NaN")  # fmt: skip
        warnings.warn(
            f"{type(self).__name__} ({self.tag_name}) check at epoch {epoch} {what}; "
            f"training goes on (on_error='raise' stops it). {reason}",
            RuntimeWarning,
            stacklevel=2,
        )
        self.last_result = {}
        if recorded:  # the scalars went out; a figure failed afterwards
            return
        keys = list(self.history) or list(self.history_keys)
        nan = torch.tensor(math.nan)
        pl_module.log_dict(
            {f"{self.prefix}/{self.tag_name}/{k}": nan for k in keys},
            on_step=False, on_epoch=True,
        )  # fmt: skip
        self._record(epoch, dict.fromkeys(keys, math.nan))
        self.seconds.append(seconds)

    def _check(self, trainer: Trainer, pl_module: LightningModule) -> dict[str, Tensor]:
        """Run the metric, log and record the result (all processes call it: the metric syncs)."""
        start = time.perf_counter()
        result = self._compute(trainer, pl_module)
        scalars = {k: v.detach().reshape(()) for k, v in self.scalars(result).items()}
        logged = {
            f"{self.prefix}/{self.tag_name}/{k}": _loggable(k, v) for k, v in scalars.items()
        }
        pl_module.log_dict(
            logged, on_step=False, on_epoch=True,
            sync_dist=True,  # equal on all ranks: mean is a no-op
        )  # fmt: skip
        self._record(trainer.current_epoch, {k: float(v) for k, v in scalars.items()})
        self.last_result = {k: v.detach().cpu() for k, v in result.items()}
        if self.log_figures and trainer.is_global_zero:
            self._write_figures(trainer, self.last_result)
        self.seconds.append(time.perf_counter() - start)
        return result

    def _compute(self, trainer: Trainer, pl_module: LightningModule) -> dict[str, Tensor]:
        estimator = self._find_estimator(pl_module)
        posterior = as_posterior(estimator)
        modules = dict.fromkeys(pl_module.modules())
        if isinstance(estimator, nn.Module):  # also when it lives outside the module
            modules.update(dict.fromkeys(estimator.modules()))
        modes = [(m, m.training) for m in modules]
        device = pl_module.device
        try:
            for m, _ in modes:
                m.training = False
            with torch.inference_mode(False), torch.no_grad():
                self.metric.to(device)
                self.metric.reset()
                for theta, x in self._local_batches(trainer, device, pl_module.dtype):
                    self.metric.update(posterior, theta, x)
                result = dict(self.metric.compute())
                result.update(self.extra_results(trainer, posterior))
                return result
        finally:
            for m, mode in modes:
                m.training = mode

    def _find_estimator(self, pl_module: LightningModule) -> Any:
        if callable(self.estimator) and not isinstance(self.estimator, str):
            return self.estimator(pl_module)
        try:
            return functools.reduce(getattr, self.estimator.split("."), pl_module)
        except AttributeError:
            children = [name for name, _ in pl_module.named_children()]
            raise _SetupError(
                f"estimator must name an attribute of {type(pl_module).__name__}, got "
                f"{self.estimator!r}; its submodules are {children}. Pass estimator='name' "
                "or a function pl_module -> estimator"
            ) from None

    def _local_batches(
        self, trainer: Trainer, device: torch.device, dtype: torch.dtype
    ) -> Iterator[tuple[Tensor, Tensor]]:
        """This process's share of the pairs, on the module's device and floating dtype."""

        def move(value: Tensor) -> Tensor:
            return value.to(device, dtype if value.is_floating_point() else None)

        rank, world = trainer.global_rank, trainer.world_size
        if self.dataloader is None:
            theta, x = self.theta[rank::world], self.x[rank::world]
            if theta.shape[0] == 0:
                raise _SetupError(
                    f"theta must have at least world_size = {world} rows to give every "
                    f"process a share, got {self.theta.shape[0]}"
                )
            size = self.batch_size or theta.shape[0]
            for start in range(0, theta.shape[0], size):
                yield move(theta[start : start + size]), move(x[start : start + size])
            return
        sharded = isinstance(getattr(self.dataloader, "sampler", None), DistributedSampler)
        for i, batch in enumerate(self.dataloader):
            if sharded or i % world == rank:
                if not (isinstance(batch, list | tuple) and len(batch) == 2):
                    raise _SetupError(
                        "dataloader must yield (theta, x) pairs, got a batch of type "
                        f"{type(batch).__name__}" + (f" of length {len(batch)}"
                                                     if isinstance(batch, list | tuple) else "")
                    )
                yield move(batch[0]), move(batch[1])

    def _record(self, epoch: int, scalars: dict[str, float]) -> None:
        checks = len(self.epochs)
        for key in scalars:
            if key not in self.history:
                self.history[key] = [math.nan] * checks
        for key, values in self.history.items():
            values.append(scalars.get(key, math.nan))
        self.epochs.append(epoch)

    def _write_figures(self, trainer: Trainer, result: dict[str, Tensor]) -> None:
        writers = [lg.experiment for lg in trainer.loggers if isinstance(lg, TensorBoardLogger)]
        if not writers:
            if not self._warned_no_tensorboard:
                kinds = [type(lg).__name__ for lg in trainer.loggers] or ["no logger"]
                rank_zero_warn(
                    f"{type(self).__name__} writes figures to a TensorBoardLogger only, got "
                    f"{', '.join(kinds)}; logging scalars only. Pass log_figures=False to "
                    "silence this."
                )
                self._warned_no_tensorboard = True
            return
        step = max(trainer.global_step - 1, 0)  # the step Lightning gives epoch-end scalars
        base = f"{self.prefix}/{self.tag_name}"
        for key, figure in self.figures(result).items():
            for writer in writers:
                writer.add_figure(f"{base}/{key}", figure, global_step=step, close=False)
            figure.clear()
        for key, values in self.histograms(result).items():
            for writer in writers:
                writer.add_histogram(f"{base}/{key}", values.detach().cpu(), global_step=step)


class _SetupError(ValueError):
    """A mistake in the callback's configuration: raised whatever ``on_error`` says."""


def _loggable(key: str, value: Tensor) -> Tensor:
    """float32 for the loggers; p-values floored at the smallest normal float32."""
    out = value.float()
    if key.split("/")[0].endswith("p_value"):
        out = out.clamp_min(torch.finfo(torch.float32).tiny)
    return out


def _describe(value: object) -> str:
    if isinstance(value, Tensor):
        return f"tensor of shape {tuple(value.shape)}"
    return "None" if value is None else type(value).__name__
