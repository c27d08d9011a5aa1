"""Numbers far from the origin (issue 12): contraction, Frechet distance, MMD power.

Prints, at offset 0 and far from it, the posterior contraction of ``RankCalibration``
(theta = offset + 0.01 z, x = z + noise, exact posterior: contraction 1/2), the
streaming and functional Frechet distances (float64, offset 1e6) and the MMD power
against a doubled spread (float32, spread 0.01, offset 100; 100 datasets of 100 + 100
points, 200 permutations) with the median bandwidths of the first three.
Runs on any checkout (public API only), so before and after can be compared:

    python examples/benchmarks/offsets.py            # --smoke: fewer pairs and datasets

Measured (2 CPU cores): before (raw moments, uncentred distances) contraction
[1.398, 0.601] at 1e6 and [-inf, -inf] at 1.1e9 instead of [0.503, 0.490];
streaming Frechet 0.0 at 1e6 instead of 7.02e-07; MMD power 0.00 at offset 100
(bandwidths 0.14 instead of 0.023). After (centred moments, centred distances):
contraction [0.503213056, 0.490297751] at 1e6 (equal to offset 0 to 1e-10) and
[0.502, 0.489] at 1.1e9 (float64 rounds theta to 2.4e-7 there: rank ties change the
random draws); Frechet 7.0245075e-07 (stream and functional agree to 4e-16); MMD
power 1.00 with bandwidths 0.0228, 0.0240, 0.0243 as at offset 0.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if not __package__:  # run as a file (python examples/x.py): make `examples` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
from torch.distributions import Independent, Normal

import calib_lightning as cl
from calib_lightning.functional import frechet_distance, mmd
from calib_lightning.metrics import FrechetDistance
from examples._smoke import add_smoke_argument


def posterior(offset: float, spread: float):
    """Exact posterior of theta = offset + spread z given x = z + N(0, I)."""
    return lambda x: Independent(Normal(offset + spread * x / 2, spread * 0.5**0.5), 1)


def contraction(offset: float, spread: float = 0.01, n: int = 2000) -> list[float]:
    g = torch.Generator().manual_seed(0)
    z = torch.randn(n, 2, generator=g, dtype=torch.float64)
    x = z + torch.randn(n, 2, generator=g, dtype=torch.float64)
    theta = offset + spread * z
    torch.manual_seed(1)
    metric = cl.RankCalibration(100)
    for start in range(0, n, 500):
        metric.update(posterior(offset, spread), theta[start : start + 500],
                      x[start : start + 500])
    return metric.compute().contraction.tolist()


def frechet(offset: float) -> tuple[float, float]:
    g = torch.Generator().manual_seed(0)
    a = offset + 0.01 * torch.randn(4000, 2, generator=g, dtype=torch.float64)
    b = offset + 0.01 * torch.randn(4000, 2, generator=g, dtype=torch.float64) + 0.0005
    metric = FrechetDistance(dim=2)
    for start in range(0, 4000, 1000):
        metric.update(samples=a[start : start + 1000], reference=b[start : start + 1000])
    return float(metric.compute().frechet_distance), float(frechet_distance(a, b))


def mmd_power(
    offset: float, spread: float = 0.01, datasets: int = 100
) -> tuple[float, list[float]]:
    g = torch.Generator().manual_seed(0)
    y = spread * torch.randn(datasets, 100, 2, generator=g)
    x = spread * torch.randn(datasets, 100, 2, generator=g)
    out = mmd(offset + 2.0 * y, offset + x, num_permutations=200, generator=g)
    return float((out["p_value"] <= 0.05).float().mean()), out["bandwidth"][:3].tolist()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_smoke_argument(parser)
    args = parser.parse_args()
    torch.set_num_threads(1)
    n, datasets = (500, 10) if args.smoke else (2000, 100)
    for offset in (0.0, 1e6, 1.1e9):
        print(f"contraction, offset {offset:g}: {contraction(offset, n=n)}")
    for offset in (0.0, 1e6):
        print(f"Frechet (stream, functional), offset {offset:g}: {frechet(offset)}")
    for offset in (0.0, 100.0):
        power = mmd_power(offset, datasets=datasets)
        print(f"MMD power and bandwidths, float32, offset {offset:g}: {power}")
