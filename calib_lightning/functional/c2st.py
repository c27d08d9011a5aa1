r"""Oracle C2ST: classifier two-sample test between estimator and true posterior samples.

Needs samples of the true posterior at :math:`x_o`, so it serves benchmarks only (the
reference L-C2ST is compared with). Reports the held-out accuracy of a classifier
separating the two samples (0.5 when they are indistinguishable) and the regression
statistic :math:`\mathrm{mean}\,(d - \frac12)^2` of Kim et al.

References:
    Lopez-Paz, Oquab. "Revisiting Classifier Two-Sample Tests." ICLR 2017.

    Kim, Lee, Lei. "Global and local two-sample tests via regression." Electronic
    Journal of Statistics, 2019.

    Linhart, Gramfort, Rodrigues. "L-C2ST: Local Diagnostics for Posterior
    Approximations in Simulation-Based Inference." NeurIPS 2023, section 2.1.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from calib_lightning._checks import check_points, check_positive
from calib_lightning.classifiers import make_ensemble
from calib_lightning.functional.lc2st import lc2st_statistic

__all__ = ["oracle_c2st"]


def oracle_c2st(
    estimator_samples: Tensor,
    reference_samples: Tensor,
    *,
    num_folds: int = 5,
    classifier: str | Any = "mlp",
    seed: int = 0,
    **classifier_kwargs: Any,
) -> dict[str, Tensor]:
    r"""Oracle C2ST between estimator samples and true posterior samples (benchmarks only).

    ``num_folds``-fold cross-validated classifiers (all folds of all batches in one
    ensemble fit) separate estimator samples (class 0) from reference samples (class 1).

    Arguments:
        estimator_samples: :math:`\theta \sim q(\cdot \mid x_o)`, shape ``(*, M, D)``.
        reference_samples: :math:`\theta \sim p(\cdot \mid x_o)`, shape ``(*, M', D)``.
        num_folds: cross-validation folds.
        classifier: as in :func:`calib_lightning.classifiers.make_ensemble`.
        seed: seeds the folds and the classifiers.
        classifier_kwargs: :class:`~calib_lightning.classifiers.MLPEnsemble` settings.

    Returns:
        ``"accuracy"`` (held-out accuracy, 0.5 when the samples are indistinguishable) and
        ``"statistic"`` (held-out :math:`\mathrm{mean}\,(d - \frac12)^2` of both classes),
        each of shape ``(*)``.
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
    batch = estimator_samples.shape[:-2]
    data = torch.cat(
        [
            estimator_samples.reshape(-1, *estimator_samples.shape[-2:]),
            reference_samples.reshape(-1, *reference_samples.shape[-2:]).to(estimator_samples),
        ],
        1,
    )
    num_batch, rows = data.shape[0], data.shape[1]
    labels = torch.cat(
        [data.new_zeros(estimator_samples.shape[-2]), data.new_ones(reference_samples.shape[-2])]
    )
    fold = rows // num_folds
    if fold < 2:
        raise ValueError(
            f"estimator_samples and reference_samples must have at least 2 * num_folds = "
            f"{2 * num_folds} rows together (M + M'), got {rows}"
        )
    generator = torch.Generator().manual_seed(seed)
    order = torch.stack([torch.randperm(rows, generator=generator) for _ in range(num_batch)])
    order = order[:, : fold * num_folds].reshape(num_batch, num_folds, fold).to(data.device)
    held = order.reshape(-1, fold)  # member (b, f) holds out fold f of batch b
    train = torch.stack(
        [
            torch.cat([order[b, g] for g in range(num_folds) if g != f])
            for b in range(num_batch)
            for f in range(num_folds)
        ]
    )
    source = torch.arange(num_batch, device=data.device).repeat_interleave(num_folds)
    ensemble = make_ensemble(classifier, num_batch * num_folds, seed, **classifier_kwargs)
    ensemble.fit(data[source[:, None], train], labels[train])
    proba = ensemble.predict_proba(data[source[:, None], held])
    truth = labels[held]
    accuracy = ((proba > 0.5).to(truth) == truth).to(data.dtype).mean(-1)
    statistic = lc2st_statistic(proba)
    shape = (*batch, num_folds)
    return {
        "accuracy": accuracy.reshape(shape).mean(-1),
        "statistic": statistic.reshape(shape).mean(-1),
    }
