r"""The checks of ``cl.diagnose``, one small object each, run over one or two posteriors.

A check knows what it needs (a posterior capability, the shared posterior draws, the
observations, the prior) and how to run on one posterior; :func:`run_checks` runs each
check on every posterior it is given (the posterior diagnosed, and the one before a
fix) under the same random stream: torch's, numpy's and Python's global generators
forked and seeded from the diagnosis seed and the check's own number
(:data:`STREAMS`), so one seed gives the same numbers whichever other checks run, and
two posteriors get **common random numbers**: the same TARP references, joint-classifier
folds and initializations, KCCSD base points and bootstrap signs, L-C2ST classifier
seeds and evaluation points. Where both posteriors map a shared standard-normal base
(flows, a flow and its recalibration), their shared draws come from the same latent
draws too (:func:`shared_draws`). A difference between the two columns of a comparison
is then a difference between the posteriors, not between two lotteries.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import Tensor

from calib_lightning._chunks import row_blocks
from calib_lightning._prior import outside_support
from calib_lightning._random import seeded
from calib_lightning.diagnosis._names import CHECKS, STREAMS, local_num_null
from calib_lightning.evaluation import draw_chunks, draws
from calib_lightning.functional.recovery import recovery
from calib_lightning.functional.reference import compare_to_reference
from calib_lightning.functional.sbc import rank_calibration
from calib_lightning.functional.support import support_leakage
from calib_lightning.functional.tarp import (
    NUM_REFERENCES,
    pooled_values,
    tarp,
    tarp_box,
    tarp_fit_scale,
    tarp_references,
)
from calib_lightning.metrics import KCCSD, LC2ST, LC2STNF, ImportanceCoverage, RatioBalance
from calib_lightning.metrics.joint_c2st import joint_c2st
from calib_lightning.metrics.lc2st import ProbabilityMap
from calib_lightning.misspecification import misspecification_test
from calib_lightning.posteriors import density_draws, supports
from calib_lightning.posteriors.base import Posterior, UnsupportedError

__all__ = [
    "COVERAGE_IS_SAMPLES",
    "MAP_NUM_POSTERIOR_SAMPLES",
    "Check",
    "Draws",
    "Inputs",
    "Outcome",
    "local_num_null",
    "make_checks",
    "run_checks",
    "shared_draws",
]

MAP_NUM_POSTERIOR_SAMPLES = 2000  # posterior draws per observation of the probability maps
#: draws per pair of the importance-sampled coverage (below an ESS of 50 it cannot judge)
COVERAGE_IS_SAMPLES = 4000
#: points per call when the shared draws are mapped from shared latents
_LATENT_POINTS = 2**16


@dataclass(frozen=True)
class Inputs:
    """What every check of one diagnosis may read (the same for both posteriors)."""

    theta: Tensor
    x: Tensor
    observations: Tensor | None
    reference_samples: Tensor | None
    prior: Any
    level: float
    seed: int
    num_posterior_samples: int
    embedding: Any
    devices: list[torch.device]


@dataclass
class Draws:
    """One posterior's shared draws: ``samples (M, N, D)`` and, for a posterior with a cheap
    ``log_prob``, their log-densities ``(M, N)`` and the truths' ``(N,)``."""

    samples: Tensor
    log_prob: Tensor | None
    log_prob_theta: Tensor | None


@dataclass
class Outcome:
    """What the checks gave for one posterior: results, seconds, skipped checks (with the
    reason), and the probability maps of the local test."""

    results: dict[str, Any] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    maps: ProbabilityMap | None = None


class Check:
    """One check of ``diagnose``.

    Attributes:
        name: its key in :data:`~calib_lightning.diagnosis._names.CHECKS`.
        needs: the posterior capability it needs beyond sampling (``None``: none).
        draws: whether it reads the shared posterior draws.
        instead_of: a check whose result makes this one unnecessary (L-C2ST by default
            runs only where L-C2ST-NF did not).
    """

    name: ClassVar[str]
    needs: ClassVar[str | None] = None
    draws: ClassVar[bool] = False
    instead_of: str | None = None

    def common(self, inputs: Inputs, drawn: Sequence[Draws | None]) -> Any:
        """What the posteriors share beyond the random stream (e.g. TARP's references),
        from every posterior's draws; ``None`` by default."""
        return None

    def run(self, posterior: Posterior, inputs: Inputs, drawn: Draws | None, common: Any,
            outcome: Outcome) -> Any:  # fmt: skip
        """The check's typed result on ``posterior``."""
        raise NotImplementedError


class KCCSDCheck(Check):
    name, needs = "kccsd", "score"

    def run(self, posterior: Posterior, inputs: Inputs, drawn: Draws | None, common: Any,
            outcome: Outcome) -> Any:  # fmt: skip
        metric = KCCSD(seed=inputs.seed)  # base points from theta's moments: common to both
        metric.update(posterior, inputs.theta, inputs.x)
        return metric.compute()


class RanksCheck(Check):
    name, draws = "ranks", True

    def run(self, posterior: Posterior, inputs: Inputs, drawn: Draws | None, common: Any,
            outcome: Outcome) -> Any:  # fmt: skip
        assert drawn is not None
        return rank_calibration(drawn.samples, drawn.log_prob, inputs.theta, drawn.log_prob_theta,
                                level=inputs.level, generator=_generator())  # fmt: skip


class TARPCheck(Check):
    """TARP with references and scale fitted on the pooled values of every posterior
    diagnosed: a function of each posterior's unordered values, so exact for each, and
    the same references for both."""

    name, draws = "tarp", True

    def common(self, inputs: Inputs, drawn: Sequence[Draws | None]) -> Any:
        values = torch.cat([pooled_values(d.samples, inputs.theta) for d in drawn if d is not None])
        low, high = tarp_box(values, inputs.theta.shape[0])
        references = tarp_references(low, high, inputs.theta.shape[0], NUM_REFERENCES,
                                     generator=_generator())  # fmt: skip
        return references, tarp_fit_scale(values)

    def run(self, posterior: Posterior, inputs: Inputs, drawn: Draws | None, common: Any,
            outcome: Outcome) -> Any:  # fmt: skip
        assert drawn is not None
        references, scale = common
        return tarp(drawn.samples, inputs.theta, references=references, scale=scale,
                    level=inputs.level, generator=_generator())  # fmt: skip


class JointC2STCheck(Check):
    name, draws = "joint_c2st", True

    def run(self, posterior: Posterior, inputs: Inputs, drawn: Draws | None, common: Any,
            outcome: Outcome) -> Any:  # fmt: skip
        assert drawn is not None
        x = inputs.x.reshape(inputs.x.shape[0], -1)
        return joint_c2st(inputs.theta, x, drawn.samples, seed=inputs.seed)


class RecoveryCheck(Check):
    name, draws = "recovery", True

    def run(self, posterior: Posterior, inputs: Inputs, drawn: Draws | None, common: Any,
            outcome: Outcome) -> Any:  # fmt: skip
        assert drawn is not None
        return recovery(drawn.samples, inputs.theta)


class SupportCheck(Check):
    name, draws = "support", True

    def run(self, posterior: Posterior, inputs: Inputs, drawn: Draws | None, common: Any,
            outcome: Outcome) -> Any:  # fmt: skip
        assert drawn is not None
        at = None
        if inputs.observations is not None:
            at = outside_support(inputs.prior, draws(posterior, inputs.observations,
                                                     inputs.num_posterior_samples))  # fmt: skip
        return support_leakage(outside_support(inputs.prior, drawn.samples), at)


class LocalCheck(Check):
    """L-C2ST-NF (``latents=True``) or L-C2ST at the observations, with
    :func:`local_num_null` null classifiers; keeps the probability maps."""

    def __init__(self, latents: bool, instead_of: str | None = None) -> None:
        self.latents, self.instead_of = latents, instead_of

    @property
    def name(self) -> str:  # type: ignore[override]
        return "lc2st_nf" if self.latents else "lc2st"

    @property
    def needs(self) -> str | None:  # type: ignore[override]
        return "to_latent" if self.latents else None

    def run(self, posterior: Posterior, inputs: Inputs, drawn: Draws | None, common: Any,
            outcome: Outcome) -> Any:  # fmt: skip
        assert inputs.observations is not None
        kind = LC2STNF if self.latents else LC2ST
        metric = kind(observations=inputs.observations, level=inputs.level, seed=inputs.seed,
                      num_null=local_num_null(inputs.observations.shape[0], inputs.level),
                      embedding=inputs.embedding)  # fmt: skip
        metric.update(posterior, inputs.theta, inputs.x)
        result = metric.compute()
        if outcome.maps is None:  # the classifier's output on posterior draws there
            if self.latents:
                outcome.maps = metric.probability_map(posterior, MAP_NUM_POSTERIOR_SAMPLES)
            else:
                outcome.maps = ProbabilityMap(samples=result.samples,
                                              probabilities=result.probabilities)
        return result


class CoverageISCheck(Check):
    """:class:`~calib_lightning.ImportanceCoverage` from the prior, or the adaptive proposal
    where the prior's ESS is too small (blind to the true theta: the level holds)."""

    name = "coverage_is"

    def run(self, posterior: Posterior, inputs: Inputs, drawn: Draws | None, common: Any,
            outcome: Outcome) -> Any:  # fmt: skip
        for proposal in (None, "adaptive"):
            metric = ImportanceCoverage(COVERAGE_IS_SAMPLES, proposal, seed=inputs.seed)
            metric.update(posterior, inputs.theta, inputs.x)
            result = metric.compute()
            if result.cannot_judge is None:
                return result
        raise UnsupportedError(f"could not judge: with the prior and the adaptive proposal "
                               f"({COVERAGE_IS_SAMPLES} draws a pair) the median effective "
                               f"sample size is {float(result.ess_median):.1f} < 50")


class BalanceCheck(Check):
    """The balancing condition of a ratio estimator (:class:`~calib_lightning.RatioBalance`)."""

    name = "balance"

    def run(self, posterior: Posterior, inputs: Inputs, drawn: Draws | None, common: Any,
            outcome: Outcome) -> Any:  # fmt: skip
        metric = RatioBalance()
        metric.update(posterior, inputs.theta, inputs.x)
        return metric.compute()


class ReferenceCheck(Check):
    name = "reference"

    def run(self, posterior: Posterior, inputs: Inputs, drawn: Draws | None, common: Any,
            outcome: Outcome) -> Any:  # fmt: skip
        assert inputs.reference_samples is not None
        assert inputs.observations is not None
        samples = draws(posterior, inputs.observations, inputs.reference_samples.shape[0])
        return compare_to_reference(samples, inputs.reference_samples.to(samples), vendi=False,
                                    generator=_generator())  # fmt: skip


class MisspecificationCheck(Check):
    name = "misspecification"

    def run(self, posterior: Posterior, inputs: Inputs, drawn: Draws | None, common: Any,
            outcome: Outcome) -> Any:  # fmt: skip
        assert inputs.observations is not None
        return misspecification_test(inputs.observations, inputs.x, embedding=inputs.embedding,
                                     seed=inputs.seed, global_method="holm")  # fmt: skip


def _generator() -> torch.Generator:
    """A CPU generator seeded from the (already seeded) global stream of the check."""
    return torch.Generator().manual_seed(int(torch.randint(2**62, ())))


_BY_NAME: dict[str, Callable[[], Check]] = {
    "kccsd": KCCSDCheck, "ranks": RanksCheck, "tarp": TARPCheck, "joint_c2st": JointC2STCheck,
    "recovery": RecoveryCheck, "lc2st_nf": lambda: LocalCheck(latents=True),
    "lc2st": lambda: LocalCheck(latents=False), "misspecification": MisspecificationCheck,
    "support": SupportCheck, "reference": ReferenceCheck, "coverage_is": CoverageISCheck,
    "balance": BalanceCheck,
}  # fmt: skip


_ORDER = {name: k for k, name in enumerate((*CHECKS, "reference"))}  # L-C2ST-NF before L-C2ST


def make_checks(names: Sequence[str], *, local_fallback: bool = False) -> list[Check]:
    """The check objects of ``names``, in the order of :data:`CHECKS` (``reference``
    last); with ``local_fallback``, L-C2ST runs only if L-C2ST-NF gives no result."""
    out = [_BY_NAME[name]() for name in sorted(names, key=_ORDER.__getitem__)]
    if local_fallback and "lc2st_nf" in names:
        for check in out:
            if check.name == "lc2st":
                check.instead_of = "lc2st_nf"
    return out


def _latent_base(posteriors: Sequence[Posterior]) -> bool:
    """Whether every posterior maps a standard-normal base (``to_latent`` and a
    ``from_latent`` of its own) and computes ``log_prob`` cheaply."""
    return all(
        supports(p, "to_latent") and density_draws(p)
        and type(p).from_latent is not Posterior.from_latent
        for p in posteriors
    )  # fmt: skip


def shared_draws(posteriors: Sequence[Posterior], inputs: Inputs) -> list[Draws]:
    """Every posterior's ``M`` draws per pair, with their log-densities when cheap.

    One posterior: its own sampler (:func:`~calib_lightning.evaluation.draw_chunks`),
    within the memory budget. Several (a comparison) that all map a standard-normal base:
    one set of latent draws ``z ~ N(0, I)`` pushed through each (``from_latent``), so a
    flow and its recalibration are compared on the same randomness (an identity fit gives
    the same draws); otherwise each samples from the same seeded stream.
    """
    theta, x, m = inputs.theta, inputs.x, inputs.num_posterior_samples
    if len(posteriors) > 1 and _latent_base(posteriors):
        with seeded(inputs.seed, STREAMS["draws"], devices=inputs.devices):
            z = torch.randn(m, *theta.shape, dtype=theta.dtype, device=theta.device)
        return [_mapped_draws(post, z, theta, x) for post in posteriors]
    out = []
    for post in posteriors:
        with seeded(inputs.seed, STREAMS["draws"], devices=inputs.devices):
            out.append(_sampled_draws(post, theta, x, m))
    return out


def _mapped_draws(post: Posterior, z: Tensor, theta: Tensor, x: Tensor) -> Draws:
    samples, log_prob = torch.empty_like(z), z.new_empty(z.shape[:2])
    rows_per_call = max(1, _LATENT_POINTS // z.shape[0])
    with torch.no_grad():
        for rows in row_blocks(theta.shape[0], rows_per_call):
            drawn = post.from_latent(z[:, rows], x[rows]).to(z)
            samples[:, rows] = drawn
            log_prob[:, rows] = post.log_prob(drawn, x[rows]).to(z)
        log_prob_theta = torch.cat([post.log_prob(theta[rows], x[rows]).to(z)
                                    for rows in row_blocks(theta.shape[0], rows_per_call)])
    return Draws(samples, log_prob, log_prob_theta)


def _sampled_draws(post: Posterior, theta: Tensor, x: Tensor, m: int) -> Draws:
    like = {"dtype": theta.dtype, "device": theta.device}  # CUDA data: CUDA draws
    samples = torch.empty(m, *theta.shape, **like)
    dense = density_draws(post)
    log_prob = torch.empty(m, theta.shape[0], **like)
    log_prob_theta = torch.empty(theta.shape[0], **like)
    # the draws kept for every check count against the budget of the sampling chunks
    held = sum(t.numel() * t.element_size() for t in (samples, log_prob, log_prob_theta))
    for chunk in draw_chunks(post, theta, x, m, kept_bytes=held):
        rows = slice(chunk.start, chunk.start + chunk.theta.shape[0])
        taken = slice(chunk.first_draw, chunk.first_draw + chunk.samples.shape[0])
        samples[taken, rows] = chunk.samples.to(samples)
        if chunk.log_prob is not None and chunk.log_prob_theta is not None:
            log_prob[taken, rows] = chunk.log_prob.to(log_prob)
            log_prob_theta[rows] = chunk.log_prob_theta.to(log_prob_theta)
    return Draws(samples, log_prob, log_prob_theta) if dense else Draws(samples, None, None)


def run_checks(
    posteriors: Sequence[Posterior], plans: Sequence[Sequence[Check]], inputs: Inputs,
    skipped: Sequence[dict[str, str]],
) -> list[Outcome]:  # fmt: skip
    """Run ``plans[k]`` on ``posteriors[k]``, check by check, each check on every posterior
    under the same seeded stream (common random numbers); ``skipped[k]``: checks already
    known not to apply, with the reason."""
    outcomes = [Outcome(skipped=dict(s)) for s in skipped]
    drawn: list[Draws | None] = [None] * len(posteriors)
    users = [k for k, plan in enumerate(plans) if any(c.draws for c in plan)]
    if users:
        start = time.perf_counter()
        made = shared_draws([posteriors[k] for k in users], inputs)
        seconds = (time.perf_counter() - start) / len(users)
        for k, d in zip(users, made, strict=True):
            drawn[k] = d
            outcomes[k].seconds["draws"] = seconds
    names = sorted({c.name for plan in plans for c in plan}, key=_ORDER.__getitem__)
    for name in names:
        runs = [(k, next(c for c in plan if c.name == name)) for k, plan in enumerate(plans)
                if any(c.name == name for c in plan)]  # fmt: skip
        with seeded(inputs.seed, STREAMS[name], 0, devices=inputs.devices):  # its own stream
            common = runs[0][1].common(inputs, [drawn[k] for k, _ in runs])
        for k, check in runs:
            if check.instead_of in outcomes[k].results:
                continue
            start = time.perf_counter()
            try:
                with seeded(inputs.seed, STREAMS[name], devices=inputs.devices):
                    outcomes[k].results[name] = check.run(posteriors[k], inputs, drawn[k],
                                                          common, outcomes[k])  # fmt: skip
            except UnsupportedError as err:  # found when the model ran: no score, no latents
                outcomes[k].skipped[name] = str(err)
                continue
            outcomes[k].seconds[name] = time.perf_counter() - start
    return outcomes
