"""Machinery shared by the L-C2ST metrics: settings, seeds, canonical order, PP-plot output."""

from __future__ import annotations

import hashlib
import warnings
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torchmetrics import Metric

from calib_lightning._checks import check_matrix, check_positive, check_probability
from calib_lightning.classifiers import make_ensemble
from calib_lightning.functional.lc2st import lc2st_p_value, lc2st_statistic, pp_band, pp_ecdf

__all__ = ["LocalC2ST", "canonical_order", "check_observations", "fingerprint"]


def _stream_seed(seed: int, stream: int) -> int:
    """Independent seeds for the metric's random streams (data draws, classifiers)."""
    return int(np.random.SeedSequence([seed, stream]).generate_state(1)[0]) >> 1


def canonical_order(rows: Tensor) -> Tensor:
    """Lexicographic row order of ``rows (N, C)``, independent of arrival order (DDP)."""
    order = torch.arange(rows.shape[0], device=rows.device)
    for column in reversed(range(rows.shape[1])):
        order = order[torch.sort(rows[order, column], stable=True).indices]
    return order


def _digest(data: bytes) -> Tensor:
    return torch.frombuffer(bytearray(hashlib.sha256(data).digest()), dtype=torch.uint8).clone()


def fingerprint(x: Tensor) -> Tensor:
    """SHA-256 of the calibration observations (rows in canonical order), as 32 ``uint8``."""
    rows = x.detach().reshape(x.shape[0], -1).cpu().double()
    rows = rows[canonical_order(rows)].contiguous()
    return _digest(str(tuple(rows.shape)).encode() + rows.numpy().tobytes())


def check_observations(observations: Tensor, features: int | None = None) -> Tensor:
    """Reference observations ``(O, *X)`` (with ``X`` = ``features`` when given), as ``(O, X)``."""
    width = observations.shape[1:].numel() if isinstance(observations, Tensor) else None
    if width is None or observations.ndim < 2 or features not in (None, width):
        got = tuple(observations.shape) if isinstance(observations, Tensor) else observations
        expected = "(O, X) or (O, *X)" if features is None else f"(O, *X) with {features} features"
        raise ValueError(f"observations must have shape {expected}, got {got}")
    return check_matrix("observations", observations.reshape(observations.shape[0], width))


class LocalC2ST(Metric):
    """Shared machinery: reference observations, classifier settings, PP-plot output."""

    is_differentiable = False
    higher_is_better = False
    full_state_update = False

    def __init__(
        self,
        observations: Tensor,
        num_null: int = 100,
        num_eval: int = 10_000,
        num_ensemble: int = 1,
        classifier: str | Any = "mlp",
        classifier_kwargs: dict[str, Any] | None = None,
        max_samples: int = 100_000,
        confidence: float = 0.95,
        seed: int = 0,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        check_observations(observations)
        for name, value in (
            ("num_null", num_null),
            ("num_eval", num_eval),
            ("num_ensemble", num_ensemble),
            ("max_samples", max_samples),
        ):
            check_positive(name, value, integer=True)
        check_probability("confidence", confidence)
        self.num_null, self.num_eval, self.num_ensemble = num_null, num_eval, num_ensemble
        self.classifier_spec, self.classifier_kwargs = classifier, dict(classifier_kwargs or {})
        self.max_samples, self.confidence, self.seed = max_samples, confidence, seed
        make_ensemble(classifier, 1, **self.classifier_kwargs)  # validate the specification
        self.register_buffer("observations", observations.detach().clone())
        self.register_buffer(
            "pp_grid", torch.linspace(0, 1, 101, dtype=observations.dtype), persistent=False
        )
        self._warned = False

    def _ensemble(self, members: int, stream: int) -> Any:
        return make_ensemble(
            self.classifier_spec, members, _stream_seed(self.seed, stream), **self.classifier_kwargs
        )

    def settings_fingerprint(self) -> Tensor:
        """SHA-256 of what a null must share with the check it serves: classifier settings,
        ensemble size and evaluation points (not the seed)."""
        kwargs = sorted(self.classifier_kwargs.items())
        text = f"{self.classifier_spec!r}|{kwargs}|{self.num_ensemble}|{self.num_eval}"
        return _digest(text.encode())

    def _generator(self, stream: int) -> torch.Generator:
        return torch.Generator().manual_seed(_stream_seed(self.seed, stream))

    @property
    def flat_observations(self) -> Tensor:
        """The reference observations as classifier features, ``(O, X)``."""
        return self.observations.reshape(self.observations.shape[0], -1)

    def _check_features(self, x: Tensor) -> Tensor:
        """``x (N, *X)`` flattened to ``(N, X)`` with ``X`` the observations' width."""
        flat = x.reshape(x.shape[0], -1)
        if flat.shape[1] != self.flat_observations.shape[1]:
            raise ValueError(
                f"x must have X = {self.flat_observations.shape[1]} features like observations, "
                f"got shape {tuple(x.shape)}"
            )
        return flat

    def _room(self, stored: list[Tensor], incoming: int) -> int:
        """Rows of the next batch that fit under ``max_samples``; warn once when cut."""
        room = self.max_samples - sum(t.shape[0] for t in stored)
        if room < incoming and not self._warned:
            warnings.warn(
                f"{type(self).__name__} keeps at most max_samples={self.max_samples} pairs per "
                f"process; {incoming - max(room, 0)} further pairs are ignored",
                stacklevel=3,
            )
            self._warned = True
        return max(room, 0)

    def reset(self) -> None:
        super().reset()
        self._warned = False

    def forward(self, *args: Any, **kwargs: Any) -> None:
        """Accumulate the batch (as :meth:`update`); a per-batch test would need its own null."""
        self.update(*args, **kwargs)

    def _result(
        self, probabilities: Tensor, null_statistics: Tensor, null_ecdf: Tensor
    ) -> dict[str, Tensor]:
        statistic = lc2st_statistic(probabilities)
        return {
            "statistic": statistic,
            "p_value": lc2st_p_value(statistic, null_statistics),
            "probabilities": probabilities,
            "null_statistics": null_statistics,
            "pp_grid": self.pp_grid,
            "pp_ecdf": pp_ecdf(probabilities, self.pp_grid),
            "pp_band": pp_band(null_ecdf, self.confidence),
        }
