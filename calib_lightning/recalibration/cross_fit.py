r"""The latent methods' maps, fitted and scored on held-out pairs: :func:`cross_fit_scores`.

How each latent candidate of ``cl.recalibrate`` is fitted (:func:`_fit_map`: scales,
:func:`scale_kinds`, then the radial map with its band, :func:`default_band`) and how
``method="auto"`` scores it without scoring a map on the pairs it was fitted on:
two-fold cross-fitting, each half fitted and the other scored, both ways. The scores are
the held-out HPD calibration error (the expected-coverage curve against the diagonal at
:data:`CALIBRATION_LEVELS`, :func:`coverage_gaps`), the latent coverage error and the
held-out NLL. The rule that chooses from them is :mod:`.selection`.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from calib_lightning.functional.marginal import marginal_knots
from calib_lightning.functional.radial import latent_ball_levels, radial_knots
from calib_lightning.recalibration._hpd import LatentDraws, levels_and_log_share, on_cpu
from calib_lightning.recalibration.radial import LatentMap, standard_normal_log_prob
from calib_lightning.recalibration.scale import latent_log_scale, shared_hpd_log_scale

__all__ = [
    "AUTO_CANDIDATES",
    "CALIBRATION_LEVELS",
    "coverage_gaps",
    "cross_fit_scores",
    "default_band",
    "marginal_coverage_gaps",
    "scale_kinds",
]

#: the candidates of ``method="auto"``, in order of preference on ties (simplest first:
#: the marginal maps, ``D`` monotone splines, come after the one-dimensional maps)
AUTO_CANDIDATES = ("none", "scale", "radial", "scale+radial", "marginal", "marginal+radial")
#: the levels the held-out expected-coverage curve is compared with the diagonal at
CALIBRATION_LEVELS = torch.arange(1, 100, dtype=torch.float64) / 100


def scale_kinds(scale_target: str | None) -> dict[str, str]:
    """How each candidate with scales fits them: ``"hpd"`` (one shared scale targeting
    HPD coverage) or ``"latent"`` (per coordinate). ``None`` (the default of ``"auto"``):
    ``"scale"`` the HPD scale, ``"scale+radial"`` per-coordinate scales (a shared scale
    followed by the radial map is a radial map again, so only per-coordinate scales give
    that candidate something of its own: they fix errors that differ across coordinates,
    the radial map then the tails)."""
    if scale_target is None:
        return {"scale": "hpd", "scale+radial": "latent"}
    return {"scale": scale_target, "scale+radial": scale_target}


def _fit_map(
    z: Tensor, method: str, band: int | None, log_hpd_scale: Tensor | None = None
) -> LatentMap:
    """The :class:`LatentMap` of ``method`` fitted on held-out latents ``z (n, D)``: its
    marginal map (``"marginal"``, :func:`~calib_lightning.functional.marginal.marginal_knots`),
    its scales, the shared ``log_hpd_scale`` when given (``scale_target="hpd"``), else
    :func:`~.scale.latent_log_scale`, then its radial map, each fitted on the latents the
    parts before it mapped."""
    dim = z.shape[1]
    marginal = None
    if "marginal" in method:
        marginal = marginal_knots(z)
        z = LatentMap(dim, marginal_knots=marginal)(z.double())[0]
    log_scale = None
    if "scale" in method:
        log_scale = latent_log_scale(z) if log_hpd_scale is None else log_hpd_scale.expand(dim)
    knots = None
    if "radial" in method:
        scaled = z.double() if log_scale is None else z.double() * torch.exp(-log_scale)
        band = default_band(z.shape[0]) if band is None else band
        knots = radial_knots(scaled.norm(dim=-1), dim, band)
    return LatentMap(dim, log_scale, knots, marginal)


def default_band(n: int) -> int:
    r"""The radial band used when none is given: :math:`\max(1, \mathrm{round}(\sqrt n / 2))`
    (slack at most :math:`1 / (2 \sqrt n)`, below the :math:`1/\sqrt n` noise of an
    empirical coverage curve from ``n`` pairs), for a smoother density than ``band=1``:
    on calibrated latents, ``band=1`` costs 0.36-0.39 nats of held-out NLL and the
    default 0.015-0.036 (D = 2, 5; n = 100, 400:
    ``examples/benchmarks/results/radial_band.md``)."""
    return max(1, round(math.sqrt(n) / 2))


def _coverage_error(u: Tensor) -> float:
    """Mean absolute gap between the sorted latent-ball levels of ``u (m, D)`` and the
    uniform quantiles: the area between the latent expected-coverage curve and the
    diagonal."""
    levels = latent_ball_levels(u.double()).sort().values
    m = levels.shape[0]
    return float((levels - (torch.arange(m, dtype=torch.float64) + 0.5) / m).abs().mean())


def coverage_gaps(levels: Tensor) -> Tensor:
    r"""The held-out expected-coverage curve minus the diagonal at
    :data:`CALIBRATION_LEVELS`: :math:`\hat C(a) - a` with :math:`\hat C(a)` the share of
    the HPD levels ``levels (n,)`` at most :math:`a` (the curve ``RankCalibration``
    draws), shape ``(99,)``."""
    return (levels[:, None] <= CALIBRATION_LEVELS).double().mean(0) - CALIBRATION_LEVELS


def marginal_coverage_gaps(
    levels: Tensor, folds: Tensor | None = None, weight: Tensor | None = None
) -> Tensor:
    r"""Per-coordinate expected-coverage curves minus the diagonal: for each latent
    coordinate :math:`j`, :math:`\hat C_j(a) - a` at :data:`CALIBRATION_LEVELS`, with
    :math:`\hat C_j(a)` the share of the held-out levels :math:`\Phi(u_{ij})` at most
    :math:`a` (uniform when the recalibrated latent coordinates are standard normal; for
    a flow that acts coordinate by coordinate, a Gaussian, these are the marginal ranks
    ``RankCalibration`` tests).

    Each fold's curve apart (``folds (n,)``, the fold of each pair; ``None``: one): two
    folds of quantile maps fitted on each other are antithetic, their pooled curve hugs
    the diagonal far closer than either (the two empirical CDFs' errors cancel), so
    pooling them would favour the marginal map by construction.

    Arguments:
        levels: ``(n, D)``.
        folds: ``(n,)`` integer fold labels, or ``None``.
        weight: ``(B, n)`` resampling weights (bootstrap), or ``None``.

    Returns:
        ``(F, D, 99)`` (``(B, F, D, 99)`` with ``weight``), ``F`` the number of folds.
    """
    folds = torch.zeros(levels.shape[0], dtype=torch.long) if folds is None else folds
    below = (levels[:, :, None] <= CALIBRATION_LEVELS).double()  # (n, D, 99)
    masks = torch.stack([folds == f for f in folds.unique()]).double()  # (F, n)
    w = masks if weight is None else weight[:, None, :] * masks  # (F, n) or (B, F, n)
    w = w / w.sum(-1, keepdim=True)
    return torch.einsum("...n,ndl->...dl", w, below) - CALIBRATION_LEVELS


def _map_log_density(latent_map: LatentMap) -> Callable[[Tensor], Tensor]:
    """``z -> log N(g(z)) + log|det g'(z)|``: the latent density of the recalibrated
    posterior, in the flow's latent."""

    def log_density(z: Tensor) -> Tensor:
        u, log_det = latent_map(z)
        return standard_normal_log_prob(u) + log_det

    return log_density


def _cross_fit(
    z: Tensor,
    log_prob: Tensor,
    candidates: tuple[str, ...],
    band: int | None,
    seed: int,
    draws: LatentDraws | None,
    scale_target: str | None,
) -> tuple[
    dict[str, dict[str, float]], dict[str, Tensor], dict[str, Tensor], dict[str, Tensor], Tensor
]:
    r""":func:`cross_fit_scores`, each candidate's held-out HPD levels ``(n,)`` (pair
    order; empty without ``draws``), its held-out ``log q' - log q`` ``(n,)`` (fold
    order, the same for every candidate) and its held-out per-coordinate latent levels
    :math:`\Phi(u)` ``(n, D)`` (pair order), and which fold scored each pair ``(n,)``."""
    n = z.shape[0]
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    halves = (order[: n // 2], order[n // 2 :])
    folds = torch.zeros(n, dtype=torch.long)
    folds[halves[0]] = 1  # the fold that scored each pair
    z, log_prob = z.detach().double().cpu(), log_prob.detach().double().cpu()
    draws = None if draws is None else on_cpu(draws)  # the maps are fitted on the CPU
    kinds = scale_kinds(scale_target) if draws is not None else scale_kinds("latent")
    hpd_scales = [None, None]  # the shared HPD scale of each fold, fitted once
    if any(kinds.get(c) == "hpd" for c in candidates):
        hpd_scales = [shared_hpd_log_scale(draws, rows=rows) for rows, _ in (halves, halves[::-1])]
    scores: dict[str, dict[str, float]] = {}
    changes: dict[str, Tensor] = {}
    levels: dict[str, Tensor] = {}
    coordinate_levels: dict[str, Tensor] = {}
    for name in candidates:
        errors, nlls, parts = [], [], []
        level = torch.empty(n, dtype=torch.float64)
        coordinate_level = torch.empty_like(z)
        hpd = kinds.get(name) == "hpd"
        for fold, (fit_rows, test_rows) in enumerate((halves, halves[::-1])):
            latent_map = _fit_map(z[fit_rows], name, band, hpd_scales[fold] if hpd else None)
            z_test = z[test_rows]
            u, log_det = latent_map(z_test)
            coordinate_level[test_rows] = torch.special.ndtr(u)
            change = standard_normal_log_prob(u) - standard_normal_log_prob(z_test) + log_det
            if draws is not None:  # restricted to the prior's support: log q' - log Z'
                level[test_rows], log_share = levels_and_log_share(
                    draws, _map_log_density(latent_map), test_rows
                )
                change = change - log_share.to(change)
            errors.append(_coverage_error(u))
            nlls.append(float(-(log_prob[test_rows] + change).mean()))
            parts.append(change)
        scores[name] = {"latent_coverage_error": sum(errors) / 2, "nll": sum(nlls) / 2}
        changes[name] = torch.cat(parts)
        coordinate_levels[name] = coordinate_level
        coordinate_gaps = marginal_coverage_gaps(coordinate_level, folds)
        scores[name].update(
            marginal_calibration_error=float(coordinate_gaps.abs().mean()),
            max_marginal_gap=float(coordinate_gaps.abs().max()),
        )
        if draws is not None:
            levels[name] = level
            gaps = coverage_gaps(level)
            scores[name].update(
                hpd_coverage_error=float(0.5 - level.mean()),
                calibration_error=float(gaps.abs().mean()),
                max_gap=float(gaps.abs().max()),
            )
    for name in candidates:  # paired standard error of the NLL difference to the first
        diff = changes[candidates[0]] - changes[name]
        scores[name]["nll_difference_se"] = float(diff.std() / math.sqrt(diff.numel()))
    return scores, levels, changes, coordinate_levels, folds


def cross_fit_scores(
    z: Tensor,
    log_prob: Tensor,
    candidates: tuple[str, ...] = AUTO_CANDIDATES,
    *,
    band: int | None = None,
    seed: int = 0,
    draws: LatentDraws | None = None,
    scale_target: str | None = "latent",
) -> dict[str, dict[str, float]]:
    r"""Held-out scores of latent ``candidates`` from latents ``z (n, D)`` and
    log-densities ``log_prob (n,)`` of the posterior at the same held-out pairs.

    Two-fold cross-fitting (a seeded random split): each candidate is fitted on one half
    and scored on the other, both ways, so every pair is scored once by a map that did not
    see it:

    * with ``draws`` (:func:`~._hpd.latent_draws` at the same pairs), from the held-out HPD
      levels :math:`c_i` of the recalibrated posterior (every candidate scored on the same
      draws, :mod:`._hpd`): ``calibration_error``, the mean over the levels
      :math:`a` = 0.01, ..., 0.99 of :math:`|\hat C(a) - a|` with :math:`\hat C(a)` the
      share of :math:`c_i \le a` (the expected-coverage curve ``RankCalibration`` draws,
      held out), and ``max_gap``, its largest :math:`|\hat C(a) - a|`;
      ``hpd_coverage_error``, the signed area :math:`1/2 - \bar c` (negative =
      over-confident; the ``coverage_error`` of ``RankCalibration``);
    * ``marginal_calibration_error``: the mean over the latent coordinates and the same
      levels of :math:`|\hat C_j(a) - a|`, the curves of the held-out :math:`\Phi(u_{ij})`
      of each fold (:func:`marginal_coverage_gaps`; sampling-free), averaged, and
      ``max_marginal_gap``, their
      largest gap;
    * ``latent_coverage_error``: the latent coverage error of the recalibrated latents (mean
      absolute gap of their ball levels to uniform), averaged over the two folds;
    * ``nll``: the held-out negative log-density, and ``nll_difference_se``, the standard
      error of its per-pair difference to the first candidate's (the maps act on the
      latent, so :math:`\log q' = \log q - \log N(z) + \log N(u) + \log|\det|` needs
      no new pass of the flow). With ``draws.inside`` (a prior), that of the posterior
      restricted to the prior's support, the one ``recalibrate`` returns: minus
      :math:`\log \hat Z'(x)`, the candidate's mass inside estimated from the same draws
      (:func:`~._hpd.levels_and_log_share`). Unrestricted, a scale that widens a flow over a
      box loses the mass it moves outside and looks worse than it is.

    ``scale_target`` (with ``draws``): how the candidates' scales are fitted
    (:func:`scale_kinds`; the HPD scale as :func:`~.scale.hpd_log_scale` does, on each
    fold's draws).
    """
    return _cross_fit(z, log_prob, candidates, band, seed, draws, scale_target)[0]
