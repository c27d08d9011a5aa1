"""The :class:`Posterior` base class and the input checks every adapter shares.

Adapters (the other modules of :mod:`calib_lightning.posteriors`) subclass
:class:`Posterior`; see the package docstring for the shape and dtype conventions.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from calib_lightning._utils.validation import (
    as_float,
    check_device,
    check_positive,
    model_device,
    model_dtype,
    model_errors,
)

__all__ = [
    "CAPABILITIES",
    "NotDifferentiableError",
    "Posterior",
    "Recognized",
    "UnsupportedError",
    "check_width",
    "density_draws",
    "supports",
    "unsupported",
]

#: what a posterior can compute, and the checks that need each capability
CAPABILITIES: dict[str, str] = {
    "sample": "RankCalibration, TARP, recovery, LC2ST and the reference distances",
    "log_prob": (
        "KCCSD (through the score), the calibration losses and the joint energy rank of "
        "RankCalibration (a samples-only posterior gets the distance rank instead)"
    ),
    "score": "KCCSD and KCCSDLoss",
    "to_latent": "LatentCalibration, LC2STNF and the latent losses",
}


def _check_x(x: Tensor) -> Tensor:
    if not isinstance(x, Tensor):
        raise ValueError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.ndim < 2:
        raise ValueError(
            f"x must have shape (N, X) with a leading batch dimension, got {tuple(x.shape)}"
        )
    return x


def _check_theta(theta: Tensor, x: Tensor) -> Tensor:
    if not isinstance(theta, Tensor):
        raise ValueError(f"theta must be a torch.Tensor, got {type(theta).__name__}")
    if theta.ndim < 2 or theta.shape[-2] != x.shape[0]:
        raise ValueError(
            f"theta must have shape (*, N, D) with N = {x.shape[0]} (the rows of x), "
            f"got {tuple(theta.shape)}"
        )
    return theta


def _check_num_posterior_samples(num_posterior_samples: int) -> int:
    check_positive("num_posterior_samples", num_posterior_samples, integer=True)
    return num_posterior_samples


def check_width(theta: Tensor, size: int | None) -> None:
    if size is not None and theta.shape[-1] != size:
        raise ValueError(
            f"theta must have D = {size} columns like the posterior's event shape "
            f"({size},), got shape {tuple(theta.shape)}"
        )


def _context_fits(x: Tensor, expected: tuple[int, ...]) -> bool:
    """Whether one observation of ``x (N, *X)`` has the shape ``expected``."""
    return tuple(x.shape[1:]) == tuple(expected)


def _out_dtype(x: Tensor, model: torch.dtype | None) -> torch.dtype:
    """Dtype of samples: ``x``'s when floating, else the model's (or torch's default)."""
    if x.is_floating_point():
        return x.dtype
    return model or torch.get_default_dtype()


def supports(posterior: Any, capability: str) -> bool:
    """Whether ``posterior`` (a :class:`Posterior`) declares ``capability``, one of
    :data:`CAPABILITIES`."""
    if capability not in CAPABILITIES:
        raise ValueError(f"capability must be one of {list(CAPABILITIES)}, got {capability!r}")
    return capability in getattr(posterior, "capabilities", CAPABILITIES)


def density_draws(posterior: Any) -> bool:
    """Whether draws of ``posterior`` come with their log-densities by default: it provides
    ``log_prob`` at about the cost of sampling (not in its ``costly``). Otherwise the
    sampling checks draw samples only (the joint rank is then the distance rank)."""
    costly = getattr(posterior, "costly", frozenset())
    return supports(posterior, "log_prob") and "log_prob" not in costly


#: what an estimator can be read as: a posterior q(theta | x), a likelihood q(x | theta), a
#: ratio r(theta, x), or ``"unnormalized"``: a likelihood or a ratio, it does not say which
READINGS = ("posterior", "likelihood", "ratio", "unnormalized")


@dataclass(frozen=True)
class Recognized:
    r"""What an adapter module's ``recognize(obj)`` makes of an object it knows.

    Attributes:
        what: the object in words, for messages (``"an sbi RatioEstimator"``).
        readings: what it can be read as, among :data:`READINGS`.
        default: the reading when the caller declares nothing (no ``prior``, no
            ``kind``); ``None`` when the object cannot tell (an sbi density estimator with
            ``dim theta = dim x``).
        posterior: builds the normalized adapter (the reading ``"posterior"``).
        log_likelihood: :math:`f(\theta, x)`, a batched callable ``(theta (M, D),
            x (M, *X)) -> (M,)``, for the other readings.
        shapes: for each reading, ``(D, X)``: the width of ``theta`` and the shape of one
            ``x`` that reading implies, ``None`` where the object does not say.
        prior: a prior the object carries (an sbi ``MCMCPosterior``'s potential).
    """

    what: str
    readings: tuple[str, ...]
    default: str | None
    posterior: Callable[[], Posterior] | None = None
    log_likelihood: Any = None
    shapes: dict[str, tuple[int | None, tuple[int, ...] | None]] = field(default_factory=dict)
    prior: Any = None

    def fits(self, reading: str, size: int | None, context: tuple[int, ...] | None) -> bool:
        """Whether ``theta`` of width ``size`` and one ``x`` of shape ``context`` (each
        ``None``: not known) fit ``reading``'s shapes."""
        expected_size, expected_context = self.shapes.get(reading, (None, None))
        return (expected_size is None or size is None or expected_size == size) and (
            expected_context is None or context is None or tuple(expected_context) == context
        )


class UnsupportedError(ValueError):
    """A posterior cannot compute what a check needs (a capability it lacks, found from its
    ``capabilities`` or only when the model runs); ``cl.diagnose`` skips that check."""


def unsupported(posterior: Any, capability: str) -> UnsupportedError:
    """The error for a method ``posterior`` cannot support: which capability is missing
    and which checks need it."""
    return UnsupportedError(
        f"{type(posterior).__name__} does not provide {capability}, which "
        f"{CAPABILITIES[capability]} need; it provides "
        f"{', '.join(sorted(posterior.capabilities))}"
    )


class NotDifferentiableError(UnsupportedError):
    """A posterior's log-density has no gradient in ``theta``, hence no score: raised by
    :meth:`Posterior.score` (so by KCCSD and KCCSDLoss); ``cl.diagnose`` skips KCCSD."""


class Posterior:
    r"""Base class: a conditional density :math:`q(\theta \mid x)` with a fixed interface.

    Subclasses implement :meth:`sample`, :meth:`log_prob` and :meth:`to_latent`;
    :meth:`score` and :meth:`sample_and_log_prob` have generic implementations. An
    adapter that cannot support some of them (samples only, no inverse map) lists what
    it can in :attr:`capabilities`; the others raise :func:`unsupported`'s error.

    Arguments:
        module: the wrapped estimator (kept so callers can reach its parameters).

    Attributes:
        capabilities: the :data:`CAPABILITIES` the adapter provides (every one by
            default; a flow whose base is not normal still raises from ``to_latent``).
        costly: the capabilities it provides only at many times the cost of sampling
            (a continuous flow's ``log_prob`` integrates a trace along its ODE, its
            ``score`` differentiates that solve): the checks then take their cheaper
            form (:func:`density_draws`: the distance rank; ``cl.diagnose`` leaves out
            KCCSD unless asked for it).
    """

    capabilities: frozenset[str] = frozenset(CAPABILITIES)
    costly: frozenset[str] = frozenset()

    def __init__(self, module: Any) -> None:
        self.module = module

    def __repr__(self) -> str:
        return f"{type(self).__name__}({type(self.module).__name__})"

    @property
    def dtype(self) -> torch.dtype | None:
        """The model's floating dtype (its parameters'), ``None`` if it has none."""
        return model_dtype(self.module)

    @property
    def device(self) -> torch.device | None:
        """The model's device (its parameters'), ``None`` if it has none."""
        return model_device(self.module)

    def event_size(self) -> int | None:
        """``D``, the width of ``theta``, when known without evaluating the model."""
        return None

    def context_shape(self) -> tuple[int, ...] | None:
        """Shape of one observation ``X`` the model was built for, when known."""
        return None

    def check_reading(self, theta: Tensor | None, x: Tensor) -> None:
        """Raise a ``ValueError`` where ``theta (N, D)`` and ``x (N, *X)`` fit another
        reading of the model than this adapter's (an sbi density estimator given data
        shaped for a likelihood); nothing by default."""

    def _prepare_x(self, x: Tensor) -> Tensor:
        """``x`` checked against the context shape and the model's device, and cast to the
        model's dtype."""
        x = _check_x(x)
        check_device("x", x, self.device)
        expected = self.context_shape()
        if expected is not None and not _context_fits(x, expected):
            raise ValueError(
                f"x must have shape (N, {', '.join(map(str, expected))}) for this "
                f"posterior's context, got {tuple(x.shape)}"
            )
        return as_float(x, self.dtype)

    def _sampling_inputs(self, x: Tensor, num_posterior_samples: int) -> tuple[Tensor, torch.dtype]:
        """``x`` prepared for the model (:meth:`_prepare_x`), and the dtype draws are
        returned in (``x``'s when floating, else the model's); ``num_posterior_samples`` checked."""
        _check_num_posterior_samples(num_posterior_samples)
        return self._prepare_x(x), _out_dtype(_check_x(x), self.dtype)

    def _prepare_theta(self, theta: Tensor, x: Tensor, size: int | None = None) -> Tensor:
        """``theta`` checked against ``N``, the event size (``size`` or :meth:`event_size`)
        and cast to the model's dtype."""
        theta = _check_theta(theta, x)
        check_device("theta", theta, self.device)
        if not theta.is_floating_point():
            raise ValueError(f"theta must have a floating dtype, got {theta.dtype}")
        check_width(theta, self.event_size() if size is None else size)
        return theta.to(self.dtype or theta.dtype)

    def _errors(self, theta: Tensor | None, x: Tensor, size: int | None = None) -> Any:
        """Translate the model's shape/dtype errors (``size``: the event size checked)."""
        expected = self.context_shape()
        context = None if expected is None else f"shape {tuple(expected)}"
        size = self.event_size() if size is None else size
        return model_errors(theta, x, dtype=self.dtype, context=context, event_size=size)

    def sample(self, x: Tensor, num_posterior_samples: int) -> Tensor:
        """Draw ``num_posterior_samples`` parameters per observation: ``(S, N, D)``, no gradient."""
        raise NotImplementedError

    def log_prob(self, theta: Tensor, x: Tensor) -> Tensor:
        """Log-density of ``theta`` ``(*, N, D)`` under ``q(. | x)``: ``(*, N)``."""
        raise NotImplementedError

    def to_latent(self, theta: Tensor, x: Tensor) -> Tensor:
        """Map ``theta`` ``(*, N, D)`` to the standard-normal base space: ``(*, N, D)``."""
        raise NotImplementedError

    def from_latent(self, z: Tensor, x: Tensor) -> Tensor:
        """The inverse of :meth:`to_latent`: ``z`` ``(*, N, D)`` in the base space to
        ``theta`` ``(*, N, D)`` (what a recalibrated posterior samples through)."""
        raise UnsupportedError(
            f"{type(self).__name__} has no map from its latent space back to theta "
            "(from_latent), which sampling a recalibrated posterior needs"
        )

    def log_prob_and_latent(self, theta: Tensor, x: Tensor) -> tuple[Tensor, Tensor]:
        """``(log_prob, to_latent)`` of ``theta`` ``(N, D)``: ``(N,)`` and ``(N, D)``, with
        their graphs. Flows override this to share one pass of the network."""
        return self.log_prob(theta, x), self.to_latent(theta, x)

    def sample_and_log_prob(self, x: Tensor, num_posterior_samples: int) -> tuple[Tensor, Tensor]:
        """Samples ``(S, N, D)`` and their log-densities ``(S, N)``, without gradient.

        Flows override this to reuse the sampling pass for the density.
        """
        with torch.no_grad():
            theta = self.sample(x, num_posterior_samples)
            return theta, self.log_prob(theta, x)

    def score(self, theta: Tensor, x: Tensor, *, create_graph: bool = False) -> Tensor:
        r"""Score :math:`\nabla_\theta \log q(\theta \mid x)`, shape ``(*, N, D)``.

        Computed by autograd through the estimator. With ``create_graph=True`` the
        result stays differentiable with respect to the estimator's parameters
        (needed for calibration losses); ``theta`` itself is treated as data.

        Raises:
            NotDifferentiableError: a ``ValueError``, when ``log_prob`` has no gradient
                with respect to ``theta``.
        """
        grad, _ = self._autograd_score(
            self.log_prob,
            theta,
            x,
            create_graph,
            "whose log_prob has no gradient with respect to theta (a piecewise-constant "
            "density such as a box uniform, or one computed under torch.no_grad)",
        )
        return grad

    def _autograd_score(
        self,
        density: Any,
        theta: Tensor,
        x: Tensor,
        create_graph: bool,
        why: str,
        finite_only: bool = False,
    ) -> tuple[Tensor, Tensor]:
        """``(grad_theta density(theta, x), density)`` by autograd, ``theta`` as data; with
        ``finite_only`` the non-finite values of ``density`` add no gradient. Raises a
        :class:`NotDifferentiableError` ending with ``why`` when no gradient reaches theta."""
        x = _check_x(x)
        theta = _check_theta(theta, x)
        if not theta.is_floating_point():
            raise ValueError(f"theta must have a floating dtype, got {theta.dtype}")
        with torch.enable_grad():
            leaf = theta.detach().requires_grad_(True)
            value = density(leaf, x)
            grad = None
            if value.requires_grad:  # else computed without a graph (torch.no_grad)
                total = torch.where(torch.isfinite(value), value, 0.0) if finite_only else value
                (grad,) = torch.autograd.grad(
                    total.sum(), leaf, create_graph=create_graph, allow_unused=True
                )
        if grad is None:  # no graph, or one that does not reach theta (a box uniform)
            raise NotDifferentiableError(
                "the score (KCCSD, KCCSDLoss) needs a log-density differentiable in theta, "
                f"got {self!r} {why}"
            )
        return grad, value.detach()
