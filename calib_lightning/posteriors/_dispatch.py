r"""Which adapter takes an object, and as what: the one place that asks.

Each adapter module declares what it recognizes, ``recognize(obj) -> Recognized | None``
(:class:`~calib_lightning.posteriors.base.Recognized`); :data:`FAMILIES` asks them in a
fixed order and the first that claims an object decides what it can be read as. A new
estimator family is one module with its ``recognize`` and one line in :data:`FAMILIES`.

:func:`resolve` turns what the object is, and what the caller declares (a ``prior``, a
``kind``), into one reading: ``"posterior"`` (the normalized adapter) or a posterior known
up to a constant (``"likelihood"``, ``"ratio"``, ``"unnormalized"``). Where the object
cannot tell and the caller says nothing (an sbi density estimator with
``dim theta = dim x``), it refuses with a ``ValueError`` that says how to declare it:
never a number.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

import calib_lightning.posteriors._lampe as lampe
import calib_lightning.posteriors.bayesflow as bayesflow
import calib_lightning.posteriors.distributions as distributions
import calib_lightning.posteriors.flows as flows
import calib_lightning.posteriors.sbi as sbi
import calib_lightning.posteriors.vector_fields as vector_fields
from calib_lightning.posteriors.base import Recognized

__all__ = ["FAMILIES", "KINDS", "recognize", "resolve", "resolve_with_data"]

#: the adapter modules, asked in this order (the specific before the generic callables)
FAMILIES = (lampe, vector_fields, sbi, bayesflow, flows, distributions)

#: what a caller may declare an estimator to be (``cl.as_posterior(obj, kind=...)``)
KINDS = ("posterior", "likelihood", "ratio")


def recognize(obj: Any) -> Recognized | None:
    """What the first module of :data:`FAMILIES` that knows ``obj`` makes of it, or
    ``None`` when none does (a ``ValueError`` for an object a family refuses)."""
    for family in FAMILIES:
        found = family.recognize(obj)
        if found is not None:
            return found
    return None


def tried() -> str:
    """The families :func:`recognize` asks, in words, for the error when none claims."""
    return (
        "a Posterior, a lampe NPE, FMPE or NRE, an sbi vector-field estimator (FMPE, NPSE), "
        "an sbi density, ratio or likelihood estimator, DirectPosterior or MCMCPosterior, "
        "a BayesFlow ContinuousApproximator (torch backend), "
        "an nflows Flow, a zuko flow or any callable x -> Distribution, or a callable "
        "f(theta, x) with prior="
    )


def check_kind(kind: str | None) -> None:
    if kind is not None and kind not in KINDS:
        raise ValueError(f"kind must be one of {list(KINDS)} or None, got {kind!r}")


def _declared(found: Recognized, kind: str) -> str | None:
    """The reading of ``found`` that ``kind`` names, ``None`` when it has none."""
    if kind in found.readings:
        return kind
    if kind != "posterior" and "unnormalized" in found.readings:
        return kind  # a callable f(theta, x) may be either
    return None


def resolve(
    found: Recognized, *, prior: Any = None, kind: str | None = None, argument: str = "posterior"
) -> str:
    """The reading of ``found`` (one of ``base.READINGS``) given what the caller declares:
    ``prior`` (it is not a posterior: a likelihood or ratio) and ``kind``. A ``ValueError``
    naming ``argument`` when the declarations do not fit the object, when it needs a prior
    it has not got, or when nothing tells what it is."""
    check_kind(kind)
    if kind is not None:
        reading = _declared(found, kind)
        if reading is None:
            raise ValueError(
                f"kind must fit the estimator: {argument} is {found.what}, which reads as "
                f"{' or '.join(found.readings)}, got kind={kind!r}"
            )
    elif prior is not None:
        others = [r for r in found.readings if r != "posterior"]
        if not others:
            raise prior_unused(found)
        reading = others[0]
        size = _prior_size(prior)
        if (
            "posterior" in found.readings
            and found.fits("posterior", size, None)
            and not (found.fits(reading, size, None))
        ):
            raise prior_unused(found, f" (its parameters have D = {size} like the prior's)")
    elif found.default is not None:
        reading = found.default
    else:
        raise ambiguous(found, argument)
    if reading == "posterior" and prior is not None:
        raise prior_unused(found)
    if reading != "posterior" and prior is None and found.prior is None:
        raise needs_prior(found, argument)
    return reading


def resolve_with_data(found: Recognized, prior: Any, theta: Tensor, x: Tensor) -> str:
    """The reading of ``found`` where ``prior`` may be a posterior's (for the support
    check) or a likelihood's (``cl.diagnose(..., prior=)``): where the object can be both,
    the shapes of ``theta (N, D)`` and ``x (N, *X)`` decide; where they fit both, a
    ``ValueError`` says how to declare it."""
    if prior is None or "posterior" not in found.readings:
        return resolve(found, prior=prior)
    if len(found.readings) == 1 or not any(found.shapes.values()):
        return "posterior"  # the prior is the posterior's, for the support check
    size, context = int(theta.shape[-1]), tuple(x.shape[1:])
    fitting = [r for r in found.readings if found.fits(r, size, context)]
    if len(fitting) > 1:
        raise ambiguous(found, "posterior", with_prior=True)
    if not fitting or fitting == ["posterior"]:
        return "posterior"  # no reading fits: the adapter's input checks say how
    return resolve(found, prior=prior, kind=fitting[0] if fitting[0] in KINDS else None)


def _prior_size(prior: Any) -> int | None:
    shape = tuple(getattr(prior, "batch_shape", ())) + tuple(getattr(prior, "event_shape", ()))
    return int(shape[0]) if len(shape) == 1 else None


def prior_unused(found: Recognized, why: str = "") -> ValueError:
    return ValueError(
        "prior must be given only with a ratio or likelihood estimator (or an sbi MCMC "
        f"posterior), got a prior with {found.what}, a posterior estimator{why} that needs "
        "none"
    )


def needs_prior(found: Recognized, argument: str = "posterior") -> ValueError:
    sampler = (
        "; a sampler fn(x, num_samples) goes in cl.SamplePosterior(fn)"
        if found.default == "unnormalized"
        else ""
    )
    return ValueError(
        f"{argument} must be a posterior estimator, got {found.what}, whose posterior is "
        "known only up to a constant given its prior: pass cl.as_posterior(estimator, "
        "prior=prior) or cl.UnnormalizedPosterior(estimator, prior=prior) "
        f"(cl.diagnose(estimator, theta, x, prior=prior)){sampler}"
    )


def ambiguous(found: Recognized, argument: str, with_prior: bool = False) -> ValueError:
    shapes = found.shapes.get("posterior", (None, None))
    both = " with the prior given" if with_prior else ""
    return ValueError(
        f"{argument} must say what it estimates: {found.what} may be a posterior estimator "
        "q(theta | x) (as sbi's NPE trains) or a likelihood estimator q(x | theta) (as sbi's "
        f"NLE trains), and its shapes cannot tell (theta of width {shapes[0]} and x of shape "
        f"{shapes[1]} fit both readings{both}). Declare it: "
        'cl.as_posterior(estimator, kind="posterior") for a posterior estimator (or the '
        "DirectPosterior of inference.build_posterior), cl.as_posterior(estimator, "
        'prior=prior, kind="likelihood") or cl.UnnormalizedPosterior(estimator, prior=prior) '
        "for a likelihood estimator"
    )
