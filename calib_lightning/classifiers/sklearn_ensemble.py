"""scikit-learn classifiers behind the ensemble interface: the paper's reference path.

References:
    Lueckmann, Boelts, Greenberg, Goncalves, Macke. "Benchmarking Simulation-Based
    Inference." AISTATS 2021 (sbibm's C2ST classifier, used by the L-C2ST paper).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from calib_lightning._utils.validation import check_positive
from calib_lightning.classifiers._blocks import Features, as_blocks, as_labels, standardize

__all__ = ["SklearnEnsemble", "sbibm_mlp"]


def sbibm_mlp(in_features: int, seed: int = 0) -> Any:
    """scikit-learn ``MLPClassifier`` with sbibm's C2ST settings, as in the L-C2ST paper.

    Two ReLU hidden layers of ``10 * in_features`` units, Adam, ``max_iter=10000``,
    scikit-learn's defaults otherwise (no early stopping; stop when the training loss
    stalls for 10 epochs).

    Arguments:
        in_features: number of classifier inputs ``F``.
        seed: ``random_state``.
    """
    from sklearn.neural_network import MLPClassifier

    check_positive("in_features", in_features, integer=True)
    width = 10 * in_features
    return MLPClassifier(
        activation="relu",
        hidden_layer_sizes=(width, width),
        max_iter=10000,
        solver="adam",
        random_state=seed,
    )


def _member_features(blocks: list[Tensor], k: int) -> Tensor:
    """Member ``k``'s rows ``(M, F)``: shared blocks as they are, per-member blocks at ``k``."""
    return torch.cat([b if b.ndim == 2 else b[k] for b in blocks], -1)


class SklearnEnsemble:
    """``K`` scikit-learn classifiers behind the :class:`MLPEnsemble` interface.

    Each member is a fresh clone of ``estimator`` (its ``random_state`` set to
    ``seed + k`` when it has one), fitted on its own standardized rows. This is the
    slow reference path: one fit per member, in a Python loop.

    Arguments:
        estimator: an unfitted scikit-learn classifier with ``predict_proba``, or a
            callable ``(in_features, seed) -> estimator`` such as :func:`sbibm_mlp`.
        num_members: ``K``.
        seed: base seed of the members.
    """

    def __init__(
        self, estimator: Any | Callable[[int, int], Any], num_members: int = 1, seed: int = 0
    ) -> None:
        check_positive("num_members", num_members, integer=True)
        if not callable(estimator) and not hasattr(estimator, "predict_proba"):
            raise ValueError(
                "estimator must be a scikit-learn classifier with predict_proba or a callable "
                f"(in_features, seed) -> classifier, got {type(estimator).__name__}"
            )
        self.estimator, self.num_members, self.seed = estimator, num_members, seed
        self.members: list[Any] = []
        self.loc = self.scale = torch.empty(0)

    @property
    def fitted(self) -> bool:
        return len(self.members) == self.num_members

    def _member(self, k: int, in_features: int) -> Any:
        if hasattr(self.estimator, "predict_proba"):
            from sklearn.base import clone

            model = clone(self.estimator)
            if "random_state" in model.get_params():
                model.set_params(random_state=self.seed + k)
            return model
        return self.estimator(in_features, self.seed + k)

    def fit(self, features: Features, labels: Tensor) -> SklearnEnsemble:
        """Fit every member on its rows (``features`` and ``labels`` as in :class:`MLPEnsemble`)."""
        blocks = as_blocks(features, self.num_members)
        labels = as_labels(labels, self.num_members, blocks[0].shape[-2])
        blocks, self.loc, self.scale = standardize(blocks, self.num_members)
        self.members = []
        for k in range(self.num_members):
            x = _member_features(blocks, k)
            y = labels if labels.ndim == 1 else labels[k]
            model = self._member(k, x.shape[-1])
            model.fit(x.detach().cpu().double().numpy(), y.detach().cpu().numpy().astype(int))
            self.members.append(model)
        return self

    def predict_proba(self, features: Features) -> Tensor:
        r"""Probabilities :math:`P(\text{class } 1)` of every member: ``(K, N)``."""
        if not self.fitted:
            raise ValueError("SklearnEnsemble.predict_proba needs a fitted ensemble; call fit")
        blocks = as_blocks(features, self.num_members)
        dtype, device = blocks[0].dtype, blocks[0].device
        out = []
        for k, model in enumerate(self.members):
            x = _member_features(blocks, k)
            x = ((x - self.loc[k].to(x)) / self.scale[k].to(x)).detach().cpu().double().numpy()
            column = list(model.classes_).index(1)
            out.append(torch.from_numpy(model.predict_proba(x)[:, column]))
        return torch.stack(out).to(device=device, dtype=dtype)
