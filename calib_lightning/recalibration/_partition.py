"""The cells of a :class:`~calib_lightning.recalibration.ConformalRegion` and their levels.

:class:`TreePartition` is the region's partition of the observations (LOCART): a regression
tree of the held-out scores on features of ``x`` (``x`` itself, a given embedding, or the
posterior summary of :func:`~calib_lightning.recalibration._draw_stats.posterior_summary`),
the map from features to the index of their leaf, and the conformal quantile of the
held-out scores of each leaf (of all of them for a global region).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from calib_lightning import evaluation
from calib_lightning._checks import check_probability
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

    @property
    def _raw(self) -> bool:
        """Whether the scores are log-densities (``conformity="log_density"``)."""
        return self.conformity == "log_density"

    def _fitted(self) -> Tensor:
        if self.scores is None:
            raise ValueError("ConformalRegion is not fitted: call fit(theta_val, x_val) first")
        return self.scores

    def _quantile(self, level: float, x: Tensor | None, samples: Tensor | None = None,
                  ell: Tensor | None = None) -> Tensor:  # fmt: skip
        """The calibrated score: global ``()`` without ``x``, else one per row of ``x``."""
        scores = self._fitted()
        check_probability("level", level)
        if not self.local:
            value = conformal_quantile(scores, level)
            return value if x is None else value.expand(len(x))
        if x is None:
            raise ValueError("a local ConformalRegion needs x (N, *X) to give its levels")
        if self.min_leaf_size < min_pairs(level):
            raise ValueError(
                f"level {level} needs at least {min_pairs(level)} pairs per leaf, got "
                f"min_leaf_size = {self.min_leaf_size}"
            )
        per_leaf, _ = leaf_quantiles(scores, self.leaves, len(self._leaf_index), level,
                                     fill=math.inf if self._raw else 1.0)  # fmt: skip
        return per_leaf[self._leaf_of(self._features(x, samples, ell))]

    def _draws_log_prob(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """The region's (seeded) draws at ``x`` ``(S, N, D)`` and their log-densities."""
        samples = self._draws(x)
        with torch.no_grad():
            return samples, self.posterior.log_prob(samples, x)

    def _features(
        self, x: Tensor, samples: Tensor | None = None, ell: Tensor | None = None
    ) -> Any:
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
        """The regression tree of ``scores`` on ``features``, and its leaves' indices."""
        from sklearn.tree import DecisionTreeRegressor

        tree = DecisionTreeRegressor(min_samples_leaf=self.min_leaf_size, random_state=self.seed)
        tree.fit(features, scores.numpy())
        nodes = sorted(set(tree.apply(features).tolist()))
        self.tree, self._leaf_index = tree, {node: i for i, node in enumerate(nodes)}

    def _leaf_of(self, features: Any) -> Tensor:
        nodes = self.tree.apply(features).tolist()
        return torch.tensor([self._leaf_index[node] for node in nodes], dtype=torch.long)
