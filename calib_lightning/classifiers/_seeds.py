r"""Random streams of the local C2STs, keyed by a seed, a stream number and the data.

Every random stream of a check (initialisation, validation split, batch order, class-0
normal draws) is seeded by

.. math::
    \mathrm{SeedSequence}(\text{seed}, \text{stream}, \text{check}, \mathrm{SHA256}(\text{data})),

with ``check`` a counter in the metric's ``state_dict`` advanced by every ``compute()``
(a resumed run continues the stream) and the digest of the data the classifiers are
trained on: two datasets never share classifier randomness, and the same data, seed and
counter reproduce the same result (why the p-value needs this: ``docs/design.md``,
"L-C2ST-NF: randomness and defaults").
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch
from torch import Tensor

from calib_lightning._utils.distributed import canonical_order

__all__ = ["digest", "digest_words", "fingerprint", "generator", "stream_seed"]


def stream_seed(seed: int, stream: int, *words: int) -> int:
    """Independent 31-bit seeds for the random streams (data draws, classifiers), keyed by
    ``words`` (check counter, data digest); 31 bits leave room for ``seed + k`` per member
    (scikit-learn's ``random_state`` must stay below ``2**32``)."""
    return int(np.random.SeedSequence([seed, stream, *words]).generate_state(1)[0]) >> 1


def generator(seed: int, stream: int, *words: int) -> torch.Generator:
    """A CPU generator seeded by :func:`stream_seed`."""
    return torch.Generator().manual_seed(stream_seed(seed, stream, *words))


def digest(data: bytes) -> Tensor:
    """SHA-256 of ``data`` as 32 ``uint8``."""
    return torch.frombuffer(bytearray(hashlib.sha256(data).digest()), dtype=torch.uint8).clone()


def fingerprint(x: Tensor) -> Tensor:
    """SHA-256 of the rows of ``x (N, *X)`` in canonical order, as 32 ``uint8``.

    A function of the values alone: any dtype is read as float64, and ``-0.0`` as ``0.0``
    (``x.round()`` and integer ``x`` give the same fingerprint).
    """
    rows = x.detach().reshape(x.shape[0], -1).cpu().double() + 0.0  # -0.0 + 0.0 == +0.0
    rows = rows[canonical_order(rows)].contiguous()
    return digest(str(tuple(rows.shape)).encode() + rows.numpy().tobytes())


def digest_words(*tensors: Tensor) -> list[int]:
    """The SHA-256 digest of ``tensors`` (each ``(N, C)``) as 8 unsigned 32-bit words, to
    key the random streams of a check by its data."""
    joined = b"".join(bytes(fingerprint(t).tolist()) for t in tensors)
    words = hashlib.sha256(joined).digest()
    return [int.from_bytes(words[i : i + 4], "little") for i in range(0, 32, 4)]
