"""Centred moments (``calib_lightning.functional._moments``): Chan et al.'s merge against
two-pass numpy.

Closed forms in float64 on random splits, points far from the origin, empty parts, the
packed state as a torchmetrics reduction, and bad input.
"""

import itertools

import numpy as np
import pytest
import torch

from calib_lightning.functional._moments import (
    merge_moments,
    moment_state_size,
    moments,
    split_moments,
    variance_from_moments,
)

F64 = torch.float64


def gen(seed):
    return torch.Generator().manual_seed(seed)


def random_split(n, parts, g):
    """``parts`` consecutive chunks of ``range(n)`` at random cut points (some may be empty)."""
    cuts = torch.sort(torch.randint(0, n + 1, (parts - 1,), generator=g)).values.tolist()
    edges = [0, *cuts, n]
    return [slice(a, b) for a, b in itertools.pairwise(edges)]


@pytest.mark.parametrize("covariance", [False, True])
@pytest.mark.parametrize("offset", [0.0, 1e6, 1.1e9])
def test_merge_of_random_splits_equals_two_pass_numpy(covariance, offset):
    g = gen(0)
    for trial in range(20):
        n, d = int(torch.randint(2, 60, (1,), generator=g)), 1 + trial % 3
        spread = torch.rand(d, generator=g, dtype=F64) * 0.1 + 0.01
        points = offset + spread * torch.randn(n, d, generator=g, dtype=F64)
        parts = random_split(n, 1 + trial % 5, g)
        # sequential (batch after batch) and K-way (all processes at once) merges
        state = torch.zeros(moment_state_size(d, covariance), dtype=F64)
        for rows in parts:
            state = merge_moments(torch.stack([state, moments(points[rows], covariance)]),
                                  covariance)
        stacked = merge_moments(torch.stack([moments(points[r], covariance) for r in parts]),
                                covariance)
        # reference: two-pass numpy on the points minus one of them (exact by Sterbenz's
        # lemma at the offsets: all points are within a factor 2 of each other)
        array = points.numpy()
        expected_cov = np.cov(array - array[0], rowvar=False, ddof=1).reshape(d, d)
        expected = expected_cov if covariance else np.diag(expected_cov)
        for merged in (state, stacked):
            count, mean, _ = split_moments(merged, covariance)
            assert int(count) == n
            np.testing.assert_allclose(mean.numpy(), array.mean(0), rtol=0,
                                       atol=4e-16 * (offset + 1.0))
            _, variance = variance_from_moments(merged, covariance)
            np.testing.assert_allclose(variance.numpy(), expected, rtol=1e-12,
                                       atol=1e-12 * float(spread.max()) ** 2)


def test_closed_form_two_points_and_exact_integers():
    # {1e9 + 1, 1e9 + 3}: mean 1e9 + 2, unbiased variance 2, all exactly representable
    a = torch.tensor([[1e9 + 1.0]], dtype=F64)
    b = torch.tensor([[1e9 + 3.0]], dtype=F64)
    merged = merge_moments(torch.stack([moments(a), moments(b)]))
    mean, var = variance_from_moments(merged)
    assert mean.item() == 1e9 + 2.0
    assert var.item() == 2.0
    # raw moments lose it: sum x^2 - n mean^2 in float64
    x = torch.cat([a, b])
    raw = ((x * x).sum() - 2 * x.mean() ** 2) / 1
    assert raw.item() != 2.0


def test_empty_parts_are_ignored_and_all_empty_is_empty():
    g = gen(1)
    points = 5.0 + torch.randn(30, 2, generator=g, dtype=F64)
    empty = torch.zeros(moment_state_size(2), dtype=F64)
    alone = moments(points)
    for stack in ([empty, alone], [alone, empty], [empty, alone, empty]):
        torch.testing.assert_close(merge_moments(torch.stack(stack)), alone, rtol=1e-15, atol=0)
    assert torch.equal(merge_moments(torch.stack([empty, empty])), empty)
    assert torch.equal(moments(points[:0]), empty)


def test_batched_states_merge_per_comparison():
    g = gen(2)
    shifts = torch.arange(4.0, dtype=F64)[:, None, None]
    points = torch.randn(4, 50, 3, generator=g, dtype=F64) + shifts
    parts = [moments(points[:, :20], True), moments(points[:, 20:], True)]
    merged = merge_moments(torch.stack(parts), True)
    # the anchors may differ (each part keeps one of its points); the moments do not
    for got, want in zip(split_moments(merged, True), split_moments(moments(points, True), True),
                         strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    _, cov = variance_from_moments(merged, True)
    for k in range(4):
        np.testing.assert_allclose(cov[k].numpy(), np.cov(points[k].numpy(), rowvar=False),
                                   rtol=1e-12)


def test_bad_input_names_what_was_expected():
    with pytest.raises(ValueError, match=r"states must have shape \(K, \*, L\)"):
        merge_moments(torch.zeros(7, dtype=F64))
    with pytest.raises(ValueError, match=r"last axis of length 1 \+ 3 D, got 5"):
        split_moments(torch.zeros(5, dtype=F64))
    with pytest.raises(ValueError, match=r"1 \+ 2 D \+ D \* D, got 6"):
        split_moments(torch.zeros(6, dtype=F64), covariance=True)
    with pytest.raises(ValueError, match="at least 2 points, got count 1"):
        variance_from_moments(moments(torch.ones(1, 2, dtype=F64)))
