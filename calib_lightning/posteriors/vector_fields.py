r"""sbi's vector-field estimators: flow matching (``FMPE``) and score-based (``NPSE``).

Both define :math:`q(\theta \mid x)` through the probability-flow ODE
:math:`d\theta_t = v(\theta_t, t; x)\,dt` between the data at :math:`t_{\min}` and a
Gaussian base :math:`N(\mu_b, \mathrm{diag}(\sigma_b^2))` at :math:`t_{\max}`.
:class:`VectorFieldPosterior` evaluates it through sbi's own neural ODE (the zuko
``NormalizingFlow`` that sbi 0.27 builds with ``build_neural_ode``, its
``FreeFormJacobianTransform`` integrating all pairs and draws of a call as one batch):

* ``sample``: the sampler the user chose on sbi's ``VectorFieldPosterior``
  (``sample_with="ode"`` or ``"sde"``, without sbi's prior-support rejection, as for
  ``DirectPosterior``); a bare estimator samples through the ODE;
* ``log_prob``: the instantaneous change of variables along the ODE (an exact trace
  along the path: expensive);
* ``to_latent``: the ODE's map of :math:`\theta` to :math:`t_{\max}`, standardized,
  :math:`z = (\phi(\theta; x) - \mu_b) / \sigma_b`, standard normal when
  :math:`\theta \sim q(\cdot \mid x)` (no trace: the cheap direction; then
  ``LatentCalibration`` and ``LC2STNF`` apply);
* ``score``: for a score estimator (``NPSE``) the network's score at :math:`t_{\min}`;
  for a flow-matching estimator (``FMPE``) the score of the ODE's density, by autograd
  through ``log_prob`` (see :class:`VectorFieldPosterior`).

Samples of sbi's SDE sampler follow the SDE's law, the log-density and the latents the
ODE's: with ``sample_with="sde"``, the sampling checks (ranks, TARP, L-C2ST) test the
SDE's :math:`q` and the latent checks the ODE's.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.distributions import Distribution
from torch.distributions.transforms import AffineTransform
from zuko.distributions import NormalizingFlow
from zuko.transforms import ComposedTransform

from calib_lightning.posteriors.base import Posterior, Recognized
from calib_lightning.posteriors.distributions import DistributionPosterior

__all__ = ["VectorFieldPosterior", "recognize", "vector_field_estimator"]


def vector_field_estimator(obj: object) -> Any | None:
    """The sbi ``ConditionalVectorFieldEstimator`` behind ``obj`` (the estimator itself or
    sbi's ``VectorFieldPosterior``), or ``None``."""
    if not type(obj).__module__.startswith("sbi."):
        return None
    try:
        from sbi.neural_nets.estimators.base import ConditionalVectorFieldEstimator
    except ImportError:  # pragma: no cover - sbi < 0.25
        return None
    estimator = getattr(obj, "vector_field_estimator", obj)
    return estimator if isinstance(estimator, ConditionalVectorFieldEstimator) else None


def recognize(obj: object) -> Recognized | None:
    """An sbi vector-field estimator or ``VectorFieldPosterior`` is a posterior estimator."""
    estimator = vector_field_estimator(obj)
    if estimator is None:
        return None
    return Recognized(
        f"an sbi {type(obj).__name__} (a vector-field posterior estimator)",
        ("posterior",),
        "posterior",
        lambda: VectorFieldPosterior(obj),
    )


class _ODEFlow(nn.Module):
    """``x -> `` sbi's probability-flow ODE at ``x``: a zuko ``NormalizingFlow`` with batch
    shape ``(N,)`` and event shape ``(D,)``; with sbi's composed standardization, the ODE
    runs on ``z = (theta - shift) / scale`` and the flow starts with that affine map."""

    def __init__(self, estimator: nn.Module, neural_ode: Any) -> None:
        super().__init__()
        self.estimator, self.neural_ode = estimator, neural_ode

    def forward(self, x: Tensor) -> Distribution:
        flow = self.neural_ode(x)
        if not self.estimator.compose_enabled:
            return flow
        shift, scale = self.estimator._theta_shift[0], self.estimator._theta_scale[0]
        to_z = AffineTransform(-shift / scale, 1 / scale, event_dim=1)
        return NormalizingFlow(ComposedTransform(to_z, flow.transform), flow.base)


class VectorFieldPosterior(DistributionPosterior):
    r"""Adapter for sbi's ``FlowMatchingEstimator`` (``FMPE``) and
    ``ConditionalScoreEstimator`` (``NPSE``), alone or inside sbi's
    ``VectorFieldPosterior`` (module docstring: what each method computes).

    **Score.** A score estimator's score is the network's at :math:`t_{\min}`, the
    smallest diffusion time (differentiable in its parameters with
    ``create_graph=True``). A flow-matching estimator is trained on velocities only, and
    the score sbi derives from the velocity at :math:`t_{\min} = 0`,
    :math:`(-v - \theta) / \sigma_{\min}`, divides the network's error by
    :math:`\sigma_{\min}` (``1e-3``); its score here is instead the gradient of the
    ODE's log-density (``log_prob``) by autograd through zuko's adjoint ODE solve: the
    score of the density the other checks use, one ODE solve per point (KCCSD evaluates
    it at every pair and base point; its cost:
    ``examples/benchmarks/results/estimator_cost.md``). The adjoint gives no gradient in
    the network's parameters, so ``create_graph=True`` (the calibration losses) raises
    a ``ValueError`` for it.

    With sbi's composed standardization (``compose_standardization=True``) the ODE runs
    on :math:`z = (\theta - \text{shift}) / \text{scale}`: the adapter composes that affine
    map into the flow (densities, latents, ODE draws) and the score; sbi 0.27 cannot draw
    such an estimator's SDE samples for a batch of ``x``, so ``sample_with="sde"`` then
    raises a ``ValueError``.

    Arguments:
        module: the estimator, or sbi's ``VectorFieldPosterior`` (its ODE settings and
            its ``sample_with`` are then used).

    ``tests/test_vector_fields.py`` shows it on an FMPE and an NPSE trained for seconds.

    References:
        Song et al. "Score-Based Generative Modeling through Stochastic Differential
        Equations." ICLR 2021 (the probability-flow ODE). Grathwohl et al. "FFJORD."
        ICLR 2019 (its log-density). Wildberger et al. "Flow Matching for Scalable
        Simulation-Based Inference." NeurIPS 2023. Sharrock et al. "Sequential Neural
        Score Estimation." ICML 2024.
    """

    def __init__(self, module: Any) -> None:
        estimator = vector_field_estimator(module)
        if estimator is None:
            raise ValueError(
                "module must be an sbi FlowMatchingEstimator, ConditionalScoreEstimator or "
                f"VectorFieldPosterior, got {type(module).__name__}"
            )
        potential = getattr(module, "potential_fn", None)
        neural_ode = getattr(potential, "neural_ode", None)
        if neural_ode is None:
            from sbi.samplers.ode_solvers import build_neural_ode

            neural_ode = build_neural_ode(
                estimator.ode_fn,
                estimator.net,
                estimator.mean_base,
                estimator.std_base,
                estimator.condition_shape,
                t_min=estimator.t_min,
                t_max=estimator.t_max,
            )
        super().__init__(_ODEFlow(estimator, neural_ode))
        self.estimator = estimator
        self.posterior = module if module is not estimator else None
        self.sample_with = getattr(self.posterior, "sample_with", "ode")
        self.flow_matching = _is_flow_matching(estimator)
        # the trace along the ODE (log_prob), and for flow matching its adjoint (score)
        self.costly = frozenset({"log_prob", "score"} if self.flow_matching else {"log_prob"})

    def __repr__(self) -> str:
        return f"VectorFieldPosterior({type(self.estimator).__name__}, {self.sample_with})"

    def event_size(self) -> int | None:
        shape = self.estimator.input_shape
        return int(shape[-1]) if len(shape) == 1 else None

    def context_shape(self) -> tuple[int, ...] | None:
        return tuple(int(s) for s in self.estimator.condition_shape)

    def sample(self, x: Tensor, num_posterior_samples: int) -> Tensor:
        if self.posterior is None or self.sample_with == "ode":
            return super().sample(x, num_posterior_samples)
        if self.estimator.compose_enabled:
            raise ValueError(
                "sbi 0.27 cannot draw SDE samples for a batch of x from an estimator with "
                "compose_standardization: build its posterior with sample_with='ode'"
            )
        inner, out = self._sampling_inputs(x, num_posterior_samples)
        per_batch = max(1, min(num_posterior_samples, 100_000 // inner.shape[0]))  # sbi's cap
        with torch.no_grad(), self._errors(None, inner):
            samples = self.posterior.sample_batched(
                (num_posterior_samples,),
                inner,
                reject_outside_prior=False,
                show_progress_bars=False,
                max_sampling_batch_size=per_batch,
            )
        return samples.reshape(num_posterior_samples, inner.shape[0], -1).to(out)

    def sample_and_log_prob(self, x: Tensor, num_posterior_samples: int) -> tuple[Tensor, Tensor]:
        # with an SDE sampler the draws do not come from the ODE: sample, then log_prob
        # (for the ODE, zuko's joint pass costs the same: the trace dominates)
        with torch.no_grad():
            theta = self.sample(x, num_posterior_samples)
            return theta, self.log_prob(theta, x)

    def score(self, theta: Tensor, x: Tensor, *, create_graph: bool = False) -> Tensor:
        if self.flow_matching:
            if create_graph:
                raise ValueError(
                    "create_graph=True needs a score differentiable in the estimator's "
                    "parameters: a flow-matching estimator's score is the gradient of its "
                    "ODE's log-density, and the ODE's adjoint gives none (calibration "
                    "losses do not apply to FMPE)"
                )
            return Posterior.score(self, theta, x)
        inner_x = self._prepare_x(x)
        inner = self._prepare_theta(theta, inner_x)
        time, compose = inner.new_tensor(self.estimator.t_min), self.estimator.compose_enabled
        with torch.set_grad_enabled(create_graph), self._errors(inner, inner_x):
            z = self.estimator.to_z(inner) if compose else inner
            score = self.estimator.score(z, inner_x, time)
            score = score / self.estimator._theta_scale if compose else score
        return score.to(theta.dtype)


def _is_flow_matching(estimator: Any) -> bool:
    from sbi.neural_nets.estimators.flowmatching_estimator import FlowMatchingEstimator

    return isinstance(estimator, FlowMatchingEstimator)
