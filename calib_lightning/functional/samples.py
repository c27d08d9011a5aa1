r"""Sample-based comparison of posterior approximations with reference samples.

When reference samples exist (benchmark tasks, long MCMC runs) the approximation's
samples :math:`Y_{1..n}` are compared with the reference samples :math:`X_{1..m}`:

* :func:`mmd`: unbiased :math:`\mathrm{MMD}^2` with an RBF kernel and a permutation test;
* :func:`frechet_distance`: the Frechet (2-Wasserstein) distance between Gaussian fits,
  the FID computed on parameters instead of network features;
* :func:`density_coverage`: the k-NN fidelity and diversity scores of Naeem et al. (2020);
* :func:`vendi_score`: the diversity of one set (needs no reference).

Every function takes sets of shape ``(*, n, D)``: the points are on axis ``-2`` and
optional leading dimensions ``(*)`` batch many comparisons (observations, repeated
datasets) into one call. Posterior samples ``(S, K, D)`` are transposed to ``(K, S, D)``
to compare per observation (:func:`calib_lightning.functional.compare_to_reference`).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from calib_lightning._utils.chunks import row_blocks
from calib_lightning._utils.validation import check_points, check_positive, check_same_device_dtype
from calib_lightning.functional._moments import moments, variance_from_moments
from calib_lightning.functional.combine import monte_carlo_p_value
from calib_lightning.kernels import exponentiated, median_bandwidth, sq_distances

__all__ = [
    "ball_counts",
    "density_coverage",
    "frechet_distance",
    "frechet_distance_from_moments",
    "gaussian_moments",
    "knn_sq_radii",
    "mmd",
    "vendi_score",
]


def _check_sets(samples: Tensor, reference: Tensor, min_rows: int) -> None:
    check_points("samples", samples, min_rows=min_rows)
    check_points("reference", reference, min_rows=min_rows, columns=samples.shape[-1])
    if samples.shape[:-2] != reference.shape[:-2]:
        raise ValueError(
            f"reference must have the batch shape {tuple(samples.shape[:-2])} of samples, "
            f"got shape {tuple(reference.shape)}"
        )
    check_same_device_dtype(samples=samples, reference=reference)


def _check_bandwidth(bandwidth: float | Tensor) -> None:
    if not isinstance(bandwidth, Tensor):
        check_positive("bandwidth", bandwidth)
    elif not bool(((bandwidth > 0) & torch.isfinite(bandwidth)).all()):
        raise ValueError(f"bandwidth must be positive and finite, got {bandwidth}")


# -- MMD ------------------------------------------------------------------------------
def _mmd_from_gram(gram: Tensor, membership: Tensor, n: int, m: int) -> Tensor:
    r"""Unbiased :math:`\mathrm{MMD}^2` for every labelling in ``membership`` at once.

    ``gram`` is the zero-diagonal kernel matrix of the pooled sets ``(*, N, N)``;
    ``membership`` ``(*, N, P)`` holds ``1`` for the ``n`` points of the first set.
    With :math:`a` a membership vector, :math:`K a` is one matmul for all ``P`` columns and

    .. math::
        a^\top K a,\quad a^\top K (1 - a) = a^\top K 1 - a^\top K a,\quad
        (1 - a)^\top K (1 - a) = 1^\top K 1 - 2 a^\top K 1 + a^\top K a.
    """
    row = gram.sum(-1)
    total = row.sum(-1, keepdim=True)
    within = (membership * (gram @ membership)).sum(-2)  # a^T K a
    linear = (row.unsqueeze(-1) * membership).sum(-2)  # a^T K 1
    cross = linear - within
    other = total - 2.0 * linear + within
    return within / (n * (n - 1)) + other / (m * (m - 1)) - 2.0 * cross / (n * m)


def mmd(
    samples: Tensor,
    reference: Tensor,
    *,
    bandwidth: float | Tensor | None = None,
    num_permutations: int = 500,
    generator: torch.Generator | None = None,
) -> dict[str, Tensor]:
    r"""Unbiased :math:`\mathrm{MMD}^2` with an RBF kernel and its permutation p-value.

    .. math::
        \widehat{\mathrm{MMD}}^2_u = \frac{1}{n(n-1)} \sum_{i \ne j} k(y_i, y_j)
        + \frac{1}{m(m-1)} \sum_{i \ne j} k(x_i, x_j) - \frac{2}{nm} \sum_{i, j} k(y_i, x_j),

    :math:`k(a, b) = \exp(-\|a - b\|^2 / (2 \ell^2))`, :math:`\ell` the median pairwise
    distance of the pooled sample by default. The estimator is unbiased (it can be
    negative) and zero in expectation when both sets come from one distribution.

    Test of :math:`H_0`: "same distribution". The pooled sample is relabelled ``P`` times
    at random; all relabellings are evaluated as one ``(N, N) @ (N, P)`` matmul from the
    same Gram matrix, and :math:`p = (1 + \#\{T_b \ge T\}) / (1 + P)`, which is valid
    (level at most :math:`\alpha`) for any sample sizes because the pooled sample is
    exchangeable under :math:`H_0`.

    Memory: ``O(N^2 + N P)`` per comparison, ``N = n + m``.

    Arguments:
        samples: approximation's samples :math:`y`, shape ``(*, n, D)``, ``n >= 2``.
        reference: reference samples :math:`x`, shape ``(*, m, D)``, ``m >= 2``.
        bandwidth: :math:`\ell`, a float or a tensor of shape ``(*)``; ``None``: median
            heuristic on the pooled sample (computed once and kept for every permutation).
        num_permutations: ``P``; ``0`` skips the test (``p_value`` is NaN).
        generator: random generator for the permutations.

    Returns:
        dict with ``statistic`` (:math:`\widehat{\mathrm{MMD}}^2_u`, differentiable in the
        samples), ``p_value`` and ``bandwidth``, each of shape ``(*)``.

    Example:
        >>> g = torch.Generator().manual_seed(0)
        >>> x, y = torch.randn(2, 200, 2, generator=g)
        >>> mmd(x, y, generator=g)["p_value"] > 0.05  # same distribution
        tensor(True)
        >>> mmd(2.0 * x, y, generator=g)["p_value"]  # standard deviation doubled
        tensor(0.0020)

    References:
        Gretton, Borgwardt, Rasch, Schoelkopf, Smola. "A Kernel Two-Sample Test."
        JMLR 13, 2012.
    """
    _check_sets(samples, reference, min_rows=2)
    if num_permutations != 0:
        check_positive("num_permutations", num_permutations, integer=True)
    n, m = samples.shape[-2], reference.shape[-2]
    pooled = torch.cat([samples, reference], -2)
    if bandwidth is None:
        bandwidth = median_bandwidth(pooled)
    else:
        _check_bandwidth(bandwidth)
    gram = exponentiated(sq_distances(pooled, pooled), bandwidth)
    eye = torch.eye(n + m, dtype=torch.bool, device=gram.device)
    gram = gram.masked_fill(eye, 0.0)
    batch = pooled.shape[:-2]
    observed = torch.zeros(*batch, n + m, 1, dtype=gram.dtype, device=gram.device)
    observed[..., :n, :] = 1.0
    statistic = _mmd_from_gram(gram, observed, n, m)[..., 0]
    if num_permutations:
        keys = torch.rand(*batch, num_permutations, n + m, generator=generator)
        first = keys.argsort(-1)[..., :n].to(gram.device)
        membership = torch.zeros(
            *batch, num_permutations, n + m, dtype=gram.dtype, device=gram.device
        ).scatter_(-1, first, 1.0)
        with torch.no_grad():
            draws = _mmd_from_gram(gram.detach(), membership.transpose(-1, -2), n, m)
        p_value = monte_carlo_p_value(statistic, draws, dtype=gram.dtype)
    else:
        p_value = torch.full_like(statistic.detach(), float("nan"))
    bandwidth = torch.as_tensor(bandwidth, dtype=pooled.dtype, device=pooled.device)
    return {"statistic": statistic, "p_value": p_value, "bandwidth": bandwidth.expand(batch)}


# -- Frechet distance -----------------------------------------------------------------
def gaussian_moments(points: Tensor) -> tuple[Tensor, Tensor]:
    """Mean ``(*, D)`` and unbiased covariance ``(*, D, D)`` of ``points`` ``(*, n, D)``,
    in float64, from centred moments (:mod:`calib_lightning.functional._moments`)."""
    check_points("points", points, min_rows=2)
    return variance_from_moments(moments(points, covariance=True), covariance=True)


def _sqrt_psd(matrix: Tensor) -> Tensor:
    """Symmetric square root of a positive semi-definite matrix by eigendecomposition."""
    values, vectors = torch.linalg.eigh(0.5 * (matrix + matrix.transpose(-1, -2)))
    return (vectors * values.clamp_min(0.0).sqrt().unsqueeze(-2)) @ vectors.transpose(-1, -2)


def frechet_distance_from_moments(
    mean1: Tensor, cov1: Tensor, mean2: Tensor, cov2: Tensor
) -> Tensor:
    r"""Squared Frechet distance between :math:`N(\mu_1, \Sigma_1)` and :math:`N(\mu_2, \Sigma_2)`.

    .. math::
        d^2 = \|\mu_1 - \mu_2\|^2 + \operatorname{tr}\Big(\Sigma_1 + \Sigma_2
        - 2 \big(\Sigma_1^{1/2} \Sigma_2 \Sigma_1^{1/2}\big)^{1/2}\Big)

    the squared 2-Wasserstein distance between the two Gaussians. The trace of the
    matrix square root is the sum of the square roots of the eigenvalues of the
    symmetric PSD matrix :math:`\Sigma_1^{1/2} \Sigma_2 \Sigma_1^{1/2}`, computed with
    ``eigh`` in float64 (no complex ``sqrtm`` of a non-symmetric product).

    Arguments:
        mean1: first mean ``(*, D)``.
        cov1: first covariance ``(*, D, D)``, symmetric positive semi-definite.
        mean2: second mean ``(*, D)``.
        cov2: second covariance ``(*, D, D)``, symmetric positive semi-definite.

    Returns:
        ``(*)`` in float64, clamped at zero.
    """
    mean1, mean2, cov1, cov2 = (t.double() for t in (mean1, mean2, cov1, cov2))
    root1 = _sqrt_psd(cov1)
    middle = root1 @ cov2 @ root1
    middle = 0.5 * (middle + middle.transpose(-1, -2))
    cross = torch.linalg.eigvalsh(middle).clamp_min(0.0).sqrt().sum(-1)
    trace = torch.diagonal(cov1, dim1=-2, dim2=-1).sum(-1)
    trace = trace + torch.diagonal(cov2, dim1=-2, dim2=-1).sum(-1)
    return (((mean1 - mean2) ** 2).sum(-1) + trace - 2.0 * cross).clamp_min(0.0)


def frechet_distance(samples: Tensor, reference: Tensor) -> Tensor:
    r"""Squared Frechet distance between Gaussian fits of two sample sets (FID on parameters).

    Fits :math:`N(\bar y, S_y)` and :math:`N(\bar x, S_x)` (unbiased covariances) and
    returns :func:`frechet_distance_from_moments` of the fits. It compares the first two
    moments only: two different distributions with equal mean and covariance are at
    distance zero (use :func:`mmd` for a consistent test).

    Arguments:
        samples: ``(*, n, D)``, ``n >= 2``.
        reference: ``(*, m, D)``, ``m >= 2``.

    Returns:
        ``(*)`` in the dtype of ``samples`` (computed in float64).

    Example:
        >>> g = torch.Generator().manual_seed(0)
        >>> x = torch.randn(100_000, 2, generator=g, dtype=torch.float64)
        >>> frechet_distance(x + 1.0, 2.0 * x)  # exact: 2 * 1^2 + 2 * (1 - 2)^2 = 4
        tensor(4.0062, dtype=torch.float64)

    References:
        Heusel, Ramsauer, Unterthiner, Nessler, Hochreiter. "GANs Trained by a Two
        Time-Scale Update Rule Converge to a Local Nash Equilibrium." NeurIPS 2017.
        Dowson and Landau. "The Frechet distance between multivariate normal
        distributions." J. Multivariate Analysis 12, 1982.
    """
    _check_sets(samples, reference, min_rows=2)
    distance = frechet_distance_from_moments(
        *gaussian_moments(samples), *gaussian_moments(reference)
    )
    return distance.to(samples.dtype)


# -- density and coverage -------------------------------------------------------------
def knn_sq_radii(reference: Tensor, k: int = 5, block_size: int = 1024) -> Tensor:
    r"""Squared distance from each reference point to its ``k``-th nearest other reference point.

    Arguments:
        reference: ``(*, m, D)`` with ``m > k``.
        k: the neighbour.
        block_size: rows of the ``(m, m)`` distance matrix computed at once.

    Returns:
        ``(*, m)``.
    """
    check_positive("k", k, integer=True)
    check_points("reference", reference, min_rows=k + 1)
    check_positive("block_size", block_size, integer=True)
    m = reference.shape[-2]
    radii = []
    for rows in row_blocks(m, block_size):
        sq = sq_distances(reference[..., rows, :], reference)
        index = torch.arange(rows.stop - rows.start, device=sq.device)
        sq[..., index, index + rows.start] = float("inf")  # a point is not its own neighbour
        radii.append(sq.kthvalue(k, -1).values)
    return torch.cat(radii, -1)


def ball_counts(
    samples: Tensor, reference: Tensor, sq_radii: Tensor, block_size: int = 1024
) -> Tensor:
    r"""How many ``samples`` fall inside each reference ball :math:`B(x_i, r_i)`.

    Arguments:
        samples: ``(*, n, D)``.
        reference: ``(*, m, D)``.
        sq_radii: :math:`r_i^2`, ``(*, m)`` (from :func:`knn_sq_radii`).
        block_size: samples processed at once (memory ``block_size * m``).

    Returns:
        ``(*, m)`` counts :math:`\sum_j 1[\|y_j - x_i\| < r_i]` (int64).
    """
    check_positive("block_size", block_size, integer=True)
    if samples.shape[-1] != reference.shape[-1] or sq_radii.shape != reference.shape[:-1]:
        raise ValueError(
            f"samples (*, n, D), reference (*, m, D) and sq_radii (*, m) must match, got "
            f"{tuple(samples.shape)}, {tuple(reference.shape)} and {tuple(sq_radii.shape)}"
        )
    counts = torch.zeros(sq_radii.shape, dtype=torch.long, device=sq_radii.device)
    for rows in row_blocks(samples.shape[-2], block_size):
        sq = sq_distances(samples[..., rows, :], reference)
        counts += (sq < sq_radii.unsqueeze(-2)).sum(-2)
    return counts


def density_coverage(
    samples: Tensor, reference: Tensor, *, k: int = 5, block_size: int = 1024
) -> dict[str, Tensor]:
    r"""Density (fidelity) and coverage (diversity) of ``samples`` against ``reference``.

    With :math:`r_i` the distance from reference point :math:`x_i` to its ``k``-th
    nearest other reference point:

    .. math::
        \mathrm{density} = \frac{1}{k n} \sum_{j=1}^{n} \sum_{i=1}^{m}
        1[y_j \in B(x_i, r_i)], \qquad
        \mathrm{coverage} = \frac{1}{m} \sum_{i=1}^{m} 1[\exists j: y_j \in B(x_i, r_i)].

    When both sets come from one continuous distribution,
    :math:`E[\mathrm{density}] = 1` and
    :math:`E[\mathrm{coverage}] = 1 - \prod_{j=1}^{k} \frac{m - j}{m - j + n}`
    (:math:`\to 1 - 2^{-k}` for :math:`n = m \to \infty`). The balls adapt to the local
    density of the reference, so density stays near 1 wherever the samples stay inside
    the reference's support and drops below 1 when they leave it (too wide, shifted);
    coverage below its expectation means parts of the reference are missed (too
    narrow, dropped modes).

    Arguments:
        samples: ``(*, n, D)`` (the "fake" set).
        reference: ``(*, m, D)`` (the "real" set), ``m > k``.
        k: nearest neighbour defining the balls (5 in the paper).
        block_size: rows of the distance matrices computed at once; memory is
            ``O(block_size * m)``.

    Returns:
        dict with ``density`` and ``coverage``, each ``(*)``.

    References:
        Naeem, Oh, Uh, Choi, Yoo. "Reliable Fidelity and Diversity Metrics for
        Generative Models." ICML 2020.
    """
    _check_sets(samples, reference, min_rows=1)
    sq_radii = knn_sq_radii(reference, k, block_size)
    counts = ball_counts(samples, reference, sq_radii, block_size)
    density = counts.sum(-1).to(samples.dtype) / (k * samples.shape[-2])
    coverage = (counts > 0).to(samples.dtype).mean(-1)
    return {"density": density, "coverage": coverage}


# -- Vendi score ----------------------------------------------------------------------
def vendi_score(samples: Tensor, bandwidth: float | Tensor, *, q: float = 1.0) -> Tensor:
    r"""Vendi score: the effective number of distinct points in ``samples``.

    With :math:`\lambda_i` the eigenvalues of :math:`K / n`,
    :math:`K_{ij} = \exp(-\|y_i - y_j\|^2 / (2 \ell^2))` (so :math:`\sum_i \lambda_i = 1`):

    .. math::
        \mathrm{VS}_q = \exp\Big(\frac{1}{1 - q} \log \sum_i \lambda_i^q\Big), \qquad
        \mathrm{VS}_1 = \exp\Big(-\sum_i \lambda_i \log \lambda_i\Big),

    :math:`\mathrm{VS}_\infty = 1 / \max_i \lambda_i` and :math:`\mathrm{VS}_0` the rank
    of :math:`K` (eigenvalues below ``n * eps * max`` count as zero for every ``q``).
    ``n`` identical points score 1; ``k`` clusters much tighter than :math:`\ell` and
    much farther apart than :math:`\ell` score ``k``. Larger ``q`` weighs the largest
    modes more; small ``q`` counts near-duplicates too (``VS_0`` counts distinct points).

    The score depends on :math:`\ell` by design (it counts points that differ at that
    scale), so there is no per-set default: compare sets at one bandwidth, e.g.
    ``calib_lightning.kernels.median_bandwidth(reference)``. Cost: one ``(n, n)``
    symmetric eigendecomposition in float64.

    Arguments:
        samples: ``(*, n, D)``.
        bandwidth: :math:`\ell`, a positive float or a tensor of shape ``(*)``.
        q: order, ``0 <= q <= inf``.

    Returns:
        ``(*)`` in the dtype of ``samples``.

    Example:
        >>> centers = torch.tensor([[0.0, 0.0], [10.0, 0.0], [0.0, 10.0]])
        >>> clusters = centers.repeat_interleave(50, 0)  # 3 clusters of 50 identical points
        >>> vendi_score(clusters, 1.0)
        tensor(3.0000)

    References:
        Friedman and Dieng. "The Vendi Score: A Diversity Evaluation Metric for
        Machine Learning." TMLR 2023.
    """
    check_points("samples", samples, min_rows=1)
    _check_bandwidth(bandwidth)
    if isinstance(q, bool) or not isinstance(q, int | float) or not q >= 0:
        raise ValueError(f"q must be a number in [0, inf], got {q!r}")
    n = samples.shape[-2]
    points = samples.detach().double()
    bandwidth = torch.as_tensor(bandwidth, dtype=torch.float64, device=points.device)
    gram = exponentiated(sq_distances(points, points), bandwidth)
    values = torch.linalg.eigvalsh(gram / n)
    # eigenvalues below the rounding level of the decomposition are zeros of the rank
    tol = n * torch.finfo(values.dtype).eps * values.amax(-1, keepdim=True)
    values = torch.where(values > tol, values, torch.zeros_like(values))
    values = values / values.sum(-1, keepdim=True)
    if q == 0:
        entropy = (values > 0).sum(-1).double().log()
    elif q == 1:
        entropy = -torch.special.xlogy(values, values).sum(-1)
    elif math.isinf(q):
        entropy = -values.amax(-1).log()
    else:
        powers = torch.where(values > 0, values.clamp_min(1e-300) ** q, 0.0)
        entropy = powers.sum(-1).log() / (1.0 - q)
    return entropy.exp().to(samples.dtype)
