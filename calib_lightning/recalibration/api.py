r"""One call to fix a miscalibrated posterior: :func:`recalibrate`.

``cl.recalibrate(posterior, theta_val, x_val, method=...)`` fits a map of the flow's latent
space on held-out pairs and returns a
:class:`~calib_lightning.recalibration.radial.RecalibratedPosterior`, which every metric,
callback and ``cl.diagnose`` accept. Methods (:data:`METHODS`):

* ``"scale"``: per-coordinate latent scales (:func:`~.scale.latent_log_scale`, or the
  HPD-targeted shared scale with ``scale_target="hpd"``);
* ``"radial"``: the radial map of the latent norm (:mod:`calib_lightning.functional.radial`),
  with its finite-sample guarantee on latent balls;
* ``"scale+radial"``: scales, then the radius of the scaled latents;
* ``"none"``: the identity (what ``"auto"`` returns when nothing helps);
* ``"auto"``: cross-fitted choice among the above by held-out HPD coverage error, with
  held-out NLL as a guard (:func:`select_method`).

Another module adds a method with :func:`register_method`.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from calib_lightning._checks import check_pairs, check_positive
from calib_lightning._prior import check_prior
from calib_lightning.functional.radial import latent_ball_levels, radial_knots
from calib_lightning.posteriors import Posterior, UnsupportedError, as_posterior
from calib_lightning.recalibration._hpd import (
    LatentDraws,
    latent_draws,
    levels_and_log_share,
    on_cpu,
)
from calib_lightning.recalibration.radial import (
    LatentMap,
    RecalibratedPosterior,
    standard_normal_log_prob,
)
from calib_lightning.recalibration.scale import (
    hpd_log_scale,
    latent_log_scale,
    shared_hpd_log_scale,
)
from calib_lightning.recalibration.selection import Candidate, Selection
from calib_lightning.recalibration.truncation import TruncatedPosterior

__all__ = [
    "METHODS",
    "MIN_PAIRS",
    "choose",
    "coverage_gaps",
    "cross_fit_scores",
    "default_band",
    "recalibrate",
    "register_method",
    "scale_kinds",
    "select_method",
]

log = logging.getLogger(__name__)

#: fewest held-out pairs a method is fitted on (``"auto"`` needs twice as many)
MIN_PAIRS = 20
#: the candidates of ``method="auto"``, in order of preference on ties
AUTO_CANDIDATES = ("none", "scale", "radial", "scale+radial")
#: posterior draws per pair and proposal scale (3 scales) that ``"auto"`` scores HPD
#: coverage with (:func:`~._hpd.latent_draws`); ``None``: :func:`~._hpd.draws_per_pair`
AUTO_NUM_POSTERIOR_SAMPLES: int | None = None
#: the levels the held-out expected-coverage curve is compared with the diagonal at
CALIBRATION_LEVELS = torch.arange(1, 100, dtype=torch.float64) / 100
#: paired bootstrap resamples of the pairs for the standard error of a difference in
#: calibration error between two candidates
BOOTSTRAP_RESAMPLES = 200


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
    """The :class:`LatentMap` of ``method`` fitted on held-out latents ``z (n, D)``; its
    scales the shared ``log_hpd_scale`` when given (``scale_target="hpd"``), else
    :func:`~.scale.latent_log_scale`."""
    dim = z.shape[1]
    log_scale = None
    if "scale" in method:
        log_scale = latent_log_scale(z) if log_hpd_scale is None else log_hpd_scale.expand(dim)
    knots = None
    if "radial" in method:
        scaled = z.double() if log_scale is None else z.double() * torch.exp(-log_scale)
        band = default_band(z.shape[0]) if band is None else band
        knots = radial_knots(scaled.norm(dim=-1), dim, band)
    return LatentMap(dim, log_scale, knots)


def _latent_method(method: str) -> Callable[..., RecalibratedPosterior]:
    def fit(posterior: Posterior, theta: Tensor, x: Tensor, z: Tensor, **options: Any) -> Any:
        hpd = None
        target = options.get("scale_target", "latent") if "scale" in method else ""
        if target == "hpd":
            hpd = hpd_log_scale(posterior, theta, x, prior=options.get("prior"))
        return RecalibratedPosterior(posterior, _fit_map(z, method, options.get("band"), hpd),
                                     method, scale_target=target)  # fmt: skip

    return fit


#: method name -> ``fit(posterior, theta, x, z, **options) -> Posterior``, where ``z`` are
#: the held-out latents (``None`` for a method registered with ``needs_latent=False``)
METHODS: dict[str, Callable[..., Posterior]] = {
    name: _latent_method(name) for name in AUTO_CANDIDATES
}
_NEEDS_LATENT = set(AUTO_CANDIDATES)


def register_method(name: str, fit: Callable[..., Posterior], needs_latent: bool = False) -> None:
    """Make ``cl.recalibrate(..., method=name)`` call ``fit(posterior, theta, x, z,
    **options)``; ``z`` is ``None`` unless ``needs_latent`` (then the posterior must have
    an inverse and ``z`` are the checked held-out latents)."""
    METHODS[name] = fit
    if needs_latent:
        _NEEDS_LATENT.add(name)


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


def default_band(n: int) -> int:
    r"""The radial band used when none is given: :math:`\max(1, \mathrm{round}(\sqrt n / 2))`
    (slack at most :math:`1 / (2 \sqrt n)`, below the :math:`1/\sqrt n` noise of an
    empirical coverage curve from ``n`` pairs), for a smoother density than ``band=1``:
    on calibrated latents, ``band=1`` costs 0.36-0.39 nats of held-out NLL and the
    default 0.015-0.036 (D = 2, 5; n = 100, 400:
    ``examples/benchmarks/results/radial_band.md``)."""
    return max(1, round(math.sqrt(n) / 2))


def _map_log_density(latent_map: LatentMap) -> Callable[[Tensor], Tensor]:
    """``z -> log N(g(z)) + log|det g'(z)|``: the latent density of the recalibrated
    posterior, in the flow's latent."""

    def log_density(z: Tensor) -> Tensor:
        u, log_det = latent_map(z)
        return standard_normal_log_prob(u) + log_det

    return log_density


def _cross_fit(
    z: Tensor, log_prob: Tensor, candidates: tuple[str, ...], band: int | None, seed: int,
    draws: LatentDraws | None, scale_target: str | None,
) -> tuple[dict[str, dict[str, float]], dict[str, Tensor], dict[str, Tensor]]:  # fmt: skip
    """:func:`cross_fit_scores`, each candidate's held-out HPD levels ``(n,)`` (pair
    order; empty without ``draws``) and its held-out ``log q' - log q`` ``(n,)`` (fold
    order, the same for every candidate)."""
    n = z.shape[0]
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    halves = (order[: n // 2], order[n // 2 :])
    z, log_prob = z.detach().double().cpu(), log_prob.detach().double().cpu()
    draws = None if draws is None else on_cpu(draws)  # the maps are fitted on the CPU
    kinds = scale_kinds(scale_target) if draws is not None else scale_kinds("latent")
    hpd_scales = [None, None]  # the shared HPD scale of each fold, fitted once
    if any(kinds.get(c) == "hpd" for c in candidates):
        hpd_scales = [shared_hpd_log_scale(draws, rows=rows) for rows, _ in (halves, halves[::-1])]
    scores: dict[str, dict[str, float]] = {}
    changes: dict[str, Tensor] = {}
    levels: dict[str, Tensor] = {}
    for name in candidates:
        errors, nlls, parts = [], [], []
        level = torch.empty(n, dtype=torch.float64)
        hpd = kinds.get(name) == "hpd"
        for fold, (fit_rows, test_rows) in enumerate((halves, halves[::-1])):
            latent_map = _fit_map(z[fit_rows], name, band, hpd_scales[fold] if hpd else None)
            z_test = z[test_rows]
            u, log_det = latent_map(z_test)
            change = standard_normal_log_prob(u) - standard_normal_log_prob(z_test) + log_det
            if draws is not None:  # restricted to the prior's support: log q' - log Z'
                level[test_rows], log_share = levels_and_log_share(
                    draws, _map_log_density(latent_map), test_rows)  # fmt: skip
                change = change - log_share.to(change)
            errors.append(_coverage_error(u))
            nlls.append(float(-(log_prob[test_rows] + change).mean()))
            parts.append(change)
        scores[name] = {"latent_coverage_error": sum(errors) / 2, "nll": sum(nlls) / 2}
        changes[name] = torch.cat(parts)
        if draws is not None:
            levels[name] = level
            gaps = coverage_gaps(level)
            scores[name].update(hpd_coverage_error=float(0.5 - level.mean()),
                                calibration_error=float(gaps.abs().mean()),
                                max_gap=float(gaps.abs().max()))  # fmt: skip
    for name in candidates:  # paired standard error of the NLL difference to the first
        diff = changes[candidates[0]] - changes[name]
        scores[name]["nll_difference_se"] = float(diff.std() / math.sqrt(diff.numel()))
    return scores, levels, changes


def cross_fit_scores(
    z: Tensor, log_prob: Tensor, candidates: tuple[str, ...] = AUTO_CANDIDATES, *,
    band: int | None = None, seed: int = 0, draws: LatentDraws | None = None,
    scale_target: str | None = "latent",
) -> dict[str, dict[str, float]]:  # fmt: skip
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


def _bootstrap_se(levels: dict[str, Tensor], best: str, seed: int) -> dict[str, float]:
    """Paired bootstrap standard error of each candidate's calibration error minus the
    best's: :data:`BOOTSTRAP_RESAMPLES` resamples of the pairs, shared by all."""
    n = levels[best].numel()
    generator = torch.Generator().manual_seed(seed + 1)
    rows = torch.randint(n, (BOOTSTRAP_RESAMPLES, n), generator=generator)
    weight = torch.zeros(BOOTSTRAP_RESAMPLES, n, dtype=torch.float64)
    weight.scatter_add_(1, rows, torch.ones_like(rows, dtype=torch.float64))
    weight /= n

    def errors(level: Tensor) -> Tensor:
        curve = weight @ (level[:, None] <= CALIBRATION_LEVELS).double()
        return (curve - CALIBRATION_LEVELS).abs().mean(1)

    reference = errors(levels[best])
    return {name: float((errors(level) - reference).std()) for name, level in levels.items()}


def select_method(
    z: Tensor, log_prob: Tensor, draws: LatentDraws, *, band: int | None = None,
    seed: int = 0, nll_tolerance: float = 0.01, num_standard_errors: float = 2.0,
    scale_target: str | None = None,
) -> tuple[str, Selection, dict[str, LatentMap]]:  # fmt: skip
    r"""The method ``"auto"`` picks, the :class:`~.selection.Selection` table of every
    candidate's :func:`cross_fit_scores`, and each candidate's map fitted on all pairs.

    By the cross-fitted held-out calibration error :math:`e` (``calibration_error``: the
    mean :math:`|\mathrm{coverage} - \mathrm{level}|` of the HPD regions, from ``draws``
    at the same pairs), with :math:`k` = ``num_standard_errors``:

    1. the NLL guard: candidates whose held-out ``nll`` exceeds the identity's by more than
       ``nll_tolerance * max(1, |nll|)`` plus :math:`k` paired standard errors
       (``nll_difference_se``: a map fitted on half of the pairs is noisier than the
       final one) are out (``kept_by_nll``); it only vetoes a clearly worse density;
    2. of the others the one with the smallest :math:`e` is the best; as calibrated are
       those within :math:`k` standard errors of it in :math:`e`
       (``calibration_difference_se``: the paired bootstrap standard error of the
       difference, :data:`BOOTSTRAP_RESAMPLES` resamples of the pairs) and not off in the
       absolute signed area ``hpd_coverage_error`` (off: beyond :math:`k` of its own
       standard errors from 0, ``hpd_se``, and beyond the best's by :math:`k` paired ones,
       ``hpd_difference_se``; the more powerful measure against a shift of every level, a
       variance error, where :math:`e` is noisier);
    3. of those, the first in :data:`AUTO_CANDIDATES` order (simplest first, ``"none"``
       included) whose held-out NLL is within :math:`k` paired standard errors of their
       lowest (``nll_to_sharpest_se``) is picked: the identity stays unless a map is
       measurably better calibrated, and a map replaces a simpler one only when it is
       measurably better calibrated or, as calibrated, measurably sharper;
    4. a candidate whose map, fitted on all pairs, is the same as a simpler candidate's
       (:meth:`~.radial.LatentMap.same_as`: ``"scale"`` fitted to the identity is
       ``"none"``) gives way to it, and the table says so.
    """
    scores, levels, changes = _cross_fit(z, log_prob, AUTO_CANDIDATES, band, seed, draws,
                                         scale_target)  # fmt: skip
    kinds = scale_kinds(scale_target)
    full_hpd = shared_hpd_log_scale(on_cpu(draws))
    z_all = z.detach().double().cpu()
    maps = {name: _fit_map(z_all, name, band, full_hpd if kinds.get(name) == "hpd" else None)
            for name in AUTO_CANDIDATES}  # fmt: skip
    same = {name: next((other for other in AUTO_CANDIDATES[: AUTO_CANDIDATES.index(name)]
                        if maps[name].same_as(maps[other])), None)
            for name in AUTO_CANDIDATES}  # fmt: skip
    chosen, selection = choose(scores, levels, changes, same, seed=seed,
                               nll_tolerance=nll_tolerance,
                               num_standard_errors=num_standard_errors)  # fmt: skip
    return chosen, selection, maps


def choose(
    scores: dict[str, dict[str, float]], levels: dict[str, Tensor], changes: dict[str, Tensor],
    same: dict[str, str | None], *, seed: int = 0, nll_tolerance: float = 0.01,
    num_standard_errors: float = 2.0,
) -> tuple[str, Selection]:  # fmt: skip
    """The rule of :func:`select_method` on the cross-fitted ``scores`` (each candidate's
    ``calibration_error``, ``max_gap``, ``nll`` and ``nll_difference_se``), held-out HPD
    levels ``(n,)``, per-pair log-density changes ``(n,)`` and ``same`` (candidate -> the
    simpler candidate with the same map, or ``None``), in :data:`AUTO_CANDIDATES` order:
    the method chosen and the :class:`~.selection.Selection` table."""
    names = list(scores)
    reference = scores[names[0]]["nll"]
    margin = nll_tolerance * max(1.0, abs(reference))
    k = num_standard_errors
    limit = {name: reference + margin + k * scores[name]["nll_difference_se"] for name in names}
    kept = [name for name in names if scores[name]["nll"] <= limit[name]]
    error = {name: scores[name]["calibration_error"] for name in names}
    best = min(kept, key=error.__getitem__)
    se = _bootstrap_se(levels, best, seed)
    root_n = math.sqrt(levels[best].numel())
    signed = {name: abs(scores[name]["hpd_coverage_error"]) for name in names}
    signed_se = {name: float((levels[name] - levels[best]).std() / root_n) for name in names}
    own_se = {name: float(levels[name].std() / root_n) for name in names}
    # as calibrated as the best: within k SE of it by the curve's distance, and by the
    # signed area (the more powerful against a shift of every level, a variance error)
    # unless that area is itself within k SE of 0
    off = {name: signed[name] > k * own_se[name]
           and signed[name] - signed[best] > k * signed_se[name] for name in names}  # fmt: skip
    level = [name for name in kept if error[name] - error[best] <= k * se[name]
             and not off[name]]  # fmt: skip
    nll = {name: scores[name]["nll"] for name in names}
    sharpest = min(level, key=nll.__getitem__)
    nll_se = {name: float((changes[sharpest] - changes[name]).std() / root_n) for name in names}
    within = [name for name in level if nll[name] - nll[sharpest] <= k * nll_se[name]]
    chosen = same[within[0]] or within[0]
    for name in names:
        scores[name]["hpd_se"] = own_se[name]
        scores[name]["hpd_difference_se"] = signed_se[name]
        scores[name]["calibration_difference_se"] = se[name]
        scores[name]["nll_to_sharpest_se"] = nll_se[name]
        scores[name]["kept_by_nll"] = float(name in kept)
        scores[name]["chosen"] = float(name == chosen)

    def why(name: str) -> str:
        gap = error[name] - error[best]
        if same[name] is not None:
            return f"same map as {same[name]!r} (fitted on all pairs)"
        if name not in kept:
            return (f"NLL {nll[name] - reference:+.4f} over {names[0]!r}'s, beyond the guard "
                    f"({limit[name] - reference:.4f}): out")  # fmt: skip
        if name == chosen and name != within[0]:
            return f"{within[0]!r} won, and fitted on all pairs its map is this one"
        if gap > k * se[name]:
            return f"{gap:+.4f} from the best {best!r}, beyond {k:g} SE ({k * se[name]:.4f})"
        if name not in level:
            return (f"signed coverage area {signed[name] - signed[best]:+.4f} beyond the best "
                    f"{best!r}'s, more than {k:g} SE ({k * signed_se[name]:.4f})")  # fmt: skip
        loss = nll[name] - nll[sharpest]
        if name == chosen:
            calibrated = ("lowest held-out calibration error" if name == best else
                          f"within {k:g} SE of the best {best!r} ({gap:+.4f})")  # fmt: skip
            if len(level) == 1:
                return calibrated
            if name == sharpest:
                return f"{calibrated}; the lowest NLL of those"
            return f"{calibrated}; NLL within {k:g} SE of the lowest ({loss:+.4f}), simplest"
        if loss > k * nll_se[name]:
            return (f"as calibrated (within {k:g} SE), but NLL {loss:+.4f} over "
                    f"{sharpest!r}'s, beyond {k:g} SE ({k * nll_se[name]:.4f})")  # fmt: skip
        return f"as calibrated and as sharp (within {k:g} SE), but {chosen!r} is simpler"

    rows = [Candidate(name, error[name], scores[name]["max_gap"], nll[name], name == chosen,
                      why(name)) for name in names]  # fmt: skip
    note = (f"2-fold cross-fit on {levels[best].numel()} held-out pairs; calibration error = "
            f"mean |coverage - level| of the HPD regions; NLL guard +{nll_tolerance:g} x "
            f"max(1, |NLL|) + {k:g} SE")  # fmt: skip
    return chosen, Selection(rows, scores, note)


def recalibrate(
    posterior: Any,
    theta_val: Tensor,
    x_val: Tensor,
    method: str = "auto",
    *,
    band: int | None = None,
    scale_target: str | None = None,
    seed: int = 0,
    prior: Any = None,
    **options: Any,
) -> Posterior:
    r"""Recalibrate ``posterior`` on held-out pairs; returns a posterior for every check.

    Arguments:
        posterior: a zuko flow, an nflows ``Flow``, an sbi flow estimator, a callable
            ``x -> Distribution`` (``TransformedDistribution``, Gaussian), or a
            :class:`~calib_lightning.posteriors.Posterior`, with an inverse
            (``to_latent``) and a forward map (``from_latent``) for the latent methods.
        theta_val: held-out parameters ``(n, D)``, never used for training nor to pick
            the epoch or checkpoint (pairs apart from the ones early stopping monitors:
            the model kept fits those better than new pairs); ``n >= MIN_PAIRS``
            (``2 * MIN_PAIRS`` for ``"auto"``).
        x_val: their observations ``(n, *X)``.
        method: ``"auto"``, ``"scale"``, ``"radial"``, ``"scale+radial"``, ``"none"``, or
            a name added with :func:`register_method`.
        band: the radial map's band :math:`w`: latent balls of every level :math:`a`
            cover new exchangeable pairs with probability within :math:`w/(n+1)` of
            :math:`a` (:mod:`calib_lightning.functional.radial`; with ``"scale+radial"``
            the scales are fitted on the same pairs, so the bound is not exact there).
            ``1``: the order-statistic form; ``None``: :func:`default_band`.
        scale_target: ``"latent"`` (per-coordinate, sampling-free) or ``"hpd"`` (one
            shared scale targeting HPD coverage, :func:`~.scale.hpd_log_scale`);
            ``None``: ``"latent"`` for a named method; for ``"auto"``, its ``"scale"``
            candidate the HPD scale (fitted on the draws it scores with) and its
            ``"scale+radial"`` per-coordinate scales (:func:`scale_kinds`).
        seed: the cross-fitting split and the posterior draws of ``"auto"``, which scores
            each candidate by its cross-fitted held-out calibration error
            (:func:`select_method`; :func:`~._hpd.draws_per_pair` draws per pair at 3
            latent scales, one flow pass each, shared by every candidate).
        prior: the prior ``theta`` were drawn from (a torch ``Distribution``, e.g. sbi's
            ``BoxUniform``, or anything with ``log_prob``); when given, the result is
            restricted to its support and renormalized after the method's map
            (:class:`~.truncation.TruncatedPosterior`): this removes the mass outside the
            support that ``cl.diagnose(..., prior=prior)`` reports and, as the true
            posterior has none there, never raises the expected NLL. The HPD-targeted
            scale (``scale_target="hpd"``) and the HPD scores of ``"auto"`` then measure
            the restricted posterior (draws outside count for nothing), the one returned.
            The result has no latent space (the latent checks do not apply to it).
        options: passed to a registered method.

    Returns:
        The recalibrated posterior, an ``nn.Module`` (:class:`~.radial.RecalibratedPosterior`,
        or :class:`~.truncation.TruncatedPosterior` around it with ``prior``): called on
        ``x`` like the flow (``fixed(x)`` a distribution), saved and loaded with
        ``state_dict``; ``.method`` says what was fitted (``"+support"`` appended with
        ``prior``), ``.is_identity`` whether the fit changed nothing (also in its
        ``repr``), and for ``"auto"`` ``.selection`` is the table of every candidate's
        held-out scores, the one chosen and why (:class:`~.selection.Selection`; also
        logged at INFO).

    Raises:
        ValueError: too few pairs, non-finite latents, a posterior without the inverse
            the method needs, an unknown method, or held-out ``theta`` outside ``prior``'s
            support.

    Example:
        >>> from calib_lightning.tasks import GaussianToy
        >>> toy = GaussianToy(dim=2)
        >>> theta, x = toy.sample(400, torch.Generator().manual_seed(0))
        >>> fixed = recalibrate(toy.posterior(variance_scale=0.25), theta, x)  # too narrow
        >>> fixed.method, fixed.is_identity, round(fixed.selection["none"]["hpd_coverage_error"], 2)
        ('scale', False, -0.3)
        >>> fixed.selection["scale"]["calibration_error"] < 0.02  # held out, cross-fitted
        True
        >>> print(fixed.selection.rows[1].why)  # the radial map: as calibrated, less sharp
        within 2 SE of the best 'radial' (+0.0042); the lowest NLL of those
    """
    if method != "auto" and method not in METHODS:
        raise ValueError(f"method must be 'auto' or one of {sorted(METHODS)}, got {method!r}")
    check_pairs(theta_val, x_val, min_rows=2)
    if band is not None:
        check_positive("band", band, integer=True)
    if scale_target is None and method != "auto":
        scale_target = "latent"
    if scale_target not in ("latent", "hpd", None):
        raise ValueError(f"scale_target must be 'latent', 'hpd' or None, got {scale_target!r}")
    need = 2 * MIN_PAIRS if method == "auto" else MIN_PAIRS
    if theta_val.shape[0] < need:
        raise ValueError(
            f"theta_val must have at least {need} held-out pairs for method={method!r}, "
            f"got {theta_val.shape[0]}"
        )
    if prior is not None:
        check_prior(prior, theta_val)

    def restrict(fixed: Posterior) -> Posterior:
        return fixed if prior is None else TruncatedPosterior(fixed, prior)

    post = as_posterior(posterior)
    if method != "auto" and method not in _NEEDS_LATENT:
        return restrict(METHODS[method](post, theta_val, x_val, None, **options))
    with torch.no_grad():
        z = _checked_latents(post, theta_val, x_val, method)
        if method != "auto":
            if method in AUTO_CANDIDATES:  # the HPD scale then targets the restricted one
                options = {"prior": prior, **options}
            return restrict(METHODS[method](post, theta_val, x_val, z, band=band,
                                            scale_target=scale_target, **options))  # fmt: skip
        log_prob = post.log_prob(theta_val, x_val)
        draws = latent_draws(post, theta_val, x_val, AUTO_NUM_POSTERIOR_SAMPLES, seed=seed,
                             truth=(z, log_prob), prior=prior)  # fmt: skip
        chosen, selection, maps = select_method(z, log_prob, draws, band=band, seed=seed,
                                                scale_target=scale_target)  # fmt: skip
    target = scale_kinds(scale_target).get(chosen, "")
    fixed = RecalibratedPosterior(post, maps[chosen], chosen, selection, scale_target=target)
    log.info("recalibrate(method='auto') picked %r\n%r", chosen, selection)
    return restrict(fixed)


def _checked_latents(post: Posterior, theta: Tensor, x: Tensor, method: str) -> Tensor:
    """Held-out latents ``(n, D)``, after checking the posterior can map both ways."""
    try:
        z = post.to_latent(theta, x)
        post.from_latent(z[:2], x[:2])
    except (UnsupportedError, NotImplementedError) as error:
        raise ValueError(
            f"posterior must map theta to its latent and back (to_latent, from_latent) for "
            f"method={method!r}, got {post!r}: {error}"
        ) from None
    if not bool(torch.isfinite(z).all()):
        bad = int((~torch.isfinite(z)).any(-1).sum())
        raise ValueError(
            f"theta_val must have finite latents under the posterior, got {bad} pairs of "
            f"{z.shape[0]} with a non-finite latent (theta outside the flow's support?)"
        )
    return z
