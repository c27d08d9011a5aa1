r"""The joint classifier test as a torchmetrics metric: a global test over :math:`(\theta, x)`.

SBC, TARP and the latent checks test the law of a per-pair statistic averaged over
:math:`x`, so a posterior that ignores the observation, :math:`q(\theta \mid x) =
p(\theta)`, passes all of them: it is calibrated, and useless. :class:`JointC2ST` trains
classifiers on :math:`(\theta, x)` jointly, true pairs against posterior draws at the same
:math:`x`, cross-fitted over ``K`` folds and repeated ``R`` times, and ranks every pair's
true parameter among ``M`` posterior draws by the score of classifiers that did not see
it: a conformal test whose level holds for any classifier and whose verdict does not
hang on one split (:mod:`calib_lightning.functional.joint_c2st`,
:mod:`calib_lightning.classifiers.joint_c2st`). Power and seconds against the other checks:
``examples/benchmarks/results/joint_c2st.md``.

References:
    Bansal, Chen, Scott. "Conformal C2ST: Turning weak classifiers into strong two-sample
    tests." arXiv:2507.17026 (2025).

    Hu, Lei. "A Two-Sample Conditional Distribution Test Using Conformal Prediction and
    Weighted Rank Sum." JASA 119 (2024).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torchmetrics.utilities.data import dim_zero_cat

from calib_lightning._utils.distributed import canonical_order, room_for_rows
from calib_lightning._utils.validation import check_pairs, check_positive
from calib_lightning.classifiers import make_ensemble
from calib_lightning.classifiers._seeds import digest_words, generator, stream_seed
from calib_lightning.classifiers.joint_c2st import joint_c2st_folds, joint_c2st_test
from calib_lightning.evaluation import check_event_size, draws
from calib_lightning.metrics._shapes import KeepShapes
from calib_lightning.posteriors import Posterior
from calib_lightning.results import Result

__all__ = ["FOLDS", "REPEATS", "JointC2ST", "JointC2STResult", "joint_c2st"]

#: folds of the cross-fit and its repetitions (``examples/benchmarks/results/seed_stability.md``)
FOLDS, REPEATS = 2, 4


@dataclass(eq=False)
class JointC2STResult(Result):
    r"""Result of :class:`JointC2ST` (and of :func:`joint_c2st`).

    Attributes:
        statistic: the mean of the folds' statistics :math:`Z_f`, ``()``; each is
            ``N(0, 1)`` under :math:`H_0`, large when the classifiers tell true pairs from
            the posterior's (negative when they rank them below the draws).
        p_value: the Cauchy combination of the folds' two-sided p-values
            :math:`2 \Phi(-|Z_f|)`, ``()`` (the verdict); from :math:`\log \Phi`, so it
            does not underflow before ``2.2e-308``.
        mean_rank: :math:`\frac1N \sum_i \bar u_i`, ``()``: 0.5 when calibrated, up to 1
            when the true parameters always score above the posterior draws.
        ranks: every pair's conformal rank averaged over the repetitions,
            :math:`\bar u_i`, ``(N,)``.
        num_train: pairs each classifier trained on.
        num_classifiers: classifiers trained (folds x repetitions x ensemble members).
        p_value_error: ``()`` Monte Carlo standard error of ``p_value``: the jackknife
            over the repetitions (the combination without each one), what other folds
            and initializations could move it by; ``cl.diagnose`` says a decision within
            twice it of the level may turn with the seed.
    """

    logged = ("p_value", "statistic", "mean_rank")
    verdict = "p_value"

    statistic: Tensor
    p_value: Tensor
    mean_rank: Tensor
    ranks: Tensor
    num_train: int
    num_classifiers: int
    p_value_error: Tensor | None = None


def joint_c2st(
    theta: Tensor,
    x: Tensor,
    samples: Tensor,
    *,
    folds: int = FOLDS,
    repeats: int = REPEATS,
    num_ensemble: int = 1,
    classifier: str | Any = "mlp",
    classifier_kwargs: dict[str, Any] | None = None,
    seed: int = 0,
    check: int = 0,
) -> JointC2STResult:
    r"""The joint classifier test on calibration pairs and posterior draws.

    Arguments:
        theta: true parameters ``(N, D)``, ``N >= 2 * folds``.
        x: observations ``(N, X)`` (flattened features).
        samples: posterior draws :math:`\theta_{im} \sim q(\cdot \mid x_i)`, ``(M, N, D)``,
            ``M >= 2``.
        folds: ``K``: each pair is ranked by a classifier trained on the other folds.
        repeats: ``R`` cross-fits with fresh folds and classifiers, averaged.
        num_ensemble: classifiers whose log-odds are averaged, per fold.
        classifier: ``"mlp"``, ``"sbibm"`` or a scikit-learn classifier
            (:func:`~calib_lightning.classifiers.make_ensemble`).
        classifier_kwargs: :class:`~calib_lightning.classifiers.MLPEnsemble` settings.
        seed: with ``check`` and the observations, keys the folds, the classifiers and the
            ties.
        check: a counter that makes repeated checks on the same data draw fresh randomness.

    Every random stream is keyed by ``seed``, ``check`` and the digest of ``x`` only:
    nothing the classifiers do depends on a pair's :math:`\theta^*` unless they train on
    it, so each pair's rank is exactly uniform under :math:`H_0`; and two posteriors
    tested on the same pairs (before and after a fix) get the same folds, initializations
    and ties: a difference between their results is a difference between them.

    Example:
        >>> from calib_lightning.tasks import GaussianToy
        >>> toy = GaussianToy(dim=2)
        >>> theta, x = toy.sample(400, torch.Generator().manual_seed(0))
        >>> blind = torch.randn(50, 400, 2, generator=torch.Generator().manual_seed(1))
        >>> bool(joint_c2st(theta, x, blind).p_value < 0.05)  # the prior as the posterior
        True
    """
    theta, x = check_pairs(theta, x, min_rows=4)
    x = x.reshape(x.shape[0], -1)
    if samples.ndim != 3 or samples.shape[1:] != theta.shape:
        raise ValueError(
            f"samples must have shape (M, N, D) = (M, {theta.shape[0]}, "
            f"{theta.shape[1]}), got {tuple(samples.shape)}"
        )
    check_positive("num_ensemble", num_ensemble, integer=True)
    key = [check, *digest_words(x)]
    assignment = joint_c2st_folds(theta.shape[0], folds, repeats, generator(seed, 1, *key))
    members = folds * repeats * num_ensemble
    ensemble = make_ensemble(
        classifier, members, stream_seed(seed, 2, *key), **(classifier_kwargs or {})
    )
    z, p_value, ranks, error = joint_c2st_test(
        theta[None],
        x[None],
        samples.to(theta)[None],
        ensemble,
        assignment,
        generator(seed, 3, *key),
    )
    num_train = theta.shape[0] - int(max(assignment.eq(k).sum(1).max() for k in range(folds)))
    return JointC2STResult(
        statistic=z[0],
        p_value=p_value[0],
        mean_rank=ranks[0].mean(),
        ranks=ranks[0],
        num_train=num_train,
        num_classifiers=members,
        p_value_error=error[0],
    )


class JointC2ST(KeepShapes):
    r"""A global classifier test over :math:`(\theta, x)` that sees a posterior ignoring ``x``.

    ``update(posterior, theta, x)`` stores the pairs and ``num_posterior_samples`` draws
    :math:`\theta_{im} \sim q(\cdot \mid x_i)` per pair; ``compute()`` cross-fits
    classifiers over ``folds`` folds, ``repeats`` times, ranks every pair by the ones that
    did not see it (:func:`joint_c2st`), and returns a :class:`JointC2STResult`. Every
    ``compute()`` is a check with fresh randomness (the counter ``checks`` is in the
    ``state_dict``).

    Memory: per process at most ``max_pairs`` pairs with their draws,
    ``max_pairs * (X + (M + 1) D)`` numbers. Under DDP the pairs are gathered and put in
    a canonical order of ``x``; every process runs the same test.

    Arguments:
        num_posterior_samples: ``M``, draws per pair; the ranks take ``M + 1`` values.
        folds: ``K`` folds of the cross-fit.
        repeats: ``R`` cross-fits averaged.
        num_ensemble: classifiers averaged per fold.
        classifier: ``"mlp"``, ``"sbibm"`` or a scikit-learn classifier.
        classifier_kwargs: :class:`~calib_lightning.classifiers.MLPEnsemble` settings.
        max_pairs: per-process bound on stored pairs.
        seed: keys every random stream with the data and the check counter; ``None``
            draws it from fresh entropy.

    Example:
        >>> from calib_lightning.tasks import GaussianToy
        >>> toy = GaussianToy(dim=2)
        >>> theta, x = toy.sample(400, torch.Generator().manual_seed(0))
        >>> metric = JointC2ST()
        >>> _ = torch.manual_seed(0)
        >>> metric.update(lambda x: toy.prior().expand(x.shape[:1]), theta, x)
        >>> bool(metric.compute().p_value < 0.05)
        True
    """

    is_differentiable = False
    higher_is_better = False
    full_state_update = False

    theta: list[Tensor]
    x: list[Tensor]
    samples: list[Tensor]

    def __init__(
        self,
        num_posterior_samples: int = 100,
        folds: int = FOLDS,
        repeats: int = REPEATS,
        num_ensemble: int = 1,
        classifier: str | Any = "mlp",
        classifier_kwargs: dict[str, Any] | None = None,
        max_pairs: int = 10_000,
        seed: int | None = 0,
        **kwargs: Any,
    ) -> None:
        kwargs.setdefault("compute_with_cache", False)
        super().__init__(**kwargs)
        if seed is None:
            seed = int(np.random.SeedSequence().entropy) % 2**63
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed must be a non-negative integer or None, got {seed!r}")
        check_positive("num_posterior_samples", num_posterior_samples, integer=True)
        if num_posterior_samples < 2:
            raise ValueError(f"num_posterior_samples must be >= 2, got {num_posterior_samples}")
        check_positive("num_ensemble", num_ensemble, integer=True)
        check_positive("max_pairs", max_pairs, integer=True)
        joint_c2st_folds(2 * folds, folds, repeats)  # validates folds and repeats
        self.num_posterior_samples, self.folds, self.repeats = num_posterior_samples, folds, repeats
        self.num_ensemble, self.max_pairs, self.seed = num_ensemble, max_pairs, seed
        self.classifier_spec, self.classifier_kwargs = classifier, dict(classifier_kwargs or {})
        make_ensemble(classifier, 1, **self.classifier_kwargs)  # validate the specification
        for name in ("theta", "x", "samples"):
            self.add_state(name, default=[], dist_reduce_fx="cat")
        self.register_buffer("checks", torch.zeros((), dtype=torch.long))
        self._warned = False

    def update(self, posterior: Posterior | object, theta: Tensor, x: Tensor) -> None:
        """Store pairs ``theta (N, D)``, ``x (N, *X)`` with ``M`` posterior draws each."""
        theta, x = check_pairs(theta, x)
        check_event_size(posterior, theta, x)
        flat = x.reshape(x.shape[0], -1)
        if self.x and flat.shape[1] != self.x[0].shape[1]:
            raise ValueError(
                f"x must keep X = {self.x[0].shape[1]} features across updates, "
                f"got shape {tuple(x.shape)}"
            )
        keep = room_for_rows(self, theta.shape[0], self.theta)
        if keep:
            drawn = draws(posterior, x[:keep], self.num_posterior_samples)  # (M, n, D)
            self.theta.append(theta[:keep].detach())
            self.x.append(flat[:keep].detach())
            self.samples.append(drawn.transpose(0, 1).to(theta))  # (n, M, D)

    def reset(self) -> None:
        super().reset()
        self._warned = False

    def compute(self) -> JointC2STResult:
        """Statistic, p-value, mean rank and the held-out ranks."""
        if isinstance(self.theta, list) and not self.theta:
            raise ValueError("JointC2ST.compute() needs at least one update, got none")
        theta, x = dim_zero_cat(self.theta), dim_zero_cat(self.x)
        samples = dim_zero_cat(self.samples)
        order = canonical_order(x)
        if x.shape[0] < 2 * self.folds:
            raise ValueError(
                f"JointC2ST needs at least N >= 2 * folds = {2 * self.folds} "
                f"calibration pairs, got N = {len(x)}"
            )
        result = joint_c2st(
            theta[order],
            x[order],
            samples[order].transpose(0, 1),
            folds=self.folds,
            repeats=self.repeats,
            num_ensemble=self.num_ensemble,
            classifier=self.classifier_spec,
            classifier_kwargs=self.classifier_kwargs,
            seed=self.seed,
            check=int(self.checks),
        )
        self.checks += 1
        return result
