r"""Conformal credible regions: HPD-type regions of any posterior, calibrated.

:class:`ConformalRegion` turns a trained posterior and held-out pairs into credible
regions with a finite-sample coverage guarantee (split conformal prediction,
:mod:`calib_lightning.functional.conformal`). The posterior itself is not changed: the
region at :math:`x` is a log-density contour of it, :math:`\{\log q \ge -\hat t\}` with a
calibrated threshold (score :math:`-\log q`, the default with a log-density), or its HPD
region at the calibrated credibility :math:`\hat a(1 - \alpha)` instead of the nominal
:math:`1 - \alpha` (CDF-split); one threshold or level for all ``x`` (global) or one per
cell of a regression tree over ``x`` or a summary of the posterior at ``x`` (LOCART).

It needs draws and log-densities, so it works with every estimator
:func:`calib_lightning.as_posterior` accepts; a samples-only posterior gets the
density-free distance statistic (:func:`~calib_lightning.functional.distance_log_prob`)
in place of the log-density.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from calib_lightning._utils.validation import (
    check_choice,
    check_finite,
    check_pairs,
    check_positive,
)
from calib_lightning._utils.validation import check_probability as _check_probability
from calib_lightning.functional.conformal import (
    conformal_coverage_error,
    credibility,
    density_threshold,
)
from calib_lightning.posteriors import as_posterior
from calib_lightning.posteriors.base import supports
from calib_lightning.recalibration._draw_stats import (
    check_points,
    check_scores,
    count_above,
    negative_log_prob,
    score_statistics,
    seeded_draws,
    tie_noise,
)
from calib_lightning.recalibration._partition import TreePartition

__all__ = ["ConformalRegion"]

_SCORES = ("auto", "density", "distance")
_CONFORMITY = ("auto", "credibility", "log_density")


class ConformalRegion(TreePartition):
    r"""Credible regions of a posterior at a level calibrated on held-out pairs.

    The score of a pair :math:`(\theta^*, x)` is :math:`-\log q(\theta^* \mid x)` for a
    posterior with ``log_prob`` (``conformity="log_density"``, the default there), else
    (``"credibility"``) its credibility :math:`c`: the share of ``num_posterior_samples``
    draws of :math:`q(\cdot \mid x)` with a higher log-density than :math:`\theta^*`
    (randomized to break ties). :meth:`fit` stores the scores of ``n`` held-out pairs;
    their conformal quantile is the calibrated threshold :math:`\hat t` (the region
    :math:`\{\log q \ge -\hat t\}`, :meth:`threshold`) or credibility :math:`\hat a`
    (:math:`q`'s HPD region at that credibility); :meth:`calibrated_level` is the
    region's credibility, :meth:`contains` its membership.

    **Guarantee.** For pairs exchangeable with the held-out ones (the same joint
    distribution, independent; the held-out pairs must not have picked the posterior's
    epoch or checkpoint either: it fits those better than new pairs), the region at level
    :math:`1 - \alpha` contains the true parameter with probability

    .. math::
        1 - \alpha \;\le\; P\big(\theta^* \in R_{1-\alpha}(x)\big)
        \;\le\; 1 - \alpha + \frac{1}{n + 1} + \varepsilon_S,

    for any posterior, however miscalibrated, and any ``n`` (the probability is over the
    held-out pairs, the new pair and the draws). The lower bound is exact; the upper one
    holds for the randomized score (no ties: :math:`P(c_{n+1} \le \hat a)`) with
    :math:`\varepsilon_S = 0`; the deterministic membership test of :meth:`contains`
    adds :math:`\varepsilon_S = P(r_{n+1} = \lceil \hat a (S + 1) \rceil - 1)`, about
    :math:`1 / (S + 1)` for a roughly calibrated posterior. The same bounds hold for
    ``conformity="log_density"`` (score :math:`-\log q(\theta^* \mid x)`, region
    :math:`\{\log q \ge -t\}`, no draws needed but for the summary), with
    :math:`\varepsilon_S = 0`; credibility regions beyond all ``S`` draws are everything.

    A local region fits its model over ``x`` (a tree, or a location-scale regression of
    the scores) on a random ``tree_fraction`` of the pairs and takes the quantiles on the
    others: the bounds hold within every leaf (with the leaf's ``n``), or for the
    normalized residuals, conditionally on the model, hence marginally; the region moves
    closer to coverage at every ``x``. Other pairs (an early-stopping split) can fit the
    model (:meth:`fit_partition`), all held-out ones then calibrate.

    Arguments:
        posterior: anything :func:`calib_lightning.as_posterior` accepts.
        local: ``False``: one level for all ``x``; ``True`` or ``"tree"``: one per leaf
            of a regression tree of the scores on the features of ``x`` (``sklearn``
            ``DecisionTreeRegressor``, LOCART); ``"regression"``: normalized split
            conformal, a linear regression of the scores on the features (location) and
            of their absolute residuals (scale), the conformal quantile taken of the
            normalized residuals: smooth in ``x``, no leaves to fill (on sbibm's SLCP
            closer to the reference posteriors than the tree, ``conformal_sbibm.md``).
        score: ``"density"`` (log-density), ``"distance"`` (density-free; the only one
            for a samples-only posterior) or ``"auto"`` (density when available).
        num_posterior_samples: ``S``, the draws per observation, for fitting and for
            every region (more draws: a sharper region, the same guarantee).
        min_leaf_size: the tree's minimum number of pairs per leaf (local only; also the
            fewest pairs a regression is fitted on).
        tree_fraction: share of the held-out pairs that fits the model (local only).
        embedding: the local model's features of ``x``: a callable ``x -> (N, F)``;
            ``None``: ``x`` flattened; ``"posterior"``: a summary of ``q(. | x)`` from its
            ``S`` draws, each coordinate's mean and standard deviation and (density
            score) the draws' mean log-density: where ``q`` is narrow or wide, i.e. where
            its over- or under-confidence may change. At new ``x`` the draws are seeded.
        conformity: the score the quantiles are taken of: ``"log_density"`` (CP4SBI's
            HPD score; needs ``log_prob``; one log-density threshold per leaf, exact
            membership), ``"credibility"`` (CDF-split; any estimator) or ``"auto"``
            (the former when ``score`` is ``"density"``): on sbibm's SLCP the log-density
            is closer to the reference posteriors, on Two Moons as close
            (``examples/benchmarks/results/conformal_sbibm.md``, confirmation seeds).
        seed: seeds the tie-breaking noise, the split and the tree.

    Example:
        >>> from calib_lightning.tasks import GaussianToy
        >>> toy = GaussianToy(dim=2)
        >>> theta, x = toy.sample(1000, torch.Generator().manual_seed(0))
        >>> too_narrow = toy.posterior(variance_scale=0.5)  # over-confident
        >>> region = ConformalRegion(too_narrow).fit(theta, x)  # log-density threshold
        >>> region.calibrated_level(0.9, x[:3])  # its 90 % region: about its 99 % one
        tensor([0.9880, 0.9850, 0.9900], dtype=torch.float64)
        >>> theta, x = toy.sample(4000, torch.Generator().manual_seed(1))
        >>> round(float(region.contains(theta, x, level=0.9).double().mean()), 2)  # ~0.9
        0.89

    References:
        Vagner, Cabezas, Izbicki et al. "CP4SBI: Local Conformal Calibration of Credible
        Sets in Simulation-Based Inference." arXiv:2508.17077 (2025).
    """

    def __init__(
        self,
        posterior: Any,
        *,
        local: bool | str = False,
        score: str = "auto",
        num_posterior_samples: int = 1000,
        min_leaf_size: int = 100,
        tree_fraction: float = 0.5,
        embedding: Callable[[Tensor], Tensor] | None = None,
        conformity: str = "auto",
        seed: int = 0,
    ) -> None:
        check_choice("score", score, _SCORES)
        check_choice("conformity", conformity, _CONFORMITY)
        check_positive("num_posterior_samples", num_posterior_samples, integer=True)
        check_positive("min_leaf_size", min_leaf_size, integer=True)
        _check_probability("tree_fraction", tree_fraction)
        self.posterior = as_posterior(posterior)
        dense = supports(self.posterior, "log_prob")
        if score == "density" and not dense:
            raise ValueError(
                f"score='density' needs log_prob, which {type(self.posterior).__name__} does "
                "not provide; use score='distance' (or 'auto')"
            )
        self.score = ("density" if dense else "distance") if score == "auto" else score
        if conformity == "log_density" and self.score != "density":
            raise ValueError(
                f"conformity='log_density' needs log_prob (score 'density'), "
                f"got {self.score!r} for {type(self.posterior).__name__}"
            )
        if conformity == "auto":
            conformity = "log_density" if self.score == "density" else "credibility"
        self.conformity = conformity
        if not (embedding is None or embedding == "posterior" or callable(embedding)):
            raise ValueError(
                f"embedding must be None, 'posterior' or a callable x -> (N, F), got {embedding!r}"
            )
        if local not in (False, True, "tree", "regression"):
            raise ValueError(f"local must be False, True, 'tree' or 'regression', got {local!r}")
        self.partition = {False: None, True: "tree"}.get(local, local)
        self.local, self.embedding, self.seed = self.partition is not None, embedding, int(seed)
        self._summary = self.local and embedding == "posterior"
        self.num_posterior_samples, self.min_leaf_size = num_posterior_samples, min_leaf_size
        self.tree_fraction, self.tree = float(tree_fraction), None
        self.scores: Tensor | None = None
        self.leaves: Tensor | None = None
        self._residuals: Tensor | None = None
        self._leaf_index: dict[int, int] = {}
        self._partitioned = False  # the tree comes from fit_partition

    def __repr__(self) -> str:
        kind = {None: "global", "tree": "local"}.get(self.partition, self.partition)
        n = "unfitted" if self.scores is None else f"n={len(self.scores)}"
        return (
            f"ConformalRegion({self.posterior!r}, {kind}, score={self.score!r}, "
            f"conformity={self.conformity!r}, {n})"
        )

    # --- scores -------------------------------------------------------------------------

    def _draws(self, x: Tensor) -> Tensor:  # seeded: the same at the same x (summary, level)
        seed = self.seed + 2 if self._summary or self._raw else None
        return seeded_draws(self.posterior, x, self.num_posterior_samples, seed)

    def credibility(self, theta: Tensor, x: Tensor, *, randomized: bool = False) -> Tensor:
        r"""Credibility of ``theta`` under :math:`q(\cdot \mid x)`: the share of fresh draws
        with a higher score, ``r / (S + 1)`` (``(r + U) / (S + 1)`` if ``randomized``).

        Arguments:
            theta: ``(*, N, D)``: every leading index is compared with the same draws.
            x: observations ``(N, *X)``.
            randomized: add the tie-breaking noise (as for the held-out scores).

        Returns:
            ``(*, N)`` in ``[0, 1)``; ``theta`` lies in the region at level ``a`` iff its
            non-randomized credibility is below ``a``.
        """
        return self._credibility(*self._statistics(theta, x)[1:], randomized)

    def _statistics(self, theta: Tensor, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Checked points' draws at ``x`` and score statistics (of the draws, of ``theta``)."""
        theta, x = check_points(theta, x)
        samples = self._draws(x)
        return samples, *score_statistics(self.posterior, self.score, samples, theta, x)

    def _credibility(self, ell_samples: Tensor, ell_theta: Tensor, randomized: bool) -> Tensor:
        noise = tie_noise(ell_theta, self.seed + 1) if randomized else None
        return credibility(ell_samples, ell_theta, noise)

    # --- fit ----------------------------------------------------------------------------

    def fit(self, theta: Tensor, x: Tensor, *, scores: Tensor | None = None) -> ConformalRegion:
        """Score the held-out pairs (and fit the local model); returns ``self``.

        Arguments:
            theta: held-out true parameters ``(n, D)``, never used to train or select it.
            x: their observations ``(n, *X)``.
            scores: the same pairs' scores from a global region of the same posterior
                (its :attr:`scores`, ``(n,)``), to skip the draws (e.g. a local region
                beside a global one); ``embedding="posterior"`` then draws its features
                anew, apart from the scores' draws (unlike new pairs: a Monte Carlo gap).
        """
        generator = torch.Generator().manual_seed(self.seed)
        scores, features = self._scored(theta, x, scores, generator)
        self.scores, self.leaves, self._residuals = scores, None, None
        if not self.local:
            return self
        features = self._features(x) if features is None else features
        if self._partitioned:  # every pair calibrates the given model
            self._calibrate(features, scores)
            return self
        n = len(scores)
        n_tree = round(self.tree_fraction * n)
        if n_tree < self.min_leaf_size or n - n_tree < 2:
            raise ValueError(
                f"local={self.partition!r} needs at least min_leaf_size = {self.min_leaf_size} "
                f"pairs to fit its model (tree_fraction = {self.tree_fraction} of n) and 2 to "
                f"calibrate, got n = {n}"
            )
        order = torch.randperm(n, generator=generator)
        fit_rows, cal_rows = order[:n_tree].numpy(), order[n_tree:]
        self._grow(features[fit_rows], scores[fit_rows])
        self._calibrate(features[cal_rows.numpy()], scores[cal_rows])
        return self

    def fit_partition(
        self, theta: Tensor, x: Tensor, *, scores: Tensor | None = None
    ) -> ConformalRegion:
        """Fit the local model on pairs apart from the held-out ones; returns ``self``.

        Call it before :meth:`fit`, which then keeps this model (tree or regression) and
        lets every held-out pair calibrate instead of splitting them (``tree_fraction``).
        The guarantee needs the model independent of the held-out pairs only: these may be
        any pairs that did not train the posterior's weights, typically the early-stopping
        split.

        Arguments:
            theta: parameters ``(m, D)``, at least ``min_leaf_size`` pairs.
            x: their observations ``(m, *X)``.
            scores: their scores, as in :meth:`fit`.
        """
        if not self.local:
            raise ValueError(
                "fit_partition fits the model of a local region: use local=True or 'regression'"
            )
        generator = torch.Generator().manual_seed(self.seed + 3)
        scores, features = self._scored(theta, x, scores, generator)
        if len(scores) < self.min_leaf_size:
            raise ValueError(
                f"fit_partition needs at least min_leaf_size = "
                f"{self.min_leaf_size} pairs, got {len(scores)}"
            )
        self._grow(self._features(x) if features is None else features, scores)
        self._partitioned, self.scores, self.leaves, self._residuals = True, None, None, None
        return self

    def _scored(
        self, theta: Tensor, x: Tensor, scores: Tensor | None, generator: torch.Generator
    ) -> tuple[Tensor, Any]:
        """The pairs' randomized scores ``(n,)`` float64 and, with the posterior summary,
        their features from the same draws (``None`` otherwise, or with given scores)."""
        theta, x = check_pairs(theta, x, min_rows=2)
        check_finite("theta", theta)
        if scores is not None:
            check_scores(scores, len(theta), credibility=not self._raw)
            torch.rand(len(theta), generator=generator, dtype=torch.float64)  # same split
            return scores.double().cpu(), None
        above, summary = None, None
        if not self._raw or self._summary:  # (log_density: draws for the summary only)
            above, summary = count_above(
                self.posterior,
                self.score,
                theta,
                x,
                self.num_posterior_samples,
                summary=self._summary,
            )
        noise = torch.rand(len(theta), generator=generator, dtype=torch.float64)
        features = None if summary is None else summary.numpy()
        if self._raw:
            return negative_log_prob(self.posterior, theta, x), features
        return (above + noise) / (self.num_posterior_samples + 1), features

    # --- levels and regions -------------------------------------------------------------

    def calibrated_level(self, level: float = 0.9, x: Tensor | None = None) -> Tensor:
        r"""The credibility :math:`\hat a` whose HPD regions cover ``level`` of new pairs.

        Above ``level`` for an over-confident posterior, below for an under-confident one.
        With ``conformity="log_density"`` the region is :math:`\{\log q \ge -t\}` (one
        calibrated :math:`t` per leaf, :meth:`threshold`) and this is its credibility at
        each ``x``: the share of the ``S`` seeded draws at ``x`` inside, plus one, over
        ``S + 1`` (``x`` needed).

        Arguments:
            level: nominal coverage :math:`1 - \alpha` in ``(0, 1)``.
            x: observations ``(N, *X)``: one level per row (needed when ``local``).

        Returns:
            ``()`` (global, without ``x``) or ``(N,)``; 1 (the whole space) in a leaf with
            fewer than ``level / (1 - level)`` calibration pairs.

        Raises:
            ValueError: too few held-out pairs for ``level`` (global), or an unfitted region.
        """
        out = self._level(level, x)
        return out if x is None else out.to(x.device)

    def contains(self, theta: Tensor, x: Tensor, level: float = 0.9) -> Tensor:
        r"""Whether ``theta`` lies in the calibrated ``level`` region at ``x``.

        Arguments:
            theta: ``(*, N, D)``: points compared with the same ``S`` draws per row of ``x``.
            x: observations ``(N, *X)``.
            level: nominal coverage :math:`1 - \alpha`.

        Returns:
            Boolean ``(*, N)``, on ``x``'s device.
        """
        if self._raw:  # exact: -log q(theta | x) <= t(x), no draws but the summary's
            theta, x = check_points(theta, x)
            score = negative_log_prob(self.posterior, theta, x)
            return (score <= self._quantile(level, x).to(score)).to(x.device)
        samples, ell_samples, ell_theta = self._statistics(theta, x)
        target = self._level(level, x if self.local else None, samples, ell_samples)
        cred = self._credibility(ell_samples, ell_theta, False)
        return (cred < target.to(device=cred.device, dtype=theta.dtype)).to(x.device)

    def coverage_error(
        self, theta: Tensor, x: Tensor, *, credibility: Tensor | None = None
    ) -> Tensor:
        r"""Signed coverage error of the calibrated regions on new pairs, over all levels.

        The area between their coverage curve (share of ``theta`` inside the calibrated
        region at each nominal level) and the diagonal
        (:func:`~calib_lightning.functional.conformal_coverage_error`): comparable with the
        ``coverage_error`` of :class:`~calib_lightning.RankCalibration`; negative =
        over-confident. The guarantee keeps it at or above 0 up to sampling noise.

        Arguments:
            theta: new true parameters ``(N, D)``, never used to fit the region.
            x: their observations ``(N, *X)``.
            credibility: their credibilities from :meth:`credibility` (non-randomized,
                ``(N,)``), to skip the draws (e.g. a local and a global region of the same
                posterior and ``num_posterior_samples``; ``conformity="credibility"``).

        Returns:
            ``()`` float64.
        """
        scores, samples, ell_samples = self._fitted(), None, None
        if self._raw:
            if credibility is not None:
                raise ValueError("credibility= needs conformity='credibility', got log_density")
            theta, x = check_points(theta, x)
            new = negative_log_prob(self.posterior, theta, x)
        elif credibility is None:  # the same draws for the scores and the tree's features
            samples, ell_samples, ell_theta = self._statistics(theta, x)
            new = self._credibility(ell_samples, ell_theta, False).double().cpu()
        elif credibility.shape != (len(x),):
            raise ValueError(
                f"credibility must have shape (N,) = ({len(x)},), got {tuple(credibility.shape)}"
            )
        else:
            new = credibility.double().cpu()
        if not self.local:
            return conformal_coverage_error(scores, new)
        features = self._features(x, samples, ell_samples)
        if self.partition == "regression":  # a global quantile of the normalized residuals
            mu, sigma = self._location_scale(features)
            return conformal_coverage_error(self._residuals, (new - mu) / sigma)
        return conformal_coverage_error(scores, new, self.leaves, self._leaf_of(features))

    def threshold(self, x: Tensor, level: float = 0.9, *, calibrated: bool = True) -> Tensor:
        r"""Log-density threshold of the region at each ``x``: the region is
        :math:`\{\theta : \log q(\theta \mid x) \ge t(x)\}` (``score="density"``).

        Arguments:
            x: observations ``(N, *X)``.
            level: nominal coverage.
            calibrated: the calibrated region (``False``: the posterior's own HPD region at
                the nominal level, estimated with the same draws).

        Returns:
            ``(N,)`` on ``x``'s device; ``-inf`` where the region is everything.
        """
        if self.score != "density":
            raise ValueError(
                "threshold needs score='density'; a distance-score region has no fixed "
                "log-density contour (use contains)"
            )
        _check_probability("level", level)
        if self._raw and calibrated:  # the calibrated score itself
            return -self._quantile(level, x).to(x.device)
        samples, ell = self._draws_log_prob(x)
        target = (
            self._level(level, x if self.local else None, samples, ell) if calibrated else level
        )
        return density_threshold(ell, target).to(x.device)
