"""Short KCCSD demo: test a calibrated and two miscalibrated Gaussian models.

Run: python examples/kccsd_demo.py  (``--smoke``: 100 pairs instead of 500)
"""

import argparse

import torch

import calib_lightning as cl
from calib_lightning.tasks import HGM, MGM


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-pairs", type=int, default=500)
    parser.add_argument("--smoke", action="store_true", help="100 pairs (writes nothing)")
    args = parser.parse_args(argv)
    n = 100 if args.smoke else args.num_pairs
    generator = torch.Generator().manual_seed(0)
    cases = {
        "MGM, calibrated (delta=0)": (MGM(0.0), MGM(0.0)),
        "MGM, mean shifted (delta=0.2)": (MGM(0.0), MGM(0.2)),
        "HGM, variance inflated near c (delta=1)": (HGM(0.0), HGM(1.0)),
    }
    print(f"{'model':42s} {'n':>5s} {'statistic':>11s} {'p-value':>8s}")
    for name, (truth, model) in cases.items():
        theta, x = truth.sample(n, generator)
        metric = cl.KCCSD(seed=1)
        metric.update(model, theta, x)
        out = metric.compute()
        print(f"{name:42s} {n:5d} {float(out.statistic):11.4g} {float(out.p_value):8.3f}")


if __name__ == "__main__":
    main()
