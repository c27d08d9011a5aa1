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

from collections.abc import Sequence
from typing import Any

from torch import Tensor

from calib_lightning._checks import check_pairs, check_positive, check_probability
from calib_lightning._fit_check import check_fits
from calib_lightning._prior import check_prior
from calib_lightning._random import cuda_devices, seeded
from calib_lightning.diagnosis._checks import (
    COVERAGE_IS_SAMPLES,
    MAP_NUM_POSTERIOR_SAMPLES,
    Inputs,
    Outcome,
    local_num_null,
    make_checks,
    run_checks,
)
from calib_lightning.diagnosis._names import (
    CHECKS,
    LOCAL,
    NEEDS,
    SAMPLING,
    STREAMS,
    UNNORMALIZED,
)
from calib_lightning.diagnosis._regions import summarize_region
from calib_lightning.diagnosis._report import Diagnosis
from calib_lightning.plots._grid import select_parameters
from calib_lightning.posteriors import (
    UnnormalizedPosterior,
    as_posterior,
    recognize,
    supports,
    unsupported,
)
from calib_lightning.posteriors._dispatch import resolve_with_data
from calib_lightning.posteriors.base import Posterior
from calib_lightning.posteriors.samples import SamplePosterior

__all__ = ["CHECKS", "COVERAGE_IS_SAMPLES", "MAP_NUM_POSTERIOR_SAMPLES", "NEEDS", "diagnose",
           "local_num_null", "skipped_checks"]  # fmt: skip


def skipped_checks(posterior: Any, checks: Sequence[str]) -> dict[str, str]:
    """The checks among ``checks`` that ``posterior`` cannot support, with the reason:
    the capability it lacks (:data:`NEEDS`) and what it provides."""
    post = as_posterior(posterior)
    return {name: str(unsupported(post, NEEDS[name])) for name in checks
            if name in NEEDS and not supports(post, NEEDS[name])}  # fmt: skip


def _plan(
    post: Posterior, checks: Sequence[str] | None, inputs: Inputs
) -> tuple[list[str], dict[str, str]]:
    """The checks to run on ``post`` (``checks``, or its defaults) and those skipped, with
    the reason."""
    observations, prior = inputs.observations, inputs.prior
    by_default = checks is None
    unnormalized = isinstance(post, UnnormalizedPosterior)
    if checks is None:
        checks = [c for c in CHECKS if (observations is not None or c not in LOCAL)
                  and (prior is not None or c != "support") and c not in UNNORMALIZED]
        if unnormalized:  # r p has no mass outside the prior's support: no support check
            checks = [c for c in checks if c != "support"] + list(UNNORMALIZED)
    skipped = skipped_checks(post, checks)
    for name in checks:
        if unnormalized and name in (*SAMPLING, "lc2st_nf", "lc2st") and not supports(
                post, "sample"):  # fmt: skip
            skipped[name] = _NEEDS_SAMPLES.format(type(post).__name__)
        elif not unnormalized and name in UNNORMALIZED:
            skipped[name] = (f"needs a posterior known up to its normalizing constant (a "
                             f"ratio or likelihood estimator with prior=), got "
                             f"{type(post).__name__}")  # fmt: skip
        elif name == "balance" and not is_ratio(post):
            skipped[name] = ("needs a ratio estimator (sbi's NRE_A/B/C or BNRE, lampe's NRE); "
                             "for a log-ratio callable f in cl.UnnormalizedPosterior(f, prior), "
                             "name 'balance' in checks")  # fmt: skip
            if not by_default:
                del skipped[name]
    if by_default and "kccsd" in checks and "score" in post.costly:
        skipped["kccsd"] = (
            f"left out by default: the score of this {type(post).__name__} differentiates an "
            "ODE solve at every point (minutes at N = 1,000 on a CPU); pass checks with "
            "'kccsd' to run it"
        )
    n, m = inputs.theta.shape[0], inputs.num_posterior_samples
    if "joint_c2st" in checks and (n < 4 or m < 2):
        skipped["joint_c2st"] = ("the joint classifier test needs N >= 4 pairs and "
                                 f"num_posterior_samples >= 2, got N = {n} and {m}")  # fmt: skip
    run = [c for c in checks if c not in skipped]
    if inputs.reference_samples is not None and unnormalized and not supports(post, "sample"):
        skipped["reference"] = _NEEDS_SAMPLES.format(type(post).__name__)
    elif inputs.reference_samples is not None:
        run.append("reference")
    return run, skipped


_NEEDS_SAMPLES = (
    "needs posterior samples, and this {} is known only up to its normalizing constant "
    "(scores only): KCCSD and the importance-sampled coverage check it without sampling; "
    "for this check, pass sampler= (e.g. MCMC, batched over x)"
)


class UnnormalizedWithSampler(UnnormalizedPosterior):
    """An unnormalized posterior with the user's sampler (MCMC, say) for the checks that
    need samples; its scores stay those of ``inner``."""

    capabilities = frozenset({"score", "sample"})

    def __init__(self, inner: UnnormalizedPosterior, sampler: Any) -> None:
        Posterior.__init__(self, inner.module)
        self.prior, self._size, self._context = inner.prior, inner._size, inner._context
        self.kind = inner.kind
        self.sampler = sampler if isinstance(sampler, Posterior) else SamplePosterior(
            sampler, num_dims=inner._size)  # fmt: skip
        if "sample" not in self.sampler.capabilities:
            raise ValueError(f"sampler must draw samples: a callable (x (N, *X), num_samples) "
                             f"-> (S, N, D) or a posterior that samples, got {self.sampler!r}")

    def sample(self, x: Tensor, num_posterior_samples: int) -> Tensor:
        return self.sampler.sample(x, num_posterior_samples)


def is_ratio(post: Posterior) -> bool:
    """Whether ``post`` is the posterior of a ratio estimator (sbi's, lampe's, or declared
    with ``kind="ratio"``)."""
    return getattr(post, "kind", None) == "ratio"


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
        checks: a subset of :data:`CHECKS`; default every check that applies
            (the local ones need ``observations``; ``"lc2st"`` only where L-C2ST-NF
            cannot run: it asks the same question from posterior draws, and trains its
            null anew on them at every call). A check the posterior cannot support
            (:data:`NEEDS`: KCCSD needs the score, L-C2ST-NF the latents; a ``log_prob``
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
        raise ValueError(f"labels must name the D = {theta.shape[1]} parameters, got "
                         f"{len(labels)} labels")  # fmt: skip
    select_parameters(theta.shape[1], parameters, labels)  # ValueError now, not at .figures
    if checks is not None:
        unknown = [c for c in checks if c not in CHECKS]
        if unknown:
            raise ValueError(f"checks must be among {list(CHECKS)}, got {unknown}")
        if observations is None and any(c in LOCAL for c in checks):
            raise ValueError(f"checks {[c for c in checks if c in LOCAL]} need observations, "
                             "got observations=None")  # fmt: skip
        if "support" in checks and prior is None:
            raise ValueError("checks ['support'] need the prior, got prior=None")
    post = _target(posterior, prior, theta, x)
    if sampler is not None:
        if not isinstance(post, UnnormalizedPosterior):
            raise ValueError("sampler must be given only with a posterior known up to its "
                             "constant (a ratio or likelihood estimator with prior=), got "
                             f"{type(post).__name__}, which samples itself")  # fmt: skip
        post = UnnormalizedWithSampler(post, sampler)
    if isinstance(post, UnnormalizedPosterior) and before is not None:
        raise ValueError("before must be None for a posterior known up to its constant (a "
                         "ratio or likelihood estimator): a comparison needs posterior samples, "
                         f"got before={type(before).__name__}")  # fmt: skip
    # theta, x and the observations first: a wrong theta is named as theta, not as a
    # prior that does not fit it
    check_fits(post, theta, x, observations=observations)
    if prior is not None:
        check_prior(prior, theta)
    _check_before(before, theta, x, observations, num_posterior_samples, level)
    if reference_samples is not None and (
        observations is None or reference_samples.ndim != 3
        or reference_samples.shape[1:] != (observations.shape[0], theta.shape[1])
    ):  # fmt: skip
        raise ValueError(
            "reference_samples must have shape (S_ref, O, D) for the O observations and "
            f"D = {theta.shape[1]} parameters, got {tuple(reference_samples.shape)} with "
            f"observations={None if observations is None else tuple(observations.shape)}"
        )
    prior_before = before if isinstance(before, Diagnosis) or before is None else as_posterior(
        before)  # fmt: skip
    devices = cuda_devices(post, prior_before if isinstance(prior_before, Posterior) else None,
                           theta, x, observations)  # fmt: skip
    inputs = Inputs(theta=theta.detach(), x=x.detach(), observations=observations,
                    reference_samples=reference_samples, prior=prior, level=level, seed=seed,
                    num_posterior_samples=num_posterior_samples, embedding=embedding,
                    devices=devices)  # fmt: skip
    regions = None
    if region is not None:
        with seeded(seed, STREAMS["region"], devices=devices):
            regions = summarize_region(region, observations, reference_samples, theta.shape[1])
    posteriors, plans, skipped = [post], [], []
    if isinstance(prior_before, Posterior):
        posteriors.append(prior_before)
    for one in posteriors:  # the posterior before a fix: its own defaults too
        names, why = _plan(one, checks, inputs)
        # by default L-C2ST runs only in L-C2ST-NF's place (where the latents fail)
        plans.append(make_checks(names, local_fallback=checks is None))
        skipped.append(why)
    outcomes = run_checks(posteriors, plans, inputs, skipped)
    earlier = before if isinstance(before, Diagnosis) else None
    if len(outcomes) > 1:
        earlier = _diagnosis(outcomes[1], inputs, labels, parameters)
    return _diagnosis(outcomes[0], inputs, labels, parameters, before=earlier, regions=regions,
                      fixed=post)  # fmt: skip


def _diagnosis(
    outcome: Outcome, inputs: Inputs, labels: Sequence[str] | None,
    parameters: Sequence[int] | None, *, before: Diagnosis | None = None, regions: Any = None,
    fixed: Any = None,
) -> Diagnosis:  # fmt: skip
    return Diagnosis(
        outcome.results, level=inputs.level, labels=labels, parameters=parameters,
        seconds=outcome.seconds, num_pairs=inputs.theta.shape[0],
        num_posterior_samples=inputs.num_posterior_samples,
        reference_samples=inputs.reference_samples, probability_maps=outcome.maps,
        skipped=outcome.skipped, before=before, regions=regions,
        identity=bool(getattr(fixed, "is_identity", False)) if before is not None else False,
    )  # fmt: skip


def _check_before(
    before: Any, theta: Tensor, x: Tensor, observations: Tensor | None,
    num_posterior_samples: int, level: float,
) -> None:  # fmt: skip
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
