"""Argument checks shared by the whole package.

Every public entry point validates its tensors here, so that bad input fails
early with a :class:`ValueError` that names the argument, what was expected and
what was received, instead of producing a silently wrong number.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import Tensor

__all__ = [
    "NonFinitePairs",
    "PairAudit",
    "as_float",
    "check_choice",
    "check_device",
    "check_finite",
    "check_finite_pairs",
    "check_matrix",
    "check_pairs",
    "check_points",
    "check_positive",
    "check_probability",
    "check_same_device_dtype",
    "check_shape",
    "model_device",
    "model_dtype",
    "model_errors",
    "non_finite_kinds",
]


#: how many row indices a message about non-finite pairs lists
_SHOWN_ROWS = 5


def non_finite_kinds(
    value: Tensor, *, pair_dim: int = 0, allow_negative_infinity: bool = False
) -> dict[str, Tensor]:
    """Which pairs hold which kind of non-finite entry: ``{"NaN": flags, "+inf": flags,
    "-inf": flags}``, each ``(n,)`` bool on the CPU, one flag per index of ``pair_dim``
    (kinds no pair has are left out; ``-inf`` not counted with
    ``allow_negative_infinity``)."""
    value = value.detach()
    if bool(torch.isfinite(value).all()):
        return {}
    n = value.shape[pair_dim] if value.ndim else 1
    masks = {"NaN": value.isnan(), "+inf": value == torch.inf}
    if not allow_negative_infinity:
        masks["-inf"] = value == -torch.inf
    kinds = {}
    for kind, mask in masks.items():
        flags = mask.movedim(pair_dim, 0).reshape(n, -1).any(1) if value.ndim else mask[None]
        if bool(flags.any()):
            kinds[kind] = flags.cpu()
    return kinds


class NonFinitePairs(ValueError):
    """The posterior gave non-finite values at some calibration pairs.

    The message counts the affected pairs and lists the first rows of ``theta`` and
    ``x``. Raised on a block of the pairs (``offset``: the block's first row), it
    carries the flags, so that a caller working block by block can count over the whole
    input instead (:class:`PairAudit`).

    Arguments:
        problems: what must hold -> kind of value (``"NaN"``, ``"+inf"``, ...) ->
            ``(n,)`` bool flags of the pairs of the block that broke it.
        offset: row of the block's first pair in the caller's input.
        num_pairs: ``N``, the pairs of that input; ``None``: the block's ``n``.
    """

    def __init__(
        self, problems: dict[str, dict[str, Tensor]], offset: int = 0, num_pairs: int | None = None
    ) -> None:
        self.problems, self.offset = problems, offset
        n = next(iter(next(iter(problems.values())).values())).numel()
        self.num_pairs = n if num_pairs is None else num_pairs
        sentences = [
            _pair_sentence(what, kinds, offset, self.num_pairs) for what, kinds in problems.items()
        ]
        super().__init__("; ".join(sentences))


def _pair_sentence(what: str, kinds: dict[str, Tensor], offset: int, num_pairs: int) -> str:
    """``"<what>, got NaN for 3, +inf for 2 of 200 calibration pairs (rows of theta and x:
    [7, 9, ...])"``."""
    counts = ", ".join(f"{kind} for {int(flags.sum())}" for kind, flags in kinds.items())
    bad = torch.stack(list(kinds.values())).any(0)
    rows = (bad.nonzero().flatten() + offset).tolist()
    where = (
        f"rows of theta and x: {rows}"
        if len(rows) <= _SHOWN_ROWS
        else f"first rows of theta and x: {rows[:_SHOWN_ROWS]}"
    )
    return f"{what}, got {counts} of {num_pairs} calibration pairs ({where})"


def check_finite_pairs(
    what: str, value: Tensor, *, pair_dim: int = 0, allow_negative_infinity: bool = False
) -> Tensor:
    """Raise :class:`NonFinitePairs` if ``value`` holds NaN or infinite entries, counting
    the calibration pairs (indices of ``pair_dim``) affected; ``what`` says what must hold,
    e.g. ``"posterior log_prob at theta must be finite"``."""
    kinds = non_finite_kinds(
        value, pair_dim=pair_dim, allow_negative_infinity=allow_negative_infinity
    )
    if kinds:
        raise NonFinitePairs({what: kinds})
    return value


class PairAudit:
    """Which of the ``N`` pairs of an input broke which check, gathered block by block.

    A check that works on blocks of pairs (chunks of draws) and meets non-finite values
    in one of them keeps going through the others, adding each block's flags, and then
    raises one :class:`NonFinitePairs` that counts over all ``N`` pairs and names rows in
    the input's numbering.

    Arguments:
        num_pairs: ``N``.
    """

    def __init__(self, num_pairs: int) -> None:
        self.num_pairs = num_pairs
        self.flags: dict[str, dict[str, Tensor]] = {}

    def add(self, start: int, problems: dict[str, dict[str, Tensor]]) -> None:
        """Add the flags ``(n,)`` of the block whose first pair is row ``start``."""
        for what, kinds in problems.items():
            for kind, flags in kinds.items():
                known = self.flags.setdefault(what, {})
                total = known.setdefault(kind, torch.zeros(self.num_pairs, dtype=torch.bool))
                total[start : start + flags.numel()] |= flags.cpu()

    def error(self) -> NonFinitePairs | None:
        """The error over all pairs added, ``None`` if none broke a check."""
        problems = {
            what: {kind: flags for kind, flags in kinds.items() if bool(flags.any())}
            for what, kinds in self.flags.items()
        }
        problems = {what: kinds for what, kinds in problems.items() if kinds}
        return NonFinitePairs(problems, 0, self.num_pairs) if problems else None


def _as_tensor(name: str, value: object) -> Tensor:
    if not isinstance(value, Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    return value


def _check_readable(name: str, value: Tensor) -> None:
    """Raise if ``value`` lives on the ``meta`` device: a shape without values."""
    if value.device.type == "meta":
        raise ValueError(
            f"{name} must hold values on the model's device (e.g. cpu or cuda), got a "
            "tensor on the meta device, which has a shape but no values"
        )


def check_finite(name: str, value: Tensor) -> Tensor:
    """Raise if ``value`` holds NaN or infinite entries; say how many and where."""
    value = _as_tensor(name, value)
    _check_readable(name, value)
    if value.is_floating_point() or value.is_complex():
        bad = ~torch.isfinite(value)
        if bool(bad.any()):
            count = int(bad.sum())
            if value.ndim >= 1:
                rows = bad.reshape(bad.shape[0], -1).any(dim=1).nonzero().flatten()
                first = rows[:5].tolist()
                where = f" in {rows.numel()} of {value.shape[0]} rows (first: {first})"
            else:
                where = ""
            raise ValueError(f"{name} must be finite, got {count} NaN/inf entries{where}")
    return value


def check_shape(name: str, value: Tensor, shape: tuple[int, ...], what: str = "") -> Tensor:
    """Raise unless ``value`` has ``shape``; ``what`` describes it in the message (default:
    the shape itself), e.g. ``"the shape of theta (8, 2)"``."""
    value = _as_tensor(name, value)
    if tuple(value.shape) != tuple(shape):
        raise ValueError(
            f"{name} must have {what or f'shape {tuple(shape)}'}, got {tuple(value.shape)}"
        )
    return value


def check_matrix(
    name: str,
    value: Tensor,
    *,
    min_rows: int = 1,
    columns: int | None = None,
) -> Tensor:
    """Check that ``value`` is a ``(N, D)`` tensor with ``N >= min_rows``."""
    value = _as_tensor(name, value)
    if value.ndim != 2:
        expected = f"(N, {columns})" if columns is not None else "(N, D)"
        raise ValueError(f"{name} must have shape {expected}, got {tuple(value.shape)}")
    if columns is not None and value.shape[1] != columns:
        raise ValueError(f"{name} must have shape (N, {columns}), got {tuple(value.shape)}")
    if value.shape[0] < min_rows:
        raise ValueError(
            f"{name} must have at least {min_rows} rows (N >= {min_rows}), "
            f"got shape {tuple(value.shape)}"
        )
    if not value.is_floating_point():
        raise ValueError(f"{name} must have a floating dtype, got {value.dtype}")
    check_finite(name, value)
    return value


def check_points(
    name: str, value: Tensor, *, min_rows: int = 1, columns: int | None = None
) -> Tensor:
    """Check a finite floating point set ``(*, N, D)`` (optional leading batch dimensions)."""
    value = _as_tensor(name, value)
    if value.ndim < 2:
        raise ValueError(f"{name} must have shape (*, N, D), got {tuple(value.shape)}")
    if columns is not None and value.shape[-1] != columns:
        raise ValueError(f"{name} must have shape (*, N, {columns}), got {tuple(value.shape)}")
    if value.shape[-2] < min_rows:
        raise ValueError(
            f"{name} must have at least {min_rows} points (N >= {min_rows}) in shape (*, N, D), "
            f"got {tuple(value.shape)}"
        )
    if not value.is_floating_point():
        raise ValueError(f"{name} must have a floating dtype, got {value.dtype}")
    check_finite(name, value)
    return value


def check_same_device_dtype(**tensors: Tensor) -> None:
    """Raise if the named tensors do not share one device and one floating dtype."""
    items = [(name, t) for name, t in tensors.items() if t is not None]
    if not items:
        return
    first_name, first = items[0]
    for name, t in items[1:]:
        if t.device != first.device:
            raise ValueError(
                f"{name} must be on the same device as {first_name} ({first.device}), "
                f"got {t.device}"
            )
        if t.is_floating_point() and first.is_floating_point() and t.dtype != first.dtype:
            raise ValueError(
                f"{name} must have the same dtype as {first_name} ({first.dtype}), got {t.dtype}"
            )


def check_pairs(theta: Tensor, x: Tensor, *, min_rows: int = 1) -> tuple[Tensor, Tensor]:
    """Check calibration pairs: ``theta`` of shape ``(N, D)`` and ``x`` of shape ``(N, *X)``.

    ``x`` may carry any event shape (vectors, images, sequences) as long as its
    first dimension matches ``theta``'s. Integer or boolean ``x`` (counts, labels) is
    returned cast to ``theta``'s dtype, so every metric sees the same floating ``x``;
    floating ``x`` must share ``theta``'s dtype. Use the returned pair.

    Returns:
        ``(theta, x)``, ``x`` floating.
    """
    theta, x = _as_tensor("theta", theta), _as_tensor("x", x)
    if theta.device != x.device:
        raise ValueError(
            f"theta and x must be on one device (the model's), got theta on {theta.device} "
            f"and x on {x.device}"
        )
    check_matrix("theta", theta, min_rows=min_rows)
    if x.ndim < 2:
        raise ValueError(
            f"x must have shape (N, X) with a leading batch dimension, got {tuple(x.shape)}"
            " (use x[:, None] for a scalar observation)"
        )
    if x.shape[0] != theta.shape[0]:
        raise ValueError(
            f"x must have the same number of rows as theta ({theta.shape[0]}), "
            f"got shape {tuple(x.shape)}"
        )
    if not (x.is_floating_point() or x.is_complex()):
        x = x.to(theta.dtype)
    check_finite("x", x)
    check_same_device_dtype(theta=theta, x=x)
    return theta, x


def check_positive(name: str, value: float | int, *, integer: bool = False) -> None:
    """Raise unless ``value`` is a positive (integer) number."""
    if integer:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    elif isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ValueError(f"{name} must be a positive number, got {value!r}")


def check_probability(name: str, value: float, *, open_interval: bool = True) -> None:
    """Raise unless ``0 < value < 1`` (or ``0 <= value <= 1``)."""
    ok = 0 < value < 1 if open_interval else 0 <= value <= 1
    if not ok:
        interval = "(0, 1)" if open_interval else "[0, 1]"
        raise ValueError(f"{name} must lie in {interval}, got {value!r}")


def check_choice(name: str, value: object, choices: Sequence[object]) -> None:
    """Raise unless ``value`` is one of ``choices``."""
    if value not in choices:
        raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}")


def model_dtype(module: object) -> torch.dtype | None:
    """The floating dtype of a model's first floating parameter (or buffer).

    ``None`` when ``module`` has none (a plain callable, a parameter-free module).
    """
    for getter in ("parameters", "buffers"):
        tensors = getattr(module, getter, None)
        if not callable(tensors):
            return None
        for tensor in tensors():
            if isinstance(tensor, Tensor) and tensor.is_floating_point():
                return tensor.dtype
    return None


def model_device(module: object) -> torch.device | None:
    """The device of a model's first parameter (or buffer); ``None`` when it has none."""
    for getter in ("parameters", "buffers"):
        tensors = getattr(module, getter, None)
        if not callable(tensors):
            return None
        for tensor in tensors():
            if isinstance(tensor, Tensor):
                return tensor.device
    return None


def check_device(name: str, value: Tensor, device: torch.device | None) -> None:
    """Raise unless ``value`` is on the model's ``device`` (``None``: not known, passes)."""
    if device is not None and value.device != device:
        raise ValueError(
            f"{name} must be on the posterior's device {device} (where its parameters are), "
            f"got {name} on {value.device}"
        )


def as_float(value: Tensor, dtype: torch.dtype | None) -> Tensor:
    """``value`` in ``dtype``; with ``dtype=None``, integer/bool ``value`` in torch's default
    floating dtype and floating ``value`` unchanged."""
    if dtype is None:
        if value.is_floating_point() or value.is_complex():
            return value
        dtype = torch.get_default_dtype()
    return value.to(dtype)


# Messages of the RuntimeErrors torch raises when tensors of the wrong width or dtype
# meet inside a model ("mat1 and mat2 shapes cannot be multiplied", "The size of tensor
# a (2) must match ...", "expected scalar type Float but found Double", ...).
_MISMATCH = re.compile(r"shape|size|must match|dtype|scalar type", re.IGNORECASE)
_DTYPE = re.compile(r"dtype|scalar type", re.IGNORECASE)


def _describe(value: Tensor | None) -> str:
    return "none" if value is None else f"shape {tuple(value.shape)} and dtype {value.dtype}"


@contextmanager
def model_errors(
    theta: Tensor | None,
    x: Tensor,
    *,
    dtype: torch.dtype | None = None,
    context: str | None = None,
    event_size: int | None = None,
) -> Iterator[None]:
    """Turn torch's shape and dtype errors from inside a model into a :class:`ValueError`.

    Wrap every call into the wrapped estimator. Only RuntimeErrors whose message is a
    shape or dtype mismatch are translated (out-of-memory and other errors pass
    unchanged); the torch error stays attached as ``__cause__``. The caller has
    already checked what it could know: with ``theta``'s width checked against
    ``event_size``, a remaining shape mismatch is blamed on ``x``.

    Arguments:
        theta: the parameters as passed to the model, or ``None`` (sampling).
        x: the observations as passed to the model.
        dtype: the model's dtype if known.
        context: the expected shape of one observation if known, e.g. ``"shape (2,)"``.
        event_size: ``D``, which ``theta``'s width was checked against, if known.
    """
    try:
        yield
    except RuntimeError as err:
        message = str(err)
        if isinstance(err, torch.cuda.OutOfMemoryError) or not _MISMATCH.search(message):
            raise
        if _DTYPE.search(message):
            if dtype is not None and all(t is None or t.dtype == dtype for t in (theta, x)):
                raise ValueError(
                    "the posterior's model must hold its parameters and buffers in one dtype: "
                    f"x and theta were passed in its parameters' dtype {dtype}, yet it failed "
                    "on a dtype mismatch"
                ) from err
            expected = (
                f"the model's dtype {dtype}"
                if dtype is not None
                else "the dtype of the tensors inside the posterior callable"
            )
            raise ValueError(
                f"x and theta must have {expected}, got x with {_describe(x)} and theta "
                f"with {_describe(theta)}: the model failed on a dtype mismatch"
            ) from err
        if theta is not None and event_size is None:
            raise ValueError(
                "theta and x must have the widths the model was built for (the adapter "
                f"cannot read them from it), got theta with {_describe(theta)} and x with "
                f"{_describe(x)}: the model failed on a shape mismatch"
            ) from err
        expected = context or "the width the model's conditioning network was built for"
        raise ValueError(
            f"x must have one observation of {expected} per row, got x with {_describe(x)} "
            f"(theta: {_describe(theta)}): the model failed on a shape mismatch"
        ) from err
