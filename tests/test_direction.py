"""Directional rank-mean tests and Holm's adjusted p-values: closed forms and level."""

from __future__ import annotations

import itertools

import pytest
import torch

from calib_lightning.functional.combine import combine_p_values, holm_adjust
from calib_lightning.functional.direction import rank_mean_test

LEVEL = 0.05


def histograms(weights: torch.Tensor, reps: int, n: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    ranks = torch.multinomial(weights, reps * n, replacement=True, generator=generator)
    ranks = ranks.view(reps, n)
    return torch.zeros(reps, weights.shape[0]).scatter_add_(1, ranks, torch.ones(reps, n)).long()


def rank_law(kind: str, m: int) -> torch.Tensor:
    u = (torch.arange(m + 1, dtype=torch.float64) + 0.5) / (m + 1)
    weights = {"uniform": torch.ones_like(u), "U": (u * (1 - u)) ** -0.6,
               "hump": (u * (1 - u)) ** 2}[kind]  # fmt: skip
    return weights / weights.sum()


def test_closed_form_matches_a_t_test_on_the_fractional_ranks():
    from scipy import stats

    counts = torch.tensor([4, 0, 3, 7, 1, 9])  # M = 5, N = 24
    u = (torch.repeat_interleave(torch.arange(6), counts).double() + 0.5) / 6
    reference = stats.ttest_1samp(u.numpy(), 0.5, alternative="greater")
    out = rank_mean_test(counts)
    assert float(out.offset) == pytest.approx(float(u.mean()) - 0.5, abs=1e-12)
    assert float(out.statistic) == pytest.approx(reference.statistic, rel=1e-9)
    assert float(out.p_greater) == pytest.approx(reference.pvalue, rel=1e-9)
    assert float(out.p_less + out.p_greater) == pytest.approx(1.0, abs=1e-12)


@pytest.mark.parametrize(("kind", "m", "n"), [
    ("uniform", 10, 30), ("uniform", 100, 200), ("U", 100, 30), ("hump", 10, 200),
])  # fmt: skip
def test_one_sided_level_for_any_unbiased_rank_law(kind, m, n):
    """Calibrated (uniform), too narrow (U) and too wide (hump) ranks all have mean 1/2:
    neither one-sided test may reject more than its level (4,000 datasets, 99 % band)."""
    out = rank_mean_test(histograms(rank_law(kind, m), 4000, n, seed=m + n))
    for p in (out.p_greater, out.p_less):
        rate = float((p <= LEVEL).double().mean())
        assert 0.041 <= rate <= 0.059, (kind, m, n, rate)


def test_power_and_sign():
    weights = rank_law("uniform", 20) * torch.linspace(0.5, 1.5, 21, dtype=torch.float64)
    out = rank_mean_test(histograms(weights / weights.sum(), 200, 300, seed=1))
    assert float((out.p_greater <= LEVEL).double().mean()) > 0.95  # ranks high: truth above
    assert float((out.p_less <= LEVEL).double().mean()) == 0.0


def test_holm_matches_the_step_down_procedure_by_brute_force():
    generator = torch.Generator().manual_seed(0)
    p = torch.rand(200, 5, generator=generator, dtype=torch.float64) ** 3
    adjusted = holm_adjust(p)
    for row, adj in zip(p, adjusted, strict=True):
        order = row.argsort()
        for alpha in (0.01, 0.05, 0.2):
            rejected = set()
            for j, k in enumerate(order.tolist()):  # Holm: stop at the first acceptance
                if row[k] > alpha / (5 - j):
                    break
                rejected.add(k)
            assert {k for k in range(5) if adj[k] <= alpha} == rejected
    assert torch.equal(adjusted.amin(-1), combine_p_values(p, method="holm"))


def test_holm_ignores_nan_and_keeps_shape():
    p = torch.tensor([[0.01, 0.03], [float("nan"), 0.2], [0.04, 0.5]], dtype=torch.float64)
    out = holm_adjust(p, dim=0)
    assert torch.allclose(out[:, 0], torch.tensor([0.02, float("nan"), 0.04],
                                                  dtype=torch.float64), equal_nan=True)
    assert torch.allclose(out[:, 1], torch.tensor([0.09, 0.4, 0.5], dtype=torch.float64))


def test_directions_named_by_holm_keep_the_family_wise_level():
    """Calibrated ranks, D = 3: Holm over the 8 one-sided tests names any direction in at
    most 5 % of 4,000 datasets, with no gate at all (the verdict adds one)."""
    m, n, d = 20, 100, 3
    hist = torch.stack([histograms(rank_law("uniform", m), 4000, n, seed=10 + j)
                        for j in range(d + 1)], 1)  # fmt: skip
    test = rank_mean_test(hist)
    p = torch.stack([test.p_greater, test.p_less], -1).reshape(4000, -1)
    rate = float((holm_adjust(p) < LEVEL).any(-1).double().mean())
    assert rate <= 0.059, rate


def test_input_errors():
    with pytest.raises(ValueError, match="N >= 2"):
        rank_mean_test(torch.tensor([1, 0, 0]))
    with pytest.raises(ValueError, match="p_values must be a tensor"):
        holm_adjust(torch.tensor(0.5))
    for a, b in itertools.product((0.0, 1.0), repeat=2):
        assert float(holm_adjust(torch.tensor([a, b]))[0]) in (0.0, 1.0)
