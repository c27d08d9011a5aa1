r"""One call to fix a miscalibrated posterior: :func:`recalibrate`.

``cl.recalibrate(posterior, theta_val, x_val, method=...)`` fits a map of the flow's latent
space on held-out pairs and returns a
:class:`~calib_lightning.recalibration.recalibrated.RecalibratedPosterior`, which every metric,
callback and ``cl.diagnose`` accept. Methods (:data:`METHODS`):

* ``"scale"``: per-coordinate latent scales (:func:`~.scale.latent_log_scale`, or the
  HPD-targeted shared scale with ``scale_target="hpd"``);
* ``"radial"``: the radial map of the latent norm (:mod:`calib_lightning.functional.radial`),
  with its finite-sample guarantee on latent balls;
* ``"scale+radial"``: scales, then the radius of the scaled latents;
* ``"marginal"``: a monotone map per latent coordinate, :math:`\Phi^{-1}` of its
  kernel-smoothed CDF (:mod:`calib_lightning.functional.marginal`), for a shape error
  per coordinate; ``"marginal+radial"``: then the radius of the mapped latents;
* ``"none"``: the identity (what ``"auto"`` returns when nothing helps);
* ``"auto"``: cross-fitted choice among the above by held-out HPD and per-coordinate
  coverage error, with held-out NLL as a guard (:func:`~.selection.select_method`, on the scores of
  :func:`~.cross_fit.cross_fit_scores`).

Another module adds a method with :func:`register_method`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from calib_lightning._utils.prior import check_prior
from calib_lightning._utils.validation import check_pairs, check_positive
from calib_lightning.posteriors import Posterior, UnsupportedError, as_posterior
from calib_lightning.recalibration._hpd import latent_draws
from calib_lightning.recalibration.cross_fit import (
    AUTO_CANDIDATES,
    _fit_map,
    coverage_gaps,
    cross_fit_scores,
    default_band,
    scale_kinds,
)
from calib_lightning.recalibration.recalibrated import RecalibratedPosterior
from calib_lightning.recalibration.scale import hpd_log_scale
from calib_lightning.recalibration.selection import choose, select_method
from calib_lightning.recalibration.truncation import TruncatedPosterior

__all__ = [
    "METHODS",
    "MIN_PAIRS",
    "choose",  # re-exported from .selection
    "coverage_gaps",  # re-exported from .cross_fit
    "cross_fit_scores",  # re-exported from .cross_fit
    "default_band",  # re-exported from .cross_fit
    "recalibrate",
    "register_method",
    "scale_kinds",  # re-exported from .cross_fit
    "select_method",  # re-exported from .selection
]

log = logging.getLogger(__name__)

#: fewest held-out pairs a method is fitted on (``"auto"`` needs twice as many)
MIN_PAIRS = 20
#: posterior draws per pair and proposal scale (3 scales) that ``"auto"`` scores HPD
#: coverage with (:func:`~._hpd.latent_draws`); ``None``: :func:`~._hpd.draws_per_pair`
AUTO_NUM_POSTERIOR_SAMPLES: int | None = None


def _latent_method(method: str) -> Callable[..., RecalibratedPosterior]:
    def fit(posterior: Posterior, theta: Tensor, x: Tensor, z: Tensor, **options: Any) -> Any:
        hpd = None
        target = options.get("scale_target", "latent") if "scale" in method else ""
        if target == "hpd":
            hpd = hpd_log_scale(posterior, theta, x, prior=options.get("prior"))
        return RecalibratedPosterior(
            posterior, _fit_map(z, method, options.get("band"), hpd), method, scale_target=target
        )

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
        method: ``"auto"``, ``"scale"``, ``"radial"``, ``"scale+radial"``, ``"marginal"``,
            ``"marginal+radial"``, ``"none"``, or a name added with :func:`register_method`.
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
        The recalibrated posterior, an ``nn.Module`` (:class:`~.recalibrated.RecalibratedPosterior`,
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
        within 2 SE of the best 'radial' (+0.0018); the lowest NLL of those
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
            return restrict(
                METHODS[method](
                    post, theta_val, x_val, z, band=band, scale_target=scale_target, **options
                )
            )
        log_prob = post.log_prob(theta_val, x_val)
        draws = latent_draws(
            post,
            theta_val,
            x_val,
            AUTO_NUM_POSTERIOR_SAMPLES,
            seed=seed,
            truth=(z, log_prob),
            prior=prior,
        )
        chosen, selection, maps = select_method(
            z, log_prob, draws, band=band, seed=seed, scale_target=scale_target
        )
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
