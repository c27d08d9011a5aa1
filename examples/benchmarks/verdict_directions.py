"""Level and power of the verdict's directional tests (``cl.diagnose``'s sentence).

Part A: one-sided level of :func:`calib_lightning.functional.direction.rank_mean_test`
on rank histograms drawn from a uniform (calibrated), a U-shaped (too narrow, unbiased)
and a hump-shaped (too wide, unbiased) rank law: the rank-mean null holds for all three.

Part B: how often the verdict's rule (one-sided rank-mean tests, Holm over the
``2 (D + 1)`` directions, gated by the rank check's global p-value) names each
direction, on rank histograms of Gaussian posteriors: exact, over-confident (variance
x 0.7), under-confident (variance x 2), biased in parameter 0 (mean + 0.5 posterior sd).
Ranks are computed from ``M`` draws per pair exactly as ``rank_calibration`` does
(marginal: draws below the truth; joint: draws more probable than the truth).

    python examples/benchmarks/verdict_directions.py [--smoke]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from calib_lightning.functional.combine import holm_adjust
from calib_lightning.functional.direction import rank_mean_test
from calib_lightning.functional.sbc import summarize_ranks

LEVEL = 0.05


def band(rate: float, reps: int) -> tuple[float, float]:
    """99 % binomial band around ``rate`` for ``reps`` repetitions (normal approximation)."""
    half = 2.576 * (rate * (1 - rate) / reps) ** 0.5
    return rate - half, rate + half


def rank_law(kind: str, m: int) -> torch.Tensor:
    u = (torch.arange(m + 1, dtype=torch.float64) + 0.5) / (m + 1)
    weights = {"uniform": torch.ones_like(u), "U-shaped": (u * (1 - u)) ** -0.6,
               "hump": (u * (1 - u)) ** 2}[kind]  # fmt: skip
    return weights / weights.sum()


def part_a(reps: int, sizes: list[int], generator: torch.Generator) -> list[str]:
    low, high = band(LEVEL, reps)
    lines = [f"| M | N | rank law | P(p_greater <= {LEVEL}) | P(p_less <= {LEVEL}) |",
             "| --- | --- | --- | --- | --- |"]  # fmt: skip
    for m in (10, 100):
        for n in sizes:
            for kind in ("uniform", "U-shaped", "hump"):
                ranks = torch.multinomial(rank_law(kind, m), reps * n, replacement=True,
                                          generator=generator).view(reps, n)  # fmt: skip
                hist = torch.zeros(reps, m + 1).scatter_add_(1, ranks, torch.ones(reps, n))
                out = rank_mean_test(hist)
                rates = [float((p <= LEVEL).double().mean()) for p in (out.p_greater, out.p_less)]
                marks = ["" if low <= r <= high else " (below the band)" if r < low
                         else " (ABOVE the band)" for r in rates]  # fmt: skip
                lines.append(f"| {m} | {n} | {kind} | {rates[0]:.4f}{marks[0]} | "
                             f"{rates[1]:.4f}{marks[1]} |")  # fmt: skip
    return [f"99 % band for {reps} repetitions: [{low:.4f}, {high:.4f}]", "", *lines]


def gaussian_histograms(
    reps: int, n: int, m: int, dim: int, scale: float, shift: float, generator: torch.Generator
) -> torch.Tensor:
    """Rank histograms ``(reps, D + 1, M + 1)``: truth ~ N(0, I), model N(shift e_0, scale I)."""
    hists = []
    mean = torch.zeros(dim)
    mean[0] = shift
    for start in range(0, reps, 50):
        r = min(50, reps - start)
        truth = torch.randn(r, n, dim, generator=generator)
        draws = mean + scale**0.5 * torch.randn(m, r, n, dim, generator=generator)
        marginal = (draws < truth).sum(0)  # (r, n, D)
        joint = (((draws - mean) ** 2).sum(-1) < ((truth - mean) ** 2).sum(-1)).sum(0)
        ranks = torch.cat([marginal, joint.unsqueeze(-1)], -1).transpose(1, 2)  # (r, D+1, n)
        hists.append(torch.zeros(r, dim + 1, m + 1).scatter_add_(-1, ranks, torch.ones_like(
            ranks, dtype=torch.float32)))  # fmt: skip
    return torch.cat(hists).long()


def part_b(reps: int, n: int, m: int, generator: torch.Generator) -> list[str]:
    lines = ["| D | model | ranks reject | over named | under named | bias in 0 named | "
             "bias in another named |", "| --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    # any wrongly named direction is a true null rejected: Holm keeps that family-wise
    # rate at the level; the gate (ranks reject) lowers it further
    models = {"exact": (1.0, 0.0), "over-confident (var x 0.7)": (0.7, 0.0),
              "under-confident (var x 2)": (2.0, 0.0), "biased in 0 (+0.5 sd)": (1.0, 0.5)}
    for dim in (2, 10):
        for name, (scale, shift) in models.items():
            hist = gaussian_histograms(reps, n, m, dim, scale, shift, generator)
            gate = summarize_ranks(hist).global_p_value < LEVEL  # (reps,)
            test = rank_mean_test(hist)  # (reps, D + 1)
            p = torch.stack([test.p_greater, test.p_less], -1)  # (reps, D + 1, 2)
            named = (holm_adjust(p.reshape(reps, -1)).view_as(p) < LEVEL) & gate[:, None, None]
            over, under = named[:, -1, 0], named[:, -1, 1]
            bias0 = named[:, 0].any(-1)
            other = named[:, 1:-1].any(-1).any(-1)
            rates = [gate, over, under, bias0, other]
            lines.append(f"| {dim} | {name} | " + " | ".join(
                f"{float(r.double().mean()):.3f}" for r in rates) + " |")  # fmt: skip
    return [f"{reps} datasets per row, N = {n} pairs, M = {m} draws, level {LEVEL}", "", *lines]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    generator = torch.Generator().manual_seed(0)
    start = time.perf_counter()
    if args.smoke:
        a, b = part_a(500, [30], generator), part_b(50, 100, 20, generator)
        folder = Path(tempfile.mkdtemp())
    else:
        a, b = part_a(20_000, [30, 100, 1000], generator), part_b(1000, 400, 100, generator)
        folder = Path(__file__).parent / "results"
    text = "\n".join([
        "# Directional tests of the verdict", "",
        "Written by `examples/benchmarks/verdict_directions.py` (seed 0).", "",
        "## A. Level of the one-sided rank-mean t-test", "", *a, "",
        "## B. What the verdict names (Holm over 2 (D + 1) directions, gated by the "
        "rank check)", "", *b, "",
        f"Total {time.perf_counter() - start:.0f} s.", "",
    ])  # fmt: skip
    (folder / "verdict_directions.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
