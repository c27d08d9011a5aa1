"""Keep the documented shapes of a metric's result through torchmetrics' ``compute`` wrapper.

torchmetrics squeezes every one-element tensor a ``compute()`` returns, so a
per-dimension output documented as ``(D,)`` comes back as ``()`` when ``D = 1`` (and a
per-observation ``(O,)`` as ``()`` when ``O = 1``). :class:`KeepShapes` records the
shapes ``compute()`` produced and restores them after the wrapper. torchmetrics has no
public switch for the squeeze, so this overrides its compute wrapper (``_wrap_compute``),
the one place where the squeezed value can be reached.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

from torch import Tensor
from torchmetrics import Metric

from calib_lightning.results import Result

__all__ = ["KeepShapes"]


class KeepShapes(Metric):
    """A ``Metric`` whose ``compute()`` result (a :class:`~calib_lightning.results.Result`
    or a dict) keeps each tensor's shape (no squeezing)."""

    _result_shapes: dict[str, Any]

    def _wrap_compute(self, compute: Callable) -> Callable:
        @functools.wraps(compute)
        def recording(*args: Any, **kwargs: Any) -> Any:
            out = compute(*args, **kwargs)
            self._result_shapes = {k: v.shape for k, v in _items(out) if isinstance(v, Tensor)}
            return out

        wrapped = super()._wrap_compute(recording)

        @functools.wraps(compute)
        def restoring(*args: Any, **kwargs: Any) -> Any:
            out = wrapped(*args, **kwargs)
            shapes = getattr(self, "_result_shapes", {})
            restored = {
                k: v.reshape(shapes[k])
                for k, v in _items(out)
                if isinstance(v, Tensor) and k in shapes
            }
            if isinstance(out, Result):
                return dataclasses.replace(out, **restored)  # type: ignore[type-var]
            return {**out, **restored}

        return restoring


def _items(out: Any) -> list[tuple[str, Any]]:
    if isinstance(out, Result):
        return [(f.name, getattr(out, f.name)) for f in dataclasses.fields(out)]
    return list(out.items())
