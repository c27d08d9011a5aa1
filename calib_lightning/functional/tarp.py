r"""TARP: expected coverage of random-reference credible balls, with an exact test.

For each calibration pair :math:`(\theta^*_i, x_i)`, draw :math:`S` samples
:math:`\theta_{ik} \sim q(\cdot \mid x_i)` and a reference point :math:`\theta^r_i`
(independent of :math:`\theta^*_i` given :math:`x_i`). The TARP rank is

.. math::
    r_i = \#\{k : d(\theta_{ik}, \theta^r_i) < d(\theta^*_i, \theta^r_i)\} \in \{0, \dots, S\},

the number of samples inside the ball around the reference that just reaches the true
value. :math:`c_i = (r_i + 1/2) / (S + 1)` is the credibility level of the smallest such
ball (Lemos et al. 2023, eq. 3-4, with the half-count of a discrete rank), and the
expected coverage probability at credibility :math:`c` is
:math:`\mathrm{ECP}(c) = \frac{1}{N} \sum_i 1[c_i \le c]`. If :math:`q = p` the
:math:`S + 1` values :math:`\theta^*_i, \theta_{i1}, \dots, \theta_{iS}` are exchangeable
given :math:`x_i` and the reference, so every :math:`r_i` is uniform on
:math:`\{0, \dots, S\}` and the ranks of different pairs are independent:
:math:`\mathrm{ECP}(c) \approx c`.

Distances are measured in standardized coordinates :math:`\theta / s` (``scale``
:math:`s`, a per-dimension standard deviation) and reference points are drawn uniformly
on a box; the curve is evaluated exactly on :math:`[0, 1]`.

Where the box and the scale come from decides whether the test holds its level. Fitted
on the tested :math:`\theta^*_i` themselves (this module's default until issue 22),
they are not independent of the pairs: a :math:`\theta^*_i` that is the largest value of
coordinate :math:`a` has every reference on one side of it, while its samples are not
bound by the box, so its rank is pushed up. Each coordinate makes two such pairs, so the
excess grows with :math:`D`: rejection 0.068 at :math:`D = 20` and 0.076 at
:math:`D = 50` (N = 500) at level 0.05. The default now fits them on **fit points**
(:func:`tarp_fit_points`): for each pair one of its :math:`S + 1` values
:math:`\{\theta^*_i, \theta_{i1}, \dots, \theta_{iS}\}`, picked uniformly at random.
Under :math:`H_0` these values are exchangeable given :math:`x_i`, and a uniformly
picked one is independent of *which* of them is :math:`\theta^*_i` (for distinct values,
the pick and the true value's position are independent uniforms). So given all fit
points, box, scale and references, the position of :math:`\theta^*_i` among its pair's
values is still uniform and independent across pairs: the ranks are exactly i.i.d.
uniform and the multinomial null below is exact, at every ``D``, ``N`` and ``S``. The
fit points follow the model's marginal (under :math:`H_0` the prior's), so the box and
scale have the size of the old ones and the power is kept (measured in
``examples/benchmarks/results/level_audit.md``; an independent prior draw, a two-fold
cross-fit and one extra posterior draw per pair were measured beside it). References and
a scale fixed in advance (e.g. from the prior's range) are exact too.

The test: the statistic is the largest deviation of the curve from the diagonal,
:math:`T = \sup_{c \in [0, 1]} |\mathrm{ECP}(c) - c|` (a KS statistic on the
:math:`N` ranks), and its null distribution is simulated exactly: under :math:`H_0` the
rank histogram is :math:`\mathrm{Multinomial}(N, 1/(S+1))`, so :math:`B` independent
histograms are drawn and :math:`p = (1 + \#\{T_b \ge T\}) / (1 + B)`, a Monte Carlo
test of level at most the nominal one for every ``N`` and ``S`` (Besag and Clifford,
1989), given ranks that are i.i.d. uniform under :math:`H_0` (above). The
``1 - level`` quantile of the :math:`T_b` is a simultaneous band around the diagonal,
drawn by :func:`calib_lightning.plots.plot_tarp`.

The summary ``coverage_error`` is the signed area of the *upper half* of the curve,
:math:`\int_{1/2}^{1} (\mathrm{ECP}(c) - c)\, dc` (the ATC of Lemos et al.):
positive for a conservative (too wide) posterior, negative for an over-confident
(too narrow) one. Read its sign for dispersion only (a bias can leave it near zero).
See ``docs/diagnostics.md`` (TARP) for how this differs from sbi's implementation.

References:
    Lemos, Coogan, Hezaveh, Perreault-Levasseur. "Sampling-Based Accuracy Testing of
    Posterior Estimators for General Inference." ICML 2023.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from calib_lightning._checks import (
    check_choice,
    check_finite,
    check_matrix,
    check_points,
    check_positive,
    check_probability,
)
from calib_lightning._chunks import pair_blocks
from calib_lightning._moments import moments, std_from_moments
from calib_lightning.functional._multinomial import uniform_multinomial
from calib_lightning.functional.combine import monte_carlo_p_value
from calib_lightning.functional.ranks import _check_counts, rank_histogram
from calib_lightning.results import Result

__all__ = [
    "DISTANCES",
    "TARPResult",
    "expected_coverage",
    "tarp",
    "tarp_counts",
    "tarp_fit_points",
    "tarp_fit_scale",
    "tarp_ranks",
    "tarp_references",
    "tarp_test",
    "uniform_multinomial",
]

DISTANCES = ("l2", "l1")


@dataclass(eq=False)
class TARPResult(Result):
    """The TARP test and its curve (:func:`tarp_test`, ``TARP.compute()``).

    ``*`` is the leading batch shape of the rank histogram, ``A = num_bins + 1``.

    Attributes:
        statistic: ``(*)`` sup deviation of the coverage curve from the diagonal.
        p_value: ``(*)`` Monte Carlo p-value (the verdict), at least ``1 / (B + 1)``.
        coverage_error: ``(*)`` signed area of the upper half (``c > 1/2``) of the curve
            (the ATC): negative = over-confident, positive = under-confident.
        band: ``(*)`` half-width of the simultaneous band (``1 - level`` null quantile).
        level: ``()`` test level of the band.
        credibility: ``(A,)`` credibility levels from 0 to 1.
        coverage: ``(*, A)`` expected coverage at each credibility level.
        num_pairs: ``(*)`` calibration pairs counted.
    """

    verdict = "p_value"
    logged = ("p_value", "coverage_error", "statistic", "num_pairs")

    statistic: Tensor
    p_value: Tensor
    coverage_error: Tensor
    band: Tensor
    level: Tensor
    credibility: Tensor
    coverage: Tensor
    num_pairs: Tensor


def tarp_fit_scale(theta: Tensor) -> Tensor:
    """Per-dimension standard deviation of ``theta`` ``(*, N, D)`` -> ``(*, D)``; zeros become 1.

    Computed in float64 from centred moments (exact at any offset), returned in the
    dtype of ``theta``.
    """
    check_points("theta", theta, min_rows=2)
    return std_from_moments(moments(theta)).to(theta.dtype)


def tarp_references(
    theta: Tensor, num_references: int | None = None, generator: torch.Generator | None = None
) -> Tensor:
    r"""Reference points uniform on the box spanned by the (standardized) ``theta``.

    The box of the standardized parameters :math:`[\min_i z_{ia}, \max_i z_{ia}]`,
    :math:`z = (\theta - \bar\theta) / s`, mapped back to parameter units, is the box
    :math:`[\min_i \theta_{ia}, \max_i \theta_{ia}]`.

    Arguments:
        theta: calibration parameters ``(*, N, D)``.
        num_references: how many to draw (default ``N``, one per pair).
        generator: random generator (on the CPU).

    Returns:
        ``(*, num_references, D)``.
    """
    check_points("theta", theta, min_rows=1)
    num = theta.shape[-2] if num_references is None else num_references
    check_positive("num_references", num, integer=True)
    low = theta.detach().amin(-2, keepdim=True)
    high = theta.detach().amax(-2, keepdim=True)
    u = torch.rand(*theta.shape[:-2], num, theta.shape[-1], generator=generator,
                   dtype=theta.dtype)
    return low + (high - low) * u.to(theta.device)


def tarp_fit_points(
    samples: Tensor, theta: Tensor, generator: torch.Generator | None = None
) -> Tensor:
    r"""One value per pair picked uniformly among its :math:`S + 1` values.

    Pair :math:`i`'s values are :math:`\{\theta^*_i, \theta_{i1}, \dots, \theta_{iS}\}`.

    The points the default reference box (:func:`tarp_references`) and scale
    (:func:`tarp_fit_scale`) are fitted on. Under :math:`H_0` the pick is independent of
    which of the :math:`S + 1` values is the true one, so the TARP ranks stay exactly
    uniform and independent (module docstring); fitting on ``theta`` itself does not.

    Arguments:
        samples: posterior samples ``(S, *, N, D)``.
        theta: true parameters ``(*, N, D)``.
        generator: random generator (on the CPU) for the picks.

    Returns:
        ``(*, N, D)``: ``theta[..., i, :]`` with probability :math:`1 / (S + 1)`, else
        one of the pair's samples.
    """
    check_points("theta", theta, min_rows=1)
    if samples.ndim != theta.ndim + 1 or samples.shape[1:] != theta.shape:
        raise ValueError(
            f"samples must have shape (S, {', '.join(map(str, theta.shape))}) like theta "
            f"with a leading sample axis, got {tuple(samples.shape)}"
        )
    pick = torch.randint(0, samples.shape[0] + 1, theta.shape[:-1], generator=generator)
    pick = pick.to(theta.device)
    index = (pick - 1).clamp_min(0)[None, ..., None].expand(1, *theta.shape)
    drawn = samples.detach().gather(0, index).squeeze(0).to(theta.dtype)
    return torch.where((pick == 0).unsqueeze(-1), theta.detach(), drawn)


def _distance(diff: Tensor, distance: str) -> Tensor:
    return diff.pow(2).sum(-1) if distance == "l2" else diff.abs().sum(-1)


def tarp_ranks(
    samples: Tensor,
    theta: Tensor,
    references: Tensor,
    *,
    scale: Tensor | None = None,
    distance: str = "l2",
) -> Tensor:
    r"""TARP ranks :math:`r_i = \#\{k : d(\theta_{ik}, \theta^r_i) < d(\theta^*_i, \theta^r_i)\}`.

    Arguments:
        samples: posterior samples ``(S, *, N, D)`` (the layout of ``Posterior.sample``).
        theta: true parameters ``(*, N, D)``.
        references: reference points ``(*, N, D)``.
        scale: per-dimension scale ``(D,)`` or ``(*, D)``; distances are computed on
            ``theta / scale``. ``None``: unscaled.
        distance: ``"l2"`` (Euclidean) or ``"l1"``.

    Returns:
        ``(*, N)`` int64 ranks in ``{0, ..., S}``.
    """
    check_choice("distance", distance, DISTANCES)
    check_points("theta", theta)
    if samples.ndim != theta.ndim + 1 or samples.shape[1:] != theta.shape:
        raise ValueError(
            f"samples must have shape (S, {', '.join(map(str, theta.shape))}) like theta "
            f"with a leading sample axis, got {tuple(samples.shape)}"
        )
    if references.shape != theta.shape:
        raise ValueError(
            f"references must have the shape of theta {tuple(theta.shape)}, "
            f"got {tuple(references.shape)}"
        )
    blocks = pair_blocks(theta.shape[0], samples.shape[0] * theta.shape[-1])
    if theta.ndim == 2 and len(blocks) > 1:  # by blocks of pairs: bounded scratch
        return torch.cat([tarp_ranks(samples[:, rows], theta[rows], references[rows],
                                     scale=scale, distance=distance) for rows in blocks])
    inverse = 1.0 if scale is None else 1.0 / scale.unsqueeze(-2)
    d_true = _distance((theta - references) * inverse, distance)
    d_samples = _distance((samples - references) * inverse, distance)
    return (d_samples < d_true).sum(0)


def tarp_counts(ranks: Tensor, num_posterior_samples: int) -> Tensor:
    """Histogram of ranks ``(*, N)`` over ``{0, ..., S}``: ``(*, S + 1)`` int64 counts."""
    return rank_histogram(ranks.unsqueeze(-1), num_posterior_samples).squeeze(-2)


def _midpoints(cells: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    return (torch.arange(cells, dtype=dtype, device=device) + 0.5) / cells


def expected_coverage(counts: Tensor, credibility: Tensor) -> Tensor:
    r"""Expected coverage :math:`\mathrm{ECP}(c) = \frac{1}{N} \#\{i : c_i \le c\}`.

    Arguments:
        counts: rank histogram ``(*, S + 1)``.
        credibility: credibility levels ``c``, ``(A,)`` in :math:`[0, 1]`.

    Returns:
        ``(*, A)`` in float64.
    """
    check_finite("credibility", credibility)
    counts = counts.double()
    cells = counts.shape[-1]
    cdf = torch.cat([torch.zeros_like(counts[..., :1]), counts.cumsum(-1)], -1)
    cdf = cdf / counts.sum(-1, keepdim=True).clamp_min(1.0)
    mids = _midpoints(cells, torch.float64, counts.device)
    index = torch.searchsorted(mids, credibility.double().to(counts.device), right=True)
    return cdf[..., index]


def _ks_coverage_error(counts: Tensor) -> tuple[Tensor, Tensor]:
    """Exact sup-deviation of the ECP step function from the diagonal, and the signed
    area of its upper half (``coverage_error``)."""
    counts = counts.double()
    cells = counts.shape[-1]
    total = counts.sum(-1, keepdim=True).clamp_min(1.0)
    upper = counts.cumsum(-1) / total  # ECP just after each jump
    lower = upper - counts / total  # ECP just before it
    mids = _midpoints(cells, torch.float64, counts.device)
    statistic = torch.maximum((upper - mids).amax(-1), (mids - lower).amax(-1))
    error = (counts * (1.0 - mids.clamp_min(0.5))).sum(-1) / total.squeeze(-1) - 0.375
    return statistic, error


def tarp_test(
    counts: Tensor,
    *,
    num_null: int = 1000,
    level: float = 0.05,
    num_bins: int = 100,
    generator: torch.Generator | None = None,
) -> TARPResult:
    r"""Monte Carlo test of uniform ranks, coverage error and the curve from a rank histogram.

    Arguments:
        counts: rank histogram ``(*, S + 1)`` (:func:`tarp_counts`).
        num_null: ``B`` null histograms drawn per test.
        level: the band is the ``1 - level`` quantile of the null statistics.
        num_bins: the curve is returned on ``num_bins + 1`` credibility levels in [0, 1].
        generator: random generator for the null draws.

    Returns:
        :class:`TARPResult`.
    """
    check_positive("num_null", num_null, integer=True)
    check_positive("num_bins", num_bins, integer=True)
    check_probability("level", level)
    if counts.ndim < 1 or counts.shape[-1] < 2:
        raise ValueError(
            f"counts must have shape (*, S + 1) with S >= 1, got {tuple(counts.shape)}"
        )
    _check_counts("counts", counts, unit="calibration pair")
    total = counts.sum(-1)
    statistic, error = _ks_coverage_error(counts)
    null = uniform_multinomial(total.cpu(), counts.shape[-1], num_null, generator)
    null_statistic = _ks_coverage_error(null)[0].to(counts.device)
    p_value = monte_carlo_p_value(statistic, null_statistic, tolerance=1e-12, dtype=torch.float64)
    credibility = torch.linspace(0.0, 1.0, num_bins + 1, dtype=torch.float64,
                                 device=counts.device)  # fmt: skip
    return TARPResult(
        statistic=statistic,
        p_value=p_value,
        coverage_error=error,
        band=torch.quantile(null_statistic, 1.0 - level, dim=-1),
        level=torch.tensor(level, dtype=torch.float64),
        credibility=credibility,
        coverage=expected_coverage(counts, credibility),
        num_pairs=total,
    )


def tarp(
    samples: Tensor,
    theta: Tensor,
    *,
    references: Tensor | None = None,
    scale: Tensor | None = None,
    distance: str = "l2",
    num_null: int = 1000,
    level: float = 0.05,
    num_bins: int = 100,
    generator: torch.Generator | None = None,
) -> TARPResult:
    r"""TARP coverage test from posterior samples at calibration pairs.

    Arguments:
        samples: posterior samples ``(S, N, D)``, ``S`` drawn at each pair's ``x_i``
            (e.g. :func:`calib_lightning.evaluation.draws`).
        theta: true parameters ``(N, D)``, ``N >= 2``.
        references: reference points ``(N, D)`` in parameter units, independent of
            ``theta`` given ``x``; ``None``: uniform on the box of the fit points
            (:func:`tarp_fit_points`, :func:`tarp_references`).
        scale: per-dimension scale ``(D,)`` of the standardized coordinates, independent
            of ``theta``; ``None``: standard deviation of the fit points
            (:func:`tarp_fit_scale`).
        distance: ``"l2"`` or ``"l1"``.
        num_null, level, num_bins: as :func:`tarp_test`.
        generator: random generator for the fit points, the references and the null
            draws.

    Returns:
        :class:`TARPResult`.

    Example:
        >>> from calib_lightning.tasks import GaussianToy
        >>> toy, g = GaussianToy(dim=2), torch.Generator().manual_seed(0)
        >>> theta, x = toy.sample(1000, g)
        >>> _ = torch.manual_seed(0)
        >>> samples = toy.posterior()(x).sample((1000,))
        >>> tarp(samples, theta, generator=g).p_value > 0.05  # exact
        tensor(True)
        >>> out = tarp(toy.posterior(variance_scale=2.0)(x).sample((1000,)), theta, generator=g)
        >>> out.p_value, out.coverage_error > 0  # too wide: rejected, positive error
        (tensor(0.0010, dtype=torch.float64), tensor(True))
    """
    check_matrix("theta", theta, min_rows=2)
    check_choice("distance", distance, DISTANCES)
    n, d = theta.shape
    if samples.ndim != 3 or samples.shape[1:] != theta.shape:
        raise ValueError(f"samples must have shape (S, {n}, {d}), got {tuple(samples.shape)}")
    check_finite("posterior samples", samples.transpose(0, 1))
    fit = None
    if references is None or scale is None:
        fit = tarp_fit_points(samples, theta, generator=generator)
    if references is None:
        references = tarp_references(fit, generator=generator)
    elif references.shape != theta.shape:
        raise ValueError(f"references must have shape {tuple(theta.shape)} like theta, "
                         f"got {tuple(references.shape)}")
    check_finite("references", references)
    scale = tarp_fit_scale(fit) if scale is None else _check_scale(scale, d)
    ranks = tarp_ranks(samples, theta, references, scale=scale, distance=distance)
    counts = tarp_counts(ranks, samples.shape[0])
    return tarp_test(counts, num_null=num_null, level=level, num_bins=num_bins,
                     generator=generator)


def _check_scale(scale: Tensor, dim: int | None = None) -> Tensor:
    """Raise unless ``scale`` is a positive finite tensor of shape ``(dim,)`` (any ``(D,)``)."""
    if not isinstance(scale, Tensor) or scale.ndim != 1 or dim not in (None, scale.shape[0]):
        shape = tuple(scale.shape) if isinstance(scale, Tensor) else type(scale).__name__
        raise ValueError(f"scale must be a tensor of shape ({dim or 'D'},), got {shape}")
    if not bool((scale > 0).all()) or not bool(torch.isfinite(scale).all()):
        raise ValueError(f"scale must be a positive tensor of finite values, got {scale.tolist()}")
    return scale
