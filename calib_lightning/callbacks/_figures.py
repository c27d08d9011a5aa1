"""Where a check's figures go: one small dispatch over Lightning's loggers.

Each logger of the trainer receives the figures the way it stores images:

* ``TensorBoardLogger``: ``add_figure`` (Images tab) and ``add_histogram``;
* ``WandbLogger``: ``log_image``;
* ``MLFlowLogger``: ``log_figure``, run artifacts ``{tag}/epoch=EEEE.png``;
* ``CometLogger``: ``log_figure``;
* any other logger (``CSVLogger``, ...), or none: PNG files
  ``{log_dir}/{tag}/epoch=EEEE.png``.

``tag`` is ``{prefix}/{name}/{figure}``, e.g. ``calibration/ranks/ecdf``; ``EEEE`` the
zero-padded epoch. A logger without a ``log_dir`` (and a trainer without logger) gets
its files under ``trainer.default_root_dir``. Histograms go to TensorBoard only; their
counts are drawn in the figures too (rank histograms), so nothing is lost elsewhere.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np
from lightning.pytorch import Trainer
from lightning.pytorch.loggers import (
    CometLogger,
    Logger,
    MLFlowLogger,
    TensorBoardLogger,
    WandbLogger,
)
from matplotlib.figure import Figure
from torch import Tensor

__all__ = ["FigureSink", "figure_sinks", "png_path", "write_figures"]


def png_path(root: str | os.PathLike, tag: str, epoch: int) -> Path:
    """``{root}/{tag}/epoch=EEEE.png``: one folder per figure, one file per check."""
    return Path(root, *tag.split("/"), f"epoch={epoch:04d}.png")


class FigureSink:
    """One destination of figures: writes a figure (and maybe a histogram) under a tag.

    Arguments:
        name: what it is, for messages (e.g. ``"TensorBoardLogger"``, ``"PNG files"``).
        figure: ``(tag, figure, step, epoch) -> None``.
        histogram: ``(tag, values, step, epoch) -> None``, or ``None`` where the logger
            has no histogram type.
    """

    def __init__(
        self,
        name: str,
        figure: Callable[[str, Figure, int, int], None],
        histogram: Callable[[str, Tensor, int, int], None] | None = None,
    ) -> None:
        self.name, self.figure, self.histogram = name, figure, histogram

    def __repr__(self) -> str:
        return f"FigureSink({self.name})"


def _rgb(figure: Figure) -> np.ndarray:
    figure.canvas.draw()
    return np.asarray(figure.canvas.buffer_rgba())[..., :3].copy()


def _files(root: str | os.PathLike) -> FigureSink:
    def write(tag: str, figure: Figure, step: int, epoch: int) -> None:
        path = png_path(root, tag, epoch)
        path.parent.mkdir(parents=True, exist_ok=True)
        figure.savefig(path, dpi=100)

    return FigureSink(f"PNG files under {root}", write)


def _sink(logger: Logger, fallback_root: str | os.PathLike) -> FigureSink:
    if isinstance(logger, TensorBoardLogger):
        writer = logger.experiment
        return FigureSink(
            "TensorBoardLogger",
            lambda tag, fig, step, epoch: writer.add_figure(
                tag, fig, global_step=step, close=False
            ),
            lambda tag, values, step, epoch: writer.add_histogram(tag, values, global_step=step),
        )
    if isinstance(logger, WandbLogger):
        return FigureSink(
            "WandbLogger",
            lambda tag, fig, step, epoch: logger.log_image(key=tag, images=[_rgb(fig)], step=step),
        )
    if isinstance(logger, MLFlowLogger):
        return FigureSink(
            "MLFlowLogger",
            lambda tag, fig, step, epoch: logger.experiment.log_figure(
                logger.run_id, fig, f"{tag}/epoch={epoch:04d}.png"
            ),
        )
    if isinstance(logger, CometLogger):
        return FigureSink(
            "CometLogger",
            lambda tag, fig, step, epoch: logger.experiment.log_figure(
                figure_name=tag, figure=fig, step=step
            ),
        )
    root = getattr(logger, "log_dir", None) or fallback_root
    return _files(root)


def figure_sinks(trainer: Trainer) -> list[FigureSink]:
    """One sink per logger of ``trainer``; PNG files under ``default_root_dir`` without one."""
    fallback = trainer.default_root_dir
    sinks = [_sink(logger, fallback) for logger in trainer.loggers]
    return sinks or [_files(fallback)]


def write_figures(
    trainer: Trainer, base: str, figures: Mapping[str, Figure], histograms: Mapping[str, Tensor]
) -> None:
    """Send a check's figures and histograms, tagged ``{base}/{key}``, to every logger."""
    sinks = figure_sinks(trainer)
    step = max(trainer.global_step - 1, 0)  # the step Lightning gives epoch-end scalars
    for key, figure in figures.items():
        for sink in sinks:
            sink.figure(f"{base}/{key}", figure, step, trainer.current_epoch)
        figure.clear()
    for key, values in histograms.items():
        for sink in sinks:
            if sink.histogram is not None:
                sink.histogram(f"{base}/{key}", values.detach().cpu(), step, trainer.current_epoch)
