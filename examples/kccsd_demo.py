"""Short KCCSD demo: test a calibrated and two miscalibrated Gaussian models.

Run: python examples/kccsd_demo.py
"""

import torch

import calib_lightning as cl
from calib_lightning.tasks import HGM, MGM


def main() -> None:
    generator = torch.Generator().manual_seed(0)
    cases = {
        "MGM, calibrated (delta=0)": (MGM(0.0), MGM(0.0)),
        "MGM, mean shifted (delta=0.2)": (MGM(0.0), MGM(0.2)),
        "HGM, variance inflated near c (delta=1)": (HGM(0.0), HGM(1.0)),
    }
    print(f"{'model':42s} {'n':>5s} {'statistic':>11s} {'p-value':>8s}")
    for name, (truth, model) in cases.items():
        theta, x = truth.sample(500, generator)
        metric = cl.KCCSD(seed=1)
        metric.update(model, theta, x)
        out = metric.compute()
        print(f"{name:42s} {500:5d} {float(out['statistic']):11.4g} {float(out['p_value']):8.3f}")


if __name__ == "__main__":
    main()
