r"""The radial map of latent recalibration: held-out latent norms sent to the chi law.

A flow writes :math:`q(\theta \mid x)` as the push-forward of :math:`N(0, I_D)` by
:math:`T_x`. On held-out pairs the latent norms :math:`t_i = \|T_{x_i}^{-1}(\theta_i)\|`
follow the :math:`\chi_D` law when the flow is calibrated. Latent recalibration (Dheur
and Ben Taieb, 2025) places a radial map before the flow,

.. math::
    u = R(\|z\|) \, \frac{z}{\|z\|}, \qquad R = F_{\chi_D}^{-1} \circ \hat F, \qquad
    \log |\det \partial u / \partial z| = (D - 1) (\log R(t) - \log t) + \log R'(t),

with :math:`\hat F` an estimate of the law of the held-out norms, so that the
recalibrated latents :math:`u` have :math:`\chi_D` norms.

Here :math:`R` is piecewise linear in :math:`(\log t, \log R)`, through knots at sorted
held-out norms :math:`t_{(i)}`, with unit slope beyond the end knots (a pure scaling near
the origin and in the tails, so the density stays smooth there). Its knots are chosen so
that :math:`R` stays inside the band

.. math::
    r_{i - w} \le R(t_{(i)}) \le r_{i + w - 1}, \qquad r_j = F_{\chi_D}^{-1}\big(j / (n + 1)\big)

(:math:`r_j = 0` for :math:`j \le 0`, :math:`\infty` for :math:`j \ge n + 1`) at every
order statistic, :math:`w` = ``band``. Greedy: from each knot, the next one is the
farthest sorted norm whose straight segment keeps every norm in between inside the band
(knot values at the band's centre, :math:`F_{\chi_D}^{-1}((i - 1/2)/(n + 1))`). ``band=1``
is the order-statistic (exact) form; a wider band buys fewer knots, hence a smoother
density, for a looser guarantee.

**Guarantee.** Let :math:`(t_1, \dots, t_n, t_{n+1})` be exchangeable with no ties (the
held-out norms and a new pair's norm, the map before the radius fixed independently of
these pairs), and :math:`c = F_{\chi^2_D}(R(t_{n+1})^2)` the level of the smallest
recalibrated latent ball holding the new pair. Then for every level :math:`a \in [0, 1]`

.. math::
    a - \frac{w}{n + 1} \;\le\; P(c \le a) \;\le\; a + \frac{w}{n + 1}.

Proof: let :math:`k = \lfloor a (n + 1) \rfloor`. If :math:`t_{n+1} \le t_{(k - w + 1)}`,
then :math:`R(t_{n+1}) \le R(t_{(k-w+1)}) \le r_k \le F_{\chi_D}^{-1}(a)`, so
:math:`c \le a`; the rank of :math:`t_{n+1}` among the :math:`n + 1` norms is uniform, so
this has probability :math:`(k - w + 1)/(n + 1) \ge a - w/(n + 1)`. Conversely
:math:`c \le a` gives :math:`R(t_{n+1}) \le F_{\chi_D}^{-1}(a) < r_{k+1} \le
R(t_{(k + w + 1)})`, so :math:`t_{n+1} < t_{(k + w + 1)}`, of probability
:math:`(k + w)/(n + 1) \le a + w/(n + 1)`. (Terms with indices outside ``1..n`` are
trivial.) The recalibrated ball of level :math:`a`, :math:`\{\|u\|^2 \le
F_{\chi^2_D}^{-1}(a)\}`, is the recalibrated flow's own credible region of mass
:math:`a`, so its coverage of new pairs is :math:`a` within :math:`w / (n + 1)`.

References:
    V. Dheur and S. Ben Taieb, "Multivariate latent recalibration for conditional
    normalizing flows", arXiv:2505.16636, 2025.
"""

from __future__ import annotations

import torch
from scipy import special
from torch import Tensor

from calib_lightning._utils.validation import check_finite

__all__ = ["chi_quantile", "latent_ball_levels", "radial_knots", "radial_map"]

MAX_SEGMENT = 256  # longest segment tried (in sorted norms) from one knot


def chi_quantile(p: Tensor, dim: int) -> Tensor:
    r""":math:`F_{\chi_D}^{-1}(p)`, elementwise, float64 (0 at ``p = 0``, inf at ``p = 1``)."""
    value = special.gammaincinv(dim / 2.0, p.detach().double().cpu().numpy())
    return torch.as_tensor(2.0 * value, dtype=torch.float64).sqrt().to(p.device)


def latent_ball_levels(u: Tensor) -> Tensor:
    r"""Level :math:`F_{\chi^2_D}(\|u\|^2)` of the smallest latent ball holding each
    ``u (*, D)``: uniform on ``[0, 1]`` when ``u ~ N(0, I_D)``. Shape ``(*,)``."""
    dim = u.shape[-1]
    return torch.special.gammainc(u.new_tensor(dim / 2.0), u.pow(2).sum(-1) / 2)


def radial_knots(norms: Tensor, dim: int, band: int = 1) -> Tensor:
    r"""Knots of the radial map fitted on held-out latent norms.

    Arguments:
        norms: :math:`t_i = \|z_i\|`, shape ``(n,)``, positive and finite, ``n >= 2``.
        dim: :math:`D`, the latent dimension.
        band: :math:`w \ge 1`: the guarantee's slack in ranks (module docstring).

    Returns:
        ``(2, K)`` float64: :math:`\log t` and :math:`\log R` at the ``K`` knots, both
        strictly increasing (``K >= 2``).
    """
    if norms.ndim != 1 or norms.shape[0] < 2:
        raise ValueError(f"norms must have shape (n,) with n >= 2, got {tuple(norms.shape)}")
    check_finite("norms", norms)
    if bool((norms <= 0).any()):
        raise ValueError("norms must be positive, got a zero or negative latent norm")
    _check_dim(dim)
    if int(band) != band or band < 1:
        raise ValueError(f"band must be an integer >= 1, got {band!r}")
    n = norms.shape[0]
    log_t = norms.detach().double().cpu().log().sort().values
    log_t = log_t + 1e-9 * torch.arange(n, dtype=torch.float64)  # ties: strictly increasing
    ranks = torch.arange(1, n + 1, dtype=torch.float64)

    def log_r(p: Tensor) -> Tensor:
        return chi_quantile(p.clamp(0.0, 1.0), dim).log()

    centre = log_r((ranks - 0.5) / (n + 1))
    lower = log_r((ranks - band).clamp_min(0.0) / (n + 1))  # -inf below rank 1
    upper = log_r((ranks + band - 1) / (n + 1))  # +inf from rank n + 1
    knots, start = [0], 0
    while start < n - 1:
        ends = torch.arange(start + 1, min(start + MAX_SEGMENT, n - 1) + 1)
        inner = torch.arange(start + 1, int(ends[-1]))  # the norms a segment passes over
        slope = (centre[ends] - centre[start]) / (log_t[ends] - log_t[start])
        line = centre[start] + slope[:, None] * (log_t[inner] - log_t[start])[None, :]
        inside = (line >= lower[inner]) & (line <= upper[inner])
        covered = inner[None, :] < ends[:, None]  # only the norms before each end count
        feasible = (inside | ~covered).all(1)
        start = int(ends[feasible].max())  # the next norm is always feasible
        knots.append(start)
    index = torch.tensor(knots)
    return torch.stack([log_t[index], centre[index]])


def radial_map(t: Tensor, knots: Tensor, *, inverse: bool = False) -> tuple[Tensor, Tensor]:
    r"""The radial map :math:`R(t)` and :math:`\log R'(t) + \log t - \log R(t)` (the log
    slope in :math:`(\log t, \log R)`), for norms ``t (*)``.

    With ``inverse=True``, :math:`R^{-1}` and its log slope. The Jacobian determinant of
    :math:`z \mapsto R(\|z\|) z / \|z\|` in :math:`D` dimensions is then
    :math:`D (\log R - \log t) + \text{log slope}`. Differentiable in ``t``; computed in
    float64 and returned in ``t``'s dtype.

    Arguments:
        t: norms, shape ``(*)``, non-negative (``t = 0`` maps to 0).
        knots: ``(2, K)`` from :func:`radial_knots`.
        inverse: evaluate :math:`R^{-1}`.
    """
    knots = knots.to(device=t.device, dtype=torch.float64)
    x_knots, y_knots = (knots[1], knots[0]) if inverse else (knots[0], knots[1])
    log_slope = torch.log((y_knots[1:] - y_knots[:-1]) / (x_knots[1:] - x_knots[:-1]))
    zero = torch.zeros(1, dtype=torch.float64, device=t.device)
    log_slope = torch.cat([zero, log_slope, zero])  # unit slope beyond the end knots
    log_t = t.double().clamp_min(1e-300).log()
    segment = torch.searchsorted(x_knots, log_t.detach().contiguous(), right=True)
    anchor = (segment - 1).clamp_min(0)
    log_out = y_knots[anchor] + log_slope[segment].exp() * (log_t - x_knots[anchor])
    out = torch.where(t > 0, log_out.exp(), torch.zeros_like(log_out))
    return out.to(t.dtype), log_slope[segment].to(t.dtype)


def _check_dim(dim: int) -> None:
    if int(dim) != dim or dim < 1:
        raise ValueError(f"dim must be an integer >= 1, got {dim!r}")
