"""Seeded, isolated randomness for ``cl.diagnose`` and the calibration callbacks.

Posterior sampling runs through the estimator's own code (``flow(x).sample``, nflows,
sbi), which draws from torch's global generators. :func:`seeded` runs such code with
those generators forked and seeded from a seed and a few integer words (the check, the
epoch, the step), then restores them: the same seed gives the same numbers, and the
caller's random stream (a training run, a notebook) is left exactly where it was.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import numpy as np
import torch
from torch import Tensor

__all__ = ["cuda_devices", "derived_seed", "seeded"]


def derived_seed(seed: int, *words: int) -> int:
    """A 31-bit seed keyed by ``seed`` and ``words`` (independent streams for distinct keys)."""
    return int(np.random.SeedSequence([int(seed), *map(int, words)]).generate_state(1)[0]) >> 1


def cuda_devices(*objects: object) -> list[torch.device]:
    """The CUDA devices of ``objects``: tensors, devices, or modules (their parameters and
    buffers; a posterior adapter's ``module``)."""
    found: dict[torch.device, None] = {}

    def visit(obj: object) -> None:
        if isinstance(obj, torch.device):
            if obj.type == "cuda":
                found[torch.device("cuda", obj.index or 0)] = None
        elif isinstance(obj, Tensor):
            visit(obj.device)
        elif isinstance(obj, torch.nn.Module):
            for tensor in (*obj.parameters(), *obj.buffers()):
                visit(tensor.device)
        elif hasattr(obj, "module"):  # a Posterior adapter, or a wrapper of one
            visit(obj.module)
        elif isinstance(obj, Iterable) and not isinstance(obj, str | bytes):
            for item in obj:
                visit(item)

    for obj in objects:
        if obj is not None:
            visit(obj)
    return list(found)


@contextmanager
def seeded(seed: int, *words: int, devices: Iterable[torch.device] = ()) -> Iterator[int]:
    """Run the block with the global generators seeded from ``(seed, *words)``; restore them.

    Forks and seeds torch's CPU generator and those of the CUDA ``devices`` (other CUDA
    devices are neither seeded nor touched), numpy's and Python's global generators.
    Yields the derived seed, for explicit generators inside the block.
    """
    derived = derived_seed(seed, *words)
    devices = [torch.device(d) for d in devices]
    # numpy's legacy global state is what third-party code (scikit-learn) draws from
    python_state, numpy_state = random.getstate(), np.random.get_state()  # noqa: NPY002
    with torch.random.fork_rng(devices=[d.index or 0 for d in devices]):
        torch.random.default_generator.manual_seed(derived)
        for device in devices:
            with torch.cuda.device(device):
                torch.cuda.manual_seed(derived)
        random.seed(derived)
        np.random.seed(derived)  # noqa: NPY002
        try:
            yield derived
        finally:
            random.setstate(python_state)
            np.random.set_state(numpy_state)  # noqa: NPY002
