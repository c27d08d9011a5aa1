"""How a :class:`~calib_lightning.recalibration.ConformalRegion` adapts its level over x.

:class:`TreePartition` holds the region's local model on features of ``x`` (``x`` itself, a
given embedding, or the posterior summary of
:func:`~calib_lightning.recalibration._draw_stats.posterior_summary`) and turns the held-out
scores into a calibrated score per ``x``:

* ``"tree"`` (LOCART): a regression tree of the scores, the map from features to the index
  of their leaf, and the conformal quantile of the held-out scores of each leaf;
* ``"regression"`` (normalized split conformal): a linear regression of the scores on the
  features (location ``mu``) and one of the absolute residuals (scale ``sigma``, floored at a
  twentieth of their mean); the conformal quantile ``tau`` of the held-out normalized
  residuals ``(s - mu) / sigma`` gives ``mu + tau sigma`` at each ``x``;
* a global region: the conformal quantile of all held-out scores.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from calib_lightning import evaluation
from calib_lightning._utils.validation import check_probability
from calib_lightning.functional.conformal import conformal_quantile, leaf_quantiles, min_pairs
from calib_lightning.recalibration._draw_stats import posterior_summary

__all__ = ["TreePartition"]


class TreePartition:
    """Mixin of ``ConformalRegion``: its tree's features, growth and leaves, and the
    calibrated score per cell (it reads the region's ``posterior``, ``score``,
    ``embedding``, ``min_leaf_size``, ``seed``, ``scores``, ``leaves``)."""

    tree: Any
    _leaf_index: dict[int, int]
    scores: Tensor | None
    conformity: str
    partition: str | None  # "tree", "regression", or None (global)
    _residuals: Tensor | None  # regression: the calibration pairs' normalized residuals

    @property
    def _raw(self) -> bool:
        """Whether the scores are log-densities (``conformity="log_density"``)."""
        return self.conformity == "log_density"

    def _fitted(self) -> Tensor:
        if self.scores is None:
            raise ValueError("ConformalRegion is not fitted: call fit(theta_val, x_val) first")
        return self.scores

    def _quantile(
        self,
        level: float,
        x: Tensor | None,
        samples: Tensor | None = None,
        ell: Tensor | None = None,
    ) -> Tensor:
        """The calibrated score: global ``()`` without ``x``, else one per row of ``x``."""
        scores = self._fitted()
        check_probability("level", level)
        if not self.local:
            value = conformal_quantile(scores, level)
            return value if x is None else value.expand(len(x))
        if x is None:
            raise ValueError("a local ConformalRegion needs x (N, *X) to give its levels")
        if self.partition == "tree" and self.min_leaf_size < min_pairs(level):
            raise ValueError(
                f"level {level} needs at least {min_pairs(level)} pairs per leaf, got "
                f"min_leaf_size = {self.min_leaf_size}"
            )
        features = self._features(x, samples, ell)
        if self.partition == "regression":
            mu, sigma = self._location_scale(features)
            value = mu + conformal_quantile(self._residuals, level) * sigma
            return value if self._raw else value.clamp(max=1.0)  # (a credibility: <= 1)
        per_leaf, _ = leaf_quantiles(
            scores, self.leaves, len(self._leaf_index), level, fill=math.inf if self._raw else 1.0
        )
        return per_leaf[self._leaf_of(features)]

    def _level(
        self,
        level: float,
        x: Tensor | None,
        samples: Tensor | None = None,
        ell: Tensor | None = None,
    ) -> Tensor:
        """The calibrated credibility at ``x`` (log-density: its region's share of draws)."""
        if not self._raw:
            return self._quantile(level, x, samples, ell)
        self._fitted()
        if x is None:
            raise ValueError("conformity='log_density' needs x (N, *X): one level per x")
        if ell is None:
            samples, ell = self._draws_log_prob(x)
        t = self._quantile(level, x, samples, ell).to(ell)
        inside = (-ell <= t).sum(0).double().cpu()  # draws (S, N) in {log q >= -t}
        return (inside + 1) / (ell.shape[0] + 1)

    def _draws_log_prob(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """The region's (seeded) draws at ``x`` ``(S, N, D)`` and their log-densities."""
        samples = self._draws(x)
        with torch.no_grad():
            return samples, self.posterior.log_prob(samples, x)

    def _features(self, x: Tensor, samples: Tensor | None = None, ell: Tensor | None = None) -> Any:
        """The tree's features at ``x`` (``"posterior"``: from given draws and statistics)."""
        if not self._summary:
            return evaluation.embed(self.embedding, x).detach().cpu().double().numpy()
        samples = self._draws(x) if samples is None else samples
        dense = self.score == "density"
        if dense and ell is None:
            with torch.no_grad():
                ell = self.posterior.log_prob(samples, x)
        return posterior_summary(samples, ell if dense else None).numpy()

    def _grow(self, features: Any, scores: Tensor) -> None:
        """The local model of ``scores`` on ``features``: the tree and its leaves' indices,
        or the location and scale regressions."""
        if self.partition == "regression":
            from sklearn.linear_model import LinearRegression

            target = scores.numpy()
            location = LinearRegression().fit(features, target)
            spread = abs(target - location.predict(features))
            scale = LinearRegression().fit(features, spread)
            self.tree, self._leaf_index = (location, scale, 0.05 * float(spread.mean())), {}
            return
        from sklearn.tree import DecisionTreeRegressor

        tree = DecisionTreeRegressor(min_samples_leaf=self.min_leaf_size, random_state=self.seed)
        tree.fit(features, scores.numpy())
        nodes = sorted(set(tree.apply(features).tolist()))
        self.tree, self._leaf_index = tree, {node: i for i, node in enumerate(nodes)}

    def _location_scale(self, features: Any) -> tuple[Tensor, Tensor]:
        """The regression's location and (floored, positive) scale at ``features``."""
        location, scale, floor = self.tree
        mu = torch.from_numpy(location.predict(features)).double()
        sigma = torch.from_numpy(scale.predict(features)).double().clamp(min=max(floor, 1e-12))
        return mu, sigma

    def _calibrate(self, features: Any, scores: Tensor) -> None:
        """Keep the calibration pairs' scores and their leaves, or normalized residuals."""
        self.scores, self.leaves, self._residuals = scores, None, None
        if self.partition == "regression":
            mu, sigma = self._location_scale(features)
            self._residuals = (scores - mu) / sigma
        else:
            self.leaves = self._leaf_of(features)

    def _leaf_of(self, features: Any) -> Tensor:
        nodes = self.tree.apply(features).tolist()
        return torch.tensor([self._leaf_index[node] for node in nodes], dtype=torch.long)
