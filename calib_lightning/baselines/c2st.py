r"""Oracle C2ST: classifier two-sample test between estimator and true posterior samples.

Needs samples of the true posterior at :math:`x_o`, so it serves benchmarks only (the
reference L-C2ST is compared with). Reports the held-out (balanced) accuracy of a
classifier separating the two samples (0.5 when they are indistinguishable) and the
regression statistic :math:`\mathrm{mean}\,(d - \frac12)^2` of Kim et al.

References:
    Lopez-Paz, Oquab. "Revisiting Classifier Two-Sample Tests." ICLR 2017.

    Kim, Lee, Lei. "Global and local two-sample tests via regression." Electronic
    Journal of Statistics, 2019.

    Linhart, Gramfort, Rodrigues. "L-C2ST: Local Diagnostics for Posterior
    Approximations in Simulation-Based Inference." NeurIPS 2023, section 2.1.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor

from calib_lightning._utils.validation import check_points, check_positive
from calib_lightning.classifiers import make_ensemble

__all__ = ["CONVERGED_MLP", "OracleC2ST", "oracle_c2st"]

#: :class:`~calib_lightning.classifiers.MLPEnsemble` settings of the oracle: scikit-learn's
#: ``MLPClassifier`` as sbibm's ``c2st`` configures it (Adam at 1e-3, mini-batches of 200,
#: L2 penalty ``alpha = 1e-4`` per batch, up to 10,000 epochs, stop when the training loss
#: has not fallen by ``tol = 1e-4`` for 10 epochs); the hidden layers, two of ``10 * D``
#: units, are set from the data.
CONVERGED_MLP: dict[str, Any] = {
    "learning_rate": 1e-3,
    "batch_size": 200,
    "max_epochs": 10_000,
    "patience": 10,
    "validation_fraction": 0.0,
    "tol": 1e-4,
    "weight_decay": 1e-4 / 200,
}


class OracleC2ST(NamedTuple):
    r"""Result of :func:`oracle_c2st`, each field of shape ``(*)`` (the batch shape).

    Attributes:
        accuracy: held-out balanced accuracy, 0.5 when the samples are indistinguishable.
        statistic: held-out balanced :math:`(d - \pi)^2`, 0 when they are.
    """

    accuracy: Tensor
    statistic: Tensor


def oracle_c2st(
    estimator_samples: Tensor,
    reference_samples: Tensor,
    *,
    num_folds: int = 5,
    classifier: str | Any = "sklearn",
    seed: int = 1,
    **classifier_kwargs: Any,
) -> OracleC2ST:
    r"""Oracle C2ST between estimator samples and true posterior samples (benchmarks only).

    By default (``classifier="sklearn"``) this is the field's standard, sbibm 1.1.0's
    ``c2st(reference_samples, estimator_samples, seed=seed)``: both samples are z-scored
    with the reference's mean and standard deviation, the reference is class 0 and the
    estimator class 1, and scikit-learn's ``MLPClassifier`` (two ReLU layers of
    ``10 * D`` units, Adam, ``max_iter=10000``, ``random_state=seed``) is scored on the
    folds of ``KFold(num_folds, shuffle=True, random_state=seed)``, one batch element and
    one fold at a time. The accuracy is the mean held-out accuracy of ``predict``, as
    sbibm reports it (at the same seed, the same number); for ``M != M'`` it is the
    class-balanced accuracy below instead.

    With any other ``classifier``, ``num_folds``-fold cross-validated classifiers (all
    folds of all batches in one ensemble fit) separate estimator samples (class 0) from
    reference samples (class 1). Folds are stratified: each holds out
    :math:`\lfloor M / F \rfloor` rows of class 0 and :math:`\lfloor M' / F \rfloor` of
    class 1 (leftover rows are not used).

    With :math:`\pi` the share of the second class in a fold's training rows, the
    held-out scores are class-balanced,

    .. math::
        \mathrm{acc} = \tfrac12 \big(P_0(d \le \pi) + P_1(d > \pi)\big), \qquad
        T = \tfrac12 \big(E_0 (d - \pi)^2 + E_1 (d - \pi)^2\big),

    so that both are 0.5 and 0 in expectation when the samples are indistinguishable,
    whatever their sizes (plain accuracy would reward predicting the larger class).
    :math:`d > \pi` is the Bayes rule for the balanced accuracy; for ``M = M'`` and
    stratified folds these are the usual accuracy at threshold 1/2 and
    :math:`\mathrm{mean}\,(d - \frac12)^2`.

    Arguments:
        estimator_samples: :math:`\theta \sim q(\cdot \mid x_o)`, shape ``(*, M, D)``.
        reference_samples: :math:`\theta \sim p(\cdot \mid x_o)`, shape ``(*, M', D)``.
        num_folds: cross-validation folds ``F``; ``M`` and ``M'`` must be at least ``F``.
        classifier: ``"sklearn"`` (default): sbibm's ``c2st`` protocol above (needs
            scikit-learn; seconds per call). Else as in
            :func:`calib_lightning.classifiers.make_ensemble`, in stratified folds:
            ``"mlp"`` trains :class:`~calib_lightning.classifiers.MLPEnsemble` members
            like scikit-learn's ``MLPClassifier`` (two ReLU layers of ``10 * D`` units,
            :data:`CONVERGED_MLP`), all folds in one batched fit (its accuracy differs
            from sbibm's by the training noise of either); ``"sbibm"`` fits
            scikit-learn's own, one fold at a time.
        seed: seeds the folds and the classifiers; sbibm's default is 1.
        classifier_kwargs: :class:`~calib_lightning.classifiers.MLPEnsemble` settings,
            over :data:`CONVERGED_MLP` and the ``10 * D`` hidden layers (``"mlp"`` only).

    Returns:
        :class:`OracleC2ST`: ``accuracy`` (held-out accuracy, 0.5 when the samples are
        indistinguishable) and ``statistic`` (held-out balanced :math:`(d - \pi)^2`),
        each of shape ``(*)``.

    References:
        Lueckmann, Boelts, Greenberg, Goncalves, Macke. "Benchmarking Simulation-Based
        Inference." AISTATS 2021 (sbibm's ``c2st``).

        Brodersen, Ong, Stephan, Buhmann. "The balanced accuracy and its posterior
        distribution." ICPR 2010.
    """
    check_points("estimator_samples", estimator_samples)
    check_points("reference_samples", reference_samples, columns=estimator_samples.shape[-1])
    if reference_samples.shape[:-2] != estimator_samples.shape[:-2]:
        raise ValueError(
            "estimator_samples and reference_samples must have shapes (*, M, D) and (*, M', D) "
            f"with equal batch shapes, got {tuple(estimator_samples.shape)} and "
            f"{tuple(reference_samples.shape)}"
        )
    check_positive("num_folds", num_folds, integer=True)
    if num_folds < 2:
        raise ValueError(f"num_folds must be >= 2, got {num_folds}")
    sizes = (estimator_samples.shape[-2], reference_samples.shape[-2])
    if min(sizes) < num_folds:
        raise ValueError(
            f"estimator_samples and reference_samples must each have at least num_folds = "
            f"{num_folds} rows (M, M'), got M = {sizes[0]} and M' = {sizes[1]}"
        )
    batch = estimator_samples.shape[:-2]
    if isinstance(classifier, str) and classifier == "sklearn":
        if classifier_kwargs:
            raise ValueError(
                f"classifier_kwargs apply to classifier='mlp' only, got "
                f"{sorted(classifier_kwargs)} with classifier='sklearn'"
            )
        return _sbibm_protocol(estimator_samples, reference_samples, num_folds, seed)
    data = torch.cat(
        [
            estimator_samples.reshape(-1, *estimator_samples.shape[-2:]),
            reference_samples.reshape(-1, *reference_samples.shape[-2:]).to(estimator_samples),
        ],
        1,
    )
    num_batch, device = data.shape[0], data.device
    labels = torch.cat([data.new_zeros(sizes[0]), data.new_ones(sizes[1])])
    generator = torch.Generator().manual_seed(seed)
    folds = []  # per class: (num_batch, num_folds, rows per fold) indices into the rows
    for offset, size in ((0, sizes[0]), (sizes[0], sizes[1])):
        fold = size // num_folds
        order = torch.stack([torch.randperm(size, generator=generator) for _ in range(num_batch)])
        folds.append(offset + order[:, : fold * num_folds].reshape(num_batch, num_folds, fold))
    order = torch.cat(folds, -1).to(device)  # (num_batch, num_folds, held-out rows)
    held = order.reshape(-1, order.shape[-1])  # member (b, f) holds out fold f of batch b
    train = torch.stack(
        [
            torch.cat([order[b, g] for g in range(num_folds) if g != f])
            for b in range(num_batch)
            for f in range(num_folds)
        ]
    )
    source = torch.arange(num_batch, device=device).repeat_interleave(num_folds)
    if isinstance(classifier, str) and classifier == "mlp":
        width = 10 * data.shape[-1]
        settings = {"hidden_features": (width, width), **CONVERGED_MLP}
        classifier_kwargs = {**settings, **classifier_kwargs}
    ensemble = make_ensemble(classifier, num_batch * num_folds, seed, **classifier_kwargs)
    ensemble.fit(data[source[:, None], train], labels[train])
    proba = ensemble.predict_proba(data[source[:, None], held])
    truth = labels[held]
    share = labels[train[0]].mean()  # pi: the class-1 share of every member's training rows
    correct = ((proba > share).to(truth) == truth).to(data.dtype)
    squares = (proba - share).square()

    shape = (*batch, num_folds)
    return OracleC2ST(
        accuracy=_balanced(correct, truth).reshape(shape).mean(-1),
        statistic=_balanced(squares, truth).reshape(shape).mean(-1),
    )


def _balanced(values: Tensor, truth: Tensor) -> Tensor:
    """Class-balanced mean of ``values`` over the last axis, classes ``truth`` in {0, 1}."""
    ones = truth.to(values.dtype)
    zeros = 1 - ones
    return 0.5 * ((values * zeros).sum(-1) / zeros.sum(-1) + (values * ones).sum(-1) / ones.sum(-1))


def _sbibm_protocol(estimator: Tensor, reference: Tensor, num_folds: int, seed: int) -> OracleC2ST:
    """sbibm 1.1.0's ``c2st`` configuration of scikit-learn, per batch element and fold."""
    import numpy as np
    from sklearn.model_selection import KFold
    from sklearn.neural_network import MLPClassifier

    batch, dim = estimator.shape[:-2], estimator.shape[-1]
    estimator = estimator.reshape(-1, *estimator.shape[-2:])
    reference = reference.reshape(-1, *reference.shape[-2:]).to(estimator)
    equal = estimator.shape[-2] == reference.shape[-2]
    target = np.concatenate([np.zeros(reference.shape[-2]), np.ones(estimator.shape[-2])])
    accuracy, statistic = [], []
    for first, second in zip(reference, estimator, strict=True):
        mean, std = first.mean(0), first.std(0)  # z-scored on the reference, as sbibm
        data = torch.cat([(first - mean) / std, (second - mean) / std]).detach().cpu().numpy()
        folds = KFold(n_splits=num_folds, shuffle=True, random_state=seed)
        scores = []
        for train, held in folds.split(data):
            model = MLPClassifier(
                activation="relu",
                hidden_layer_sizes=(10 * dim, 10 * dim),
                max_iter=10000,
                solver="adam",
                random_state=seed,
            )
            model.fit(data[train], target[train])
            proba = torch.from_numpy(model.predict_proba(data[held])[:, 1]).double()
            truth = torch.from_numpy(target[held])
            share = float(target[train].mean())
            if equal:  # sbibm's score: plain accuracy of predict
                correct = float((model.predict(data[held]) == target[held]).mean())
            else:
                correct = float(_balanced(((proba > share).double() == truth).double(), truth))
            scores.append((correct, float(_balanced((proba - share).square(), truth))))
        accuracy.append(sum(a for a, _ in scores) / num_folds)
        statistic.append(sum(t for _, t in scores) / num_folds)
    options = {"dtype": estimator.dtype, "device": estimator.device}
    return OracleC2ST(
        accuracy=torch.tensor(accuracy, **options).reshape(batch),
        statistic=torch.tensor(statistic, **options).reshape(batch),
    )
