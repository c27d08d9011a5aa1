"""Why the joint classifier test trains on one posterior draw per pair: its folds' dependence.

NPT Gaussian (:class:`calib_lightning.tasks.NPTGaussian`, ``D = 3``), ``N`` pairs, the
exact posterior, ``M = 100`` draws, ``--datasets`` fresh datasets tested at once through
:func:`calib_lightning.classifiers.joint_c2st_test` (two folds, four repetitions, the
default classifier with the given mini-batch size), with ``L`` posterior draws of each
training pair in class 0. Each fold's statistic is exactly N(0, 1) under the null
whatever ``L``; the folds' correlation within a repetition is what the Cauchy
combination has to absorb. For each (``L``, batch size): the folds' mean and standard
deviation, their correlation within a repetition, the rejection rate at 0.05 with its
99 % binomial band, and the seconds. With ``--case over-confident`` the draws come from
the exact posterior with its covariance x 0.85 (``seed_stability.py``'s over-confident
case): the rejection rate is the power, and the fold mean says in which direction the
classifiers found the difference.

    python examples/benchmarks/joint_c2st_train_draws.py [--smoke] [--datasets 40]
    python examples/benchmarks/joint_c2st_train_draws.py --case over-confident

Writes examples/benchmarks/results/joint_c2st_train_draws.md
(``joint_c2st_train_draws_overconfident.md`` with ``--case over-confident``).
"""

from __future__ import annotations

import argparse
import platform
import subprocess
import time
from pathlib import Path

import torch
from scipy import stats

import calib_lightning.classifiers.joint_c2st as core
from calib_lightning.classifiers import joint_c2st_folds, make_ensemble
from calib_lightning.tasks import NPTGaussian

RESULTS = Path(__file__).parent / "results"
CONFIGS = ((1, 64), (1, 256), (10, 64), (10, 256))  # L, batch size
OVERCONFIDENT = 0.85  # covariance factor of seed_stability.py's over-confident case


def run(
    train_draws: int, batch: int, reps: int, n: int, draws: int, case: str = "exact"
) -> tuple[float, ...]:
    """Fold mean, sd, correlation within a repetition, rejection rate, seconds."""
    task = NPTGaussian(dim=3)
    exact = task.case("mean_shift", 0.0)[0]
    estimate = exact if case == "exact" else task._gaussian(covariance_factor=OVERCONFIDENT)
    generator = torch.Generator().manual_seed(500)
    pairs = [task.sample(n, exact, generator) for _ in range(reps)]
    theta, x = torch.stack([t for t, _ in pairs]), torch.stack([o for _, o in pairs])
    with torch.random.fork_rng():
        torch.manual_seed(900)
        samples = torch.stack([estimate(o).sample((draws,)) for o in x])
    folds = joint_c2st_folds(n, 2, 4, torch.Generator().manual_seed(1))
    classifier = make_ensemble("mlp", reps * 8, seed=3, batch_size=batch)
    seen: list[torch.Tensor] = []
    original = core.normal_two_sided_p_value
    core.normal_two_sided_p_value = lambda z: seen.append(z) or original(z)
    start = time.perf_counter()
    try:
        _, p, _, _ = core.joint_c2st_test(theta, x, samples, classifier, folds,
                                          torch.Generator().manual_seed(2),
                                          train_draws=train_draws)  # fmt: skip
    finally:
        core.normal_two_sided_p_value = original
    z = seen[-1]  # (B, R, K): the folds' statistics
    pair = torch.stack([z[..., 0].flatten(), z[..., 1].flatten()])
    return (float(z.mean()), float(z.std()), float(torch.corrcoef(pair)[0, 1]),
            float((p < 0.05).double().mean()), time.perf_counter() - start)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--datasets", type=int, default=40)
    parser.add_argument("--n", type=int, default=1000)
    parser.add_argument(
        "--case",
        choices=("exact", "over-confident"),
        default="exact",
        help="the posterior whose draws are tested: the exact one (the level) or its "
        f"covariance x {OVERCONFIDENT} (seed_stability.py's over-confident case: the power, "
        "and the sign of the fold statistics)",
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    reps, n, draws = (2, 40, 12) if args.smoke else (args.datasets, args.n, 100)
    configs = CONFIGS[-1:] if args.smoke else CONFIGS
    low, high = stats.binom.ppf([0.005, 0.995], reps, 0.05) / reps
    rows, start = [], time.perf_counter()
    for train_draws, batch in configs:
        mean, sd, corr, rate, sec = run(train_draws, batch, reps, n, draws, args.case)
        rows.append(f"| {train_draws} | {batch} | {mean:.2f} | {sd:.2f} | {corr:.2f} | "
                    f"{rate:.3f} | [{low:.3f}, {high:.3f}] | {sec:.0f} |")  # fmt: skip
        print(rows[-1], flush=True)
    if args.smoke:
        return
    exact = args.case == "exact"
    suffix, suffix_flag = ("", "") if exact else ("_overconfident", " --case over-confident")
    posterior = "the exact posterior"
    if not exact:
        posterior += f"'s covariance x {OVERCONFIDENT} (over-confident)"
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, check=False).stdout.strip()  # fmt: skip
    text = "\n".join([
        "# The joint classifier test: draws per training pair and the folds' dependence", "",
        f"Written by `python examples/benchmarks/joint_c2st_train_draws.py --datasets "
        f"{reps}{suffix_flag}` at commit {commit} ({platform.machine()}, one thread, "
        f"{(time.perf_counter() - start) / 60:.0f} min). NPT Gaussian D = 3, N = {n}, "
        f"{posterior}, M = {draws}, {reps} fresh datasets, two folds, four "
        "repetitions, Cauchy combination of the 8 fold p-values (two-sided: a fold "
        "statistic below 0 means the classifiers rank the held-out truths below the "
        "draws).", "",
        "| L (draws per training pair) | batch size | fold Z mean | fold Z sd | correlation "
        "of the two folds | rejection rate at 0.05 | 99 % band | seconds |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |", *rows, "",
    ])  # fmt: skip
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"joint_c2st_train_draws{suffix}.md").write_text(text)


if __name__ == "__main__":
    main()
