r"""KCCSD calibration regularizer: the kernel calibration-conditional Stein discrepancy of
a training batch as a differentiable loss (Glaser et al., 2023).

By default the statistic is computed on the flow's *latent* calibration problem. A
flow writes :math:`q(\cdot \mid x)` as the push-forward of :math:`N(0, I)` by a
bijection :math:`T_x`; so :math:`\theta^* \sim q(\cdot \mid x)` given the model exactly
when :math:`z^* = T_x^{-1}(\theta^*) \sim N(0, I)` given the model. The KCCSD of that
problem has the model :math:`N(0, I)` for every pair, whose score is :math:`-z` in
closed form: no second-order autograd, one forward pass of the flow, and every pair
lives on the same scale. ``space="parameter"`` gives the statistic on :math:`\theta`
itself, from scores. Why these defaults: ``docs/design.md`` (the KCCSD regularizer);
the measurements: ``examples/benchmarks/README.md`` (regularizer design).

Ratio and likelihood estimators (an :class:`~calib_lightning.UnnormalizedPosterior`, or a
log-ratio callable with ``prior=``) have scores and no latent map: the statistic runs on
:math:`\theta`, in the unconstrained space :math:`u = T^{-1}(\theta)` when the prior's
support is bounded, as :class:`calib_lightning.KCCSD` tests them (no sampling at all).

References:
    Glaser, Widmann, Lindsten, Gretton. "Fast and Scalable Score-Based Kernel
    Calibration Tests." UAI 2023.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from calib_lightning import evaluation
from calib_lightning._utils.validation import (
    check_choice,
    check_finite,
    check_pairs,
    check_points,
    check_positive,
    check_shape,
)
from calib_lightning.functional._moments import std_or_one
from calib_lightning.functional.kccsd import gaussian_base_points
from calib_lightning.kernels import (
    KERNELS,
    exponentiated,
    gfd_sq_distances,
    median_bandwidth,
    median_from_sq_distances,
    sq_distances,
    stein_kernel,
)
from calib_lightning.posteriors import Posterior, UnnormalizedPosterior
from calib_lightning.posteriors.base import UnsupportedError
from calib_lightning.posteriors.unnormalized import in_testing_space

__all__ = ["KCCSDLoss", "kccsd_loss", "latent_kccsd_loss"]

SPACES = ("latent", "parameter")
CONDITIONING = (None, "x", "gfd")
ESTIMATORS = ("u", "v")


def _batch_std(value: Tensor) -> Tensor:
    """Detached per-column standard deviation of ``(n, F)``, with 1 for constant columns."""
    return std_or_one(value.detach().std(0))


def _standardized(value: Tensor) -> Tensor:
    """``(value - mean) / std`` per column with batch statistics, detached scale."""
    flat = value.reshape(value.shape[0], -1)
    return (flat - flat.detach().mean(0)) / _batch_std(flat)


def kccsd_loss(
    points: Tensor,
    score: Tensor,
    *,
    kernel: str = "rbf",
    bandwidth: float | Tensor | None = None,
    condition: Tensor | None = None,
    estimator: str = "u",
    normalize: bool = True,
) -> Tensor:
    r"""KCCSD of a batch from points and model scores, as a differentiable scalar.

    .. math::
        H_{ij} = k_{ij}\, h\big((s_i, y_i), (s_j, y_j)\big), \qquad
        \hat C_U = \frac{1}{n(n-1)} \sum_{i \ne j} H_{ij}, \qquad
        \hat C_V = \frac{1}{n^2} \sum_{i, j} H_{ij},

    with :math:`h` the Stein kernel (:func:`calib_lightning.kernels.stein_kernel`) and
    :math:`k` the kernel between models (``condition``). ``normalize`` divides by the
    detached mean diagonal :math:`\bar H = \frac1n \sum_i H_{ii}`
    (:math:`= \|s_i\|^2 + D / \ell^2` times :math:`k_{ii} = 1`). ``H`` is a positive
    semi-definite Gram matrix, so :math:`|H_{ij}| \le \sqrt{H_{ii} H_{jj}}` and the
    normalized U-statistic lies in :math:`[-1/(n-1), 1]` whatever the scale of the
    scores; being detached, :math:`\bar H` rescales the gradient without changing its
    direction.

    Arguments:
        points: :math:`y_i`, shape ``(*, n, D)``, ``n >= 2``.
        score: :math:`s_i(y_i)`, shape ``(*, n, D)``; gradients flow through it.
        kernel: ``"rbf"`` or ``"imq"`` kernel on ``points``.
        bandwidth: its :math:`\ell`; ``None``: median heuristic (detached).
        condition: kernel matrix :math:`k_{ij}` ``(*, n, n)`` between the models, or
            ``None`` for :math:`k \equiv 1`.
        estimator: ``"u"`` (unbiased; its gradient has mean zero at a calibrated model,
            the value can be negative) or ``"v"`` (biased: adds :math:`\bar H / n`, which
            rewards small scores, i.e. wider posteriors).
        normalize: divide by :math:`\bar H`.

    Returns:
        ``(*)``: a scalar for one batch.
    """
    _check_loss_inputs("points", points, kernel, bandwidth, condition, estimator)
    if score.shape != points.shape:
        raise ValueError(
            f"score must have the shape of points {tuple(points.shape)}, got {tuple(score.shape)}"
        )
    check_finite("score", score)
    return _kccsd_loss(points, score, kernel, bandwidth, condition, estimator, normalize)


def _check_loss_inputs(
    name: str,
    points: Tensor,
    kernel: str,
    bandwidth: float | Tensor | None,
    condition: Tensor | None,
    estimator: str,
) -> None:
    check_choice("kernel", kernel, KERNELS)
    check_choice("estimator", estimator, ESTIMATORS)
    check_points(name, points, min_rows=2)
    if bandwidth is not None and not isinstance(bandwidth, Tensor):
        check_positive("bandwidth", bandwidth)
    n = points.shape[-2]
    if condition is not None and tuple(condition.shape[-2:]) != (n, n):
        raise ValueError(
            f"condition must have shape (*, {n}, {n}) like the pairs of {name}, "
            f"got {tuple(condition.shape)}"
        )


def _kccsd_loss(
    points: Tensor,
    score: Tensor,
    kernel: str,
    bandwidth: float | Tensor | None,
    condition: Tensor | None,
    estimator: str,
    normalize: bool,
) -> Tensor:
    """:func:`kccsd_loss` on checked arguments."""
    n = points.shape[-2]
    if bandwidth is None:
        bandwidth = median_bandwidth(points)
    matrix = stein_kernel(points, score, points, score, kernel, bandwidth)
    if condition is not None:
        matrix = matrix * condition
    diagonal = torch.diagonal(matrix, dim1=-2, dim2=-1)
    total = matrix.sum((-1, -2))
    unbiased = (total - diagonal.sum(-1)) / (n * (n - 1))
    value = unbiased if estimator == "u" else total / n**2
    if normalize:
        value = value / diagonal.detach().mean(-1)
    return value


def latent_kccsd_loss(
    latent: Tensor,
    *,
    kernel: str = "rbf",
    bandwidth: float | None = None,
    condition: Tensor | None = None,
    estimator: str = "u",
    normalize: bool = True,
) -> Tensor:
    r"""KCCSD of latent points :math:`z_i = T_{x_i}^{-1}(\theta_i)` against :math:`N(0, I)`.

    :func:`kccsd_loss` with scores :math:`-z_i` and, by default, the bandwidth
    :math:`\ell = \sqrt{D}`, a fixed fraction of the typical distance :math:`\sqrt{2D}`
    between two standard normal points. ``normalize`` divides by the diagonal's
    expectation under calibration,
    :math:`E\,H_{ii} = E\|z\|^2 + D/\ell^2 = D (1 + 1/\ell^2)`: a constant, so the
    gradient of the U-statistic keeps mean zero at a calibrated model (a batch-dependent
    detached scale would not).

    Arguments:
        latent: ``(*, n, D)``; gradients flow through it.
        kernel: as in :func:`kccsd_loss`.
        bandwidth: as in :func:`kccsd_loss`.
        condition: as in :func:`kccsd_loss`.
        estimator: as in :func:`kccsd_loss`.
        normalize: as in :func:`kccsd_loss`.

    Returns:
        ``(*)``.
    """
    _check_loss_inputs("latent", latent, kernel, bandwidth, condition, estimator)
    dim = latent.shape[-1]
    bandwidth = dim**0.5 if bandwidth is None else bandwidth
    value = _kccsd_loss(latent, -latent, kernel, bandwidth, condition, estimator, False)
    return value / (dim * (1.0 + 1.0 / bandwidth**2)) if normalize else value


class KCCSDLoss(nn.Module):
    r"""KCCSD calibration regularizer: ``loss = nll + weight * KCCSDLoss()(flow, theta, x)``.

    Computes the statistic on the batch it is given (the training batch, in the usual
    integration):

    * ``space="latent"``: points :math:`z_i = T_{x_i}^{-1}(\theta_i)`, scores
      :math:`-z_i`, bandwidth :math:`\sqrt D` (:func:`latent_kccsd_loss`); needs
      ``posterior.to_latent`` (zuko, nflows, Gaussians) and no second-order autograd.
      ``"parameter"``: :func:`kccsd_loss` on :math:`\theta` standardized by the batch,
      with scores taken with ``create_graph=True``; needs only scores, but without a
      kernel between models (``condition=None``) it hardly sees the posterior's width.
    * Unnormalized posteriors (ratio and likelihood estimators,
      :class:`~calib_lightning.UnnormalizedPosterior`, or any ``f(theta, x)`` with
      ``prior=``): parameter space only (the default when ``prior`` is given), in
      :math:`u = T^{-1}(\theta)` when the prior's support is bounded, as
      :class:`~calib_lightning.KCCSD` tests them (the Stein identity needs a density that
      vanishes at the support's edge); gradients reach the network through the scores of
      :math:`f + \log p` (plus the log-Jacobian). Use ``condition="x"``: with
      :math:`k \equiv 1` a tempered ratio :math:`r^\tau` is invisible to the term
      (``examples/benchmarks/results/kccsd_loss_nre.md``, with what it did to NRE).
    * ``estimator="u"``: its gradient has mean zero at a calibrated model; the
      V-statistic's diagonal :math:`\|s_i\|^2 + D/\ell^2` rewards wider posteriors. The
      U-statistic can be negative.
    * ``normalize=True``: on :math:`\theta`, divide by the detached mean diagonal (a
      correlation in :math:`[-1/(n-1), 1]`, same gradient direction); in latent space by
      its expectation under calibration, a constant.
    * ``condition=None``: a constant kernel between models, i.e. calibration on
      average over ``x``, which is what expected coverage measures. ``"x"``: a Gaussian
      kernel on standardized ``x`` (a conditional Stein discrepancy; local
      calibration). ``"gfd"``: the exponentiated GFD on ``num_base_points`` base points
      (``num_base_points`` more score passes with ``create_graph=True``).

    The measurements behind these defaults are in ``examples/benchmarks/README.md``
    (regularizer design).

    Bandwidths (median heuristics on the batch) are detached from the graph.

    Arguments:
        space: ``"latent"`` or ``"parameter"``; ``None``: ``"parameter"`` with a
            ``prior``, else ``"latent"``.
        kernel: ``"rbf"`` or ``"imq"``.
        bandwidth: fixed :math:`\ell` (standardized or latent units); ``None``: median
            heuristic on :math:`\theta`, :math:`\sqrt D` on :math:`z`.
        condition: ``None``, ``"x"`` or ``"gfd"``.
        num_base_points: base points for ``condition="gfd"``.
        estimator: ``"u"`` or ``"v"``.
        normalize: see :func:`kccsd_loss` and :func:`latent_kccsd_loss`.
        prior: ``None``, or the prior :math:`p` (a torch ``Distribution`` with event shape
            ``(D,)``): the ``posterior`` given to :meth:`forward` is then a log-ratio or
            log-likelihood ``f(theta (n, D), x (n, *X)) -> (n,)`` (or an sbi ratio or
            likelihood estimator), read as ``UnnormalizedPosterior(f, prior=prior)``.

    Example:
        >>> from calib_lightning.tasks import GaussianToy
        >>> toy = GaussianToy(dim=2)
        >>> theta, x = toy.sample(256, torch.Generator().manual_seed(0))
        >>> loss = KCCSDLoss()
        >>> calibrated = loss(toy.posterior(), theta, x)
        >>> overconfident = loss(toy.posterior(variance_scale=0.3), theta, x)
        >>> bool(abs(calibrated) < 0.01), bool(overconfident > 0.05)
        (True, True)

    References:
        Glaser, Widmann, Lindsten, Gretton. "Fast and Scalable Score-Based Kernel
        Calibration Tests." UAI 2023.
    """

    def __init__(
        self,
        space: str | None = None,
        kernel: str = "rbf",
        bandwidth: float | None = None,
        condition: str | None = None,
        num_base_points: int = 8,
        estimator: str = "u",
        normalize: bool = True,
        prior: Any = None,
    ) -> None:
        super().__init__()
        if space is None:
            space = "latent" if prior is None else "parameter"
        check_choice("space", space, SPACES)
        if prior is not None and space == "latent":
            raise ValueError(
                "space must be 'parameter' with a prior (a ratio or likelihood has no latent "
                "map), got 'latent'"
            )
        if prior is not None:  # checks the prior, as the posterior built in forward will
            UnnormalizedPosterior(lambda theta, x: theta.sum(-1), prior=prior)
        self.prior = prior
        check_choice("kernel", kernel, KERNELS)
        check_choice("condition", condition, CONDITIONING)
        check_choice("estimator", estimator, ESTIMATORS)
        check_positive("num_base_points", num_base_points, integer=True)
        if bandwidth is not None:
            check_positive("bandwidth", bandwidth)
        self.space, self.kernel, self.bandwidth = space, kernel, bandwidth
        self.condition, self.num_base_points = condition, num_base_points
        self.estimator, self.normalize = estimator, normalize

    def extra_repr(self) -> str:
        return (
            f"space={self.space!r}, kernel={self.kernel!r}, bandwidth={self.bandwidth}, "
            f"condition={self.condition!r}, num_base_points={self.num_base_points}, "
            f"estimator={self.estimator!r}, normalize={self.normalize}"
            + ("" if self.prior is None else f", prior={type(self.prior).__name__}")
        )

    def forward(
        self,
        posterior: Posterior | object,
        theta: Tensor,
        x: Tensor,
        latent: Tensor | None = None,
    ) -> Tensor:
        """Regularizer on the batch ``theta (n, D)``, ``x (n, *X)``, ``n >= 2``: a scalar.

        ``latent``: ``posterior.to_latent(theta, x)`` if the caller already has it (with
        its graph), e.g. from the pass that computed the NLL; only for ``space="latent"``.
        """
        check_pairs(theta, x, min_rows=2)
        if latent is not None and self.space != "latent":
            raise ValueError(f"latent is only used with space='latent', got {self.space!r}")
        if self.prior is not None and not isinstance(posterior, UnnormalizedPosterior):
            posterior = UnnormalizedPosterior(posterior, prior=self.prior)
        if self.space == "parameter":
            posterior, theta, _ = in_testing_space(posterior, theta)
        elif isinstance(posterior, UnnormalizedPosterior):
            raise UnsupportedError(
                "posterior is an UnnormalizedPosterior, which has scores and no latent map: "
                "use KCCSDLoss(space='parameter', condition='x')"
            )
        if self.space == "latent":
            if latent is None:
                points = evaluation.latents(posterior, theta, x, create_graph=True)
            else:
                points = latent
            check_shape("latent", points, theta.shape, f"the shape of theta {tuple(theta.shape)}")
        else:
            std = _batch_std(theta)
            score = evaluation.scores(posterior, theta, x, create_graph=True)
            points, score = (theta - theta.mean(0)) / std, score * std
        condition = self._condition(posterior, theta, x)
        if self.space == "parameter":
            return _kccsd_loss(
                points,
                score,
                self.kernel,
                self.bandwidth,
                condition,
                self.estimator,
                self.normalize,
            )
        return latent_kccsd_loss(
            points,
            kernel=self.kernel,
            bandwidth=self.bandwidth,
            condition=condition,
            estimator=self.estimator,
            normalize=self.normalize,
        )

    def _condition(self, posterior: Posterior | object, theta: Tensor, x: Tensor) -> Tensor | None:
        if self.condition is None:
            return None
        if self.condition == "x":
            features = _standardized(x).detach()
            sq, dtype = sq_distances(features, features), features.dtype
        else:
            base_points = gaussian_base_points(theta, self.num_base_points)
            scores = evaluation.base_scores(posterior, x, base_points, create_graph=True)
            sq, dtype = gfd_sq_distances(scores), scores.dtype  # float64 where float32 overflows
        return exponentiated(sq, median_from_sq_distances(sq)).to(dtype)
