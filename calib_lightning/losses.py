r"""Differentiable calibration regularizers for neural posterior estimation.

Two losses to add to the negative log-likelihood of an NPE,
``loss = nll + weight * regularizer(posterior, theta, x)``, computed on the training
batch:

* :class:`KCCSDLoss`: the kernel calibration-conditional Stein discrepancy of
  Glaser et al. (2023) as a U-statistic on the batch, normalized to ``[-1/(n-1), 1]``.
  By default it is evaluated on the flow's *latent* calibration problem (see below);
  ``space="parameter"`` gives the statistic on :math:`\theta` itself, from scores.
* :class:`CoverageLoss`: the differentiable expected-coverage regularizer of
  Falkiewicz et al. (2023), with a straight-through rank and ``torch.sort`` (no
  ``torchsort``).

Latent calibration. A flow writes :math:`q(\cdot \mid x)` as the push-forward of
:math:`N(0, I)` by a bijection :math:`T_x`; so :math:`\theta^* \sim q(\cdot \mid x)`
given the model exactly when :math:`z^* = T_x^{-1}(\theta^*) \sim N(0, I)` given the
model. The KCCSD of that problem has the model :math:`N(0, I)` for every pair, whose
score is :math:`-z` in closed form: no second-order autograd, one forward pass of the
flow, and, because every pair lives on the same scale, all :math:`n(n-1)` pairs of the
batch see a global over- or under-dispersion. On :math:`\theta`, the Stein kernel
compares true parameters of different observations with one bandwidth: with the
median heuristic (the prior's scale) it is almost blind to the posterior's width
(evidence in ``examples/benchmarks/regularizer_design.py``; numbers in
:class:`KCCSDLoss`).

References:
    Glaser, Widmann, Lindsten, Gretton. "Fast and Scalable Score-Based Kernel
    Calibration Tests." UAI 2023.
    Falkiewicz, Takeishi, Shekhzadeh, Wehenkel, Delaunoy, Louppe, Kalousis.
    "Calibrating Neural Simulation-Based Inference with Differentiable Coverage
    Probability." NeurIPS 2023.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from calib_lightning._checks import (
    check_choice,
    check_finite,
    check_pairs,
    check_points,
    check_positive,
)
from calib_lightning._moments import std_or_one
from calib_lightning.functional.kccsd import _base_scores, gaussian_base_points
from calib_lightning.kernels import (
    KERNELS,
    exponentiated,
    gfd_sq_distances,
    median_bandwidth,
    median_from_sq_distances,
    sq_distances,
    stein_kernel,
)
from calib_lightning.posteriors import DistributionPosterior, Posterior, as_posterior

__all__ = ["CoverageLoss", "KCCSDLoss", "kccsd_loss", "latent_kccsd_loss"]

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
    :math:`\ell = \sqrt{D}` (the best of ``0.25 .. 1`` times the typical distance
    :math:`\sqrt{2D}` between two standard normal points, for over-confidence, in the
    design benchmark). ``normalize`` divides by the diagonal's expectation under
    calibration, :math:`E\,H_{ii} = E\|z\|^2 + D/\ell^2 = D (1 + 1/\ell^2)`: a constant,
    so the gradient of the U-statistic keeps mean zero at a calibrated model (a
    batch-dependent detached scale does not: measured bias 4 standard errors).

    Arguments:
        latent: ``(*, n, D)``; gradients flow through it.
        others: as :func:`kccsd_loss`.

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
    integration). Each default below was settled by a measurement
    (``examples/benchmarks/regularizer_design.py``, batches of ``n = 128``, exact
    Gaussian posteriors of sd 0.29 under an ``N(0, I)`` prior; results in
    ``examples/benchmarks/results/regularizer_design.md``):

    * ``space="latent"``: points :math:`z_i = T_{x_i}^{-1}(\theta_i)`, scores
      :math:`-z_i`, bandwidth :math:`\sqrt D` (:func:`latent_kccsd_loss`). Mean over
      batches / null sd, for a posterior whose sd is 0.6 times the truth: 19.4
      (``D = 2``) and 14.2 (``D = 10``); with ``space="parameter"``: 0.9 and 0.5. On
      :math:`\theta` the statistic sees a mean shift of half a posterior sd (22.6, 52.9)
      but hardly the width, whatever the kernel between models (none, ``"x"``, GFD).
      ``"latent"`` needs ``posterior.to_latent`` (zuko, nflows, Gaussians) and no
      second-order autograd; ``"parameter"`` needs only log-densities: scores with
      ``create_graph=True`` on :math:`\theta` standardized by the batch.
    * ``estimator="u"``: gradient in the log-sd at a calibrated model, over 400
      batches: +1.1 and +0.6 standard errors from zero (latent, parameter); the
      V-statistic's diagonal :math:`\|s_i\|^2 + D/\ell^2` gives -5.1 and -26.8: its
      descent widens a calibrated posterior. The U-statistic can be negative.
    * ``normalize=True``: on :math:`\theta` the raw statistic grows like
      :math:`1/\sigma^4` as the posterior narrows; the detached mean diagonal makes it a
      correlation in :math:`[-1/(n-1), 1]` and leaves the direction of the gradient
      alone. In latent space the statistic is width-free already and the normalizer is
      a constant (a batch-dependent one biased the gradient by 4 standard errors).
    * ``condition=None``: a constant kernel between models, i.e. calibration on
      average over ``x``, which is what expected coverage measures. ``"x"``: a Gaussian
      kernel on standardized ``x`` (a conditional Stein discrepancy; local calibration;
      cheap). ``"gfd"``: the exponentiated GFD on ``num_base_points`` base points
      (``num_base_points`` more score passes with ``create_graph=True``, about 10x the
      step time of plain NPE; it did not add sensitivity in the measurements above).

    Bandwidths (median heuristics on the batch) are detached from the graph.

    Arguments:
        space: ``"latent"`` or ``"parameter"``.
        kernel: ``"rbf"`` or ``"imq"``.
        bandwidth: fixed :math:`\ell` (standardized or latent units); ``None``: median
            heuristic on :math:`\theta`, :math:`\sqrt D` on :math:`z`.
        condition: ``None``, ``"x"`` or ``"gfd"``.
        num_base_points: base points for ``condition="gfd"``.
        estimator: ``"u"`` or ``"v"``.
        normalize: see :func:`kccsd_loss` and :func:`latent_kccsd_loss`.

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
        space: str = "latent",
        kernel: str = "rbf",
        bandwidth: float | None = None,
        condition: str | None = None,
        num_base_points: int = 8,
        estimator: str = "u",
        normalize: bool = True,
    ) -> None:
        super().__init__()
        check_choice("space", space, SPACES)
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
            f"space={self.space!r}, kernel={self.kernel!r}, condition={self.condition!r}, "
            f"estimator={self.estimator!r}, normalize={self.normalize}"
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
        posterior = as_posterior(posterior)
        if latent is not None and self.space != "latent":
            raise ValueError(f"latent is only used with space='latent', got {self.space!r}")
        if self.space == "latent":
            points = posterior.to_latent(theta, x) if latent is None else latent
            if points.shape != theta.shape:
                raise ValueError(
                    f"latent must have the shape of theta {tuple(theta.shape)}, "
                    f"got {tuple(points.shape)}"
                )
        else:
            std = _batch_std(theta)
            score = posterior.score(theta, x, create_graph=True)
            check_finite("posterior score at theta", score)
            points, score = (theta - theta.mean(0)) / std, score * std
        condition = self._condition(posterior, theta, x)
        if self.space == "parameter":
            return _kccsd_loss(
                points, score, self.kernel, self.bandwidth, condition, self.estimator,
                self.normalize,
            )  # fmt: skip
        return latent_kccsd_loss(
            points, kernel=self.kernel, bandwidth=self.bandwidth, condition=condition,
            estimator=self.estimator, normalize=self.normalize,
        )  # fmt: skip

    def _condition(self, posterior: Posterior, theta: Tensor, x: Tensor) -> Tensor | None:
        if self.condition is None:
            return None
        if self.condition == "x":
            features = _standardized(x).detach()
            sq = sq_distances(features, features)
        else:
            base_points = gaussian_base_points(theta, self.num_base_points)
            sq = gfd_sq_distances(_base_scores(posterior, x, base_points, create_graph=True))
        return exponentiated(sq, median_from_sq_distances(sq))


def _straight_through_step(value: Tensor, temperature: float) -> Tensor:
    """``1[value > 0]`` forward; gradient of ``sigmoid(value / temperature)`` backward."""
    soft = torch.sigmoid(value / temperature)
    return (value > 0).to(value.dtype) + (soft - soft.detach())


class CoverageLoss(nn.Module):
    r"""Differentiable expected-coverage regularizer (Falkiewicz et al., 2023).

    For each pair draw :math:`L` reparameterized samples :math:`\theta_{il} \sim
    q(\cdot \mid x_i)` and count those more probable than the truth,

    .. math::
        r_i = \sum_l \mathrm{step}\big(\log q(\theta_{il} \mid x_i) -
              \log q(\theta^*_i \mid x_i)\big), \qquad
        c_i = \frac{r_i + u_i}{L + 1}, \quad u_i \sim U(0, 1),

    the credibility level of the smallest highest-density region containing
    :math:`\theta^*_i` (randomized within its rank, so that :math:`c_i \sim U(0, 1)`
    exactly under calibration). The step is hard in the forward pass and has the
    gradient of :math:`\mathrm{sigmoid}(\cdot / \tau)` in the backward pass
    (straight-through). With :math:`c_{(k)}` sorted across the batch
    (``torch.sort`` passes gradients to the values),

    .. math::
        \mathcal{L} = \frac1n \sum_k \big(c_{(k)} - \tfrac{k - 1/2}{n}\big)^2

    the squared distance between the expected-coverage curve and the diagonal;
    ``conservative=True`` penalizes only over-confidence
    (:math:`c_{(k)} > (k - 1/2)/n`). Sampling needs ``L`` inverse passes of the flow
    per pair (``D`` network passes each for an autoregressive flow), which is where
    its cost comes from; the paper's weight is 5.

    Arguments:
        num_samples: ``L``.
        temperature: :math:`\tau`, in log-density units.
        conservative: one-sided version.

    Example:
        >>> from calib_lightning.tasks import GaussianToy
        >>> toy = GaussianToy(dim=2)
        >>> theta, x = toy.sample(512, torch.Generator().manual_seed(0))
        >>> _ = torch.manual_seed(0)
        >>> loss = CoverageLoss()
        >>> bool(loss(toy.posterior(), theta, x) < loss(toy.posterior(0.3), theta, x))
        True

    References:
        Falkiewicz, Takeishi, Shekhzadeh, Wehenkel, Delaunoy, Louppe, Kalousis.
        "Calibrating Neural Simulation-Based Inference with Differentiable Coverage
        Probability." NeurIPS 2023.
    """

    def __init__(
        self, num_samples: int = 16, temperature: float = 1.0, conservative: bool = False
    ) -> None:
        super().__init__()
        check_positive("num_samples", num_samples, integer=True)
        check_positive("temperature", temperature)
        self.num_samples, self.temperature = num_samples, float(temperature)
        self.conservative = bool(conservative)

    def extra_repr(self) -> str:
        return (
            f"num_samples={self.num_samples}, temperature={self.temperature}, "
            f"conservative={self.conservative}"
        )

    def forward(
        self,
        posterior: Posterior | object,
        theta: Tensor,
        x: Tensor,
        log_prob: Tensor | None = None,
    ) -> Tensor:
        r"""Regularizer on the batch ``theta (n, D)``, ``x (n, *X)``, ``n >= 2``: a scalar.

        ``log_prob``: :math:`\log q(\theta_i \mid x_i)` ``(n,)`` with its graph, if the
        caller already has it from the NLL.
        """
        check_pairs(theta, x, min_rows=2)
        posterior = as_posterior(posterior)
        if not isinstance(posterior, DistributionPosterior):
            raise ValueError(
                "CoverageLoss needs reparameterized samples: a zuko flow or a callable "
                f"x -> torch.distributions.Distribution, got {type(posterior).__name__}"
            )
        dist = posterior.distribution(x)
        joint = getattr(dist, "rsample_and_log_prob", None)
        if joint is not None:
            samples, log_q = joint((self.num_samples,))
        else:
            samples = dist.rsample((self.num_samples,))
            log_q = dist.log_prob(samples)
        log_q_true = dist.log_prob(theta) if log_prob is None else log_prob
        if log_q_true.shape != theta.shape[:1]:
            raise ValueError(
                f"log_prob must have shape ({theta.shape[0]},), got {tuple(log_q_true.shape)}"
            )
        check_finite("posterior log_prob at theta", log_q_true)
        check_finite("posterior log_prob at its samples", log_q.T)
        above = _straight_through_step(log_q - log_q_true, self.temperature)
        jitter = torch.rand(theta.shape[0], dtype=theta.dtype, device=theta.device)
        level = (above.sum(0) + jitter) / (self.num_samples + 1)
        n = theta.shape[0]
        quantiles = (torch.arange(n, dtype=theta.dtype, device=theta.device) + 0.5) / n
        gap = torch.sort(level).values - quantiles
        if self.conservative:
            gap = gap.clamp_min(0.0)
        return (gap**2).mean()
