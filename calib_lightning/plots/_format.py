"""How figures and summaries print p-values: never as exactly 0, and saying when they clip."""

from __future__ import annotations

import math

from calib_lightning.functional.bands import P_VALUE_FLOOR

__all__ = ["format_p_value"]


def format_p_value(p: float, digits: int = 2, name: str = "p") -> str:
    """``"p = 0.031"``, or ``"p < 2.2e-308"`` for a p-value at the analytic floor.

    Analytic tests floor their p-values at
    :data:`~calib_lightning.functional.bands.P_VALUE_FLOOR` (the exact tail probability
    underflowed below it); a value at the floor, or 0 from an outside source, prints as
    an upper bound, never as 0.

    Arguments:
        p: the p-value.
        digits: significant digits.
        name: the left-hand side; ``""`` for the value alone (``"0.031"``, ``"< 2.2e-308"``).

    Example:
        >>> format_p_value(0.03125), format_p_value(0.0), format_p_value(1e-320, name="")
        ('p = 0.031', 'p < 2.2e-308', '< 2.2e-308')
    """
    p = float(p)
    prefix = f"{name} " if name else ""
    if math.isnan(p):
        return f"{prefix}= nan" if name else "nan"
    if p <= P_VALUE_FLOOR:
        return f"{prefix}< {P_VALUE_FLOOR:.2g}"
    return f"{prefix}= {p:.{digits}g}" if name else f"{p:.{digits}g}"
