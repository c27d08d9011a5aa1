"""A Keras callback: the package's calibration checks while a Keras model trains (BayesFlow's
approximators train with Keras' ``fit``), on Keras' torch backend.

:class:`KerasCalibrationCallback` takes the package's Lightning calibration callbacks
(``cl.callbacks.RankCalibrationCallback(theta, x)``, ``TARPCallback``, ``LC2STNFCallback``,
...) as the description of each check: its metric, its held-out pairs, its tag names,
scalars and figures. Every ``every_n_epochs`` epochs (and after the first and the last) it
runs each on the model being trained (``cl.as_posterior(model)``) and writes what the
Lightning callback would log, under the same tags (``calibration/ranks/global_p_value``,
``calibration/ranks/ecdf``, ...), to TensorBoard through torch's ``SummaryWriter`` (step:
the epoch), and puts the scalars in Keras' ``logs`` so the Keras callbacks after it
(``History``, ``CSVLogger``, ``EarlyStopping``) see them.

Importing this module needs Keras 3 (``pip install "calib_lightning[bayesflow]"``).
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Sequence
from types import SimpleNamespace
from typing import Any

import torch

try:
    import keras
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError(
        "calib_lightning.keras needs Keras 3 (and, for BayesFlow, bayesflow on Keras' torch "
        'backend): pip install "calib_lightning[bayesflow]"'
    ) from error

from calib_lightning._utils.random import seeded
from calib_lightning.callbacks._plumbing import local_batches
from calib_lightning.callbacks._scalars import logged_scalars
from calib_lightning.callbacks._unnormalized import callback_posterior
from calib_lightning.callbacks.base import CalibrationCallback

__all__ = ["KerasCalibrationCallback"]


class KerasCalibrationCallback(keras.callbacks.Callback):
    """Run the package's calibration checks during Keras' ``fit`` and log them.

    Arguments:
        checks: Lightning calibration callbacks (:class:`~calib_lightning.callbacks.
            CalibrationCallback` subclasses) built with their held-out pairs; each says
            what to compute, its tags (``{prefix}/{name}/...``), scalars and figures.
            Their ``history``, ``epochs`` and ``last_result`` fill as in Lightning.
        log_dir: the TensorBoard folder (``None``: no TensorBoard, Keras' ``logs`` only).
        every_n_epochs: check after epochs ``k - 1, 2k - 1, ...`` (0-based), after the
            first and after the last of ``fit``.
        estimator: ``model -> estimator`` when the model is not itself what
            ``cl.as_posterior`` takes (default: the model, e.g. a BayesFlow approximator).
        on_error: ``"warn"`` (default: a failing check warns, logs NaN and training goes
            on) or ``"raise"``.

    Example:
        >>> from calib_lightning.callbacks import RankCalibrationCallback  # doctest: +SKIP
        >>> callback = KerasCalibrationCallback(
        ...     [RankCalibrationCallback(theta, x)], log_dir="runs/bf", every_n_epochs=5
        ... )  # doctest: +SKIP
        >>> approximator.fit(dataset=dataset, epochs=20, callbacks=[callback])  # doctest: +SKIP
    """

    def __init__(
        self,
        checks: Sequence[CalibrationCallback],
        log_dir: str | None = None,
        *,
        every_n_epochs: int = 1,
        estimator: Callable[[Any], Any] | None = None,
        on_error: str = "warn",
    ) -> None:
        super().__init__()
        checks = list(checks)
        bad = [type(c).__name__ for c in checks if not isinstance(c, CalibrationCallback)]
        if not checks or bad:
            raise ValueError(
                "checks must be calib_lightning calibration callbacks "
                f"(cl.callbacks.RankCalibrationCallback(theta, x), ...), got {bad or 'none'}"
            )
        if any(c.theta is None for c in checks):
            raise ValueError("checks must hold their held-out pairs as tensors theta and x")
        if not isinstance(every_n_epochs, int) or every_n_epochs < 1:
            raise ValueError(f"every_n_epochs must be a positive integer, got {every_n_epochs!r}")
        if on_error not in ("warn", "raise"):
            raise ValueError(f"on_error must be 'warn' or 'raise', got {on_error!r}")
        self.checks, self.log_dir, self.every_n_epochs = checks, log_dir, every_n_epochs
        self.estimator, self.on_error = estimator, on_error
        self._writer: Any = None

    @property
    def writer(self) -> Any:
        """torch's ``SummaryWriter`` at ``log_dir`` (``None`` without one)."""
        if self._writer is None and self.log_dir is not None:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(self.log_dir)
        return self._writer

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        last = epoch + 1 >= int((self.params or {}).get("epochs", 0) or 0)
        if not (epoch == 0 or last or (epoch + 1) % self.every_n_epochs == 0):
            return
        model = self.model if self.estimator is None else self.estimator(self.model)
        for check in self.checks:
            scalars = self._run(check, model, epoch)
            if logs is not None:
                logs.update({f"{check.prefix}/{check.tag_name}/{k}": v for k, v in scalars.items()})
        if self.writer is not None:
            self.writer.flush()

    def on_train_end(self, logs: dict | None = None) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def _run(self, check: CalibrationCallback, model: Any, epoch: int) -> dict[str, float]:
        """One check at ``epoch``: the scalars logged (floats, keyed without prefix)."""
        start = time.perf_counter()
        base = f"{check.prefix}/{check.tag_name}"
        stub = SimpleNamespace(is_global_zero=True, current_epoch=epoch, global_step=epoch)
        try:
            with seeded(check.seed, epoch):
                posterior = callback_posterior(model, check.prior)
                result, extras = self._compute(check, posterior, stub)
            check.last_extras = extras
            scalars = {k: v.detach().reshape(()) for k, v in check.scalars(result).items()}
            logged = {k: float(v) for k, v in logged_scalars(scalars).items()}
        except Exception as error:
            if self.on_error == "raise":
                raise
            warnings.warn(
                f"{type(check).__name__} ({check.tag_name}) check at epoch {epoch} failed and "
                f"is recorded as NaN; training goes on. {type(error).__name__}: {error}",
                RuntimeWarning,
                stacklevel=2,
            )
            check.errors.append((epoch, f"{type(error).__name__}: {error}"))
            keys = list(check.history) or list(check.history_keys)
            check._record(epoch, dict.fromkeys(keys, float("nan")), "fit")
            return dict.fromkeys(keys, float("nan"))
        check._record(epoch, {k: float(v) for k, v in scalars.items()}, "fit")
        check.last_result = result
        if self.writer is not None:
            for key, value in logged.items():
                self.writer.add_scalar(f"{base}/{key}", value, global_step=epoch)
            if check.log_figures:
                for key, figure in check.figures(result).items():
                    self.writer.add_figure(f"{base}/{key}", figure, global_step=epoch)
                for key, values in check.histograms(result).items():
                    self.writer.add_histogram(f"{base}/{key}", values.cpu(), global_step=epoch)
        check.seconds.append(time.perf_counter() - start)
        return logged

    @staticmethod
    def _compute(check: CalibrationCallback, posterior: Any, stub: Any) -> tuple[Any, dict]:
        device = posterior.device or torch.device("cpu")
        dtype = posterior.dtype or torch.float32
        with torch.no_grad():
            check.metric.to(device)
            check.metric.reset()
            pairs = (check.theta, check.x, None, check.batch_size)
            batches = local_batches(*pairs, rank=0, world=1, device=device, dtype=dtype)
            for theta, x in batches:
                check.metric.update(posterior, theta, x)
            result = check.metric.compute()
            return result, dict(check.extra_results(stub, posterior))
