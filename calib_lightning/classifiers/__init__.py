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

from calib_lightning.classifiers._make import (
    LOCAL_TEST_SETTINGS,
    Ensemble,
    local_test_kwargs,
    make_ensemble,
)
from calib_lightning.classifiers.joint_c2st import (
    joint_c2st_folds,
    joint_c2st_test,
    joint_c2st_train,
)
from calib_lightning.classifiers.lc2st_null import LC2STNFNull
from calib_lightning.classifiers.local_c2st import (
    latent_features,
    lc2st_nf_null,
    lc2st_nf_train,
    lc2st_probabilities,
    lc2st_train,
)
from calib_lightning.classifiers.mlp import MLPEnsemble
from calib_lightning.classifiers.sklearn_ensemble import SklearnEnsemble, sbibm_mlp

__all__ = [
    "LOCAL_TEST_SETTINGS",
    "Ensemble",
    "LC2STNFNull",
    "MLPEnsemble",
    "SklearnEnsemble",
    "joint_c2st_folds",
    "joint_c2st_test",
    "joint_c2st_train",
    "latent_features",
    "lc2st_nf_null",
    "lc2st_nf_train",
    "lc2st_probabilities",
    "lc2st_train",
    "local_test_kwargs",
    "make_ensemble",
    "sbibm_mlp",
]
