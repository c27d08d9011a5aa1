"""Keep the documented shapes of a metric's result through torchmetrics' ``compute`` wrapper.

torchmetrics squeezes every one-element tensor a ``compute()`` returns, so a
per-dimension output documented as ``(D,)`` comes back as ``()`` when ``D = 1`` (and a
per-observation ``(O,)`` as ``()`` when ``O = 1``). :class:`KeepShapes` records the
shapes ``compute()`` produced and restores them after the wrapper.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from torch import Tensor
from torchmetrics import Metric

__all__ = ["KeepShapes"]


class KeepShapes(Metric):
    """A ``Metric`` whose ``compute()`` dict keeps each tensor's shape (no squeezing)."""

    _result_shapes: dict[str, Any]

    def _wrap_compute(self, compute: Callable) -> Callable:
        @functools.wraps(compute)
        def recording(*args: Any, **kwargs: Any) -> Any:
            out = compute(*args, **kwargs)
            self._result_shapes = {k: v.shape for k, v in out.items() if isinstance(v, Tensor)}
            return out

        wrapped = super()._wrap_compute(recording)

        @functools.wraps(compute)
        def restoring(*args: Any, **kwargs: Any) -> Any:
            out = wrapped(*args, **kwargs)
            shapes = getattr(self, "_result_shapes", {})
            return {
                k: v.reshape(shapes[k]) if isinstance(v, Tensor) and k in shapes else v
                for k, v in out.items()
            }

        return restoring
