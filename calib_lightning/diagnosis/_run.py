r"""``cl.diagnose``: every check of the package on a trained posterior, in one call.

The sampling-based checks (rank calibration, TARP, the joint classifier test, recovery)
share one set of posterior draws, made once through the evaluation layer; KCCSD needs
scores only and L-C2ST-NF latents; the misspecification test compares the observations
with the calibration ``x`` (simulator outputs). A check the posterior cannot support
(KCCSD without a score, L-C2ST-NF without latents: a samples-only posterior; KCCSD when
the log-density has no gradient in theta, L-C2ST-NF when the base is not normal) is
skipped and listed in the report with the reason. At the observations of a posterior
without latents, L-C2ST (posterior draws in place of latents, its null retrained on
them) runs in L-C2ST-NF's place. Given the prior, the support check counts the shared
draws that fall outside its support. A posterior known only up to its constant (a ratio
or likelihood estimator with its prior) gets KCCSD, the importance-sampled coverage and,
for a ratio estimator, the balance test; the checks that need samples are listed as
skipped.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from calib_lightning._utils.chunks import row_blocks
from calib_lightning._utils.prior import check_prior
from calib_lightning._utils.random import cuda_devices, seeded
from calib_lightning._utils.validation import check_pairs, check_positive, check_probability
from calib_lightning.diagnosis._check import Check, Inputs, Outcome
from calib_lightning.diagnosis._regions import summarize_region
from calib_lightning.diagnosis._report import Diagnosis
from calib_lightning.diagnosis.checks import (
    CHECKS,
    DRAWS_STREAM,
    REGION_STREAM,
    REGISTRY,
)
from calib_lightning.evaluation import MAX_SHARED_ELEMENTS, SharedDraws, check_fits, draw_chunks
from calib_lightning.plots._grid import select_parameters
from calib_lightning.posteriors import (
    UnnormalizedPosterior,
    as_posterior,
    density_draws,
    recognize,
    supports,
)
from calib_lightning.posteriors._dispatch import resolve_with_data
from calib_lightning.posteriors.base import Posterior, UnsupportedError
from calib_lightning.posteriors.unnormalized import SampledUnnormalizedPosterior

__all__ = ["diagnose", "plan", "shared_draws"]

#: points per call when the shared draws are mapped from shared latents
_LATENT_POINTS = 2**16


def plan(
    post: Posterior, checks: Sequence[str] | None, inputs: Inputs
) -> tuple[list[Check], dict[str, str]]:
    """The checks to run on ``post`` (those named in ``checks``, or every check that
    applies), in the order of the report, and those skipped with the reason; by default
    L-C2ST runs only where L-C2ST-NF gives no result."""
    by_default = checks is None
    chosen = (
        [c for c in REGISTRY if c.applies_by_default(post, inputs)]
        if by_default
        else [
            c
            for c in REGISTRY
            if c.name in checks or (not c.selectable and c.applies_by_default(post, inputs))
        ]
    )
    run, skipped = [], {}
    for check in chosen:
        reason = check.skip_reason(post, inputs, by_default)
        if reason is not None:
            skipped[check.name] = reason
        else:
            run.append(check)
    if by_default:  # L-C2ST asks L-C2ST-NF's question from draws: only in its place
        local = [c for c in run if c.local]
        for later in local[1:]:
            later = type(later)()
            later.instead_of = local[0].name
            run = [later if c.name == later.name else c for c in run]
    return run, skipped


def _target(posterior: Any, prior: Any, theta: Tensor, x: Tensor) -> Posterior:
    """The posterior ``diagnose`` checks: a ratio or likelihood estimator with the prior is
    the :class:`UnnormalizedPosterior` of ``as_posterior(..., prior=)``; a posterior
    estimator keeps ``prior`` for the support check; an estimator that may be either is
    read by the shapes of ``theta`` and ``x``."""
    if prior is None or isinstance(posterior, Posterior):
        return as_posterior(posterior)
    found = recognize(posterior)
    if found is None:
        return as_posterior(posterior)
    reading = resolve_with_data(found, prior, theta, x)
    if reading == "posterior":
        return as_posterior(posterior, kind="posterior" if found.default is None else None)
    return as_posterior(posterior, prior=prior, kind=reading if reading != "unnormalized" else None)


def _latent_base(posteriors: Sequence[Posterior]) -> bool:
    """Whether every posterior maps a standard-normal base (``to_latent`` and a
    ``from_latent`` of its own) and computes ``log_prob`` cheaply."""
    return all(
        supports(p, "to_latent")
        and density_draws(p)
        and type(p).from_latent is not Posterior.from_latent
        for p in posteriors
    )


def shared_draws(posteriors: Sequence[Posterior], inputs: Inputs) -> list[SharedDraws]:
    """Each posterior in the draw cache the callbacks use
    (:class:`~calib_lightning.evaluation.SharedDraws`), holding its ``M`` draws per pair
    at ``inputs.x`` (with their log-densities when cheap), which every sampling check
    reads.

    One posterior: its own sampler, in chunks within the memory budget. Several (a
    comparison) that all map a standard-normal base: one set of latent draws
    ``z ~ N(0, I)`` pushed through each (``from_latent``), so a flow and its recalibration
    are compared on the same randomness (an identity fit gives the same draws);
    otherwise each samples from the same seeded stream.
    """
    theta, x, m = inputs.theta, inputs.x, inputs.num_posterior_samples
    room = max(MAX_SHARED_ELEMENTS, 2 * m * theta.shape[0] * (theta.shape[1] + 1))
    held = [SharedDraws(post, max_elements=room) for post in posteriors]
    if len(posteriors) > 1 and _latent_base(posteriors):
        with seeded(inputs.seed, DRAWS_STREAM, devices=inputs.devices):
            z = torch.randn(m, *theta.shape, dtype=theta.dtype, device=theta.device)
        for cache in held:
            cache.hold(x, *_mapped_draws(cache.posterior, z, x))
        return held
    for cache in held:
        with seeded(inputs.seed, DRAWS_STREAM, devices=inputs.devices), torch.no_grad():
            for _ in draw_chunks(cache, theta, x, m):  # the cache keeps what it draws
                pass
    return held


def _mapped_draws(post: Posterior, z: Tensor, x: Tensor) -> tuple[Tensor, Tensor]:
    samples, log_prob = torch.empty_like(z), z.new_empty(z.shape[:2])
    rows_per_call = max(1, _LATENT_POINTS // z.shape[0])
    with torch.no_grad():
        for rows in row_blocks(z.shape[1], rows_per_call):
            drawn = post.from_latent(z[:, rows], x[rows]).to(z)
            samples[:, rows] = drawn
            log_prob[:, rows] = post.log_prob(drawn, x[rows]).to(z)
    return samples, log_prob


def run_checks(
    posteriors: Sequence[Posterior],
    plans: Sequence[Sequence[Check]],
    inputs: Inputs,
    skipped: Sequence[dict[str, str]],
) -> list[Outcome]:
    """Run ``plans[k]`` on ``posteriors[k]``, check by check, each check on every posterior
    under the same seeded stream (common random numbers); ``skipped[k]``: checks already
    known not to apply, with the reason."""
    outcomes = [Outcome(skipped=dict(s)) for s in skipped]
    caches: list[Any] = list(posteriors)
    users = [k for k, p in enumerate(plans) if any(c.draws for c in p)]
    if users:
        start = time.perf_counter()
        made = shared_draws([posteriors[k] for k in users], inputs)
        seconds = (time.perf_counter() - start) / len(users)
        for k, cache in zip(users, made, strict=True):
            caches[k] = cache
            outcomes[k].seconds["draws"] = seconds
    for check in REGISTRY:
        runs = [
            (k, next(c for c in p if c.name == check.name))
            for k, p in enumerate(plans)
            if any(c.name == check.name for c in p)
        ]
        if not runs:
            continue
        on = [caches[k] if check.draws else posteriors[k] for k, _ in runs]
        with seeded(inputs.seed, check.stream, 0, devices=inputs.devices):  # its own stream
            common = check.common(inputs, on)
        for (k, planned), posterior in zip(runs, on, strict=True):
            if planned.instead_of in outcomes[k].results:
                continue
            start = time.perf_counter()
            try:
                with seeded(inputs.seed, check.stream, devices=inputs.devices):
                    outcomes[k].results[check.name] = planned.run(
                        posterior, inputs, common, outcomes[k]
                    )
            except UnsupportedError as err:  # found when the model ran: no score, no latents
                outcomes[k].skipped[check.name] = str(err)
                continue
            outcomes[k].seconds[check.name] = time.perf_counter() - start
    return outcomes


def diagnose(
    posterior: Any,
    theta: Tensor,
    x: Tensor,
    observations: Tensor | None = None,
    reference_samples: Tensor | None = None,
    checks: Sequence[str] | None = None,
    labels: Sequence[str] | None = None,
    *,
    parameters: Sequence[int] | None = None,
    num_posterior_samples: int = 100,
    level: float = 0.05,
    embedding: Any = None,
    seed: int = 0,
    before: Any = None,
    region: Any = None,
    prior: Any = None,
    sampler: Any = None,
) -> Diagnosis:
    r"""Is this posterior calibrated, and where not? Every check, one verdict, one report.

    Arguments:
        posterior: a trained estimator (anything :func:`calib_lightning.as_posterior`
            accepts); with ``prior``, also an sbi or lampe ratio estimator or an sbi
            likelihood estimator. A posterior known only up to its constant (those, an
            sbi ``MCMCPosterior``, a :class:`~calib_lightning.UnnormalizedPosterior`) gets
            the checks that need no posterior sample: KCCSD, ``coverage_is`` (expected
            coverage by importance sampling from the prior,
            :class:`~calib_lightning.ImportanceCoverage` with :data:`COVERAGE_IS_SAMPLES`
            draws per pair; skipped, with the effective sample size, where it cannot
            judge) and, for a ratio estimator, ``balance``
            (:class:`~calib_lightning.RatioBalance`); the others are listed as skipped
            with the reason, and ``before`` is refused.
        theta: held-out calibration parameters ``(N, D)`` from the prior.
        x: their simulated observations ``(N, *X)``.
        observations: observations ``(O, *X)`` you will analyse; enables L-C2ST-NF at
            each (with :func:`local_num_null` null classifiers, so Holm's correction over
            the ``O`` observations can name any of them; L-C2ST, check ``"lc2st"``, in
            its place for a posterior without latents) and the misspecification test
            against ``x``.
        reference_samples: exact posterior samples ``(S_ref, O, D)`` at the
            observations, if you have them (MCMC, a known posterior): adds the row
            ``reference``, not a name for ``checks``: it runs whenever these are given
            (MMD with its p-value, Fréchet distance, density and coverage of ``S_ref``
            posterior draws at each observation,
            :func:`~calib_lightning.functional.compare_to_reference`).
        checks: a subset of :data:`CHECKS` (``"interval_coverage"`` runs only when named);
            default every check that applies
            (the local ones need ``observations``; ``"lc2st"`` only where L-C2ST-NF
            cannot run: it asks the same question from posterior draws, and trains its
            null anew on them at every call). A check the posterior cannot support
            (a check's ``needs``: KCCSD needs the score, L-C2ST-NF the latents; a ``log_prob``
            without a gradient in ``theta`` gives no score, a base that is not normal no
            latents) is skipped and listed in the report's table with the
            reason (``Diagnosis.skipped``); for a samples-only posterior, and one whose
            log-density integrates an ODE's trace, the joint rank is the distance rank
            (``costly``: :class:`~calib_lightning.posteriors.Posterior`). KCCSD on a
            posterior whose score is costly (flow matching, a zuko ``CNF``) runs only
            when ``checks`` names it.
        labels: parameter names ``(D,)`` for tables and figures.
        parameters: indices of the parameters the per-parameter figures draw (default all).
        num_posterior_samples: draws per pair shared by ranks, TARP, the joint classifier
            test (:func:`~calib_lightning.metrics.joint_c2st.joint_c2st`: a classifier on
            half of the pairs, the other half's true parameters ranked among these draws;
            the one global check that sees a posterior ignoring ``x``) and recovery.
        level: the test level of the verdicts.
        embedding: ``x -> features`` for the misspecification test and the local tests'
            classifiers (e.g. the flow's embedding network, as ``cl.LC2STNF(embedding=)``);
            ``None``: standardized raw ``x``, flattened.
        seed: seeds all the checks' randomness: posterior draws, tie-breaking, TARP
            references, classifiers. Each check runs with torch's (CPU, and the CUDA
            devices of the posterior and the data), numpy's and Python's global
            generators forked and seeded from ``seed`` and the check's name, so one
            ``seed`` gives the same numbers whichever other checks run, and the caller's
            global random state is left unchanged.
        before: the posterior before a fix (e.g. the flow that ``cl.recalibrate``
            recalibrated into ``posterior``), diagnosed with the same pairs, checks and
            seed; or its :class:`~calib_lightning.diagnosis.Diagnosis` on the same pairs.
            The report then shows before and after side by side (``.before``,
            ``.comparison``; ``.save`` writes both). Both posteriors share their random
            numbers (TARP's reference points, the classifiers' folds and seeds, the latent
            draws where both map a normal base), so a change in the table is a change in
            the posteriors; the numbers of ``posterior`` can therefore differ from those
            of its diagnosis alone, within their Monte Carlo error.
        region: a :class:`~calib_lightning.ConformalRegion` of ``posterior``, fitted on
            other held-out pairs than ``theta``, ``x``: the report gives its calibrated
            credibility for a 90 % region at each observation (with ``reference_samples``,
            the exact posterior mass of the nominal and the calibrated region there) and
            draws both regions (``.regions``).
        prior: the prior ``theta`` was drawn from (a torch ``Distribution`` such as sbi's
            ``BoxUniform``, or anything with ``log_prob``): adds the check ``support``,
            the share of the shared draws outside its support
            (:func:`~calib_lightning.functional.support.support_leakage`: the true
            posterior puts none there, so one draw outside rejects with certainty; at
            each observation too, reported beside). The estimator is diagnosed as
            trained: sbi's ``DirectPosterior`` rejects those draws when it samples. For a
            ratio or likelihood estimator, the prior of its posterior (no support check:
            that posterior has no mass outside the prior's support).
        sampler: for a posterior known up to its constant, draws from it (a callable
            ``(x (N, *X), num_samples) -> (S, N, D)`` such as an MCMC sampler batched over
            ``x``, or a posterior that samples): the checks that need samples then run on
            its draws, as on a :class:`~calib_lightning.SamplePosterior` (the joint rank
            is the distance rank), beside the score checks.

    Returns:
        :class:`~calib_lightning.diagnosis.Diagnosis`: ``.verdict``, ``.table()``,
        ``.checks`` (the typed result of each check), ``.figures``, ``.save(dir)``, and
        with ``before`` the diagnosis before the fix (``.before``, ``.comparison``).

    Raises:
        ValueError: an argument that does not fit (named in the message); ``before`` a
            posterior of other parameters or observations than ``posterior``, or a
            diagnosis of another number of pairs, draws or level.

    Example:
        >>> import torch
        >>> from calib_lightning.tasks import GaussianToy
        >>> toy = GaussianToy(dim=2)
        >>> theta, x = toy.sample(300, torch.Generator().manual_seed(0))
        >>> report = diagnose(toy.posterior(variance_scale=0.5), theta, x,
        ...                   checks=("kccsd", "ranks", "tarp", "recovery"), seed=0)
        >>> report.verdict.split(":")[0]
        'miscalibrated'
        >>> again = diagnose(toy.posterior(variance_scale=0.5), theta, x,
        ...                  checks=("kccsd", "ranks", "tarp", "recovery"), seed=0)
        >>> again.table() == report.table()  # the same seed, the same numbers
        True
    """
    theta, x = check_pairs(theta, x, min_rows=2)
    check_positive("num_posterior_samples", num_posterior_samples, integer=True)
    check_probability("level", level)
    if labels is not None and len(labels) != theta.shape[1]:
        raise ValueError(
            f"labels must name the D = {theta.shape[1]} parameters, got {len(labels)} labels"
        )
    select_parameters(theta.shape[1], parameters, labels)  # ValueError now, not at .figures
    if checks is not None:
        unknown = [c for c in checks if c not in CHECKS]
        if unknown:
            raise ValueError(f"checks must be among {list(CHECKS)}, got {unknown}")
        local = [c.name for c in REGISTRY if c.name in checks and c.at_observations]
        if observations is None and local:
            raise ValueError(f"checks {local} need observations, got observations=None")
        need_prior = [c.name for c in REGISTRY if c.name in checks and c.needs_prior]
        if prior is None and need_prior:
            raise ValueError(f"checks {need_prior} need the prior, got prior=None")
    post = _target(posterior, prior, theta, x)
    if sampler is not None:
        if not isinstance(post, UnnormalizedPosterior):
            raise ValueError(
                "sampler must be given only with a posterior known up to its "
                "constant (a ratio or likelihood estimator with prior=), got "
                f"{type(post).__name__}, which samples itself"
            )
        post = SampledUnnormalizedPosterior(post, sampler)
    if isinstance(post, UnnormalizedPosterior) and before is not None:
        raise ValueError(
            "before must be None for a posterior known up to its constant (a "
            "ratio or likelihood estimator): a comparison needs posterior samples, "
            f"got before={type(before).__name__}"
        )
    # theta, x and the observations first: a wrong theta is named as theta, not as a
    # prior that does not fit it
    check_fits(post, theta, x, observations=observations)
    if prior is not None:
        check_prior(prior, theta)
    _check_before(before, theta, x, observations, num_posterior_samples, level)
    if reference_samples is not None and (
        observations is None
        or reference_samples.ndim != 3
        or reference_samples.shape[1:] != (observations.shape[0], theta.shape[1])
    ):
        raise ValueError(
            "reference_samples must have shape (S_ref, O, D) for the O observations and "
            f"D = {theta.shape[1]} parameters, got {tuple(reference_samples.shape)} with "
            f"observations={None if observations is None else tuple(observations.shape)}"
        )
    prior_before = (
        before if isinstance(before, Diagnosis) or before is None else as_posterior(before)
    )
    devices = cuda_devices(
        post, prior_before if isinstance(prior_before, Posterior) else None, theta, x, observations
    )
    inputs = Inputs(
        theta=theta.detach(),
        x=x.detach(),
        observations=observations,
        reference_samples=reference_samples,
        prior=prior,
        level=level,
        seed=seed,
        num_posterior_samples=num_posterior_samples,
        embedding=embedding,
        devices=devices,
    )
    regions = None
    if region is not None:
        with seeded(seed, REGION_STREAM, devices=devices):
            regions = summarize_region(region, observations, reference_samples, theta.shape[1])
    posteriors, plans, skipped = [post], [], []
    if isinstance(prior_before, Posterior):
        posteriors.append(prior_before)
    for one in posteriors:  # the posterior before a fix: its own defaults too
        run, why = plan(one, checks, inputs)
        plans.append(run)
        skipped.append(why)
    outcomes = run_checks(posteriors, plans, inputs, skipped)
    earlier = before if isinstance(before, Diagnosis) else None
    if len(outcomes) > 1:
        earlier = _diagnosis(outcomes[1], inputs, labels, parameters)
    return _diagnosis(
        outcomes[0], inputs, labels, parameters, before=earlier, regions=regions, fixed=post
    )


def _diagnosis(
    outcome: Outcome,
    inputs: Inputs,
    labels: Sequence[str] | None,
    parameters: Sequence[int] | None,
    *,
    before: Diagnosis | None = None,
    regions: Any = None,
    fixed: Any = None,
) -> Diagnosis:
    return Diagnosis(
        outcome.results,
        level=inputs.level,
        labels=labels,
        parameters=parameters,
        seconds=outcome.seconds,
        num_pairs=inputs.theta.shape[0],
        num_posterior_samples=inputs.num_posterior_samples,
        reference_samples=inputs.reference_samples,
        probability_maps=outcome.maps,
        skipped=outcome.skipped,
        before=before,
        regions=regions,
        identity=bool(getattr(fixed, "is_identity", False)) if before is not None else False,
    )


def _check_before(
    before: Any,
    theta: Tensor,
    x: Tensor,
    observations: Tensor | None,
    num_posterior_samples: int,
    level: float,
) -> None:
    """Raise a ``ValueError`` naming ``before`` if it cannot be compared with the
    posterior diagnosed on ``theta``, ``x``."""
    if before is None:
        return
    if isinstance(before, Diagnosis):
        got = (before.num_pairs, before.num_posterior_samples, before.level)
        if got != (theta.shape[0], num_posterior_samples, level):
            raise ValueError(
                f"before must be a diagnosis of the same N = {theta.shape[0]} pairs with "
                f"num_posterior_samples={num_posterior_samples} at level={level:g}, got "
                f"N = {got[0]}, num_posterior_samples={got[1]}, level={got[2]:g}"
            )
        return
    try:
        check_fits(before, theta, x, observations=observations)
    except ValueError as error:
        raise ValueError(
            "before must be a posterior of the same parameters and observations as "
            f"posterior (the one before the fix), got one that does not fit them: {error}"
        ) from None
