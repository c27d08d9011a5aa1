r"""What makes a recalibrated posterior a deployable module: :class:`PosteriorModule`.

The posteriors :func:`calib_lightning.recalibrate` returns are :class:`torch.nn.Module` s
and :class:`~calib_lightning.posteriors.Posterior` s at once:

* as modules they hold the wrapped estimator (when it is a module: a zuko flow, an nflows
  ``Flow``, an sbi estimator) and the fitted map as children, so ``state_dict`` /
  ``load_state_dict``, ``.to(device)``, ``.eval()``, ``parameters()`` and ``torch.save``
  work as for the flow, and a ``LightningModule`` that holds one trains, moves and
  checkpoints it;
* called on observations, ``fixed(x)`` returns a distribution with batch shape ``(N,)``
  and event shape ``(D,)``, like the flow: a zuko ``NormalizingFlow`` (``rsample``
  included) when the wrapped estimator is a zuko flow, else a
  :class:`ConditionalDistribution` over the posterior's own ``log_prob`` and ``sample``;
* as posteriors, every metric, callback and ``cl.diagnose`` accept them
  (``cl.as_posterior`` returns them as they are).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributions import Distribution, constraints

from calib_lightning.posteriors import Posterior, WrappedPosterior, as_posterior

__all__ = ["ConditionalDistribution", "PosteriorModule"]


class PosteriorModule(nn.Module, WrappedPosterior):
    """Base of the recalibrated posteriors: an ``nn.Module`` around a wrapped posterior.

    Children: ``inner`` when the wrapped posterior is itself a module (a recalibrated
    posterior restricted to the support), else ``estimator``, the wrapped model when it is
    a module (its weights are part of ``state_dict``; a plain callable has none).

    Arguments:
        posterior: anything :func:`calib_lightning.as_posterior` accepts.
    """

    def __init__(self, posterior: Any) -> None:
        nn.Module.__init__(self)
        inner = as_posterior(posterior)
        self.inner = inner  # a module child when it is one, else a plain attribute
        if not isinstance(inner, nn.Module) and isinstance(inner.module, nn.Module):
            self.estimator = inner.module

    @property
    def module(self) -> Any:  # type: ignore[override]
        """The wrapped estimator (what :class:`~calib_lightning.posteriors.Posterior`
        keeps so that callers can reach its parameters)."""
        return self.inner.module

    @property
    def is_identity(self) -> bool:
        """Whether the posterior is the wrapped one, unchanged."""
        raise NotImplementedError

    def forward(self, x: Tensor) -> Distribution:
        """The recalibrated conditional distribution at ``x (N, *X)``: batch shape
        ``(N,)``, event shape ``(D,)``."""
        return ConditionalDistribution(self, x)

    def __repr__(self) -> str:  # the one-line Posterior form, not the module tree
        return WrappedPosterior.__repr__(self)


class ConditionalDistribution(Distribution):
    r"""The distribution of a :class:`~calib_lightning.posteriors.Posterior` at
    observations ``x (N, *X)``: batch shape ``(N,)``, event shape ``(D,)``.

    ``log_prob(theta)`` takes ``theta (*, N, D)`` and keeps the graph (a loss through it
    trains the wrapped estimator); ``sample(shape)`` draws ``(*shape, N, D)`` without
    gradient. No ``rsample``: only a zuko flow's recalibrated distribution (a
    ``NormalizingFlow``) has one.

    Arguments:
        posterior: the posterior.
        x: observations ``(N, *X)``.
    """

    arg_constraints: dict[str, constraints.Constraint] = {}  # noqa: RUF012
    support = constraints.real_vector
    has_rsample = False

    def __init__(self, posterior: Posterior, x: Tensor) -> None:
        if not isinstance(x, Tensor) or x.ndim < 2:
            raise ValueError(
                f"x must be a tensor of shape (N, *X), got {getattr(x, 'shape', type(x))}"
            )
        self.posterior, self.x = posterior, x
        dim = posterior.event_size()
        if dim is None:  # read it from one draw (no gradient)
            dim = int(posterior.sample(x[:1], 1).shape[-1])
        super().__init__(torch.Size([x.shape[0]]), torch.Size([dim]), validate_args=False)

    def log_prob(self, value: Tensor) -> Tensor:
        """``log q(value | x)``: ``value (*, N, D)`` -> ``(*, N)``."""
        return self.posterior.log_prob(value, self.x)

    def sample(self, sample_shape: torch.Size | tuple[int, ...] = ()) -> Tensor:
        """Draws ``(*sample_shape, N, D)``, no gradient."""
        shape = torch.Size(sample_shape)
        draws = self.posterior.sample(self.x, max(1, math.prod(shape)))
        return draws.reshape(*shape, *draws.shape[1:])

    def __repr__(self) -> str:
        return f"ConditionalDistribution({self.posterior!r}, N={self.batch_shape[0]})"
