"""Typed results: what a metric's ``compute()`` returns.

Each metric returns a small dataclass derived from :class:`Result`. Its fields are
documented with their shapes in the subclass's docstring; plots, callbacks and
summaries read the fields by attribute. The scalars a callback logs are declared once,
in the subclass's ``logged`` tuple, and :meth:`Result.scalars` expands them (a
``(K,)`` field ``f`` becomes ``f/0 ... f/{K-1}``), so a renamed field fails loudly at
import instead of silently dropping out of the logs.

A result also reads as a read-only mapping from field name to value (``result["p_value"]``,
``dict(result)``), for code that logs everything generically.

Example:
    >>> import torch
    >>> from dataclasses import dataclass
    >>> @dataclass(eq=False)
    ... class TwoTests(Result):
    ...     logged = ("p_value",)
    ...     p_value: torch.Tensor
    ...     statistic: torch.Tensor
    >>> out = TwoTests(p_value=torch.tensor([0.5, 0.01]), statistic=torch.zeros(2))
    >>> sorted(out.scalars())
    ['p_value/0', 'p_value/1']
    >>> out["statistic"].shape
    torch.Size([2])
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, ClassVar, TypeVar

from torch import Tensor

__all__ = ["Result", "expand_scalars"]

R = TypeVar("R", bound="Result")


class Result(Mapping[str, Any]):
    """Base of every metric result; subclasses are ``@dataclass(eq=False)``.

    Class attributes:
        logged: the fields logged as scalars, in order: 0-d tensors as ``name``, 1-d
            tensors as ``name/i``; other shapes and ``None`` are skipped.
        verdict: the field holding the one p-value that is the check's verdict
            (``global_p_value`` where a metric runs several tests), or ``None``.
    """

    logged: ClassVar[tuple[str, ...]] = ()
    verdict: ClassVar[str | None] = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        annotations = {}
        for klass in reversed(cls.__mro__):
            annotations.update(getattr(klass, "__annotations__", {}))
        names = [n for n in (*cls.logged, cls.verdict) if n is not None]
        missing = [n for n in names if n not in annotations]
        if missing:
            raise TypeError(f"{cls.__name__} declares logged/verdict fields {missing} it lacks")
        if "__repr__" not in cls.__dict__:  # @dataclass keeps an existing one: shapes, not data
            cls.__repr__ = Result.__repr__  # type: ignore[method-assign]

    def _names(self) -> list[str]:
        return [f.name for f in dataclasses.fields(self)]  # type: ignore[arg-type]

    def __getitem__(self, key: str) -> Any:
        if key not in self._names():
            raise KeyError(f"{type(self).__name__} has no field {key!r}; fields: {self._names()}")
        return getattr(self, key)

    def __iter__(self) -> Iterator[str]:
        return (n for n in self._names() if getattr(self, n) is not None)

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __repr__(self) -> str:
        parts = []
        for name in self:
            value = getattr(self, name)
            if isinstance(value, Tensor):
                value = float(value) if value.numel() == 1 else f"<{tuple(value.shape)}>"
            parts.append(f"{name}={value}")
        return f"{type(self).__name__}({', '.join(parts)})"

    def scalars(self) -> dict[str, Tensor]:
        """The ``logged`` fields as scalar tensors, keyed ``name`` or ``name/i``."""
        return expand_scalars((name, getattr(self, name)) for name in self.logged)

    def apply(self: R, fn: Callable[[Tensor], Tensor]) -> R:
        """A copy with ``fn`` applied to every tensor field (e.g. ``Tensor.cpu``)."""
        changes = {
            name: fn(getattr(self, name))
            for name in self._names()
            if isinstance(getattr(self, name), Tensor)
        }
        return dataclasses.replace(self, **changes)  # type: ignore[type-var]


def expand_scalars(items: Iterable[tuple[str, Any]]) -> dict[str, Tensor]:
    """Real tensors as scalars: a 0-d one as ``name``, each entry of a 1-d one as
    ``name/i``; other shapes and non-tensors are skipped."""
    out: dict[str, Tensor] = {}
    for name, value in items:
        if not isinstance(value, Tensor) or value.is_complex():
            continue
        if value.ndim == 0:
            out[name] = value
        elif value.ndim == 1:
            out.update({f"{name}/{i}": v for i, v in enumerate(value)})
    return out
