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

from calib_lightning._utils.validation import check_choice

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
    "score_embedding",
    "sq_distances",
    "stein_kernel",
    "stein_kernel_terms",
]

KERNELS = ("rbf", "imq")
_IMQ_BETA = -0.5  # IMQ kernel (1 + q / l^2)^beta (Gorham and Mackey, 2017)


def sq_distances(a: Tensor, b: Tensor) -> Tensor:
    r"""Squared Euclidean distances :math:`\|a_i - b_j\|^2`: ``(*, N, F)``, ``(*, M, F)`` ->
    ``(*, N, M)``.

    Computed with one matmul as :math:`|a|^2 + |b|^2 - 2 a b^\top` after subtracting
    the (detached) mean :math:`c` of all ``N + M`` points from both sets. The distances
    are translation invariant, and centring keeps the three terms of the size of the
    spread of the points instead of their offset: without it, float32 points at
    offset 100 and spread 1 lose about 4 of their 7 digits to cancellation. The result
    is clamped at zero. This is the one place in the package where pairwise squared
    distances are formed this way.
    """
    count = a.shape[-2] + b.shape[-2]
    center = (a.detach().sum(-2, keepdim=True) + b.detach().sum(-2, keepdim=True)) / max(count, 1)
    a, b = a - center, b - center
    a_sq = (a * a).sum(-1)
    b_sq = (b * b).sum(-1)
    d2 = a_sq.unsqueeze(-1) + b_sq.unsqueeze(-2) - 2.0 * (a @ b.transpose(-1, -2))
    return d2.clamp_min(0.0)


def _evenly_spaced(n: int, count: int, device: torch.device) -> Tensor:
    """At most ``count`` evenly spaced indices into ``range(n)``."""
    return torch.linspace(0, n - 1, min(n, count), device=device).long()


def _widened(value: Tensor) -> Tensor:
    """Scores at base points ``(*, N, m, D)`` (:func:`score_embedding`) as they are when the
    squared differences of two rows, summed, stay finite in their dtype, else in float64
    (float32 on a device without float64, Apple MPS). A sharp posterior's scores at base
    points far from it can pass 1e19, where float32's squares overflow (its range ends at
    3.4e38); widening only then keeps the usual float32 case at float32 speed."""
    if not value.is_floating_point() or value.dtype == torch.float64 or value.numel() == 0:
        return value
    features = value.shape[-2] * value.shape[-1]
    safe = 0.1 * (torch.finfo(value.dtype).max / (4.0 * features)) ** 0.5
    if float(value.detach().abs().max()) <= safe:
        return value
    return value.to(torch.float32 if value.device.type == "mps" else torch.float64)


def _pairwise_bandwidth(bandwidth: Tensor | float, like: Tensor) -> Tensor:
    """A bandwidth, float or of shape ``(*)``, as a tensor that broadcasts against the
    pairwise ``(*, N, M)`` matrices built from ``like`` (its dtype and device)."""
    value = torch.as_tensor(bandwidth, dtype=like.dtype, device=like.device)
    return value[..., None, None] if value.ndim > 0 else value


def stein_kernel_terms(
    y1: Tensor,
    s1: Tensor,
    y2: Tensor,
    s2: Tensor,
    kernel: str = "rbf",
    bandwidth: Tensor | float = 1.0,
) -> tuple[Tensor, Tensor]:
    r"""The Stein kernel factored as :math:`h = \exp(\log \varphi) \cdot b`.

    Keeping :math:`\log \varphi` separate lets callers fold a second exponentiated
    kernel into a single ``exp`` (see :func:`stein_kernel` for the arguments). With
    :math:`c = s_1 \cdot r - s_2 \cdot r + D` and :math:`r = y_1 - y_2`:

    * RBF: :math:`b = s_1 \cdot s_2 + c / \ell^2 - q / \ell^4`, all inner products from
      one ``(N, 2D) x (2D, M)`` product;
    * IMQ (:math:`\beta = -1/2`, :math:`u = 1 + q / \ell^2`):
      :math:`b = s_1 \cdot s_2 - 2 \beta c / (u \ell^2) - 4 \beta (\beta - 1) q / (u^2 \ell^4)`.

    Returns:
        ``(log_phi, b)``, each ``(*, N, M)``.
    """
    check_choice("kernel", kernel, KERNELS)
    d = y1.shape[-1]
    ell2 = _pairwise_bandwidth(bandwidth, y1) ** 2
    center = y1.mean(-2, keepdim=True).detach()  # translation invariant; keeps float32 exact
    y1, y2 = y1 - center, y2 - center
    s1_y1, s2_y2 = (s1 * y1).sum(-1, keepdim=True), (s2 * y2).sum(-1, keepdim=True)
    q = sq_distances(y1, y2)
    if kernel == "rbf":
        y1_sq, y2_sq = (y1 * y1).sum(-1, keepdim=True), (y2 * y2).sum(-1, keepdim=True)
        # s1.s2 - (s1.y2 + y1.s2) / l^2 + 2 y1.y2 / l^4 as one product, then row/column terms
        left = torch.cat([s1, y1], -1)
        right = torch.cat([s2 - y2 / ell2, 2.0 * y2 / ell2**2 - s2 / ell2], -1)
        rows = (s1_y1 + d) / ell2 - y1_sq / ell2**2
        cols = (s2_y2 / ell2 - y2_sq / ell2**2).transpose(-1, -2)
        return -q / (2.0 * ell2), left @ right.transpose(-1, -2) + rows + cols
    beta = _IMQ_BETA
    u = 1.0 + q / ell2
    c = s1_y1 + s2_y2.transpose(-1, -2) - s1 @ y2.transpose(-1, -2) - y1 @ s2.transpose(-1, -2)
    bracket = s1 @ s2.transpose(-1, -2) - 2.0 * beta * (c + d) / (u * ell2)
    bracket = bracket - 4.0 * beta * (beta - 1.0) * q / (u * u * ell2 * ell2)
    return beta * torch.log(u), bracket


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
    log_phi, bracket = stein_kernel_terms(y1, s1, y2, s2, kernel, bandwidth)
    return torch.exp(log_phi) * bracket


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
    points = points.index_select(-2, _evenly_spaced(points.shape[-2], max_points, points.device))
    return median_from_sq_distances(sq_distances(points, points))


def exponentiated(sq_dist: Tensor, bandwidth: Tensor | float) -> Tensor:
    r"""Exponentiated Hilbertian metric :math:`\exp(-d^2 / (2 \sigma^2))`."""
    sigma = _pairwise_bandwidth(bandwidth, sq_dist)
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
    features = _widened(features)  # float64 where float32's squared differences overflow
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
    left: Tensor, right: Tensor, rows: slice | None = None, cols: slice | None = None
) -> Tensor:
    """Divergences between the models in ``rows`` and those in ``cols`` (default all),
    from a :func:`score_embedding`: ``(*, len(rows), len(cols))``."""
    rows = rows if rows is not None else slice(None)
    cols = cols if cols is not None else slice(None)
    norm_rows = (left[..., rows, :] * right[..., rows, :]).sum(-1)
    norm_cols = (left[..., cols, :] * right[..., cols, :]).sum(-1)
    inner = left[..., rows, :] @ right[..., cols, :].transpose(-1, -2)
    return (norm_rows.unsqueeze(-1) + norm_cols.unsqueeze(-2) - 2.0 * inner).clamp_min(0.0)


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
