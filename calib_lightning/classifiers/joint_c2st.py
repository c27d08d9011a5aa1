r"""The joint classifier test over :math:`(\theta, x)`: folds, train, score, rank.

The calibration pairs are split ``R`` times into ``K`` folds; the folds are drawn from a
generator the caller seeds from the observations ``x`` only, so they carry no
information about :math:`\theta^*`. For each repetition and fold a classifier learns
:math:`d(\theta, x) = P(\text{class } 1 \mid \theta, x)` on the other folds, with class 1
:math:`(\theta^*_i, x_i)` and class 0 :math:`(\tilde\theta_{il}, x_i)`, ``L`` posterior
draws per pair (:func:`joint_c2st_train`), and scores the :math:`M + 1` values (the truth
and the ``M`` draws) of every pair of its fold. The ranks of the truths in a fold and their
exact null variances (:func:`~calib_lightning.functional.joint_c2st.averaged_ranks`) give
the fold's exact test (:func:`~calib_lightning.functional.joint_c2st.rank_sum_test`), and
the ``K R`` fold p-values are combined by the Cauchy combination (why not one pooled
statistic: :mod:`calib_lightning.functional.joint_c2st`). ``B`` datasets train at once,
``R K`` groups of ``E`` ensemble members each.

References:
    Bansal, Chen, Scott. "Conformal C2ST: Turning weak classifiers into strong two-sample
    tests." arXiv:2507.17026 (2025).
"""

from __future__ import annotations

import torch
from torch import Tensor

from calib_lightning._utils.validation import check_positive
from calib_lightning.classifiers._make import Ensemble
from calib_lightning.functional._tails import normal_two_sided_p_value
from calib_lightning.functional.combine import combine_p_values
from calib_lightning.functional.joint_c2st import averaged_ranks, rank_sum_test

__all__ = ["joint_c2st_folds", "joint_c2st_test", "joint_c2st_train"]


def joint_c2st_folds(
    num_pairs: int, folds: int, repeats: int, generator: torch.Generator | None = None
) -> Tensor:
    """Fold of each pair in each repetition, ``(repeats, num_pairs)`` int64 in
    ``0..folds - 1``: a fresh random assignment per repetition, folds as equal as can be
    (sizes differ by at most one), at least two pairs each."""
    check_positive("folds", folds, integer=True)
    check_positive("repeats", repeats, integer=True)
    if folds < 2:
        raise ValueError(
            f"folds must be at least 2 (every pair ranked by a classifier that "
            f"did not see it), got {folds}"
        )
    if num_pairs < 2 * folds:
        raise ValueError(
            f"the joint classifier test needs N >= 2 * folds = {2 * folds} pairs, "
            f"got N = {num_pairs}"
        )
    labels = torch.arange(num_pairs) % folds
    return torch.stack(
        [labels[torch.randperm(num_pairs, generator=generator)] for _ in range(repeats)]
    )


def joint_c2st_train(
    theta: Tensor, posterior_theta: Tensor, x: Tensor, classifier: Ensemble
) -> Ensemble:
    r"""Train :math:`d(\theta, x)`: class 1 :math:`(\theta^*_i, x_i)`, class 0
    :math:`(\tilde\theta_{il}, x_i)`, ``L`` draws per pair.

    Arguments:
        theta: true parameters ``(G, n, D)``, each once in class 1.
        posterior_theta: draws :math:`\tilde\theta_{il} \sim q(\cdot \mid x_i)`,
            ``(G, n, D)`` (one per pair) or ``(G, L, n, D)``, all in class 0 (the classes
            are then ``1 : L``; a ranking of the scores does not care).
        x: observations ``(G, n, X)``.
        classifier: unfitted ensemble of ``G E`` members, training set ``g`` in members
            ``g E .. g E + E - 1``.

    Returns:
        ``classifier``, fitted.
    """
    groups, n = theta.shape[:2]
    if posterior_theta.ndim == theta.ndim:
        posterior_theta = posterior_theta.unsqueeze(1)
    draws = posterior_theta.shape[1]
    per_group = classifier.num_members // groups
    negatives = posterior_theta.flatten(1, 2)  # (G, L n, D), draw-major
    rows = torch.cat([theta, negatives], 1).repeat_interleave(per_group, 0)
    context = x.repeat(1, 1 + draws, 1).repeat_interleave(per_group, 0)
    labels = torch.cat([theta.new_ones(n), theta.new_zeros(draws * n)])
    if groups * per_group == 1:
        return classifier.fit([rows[0], context[0]], labels)
    return classifier.fit([rows, context], labels)


def _scores(classifier: Ensemble, theta: Tensor, x: Tensor, ensemble: int) -> Tensor:
    """Log-odds of the members averaged per group: ``theta (G, S, D)``, ``x (G, S, X)``
    -> ``(G, S)``."""
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
    folds: Tensor,
    rank_generator: torch.Generator | None = None,
    train_draws: int = 1,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    r"""Run the cross-fitted joint classifier test on ``B`` datasets at once.

    Arguments:
        theta: true parameters ``(B, N, D)``.
        x: observations, flattened, ``(B, N, X)``.
        samples: posterior draws :math:`\theta_{im} \sim q(\cdot \mid x_i)`,
            ``(B, M, N, D)``, ``M >= 2``: draws ``0 .. L - 1`` are class 0 of the training
            pairs, all ``M`` are ranked at the pairs a classifier did not see.
        classifier: unfitted ensemble of ``B R K E`` members.
        folds: :func:`joint_c2st_folds` ``(R, N)`` (the same for every dataset).
        rank_generator: draws the tie-breaking of the ranks.
        train_draws: ``L``, draws ``0 .. L - 1`` of each training pair in class 0.

    Returns:
        ``(z, p_value, ranks, p_value_error)``: the mean of the fold statistics
        :math:`Z_f` ``(B,)`` (each ``N(0, 1)`` under :math:`H_0`, positive when the truths
        score above the draws), the Cauchy combination of the folds' two-sided p-values
        ``(B,)``, every pair's rank averaged over the repetitions ``(B, N)``, and the
        p-value's Monte Carlo error ``(B,)``: the jackknife standard error over the
        repetitions, from the combinations that leave one repetition out (0 for one
        repetition).
        Each classifier trains on the first ``n_train`` pairs outside its fold, ``n_train``
        the smallest such count (folds differ in size by at most one).
    """
    datasets, num_pairs, dim = theta.shape
    if samples.ndim != 4 or samples.shape[0] != datasets or samples.shape[2:] != theta.shape[1:]:
        raise ValueError(
            f"samples must have shape (B, M, N, D) = ({datasets}, M, {num_pairs}, {dim}), "
            f"got {tuple(samples.shape)}"
        )
    if samples.shape[1] < 2:
        raise ValueError(f"samples must hold M >= 2 draws per pair, got M = {samples.shape[1]}")
    if not 1 <= train_draws <= samples.shape[1]:
        raise ValueError(f"train_draws must be in 1..M = {samples.shape[1]}, got {train_draws}")
    repeats, num_folds = folds.shape[0], int(folds.max()) + 1
    groups = repeats * num_folds
    if classifier.num_members % (datasets * groups):
        raise ValueError(
            f"classifier.num_members must be a multiple of B R K = {datasets * groups} (datasets "
            f"x repetitions x folds), got {classifier.num_members}"
        )
    ensemble = classifier.num_members // (datasets * groups)
    sizes = torch.stack([folds.eq(k).sum(1) for k in range(num_folds)], 1)  # (R, K)
    train_size, held_size = int((num_pairs - sizes).min()), int(sizes.max())
    train = torch.stack(
        [
            (folds[r] != k).nonzero().flatten()[:train_size]
            for r in range(repeats)
            for k in range(num_folds)
        ]
    )  # (G, n_train)
    # each fold's pairs, padded to one size by repeating its first pair (scores dropped)
    held = torch.stack(
        [
            torch.cat([idx, idx[:1].expand(held_size - len(idx))])
            for r in range(repeats)
            for k in range(num_folds)
            for idx in [folds[r].eq(k).nonzero().flatten()]
        ]
    )  # (G, n_held)
    train, held = train.to(theta.device), held.to(theta.device)
    negatives = samples[:, :train_draws][:, :, train].transpose(1, 2)  # (B, G, L, n_train, D)
    joint_c2st_train(
        theta[:, train].flatten(0, 1),
        negatives.flatten(0, 1),
        x[:, train].flatten(0, 1),
        classifier,
    )
    values = torch.cat([theta.unsqueeze(1), samples.to(theta)], 1)  # (B, M + 1, N, D)
    num_values = values.shape[1]
    points = values[:, :, held].permute(0, 2, 1, 3, 4)  # (B, G, M + 1, n_held, D)
    context = x[:, held].unsqueeze(2).expand(-1, -1, num_values, -1, -1)
    scores = _scores(
        classifier,
        points.reshape(datasets * groups, -1, dim),
        context.reshape(datasets * groups, -1, x.shape[-1]),
        ensemble,
    )
    scores = scores.view(datasets, repeats, num_folds, num_values, held_size)
    statistics = scores.new_empty(datasets, repeats, num_folds)
    ranks = scores.new_empty(datasets, repeats, num_pairs)
    for r in range(repeats):
        for k in range(num_folds):
            size = int(sizes[r, k])
            idx = held[r * num_folds + k, :size]
            fold = scores[:, r, k, :, :size].unsqueeze(1)  # (B, 1, M + 1, n_fold)
            u, variance, _ = averaged_ranks(fold, rank_generator)
            statistics[:, r, k] = rank_sum_test(u, variance)[0]
            ranks[:, r, idx] = u
    p_folds = normal_two_sided_p_value(statistics)  # (B, R, K)
    p_value = combine_p_values(p_folds.flatten(1), dim=-1)
    error = torch.zeros_like(p_value)
    if repeats > 1:  # jackknife over the repetitions: the combination without each one
        keep = ~torch.eye(repeats, dtype=torch.bool, device=p_folds.device)  # (R, R)
        left_out = torch.stack(
            [combine_p_values(p_folds[:, keep[r]].flatten(1), dim=-1) for r in range(repeats)], -1
        )  # (B, R)
        spread = (left_out - left_out.mean(-1, keepdim=True)).square().sum(-1)
        error = (spread * (repeats - 1) / repeats).sqrt()
    return statistics.flatten(1).mean(-1), p_value, ranks.mean(1), error
