"""Plumbing of the calibration callbacks: sharding the pairs, scalars for the loggers."""

from __future__ import annotations

import contextlib
import functools
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor, nn
from torch.utils.data import DistributedSampler, Subset, TensorDataset

from calib_lightning._utils.random import cuda_devices, seeded
from calib_lightning._utils.validation import check_pairs
from calib_lightning.evaluation import (
    SharedDraws,
    check_fits,
    release_shared_draws,
    shared_draws_for,
)
from calib_lightning.posteriors import Posterior
from calib_lightning.results import Result, expand_scalars

__all__ = [
    "COST_WARNING_FRACTION",
    "STAGES",
    "CostWarning",
    "DrawSharing",
    "SetupCheck",
    "SetupError",
    "check_data",
    "cost_words",
    "describe",
    "epoch_check_seconds",
    "eval_mode",
    "find_estimator",
    "find_part",
    "last_epoch",
    "local_batches",
    "seeded_check",
    "share_draws",
    "tensor_scalars",
    "to_cpu",
]


#: the Trainer stages a callback can check in (``check_on``)
STAGES = ("fit", "validate", "test")


class SetupError(ValueError):
    """A mistake in the callback's configuration: raised whatever ``on_error`` says."""


def check_data(theta: Tensor | None, x: Tensor | None, dataloader: Iterable[Any] | None) -> None:
    """Raise unless the calibration data is given once: tensors ``theta`` and ``x``
    (checked as pairs, ``N >= 2``) or a ``dataloader``."""
    if (dataloader is None) == (theta is None and x is None):
        raise ValueError(
            "pass the calibration data either as tensors theta and x or as a dataloader, "
            f"got theta={describe(theta)}, x={describe(x)}, dataloader={describe(dataloader)}"
        )
    if dataloader is None:
        if theta is None or x is None:
            raise ValueError(
                f"theta and x must both be given, got theta={describe(theta)}, x={describe(x)}"
            )
        check_pairs(theta, x, min_rows=2)


def seeded_check(
    seed: int, trainer: Trainer, pl_module: LightningModule, stage: str
) -> contextlib.AbstractContextManager[int]:
    """The random state of one check: torch's (CPU and the module's CUDA device), numpy's
    and Python's global generators forked and seeded from ``seed``, the stage, the epoch,
    the global step and the process rank (:func:`calib_lightning._utils.random.seeded`)."""
    words = (STAGES.index(stage), trainer.current_epoch, trainer.global_step, trainer.global_rank)
    return seeded(seed, *words, devices=cuda_devices(pl_module.device))


@contextlib.contextmanager
def eval_mode(pl_module: nn.Module, estimator: Any) -> Iterator[None]:
    """Every submodule of ``pl_module`` and of ``estimator`` (when it is a module living
    outside it) in eval mode; each gets its own mode back afterwards."""
    modules = dict.fromkeys(pl_module.modules())
    if isinstance(estimator, nn.Module):
        modules.update(dict.fromkeys(estimator.modules()))
    modes = [(m, m.training) for m in modules]
    try:
        for m, _ in modes:
            m.training = False
        yield
    finally:
        for m, mode in modes:
            m.training = mode


def find_estimator(pl_module: Any, estimator: str | Callable[[Any], Any]) -> Any:
    """The estimator of ``pl_module``: a dotted attribute path, or a function of the module."""
    return find_part(pl_module, estimator, "estimator")


def find_part(pl_module: Any, spec: Any, name: str) -> Any:
    """A part of ``pl_module`` given as a module itself, a dotted attribute path
    (``"net.flow"``) or a function ``pl_module -> part``; ``name`` is the argument's name."""
    if isinstance(spec, nn.Module):
        return spec
    if callable(spec) and not isinstance(spec, str):
        return spec(pl_module)
    try:
        return functools.reduce(getattr, spec.split("."), pl_module)
    except AttributeError:
        children = [child for child, _ in pl_module.named_children()]
        raise SetupError(
            f"{name} must name an attribute of {type(pl_module).__name__}, got {spec!r}; "
            f"its submodules are {children}. Pass {name}='name' or a function "
            f"pl_module -> {name}"
        ) from None


def local_batches(
    theta: Tensor | None,
    x: Tensor | None,
    dataloader: Iterable[Any] | None,
    batch_size: int | None,
    *,
    rank: int,
    world: int,
    device: torch.device,
    dtype: torch.dtype,
    shared: SharedDraws | None = None,
) -> Iterator[tuple[Tensor, Tensor]]:
    """Process ``rank``'s share of the pairs, on ``device`` and in the floating ``dtype``.

    With ``shared`` draws and tensors, the batches are made once per check for all callers
    holding the same data (:meth:`~calib_lightning.evaluation.SharedDraws.batches`), so
    that their draws are shared.

    Tensors: rows ``rank, rank + world, ...`` in batches of ``batch_size`` (``None``: one
    batch). A dataloader: its batch ``i`` when ``i mod world == rank``, or every batch when
    it already has a ``DistributedSampler``.
    """

    if shared is not None and dataloader is None:
        key = (theta, x, batch_size, rank, world, device, dtype)
        make = functools.partial(
            local_batches,
            theta,
            x,
            None,
            batch_size,
            rank=rank,
            world=world,
            device=device,
            dtype=dtype,
        )
        yield from shared.batches(key, make)
        return

    def move(value: Tensor) -> Tensor:
        return value.to(device, dtype if value.is_floating_point() else None)

    if dataloader is None:
        if theta is None or x is None:
            raise SetupError("theta and x must be given when there is no dataloader")
        share_theta, share_x = theta[rank::world], x[rank::world]
        if share_theta.shape[0] == 0:
            raise SetupError(
                f"theta must have at least world_size = {world} rows to give every "
                f"process a share, got {theta.shape[0]}"
            )
        size = batch_size or share_theta.shape[0]
        for start in range(0, share_theta.shape[0], size):
            yield move(share_theta[start : start + size]), move(share_x[start : start + size])
        return
    sharded = isinstance(getattr(dataloader, "sampler", None), DistributedSampler)
    for i, batch in enumerate(dataloader):
        if sharded or i % world == rank:
            if not (isinstance(batch, list | tuple) and len(batch) == 2):
                length = f" of length {len(batch)}" if isinstance(batch, list | tuple) else ""
                raise SetupError(
                    "dataloader must yield (theta, x) pairs, got a batch of type "
                    f"{type(batch).__name__}{length}"
                )
            yield move(batch[0]), move(batch[1])


def tensor_scalars(values: Result | dict[str, Tensor]) -> dict[str, Tensor]:
    """Every real 0-d tensor of ``values`` as ``key``, every 1-d one as ``key/i``."""
    return expand_scalars(values.items())


def to_cpu(result: Any) -> Any:
    """A result (or a dict of tensors) detached and on the CPU."""
    if isinstance(result, Result):
        return result.apply(lambda v: v.detach().cpu())
    return {k: v.detach().cpu() if isinstance(v, Tensor) else v for k, v in result.items()}


def describe(value: object) -> str:
    if isinstance(value, Tensor):
        return f"tensor of shape {tuple(value.shape)}"
    return "None" if value is None else type(value).__name__


def last_epoch(trainer: Trainer, stopping: bool = False) -> bool:
    """Whether the current epoch is the last of ``fit``: ``max_epochs`` reached, or (at the
    end of the training epoch, ``stopping=True``) ``max_steps`` reached or a stop requested
    (``EarlyStopping``, ``Timer``)."""
    epoch, max_epochs = trainer.current_epoch, trainer.max_epochs
    if max_epochs is not None and max_epochs >= 0 and epoch + 1 >= max_epochs:
        return True
    if not stopping:
        return False
    max_steps = trainer.max_steps
    return trainer.should_stop or (max_steps is not None and 0 <= max_steps <= trainer.global_step)


def selecting_monitors(trainer: Trainer, theta: Tensor) -> list[str]:
    """What the trainer's ``EarlyStopping`` and ``ModelCheckpoint`` callbacks monitor, when
    its validation data hold ``theta`` (a ``TensorDataset`` or a ``Subset`` of one): those
    pairs then chose the model kept, so it fits them better than new pairs. Empty if not."""
    chosen_by = [*trainer.early_stopping_callbacks, *trainer.checkpoint_callbacks]
    monitors = [c.monitor for c in chosen_by if getattr(c, "monitor", None)]
    loaders = trainer.val_dataloaders
    if isinstance(loaders, dict):
        loaders = list(loaders.values())
    elif not isinstance(loaders, (list, tuple)):
        loaders = [] if loaders is None else [loaders]
    if monitors and any(_holds(getattr(loader, "dataset", None), theta) for loader in loaders):
        return monitors
    return []


def _holds(dataset: Any, theta: Tensor) -> bool:
    rows = None
    if isinstance(dataset, Subset):
        dataset, rows = dataset.dataset, list(dataset.indices)
    if not isinstance(dataset, TensorDataset):
        return False
    for tensor in dataset.tensors:
        tensor = tensor if rows is None else tensor[rows]
        if tensor.shape == theta.shape and torch.equal(tensor.to(theta), theta):
            return True
    return False


def share_draws(
    trainer: Trainer,
    pl_module: LightningModule,
    estimator: Any,
    posterior: Posterior,
    tensors: bool,
) -> SharedDraws | None:
    """The trainer's :class:`~calib_lightning.evaluation.SharedDraws` for this check (one
    per stage, epoch, step, estimator and parameter values), or ``None`` when the callback's
    data are not ``tensors`` (a dataloader: nothing to share) or fewer than two calibration
    callbacks are attached."""
    if not tensors or sum(isinstance(c, DrawSharing) for c in trainer.callbacks) < 2:
        return None
    key = (trainer.state.fn, trainer.current_epoch, trainer.global_step)
    return shared_draws_for(trainer, key, estimator, posterior, pl_module)


class DrawSharing(Callback):
    """Drops the trainer's shared draws when a check epoch is over: before the next training
    epoch changes the parameters, and at the end of ``fit``, ``validate`` and ``test``."""

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        release_shared_draws(trainer)

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        release_shared_draws(trainer)

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.state.fn != TrainerFn.FITTING:  # in fit, a last check may follow
            release_shared_draws(trainer)

    def on_test_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        release_shared_draws(trainer)


#: a check in ``fit`` longer than this fraction of its epoch's training warns, once per callback
COST_WARNING_FRACTION = 0.25


def cost_words(seconds: float, epoch: float) -> str:
    """How a check of ``seconds`` compares with an epoch's training of ``epoch`` seconds.

    Example:
        >>> for seconds in (3.0, 10.4, 24.0, 9400.0):
        ...     print(cost_words(seconds, 10.0))
        30% of an epoch's training
        about as long as an epoch's training
        2.4x an epoch's training
        940x an epoch's training
    """
    if epoch <= 0:
        return "longer than an epoch's training"
    ratio = seconds / epoch
    if ratio < 0.9:
        return f"{ratio:.0%} of an epoch's training"
    if ratio < 1.15:
        return "about as long as an epoch's training"
    return f"{ratio:{'.2g' if ratio < 10 else '.0f'}}x an epoch's training"


class CostWarning(Callback):
    """Warns once per callback when a check in ``fit`` costs more than
    :data:`COST_WARNING_FRACTION` of its epoch's training, giving both numbers: an
    expensive estimator (ODE log-densities of sbi's FMPE and NPSE, spline flows drawn
    many times) can make the checks the larger part of training.

    The epoch's training is the time from the training epoch's start to the check
    (training, validation, other callbacks) less the checks of every calibration
    callback of the trainer that ran before it in that epoch: each check is compared
    with the same training time, whatever the callbacks' order.
    """

    _epoch_start: float | None = None
    #: seconds of this callback's checks in ``fit`` since its epoch started
    epoch_check_seconds = 0.0
    cost_warned = False

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        super().on_train_epoch_start(trainer, pl_module)
        self._epoch_start = time.perf_counter()
        self.epoch_check_seconds = 0.0

    def add_check_seconds(self, seconds: float, stage: str) -> None:
        """Count a check of ``seconds`` in ``stage`` towards this epoch's checks."""
        if stage == "fit":
            self.epoch_check_seconds += seconds

    def warn_cost(self, started: float, seconds: float, stage: str, checks: float = 0.0) -> None:
        """Warn (once) if a check that started at ``started`` (``time.perf_counter``) and
        took ``seconds`` in stage ``stage`` cost a large part of its epoch's training;
        ``checks``: the seconds of calibration checks (of any callback) that ran in this
        epoch before it (:func:`epoch_check_seconds`), which are not training."""
        if self.cost_warned or stage != "fit" or self._epoch_start is None:
            return
        epoch = started - self._epoch_start - checks
        if seconds <= COST_WARNING_FRACTION * epoch:
            return
        self.cost_warned = True
        warnings.warn(
            f"{type(self).__name__} ({getattr(self, 'tag_name', '')}): one check took "
            f"{seconds:.3g} s, {cost_words(seconds, epoch)} ({max(epoch, 0.0):.3g} s: "
            "training and validation, the calibration checks excluded). On an expensive "
            "estimator, check less often (every_n_epochs), with fewer draws "
            "(num_posterior_samples) or fewer pairs; this warning is shown once.",
            RuntimeWarning,
            stacklevel=2,
        )


def epoch_check_seconds(trainer: Trainer) -> float:
    """Seconds spent in ``fit`` checks of the trainer's calibration callbacks since their
    training epoch started."""
    return sum(c.epoch_check_seconds for c in trainer.callbacks if isinstance(c, CostWarning))


class SetupCheck(Callback):
    """Checks the calibration data against the module's estimator at the start of each
    stage in ``check_on``, so that a mistake fails at once, not at the first check.

    For :class:`~calib_lightning.callbacks.CalibrationCallback` (its ``check_on``,
    ``metric``, ``_find_estimator`` and ``_local_batches``).
    """

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if "fit" in self.check_on:
            self.check_setup(trainer, pl_module)

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.state.fn == TrainerFn.VALIDATING and "validate" in self.check_on:
            self.check_setup(trainer, pl_module)

    def on_test_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if "test" in self.check_on:
            self.check_setup(trainer, pl_module)

    def check_setup(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Raise now if the calibration data do not fit the module's estimator.

        The first batch of this process's pairs (and the metric's ``observations``, if it
        has some) go through :func:`~calib_lightning.evaluation.check_fits`: ``theta``'s
        width against ``D``, ``x``'s shape against the context, the observations' shape
        against ``x``; one ``log_prob`` at two pairs (a draw, with the random state forked,
        for a samples-only estimator), in eval mode. Its ``ValueError`` is the one the
        metric would raise at the first check, raised whatever ``on_error``; other errors
        are left to the check.
        """
        estimator = self._find_estimator(pl_module)
        batches = self._local_batches(trainer, pl_module.device, pl_module.dtype)
        batch = next(iter(batches), None)
        if batch is None:
            return
        observations = getattr(self.metric, "observations", None)
        observations = observations if isinstance(observations, Tensor) else None
        with eval_mode(pl_module, estimator):
            try:
                check_fits(estimator, *batch, observations=observations)
            except ValueError:
                raise
            except Exception:  # not a mistake in the data: the check reports it
                return
