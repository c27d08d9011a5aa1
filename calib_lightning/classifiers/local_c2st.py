r"""Training the classifiers of L-C2ST and L-C2ST-NF, and evaluating them at observations.

**L-C2ST.** From calibration pairs :math:`(\theta^*_i, x_i)` and one draw
:math:`\tilde\theta_i \sim q(\cdot \mid x_i)` per pair, a classifier learns
:math:`d(\theta, x) = P(\text{class } 1 \mid \theta, x)` with class 0
:math:`(\tilde\theta_i, x_i)` and class 1 :math:`(\theta^*_i, x_i)`
(:func:`lc2st_train`). Its null comes from classifiers trained on the same rows with
labels swapped at random within each pair :math:`i` (a permutation that leaves the
data's law unchanged under :math:`H_0`, so the test is exact), trained in the same fit.

**L-C2ST-NF.** For a flow :math:`\theta = T_\phi(z; x)`, class 1 becomes
:math:`z^*_i = T_\phi^{-1}(\theta^*_i; x_i)`, class 0 fresh :math:`z_i \sim N(0, I)` with the
same :math:`x_i` (:func:`lc2st_nf_train`). Under :math:`H_0`,
:math:`z^*_i \mid x_i \sim N(0, I)`: null classifiers see fresh normal draws in both
classes and depend only on the calibration :math:`x`'s (:func:`lc2st_nf_null`), so they
are trained once and reused for every posterior and every check
(:class:`~calib_lightning.classifiers.LC2STNFNull`). With ``norm_feature`` the classifiers
also see the latent's standardised squared norm :math:`(\lVert z \rVert^2 - D) /
\sqrt{2D}` (:func:`latent_features`): one feature map for both classes, in the null too,
so the null is unchanged, and a scale or tail error, which moves that norm, need not be
learnt from ``D`` coordinates.

:func:`lc2st_probabilities` evaluates the classifiers at the evaluation points of each
reference observation; the statistic and p-value are in
:mod:`calib_lightning.functional.lc2st`. The ``K`` members of one ensemble carry
datasets, null trials and ensemble members at once.

References:
    Linhart, Gramfort, Rodrigues. "L-C2ST: Local Diagnostics for Posterior
    Approximations in Simulation-Based Inference." NeurIPS 2023.
"""

from __future__ import annotations

import torch
from torch import Tensor

from calib_lightning._utils.validation import check_matrix, check_positive
from calib_lightning.classifiers._make import Ensemble

__all__ = [
    "latent_features",
    "lc2st_nf_null",
    "lc2st_nf_train",
    "lc2st_probabilities",
    "lc2st_train",
]


def _members_per_dataset(classifier: Ensemble, datasets: int, name: str) -> int:
    if classifier.num_members % datasets:
        raise ValueError(
            f"classifier.num_members must be a multiple of the {datasets} {name}, "
            f"got {classifier.num_members}"
        )
    return classifier.num_members // datasets


def _check_x(x: Tensor) -> Tensor:
    """Calibration observations ``(N, X)`` shared by all datasets, or ``(R, N, X)``."""
    if not isinstance(x, Tensor) or x.ndim not in (2, 3):
        got = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
        raise ValueError(f"x must have shape (N, X) or (R, N, X), got {got}")
    check_matrix("x", x.reshape(-1, x.shape[-1]))
    if x.shape[-2] < 2:
        raise ValueError(f"x must have at least N >= 2 rows, got shape {tuple(x.shape)}")
    return x


def _with_datasets(name: str, value: Tensor, x: Tensor) -> Tensor:
    """``(N, D)`` or ``(R, N, D)`` matching ``x``'s rows (and datasets), as ``(R, N, D)``."""
    if isinstance(value, Tensor) and value.ndim == 2:
        value = value.unsqueeze(0)
    if (
        not isinstance(value, Tensor)
        or value.ndim != 3
        or value.shape[1] != x.shape[-2]
        or (x.ndim == 3 and value.shape[0] != x.shape[0])
    ):
        datasets = f"R = {x.shape[0]}" if x.ndim == 3 else "any R"
        got = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
        raise ValueError(
            f"{name} must have shape (N, D) or (R, N, D) with N = {x.shape[-2]} (the rows of x) "
            f"and {datasets}, got {got}"
        )
    check_matrix(name, value.reshape(-1, value.shape[-1]))
    return value


def _paired_rows(x: Tensor, per_dataset: int) -> Tensor:
    """``x`` for rows ``[class 1; class 0]``: shared ``(2N, X)`` or per member ``(K, 2N, X)``."""
    if x.ndim == 2:
        return torch.cat([x, x])
    return torch.cat([x, x], 1).repeat_interleave(per_dataset, 0)


def latent_features(latent: Tensor, norm_feature: bool = False) -> Tensor:
    r"""The L-C2ST-NF classifiers' features of latents ``(..., D)``: the latents, and with
    ``norm_feature`` their standardised squared norm :math:`(\lVert z \rVert^2 - D) /
    \sqrt{2D}` as one more column (mean 0, variance 1 under :math:`N(0, I_D)`)."""
    if not norm_feature:
        return latent
    d = latent.shape[-1]
    norm = (latent.pow(2).sum(-1, keepdim=True) - d) / (2 * d) ** 0.5
    return torch.cat([latent, norm], -1)


def lc2st_nf_train(
    latent: Tensor,
    x: Tensor,
    classifier: Ensemble,
    generator: torch.Generator | None = None,
    norm_feature: bool = False,
) -> Ensemble:
    r"""Train L-C2ST-NF classifiers: class 1 :math:`(z^*_i, x_i)`, class 0 :math:`(z_i, x_i)`.

    Arguments:
        latent: :math:`z^*_i = T_\phi^{-1}(\theta^*_i; x_i)`, shape ``(N, D)``, or
            ``(R, N, D)`` for ``R`` datasets.
        x: calibration observations ``(N, X)`` shared by the datasets, or ``(R, N, X)``.
        classifier: an unfitted ensemble whose ``K = R * E`` members are grouped by
            dataset: members ``r E .. r E + E - 1`` see dataset ``r``, each with its own
            class-0 draws :math:`z_i \sim N(0, I)`.
        generator: draws the class-0 points (on the CPU).
        norm_feature: the classifiers also see the latents' norm (:func:`latent_features`).

    Returns:
        ``classifier``, fitted.
    """
    x = _check_x(x)
    latent = _with_datasets("latent", latent, x)
    per_dataset = _members_per_dataset(classifier, latent.shape[0], "datasets in latent")
    positive = latent.repeat_interleave(per_dataset, 0)
    negative = torch.randn(positive.shape, generator=generator, dtype=latent.dtype)
    n = x.shape[-2]
    labels = torch.cat([x.new_ones(n), x.new_zeros(n)])
    rows = latent_features(torch.cat([positive, negative.to(latent.device)], 1), norm_feature)
    features = [rows, _paired_rows(x, per_dataset)]
    return classifier.fit(features, labels)


def lc2st_nf_null(
    x: Tensor,
    dim: int,
    num_null: int,
    classifier: Ensemble,
    generator: torch.Generator | None = None,
    norm_feature: bool = False,
) -> Ensemble:
    r"""Train the L-C2ST-NF null classifiers: both classes fresh :math:`N(0, I_D)` draws.

    They depend on the calibration observations only, so one call serves every later
    check of every posterior on the same ``x``.

    Arguments:
        x: calibration observations ``(N, X)``.
        dim: parameter dimension ``D``.
        num_null: number of null trials ``H``.
        classifier: unfitted ensemble with ``K = H * E`` members.
        generator: draws the normal points (on the CPU).
        norm_feature: as :func:`lc2st_nf_train`'s.

    Returns:
        ``classifier``, fitted; trial ``h`` is members ``h E .. h E + E - 1``.
    """
    check_positive("dim", dim, integer=True)
    check_positive("num_null", num_null, integer=True)
    x = check_matrix("x", x, min_rows=2)
    latent = torch.randn(num_null, x.shape[0], dim, generator=generator, dtype=x.dtype)
    return lc2st_nf_train(latent.to(x.device), x, classifier, generator, norm_feature)


def lc2st_train(
    theta: Tensor,
    posterior_theta: Tensor,
    x: Tensor,
    classifier: Ensemble,
    num_null: int,
    generator: torch.Generator | None = None,
) -> Ensemble:
    r"""Train the L-C2ST classifier and its ``num_null`` permutation-null classifiers at once.

    Class 1 is :math:`(\theta^*_i, x_i)`, class 0 :math:`(\tilde\theta_i, x_i)`. Null trial
    ``h`` swaps the two labels of each pair :math:`i` with probability 1/2.

    Arguments:
        theta: true parameters :math:`\theta^*`, ``(N, D)`` or ``(R, N, D)``.
        posterior_theta: one posterior draw :math:`\tilde\theta_i \sim q(\cdot \mid x_i)`
            per pair, same shape as ``theta``.
        x: calibration observations ``(N, X)`` or ``(R, N, X)``.
        classifier: unfitted ensemble with ``K = R (1 + H) E`` members, ordered
            (dataset, trial, ensemble member); trial 0 has the true labels.
        num_null: ``H``.
        generator: draws the label swaps (on the CPU).

    Returns:
        ``classifier``, fitted.
    """
    x = _check_x(x)
    theta = _with_datasets("theta", theta, x)
    posterior_theta = _with_datasets("posterior_theta", posterior_theta, x)
    if posterior_theta.shape != theta.shape:
        raise ValueError(
            f"posterior_theta must have the shape of theta {tuple(theta.shape)}, "
            f"got {tuple(posterior_theta.shape)}"
        )
    check_positive("num_null", num_null, integer=True)
    datasets, n = theta.shape[0], x.shape[-2]
    per_dataset = _members_per_dataset(classifier, datasets, "datasets in theta")
    if per_dataset % (1 + num_null):
        raise ValueError(
            f"classifier.num_members must be R (1 + num_null) E = {datasets} * {1 + num_null} * E, "
            f"got {classifier.num_members}"
        )
    ensemble = per_dataset // (1 + num_null)
    swap = torch.rand(datasets, 1 + num_null, n, generator=generator) < 0.5
    swap[:, 0] = False
    swap = swap.repeat_interleave(ensemble, 1).reshape(-1, n).to(theta.device)
    labels = torch.cat([~swap, swap], 1).to(theta.dtype)  # (K, 2N)
    rows = torch.cat([theta, posterior_theta], 1)  # (R, 2N, D)
    rows = rows[0] if datasets == 1 else rows.repeat_interleave(per_dataset, 0)
    return classifier.fit([rows, _paired_rows(x, per_dataset)], labels)


def lc2st_probabilities(
    classifier: Ensemble, points: Tensor, observations: Tensor, num_ensemble: int = 1
) -> Tensor:
    r"""Classifier outputs :math:`d(\theta_j, x_o)` at the evaluation points of each observation.

    Arguments:
        classifier: fitted ensemble of ``K`` members.
        points: evaluation points, ``(N_v, D)`` shared by all observations
            (L-C2ST-NF's :math:`z_j`) or ``(O, N_v, D)`` (L-C2ST's
            :math:`\theta_j \sim q(\cdot \mid x_o)`).
        observations: ``(O, X)``.
        num_ensemble: ``E``; consecutive groups of ``E`` members are averaged.

    Returns:
        ``(K / E, O, N_v)``.
    """
    observations = check_matrix("observations", observations)
    check_positive("num_ensemble", num_ensemble, integer=True)
    if classifier.num_members % num_ensemble:
        raise ValueError(
            f"num_ensemble must divide classifier.num_members = {classifier.num_members}, "
            f"got {num_ensemble}"
        )
    num_obs = observations.shape[0]
    if points.ndim == 2:
        points = points.expand(num_obs, *points.shape)
    if points.ndim != 3 or points.shape[0] != num_obs:
        raise ValueError(
            f"points must have shape (N_v, D) or ({num_obs}, N_v, D), got {tuple(points.shape)}"
        )
    num_points = points.shape[1]
    rows = [points.reshape(-1, points.shape[-1]), observations.repeat_interleave(num_points, 0)]
    proba = classifier.predict_proba(rows).reshape(-1, num_ensemble, num_obs, num_points)
    return proba.mean(1)
