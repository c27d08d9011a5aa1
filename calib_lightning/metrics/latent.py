"""Sampling-free calibration of flows and Gaussians from latents, as a ``Metric``."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import Tensor

from calib_lightning._utils.validation import (
    check_choice,
    check_pairs,
    check_positive,
    check_probability,
)
from calib_lightning.evaluation import check_event_size, latents
from calib_lightning.functional.combine import COMBINATION_METHODS
from calib_lightning.functional.latent import (
    DEFAULT_NUM_CELLS,
    LatentCalibrationResult,
    latent_histogram,
    latent_summary,
    latent_sums,
)
from calib_lightning.metrics._lazy import LazyDimension
from calib_lightning.posteriors import Posterior

__all__ = ["LatentCalibration"]


class LatentCalibration(LazyDimension):
    r"""Calibration from one latent pass, no sampling: uniformity of :math:`\Phi(z^*)` and
    of the latent radius.

    ``update(posterior, theta, x)`` maps each truth to the base space,
    :math:`z^* = T_x^{-1}(\theta^*)` (:func:`calib_lightning.evaluation.latents`: flows,
    ``Normal``/``MultivariateNormal`` posteriors), and counts :math:`u_d = \Phi(z^*_d)`
    (``D`` latent coordinates) and :math:`c = F_{\chi^2_D}(|z^*|^2)` (joint) in ``K``
    equal cells of :math:`[0, 1)`. Under calibration :math:`z^* \sim N(0, I_D)`, so
    each is uniform and the cell indices are exactly uniform on ``0..K-1``, like ranks
    among ``M = K - 1`` draws: ``compute()`` runs the tests of
    :class:`~calib_lightning.RankCalibration` on them
    (:mod:`calib_lightning.functional.latent`). ``c`` is the credibility of the smallest
    latent ball around the posterior's centre holding the truth, so the joint ECDF
    (``coverage``) is the expected coverage of the flow's own credible regions
    :math:`T_x(\{|z| \le r\})` (the HPD regions when ``q`` is Gaussian).

    Result fields are those of ``RankCalibration`` where they mean the same thing:
    ``p_value`` (joint chi-square), ``marginal_p_values`` (per latent coordinate),
    ``ecdf_p_values`` (coordinates, then joint), ``global_p_value`` (all ``2 (D + 1)``
    combined: the verdict), ``coverage_error`` (**negative = over-confident**: the truth
    lies further out than the posterior claims; positive = under-confident), the
    curves, bands and ``outside_band``; plus ``latent_mean`` and ``latent_std`` of
    :math:`z^*` per coordinate (0 and 1 under calibration). No ``contraction`` or
    ``mean_squared_error``: they need draws (use ``RankCalibration``).

    When to prefer it to ``RankCalibration``: its cost is one inverse pass per pair
    (``log_prob``'s direction: cheap for autoregressive flows, whose sampling is ``D``
    times slower), so it can run every epoch; its tests are exact for any ``N`` with no
    Monte Carlo rank noise. What it cannot see: errors that keep the law of each latent
    coordinate and of the radius (a dependence between latent coordinates, such as a
    non-uniform angle in a latent plane), and errors that cancel on average over ``x``;
    HPD ranks see some of the first, L-C2ST-NF tests the whole latent law locally.
    Marginals are per latent coordinate, which for a flow mix the parameters.

    States (many small updates equal one big update; DDP equals one process):
    ``histogram`` ``(D + 1, K)`` int64 and ``latent_sums`` ``(2, D)`` float64 (sums of
    :math:`z` and :math:`z^2`), both sum-reduced; memory ``O(K D)``, constant in ``N``.

    Arguments:
        num_cells: ``K >= 2`` cells of :math:`[0, 1)` (default 1000: binning changes no
            test and moves ``coverage_error`` by at most ``1 / (2K)``).
        num_dims: ``D``; if given, states are allocated at construction; otherwise at
            the first update (under DDP a process that saw no data takes the others'
            ``D`` when the states are synced).
        level: test level of the bands and of ``outside_band``.
        num_bins: chi-square bins; default ``min(K, 20, max(2, N // 5))``.
        num_ecdf_points: levels of the ECDF curves (at most ``K - 1``).
        global_method: ``"cauchy"`` (default) or ``"holm"``: how ``global_p_value``
            combines the tests.

    Example:
        >>> from calib_lightning.tasks import GaussianToy
        >>> toy = GaussianToy(dim=5)
        >>> metric = LatentCalibration()
        >>> for seed in range(4):
        ...     theta, x = toy.sample(250, torch.Generator().manual_seed(seed))
        ...     metric.update(toy.posterior(), theta, x)
        >>> out = metric.compute()
        >>> int(out.num_pairs), out.histogram.shape
        (1000, torch.Size([6, 1000]))
        >>> bool(out.global_p_value > 0.01)
        True
        >>> narrow = LatentCalibration()
        >>> narrow.update(toy.posterior(variance_scale=0.5), theta, x)
        >>> out = narrow.compute()
        >>> bool(out.global_p_value < 1e-6), bool(out.coverage_error < 0)  # over-confident
        (True, True)

    References:
        Talts et al. "Validating Bayesian inference algorithms with simulation-based
        calibration." arXiv:1804.06788 (2018). Linhart, Gramfort, Rodrigues. "L-C2ST:
        Local Diagnostics for Posterior Approximations in Simulation-Based Inference."
        NeurIPS 2023.
    """

    is_differentiable = False
    higher_is_better = None  # a result of mixed quantities (p-values, errors, moments)
    full_state_update = False

    lazy_states: ClassVar[tuple[str, ...]] = ("histogram", "latent_sums")
    histogram: Tensor
    latent_sums: Tensor

    def __init__(
        self,
        num_cells: int = DEFAULT_NUM_CELLS,
        num_dims: int | None = None,
        level: float = 0.05,
        num_bins: int | None = None,
        num_ecdf_points: int | None = 100,
        global_method: str = "cauchy",
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        check_positive("num_cells", num_cells, integer=True)
        if num_cells < 2:
            raise ValueError(f"num_cells must be >= 2, got {num_cells}")
        if num_dims is not None:
            check_positive("num_dims", num_dims, integer=True)
        check_probability("level", level)
        if num_bins is not None:
            check_positive("num_bins", num_bins, integer=True)
            if not 2 <= num_bins <= num_cells:
                raise ValueError(
                    f"num_bins must lie in 2..num_cells = 2..{num_cells}, got {num_bins}"
                )
        if num_ecdf_points is not None:
            check_positive("num_ecdf_points", num_ecdf_points, integer=True)
        check_choice("global_method", global_method, COMBINATION_METHODS)
        self.num_cells, self.num_dims, self.level = num_cells, num_dims, level
        self.num_bins, self.num_ecdf_points = num_bins, num_ecdf_points
        self.global_method = global_method
        histogram, sums = self._zero_states(num_dims or 0)
        self.add_state("histogram", histogram, dist_reduce_fx="sum")
        self.add_state("latent_sums", sums, dist_reduce_fx="sum")

    def _zero_states(self, d: int, device: torch.device | None = None) -> tuple[Tensor, Tensor]:
        """Zero ``histogram`` ``(D + 1, K)`` and ``latent_sums`` ``(2, D)``; no rows if D = 0."""
        rows = d + 1 if d else 0
        histogram = torch.zeros(rows, self.num_cells, dtype=torch.long, device=device)
        return histogram, torch.zeros(2, d, dtype=torch.float64, device=device)

    def _dims(self) -> int:
        return self.latent_sums.shape[1]

    def update(self, posterior: Posterior | object, theta: Tensor, x: Tensor) -> None:
        """Count the latents of the true parameters ``theta (N, D)`` at ``x (N, *X)``."""
        theta, x = check_pairs(theta, x)
        check_event_size(posterior, theta, x)  # theta against the posterior first
        self._allocate(theta.shape[1])
        z = latents(posterior, theta, x)
        if z.shape != theta.shape:
            raise ValueError(
                f"posterior.to_latent must return shape (N, D) = {tuple(theta.shape)}, "
                f"got {tuple(z.shape)}"
            )
        self.histogram += latent_histogram(z, self.num_cells).to(self.histogram.device)
        self.latent_sums += latent_sums(z).to(self.latent_sums.device)

    def compute(self) -> LatentCalibrationResult:
        """p-values, coverage error, curves and latent moments (see the class docstring).

        Returns:
            :class:`~calib_lightning.functional.latent.LatentCalibrationResult`, among
            its fields ``global_p_value`` ``()`` (the verdict), ``p_value`` and
            ``coverage_error`` ``()``, ``marginal_p_values`` ``(D,)``, ``ecdf_p_values``
            and ``outside_band`` ``(D + 1,)``, ``latent_mean`` and ``latent_std``
            ``(D,)``, also for ``D = 1``.
        """
        n = int(self.histogram[0].sum()) if self.histogram.numel() else 0
        if n < 2:
            raise ValueError(
                f"LatentCalibration.compute() needs at least N >= 2 calibration pairs, got N = {n}"
            )
        return latent_summary(
            self.histogram,
            self.latent_sums,
            level=self.level,
            num_bins=self.num_bins,
            num_ecdf_points=self.num_ecdf_points,
            global_method=self.global_method,
        )
