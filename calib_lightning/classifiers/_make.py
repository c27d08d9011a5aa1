"""Build an ensemble of classifiers from a short specification."""

from __future__ import annotations

from typing import Any

from calib_lightning.classifiers.mlp import MLPEnsemble
from calib_lightning.classifiers.sklearn_ensemble import SklearnEnsemble, sbibm_mlp

__all__ = [
    "LOCAL_TEST_SETTINGS",
    "NUM_EVALUATION_POINTS",
    "Ensemble",
    "local_test_kwargs",
    "make_ensemble",
]

Ensemble = MLPEnsemble | SklearnEnsemble

#: :class:`MLPEnsemble` settings of the L-C2ST and L-C2ST-NF classifiers (null and observed
#: alike) under the user's ``classifier_kwargs``: early stopping after 2 epochs without
#: improvement (3 elsewhere) and hidden layers of ``min(10 * F, 96)`` units (128
#: elsewhere). On sbibm's reference posteriors (four tasks, 16 estimators, 4,000
#: calibration pairs, three classifier seeds), with 2,000 evaluation points, they rejected
#: 393 of the 414 clearly wrong posteriors against 397 with patience 3, 128 units and
#: 10,000 points, with a null 2.8 times faster; the loss is on Gaussian Linear Uniform at
#: 10,000 simulations, whose errors are small (10 of 30 against 16; the width: patience 2
#: alone found 18) (``examples/benchmarks/results/lc2st_training_4000_speed.md``).
LOCAL_TEST_SETTINGS: dict[str, Any] = {"patience": 2, "max_width": 96}
#: evaluation points per observation of the local tests (``num_posterior_samples``): the
#: statistic's Monte Carlo error there is small next to its null spread; on those sbibm
#: cases 10,000 points (sbi's default) found as many wrong posteriors (397 of 414 against
#: 399) at 1.5 times the null's cost
NUM_EVALUATION_POINTS = 2_000


def local_test_kwargs(classifier: str | Any, kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """The classifier settings of a local test: :data:`LOCAL_TEST_SETTINGS` under
    ``kwargs`` for ``"mlp"``, ``kwargs`` alone for any other classifier."""
    kwargs = dict(kwargs or {})
    mlp = isinstance(classifier, str) and classifier == "mlp"
    return {**LOCAL_TEST_SETTINGS, **kwargs} if mlp else kwargs


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
