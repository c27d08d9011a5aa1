r"""lampe's estimators (``lampe.inference``) as posteriors.

lampe's estimators are ``nn.Module`` s whose ``forward(theta, x)`` returns a number per
pair: a log-density for ``NPE``, a log-ratio for ``NRE`` (which ``BNRELoss`` and
``CNRELoss`` also train). Both are callables of two arguments, not the callable
``x -> Distribution`` the package would otherwise take them for, so they are recognized
by class:

* ``NPE``: its conditional flow ``estimator.flow`` (a zuko flow);
* ``FMPE``: ``estimator.flow(x)``, a continuous flow (its density and score integrate an
  ODE's trace: costly);
* ``NRE``: :math:`\log r(\theta, x)`, a posterior :math:`r(\theta, x)\, p(\theta)` known up
  to a constant, given the prior (:class:`~calib_lightning.UnnormalizedPosterior`);
* ``AMNRE`` (a ratio for every subset of the parameters) is refused: fix its mask first.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn
from torch.distributions import Distribution

from calib_lightning.posteriors.base import Posterior, Recognized
from calib_lightning.posteriors.distributions import DistributionPosterior

__all__ = ["LampeFlow", "lampe_kind", "recognize"]

# subclasses before their base classes (AMNRE is an NRE)
_KINDS = {"AMNRE": "masked_ratio", "NPE": "posterior", "FMPE": "flow_matching", "NRE": "ratio"}


def lampe_kind(obj: Any) -> str | None:
    """``"posterior"`` (lampe ``NPE``), ``"flow_matching"`` (``FMPE``), ``"ratio"``
    (``NRE``), ``"masked_ratio"`` (``AMNRE``), or ``None`` for anything not from lampe."""
    if not type(obj).__module__.startswith("lampe."):
        return None
    try:
        import lampe.inference as inference
    except ImportError:  # pragma: no cover - lampe is optional
        return None
    for name, kind in _KINDS.items():
        cls = getattr(inference, name, None)
        if cls is not None and isinstance(obj, cls):
            return kind
    return None


def recognize(obj: Any) -> Recognized | None:
    """What a lampe estimator is (module docstring); a ``ValueError`` for an ``AMNRE``."""
    kind = lampe_kind(obj)
    if kind is None:
        return None
    name = type(obj).__name__
    if kind == "masked_ratio":
        raise masked_ratio_error(obj)
    if kind == "ratio":
        return Recognized(
            f"a lampe {name} (a ratio estimator r(theta, x))",
            ("ratio",),
            "ratio",
            log_likelihood=obj,
        )
    if kind == "posterior":
        return Recognized(
            f"a lampe {name} (a posterior estimator)",
            ("posterior",),
            "posterior",
            lambda: DistributionPosterior(obj.flow),
        )
    return Recognized(
        f"a lampe {name} (a flow-matching posterior estimator)",
        ("posterior",),
        "posterior",
        lambda: _continuous_flow(obj),
    )


def _continuous_flow(obj: nn.Module) -> Posterior:
    posterior = DistributionPosterior(LampeFlow(obj))
    posterior.costly = frozenset({"log_prob", "score"})
    return posterior


class LampeFlow(nn.Module):
    """``x -> estimator.flow(x)``: the conditional distribution of a lampe ``FMPE``, as a
    module (so the posterior finds the estimator's parameters, device and dtype)."""

    def __init__(self, estimator: nn.Module) -> None:
        super().__init__()
        self.estimator = estimator

    def forward(self, x: Tensor) -> Distribution:
        return self.estimator.flow(x)


def masked_ratio_error(obj: Any) -> ValueError:
    return ValueError(
        f"posterior must be a posterior, ratio or likelihood estimator, got a lampe "
        f"{type(obj).__name__} (a ratio for every subset of the parameters): fix its mask "
        "first, e.g. the joint ratio: cl.UnnormalizedPosterior(lambda theta, x: "
        "amnre(theta, x, torch.ones_like(theta, dtype=torch.bool)), prior=prior)"
    )
