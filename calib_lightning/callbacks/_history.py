"""What a calibration callback keeps of its checks: :class:`CheckHistory`.

One entry per check: the scalars it logged (``history``, keyed without prefix; ``nan``
where a key was missing or the check failed), its epoch, stage and wall-clock seconds,
and the error of a check that failed under ``on_error="warn"``. The record is saved with
the checkpoint and continues after a resume. It also says which keys are the callback's
headline (``history_keys``: the ``history`` figure and ``summary_table``) and which one
its verdict is read from (:meth:`CheckHistory.verdict_key`).
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

from lightning.pytorch import Callback

__all__ = ["CheckHistory"]


class CheckHistory(Callback):
    """The record of a callback's checks, saved with the checkpoint.

    For :class:`~calib_lightning.callbacks.CalibrationCallback`, whose docstring describes
    the attributes ``history``, ``epochs``, ``stages``, ``seconds`` and ``errors``; it
    appends one entry per check with :meth:`_record` (and ``seconds``, ``errors``).
    """

    #: history keys in the ``history`` figure (less ``unplotted_keys``) and the summary
    history_keys: ClassVar[tuple[str, ...]] = ("p_value",)

    def __init__(self) -> None:
        super().__init__()
        self.history: dict[str, list[float]] = {}
        self.epochs: list[int] = []
        self.stages: list[str] = []
        self.seconds: list[float] = []
        self.errors: list[tuple[int, str]] = []

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

    def state_dict(self) -> dict[str, Any]:
        return {
            "history": {k: list(v) for k, v in self.history.items()},
            "epochs": list(self.epochs),
            "stages": list(self.stages),
            "seconds": list(self.seconds),
            "errors": [list(error) for error in self.errors],
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.history = {k: list(v) for k, v in state_dict["history"].items()}
        self.epochs = list(state_dict["epochs"])
        self.stages = list(state_dict.get("stages", ["fit"] * len(self.epochs)))
        self.seconds = list(state_dict.get("seconds", []))
        self.errors = [(int(e), str(m)) for e, m in state_dict.get("errors", [])]

    def _record(self, epoch: int, scalars: dict[str, float], stage: str) -> None:
        checks = len(self.epochs)
        for key in scalars:
            if key not in self.history:
                self.history[key] = [math.nan] * checks
        for key, values in self.history.items():
            values.append(scalars.get(key, math.nan))
        self.epochs.append(epoch)
        self.stages.append(stage)
