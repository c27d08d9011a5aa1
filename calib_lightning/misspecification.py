r"""Misspecification test: does each observation look like the simulator's output?

A posterior estimator trained on simulations is only trustworthy at an observation
:math:`x_o` the simulator could have produced. :func:`misspecification_test` returns
one conformal p-value per observation for the null hypothesis
":math:`x_o` is exchangeable with the simulations" (in particular: drawn from the
simulator). It splits the simulations into a fit and a calibration set, scores every
point by its distance to the ``k``-th nearest fit point (in standardized raw
coordinates or in the features of an embedding network) and ranks each observation's
score among the calibration scores; the math is in
:mod:`calib_lightning.functional.misspecification`.

References:
    Vovk, Gammerman, Shafer. "Algorithmic Learning in a Random World." Springer (2005).

    Angelopoulos, Bates. "A Gentle Introduction to Conformal Prediction and
    Distribution-Free Uncertainty Quantification." arXiv:2107.07511 (2021).

    Liu, Xie. "Cauchy Combination Test: A Powerful Test With Analytic p-Value
    Calculation Under Arbitrary Dependency Structures." JASA 115 (2020).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor, nn

from calib_lightning._utils.validation import (
    as_float,
    check_choice,
    check_finite,
    check_positive,
    check_probability,
    check_same_device_dtype,
    model_dtype,
)
from calib_lightning.evaluation import embed
from calib_lightning.functional.combine import COMBINATION_METHODS, combine_p_values
from calib_lightning.functional.misspecification import (
    conformal_p_value,
    misspecification_scores,
)
from calib_lightning.results import Result

__all__ = ["MisspecificationResult", "misspecification_test"]


@dataclass(eq=False, repr=False)  # Result's short repr: tensors as shapes
class MisspecificationResult(Result):
    """What :func:`misspecification_test` returns.

    Attributes:
        p_value: conformal p-value of each observation, shape ``(O,)``, in
            ``[1 / (1 + num_calibration), 1]``; small: the observation is unlike the
            simulations.
        global_p_value: one p-value for "every observation looks simulated", shape
            ``()``: the combination of ``p_value`` (Cauchy by default); with one
            observation, its p-value.
        score: nonconformity score of each observation, shape ``(O,)``: its distance
            to the ``k``-th nearest fit simulation in standardized (or embedding)
            features.
        calibration_scores: the same score for each calibration simulation, shape
            ``(num_calibration,)``; the null distribution of ``score``.
        num_simulations: ``N``, the simulations passed in (fit plus calibration).
        num_fit: simulations in the fit set.
        k: the neighbour whose distance is the score.
        global_method: how ``global_p_value`` combines ``p_value``: ``"cauchy"`` or
            ``"holm"``.

    Properties say what the test can find at this ``N``: ``smallest_p_value``
    (:math:`1 / (1 + n)` with ``n`` calibration simulations, whatever the observation)
    and ``smallest_global_p_value``; :meth:`can_reject` compares them with a level.
    With ``N = 30`` (15 calibration simulations) the smallest p-value is 1/16: no
    observation, however far outside, is rejected at 0.05.
    """

    logged: ClassVar[tuple[str, ...]] = ("global_p_value", "p_value")
    verdict: ClassVar[str | None] = "global_p_value"

    p_value: Tensor
    global_p_value: Tensor
    score: Tensor
    calibration_scores: Tensor
    num_simulations: int
    num_fit: int
    k: int
    global_method: str = "cauchy"

    @property
    def num_calibration(self) -> int:
        """Simulations in the calibration set, ``num_simulations - num_fit``."""
        return self.num_simulations - self.num_fit

    @property
    def smallest_p_value(self) -> float:
        """The smallest attainable ``p_value``, :math:`1 / (1 + n)` (``n = num_calibration``)."""
        return 1.0 / (1 + self.num_calibration)

    @property
    def smallest_global_p_value(self) -> float:
        """The smallest attainable ``global_p_value``: ``smallest_p_value``, times the
        number of observations ``O`` (capped at 1) for ``global_method="holm"``."""
        count = self.p_value.shape[0] if self.global_method == "holm" else 1
        return min(1.0, count * self.smallest_p_value)

    def can_reject(self, level: float = 0.05, holm: bool = False) -> bool:
        """Whether any observation can be rejected at ``level`` (``p < level``) with this
        many calibration simulations: alone, or with ``holm=True`` after Holm's
        correction over the ``O`` observations (``O * smallest_p_value < level``)."""
        count = self.p_value.shape[0] if holm else 1
        return count * self.smallest_p_value < level


def _features(
    embedding: Callable[[Tensor], Tensor] | None, name: str, value: Tensor, batch_size: int
) -> Tensor:
    """``embedding(value)`` in chunks without gradients, flattened to ``(n, F)``."""
    return embed(embedding, value, batch_size, name=name)


def misspecification_test(
    observations: Tensor,
    x: Tensor,
    embedding: Callable[[Tensor], Tensor] | None = None,
    *,
    k: int = 5,
    fit_fraction: float = 0.5,
    standardize: bool = True,
    global_method: str = "cauchy",
    seed: int | None = 0,
    batch_size: int = 1024,
) -> MisspecificationResult:
    r"""Conformal p-value of "x_o looks like the simulator's output", per observation.

    The ``N`` simulations are split at random (seeded) into ``N_fit = int(fit_fraction
    * N)`` fit and ``n = N - N_fit`` calibration simulations. With features
    :math:`f = \mathrm{embedding}(x)` (or ``x`` flattened), standardized with the fit
    set's mean and standard deviation, the score of a point is its distance to the
    ``k``-th nearest fit point, and

    .. math::
        p(x_o) = \frac{1 + \#\{i \le n : s(x_i^{\mathrm{cal}}) \ge s(x_o)\}}{1 + n}.

    For an :math:`x_o` drawn from the simulator independently of ``x`` (exchangeable
    with the simulations), :math:`P(p(x_o) \le \alpha) \le \alpha` exactly, for every
    ``N``, ``k``, embedding and seed: reject at ``level`` when
    ``p_value < level`` (the package's convention; ``<=`` is valid too). The smallest
    p-value is :math:`1 / (1 + n)`, so rejecting at 0.05 needs ``n >= 20`` calibration
    simulations (``N >= 40`` with the default split; with ``N = 30`` the smallest
    p-value is 1/16 even for an observation 10 standard deviations away); a few
    hundred give a resolution far below the level. The result says so:
    ``result.smallest_p_value`` and ``result.can_reject(level)``.
    ``observations`` are cast to the dtype of ``x`` (or of the embedding's parameters;
    integer ``x`` to torch's default dtype).

    ``global_p_value`` combines the ``O`` p-values (Cauchy combination by default).
    They share the fit and calibration sets, hence are dependent; the Cauchy
    combination keeps its level under this dependence asymptotically (in the tail,
    Liu and Xie 2020), ``"holm"`` (Bonferroni's :math:`\min(1, O \min_o p_o)`) exactly.

    Arguments:
        observations: the observations :math:`x_o` to test, shape ``(O, *X)``.
        x: simulations from the simulator (e.g. the calibration pairs' ``x``), never the
            observations themselves, shape ``(N, *X)``: vectors ``(N, X)``, time series
            ``(N, T)``, images ``(N, C, H, W)``.
        embedding: ``None`` (compare ``x`` flattened) or a network or callable mapping
            ``(n, *X)`` to features ``(n, F)`` (``(n, *F)`` is flattened), such as the
            posterior's embedding net. It is applied in chunks of ``batch_size`` without
            gradients and, if an :class:`torch.nn.Module`, in eval mode (so batch norm
            and dropout make the features of a point independent of its batch); every
            submodule's training mode is restored afterwards.
        k: the neighbour whose distance is the score, ``1 <= k <= N_fit``; any ``k``
            gives a valid test, only the power changes (why 5: ``docs/design.md``,
            "Misspecification: the 5th neighbour").
        fit_fraction: share of the simulations in the fit set, in ``(0, 1)``.
        standardize: standardize the features with the fit set (a constant feature
            keeps its raw scale); ``False`` for features already on one scale.
        global_method: ``"cauchy"`` or ``"holm"``
            (:func:`~calib_lightning.functional.combine_p_values`).
        seed: seed of the split; ``None`` draws it from torch's global generator.
        batch_size: rows per embedding call and per distance block.

    Returns:
        A :class:`MisspecificationResult`; ``result.p_value`` has shape ``(O,)``.

    Raises:
        ValueError: observations whose shape after the first dimension differs from
            ``x``'s, NaN or infinite entries (in the inputs or in their features),
            ``N`` too small for ``fit_fraction`` and ``k``, bad settings.

    Example:
        >>> from calib_lightning.tasks import GaussianToy
        >>> _, x = GaussianToy(dim=2).sample(1000, torch.Generator().manual_seed(0))
        >>> x_o = torch.tensor([[0.0, 0.0], [8.0, 8.0]])  # typical; far outside
        >>> result = misspecification_test(x_o, x)
        >>> result.p_value
        tensor([0.9142, 0.0020], dtype=torch.float64)
        >>> round(float(result.global_p_value), 4), result.num_calibration
        (0.0041, 500)

    References:
        Vovk, Gammerman, Shafer. "Algorithmic Learning in a Random World." Springer
        (2005).

        Angelopoulos, Bates. "A Gentle Introduction to Conformal Prediction and
        Distribution-Free Uncertainty Quantification." arXiv:2107.07511 (2021).
    """
    check_positive("k", k, integer=True)
    check_positive("batch_size", batch_size, integer=True)
    check_probability("fit_fraction", fit_fraction)
    check_choice("global_method", global_method, COMBINATION_METHODS)
    for name, value in (("x", x), ("observations", observations)):
        if not isinstance(value, Tensor) or value.ndim < 2:
            got = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
            raise ValueError(
                f"{name} must have shape ({'N' if name == 'x' else 'O'}, *X) with a leading "
                f"batch dimension, got {got} (use {name}[None] for a single one)"
            )
    if observations.shape[1:] != x.shape[1:]:
        raise ValueError(
            f"observations must have shape (O, *X) = (O, {', '.join(map(str, x.shape[1:]))}) "
            f"like x {tuple(x.shape)}, got {tuple(observations.shape)}"
        )
    num = x.shape[0]
    num_fit = int(fit_fraction * num)
    if num_fit < k or num - num_fit < 1:
        raise ValueError(
            f"x must hold enough simulations for k = {k} fit neighbours and at least one "
            f"calibration simulation with fit_fraction = {fit_fraction}, got N = {num} "
            f"({num_fit} fit, {num - num_fit} calibration)"
        )
    dtype = model_dtype(embedding) or (x.dtype if x.is_floating_point() else None)
    x = as_float(x, dtype)
    observations = observations.to(x.dtype)
    check_same_device_dtype(x=x, observations=observations)
    check_finite("x", x)
    check_finite("observations", observations)

    generator = None if seed is None else torch.Generator().manual_seed(seed)
    order = torch.randperm(num, generator=generator).to(x.device)
    modes = (
        [(m, m.training) for m in embedding.modules()] if isinstance(embedding, nn.Module) else []
    )
    for module, _ in modes:
        module.eval()
    try:
        features = _features(embedding, "x", x, batch_size)[order]
        observed = _features(embedding, "observations", observations, batch_size)
    finally:
        for module, training in modes:  # every submodule back to its own mode
            module.train(training)
    score, calibration_scores = misspecification_scores(
        observed,
        features[:num_fit],
        features[num_fit:],
        k=k,
        standardize=standardize,
        block_size=batch_size,
    )
    p_value = conformal_p_value(score, calibration_scores, dtype=torch.float64)
    if p_value.shape[0] > 1:
        global_p_value = combine_p_values(p_value, method=global_method)
    else:
        global_p_value = p_value[0]
    return MisspecificationResult(
        p_value=p_value,
        global_p_value=global_p_value,
        score=score,
        calibration_scores=calibration_scores,
        num_simulations=num,
        num_fit=num_fit,
        k=k,
        global_method=global_method,
    )
