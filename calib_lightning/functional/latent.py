r"""Sampling-free calibration from latents: uniformity of :math:`\Phi(z^*)` and of the radius.

A flow writes :math:`q(\theta \mid x)` as the push-forward of :math:`N(0, I_D)` by
:math:`T_x`. For a calibration pair, :math:`z^* = T_x^{-1}(\theta^*)`; if ``q`` is the true
posterior, :math:`z^* \sim N(0, I_D)` for every ``x``, hence

.. math::
    u_d = \Phi(z^*_d) \sim U(0, 1) \text{ for each } d, \qquad
    c = F_{\chi^2_D}(|z^*|^2) \sim U(0, 1).

``c`` is the credibility of the smallest latent ball holding :math:`z^*`: the region
:math:`R_a(x) = T_x(\{z : |z|^2 \le F_{\chi^2_D}^{-1}(a)\})` has ``q``-mass ``a`` and
contains :math:`\theta^*` iff :math:`c \le a`, so the ECDF of ``c`` is the expected
coverage of the flow's own credible regions (for a Gaussian posterior they are its HPD
regions; for a flow, a different family with the same null). ``c`` plays the part of
the energy rank of :mod:`calib_lightning.functional.sbc` divided by ``M``: large when the
truth lies far out in the posterior. The marginal :math:`u_d` are per *latent
coordinate*: for a diagonal Gaussian they are the parameters' coordinates, for a flow
they mix parameters (an autoregressive flow's :math:`z_d` depends on the parameters up to
``d`` in its order).

**Binning onto the rank machinery.** A value uniform on :math:`[0, 1)` cut into ``K``
equal cells, :math:`\lfloor K u \rfloor`, is *exactly* uniform on :math:`\{0, \dots, K -
1\}`: the rank of the truth among ``M = K - 1`` draws under calibration. The ``D``
marginal cells and the joint cell therefore form a ``(D + 1, K)`` histogram that
:func:`~calib_lightning.functional.sbc.summarize_ranks` tests as it tests ranks: chi-square
per dimension and joint, exact ECDF-band tests, the coverage curve, ``coverage_error``
and ``global_p_value``, all exact under calibration for any ``K``. The default
``K = 1000`` makes binning invisible: the tests use at most 20 chi-square bins and 100
ECDF levels (``K`` only has to be a multiple-rich grid finer than both), and
``coverage_error`` is :math:`1/2 - E[c]` up to :math:`1 / (2K) = 5 \cdot 10^{-4}`, below
its sampling error :math:`1 / \sqrt{12 N}` up to ``N`` of about :math:`3 \cdot 10^5`; the
state is ``8 K (D + 1)`` bytes (80 kB at ``D = 9``).

**Sign.** ``coverage_error`` :math:`\approx 1/2 - E[c]`: an over-confident posterior (too
narrow) or a biased one puts :math:`z^*` far out, ``c`` near 1 and the coverage error
below 0; an under-confident one (too wide) puts :math:`z^*` near 0 and it above 0: the
package's one convention ("Reading the sign" in :mod:`calib_lightning.functional.sbc`).
The marginal curves read like marginal rank curves: :math:`u_d` small = truth below the
posterior in latent coordinate ``d`` (posterior too high there).

**What it cannot see.** Only the law of each latent coordinate and the law of the radius
are tested, pooled over ``x``. An error that keeps both passes: a dependence between
latent coordinates with :math:`N(0, 1)` coordinates and a :math:`\chi^2_D` radius (e.g. a
non-uniform angle in a latent plane), which HPD ranks can see where the flow's density
is not a function of the radius alone; and, as for every pooled check, errors that
cancel on average over ``x``. L-C2ST-NF tests the whole latent law at each observation.
(A rotation of the latent space alone is no error: :math:`N(0, I)` is rotation
invariant, so the flow's distribution is unchanged.) No draws, so no sharpness
(contraction, posterior-mean error): use ``RankCalibration`` for those.

Cost: one inverse pass of the flow per pair, no sampling.

References:
    Talts et al. "Validating Bayesian inference algorithms with simulation-based
    calibration." arXiv:1804.06788 (2018). Linhart, Gramfort, Rodrigues. "L-C2ST: Local
    Diagnostics for Posterior Approximations in Simulation-Based Inference." NeurIPS 2023
    (the latent null :math:`z^* \sim N(0, I)` of L-C2ST-NF).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from torch import Tensor

from calib_lightning._utils.validation import check_finite, check_points, check_positive
from calib_lightning.functional.ranks import rank_histogram
from calib_lightning.functional.sbc import RankSummary, summarize_ranks

__all__ = [
    "DEFAULT_NUM_CELLS",
    "LatentCalibrationResult",
    "latent_calibration",
    "latent_histogram",
    "latent_summary",
    "latent_sums",
    "latent_values",
]

DEFAULT_NUM_CELLS = 1000
"""``K``, the cells of :math:`[0, 1)` the uniform values are counted in (module docstring)."""


@dataclass(eq=False)
class LatentCalibrationResult(RankSummary):
    """:class:`~calib_lightning.functional.sbc.RankSummary` of latent values, with the
    latent moments (what :class:`calib_lightning.LatentCalibration` returns).

    The summary's fields mean what they mean for ranks, with the ``D`` marginal rows
    testing :math:`u_d = \\Phi(z^*_d)` and the joint row :math:`c = F_{\\chi^2_D}(|z^*|^2)`
    (``coverage`` is the coverage of the flow's latent-ball credible regions);
    ``histogram`` ``(*, D + 1, K)`` counts the ``K`` cells. No sharpness: there are no
    draws.

    Attributes:
        outside_band: ``(*, D + 1)`` bool, the ECDF leaves the simultaneous band.
        latent_mean: ``(*, D)`` mean of :math:`z^*_d` over the pairs: 0 under
            calibration; above 0 = truth above the posterior in latent coordinate ``d``.
        latent_std: ``(*, D)`` standard deviation of :math:`z^*_d`: 1 under calibration;
            above 1 = posterior too narrow (over-confident), below 1 = too wide.

    Plus every field of :class:`~calib_lightning.functional.sbc.RankSummary`.
    """

    outside_band: Tensor
    latent_mean: Tensor
    latent_std: Tensor


def latent_values(z: Tensor) -> tuple[Tensor, Tensor]:
    r"""Marginal :math:`u = \Phi(z)` and joint :math:`c = F_{\chi^2_D}(|z|^2)`, in float64.

    :math:`F_{\chi^2_D}(r) = P(D/2, r/2)`, the regularized lower incomplete gamma function.

    Arguments:
        z: latents ``(*, N, D)``, finite.

    Returns:
        ``(u, c)``: ``(*, N, D)`` and ``(*, N)``, float64 in :math:`[0, 1]`.

    Example:
        >>> r = torch.tensor(2.0).log().mul(2).sqrt()  # |z|^2 = 2 log 2
        >>> u, c = latent_values(torch.tensor([[0.0, 0.0], [0.0, r]]))
        >>> u[0].tolist(), c.tolist()  # D = 2: F(r) = 1 - exp(-r / 2)
        ([0.5, 0.5], [0.0, 0.5])
    """
    check_points("z", z)
    if z.shape[-1] < 1:
        raise ValueError(f"z must have shape (*, N, D) with D >= 1, got {tuple(z.shape)}")
    z = z.double()
    u = torch.special.ndtr(z)
    half_d = torch.tensor(z.shape[-1] / 2, dtype=torch.float64, device=z.device)
    c = torch.special.gammainc(half_d, z.square().sum(-1) / 2)
    return u, c


def latent_histogram(z: Tensor, num_cells: int = DEFAULT_NUM_CELLS) -> Tensor:
    r"""Counts of :math:`\lfloor K u_d \rfloor` and :math:`\lfloor K c \rfloor` over the pairs.

    Arguments:
        z: latents ``(*, N, D)``, finite.
        num_cells: ``K >= 2``.

    Returns:
        ``(*, D + 1, K)`` int64: rows ``0..D-1`` the marginal cells, row ``D`` the joint
        one (a value of exactly 1 counts in the last cell).

    Example:
        >>> latent_histogram(torch.tensor([[0.0], [-10.0], [10.0]]), 4)
        tensor([[1, 0, 1, 1],
                [1, 0, 0, 2]])
    """
    check_positive("num_cells", num_cells, integer=True)
    if num_cells < 2:
        raise ValueError(f"num_cells must be >= 2, got {num_cells}")
    u, c = latent_values(z)
    values = torch.cat([u, c.unsqueeze(-1)], -1)
    # values are >= 0, so truncation is the floor (and much faster than Tensor.floor)
    cells = (values * num_cells).long().clamp_(0, num_cells - 1)
    return rank_histogram(cells, num_cells - 1)


def latent_sums(z: Tensor) -> Tensor:
    r"""Sums :math:`\sum_i z_{id}` and :math:`\sum_i z_{id}^2` over the pairs, ``(*, 2, D)``
    float64 (sum-reducible state for :attr:`LatentCalibrationResult.latent_mean` and
    ``latent_std``)."""
    check_points("z", z)
    z = z.double()
    return torch.stack([z.sum(-2), z.square().sum(-2)], -2)


def latent_summary(
    histogram: Tensor,
    sums: Tensor,
    *,
    level: float = 0.05,
    num_bins: int | None = None,
    num_ecdf_points: int | None = 100,
    global_method: str = "cauchy",
) -> LatentCalibrationResult:
    """Tests, curves and moments from a :func:`latent_histogram` and :func:`latent_sums`.

    Arguments:
        histogram: ``(*, D + 1, K)`` cell counts.
        sums: ``(*, 2, D)`` sums of ``z`` and ``z**2`` over the same pairs.
        level: as in :func:`~calib_lightning.functional.sbc.summarize_ranks`.
        num_bins: as in :func:`~calib_lightning.functional.sbc.summarize_ranks`.
        num_ecdf_points: as in :func:`~calib_lightning.functional.sbc.summarize_ranks`, at most
            ``K - 1``.
        global_method: as in :func:`~calib_lightning.functional.sbc.summarize_ranks`.

    Returns:
        :class:`LatentCalibrationResult`.
    """
    summary = summarize_ranks(
        histogram,
        level=level,
        num_bins=num_bins,
        num_ecdf_points=num_ecdf_points,
        global_method=global_method,
    )
    d = histogram.shape[-2] - 1
    if sums.shape != (*histogram.shape[:-2], 2, d):
        raise ValueError(
            f"sums must have shape (*, 2, D) = {(*histogram.shape[:-2], 2, d)} to match the "
            f"histogram, got {tuple(sums.shape)}"
        )
    check_finite("sums", sums)
    n = histogram[..., :1, :].sum(-1).double()  # (*, 1)
    mean = sums[..., 0, :] / n
    variance = (sums[..., 1, :] - n * mean.square()) / (n - 1).clamp_min(1)
    band = summary.simultaneous_band.to(summary.ecdf)
    deviation = summary.ecdf - summary.levels.to(summary.ecdf)
    outside = ((deviation < band[0] - 1e-12) | (deviation > band[1] + 1e-12)).any(-1)
    parts = {f.name: getattr(summary, f.name) for f in fields(summary)}
    return LatentCalibrationResult(
        **parts, outside_band=outside, latent_mean=mean, latent_std=variance.clamp_min(0).sqrt()
    )


def latent_calibration(
    z: Tensor,
    *,
    num_cells: int = DEFAULT_NUM_CELLS,
    level: float = 0.05,
    num_bins: int | None = None,
    num_ecdf_points: int | None = 100,
    global_method: str = "cauchy",
) -> LatentCalibrationResult:
    r"""Full latent calibration check from latents the caller already has.

    Arguments:
        z: latents of the truths :math:`z^*_i = T_{x_i}^{-1}(\theta^*_i)`, ``(*, N, D)``,
            ``N >= 2`` (leading dimensions: independent checks, e.g. repetitions).
        num_cells: ``K``, cells of :math:`[0, 1)` (module docstring).
        level: as in :func:`~calib_lightning.functional.sbc.summarize_ranks`.
        num_bins: as in :func:`~calib_lightning.functional.sbc.summarize_ranks`.
        num_ecdf_points: as in :func:`~calib_lightning.functional.sbc.summarize_ranks`.
        global_method: as in :func:`~calib_lightning.functional.sbc.summarize_ranks`.

    Returns:
        :class:`LatentCalibrationResult`.

    Example:
        >>> z = torch.randn(2000, 3, generator=torch.Generator().manual_seed(0))
        >>> out = latent_calibration(z)  # calibrated
        >>> bool(out.global_p_value > 0.01), out.histogram.shape
        (True, torch.Size([4, 1000]))
        >>> float(latent_calibration(2 * z).coverage_error) < -0.1  # posterior too narrow
        True
    """
    check_points("z", z, min_rows=2)
    return latent_summary(
        latent_histogram(z, num_cells),
        latent_sums(z),
        level=level,
        num_bins=num_bins,
        num_ecdf_points=num_ecdf_points,
        global_method=global_method,
    )
