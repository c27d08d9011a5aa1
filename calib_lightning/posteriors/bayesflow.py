r"""BayesFlow 2's ``ContinuousApproximator`` on Keras' torch backend, as a posterior.

On ``KERAS_BACKEND=torch`` a BayesFlow approximator is a torch module: its inference
network maps the standardized parameters to a latent space and back, with a log-density,
on torch tensors. :class:`BayesFlowPosterior` runs that pipeline on ``theta (N, D)`` and
``x (N, *X)`` as every adapter does:

* ``x`` goes through the approximator's own ``Adapter`` (a dict ``{name: x}``; several
  condition names split ``x``'s last axis by the widths the adapter concatenates), its
  condition standardization and its summary network (``_prepare_conditions``);
* ``theta`` is the concatenation of the parameters the adapter puts in
  ``inference_variables``, in its order; the approximator's standardization of them is
  honoured (and its log-Jacobian added to the density);
* ``sample``: standard-normal noise drawn with torch's generator (``torch.manual_seed``
  seeds it), mapped by the network's inverse; ``log_prob``: the network's density
  (a coupling flow's change of variables: exact; flow matching: the ODE's trace along the
  path, costly); ``to_latent`` / ``from_latent``: the network's forward and inverse maps,
  standardized by its diagonal normal base; ``score``: autograd through ``log_prob``.

Where the adapter transforms the parameters beyond arranging them (``constrain``, ``log``,
``standardize``, ...), those transforms run in NumPy through the ``Adapter`` (values, and
their log-Jacobian in the density), so nothing has a gradient in ``theta``: no score.

Nothing here imports keras or bayesflow until an approximator is wrapped; ``recognize``
reads the class of the object only.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

from calib_lightning.posteriors.base import (
    CAPABILITIES,
    Posterior,
    Recognized,
    UnsupportedError,
)

__all__ = ["BayesFlowPosterior", "recognize"]

#: adapter transforms that only arrange arrays: theta's columns are the inference variables
_ARRANGING = {"ToArray", "ConvertDType", "Concatenate", "Keep", "Drop", "Rename", "AsSet"}


def _bayesflow_classes(obj: Any) -> list[str]:
    return [c.__name__ for c in type(obj).__mro__ if c.__module__.startswith("bayesflow.")]


def recognize(obj: Any) -> Recognized | None:
    """A BayesFlow ``ContinuousApproximator`` is a posterior estimator (on the torch
    backend: a ``ValueError`` otherwise); another BayesFlow approximator is refused."""
    classes = _bayesflow_classes(obj)
    if not classes:
        return None
    if "ContinuousApproximator" not in classes:
        if "Approximator" in classes:
            raise ValueError(
                "posterior must be a BayesFlow ContinuousApproximator (a density "
                f"q(theta | x)), got a BayesFlow {type(obj).__name__}, which estimates no "
                "density of the parameters (point estimates, ratios or model probabilities)"
            )
        return None
    check_backend()
    return Recognized(
        f"a BayesFlow {type(obj).__name__} (a posterior estimator)",
        ("posterior",),
        "posterior",
        lambda: BayesFlowPosterior(obj),
    )


def check_backend() -> None:
    """A ``ValueError`` unless Keras runs on its torch backend."""
    keras = sys.modules.get("keras")
    backend = keras.backend.backend() if keras is not None else None
    if backend != "torch":
        raise ValueError(
            "a BayesFlow approximator must run on Keras' torch backend (set "
            "KERAS_BACKEND=torch before importing bayesflow or keras), got the "
            f"{backend!r} backend: the checks need its networks as torch modules, with "
            "their log-densities, inverses and gradients on torch tensors"
        )


def _concatenated(adapter: Any, into: str) -> tuple[list[str], list[int] | None] | None:
    """The keys the adapter concatenates (or renames) into ``into``, and their widths along
    the last axis once the adapter has seen data (``None`` before)."""
    for transform in getattr(adapter, "transforms", ()):
        name = type(transform).__name__
        if name == "Concatenate" and transform.into == into:
            keys = list(transform.keys)
            indices = transform.indices
            widths = None if indices is None else np.diff([0, *indices]).astype(int).tolist()
            return keys, widths[: len(keys)] if widths is not None else None
        if name == "Rename" and getattr(transform, "to_key", None) == into:
            return [transform.from_key], None
    return None


def _arranging_only(adapter: Any, keys: Sequence[str]) -> bool:
    """Whether every transform of ``adapter`` that touches ``keys`` only arranges arrays."""
    for transform in getattr(adapter, "transforms", ()):
        name = type(transform).__name__
        if name == "FilterTransform":  # one elementwise transform of the keys it selects
            inner = getattr(transform, "transform_constructor", type(transform)).__name__
            touched = set(getattr(transform, "include", None) or keys)
            if inner not in _ARRANGING and touched & set(keys):
                return False
        elif hasattr(transform, "transform_map"):  # an elementwise transform per key
            for key, each in transform.transform_map.items():
                if key in keys and type(each).__name__ not in _ARRANGING:
                    return False
        elif name not in _ARRANGING:
            own = getattr(transform, "keys", None) or [getattr(transform, "key", None)]
            if set(own) & set(keys) or own == [None]:
                return False
    return True


class BayesFlowPosterior(Posterior):
    r"""Adapter for a BayesFlow ``ContinuousApproximator`` on Keras' torch backend (module
    docstring: what each method computes).

    Arguments:
        module: the approximator, trained (its adapter has seen data, so it knows the
            widths it concatenates).
        parameters: the names of the parameters, in theta's column order, when the
            adapter does not say (it concatenates nothing into ``inference_variables``).
        conditions: the names ``x`` stands for, when the adapter does not say; ``x`` is
            split along its last axis between them by the adapter's widths.

    Raises:
        ValueError: on another Keras backend (JAX, TensorFlow), or where the names cannot
            be read from the adapter and are not given.

    Example:
        >>> import os; os.environ.setdefault("KERAS_BACKEND", "torch")  # doctest: +SKIP
        >>> post = cl.as_posterior(approximator)  # doctest: +SKIP
        >>> post.sample(x, 100).shape  # doctest: +SKIP
        torch.Size([100, N, D])

    ``tests/test_bayesflow.py`` shows it on a coupling flow and a flow-matching network
    trained for seconds.
    """

    def __init__(
        self,
        module: Any,
        *,
        parameters: Sequence[str] | None = None,
        conditions: Sequence[str] | None = None,
    ) -> None:
        if "ContinuousApproximator" not in _bayesflow_classes(module):
            raise ValueError(
                f"module must be a BayesFlow ContinuousApproximator, got {type(module).__name__}"
            )
        check_backend()
        super().__init__(module)
        self.adapter, self.network = module.adapter, module.inference_network
        found = _concatenated(self.adapter, "inference_variables")
        names = list(parameters) if parameters is not None else (found[0] if found else None)
        if not names:
            raise ValueError(
                "parameters must name the approximator's inference variables: its Adapter "
                "concatenates nothing into 'inference_variables', got parameters=None"
            )
        self.parameters = names
        self.widths = found[1] if found and found[0] == names else None
        self.conditions, self.condition_widths = self._condition_names(conditions)
        self.arranged = _arranging_only(self.adapter, self.parameters)
        self.flow_matching = "FlowMatching" in [c.__name__ for c in type(self.network).__mro__]
        base = self.network.base_distribution
        self.normal_base = type(base).__name__ == "DiagonalNormal"
        capabilities = set(CAPABILITIES)
        if not self.arranged:
            capabilities.discard("score")
        if not self.normal_base:
            capabilities.discard("to_latent")
        self.capabilities = frozenset(capabilities)
        # an ODE with its trace along the path for the density, its solve for the score
        self.costly = frozenset({"log_prob", "score"} if self.flow_matching else ())

    def __repr__(self) -> str:
        return f"BayesFlowPosterior({type(self.network).__name__}, {self.parameters})"

    def _condition_names(self, conditions: Sequence[str] | None) -> tuple[list[str], list | None]:
        found = [
            part
            for part in (
                _concatenated(self.adapter, "inference_conditions"),
                _concatenated(self.adapter, "summary_variables"),
            )
            if part is not None
        ]
        if conditions is not None:
            names = list(conditions)
            widths = next((w for k, w in found if k == names), None)
            return names, widths
        if len(found) != 1:
            said = (
                "nothing" if not found else "into both inference_conditions and summary_variables"
            )
            raise ValueError(
                "conditions must name what x stands for: the approximator's Adapter "
                f"concatenates {said} ({[k for k, _ in found]}), so x cannot be read as one "
                "of them; got conditions=None (pass calib_lightning.posteriors."
                "BayesFlowPosterior(approximator, conditions=[...]))"
            )
        return found[0]

    def event_size(self) -> int | None:
        return int(sum(self.widths)) if self.widths is not None else None

    # --- the pipeline -------------------------------------------------------------------

    def _model_device(self) -> torch.device:
        return self.device or torch.device("cpu")

    def _split(self, values: np.ndarray, names: list[str], widths: list | None, what: str) -> dict:
        if len(names) == 1:
            return {names[0]: values}
        if widths is None or sum(widths) != values.shape[-1]:
            raise ValueError(
                f"{what} must have its last axis of width {sum(widths) if widths else '?'} "
                f"(the adapter's {names} concatenated), got shape {tuple(values.shape)}"
            )
        cuts = np.cumsum(widths)[:-1]
        return dict(zip(names, np.split(values, cuts, axis=-1), strict=True))

    def _conditions(self, x: Tensor) -> Tensor:
        """``x (N, *X)`` through the adapter, its standardization and summary network:
        the network's conditions ``(N, C)``."""
        dtype = self.dtype or torch.float32
        values = x.detach().cpu().to(dtype).numpy()
        data = self._split(values, self.conditions, self.condition_widths, "x")
        with torch.no_grad():
            # BayesFlow's own inference-time pipeline of the conditions
            resolved, _, _ = self.module._prepare_conditions(data)
        if resolved is None:
            raise ValueError(
                f"x must give the approximator conditions through {self.conditions}, got "
                "none after its adapter"
            )
        return resolved

    def _to_inference(self, theta: Tensor) -> tuple[Tensor, Tensor]:
        """Flat ``theta (M, D)`` as the network's standardized inference variables, and the
        log-Jacobian ``(M,)`` of that map (the adapter's and the standardization's)."""
        dtype, device = self.dtype or torch.float32, self._model_device()
        if self.arranged:
            variables = theta.to(device, dtype)
            adapter_ldj = torch.zeros(theta.shape[0], dtype=dtype, device=device)
        else:
            values = theta.detach().cpu().to(dtype).numpy()
            data = self._split(values, self.parameters, self.widths, "theta")
            adapted, ldj = self.adapter(data, strict=False, log_det_jac=True, stage="inference")
            variables = torch.as_tensor(adapted["inference_variables"], device=device).to(dtype)
            ldj = ldj.get("inference_variables", 0.0)
            adapter_ldj = torch.as_tensor(np.broadcast_to(ldj, values.shape[:1]).copy())
            adapter_ldj = adapter_ldj.to(device, dtype)
        standardized, std_ldj = self.module.standardizer.maybe_standardize(
            variables, key="inference_variables", stage="inference", log_det_jac=True
        )
        std_ldj = torch.as_tensor(std_ldj, device=device, dtype=dtype)
        return standardized, adapter_ldj + std_ldj.expand(theta.shape[0])

    def _from_inference(self, standardized: Tensor) -> Tensor:
        """The inverse of :meth:`_to_inference`: theta ``(M, D)``."""
        variables = self.module.standardizer.maybe_standardize(
            standardized, key="inference_variables", stage="inference", forward=False
        )
        if self.arranged:
            return variables
        values = variables.detach().cpu().numpy()
        data = self.adapter({"inference_variables": values}, inverse=True, strict=False)
        parts = [np.reshape(data[k], (values.shape[0], -1)) for k in self.parameters]
        return torch.as_tensor(np.concatenate(parts, axis=-1), device=variables.device)

    def _base(self, method: str) -> tuple[Tensor, Tensor]:
        if not self.normal_base:
            raise UnsupportedError(
                f"{method} needs a BayesFlow inference network with a DiagonalNormal base "
                f"distribution, got {type(self.network.base_distribution).__name__}"
            )
        base = self.network.base_distribution
        return base._mean, base._std  # the built (maybe trainable) mean and std

    def _flat(self, theta: Tensor, x: Tensor) -> tuple[Tensor, Tensor, torch.Size]:
        """``theta (*, N, D)`` checked and flattened to ``(M, D)``, the conditions repeated
        to ``(M, C)``, and the leading shape."""
        conditions = self._conditions(self._prepare_x(x))
        theta = self._prepare_theta(theta, x)
        lead = theta.shape[:-2]
        flat = theta.reshape(-1, theta.shape[-1])
        reps = lead.numel()
        return flat, conditions.repeat(reps, *([1] * (conditions.ndim - 1))), lead

    def _draw_noise(self, shape: tuple[int, int], device: torch.device) -> Tensor:
        dtype = self.dtype or torch.float32
        return torch.randn(shape, dtype=dtype).to(device)  # torch's generator: seeded

    # --- the interface ------------------------------------------------------------------

    def sample(self, x: Tensor, num_posterior_samples: int) -> Tensor:
        return self._sample(x, num_posterior_samples, density=False)[0]

    def sample_and_log_prob(self, x: Tensor, num_posterior_samples: int) -> tuple[Tensor, Tensor]:
        if self.flow_matching or not self.arranged:
            return super().sample_and_log_prob(x, num_posterior_samples)
        return self._sample(x, num_posterior_samples, density=True)

    def _sample(self, x: Tensor, num: int, density: bool) -> tuple[Tensor, Tensor | None]:
        inner, out = self._sampling_inputs(x, num)
        conditions = self._conditions(inner)
        n, size = inner.shape[0], self._latent_size(conditions)
        with torch.no_grad():
            mean, std = self._base("sample") if self.normal_base else (None, None)
            if self.normal_base:
                z = mean + std * self._draw_noise((num * n, size), conditions.device)
            else:  # the network's own base draws (keras' generator)
                z = self.network.base_distribution.sample((num * n,))
            repeated = conditions.repeat(num, *([1] * (conditions.ndim - 1)))
            result = self.network(z, conditions=repeated, inverse=True, density=density)
            standardized, log_q = result if density else (result, None)
            theta = self._from_inference(standardized)
            if density:
                _, back = self._to_inference(theta)  # the standardization's log-Jacobian
                log_q = (log_q + back).reshape(num, n).to(out)
        return theta.reshape(num, n, -1).to(device=inner.device, dtype=out), log_q

    def _latent_size(self, conditions: Tensor) -> int:
        if self.widths is not None:
            return int(sum(self.widths))
        return int(self.network.base_distribution.dim)

    def log_prob(self, theta: Tensor, x: Tensor) -> Tensor:
        flat, conditions, lead = self._flat(theta, x)
        standardized, ldj = self._to_inference(flat)
        _, log_q = self.network(standardized, conditions=conditions, inverse=False, density=True)
        value = log_q + ldj
        return value.reshape(*lead, x.shape[0]).to(device=theta.device, dtype=theta.dtype)

    def log_prob_and_latent(self, theta: Tensor, x: Tensor) -> tuple[Tensor, Tensor]:
        flat, conditions, lead = self._flat(theta, x)
        mean, std = self._base("to_latent")
        standardized, ldj = self._to_inference(flat)
        z, log_q = self.network(standardized, conditions=conditions, inverse=False, density=True)
        value, latent = (log_q + ldj), (z - mean) / std
        shape = (*lead, x.shape[0])
        return (
            value.reshape(shape).to(device=theta.device, dtype=theta.dtype),
            latent.reshape(*shape, -1).to(device=theta.device, dtype=theta.dtype),
        )

    def to_latent(self, theta: Tensor, x: Tensor) -> Tensor:
        flat, conditions, lead = self._flat(theta, x)
        mean, std = self._base("to_latent")
        standardized, _ = self._to_inference(flat)
        z = self.network(standardized, conditions=conditions, inverse=False, density=False)
        latent = (z - mean) / std
        return latent.reshape(*lead, x.shape[0], -1).to(device=theta.device, dtype=theta.dtype)

    def from_latent(self, z: Tensor, x: Tensor) -> Tensor:
        flat, conditions, lead = self._flat(z, x)
        mean, std = self._base("from_latent")
        standardized = self.network(
            mean + std * flat, conditions=conditions, inverse=True, density=False
        )
        theta = self._from_inference(standardized)
        return theta.reshape(*lead, x.shape[0], -1).to(device=z.device, dtype=z.dtype)

    def score(self, theta: Tensor, x: Tensor, *, create_graph: bool = False) -> Tensor:
        if not self.arranged:
            raise UnsupportedError(
                "the score (KCCSD, KCCSDLoss) needs a log-density differentiable in theta: "
                f"the Adapter of {self!r} transforms the parameters in NumPy (beyond "
                "concatenating them), so its log_prob has no gradient in theta"
            )
        return super().score(theta, x, create_graph=create_graph)
