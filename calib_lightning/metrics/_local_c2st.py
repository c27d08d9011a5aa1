r"""Machinery shared by the L-C2ST metrics: settings, per-check seeds, canonical order, output.

**Randomness.** A local C2ST p-value is valid when the observed statistic and the null
statistics are exchangeable under :math:`H_0`. Each statistic depends on the data *and*
on the classifier's own randomness :math:`\xi` (initialisation, validation split, batch
order, class-0 normal draws). If the observed classifier's :math:`\xi` is the same at
every check while the null classifiers' vary, the p-value is conditional on that one
:math:`\xi` and not uniform over datasets: a classifier that happens to stop late
overfits at every check and rejects too often, one that stops early never rejects. So
every random stream of a check is seeded by

.. math::
    \mathrm{SeedSequence}(\text{seed}, \text{stream}, \text{check}, \mathrm{SHA256}(\text{data})),

with ``check`` a counter in the ``state_dict`` advanced by every ``compute()`` (a
resumed run continues the stream) and the digest of the data the classifiers are
trained on. Two datasets never share classifier randomness, even through fresh
metrics built with the same seed (one check per model, the common case), and the same
data, seed and counter reproduce the same result.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import torch
from torch import Tensor

from calib_lightning._checks import check_matrix, check_positive, check_probability
from calib_lightning._distributed import canonical_order
from calib_lightning.classifiers import make_ensemble
from calib_lightning.functional.combine import combine_p_values
from calib_lightning.functional.lc2st import lc2st_p_value, lc2st_statistic, pp_band, pp_ecdf
from calib_lightning.metrics._shapes import KeepShapes

__all__ = [
    "LocalC2ST",
    "check_observations",
    "digest_words",
    "fingerprint",
]


def _stream_seed(seed: int, stream: int, *words: int) -> int:
    """Independent 31-bit seeds for the random streams (data draws, classifiers), keyed by
    ``words`` (check counter, data digest); 31 bits leave room for ``seed + k`` per member
    (scikit-learn's ``random_state`` must stay below ``2**32``)."""
    return int(np.random.SeedSequence([seed, stream, *words]).generate_state(1)[0]) >> 1


def _digest(data: bytes) -> Tensor:
    return torch.frombuffer(bytearray(hashlib.sha256(data).digest()), dtype=torch.uint8).clone()


def digest_words(*tensors: Tensor) -> list[int]:
    """The SHA-256 digest of ``tensors`` (each ``(N, C)``, rows in canonical order) as 8
    unsigned 32-bit words, to key the random streams of a check by its data."""
    digest = b"".join(bytes(fingerprint(t).tolist()) for t in tensors)
    digest = hashlib.sha256(digest).digest()
    return [int.from_bytes(digest[i : i + 4], "little") for i in range(0, 32, 4)]


def fingerprint(x: Tensor) -> Tensor:
    """SHA-256 of the calibration observations (rows in canonical order), as 32 ``uint8``.

    A function of the values alone: any dtype is read as float64, and ``-0.0`` as ``0.0``
    (``x.round()`` and integer ``x`` give the same fingerprint).
    """
    rows = x.detach().reshape(x.shape[0], -1).cpu().double() + 0.0  # -0.0 + 0.0 == +0.0
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


class LocalC2ST(KeepShapes):
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
        seed: int | None = 0,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        check_observations(observations)
        if seed is None:  # fresh entropy: valid, not reproducible
            seed = int(np.random.SeedSequence().entropy) % 2**63
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed must be a non-negative integer or None, got {seed!r}")
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
        # checks run so far: keys the random streams of the next one (saved and restored)
        self.register_buffer("checks", torch.zeros((), dtype=torch.long))
        self._warned = False

    def _load_from_state_dict(self, state_dict: dict, prefix: str, *args: Any) -> None:
        state_dict.setdefault(prefix + "checks", self.checks.clone())  # older checkpoints
        super()._load_from_state_dict(state_dict, prefix, *args)

    def _ensemble(self, members: int, stream: int, key: list[int] | None = None) -> Any:
        """``members`` classifiers seeded by stream ``stream`` and the data key ``key``."""
        return make_ensemble(
            self.classifier_spec,
            members,
            _stream_seed(self.seed, stream, *(key or [])),
            **self.classifier_kwargs,
        )

    def settings_fingerprint(self) -> Tensor:
        """SHA-256 of what a null must share with the check it serves: classifier settings,
        ensemble size and evaluation points (not the seed)."""
        kwargs = sorted(self.classifier_kwargs.items())
        text = f"{self.classifier_spec!r}|{kwargs}|{self.num_ensemble}|{self.num_eval}"
        return _digest(text.encode())

    def _generator(self, stream: int, key: list[int] | None = None) -> torch.Generator:
        return torch.Generator().manual_seed(_stream_seed(self.seed, stream, *(key or [])))

    def _check_key(self, *data: Tensor) -> list[int]:
        """Key of this check's random streams: the counter and the digest of ``data``."""
        return [int(self.checks), *digest_words(*data)]

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
        p_value = lc2st_p_value(statistic, null_statistics)
        self.checks += 1  # the next check draws fresh classifier randomness
        return {
            "statistic": statistic,
            "p_value": p_value,
            "global_p_value": combine_p_values(p_value, dim=-1).to(p_value.dtype),
            "probabilities": probabilities,
            "null_statistics": null_statistics,
            "pp_grid": self.pp_grid,
            "pp_ecdf": pp_ecdf(probabilities, self.pp_grid),
            "pp_band": pp_band(null_ecdf, self.confidence),
        }
