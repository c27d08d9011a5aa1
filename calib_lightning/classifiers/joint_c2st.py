r"""The joint classifier test over :math:`(\theta, x)`: split, train, score, rank.

The calibration pairs are split at random into a training part and a held-out part;
the split is drawn from a generator the caller seeds from the observations ``x`` only,
so it carries no information about :math:`\theta^*`. On the training part, classifiers
learn :math:`d(\theta, x) = P(\text{class } 1 \mid \theta, x)` with class 1
:math:`(\theta^*_i, x_i)` and class 0 :math:`(\tilde\theta_i, x_i)`, one posterior draw
per pair (:func:`joint_c2st_train`). On the held-out part, the score of each true
parameter is ranked among the scores of the ``M`` posterior draws at its :math:`x_i`
(:func:`~calib_lightning.functional.joint_c2st.conformal_ranks`), which are uniform
under :math:`H_0` whatever the classifier; their mean is the test
(:func:`~calib_lightning.functional.joint_c2st.uniform_mean_test`). ``R`` datasets
train at once, one group of ``E`` ensemble members each.

References:
    Bansal, Chen, Scott. "Conformal C2ST: Turning weak classifiers into strong two-sample
    tests." arXiv:2507.17026 (2025).
"""

from __future__ import annotations

import torch
from torch import Tensor

from calib_lightning._checks import check_probability
from calib_lightning.classifiers._make import Ensemble
from calib_lightning.functional.joint_c2st import conformal_ranks, uniform_mean_test

__all__ = ["joint_c2st_split", "joint_c2st_test", "joint_c2st_train"]


def joint_c2st_split(
    num_pairs: int, train_fraction: float, generator: torch.Generator | None = None
) -> tuple[Tensor, Tensor]:
    """Indices ``(train, held_out)`` of a random split of ``num_pairs`` rows; at least two
    rows on each side."""
    check_probability("train_fraction", train_fraction)
    if num_pairs < 4:
        raise ValueError(f"the joint classifier test needs N >= 4 pairs, got N = {num_pairs}")
    num_train = min(max(round(train_fraction * num_pairs), 2), num_pairs - 2)
    order = torch.randperm(num_pairs, generator=generator)
    return order[:num_train], order[num_train:]


def joint_c2st_train(
    theta: Tensor, posterior_theta: Tensor, x: Tensor, classifier: Ensemble
) -> Ensemble:
    r"""Train :math:`d(\theta, x)`: class 1 :math:`(\theta^*_i, x_i)`, class 0
    :math:`(\tilde\theta_i, x_i)`.

    Arguments:
        theta: true parameters ``(R, n, D)``.
        posterior_theta: one draw :math:`\tilde\theta_i \sim q(\cdot \mid x_i)` per pair,
            ``(R, n, D)``.
        x: observations ``(R, n, X)``.
        classifier: unfitted ensemble of ``K = R E`` members, dataset ``r`` in members
            ``r E .. r E + E - 1``.

    Returns:
        ``classifier``, fitted.
    """
    datasets, n = theta.shape[:2]
    per_dataset = classifier.num_members // datasets
    rows = torch.cat([theta, posterior_theta], 1).repeat_interleave(per_dataset, 0)
    context = torch.cat([x, x], 1).repeat_interleave(per_dataset, 0)
    labels = torch.cat([theta.new_ones(n), theta.new_zeros(n)])
    if datasets * per_dataset == 1:
        return classifier.fit([rows[0], context[0]], labels)
    return classifier.fit([rows, context], labels)


def _scores(classifier: Ensemble, theta: Tensor, x: Tensor, ensemble: int) -> Tensor:
    """Log-odds of the members averaged per dataset: ``theta (R, S, D)``, ``x (R, S, X)``
    -> ``(R, S)``."""
    rows, context = theta.repeat_interleave(ensemble, 0), x.repeat_interleave(ensemble, 0)
    if rows.shape[0] == 1:
        proba = classifier.predict_proba([rows[0], context[0]])
    else:
        proba = classifier.predict_proba([rows, context])
    proba = proba.double().clamp(1e-12, 1 - 1e-12)
    return torch.logit(proba).reshape(theta.shape[0], ensemble, -1).mean(1)


def joint_c2st_test(
    theta: Tensor,
    x: Tensor,
    samples: Tensor,
    classifier: Ensemble,
    train_fraction: float = 0.5,
    split_generator: torch.Generator | None = None,
    rank_generator: torch.Generator | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    r"""Run the joint classifier test on ``R`` datasets at once.

    Arguments:
        theta: true parameters ``(R, N, D)``.
        x: observations, flattened, ``(R, N, X)``.
        samples: posterior draws :math:`\theta_{im} \sim q(\cdot \mid x_i)`,
            ``(R, M, N, D)``, ``M >= 2``: draw 0 is class 0 of the training pairs, all
            ``M`` are ranked against the held-out pairs.
        classifier: unfitted ensemble of ``K = R E`` members.
        train_fraction: share of the pairs the classifier trains on.
        split_generator: draws the split (one split for all datasets); seed it from ``x``
            only.
        rank_generator: draws the tie-breaking of the ranks.

    Returns:
        ``(z, p_value, ranks)``: ``(R,)``, ``(R,)``, held-out ranks ``(R, n_held_out)``.
    """
    datasets, num_pairs = theta.shape[:2]
    if samples.ndim != 4 or samples.shape[0] != datasets or samples.shape[2:] != theta.shape[1:]:
        raise ValueError(
            f"samples must have shape (R, M, N, D) = ({datasets}, M, {num_pairs}, "
            f"{theta.shape[-1]}), got {tuple(samples.shape)}"
        )
    if samples.shape[1] < 2:
        raise ValueError(f"samples must hold M >= 2 draws per pair, got M = {samples.shape[1]}")
    if classifier.num_members % datasets:
        raise ValueError(
            f"classifier.num_members must be a multiple of the R = {datasets} datasets, "
            f"got {classifier.num_members}"
        )
    ensemble = classifier.num_members // datasets
    train, held = joint_c2st_split(num_pairs, train_fraction, split_generator)
    train, held = train.to(theta.device), held.to(theta.device)
    joint_c2st_train(theta[:, train], samples[:, 0, train], x[:, train], classifier)
    num_draws = samples.shape[1]
    score = _scores(classifier, theta[:, held], x[:, held], ensemble)  # (R, n)
    drawn = samples[:, :, held].reshape(datasets, -1, theta.shape[-1])  # (R, M n, D)
    context = x[:, held].repeat(1, num_draws, 1)
    drawn_scores = _scores(classifier, drawn, context, ensemble).view(datasets, num_draws, -1)
    ranks = conformal_ranks(score, drawn_scores, rank_generator)
    z, p_value = uniform_mean_test(ranks)
    return z, p_value, ranks
