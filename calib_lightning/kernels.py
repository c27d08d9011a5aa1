r"""Kernels on parameter space and between distributions, with closed-form derivatives.

Parameter-space kernels are radial, :math:`l(y, y') = \varphi(\|y - y'\|^2)`, so every
derivative the Stein kernel needs follows from :math:`\varphi, \varphi', \varphi''`:

.. math::
    \nabla_y l = 2 \varphi'(q)\, r, \quad \nabla_{y'} l = -2 \varphi'(q)\, r, \quad
    \sum_a \frac{\partial^2 l}{\partial y_a \partial y'_a} = -2 D \varphi'(q) - 4 q \varphi''(q),

with :math:`r = y - y'` and :math:`q = \|r\|^2`. All pairs are computed with matrix
products; there is no per-pair autograd and no Python loop over pairs.

Kernels between distributions compare score functions on shared base points
(Glaser et al. 2023, section 4): the generalized Fisher divergence (GFD) and its
kernelized version (KGFD), exponentiated into positive-definite kernels.

References:
    Glaser, Widmann, Lindsten, Gretton. "Fast and Scalable Score-Based Kernel
    Calibration Tests." UAI 2023.
"""

from __future__ import annotations

import torch
from torch import Tensor

from calib_lightning._checks import check_choice

__all__ = [
    "DISTRIBUTION_KERNELS",
    "KERNELS",
    "embedding_sq_distances",
    "exponentiated",
    "gaussian_expected_kernel",
    "gfd_sq_distances",
    "kgfd_sq_distances",
    "median_bandwidth",
    "median_from_sq_distances",
    "radial_profile",
    "score_embedding",
    "sq_distances",
    "stein_kernel",
]

KERNELS = ("rbf", "imq")
_IMQ_BETA = -0.5


def sq_distances(a: Tensor, b: Tensor) -> Tensor:
    r"""Squared Euclidean distances :math:`\|a_i - b_j\|^2`: ``(*, N, F)``, ``(*, M, F)`` ->
    ``(*, N, M)``, as :math:`|a|^2 + |b|^2 - 2 a b^\top`, clamped at zero."""
    a_sq = (a * a).sum(-1)
    b_sq = (b * b).sum(-1)
    d2 = a_sq.unsqueeze(-1) + b_sq.unsqueeze(-2) - 2.0 * (a @ b.transpose(-1, -2))
    return d2.clamp_min(0.0)


def radial_profile(kernel: str, q: Tensor, bandwidth: Tensor | float) -> tuple[Tensor, ...]:
    r"""Profile :math:`\varphi(q)` and its first two derivatives in :math:`q = \|r\|^2`.

    * ``"rbf"``: :math:`\varphi = \exp(-q / (2 \ell^2))`.
    * ``"imq"``: :math:`\varphi = (1 + q / \ell^2)^{-1/2}` (Gorham and Mackey, 2017).

    Arguments:
        kernel: ``"rbf"`` or ``"imq"``.
        q: squared distances, any shape.
        bandwidth: :math:`\ell`, a float or a tensor broadcastable to ``q``.

    Returns:
        ``(phi, dphi, d2phi)``, each shaped like ``q``.
    """
    check_choice("kernel", kernel, KERNELS)
    ell2 = torch.as_tensor(bandwidth, dtype=q.dtype, device=q.device) ** 2
    if kernel == "rbf":
        phi = torch.exp(-q / (2.0 * ell2))
        dphi = -phi / (2.0 * ell2)
        return phi, dphi, phi / (4.0 * ell2 * ell2)
    u = 1.0 + q / ell2
    beta = _IMQ_BETA
    phi = u**beta
    dphi = beta * u ** (beta - 1.0) / ell2
    d2phi = beta * (beta - 1.0) * u ** (beta - 2.0) / (ell2 * ell2)
    return phi, dphi, d2phi


def stein_kernel(
    y1: Tensor,
    s1: Tensor,
    y2: Tensor,
    s2: Tensor,
    kernel: str = "rbf",
    bandwidth: Tensor | float = 1.0,
) -> Tensor:
    r"""Stein kernel :math:`h((p, y), (p', y'))` of Glaser et al. (2023, eq. 10) for all pairs.

    .. math::
        h = l(y, y')\, s_p(y)^\top s_{p'}(y') + s_p(y)^\top \nabla_{y'} l
            + s_{p'}(y')^\top \nabla_y l + \sum_a \partial^2_{y_a y'_a} l

    Arguments:
        y1: points, shape ``(*, N, D)``; s1: the scores of their models at them, ``(*, N, D)``.
        y2: points, shape ``(*, M, D)``; s2: scores, ``(*, M, D)``.
        kernel: ``"rbf"`` or ``"imq"``.
        bandwidth: :math:`\ell`, a float or a tensor of shape ``(*)``.

    Returns:
        ``(*, N, M)`` matrix of :math:`h` values.
    """
    d = y1.shape[-1]
    bandwidth = torch.as_tensor(bandwidth, dtype=y1.dtype, device=y1.device)
    if bandwidth.ndim > 0:
        bandwidth = bandwidth[..., None, None]
    center = y1.mean(-2, keepdim=True).detach()  # translation invariant; keeps float32 exact
    y1, y2 = y1 - center, y2 - center
    q = sq_distances(y1, y2)
    phi, dphi, d2phi = radial_profile(kernel, q, bandwidth)
    s1_y1 = (s1 * y1).sum(-1).unsqueeze(-1)  # s_i . y_i
    s2_y2 = (s2 * y2).sum(-1).unsqueeze(-2)  # s_j . y_j
    s1_r = s1_y1 - s1 @ y2.transpose(-1, -2)  # s_i . (y_i - y_j)
    s2_r = y1 @ s2.transpose(-1, -2) - s2_y2  # s_j . (y_i - y_j)
    ss = s1 @ s2.transpose(-1, -2)
    return phi * ss - 2.0 * dphi * (s1_r - s2_r) - 2.0 * d * dphi - 4.0 * q * d2phi


def median_from_sq_distances(sq: Tensor) -> Tensor:
    r"""Median heuristic from a square matrix of squared distances ``(*, N, N)``.

    Returns the median of the off-diagonal distances :math:`\sqrt{q_{ij}}`, ``i < j``,
    detached. Degenerate inputs (all points equal) fall back to the largest
    distance, then to 1, so the result is always positive.
    """
    n = sq.shape[-1]
    iu = torch.triu_indices(n, n, offset=1, device=sq.device)
    dist = sq.detach()[..., iu[0], iu[1]].clamp_min(0.0).sqrt()
    med = dist.median(-1).values
    fallback = torch.where(dist.amax(-1) > 0, dist.amax(-1), torch.ones_like(med))
    return torch.where(med > 0, med, fallback)


def median_bandwidth(points: Tensor, max_points: int = 1000) -> Tensor:
    r"""Median-heuristic bandwidth: median pairwise distance of ``points`` ``(*, N, F)``.

    Computed on at most ``max_points`` evenly spaced rows, so its cost is bounded
    whatever ``N``; detached from the graph. Returns a tensor of shape ``(*)``.
    """
    points = points.detach()
    n = points.shape[-2]
    if n > max_points:
        index = torch.linspace(0, n - 1, max_points, device=points.device).long()
        points = points.index_select(-2, index)
    return median_from_sq_distances(sq_distances(points, points))


def exponentiated(sq_dist: Tensor, bandwidth: Tensor | float) -> Tensor:
    r"""Exponentiated Hilbertian metric :math:`\exp(-d^2 / (2 \sigma^2))`."""
    sigma = torch.as_tensor(bandwidth, dtype=sq_dist.dtype, device=sq_dist.device)
    if sigma.ndim > 0:
        sigma = sigma[..., None, None]
    return torch.exp(-sq_dist / (2.0 * sigma**2))


DISTRIBUTION_KERNELS = ("gfd", "kgfd")


def score_embedding(
    features: Tensor,
    kind: str = "gfd",
    base_points: Tensor | None = None,
    base_bandwidth: Tensor | float | None = None,
) -> tuple[Tensor, Tensor]:
    r"""Embed each model's scores at the base points so that distances are inner products.

    Returns ``(left, right)``, both ``(*, N, F)``, such that the divergence between
    models ``i`` and ``j`` is
    :math:`\langle l_i, r_i \rangle + \langle l_j, r_j \rangle - 2 \langle l_i, r_j \rangle`.
    This lets callers compute any block of the divergence matrix with one matmul.

    * ``"gfd"``: :math:`\mathrm{GFD}(P_i, P_j) = \frac{1}{m} \sum_k \|s_i(z_k) - s_j(z_k)\|^2`,
      with ``left = right`` the flattened scores over :math:`\sqrt{m}`.
    * ``"kgfd"``: :math:`\mathrm{KGFD}(P_i, P_j) = \frac{1}{m^2} \sum_{k,l} K(z_k, z_l)
      \langle (s_i - s_j)(z_k), (s_i - s_j)(z_l) \rangle` with a Gaussian :math:`K`
      on the base points (median-heuristic bandwidth by default); ``right`` is the
      ``K``-smoothed ``left``.

    Arguments:
        features: scores of each model at ``m`` shared base points, ``(*, N, m, D)``.
        kind: ``"gfd"`` or ``"kgfd"``.
        base_points: the base points ``(m, D)`` (needed for ``"kgfd"``).
        base_bandwidth: bandwidth of :math:`K` for ``"kgfd"``; ``None``: median heuristic.
    """
    check_choice("distribution_kernel", kind, DISTRIBUTION_KERNELS)
    m = features.shape[-2]
    features = features - features.mean(-3, keepdim=True).detach()  # shift invariant
    if kind == "gfd":
        left = features.flatten(-2) / m**0.5
        return left, left
    if base_points is None:
        raise ValueError("base_points must be given for the 'kgfd' kernel, got None")
    if base_bandwidth is None:
        base_bandwidth = median_bandwidth(base_points)
    gram = exponentiated(sq_distances(base_points, base_points), base_bandwidth)
    smoothed = torch.einsum("kl,...nld->...nkd", gram.to(features.dtype), features)
    return features.flatten(-2) / m, smoothed.flatten(-2) / m


def embedding_sq_distances(
    left: Tensor, right: Tensor, rows: slice | None = None
) -> Tensor:
    """Divergences between the models in ``rows`` (default all) and all models,
    from a :func:`score_embedding`: ``(*, len(rows), N)``."""
    norms = (left * right).sum(-1)
    rows = rows if rows is not None else slice(None)
    inner = left[..., rows, :] @ right.transpose(-1, -2)
    return (norms[..., rows].unsqueeze(-1) + norms.unsqueeze(-2) - 2.0 * inner).clamp_min(0.0)


def gfd_sq_distances(features: Tensor) -> Tensor:
    r"""Generalized Fisher divergence matrix ``(*, N, N)`` from scores ``(*, N, m, D)``
    at shared base points (see :func:`score_embedding`)."""
    return embedding_sq_distances(*score_embedding(features, "gfd"))


def kgfd_sq_distances(
    features: Tensor, base_points: Tensor, base_bandwidth: Tensor | float | None = None
) -> Tensor:
    r"""Kernelized generalized Fisher divergence matrix ``(*, N, N)`` (see
    :func:`score_embedding`)."""
    return embedding_sq_distances(*score_embedding(features, "kgfd", base_points, base_bandwidth))


def gaussian_expected_kernel(
    mean1: Tensor, var1: Tensor, mean2: Tensor, var2: Tensor, bandwidth: Tensor | float
) -> Tensor:
    r"""Closed form of :math:`E\, l(z, z')` for independent diagonal Gaussians and an RBF ``l``.

    For :math:`z \sim N(\mu, \mathrm{diag}(v))`, :math:`z' \sim N(\mu', \mathrm{diag}(v'))`
    and :math:`l(z, z') = \exp(-\|z - z'\|^2 / (2 \ell^2))`:

    .. math::
        E\, l(z, z') = \prod_a \Big(1 + \frac{v_a + v'_a}{\ell^2}\Big)^{-1/2}
        \exp\Big(-\frac{(\mu_a - \mu'_a)^2}{2 (v_a + v'_a + \ell^2)}\Big)

    A point is a Gaussian with zero variance, so this also gives :math:`l(y, y')` and
    :math:`E_z\, l(z, y')`. Inputs broadcast against each other; the last axis is ``D``.
    A tensor ``bandwidth`` must broadcast against the inputs without their last axis.
    """
    ell2 = torch.as_tensor(bandwidth, dtype=mean1.dtype, device=mean1.device) ** 2
    if ell2.ndim > 0:
        ell2 = ell2.unsqueeze(-1)
    total = var1 + var2 + ell2
    log_value = -0.5 * torch.log(total / ell2) - (mean1 - mean2) ** 2 / (2.0 * total)
    return torch.exp(log_value.sum(-1))
