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
draws that fall outside its support.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from calib_lightning._checks import check_pairs, check_positive, check_probability
from calib_lightning._fit_check import check_fits
from calib_lightning._prior import check_prior, outside_support
from calib_lightning._random import cuda_devices, seeded
from calib_lightning.diagnosis._regions import summarize_region
from calib_lightning.diagnosis._report import Diagnosis
from calib_lightning.evaluation import draw_chunks, draws
from calib_lightning.functional.recovery import recovery
from calib_lightning.functional.reference import compare_to_reference
from calib_lightning.functional.sbc import rank_calibration
from calib_lightning.functional.support import support_leakage
from calib_lightning.functional.tarp import tarp
from calib_lightning.metrics import KCCSD, LC2ST, LC2STNF
from calib_lightning.metrics.joint_c2st import joint_c2st
from calib_lightning.metrics.lc2st import ProbabilityMap
from calib_lightning.misspecification import misspecification_test
from calib_lightning.plots._grid import select_parameters
from calib_lightning.posteriors import as_posterior, density_draws, supports, unsupported
from calib_lightning.posteriors.base import UnsupportedError

__all__ = ["CHECKS", "NEEDS", "diagnose", "skipped_checks"]

#: every check ``diagnose`` can run, in the order of the report
CHECKS = ("kccsd", "ranks", "tarp", "joint_c2st", "recovery", "lc2st_nf", "lc2st",
          "misspecification", "support")
_SAMPLING = ("ranks", "tarp", "joint_c2st", "recovery", "support")
_LOCAL = ("lc2st_nf", "lc2st", "misspecification")
#: the posterior capability each check needs beyond sampling
NEEDS = {"kccsd": "score", "lc2st_nf": "to_latent"}
#: the random stream of each step (with ``seed``): a check's numbers do not depend on
#: which other checks run
_STREAMS = {name: k for k, name in enumerate(
    ("draws", *(c for c in CHECKS if c not in ("joint_c2st", "support", "lc2st")),
     "reference", "joint_c2st", "region", "support", "lc2st"), start=1)}
MAP_NUM_POSTERIOR_SAMPLES = 2000  # posterior draws per observation of the probability maps


def _shared_draws(
    posterior: Any, theta: Tensor, x: Tensor, num_posterior_samples: int
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """``(samples (M, N, D), log_prob (M, N), log_prob_theta (N,))`` in one sampling pass;
    the log-densities ``None`` for a posterior without a cheap ``log_prob`` (samples only,
    an ODE's trace)."""
    like = {"dtype": theta.dtype, "device": theta.device}  # CUDA data: CUDA draws
    samples = torch.empty(num_posterior_samples, *theta.shape, **like)
    dense = density_draws(posterior)
    log_prob = torch.empty(num_posterior_samples, theta.shape[0], **like)
    log_prob_theta = torch.empty(theta.shape[0], **like)
    # the draws kept for every check count against the budget of the sampling chunks
    held = sum(t.numel() * t.element_size() for t in (samples, log_prob, log_prob_theta))
    for chunk in draw_chunks(posterior, theta, x, num_posterior_samples, kept_bytes=held):
        rows = slice(chunk.start, chunk.start + chunk.theta.shape[0])
        draws = slice(chunk.first_draw, chunk.first_draw + chunk.samples.shape[0])
        samples[draws, rows] = chunk.samples.to(samples)
        if chunk.log_prob is not None and chunk.log_prob_theta is not None:
            log_prob[draws, rows] = chunk.log_prob.to(log_prob)
            log_prob_theta[rows] = chunk.log_prob_theta.to(log_prob_theta)
    return (samples, log_prob, log_prob_theta) if dense else (samples, None, None)


def skipped_checks(posterior: Any, checks: Sequence[str]) -> dict[str, str]:
    """The checks among ``checks`` that ``posterior`` cannot support, with the reason:
    the capability it lacks (:data:`NEEDS`) and what it provides."""
    post = as_posterior(posterior)
    return {name: str(unsupported(post, NEEDS[name])) for name in checks
            if name in NEEDS and not supports(post, NEEDS[name])}  # fmt: skip


def local_num_null(num_observations: int, level: float, default: int = 100) -> int:
    """Null classifiers for L-C2ST-NF in :func:`diagnose`: enough for Holm to name one.

    The verdict lists observations by Holm-adjusted p-values; with ``H`` null
    classifiers the smallest is ``O / (1 + H)``. ``H = max(default, ceil(2 O / level))``
    keeps it at most ``level / 2``, so every observation can be named (100 up to
    ``O = 2.5`` at level 0.05; 200 for 5 observations, 400 for 10).
    """
    return max(default, math.ceil(2 * num_observations / level))


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
) -> Diagnosis:
    r"""Is this posterior calibrated, and where not? Every check, one verdict, one report.

    Arguments:
        posterior: a trained estimator (anything :func:`calib_lightning.as_posterior`
            accepts).
        theta: held-out calibration parameters ``(N, D)`` from the prior.
        x: their simulated observations ``(N, *X)``.
        observations: observations ``(O, *X)`` you will analyse; enables L-C2ST-NF at
            each (with :func:`local_num_null` null classifiers, so Holm's correction over
            the ``O`` observations can name any of them; L-C2ST, check ``"lc2st"``, in
            its place for a posterior without latents) and the misspecification test
            against ``x``.
        reference_samples: exact posterior samples ``(S_ref, O, D)`` at the
            observations, if you have them (MCMC, a known posterior): adds the check
            ``reference`` (MMD with its p-value, Fréchet distance, density and coverage
            of ``S_ref`` posterior draws at each observation,
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
        embedding: ``x -> features`` for the misspecification test (e.g. the flow's
            embedding network); ``None``: standardized raw ``x``.
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
            ``.comparison``; ``.save`` writes both).
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
            trained: sbi's ``DirectPosterior`` rejects those draws when it samples.

    Returns:
        :class:`~calib_lightning.diagnosis.Diagnosis`: ``.verdict``, ``.table()``,
        ``.checks`` (the typed result of each check), ``.figures``, ``.save(dir)``, and
        with ``before`` the diagnosis before the fix (``.before``, ``.comparison``).

    Raises:
        ValueError: an argument that does not fit (named in the message); ``before`` a
            posterior of other parameters or observations than ``posterior``, or a
            diagnosis of another number of pairs, draws or level.

    Example:
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
    check_pairs(theta, x, min_rows=2)
    check_positive("num_posterior_samples", num_posterior_samples, integer=True)
    check_probability("level", level)
    if labels is not None and len(labels) != theta.shape[1]:
        raise ValueError(f"labels must name the D = {theta.shape[1]} parameters, got "
                         f"{len(labels)} labels")  # fmt: skip
    select_parameters(theta.shape[1], parameters, labels)  # ValueError now, not at .figures
    by_default = checks is None
    if checks is None:
        checks = [c for c in CHECKS if (observations is not None or c not in _LOCAL)
                  and (prior is not None or c != "support")]  # fmt: skip
    unknown = [c for c in checks if c not in CHECKS]
    if unknown:
        raise ValueError(f"checks must be among {list(CHECKS)}, got {unknown}")
    if observations is None and any(c in _LOCAL for c in checks):
        raise ValueError(f"checks {[c for c in checks if c in _LOCAL]} need observations, "
                         "got observations=None")  # fmt: skip
    if "support" in checks:
        if prior is None:
            raise ValueError("checks ['support'] need the prior, got prior=None")
        check_prior(prior, theta)
    post = as_posterior(posterior)
    check_fits(post, theta, x, observations=observations)  # names the argument that is wrong
    _check_before(before, theta, x, observations, num_posterior_samples, level)
    requested = list(checks)
    skipped = skipped_checks(post, checks)
    if by_default and "kccsd" in checks and "score" in post.costly:
        skipped["kccsd"] = (
            f"left out by default: the score of this {type(post).__name__} differentiates an "
            "ODE solve at every point (minutes at N = 1,000 on a CPU); pass checks with "
            "'kccsd' to run it"
        )
    if "joint_c2st" in checks and (theta.shape[0] < 4 or num_posterior_samples < 2):
        skipped["joint_c2st"] = ("the joint classifier test needs N >= 4 pairs and "
                                 f"num_posterior_samples >= 2, got N = {theta.shape[0]} and "
                                 f"{num_posterior_samples}")  # fmt: skip
    checks = [c for c in checks if c not in skipped]
    if reference_samples is not None and (
        observations is None or reference_samples.ndim != 3
        or reference_samples.shape[1:] != (observations.shape[0], theta.shape[1])
    ):  # fmt: skip
        raise ValueError(
            "reference_samples must have shape (S_ref, O, D) for the O observations and "
            f"D = {theta.shape[1]} parameters, got {tuple(reference_samples.shape)} with "
            f"observations={None if observations is None else tuple(observations.shape)}"
        )
    devices = cuda_devices(post, theta, x, observations)
    regions = None
    if region is not None:
        with seeded(seed, _STREAMS["region"], devices=devices):
            regions = summarize_region(region, observations, reference_samples, theta.shape[1])
    results: dict[str, Any] = {}
    seconds: dict[str, float] = {}

    def timed(name: str, run: Any) -> None:
        start = time.perf_counter()
        try:
            with seeded(seed, _STREAMS[name], devices=devices) as stream:
                results[name] = run(torch.Generator().manual_seed(stream))
        except UnsupportedError as err:  # found when the model ran: no score, no latents
            skipped[name] = str(err)
            return
        seconds[name] = time.perf_counter() - start

    theta, x = theta.detach(), x.detach()
    if "kccsd" in checks:
        def run_kccsd(generator: torch.Generator) -> Any:
            metric = KCCSD(seed=seed)
            metric.update(post, theta, x)
            return metric.compute()

        timed("kccsd", run_kccsd)
    if any(c in checks for c in _SAMPLING):
        start = time.perf_counter()
        with seeded(seed, _STREAMS["draws"], devices=devices):
            samples, log_prob, log_prob_theta = _shared_draws(
                post, theta, x, num_posterior_samples)  # fmt: skip
        seconds["draws"] = time.perf_counter() - start
        if "ranks" in checks:
            timed("ranks", lambda generator: rank_calibration(
                samples, log_prob, theta, log_prob_theta, level=level, generator=generator))
        if "tarp" in checks:
            timed("tarp", lambda generator: tarp(samples, theta, level=level, generator=generator))
        if "joint_c2st" in checks:
            timed("joint_c2st", lambda generator: joint_c2st(
                theta, x.reshape(x.shape[0], -1), samples, seed=seed))
        if "recovery" in checks:
            timed("recovery", lambda generator: recovery(samples, theta))
        if "support" in checks:
            def run_support(generator: torch.Generator) -> Any:
                at = None if observations is None else outside_support(
                    prior, draws(post, observations, num_posterior_samples))  # fmt: skip
                return support_leakage(outside_support(prior, samples), at)

            timed("support", run_support)
    maps = None  # L-C2ST-NF's classifier on posterior draws at each observation, for the report
    if "lc2st_nf" in checks:
        def run_lc2st(generator: torch.Generator) -> Any:
            nonlocal maps
            metric = LC2STNF(observations=observations, level=level, seed=seed,
                             num_null=local_num_null(observations.shape[0], level))
            metric.update(post, theta, x)
            result = metric.compute()
            maps = metric.probability_map(post, MAP_NUM_POSTERIOR_SAMPLES)  # seeded stream
            return result

        timed("lc2st_nf", run_lc2st)
    if "lc2st" in checks and not (by_default and "lc2st_nf" in results):  # asked, or in its place
        def run_lc2st_draws(generator: torch.Generator) -> Any:
            nonlocal maps
            metric = LC2ST(observations=observations, level=level, seed=seed,
                           num_null=local_num_null(observations.shape[0], level))  # fmt: skip
            metric.update(post, theta, x)
            result = metric.compute()
            if maps is None:  # its evaluation draws and the classifier's output there
                maps = ProbabilityMap(samples=result.samples, probabilities=result.probabilities)
            return result

        timed("lc2st", run_lc2st_draws)
    if reference_samples is not None:
        def run_reference(generator: torch.Generator) -> Any:
            samples = draws(post, observations, reference_samples.shape[0])
            return compare_to_reference(samples, reference_samples.to(samples), vendi=False,
                                        generator=generator)  # fmt: skip

        timed("reference", run_reference)
    if "misspecification" in checks:
        timed("misspecification", lambda generator: misspecification_test(
            observations, x, embedding=embedding, seed=seed, global_method="holm"))
    if before is not None and not isinstance(before, Diagnosis):
        before = diagnose(
            before, theta, x, observations, reference_samples,
            None if by_default else requested, labels,  # its own defaults (L-C2ST's place)
            parameters=parameters, num_posterior_samples=num_posterior_samples, level=level,
            embedding=embedding, seed=seed, prior=prior,
        )  # fmt: skip
    return Diagnosis(
        results, level=level, labels=labels, parameters=parameters, seconds=seconds,
        num_pairs=theta.shape[0], num_posterior_samples=num_posterior_samples,
        reference_samples=reference_samples, probability_maps=maps, skipped=skipped,
        before=before, regions=regions,
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
