r"""What a callback's estimator is: a posterior, or a ratio or likelihood with ``prior=``.

A callback reads its estimator through :func:`callback_posterior`, which is
:func:`calib_lightning.as_posterior` (the same reading, the same errors): without
``prior`` the estimator is a posterior estimator, and a ratio or likelihood estimator is
refused with the fix (pass ``prior=``); with ``prior`` the user says it is **not** a
posterior: an sbi or lampe ratio or likelihood estimator, an sbi MCMC posterior, or a
callable :math:`f(\theta, x)` (a log-ratio or log-likelihood, batched
``(theta (M, D), x (M, *X)) -> (M,)``) gives an
:class:`~calib_lightning.UnnormalizedPosterior`, known through its score only. A
posterior estimator (a zuko or nflows flow, an sbi or lampe posterior estimator, a
callable ``x -> Distribution``, a :class:`~calib_lightning.posteriors.Posterior`) with
``prior`` is refused, never read as a likelihood.

At setup (:func:`check_capabilities`, :func:`check_unnormalized_fits`) a callback whose
check needs what the posterior lacks (samples, latents) fails at once and says which
callbacks check such an estimator, and an unnormalized posterior is evaluated at two
pairs.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from calib_lightning._utils.validation import check_pairs
from calib_lightning.callbacks._plumbing import SetupError
from calib_lightning.evaluation import check_event_size
from calib_lightning.posteriors import (
    CAPABILITIES,
    Posterior,
    UnnormalizedPosterior,
    as_posterior,
    recognize,
    supports,
)

__all__ = ["callback_posterior", "check_capabilities", "check_unnormalized_fits"]

#: the callbacks that check a posterior with scores only (what the errors recommend)
SCORE_ONLY_CALLBACKS = (
    "KCCSDCallback(..., prior=prior) and ImportanceCoverageCallback(..., prior=prior) "
    "(and RatioBalanceCallback for a ratio estimator)"
)


def callback_posterior(estimator: Any, prior: Any = None) -> Posterior:
    r"""The posterior a callback checks (module docstring).

    Arguments:
        estimator: what the callback found on the LightningModule.
        prior: ``None`` (``estimator`` is a posterior estimator), or the prior
            :math:`p(\theta)` of a ratio or likelihood ``estimator`` (a
            ``torch.distributions.Distribution`` with event shape ``(D,)``).

    Raises:
        SetupError: a ratio or likelihood estimator without ``prior``.
        ValueError: ``prior`` with a posterior estimator, or a ``prior`` that is none.
    """
    if prior is None and not isinstance(estimator, Posterior):
        found = recognize(estimator)
        if found is not None and "posterior" not in found.readings and found.prior is None:
            raise SetupError(
                f"estimator must be a posterior estimator when the callback has no prior, got "
                f"{found.what}, whose posterior is known only up to a constant: pass the "
                "callback prior=prior (its prior, e.g. sbi's BoxUniform) and check it with "
                + SCORE_ONLY_CALLBACKS
            )
    return as_posterior(estimator, prior=prior)


def check_capabilities(callback: Any, posterior: Posterior, needs: tuple[str, ...]) -> None:
    """Raise a :class:`SetupError` if ``posterior`` lacks a capability in ``needs``,
    naming the callback, what is missing and what checks such an estimator."""
    missing = [c for c in needs if not supports(posterior, c)]
    if not missing:
        return
    what = " and ".join(f"{c} ({CAPABILITIES[c]} need it)" for c in missing)
    fix = (
        f"an estimator known up to its normalizing constant (a ratio or likelihood estimator "
        f"with prior=) has scores only: check it with {SCORE_ONLY_CALLBACKS}, or give "
        f"{type(callback).__name__} a posterior that can sample (estimator= a flow, an sbi "
        "posterior estimator)"
        if isinstance(posterior, UnnormalizedPosterior)
        else f"give {type(callback).__name__} an estimator that provides it"
    )
    raise SetupError(
        f"{type(callback).__name__} needs a posterior with {what}, got {posterior!r}, which "
        f"provides {', '.join(sorted(posterior.capabilities))}; {fix}"
    )


def check_unnormalized_fits(posterior: UnnormalizedPosterior, theta: Tensor, x: Tensor) -> None:
    """Raise now if ``theta (N, D)`` and ``x (N, *X)`` do not fit ``posterior``: ``theta``'s
    width against the prior's ``D``, ``x`` against the estimator's context where it tells
    it, then :math:`f + \\log p` at the first two pairs (its ``ValueError``; a callable
    that cannot be called as ``f(theta, x)`` is a :class:`SetupError`). Other errors are
    left to the check."""
    theta, x = check_pairs(theta, x)
    check_event_size(posterior, theta, x)
    posterior._prepare_x(x)
    try:
        with torch.no_grad():
            posterior.unnormalized_log_prob(theta[:2], x[:2])
    except TypeError as error:
        raise SetupError(
            f"estimator must be a callable (theta (M, D), x (M, *X)) -> (M,) returning a "
            f"log-ratio or log-likelihood when the callback has a prior, got "
            f"{type(posterior.module).__name__}, whose call f(theta, x) failed: {error}"
        ) from None
    except ValueError:
        raise
    except Exception:  # not a mistake in the data: the check reports it
        return
