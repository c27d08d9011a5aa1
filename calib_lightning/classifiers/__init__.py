r"""Probabilistic binary classifiers for two-sample tests, many trained at once.

A classifier two-sample test needs many classifiers trained the same way: a few for
the statistic and a hundred more for its null distribution. :class:`MLPEnsemble`
trains ``K`` independent multilayer perceptrons as one network whose every weight has
a leading ``K`` dimension (batched matrix products), with per-member input
standardization, mini-batch Adam and early stopping on a held-out split. Member ``k``
is the classifier one gets by training it alone with seed ``seed + k`` (up to float
rounding): same initialisation, same split, same batches in the same order.

:class:`SklearnEnsemble` puts any scikit-learn classifier with ``predict_proba``
behind the same interface (one fit per member); :func:`sbibm_mlp` builds the reference
network of the L-C2ST paper, scikit-learn's ``MLPClassifier`` with sbibm's settings.

Both share one interface:

* ``num_members``: ``K``;
* ``fit(features, labels)``: ``features`` is a tensor or a sequence of blocks joined
  along the last axis, each block ``(M, F_b)`` (shared by all members, never copied
  ``K`` times) or ``(K, M, F_b)`` (one dataset per member); ``labels`` in ``{0, 1}``
  of shape ``(M,)`` or ``(K, M)``;
* ``predict_proba(features) -> (K, N)``: :math:`P(\text{class } 1 \mid \text{features})`
  for each member, with ``features`` laid out as in ``fit``.

Example:
    >>> import torch
    >>> g = torch.Generator().manual_seed(0)
    >>> features = torch.randn(400, 2, generator=g)
    >>> labels = (features[:, 0] > 0).float()
    >>> ensemble = MLPEnsemble(num_members=3, batch_size=32).fit(features, labels)
    >>> proba = ensemble.predict_proba(torch.tensor([[2.0, 0.0], [-2.0, 0.0]]))
    >>> proba.shape, bool((proba[:, 0] > 0.99).all()), bool((proba[:, 1] < 0.01).all())
    (torch.Size([3, 2]), True, True)

References:
    Lopez-Paz, Oquab. "Revisiting Classifier Two-Sample Tests." ICLR 2017.

    Lueckmann, Boelts, Greenberg, Goncalves, Macke. "Benchmarking Simulation-Based
    Inference." AISTATS 2021 (sbibm's C2ST classifier).
"""

from __future__ import annotations

from typing import Any

from calib_lightning.classifiers.mlp import MLPEnsemble
from calib_lightning.classifiers.sklearn_ensemble import SklearnEnsemble, sbibm_mlp

__all__ = ["MLPEnsemble", "SklearnEnsemble", "make_ensemble", "sbibm_mlp"]


def make_ensemble(
    classifier: str | Any = "mlp", num_members: int = 1, seed: int = 0, **kwargs: Any
) -> MLPEnsemble | SklearnEnsemble:
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
