r"""Parameter recovery, posterior z-scores and contraction, per parameter.

For calibration pairs :math:`(\theta^*_i, x_i)`, :math:`i = 1..N`, and a posterior
:math:`q(\theta \mid x_i)` with mean :math:`\mu_{ia}` and standard deviation
:math:`\sigma_{ia}` in parameter :math:`a = 1..D`:

.. math::
    z_{ia} = \frac{\mu_{ia} - \theta^*_{ia}}{\sigma_{ia}}, \qquad
    \kappa_{ia} = 1 - \frac{\sigma_{ia}^2}{\mathrm{Var}_{\mathrm{prior}, a}}, \qquad
    R^2_a = 1 - \frac{\sum_i (\mu_{ia} - \theta^*_{ia})^2}
                     {\sum_i (\theta^*_{ia} - \bar\theta^*_a)^2}.

The *z-score* says how far the posterior mean misses the truth in units of the
posterior's own spread: under calibration (and a Gaussian-like posterior) it has mean
0 and standard deviation 1 over the pairs. **Reading it**: ``z_score_std > 1`` =
over-confident (the posterior is narrower than its errors), ``< 1`` = under-confident
(wider than its errors); ``z_score_mean > 0`` = the posterior sits too high (its mean
exceeds the truth), ``< 0`` = too low, as the marginal rank curves of
:mod:`calib_lightning.functional.sbc` read. The *contraction* :math:`\kappa` is
sharpness: 0 = no narrower than the prior, 1 = the parameter is pinned down (negative:
wider than the prior). :math:`R^2` is the fraction of the truths' variance the
posterior mean explains (1 = perfect recovery, 0 = no better than the truths' mean,
negative = worse). For the exact posterior, :math:`E[R^2_a] \approx` the mean
contraction, since :math:`\mathrm{Var}\,\theta = \mathrm{Var}\,E[\theta \mid x] +
E\,\mathrm{Var}[\theta \mid x]`.

:func:`recovery` takes posterior draws; :func:`recovery_from_moments` takes per-pair
means and variances, so a metric that accumulates draws in chunks (e.g. with
:mod:`calib_lightning.functional._moments`) need not keep them. With ``S`` draws per pair the
estimated mean and standard deviation carry Monte Carlo error, which inflates the
z-scores: for a Gaussian posterior :math:`z = \sqrt{1 + 1/S}\; t_{S-1}` exactly, so a
calibrated posterior has ``z_score_std`` :math:`\approx` :func:`calibrated_z_score_std`
``(S)`` (1.015 at ``S = 100``, 1.19 at ``S = 10``), not 1.

Everything is computed in float64 after centring (means relative to an anchor, as in
:mod:`calib_lightning.functional._moments`), so float32 parameters near :math:`10^6` with a
posterior standard deviation of 1 keep their z-scores and :math:`R^2`.

References:
    Schad, Betancourt, Vehtari. "Toward a principled Bayesian workflow in cognitive
    science." Psychological Methods 26(1), 2021 (posterior z-score and contraction).
    Radev, Mertens, Voss, Ardizzone, Köthe. "BayesFlow: Learning complex stochastic
    models with invertible neural networks." IEEE TNNLS 33(4), 2022 (arXiv 2020);
    Radev et al. "BayesFlow: Amortized Bayesian workflows with neural networks."
    JOSS 8(89), 2023 (recovery and z-score/contraction figures).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from calib_lightning._utils.chunks import pair_blocks
from calib_lightning._utils.validation import check_finite, check_positive
from calib_lightning.functional._moments import moments, variance_from_moments
from calib_lightning.results import Result

__all__ = ["Recovery", "calibrated_z_score_std", "recovery", "recovery_from_moments"]


@dataclass(eq=False, repr=False)  # repr: Result's, with shapes instead of (N, D) values
class Recovery(Result):
    r"""Recovery, z-scores and contraction of ``N`` pairs in ``D`` parameters (float64).

    Per pair:
        posterior_mean: :math:`\mu`, ``(N, D)``.
        posterior_std: :math:`\sigma`, ``(N, D)``.
        theta: the truths :math:`\theta^*`, ``(N, D)``.
        z_scores: :math:`(\mu - \theta^*) / \sigma`, ``(N, D)``.
        contractions: :math:`1 - \sigma^2 / \mathrm{Var}_{\mathrm{prior}}`, ``(N, D)``.

    Per parameter (``logged``, each ``(D,)``):
        r_squared: :math:`1 - \mathrm{SSE} / \mathrm{SST}` of the posterior mean against
            the truth; NaN for a parameter whose truths are all equal.
        z_score_mean: mean of the z-scores over pairs; > 0 = posterior too high.
        z_score_std: their standard deviation (unbiased); about 1 under calibration
            (:func:`calibrated_z_score_std` with ``S`` draws), > 1 over-confident,
            < 1 under-confident.
        contraction: mean contraction over pairs; 0 = no better than the prior.
        rmse: root mean squared error of the posterior mean,
            :math:`\sqrt{\overline{(\mu - \theta^*)^2}}`.

    Other:
        prior_variance: ``(D,)``, given or the variance of ``theta`` over its rows.
        num_posterior_samples: ``S``, the draws per pair behind the moments, or ``None`` (exact
            moments or unknown).
    """

    logged = ("r_squared", "z_score_mean", "z_score_std", "contraction", "rmse")

    posterior_mean: Tensor
    posterior_std: Tensor
    theta: Tensor
    z_scores: Tensor
    contractions: Tensor
    r_squared: Tensor
    z_score_mean: Tensor
    z_score_std: Tensor
    contraction: Tensor
    rmse: Tensor
    prior_variance: Tensor
    num_posterior_samples: int | None = None


def calibrated_z_score_std(num_posterior_samples: int | None) -> float:
    r"""Standard deviation of the z-scores of a calibrated Gaussian posterior with ``S`` draws.

    The posterior mean and standard deviation estimated from ``S`` draws give
    :math:`z = \sqrt{1 + 1/S}\, t_{S-1}`, whose standard deviation is
    :math:`\sqrt{(1 + 1/S)(S - 1)/(S - 3)}` (exact for Gaussian posteriors, a guide
    otherwise); ``None`` (exact moments) gives 1.

    Arguments:
        num_posterior_samples: ``S >= 4``, or ``None``.

    Returns:
        The expected ``z_score_std`` under calibration.

    Example:
        >>> round(calibrated_z_score_std(100), 4), calibrated_z_score_std(None)
        (1.0153, 1.0)
    """
    if num_posterior_samples is None:
        return 1.0
    check_positive("num_posterior_samples", num_posterior_samples, integer=True)
    if num_posterior_samples < 4:
        raise ValueError(
            "num_posterior_samples must be at least 4 for a finite z-score std, "
            f"got {num_posterior_samples}"
        )
    s = float(num_posterior_samples)
    return math.sqrt((1 + 1 / s) * (s - 1) / (s - 3))


def _check_tensor(name: str, value: Tensor, shape: str, expected: tuple[int, ...] | None) -> None:
    if not isinstance(value, Tensor):
        raise ValueError(f"{name} must be a torch.Tensor of shape {shape}, got {type(value)}")
    if not value.is_floating_point():
        raise ValueError(f"{name} must have a floating dtype, got {value.dtype}")
    ndim = len([axis for axis in shape.strip("()").split(",") if axis.strip()])
    if value.ndim != ndim or (expected is not None and tuple(value.shape) != expected):
        wanted = shape if expected is None else f"{shape} = {expected}"
        raise ValueError(f"{name} must have shape {wanted}, got {tuple(value.shape)}")
    check_finite(name, value)


def _check_theta(theta: Tensor) -> None:
    _check_tensor("theta", theta, "(N, D)", None)
    if theta.shape[0] < 2 or theta.shape[1] < 1:
        raise ValueError(
            f"theta must have shape (N, D) with N >= 2 pairs and D >= 1, got {tuple(theta.shape)}"
        )


def _check_device(name: str, value: Tensor, theta: Tensor) -> None:
    if value.device != theta.device:
        raise ValueError(f"{name} must be on theta's device {theta.device}, got {value.device}")


def _prior_variance(theta: Tensor, prior_variance: Tensor | None) -> Tensor:
    d = theta.shape[1]
    if prior_variance is None:
        _, variance = variance_from_moments(moments(theta))
        if bool((variance <= 0).any()):
            bad = (variance <= 0).nonzero().flatten().tolist()
            raise ValueError(
                f"theta must vary in every column to stand in for the prior variance, got "
                f"constant columns {bad}; pass prior_variance of shape (D,) = ({d},)"
            )
        return variance
    _check_tensor("prior_variance", prior_variance, "(D,)", (d,))
    if bool((prior_variance <= 0).any()):
        raise ValueError(
            f"prior_variance must be positive in every entry, got minimum "
            f"{prior_variance.min().item():g}"
        )
    return prior_variance.to(device=theta.device, dtype=torch.float64)


def recovery_from_moments(
    mean: Tensor,
    variance: Tensor,
    theta: Tensor,
    prior_variance: Tensor | None = None,
    *,
    num_posterior_samples: int | None = None,
) -> Recovery:
    r"""Recovery, z-scores and contraction from per-pair posterior moments.

    .. math::
        z_{ia} = \frac{\mu_{ia} - \theta^*_{ia}}{\sqrt{v_{ia}}}, \quad
        \kappa_{ia} = 1 - \frac{v_{ia}}{\mathrm{Var}_{\mathrm{prior},a}}, \quad
        R^2_a = 1 - \frac{\sum_i (\mu_{ia} - \theta^*_{ia})^2}
        {\sum_i (\theta^*_{ia} - \bar\theta^*_a)^2}

    (see the module docstring for how to read them), computed in float64 with the
    truths centred on their first row, so that an offset common to ``mean`` and
    ``theta`` cancels before any square.

    Arguments:
        mean: posterior means :math:`\mu`, ``(N, D)``.
        variance: posterior variances :math:`v`, ``(N, D)``, positive.
        theta: true parameters, ``(N, D)``, ``N >= 2``.
        prior_variance: ``(D,)``, positive; default: the unbiased variance of ``theta``
            over its ``N`` rows.
        num_posterior_samples: ``S`` if the moments were estimated from ``S`` draws per
            pair (kept in the result for :func:`calibrated_z_score_std`; the numbers do not change).

    Returns:
        :class:`Recovery`.

    Example:
        >>> theta = torch.tensor([[0.0], [1.0], [2.0]])
        >>> out = recovery_from_moments(theta + 0.5, torch.full((3, 1), 0.25), theta,
        ...                             torch.tensor([1.0]))
        >>> out.z_scores.flatten().tolist(), out.r_squared.tolist(), out.contraction.tolist()
        ([1.0, 1.0, 1.0], [0.625], [0.75])
    """
    _check_theta(theta)
    for name, value in (("mean", mean), ("variance", variance)):
        _check_tensor(name, value, "(N, D)", tuple(theta.shape))
        _check_device(name, value, theta)
    if bool((variance <= 0).any()):
        count = int((variance <= 0).sum())
        raise ValueError(f"variance must be positive, got {count} entries <= 0")
    if num_posterior_samples is not None:
        check_positive("num_posterior_samples", num_posterior_samples, integer=True)
    prior = _prior_variance(theta, prior_variance)
    truth = theta.double()
    anchor = truth[:1]
    centred = truth - anchor  # truths relative to one of them: no offset left
    error = (mean.double() - anchor) - centred  # mu - theta, the offset cancelled first
    var = variance.double()
    std = var.sqrt()
    z = error / std
    contractions = 1 - var / prior
    spread = centred - centred.mean(0)
    sst = (spread * spread).sum(0)
    sse = (error * error).sum(0)
    r_squared = torch.where(sst > 0, 1 - sse / sst.clamp_min(1e-300), torch.nan)
    return Recovery(
        posterior_mean=mean.double(),
        posterior_std=std,
        theta=truth,
        z_scores=z,
        contractions=contractions,
        r_squared=r_squared,
        z_score_mean=z.mean(0),
        z_score_std=z.std(0),
        contraction=contractions.mean(0),
        rmse=(sse / theta.shape[0]).sqrt(),
        prior_variance=prior,
        num_posterior_samples=num_posterior_samples,
    )


def recovery(samples: Tensor, theta: Tensor, prior_variance: Tensor | None = None) -> Recovery:
    r"""Recovery, z-scores and contraction from ``S`` posterior draws per pair.

    The per-pair mean and unbiased variance of the draws, computed in float64 relative
    to the first draw (:func:`calib_lightning.functional._moments.moments`), then
    :func:`recovery_from_moments`. With ``S`` draws a calibrated posterior has
    ``z_score_std`` near :func:`calibrated_z_score_std` ``(S)`` rather than 1.

    Arguments:
        samples: posterior draws ``(S, N, D)``, ``S >= 2``, draw ``s`` of pair ``i`` at
            ``samples[s, i]`` (as :meth:`~calib_lightning.posteriors.Posterior.sample`
            returns them).
        theta: true parameters ``(N, D)``, ``N >= 2``.
        prior_variance: ``(D,)``; default: the variance of ``theta`` over its rows.

    Returns:
        :class:`Recovery` with ``num_posterior_samples = S``.

    Example:
        >>> g = torch.Generator().manual_seed(0)
        >>> theta = torch.randn(2000, 1, generator=g)
        >>> x = theta + 0.5 * torch.randn(2000, 1, generator=g)
        >>> exact = 0.8 * x + 0.2**0.5 * torch.randn(100, 2000, 1, generator=g)
        >>> out = recovery(exact, theta, torch.ones(1))
        >>> round(float(out.z_score_std), 1), round(float(out.contraction), 1)
        (1.0, 0.8)
    """
    _check_tensor("samples", samples, "(S, N, D)", None)
    if samples.shape[0] < 2:
        raise ValueError(
            f"samples must have shape (S, N, D) with S >= 2 draws, got {tuple(samples.shape)}"
        )
    _check_theta(theta)
    _check_device("samples", samples, theta)
    if samples.shape[1:] != theta.shape:
        raise ValueError(
            f"samples must have shape (S, N, D) = (S, {theta.shape[0]}, {theta.shape[1]}) "
            f"to match theta, got {tuple(samples.shape)}"
        )
    # by blocks of pairs: the moments take float64 scratch copies of their points
    per_pair = samples.transpose(0, 1)
    blocks = pair_blocks(theta.shape[0], samples.shape[0] * samples.shape[2])
    state = torch.cat([moments(per_pair[rows]) for rows in blocks])
    mean, variance = variance_from_moments(state)
    if bool((variance <= 0).any()):
        pairs = (variance <= 0).any(1).nonzero().flatten()
        raise ValueError(
            f"samples must vary across the S draws of every pair, got identical draws in "
            f"{pairs.numel()} pairs (first: {pairs[:5].tolist()})"
        )
    return recovery_from_moments(
        mean, variance, theta, prior_variance, num_posterior_samples=samples.shape[0]
    )
