"""The joint classifier test (cl.JointC2ST) against the blind prior, beside the other checks.

Gaussian toy (``GaussianToy(dim=d)``: theta ~ N(0, I_d), x = theta + 0.5 noise, exact
posterior N(0.8 x, 0.2 I), its mean depends on x), d = 3, 10, 50, N = 1,000 pairs per
dataset, a fresh dataset per repetition. Estimators: the exact posterior (level), the
blind prior q(theta | x) = N(0, I) (calibrated, useless), and the posterior shrunk half-way
to the prior (mean 0.4 x, variance 0.6).

1. Which test: power per second on the blind prior of the candidates, through their public
   classes at default arguments: ``JointC2ST`` (one classifier, conformal ranks),
   ``JointC2ST(num_ensemble=3)``, and ``LC2STNF`` at two fresh observations
   (``global_p_value``; its first check trains the 100 null classifiers, a later check on
   the same x reuses them).
2. ``cl.diagnose(post, theta, x)`` at its defaults: rejection rate at 0.05 of every global
   check and of the overall verdict, and seconds per check.
3. Level: ``JointC2ST()`` on the exact posterior, 200 datasets per d, and every check of
   ``cl.diagnose`` on the exact posterior; 99 % binomial band around 0.05, KS of p-values.

Run:  python examples/benchmarks/joint_c2st.py [--power-reps 30] [--level-reps 200]
Writes examples/benchmarks/results/joint_c2st.md (``--smoke``: tiny sizes, temporary folder).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

if not __package__:  # run as a file (python examples/x.py): make `examples` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
from scipy import stats

import calib_lightning as cl
from calib_lightning.tasks import GaussianToy
from calib_lightning.tasks._common import normal
from examples._smoke import add_smoke_argument, output_folder

RESULTS = Path(__file__).parent / "results"
CHECKS = ("kccsd", "ranks", "tarp", "joint_c2st")
LEVEL = 0.05


def blind(dim: int):
    """The prior as the posterior at every x."""
    return lambda x: normal(torch.zeros(x.shape[0], dim, dtype=x.dtype), 1.0)


def shrunk(toy: GaussianToy, t: float = 0.5):
    """The exact posterior moved a share ``t`` of the way to the prior N(0, I)."""
    variance = (1 - t) * toy.weight * toy.noise_std**2 + t
    return lambda x: normal((1 - t) * toy.weight * x, variance**0.5)


def estimators(toy: GaussianToy) -> dict:
    return {"exact": toy.posterior(), "blind prior": blind(toy.dim), "shrunk 0.5": shrunk(toy)}


def band(reps: int) -> tuple[float, float]:
    low, high = stats.binom.ppf([0.005, 0.995], reps, LEVEL) / reps
    return float(low), float(high)


def candidates(dims, reps, n, g) -> list[str]:
    """Power and seconds per check of the candidate tests on the blind prior."""
    rows = ["| d | test | power (blind prior) | seconds per check | datasets |",
            "| --- | --- | --- | --- | --- |"]  # fmt: skip
    for dim in dims:
        toy = GaussianToy(dim=dim)
        found: dict[str, list] = {}
        for _ in range(reps):
            theta, x = toy.sample(n, g)
            tests = {"JointC2ST()": cl.JointC2ST(),
                     "JointC2ST(num_ensemble=3)": cl.JointC2ST(num_ensemble=3)}  # fmt: skip
            for name, metric in tests.items():
                start = time.perf_counter()
                metric.update(blind(dim), theta, x)
                p = float(metric.compute().p_value)
                found.setdefault(name, []).append((p, time.perf_counter() - start))
            metric = cl.LC2STNF(observations=toy.sample(2, g)[1])
            for label in ("LC2STNF, first check (null trained)", "LC2STNF, later check"):
                start = time.perf_counter()
                metric.reset()
                metric.update(blind(dim), theta, x)
                p = float(metric.compute().global_p_value)
                found.setdefault(label, []).append((p, time.perf_counter() - start))
        for name, values in found.items():
            p = torch.tensor([v[0] for v in values])
            seconds = sum(v[1] for v in values) / len(values)
            rows.append(f"| {dim} | {name} | {float((p < LEVEL).double().mean()):.2f} | "
                        f"{seconds:.2f} | {len(values)} |")  # fmt: skip
        print("\n".join(rows[-len(found) :]), flush=True)
    return rows


def diagnose_table(dims, reps: dict, n, g) -> tuple[list[str], dict]:
    """Rejection rates and seconds of every check of cl.diagnose, per d and estimator."""
    rows = ["| d | estimator | datasets | " + " | ".join(CHECKS) + " | overall verdict | "
            "seconds: " + " / ".join(CHECKS) + " |",
            "| --- | --- | --- | " + "--- | " * (len(CHECKS) + 2)]  # fmt: skip
    level_p: dict = {}
    for dim in dims:
        toy = GaussianToy(dim=dim)
        for name, post in estimators(toy).items():
            count = reps[name]
            if not count:
                continue
            p = {c: [] for c in (*CHECKS, "overall")}
            seconds = dict.fromkeys(CHECKS, 0.0)
            for _ in range(count):
                theta, x = toy.sample(n, g)
                report = cl.diagnose(post, theta, x)
                for c in CHECKS:
                    result = report.checks[c]
                    p[c].append(float(getattr(result, type(result).verdict)))
                    seconds[c] += report.seconds[c] / count
                p["overall"].append(report.overall_p_value)
            rates = [
                float((torch.tensor(p[c]) < LEVEL).double().mean()) for c in (*CHECKS, "overall")
            ]
            cells = " | ".join(f"{r:.2f}" for r in rates)
            times = " / ".join(f"{seconds[c]:.2f}" for c in CHECKS)
            rows.append(f"| {dim} | {name} | {count} | {cells} | {times} |")
            print(rows[-1], flush=True)
            if name == "exact":
                level_p[dim] = {c: torch.tensor(v) for c, v in p.items()}
    return rows, level_p


def level_table(dims, reps, n, g, diagnose_p: dict) -> list[str]:
    rows = ["| d | test | datasets | rejection at 0.05 | 99 % band | KS p (uniform p-values) |",
            "| --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for dim in dims:
        toy = GaussianToy(dim=dim)
        p = []
        for _ in range(reps):
            theta, x = toy.sample(n, g)
            metric = cl.JointC2ST()
            metric.update(toy.posterior(), theta, x)
            p.append(float(metric.compute().p_value))
        tests = {"JointC2ST() alone": torch.tensor(p)}
        tests.update({f"diagnose: {c}": v for c, v in diagnose_p.get(dim, {}).items()})
        for name, values in tests.items():
            low, high = band(len(values))
            rate = float((values < LEVEL).double().mean())
            ks = stats.kstest(values.double().numpy(), "uniform").pvalue
            cells = f"{rate:.3f} | [{low:.3f}, {high:.3f}] | {ks:.2g}"
            rows.append(f"| {dim} | {name} | {len(values)} | {cells} |")
            print(rows[-1], flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--power-reps", type=int, default=30)
    parser.add_argument("--level-reps", type=int, default=200)
    parser.add_argument("--diagnose-level-reps", type=int, default=100)
    parser.add_argument("--candidate-reps", type=int, default=5)
    parser.add_argument("--n", type=int, default=1000)
    add_smoke_argument(parser)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dims = (3, 10, 50)
    if args.smoke:
        args.power_reps, args.level_reps, args.diagnose_level_reps, args.candidate_reps = 2, 4, 2, 1
        args.n, dims = 200, (3,)
    out = output_folder(RESULTS, args.smoke)
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    start = time.perf_counter()
    cand = candidates(dims[:2], args.candidate_reps, args.n, g)
    reps = {"exact": 0, "blind prior": args.power_reps, "shrunk 0.5": args.power_reps}
    power, _ = diagnose_table(dims, reps, args.n, g)
    reps = {"exact": args.diagnose_level_reps, "blind prior": 0, "shrunk 0.5": 0}
    level_rows, level_p = diagnose_table(dims[:2], reps, args.n, g)
    level = level_table(dims, args.level_reps, args.n, g, level_p)
    minutes = (time.perf_counter() - start) / 60
    command = "python examples/benchmarks/joint_c2st.py" + (" --smoke" if args.smoke else "")
    text = f"""# The joint classifier test (`cl.JointC2ST`) and the blind prior

Written by `{command}` ({minutes:.0f} min on one thread of the 2-core benchmark machine,
shared with other jobs: seconds are indicative). Gaussian toy `GaussianToy(dim=d)`
(exact posterior N(0.8 x, 0.2 I)), N = {args.n} pairs per dataset, fresh data per dataset,
level 0.05. Estimators: exact; blind prior q(theta | x) = N(0, I) (calibrated, useless);
shrunk 0.5 (mean 0.4 x, variance 0.6: half-way to the prior).

## 1. Which test: power per second on the blind prior

Public classes at their defaults (LC2STNF at two fresh observations, its
`global_p_value`; its first check trains the 100 null classifiers, a later check on the same
x reuses them).

{chr(10).join(cand)}

## 2. `cl.diagnose` at its defaults: rejection rate at 0.05 and seconds per check

The overall verdict is the Cauchy combination of the checks' p-values.

{chr(10).join(power)}

## 3. Level under the exact posterior

`JointC2ST()` alone over {args.level_reps} datasets per d; every check of `cl.diagnose`
(and its overall verdict) over {args.diagnose_level_reps} datasets at d = 3 and 10.

{chr(10).join(level_rows)}

{chr(10).join(level)}
"""
    (out / "joint_c2st.md").write_text(text)
    print(f"wrote {out / 'joint_c2st.md'}")


if __name__ == "__main__":
    main()
