r"""The recalibrated posterior: a posterior whose latent space goes through a fitted
:class:`~.radial.LatentMap` first (the map and its math are in
:mod:`~calib_lightning.recalibration.radial`; how ``method="auto"`` chose it, in
:mod:`~calib_lightning.recalibration.selection`)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.distributions import Distribution

from calib_lightning.recalibration._module import PosteriorModule
from calib_lightning.recalibration.radial import (
    IDENTITY_TOLERANCE,  # noqa: F401  (named in is_identity's docstring)
    LatentMap,
    LatentMapTransform,
    standard_normal_log_prob,
)
from calib_lightning.recalibration.selection import Selection

__all__ = ["RecalibratedPosterior"]


class RecalibratedPosterior(PosteriorModule):
    """A posterior whose latent space goes through a fitted :class:`~.radial.LatentMap` first.

    Built by :func:`calib_lightning.recalibrate`; accepted by every metric, callback and
    ``cl.diagnose`` like the posterior it wraps. An ``nn.Module``
    (:class:`~._module.PosteriorModule`): ``fixed(x)`` is the recalibrated distribution
    (for a zuko flow, a ``NormalizingFlow`` whose transform is the flow's followed by
    :math:`g`, with ``rsample``), and ``state_dict`` holds the wrapped estimator's
    weights (``estimator.*``), the map (``latent_map.log_scale``, ``latent_map.knots``,
    ``latent_map.marginal_knots``)
    and what was fitted (``method``, ``scale_target``, ``selection``, as plain values).

    To load a saved state, build the same structure with the map left empty and load it:

    >>> import zuko
    >>> flow = zuko.flows.NSF(2, 2, transforms=1)
    >>> fresh = RecalibratedPosterior(flow, 2)  # the identity map of D = 2
    >>> fresh.is_identity
    True

    then ``fresh.load_state_dict(torch.load(path, weights_only=True))`` (the knots take
    the saved size).

    Arguments:
        posterior: anything :func:`calib_lightning.as_posterior` accepts, with
            ``to_latent`` and ``from_latent``.
        latent_map: the fitted map, or ``D`` for the identity map (to load a state into).
        method: the name of the method that fitted it (shown in the ``repr``).
        selection: what ``method="auto"`` scored
            (:class:`~calib_lightning.recalibration.selection.Selection`, or its
            :meth:`~calib_lightning.recalibration.selection.Selection.state`).
        scale_target: how the scales were fitted (``"latent"``, ``"hpd"``, or ``""``).

    Attributes:
        inner: the wrapped :class:`~calib_lightning.posteriors.Posterior`.
        latent_map: the :class:`~.radial.LatentMap`.
        method: what was fitted (``"none"``, ``"scale"``, ``"radial"``,
            ``"scale+radial"``, ``"marginal"``, ``"marginal+radial"``).
        selection: the :class:`~calib_lightning.recalibration.selection.Selection` table
            of ``method="auto"``, or ``None``.
    """

    def __init__(
        self,
        posterior: Any,
        latent_map: LatentMap | int,
        method: str = "",
        selection: Any = None,
        scale_target: str = "",
    ) -> None:
        super().__init__(posterior)
        if isinstance(latent_map, int):
            latent_map = LatentMap(latent_map)
        if not isinstance(latent_map, LatentMap):
            raise ValueError(f"latent_map must be a LatentMap or an int D, got {latent_map!r}")
        self.latent_map = latent_map
        self.method, self.scale_target = method, scale_target
        self.selection = Selection.from_state(selection)

    @property
    def is_identity(self) -> bool:
        """Whether the fitted map is the identity (:meth:`~.radial.LatentMap.is_identity`, within
        :data:`~.radial.IDENTITY_TOLERANCE`): the posterior is then the wrapped one, unchanged."""
        return self.latent_map.is_identity()

    def __repr__(self) -> str:
        words = [f"method={self.method!r}"]
        if "scale" in self.method and self.scale_target:
            words.append(f"scale_target={self.scale_target!r}")
        if self.selection is not None:
            words.append("picked by 'auto'")
        words.append(
            "identity: the fit changed nothing" if self.is_identity else self.latent_map.describe()
        )
        return f"RecalibratedPosterior({self.inner!r}, {', '.join(words)})"

    def get_extra_state(self) -> dict[str, Any]:
        """What was fitted, as plain values (``torch.load(..., weights_only=True)`` reads
        them)."""
        selection = None if self.selection is None else self.selection.state()
        return {"method": self.method, "scale_target": self.scale_target, "selection": selection}

    def set_extra_state(self, state: Any) -> None:
        self.method = str(state.get("method", ""))
        self.scale_target = str(state.get("scale_target", ""))
        self.selection = Selection.from_state(state.get("selection"))

    def event_size(self) -> int | None:
        return self.latent_map.log_scale.numel()

    def forward(self, x: Tensor) -> Distribution:
        """The recalibrated distribution at ``x (N, *X)``: for a zuko flow over a
        diagonal normal base, the ``NormalizingFlow`` of the flow's transform followed by
        :math:`g` in the standardized base (:class:`~.radial.LatentMapTransform`): ``log_prob``,
        ``sample`` and ``rsample``, with gradients to the flow's weights; else a
        :class:`~._module.ConditionalDistribution`."""
        from calib_lightning.posteriors import DistributionPosterior
        from calib_lightning.recalibration._hpd import _zuko_flow_on_normal

        if isinstance(self.inner, DistributionPosterior):
            dist = self.inner.distribution(x)
            if _zuko_flow_on_normal(dist):
                from zuko.distributions import NormalizingFlow
                from zuko.transforms import ComposedTransform

                normal = dist.base.base_dist
                recalibrated = LatentMapTransform(self.latent_map, normal.loc, normal.scale)
                transform = ComposedTransform(dist.transform, recalibrated)
                return NormalizingFlow(transform, dist.base)
        return super().forward(x)

    def _density_change(self, z: Tensor) -> tuple[Tensor, Tensor]:
        """``u = g(z)`` and ``log q' - log q`` at the same ``theta``."""
        u, log_det = self.latent_map(z)
        return u, standard_normal_log_prob(u) - standard_normal_log_prob(z) + log_det

    def log_prob(self, theta: Tensor, x: Tensor) -> Tensor:
        z = self.inner.to_latent(theta, x)
        return self.inner.log_prob(theta, x) + self._density_change(z)[1]

    def to_latent(self, theta: Tensor, x: Tensor) -> Tensor:
        return self.latent_map(self.inner.to_latent(theta, x))[0]

    def from_latent(self, z: Tensor, x: Tensor) -> Tensor:
        return self.inner.from_latent(self.latent_map.inverse(z), x)

    def log_prob_and_latent(self, theta: Tensor, x: Tensor) -> tuple[Tensor, Tensor]:
        log_q, z = self.inner.log_prob_and_latent(theta, x)
        u, change = self._density_change(z)
        return log_q + change, u

    def sample(self, x: Tensor, num_posterior_samples: int) -> Tensor:
        x_model, out = self._sampling_inputs(x, num_posterior_samples)
        shape = (num_posterior_samples, x_model.shape[0], self.event_size())
        u = torch.randn(shape, dtype=x_model.dtype, device=x_model.device)
        with torch.no_grad():
            return self.from_latent(u, x_model).to(out)
