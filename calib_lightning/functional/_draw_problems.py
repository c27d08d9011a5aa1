"""Which calibration pairs hold non-finite posterior draws or log-densities.

The checks of :mod:`calib_lightning.functional.ranks` (which re-exports
:func:`draw_problems`): what must hold -> kind of non-finite value -> flags of the
pairs, and the :class:`~calib_lightning._utils.validation.NonFinitePairs` raised from them.
"""

from __future__ import annotations

from torch import Tensor

from calib_lightning._utils.validation import NonFinitePairs, non_finite_kinds

__all__ = [
    "LOG_PROB",
    "LOG_PROB_THETA",
    "SAMPLES",
    "check_draws",
    "check_log_prob_theta",
    "draw_problems",
    "raise_pairs",
]


def raise_pairs(what: str, bad: Tensor, offset: int) -> None:
    """Raise :class:`~calib_lightning._utils.validation.NonFinitePairs` if any of the checked pairs
    are ``bad`` (flags ``(n,)``, the first one row ``offset``)."""
    if bool(bad.any()):
        raise NonFinitePairs({what: {"NaN": bad.cpu()}}, offset)


#: what :func:`draw_problems` checks, in the order its messages list them
LOG_PROB_THETA = "posterior log_prob at theta must be finite or -inf (zero density)"
SAMPLES = "posterior samples must be finite"
LOG_PROB = "posterior log_prob at its samples must be finite"


def draw_problems(
    samples: Tensor, log_prob_samples: Tensor | None, log_prob_theta: Tensor | None
) -> dict[str, dict[str, Tensor]]:
    """Which pairs hold non-finite draws ``(s, n, D)``, draw log-densities ``(s, n)`` or a
    NaN / ``+inf`` truth log-density ``(n,)``: what must hold -> kind -> ``(n,)`` flags
    (only what some pair breaks; never raises)."""
    problems = {}
    if log_prob_theta is not None:
        problems[LOG_PROB_THETA] = non_finite_kinds(log_prob_theta, allow_negative_infinity=True)
    problems[SAMPLES] = non_finite_kinds(samples, pair_dim=1)
    if log_prob_samples is not None:
        problems[LOG_PROB] = non_finite_kinds(log_prob_samples, pair_dim=1)
    return {what: kinds for what, kinds in problems.items() if kinds}


def check_log_prob_theta(log_prob_theta: Tensor, offset: int = 0) -> None:
    """Raise, counting the affected pairs, on a NaN or ``+inf`` truth log-density ``(n,)``
    (``-inf``, zero density, is allowed); ``offset``: row of the first pair."""
    kinds = non_finite_kinds(log_prob_theta, allow_negative_infinity=True)
    if kinds:
        raise NonFinitePairs({LOG_PROB_THETA: kinds}, offset)


def check_draws(
    samples: Tensor, log_prob_samples: Tensor, log_prob_theta: Tensor, offset: int = 0
) -> None:
    """Raise, counting the affected pairs, on non-finite draws or a NaN/+inf truth density."""
    problems = draw_problems(samples, log_prob_samples, log_prob_theta)
    if problems:
        raise NonFinitePairs(problems, offset)
