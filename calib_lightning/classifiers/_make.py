"""Build an ensemble of classifiers from a short specification."""

from __future__ import annotations

from typing import Any

from calib_lightning.classifiers.mlp import MLPEnsemble
from calib_lightning.classifiers.sklearn_ensemble import SklearnEnsemble, sbibm_mlp

__all__ = ["Ensemble", "make_ensemble"]

Ensemble = MLPEnsemble | SklearnEnsemble


def make_ensemble(
    classifier: str | Any = "mlp", num_members: int = 1, seed: int = 0, **kwargs: Any
) -> Ensemble:
    """Build ``num_members`` classifiers from a short specification.

    Arguments:
        classifier: ``"mlp"`` (:class:`MLPEnsemble`, the fast default), ``"sbibm"``
            (:func:`sbibm_mlp` members, the paper's reference), or an unfitted scikit-learn
            classifier with ``predict_proba``.
        num_members: ``K``.
        seed: base seed.
        kwargs: :class:`MLPEnsemble` hyperparameters (only with ``"mlp"``).
    """
    if isinstance(classifier, str):
        if classifier == "mlp":
            return MLPEnsemble(num_members, seed=seed, **kwargs)
        if classifier == "sbibm" and not kwargs:
            return SklearnEnsemble(sbibm_mlp, num_members, seed)
    elif hasattr(classifier, "predict_proba") and not kwargs:
        return SklearnEnsemble(classifier, num_members, seed)
    if kwargs:
        raise ValueError(
            f"classifier_kwargs apply to classifier='mlp' only, got {sorted(kwargs)} with "
            f"classifier={classifier!r:.60}"
        )
    raise ValueError(
        "classifier must be 'mlp', 'sbibm' or a scikit-learn classifier with predict_proba, "
        f"got {classifier!r:.60}"
    )
