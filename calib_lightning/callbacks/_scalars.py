r"""How a check's scalars reach the loggers: float64, and every p-value's log10 beside it.

Lightning keeps a logged float64 tensor in float64 up to the logger, and each logger
then stores what its format allows: ``CSVLogger``, ``MLFlowLogger`` and ``WandbLogger`` a
Python float (float64), ``TensorBoardLogger`` a float32 ``simple_value``, in which a
p-value below about ``1e-38`` becomes a subnormal number or exactly 0.

So that every logger shows the same, readable number, a p-value's own tag is floored at
float32's smallest normal number, :data:`P_VALUE_TAG_FLOOR` (about ``1.2e-38``): read
that value as "at most". Its exact value goes beside it, as its base-10 logarithm under
``log10_{key}`` (``p_value`` -> ``log10_p_value``, ``marginal_p_values/1`` ->
``log10_marginal_p_values/1``), which every logger stores without underflow:
:math:`\log_{10} p \ge -307.7` fits any float. It is computed in float64 from the
float64 p-value (no test of the package returns a log p-value, so this is as exact as
the p-value itself). The p-values of analytic tests are floored at
:data:`~calib_lightning.functional.bands.P_VALUE_FLOOR`, float64's smallest normal
number (about ``2.2e-308``); a p-value at or below it (``0`` from a metric of your own
included) gets ``log10 = log10(P_VALUE_FLOOR)``, about ``-307.65``: read it as "at
most". On a device without float64 (Apple MPS) both are float32. A callback's
``history`` and its summary table keep the unfloored float64 value.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar

import torch
from torch import Tensor

from calib_lightning.functional.bands import P_VALUE_FLOOR

__all__ = [
    "ALIASES_REMOVED_IN",
    "LOG10_PREFIX",
    "P_VALUE_TAG_FLOOR",
    "is_p_value",
    "log10_key",
    "logged_scalars",
    "with_deprecated_aliases",
]

#: the tag of a p-value's log10: ``log10_`` before the key's first part
LOG10_PREFIX = "log10_"

#: the smallest value a p-value's own tag takes: float32's smallest normal number, so that
#: TensorBoard's float32 stores what the other loggers store (its ``log10_`` tag is exact)
P_VALUE_TAG_FLOOR = float(torch.finfo(torch.float32).tiny)

#: the release in which the deprecated tag aliases (:func:`with_deprecated_aliases`) go
ALIASES_REMOVED_IN = "0.3.0"

# parts of a p-value field's tags that are not p-values (counts of rejections)
_NOT_P_VALUES = ("num_rejected",)


def is_p_value(key: str) -> bool:
    """Whether a scalar key names a p-value: its first part ends in ``p_value`` or
    ``p_values`` (``p_value``, ``global_p_value``, ``marginal_p_values/3``,
    ``mmd_p_value/0``), except counts such as ``marginal_p_values/num_rejected``.

    Example:
        >>> [is_p_value(k) for k in ("p_value", "ecdf_p_values/joint",
        ...                          "ecdf_p_values/num_rejected", "statistic")]
        [True, True, False, False]
    """
    field, *rest = key.split("/")
    return field.endswith(("p_value", "p_values")) and not (rest and rest[-1] in _NOT_P_VALUES)


def log10_key(key: str) -> str:
    """The key of a p-value's log10: ``log10_p_value``, ``log10_p_value/0``."""
    return LOG10_PREFIX + key


def _float64(value: Tensor) -> Tensor:
    dtype = torch.float32 if value.device.type == "mps" else torch.float64
    return value.detach().reshape(()).to(dtype)


def logged_scalars(scalars: dict[str, Tensor]) -> dict[str, Tensor]:
    r"""The tensors a check hands to ``pl_module.log_dict``, keyed without prefix.

    Every scalar in float64 (on its device), a p-value floored at
    :data:`P_VALUE_TAG_FLOOR`, and after each p-value its :math:`\log_{10}` under
    :func:`log10_key`, from the unfloored value, floored at :math:`\log_{10}`
    :data:`~calib_lightning.functional.bands.P_VALUE_FLOOR`; ``nan`` stays ``nan``.

    Arguments:
        scalars: key -> 0-d (or one-element) tensor.

    Example:
        >>> out = logged_scalars({"p_value": torch.tensor(1e-100, dtype=torch.float64),
        ...                       "statistic": torch.tensor(2.5)})
        >>> {k: float(v) for k, v in out.items()}
        {'p_value': 1.1754943508222875e-38, 'log10_p_value': -100.0, 'statistic': 2.5}
    """
    out: dict[str, Tensor] = {}
    for key, value in scalars.items():
        value = _float64(value)
        out[key] = value
        if is_p_value(key):
            out[key] = value.clamp_min(P_VALUE_TAG_FLOOR)  # nan stays nan
            floor = P_VALUE_FLOOR if value.dtype == torch.float64 else torch.finfo(value.dtype).tiny
            out[log10_key(key)] = torch.log10(value.clamp_min(floor))
    return out


Value = TypeVar("Value")


def with_deprecated_aliases(
    scalars: Mapping[str, Value], renamed: Mapping[str, str]
) -> dict[str, Value]:
    """``scalars`` and, after them, each scalar whose key's first part was renamed
    (``renamed``: new first part -> old one) once more under its old key, so that
    dashboards and monitors on the old tag keep working until
    :data:`ALIASES_REMOVED_IN`.

    Example:
        >>> with_deprecated_aliases({"reference_density/0": 0.9, "mmd/0": 0.1},
        ...                         {"reference_density": "density"})
        {'reference_density/0': 0.9, 'mmd/0': 0.1, 'density/0': 0.9}
    """
    out = dict(scalars)
    for key, value in scalars.items():
        first, *rest = key.split("/")
        if first in renamed:
            out["/".join([renamed[first], *rest])] = value
    return out
