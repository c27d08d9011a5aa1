r"""The joint classifier test as a torchmetrics metric: a global test over :math:`(\theta, x)`.

SBC, TARP and the latent checks test the law of a per-pair statistic averaged over
:math:`x`, so a posterior that ignores the observation, :math:`q(\theta \mid x) =
p(\theta)`, passes all of them: it is calibrated, and useless. :class:`JointC2ST` trains a
classifier on :math:`(\theta, x)` jointly, true pairs against posterior draws at the same
:math:`x`, on part of the calibration pairs, and ranks the true parameters of the other
part among ``M`` posterior draws by the classifier's score: a conformal test with exact
level for any classifier (:mod:`calib_lightning.functional.joint_c2st`,
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

from calib_lightning._checks import check_pairs, check_positive, check_probability
from calib_lightning._distributed import canonical_order, room_for_rows
from calib_lightning.classifiers import make_ensemble
from calib_lightning.classifiers._seeds import digest_words, generator, stream_seed
from calib_lightning.classifiers.joint_c2st import joint_c2st_split, joint_c2st_test
from calib_lightning.evaluation import check_event_size, draws
from calib_lightning.metrics._shapes import KeepShapes
from calib_lightning.posteriors import Posterior
from calib_lightning.results import Result

__all__ = ["JointC2ST", "JointC2STResult", "joint_c2st"]


@dataclass(eq=False)
class JointC2STResult(Result):
    r"""Result of :class:`JointC2ST` (and of :func:`joint_c2st`).

    Attributes:
        statistic: :math:`Z = \sqrt{12 n}(\bar u - \frac12)`, ``()``; about ``N(0, 1)``
            under :math:`H_0`, large when the classifier tells true pairs from the
            posterior's (negative when it ranks them below the draws).
        p_value: two-sided :math:`2 (1 - \Phi(|Z|))`, ``()`` (the verdict).
        mean_rank: :math:`\bar u`, ``()``: 0.5 when calibrated, up to 1 when the true
            parameters always score above the posterior draws.
        ranks: the held-out pairs' conformal ranks :math:`u_i`, ``(n,)``.
        num_train: pairs the classifier trained on.
    """

    logged = ("p_value", "statistic", "mean_rank")
    verdict = "p_value"

    statistic: Tensor
    p_value: Tensor
    mean_rank: Tensor
    ranks: Tensor
    num_train: int


def joint_c2st(
    theta: Tensor,
    x: Tensor,
    samples: Tensor,
    *,
    train_fraction: float = 0.5,
    num_ensemble: int = 1,
    classifier: str | Any = "mlp",
    classifier_kwargs: dict[str, Any] | None = None,
    seed: int = 0,
    check: int = 0,
) -> JointC2STResult:
    r"""The joint classifier test on calibration pairs and posterior draws.

    Arguments:
        theta: true parameters ``(N, D)``.
        x: observations ``(N, X)`` (flattened features).
        samples: posterior draws :math:`\theta_{im} \sim q(\cdot \mid x_i)`, ``(M, N, D)``,
            ``M >= 2``.
        train_fraction: share of the pairs the classifier trains on (the rest are ranked).
        num_ensemble: classifiers whose log-odds are averaged.
        classifier: ``"mlp"``, ``"sbibm"`` or a scikit-learn classifier
            (:func:`~calib_lightning.classifiers.make_ensemble`).
        classifier_kwargs: :class:`~calib_lightning.classifiers.MLPEnsemble` settings.
        seed: with ``check`` and the data, keys the split, the classifier and the ties.
        check: a counter that makes repeated checks on the same data draw fresh randomness.

    The split is drawn from ``seed``, ``check`` and the digest of ``x`` only, and the
    classifier's randomness from those and the digest of the training pairs: given ``x``
    and the training part, nothing depends on the held-out :math:`\theta^*`, so the ranks
    are exactly uniform under :math:`H_0`.

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
        raise ValueError(f"samples must have shape (M, N, D) = (M, {theta.shape[0]}, "
                         f"{theta.shape[1]}), got {tuple(samples.shape)}")  # fmt: skip
    check_positive("num_ensemble", num_ensemble, integer=True)
    check_probability("train_fraction", train_fraction)
    key = [check, *digest_words(x)]
    # the split joint_c2st_test draws from a generator seeded alike: the same rows
    train, _ = joint_c2st_split(theta.shape[0], train_fraction, generator(seed, 1, *key))
    training = torch.cat([theta[train], samples[0, train].to(theta)], 1)
    member_seed = stream_seed(seed, 2, *key, *digest_words(training))
    ensemble = make_ensemble(classifier, num_ensemble, member_seed, **(classifier_kwargs or {}))
    z, p_value, ranks = joint_c2st_test(
        theta[None], x[None], samples.to(theta)[None], ensemble, train_fraction,
        generator(seed, 1, *key), generator(seed, 3, *key),
    )  # fmt: skip
    return JointC2STResult(statistic=z[0], p_value=p_value[0], mean_rank=ranks[0].double().mean(),
                           ranks=ranks[0], num_train=len(train))  # fmt: skip


class JointC2ST(KeepShapes):
    r"""A global classifier test over :math:`(\theta, x)` that sees a posterior ignoring ``x``.

    ``update(posterior, theta, x)`` stores the pairs and ``num_posterior_samples`` draws
    :math:`\theta_{im} \sim q(\cdot \mid x_i)` per pair; ``compute()`` splits the pairs,
    trains the classifier on ``train_fraction`` of them and ranks the rest
    (:func:`joint_c2st`), and returns a :class:`JointC2STResult`. Every ``compute()`` is a
    check with fresh randomness (the counter ``checks`` is in the ``state_dict``).

    Memory: per process at most ``max_pairs`` pairs with their draws,
    ``max_pairs * (X + (M + 1) D)`` numbers. Under DDP the pairs are gathered and put in
    a canonical order of ``x``; every process runs the same test.

    Arguments:
        num_posterior_samples: ``M``, draws per pair; the ranks take ``M + 1`` values.
        train_fraction: share of the pairs the classifier trains on.
        num_ensemble: classifiers averaged.
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
        train_fraction: float = 0.5,
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
        check_probability("train_fraction", train_fraction)
        self.num_posterior_samples, self.train_fraction = num_posterior_samples, train_fraction
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
            raise ValueError(f"x must keep X = {self.x[0].shape[1]} features across updates, "
                             f"got shape {tuple(x.shape)}")  # fmt: skip
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
        if x.shape[0] < 4:
            raise ValueError(f"JointC2ST needs at least N >= 4 calibration pairs, got N = {len(x)}")
        result = joint_c2st(
            theta[order], x[order], samples[order].transpose(0, 1),
            train_fraction=self.train_fraction, num_ensemble=self.num_ensemble,
            classifier=self.classifier_spec, classifier_kwargs=self.classifier_kwargs,
            seed=self.seed, check=int(self.checks),
        )  # fmt: skip
        self.checks += 1
        return result
