"""Power curves on the perturbation suite of neural posterior testing (NPT, issue 23).

The failure modes of Chen, Bansal and Scott (2024) on
:class:`calib_lightning.tasks.NPTGaussian` (Gaussian posteriors whose mean and
covariance depend on ``x``): mean shift, covariance inflation, anisotropic distortion
along the least-variance direction, heavy tails (multivariate t, ``nu = 1 / strength``),
an extra reflected mode, mode collapse of a bimodal truth; and the blind prior
``q(theta | x) = p(theta)``. For each ``D`` and ``N`` and strength, fresh datasets:

* cheap checks, ``--reps`` datasets per strength (``--null-reps`` at strength 0, where
  every mode is the exact posterior): ``cl.diagnose(estimate, theta, x,
  checks=("kccsd", "ranks", "tarp"), seed=rep)`` at its defaults, read for KCCSD's
  ``p_value``, the ranks' ``global_p_value`` and its marginal and joint parts (the
  Cauchy combination of each part's chi-square and ECDF p-values), TARP's ``p_value``
  and the overall verdict (``Diagnosis.overall_p_value``, the package's combination);
  ``LatentCalibration()`` (defaults) where the estimate has latents (not the mixtures);
* expensive check, ``--lc2st-reps`` datasets per strength at ``N = 1000`` only:
  ``LC2STNF`` (defaults, 5 observations drawn from the marginal of ``x``) read for its
  ``global_p_value``. Its null classifiers depend on the calibration ``x`` only, so one
  ``x`` per ``D`` is drawn and kept, one null trained on it, and each dataset draws fresh
  ``theta ~ truth(x)``: power conditional on that ``x``, valid at every ``x``.

Every member's p-values are written to ``power_curves.json`` so that other combinations
of the same p-values can be read off the same datasets (Cauchy as before issue 23,
Bonferroni, ...); the table gives the rejection rate at 0.05 and, per mode, the strength
at which each check first reaches power 0.8 (linear interpolation between strengths),
and a 95 % paired bootstrap interval (over datasets) of the overall verdict's crossing
minus its best member's.

    python examples/benchmarks/power_curves.py [--smoke]
    python examples/benchmarks/power_curves.py --dims 50 ... --name power_curves_d50
        (another set of blocks, written beside: NAME.json, NAME.md and NAME.png)
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

import calib_lightning as cl
from calib_lightning.diagnosis._verdict import combine_verdicts
from calib_lightning.functional.combine import combine_p_values
from calib_lightning.posteriors.base import UnsupportedError
from calib_lightning.tasks import NPTGaussian

LEVEL = 0.05
#: strengths per mode (strength 0, the exact posterior, is shared by all modes)
STRENGTHS = {
    "mean_shift": (0.02, 0.04, 0.08, 0.16),
    "covariance": (0.1, 0.2, 0.4, 0.8),
    "anisotropic": (0.05, 0.1, 0.2, 0.4),
    "heavy_tails": (0.05, 0.1, 0.2, 0.4),
    "extra_mode": (0.02, 0.04, 0.08, 0.16),
    "mode_collapse": (0.02, 0.04, 0.08, 0.16),
}
CHECKS = ("kccsd", "ranks", "ranks_marginal", "ranks_joint", "tarp", "latent", "lc2st_nf",
          "cauchy", "weighted", "best@K", "overall")  # fmt: skip
MEMBERS = ("kccsd", "ranks", "tarp")  # the verdict without observations
#: the weights of issue 23's verdict (ranks 0.9, KCCSD 0.05, TARP 0.05), for comparison
ISSUE_23_WEIGHTS = {"kccsd": 0.05, "ranks": 0.9, "tarp": 0.05}
BOOTSTRAP = 2000  # resamples of the paired bootstrap of crossing_gap
NUM_OBSERVATIONS = 5


def cheap_checks(estimate: object, theta: torch.Tensor, x: torch.Tensor, seed: int) -> dict:
    report = cl.diagnose(estimate, theta, x, checks=("kccsd", "ranks", "tarp"), seed=seed)
    ranks = report.checks["ranks"]
    d = theta.shape[1]
    marginal = torch.cat([ranks.marginal_p_values, ranks.ecdf_p_values[:d]])
    joint = torch.stack([ranks.p_value, ranks.ecdf_p_values[d]])
    out = {
        "kccsd": float(report.checks["kccsd"].p_value),
        "ranks": float(ranks.global_p_value),
        "ranks_marginal": float(combine_p_values(marginal.double())),
        "ranks_joint": float(combine_p_values(joint.double())),
        "tarp": float(report.checks["tarp"].p_value),
    }
    assert combine_verdicts(out) == report.overall_p_value  # the same function as diagnose
    try:
        metric = cl.LatentCalibration()
        metric.update(estimate, theta, x)
        out["latent"] = float(metric.compute().global_p_value)
    except UnsupportedError:  # a mixture: no normal base
        pass
    return out


def run_cheap(task: NPTGaussian, n: int, reps: int, null_reps: int, seed: int) -> dict:
    cells: dict[str, dict[str, list[dict]]] = {}
    cases = [("exact", 0.0, null_reps), ("blind_prior", 0.0, null_reps)]
    cases += [(mode, s, reps) for mode, grid in STRENGTHS.items() for s in grid]
    for k, (mode, strength, count) in enumerate(cases):
        truth, estimate = task.case("covariance" if mode == "exact" else mode, strength)
        rows = []
        for rep in range(count):
            g = torch.Generator().manual_seed(seed * 1_000_003 + k * 10_007 + rep)
            theta, x = task.sample(n, truth, g)
            rows.append(cheap_checks(estimate, theta, x, seed=rep))
        cells.setdefault(mode, {})[f"{strength:g}"] = rows
    return cells


def one_case(dim: int, mode: str, strength: str, n: str, datasets: str) -> None:
    """``--case``: the cheap checks' and the combinations' rejection rates at one cell."""
    torch.set_num_threads(1)
    task = NPTGaussian(dim=dim)
    truth, estimate = task.case(mode, float(strength))
    rows = []
    for rep in range(int(datasets)):
        g = torch.Generator().manual_seed(777_000 + rep)
        theta, x = task.sample(int(n), truth, g)
        rows.append(cheap_checks(estimate, theta, x, seed=rep))
    for name in ("kccsd", "ranks", "tarp", "weighted", "overall", "best@K"):
        print(f"{name}: {rates(rows, name):.2f}")


def run_lc2st(task: NPTGaussian, n: int, reps: int, norm_feature: bool = False) -> dict:
    """``LC2STNF``'s global p-values: ``reps`` datasets per strength, twice as many at
    strength 0, on one ``x`` and one null seeded by ``D`` (every run of a ``D`` the same)."""
    null_reps, seed = 2 * reps, 7 + task.dim
    g = torch.Generator().manual_seed(seed)
    x = task.sample_x(n, g)
    observations = task.sample_x(NUM_OBSERVATIONS, g)
    metric = cl.LC2STNF(observations=observations, seed=seed, norm_feature=norm_feature)
    cells: dict[str, dict[str, list[dict]]] = {}
    cases = [("exact", 0.0, null_reps), ("blind_prior", 0.0, null_reps)]
    cases += [(mode, s, reps) for mode, grid in STRENGTHS.items() for s in grid]
    for mode, strength, count in cases:
        truth, estimate = task.case("covariance" if mode == "exact" else mode, strength)
        if mode in ("extra_mode",) and strength > 0:
            continue  # a mixture estimate has no latents
        rows = []
        for _ in range(count):
            with torch.random.fork_rng():
                torch.manual_seed(int(torch.randint(2**62, (), generator=g)))
                theta = truth(x).sample().to(x.dtype)
            metric.reset()
            metric.update(estimate, theta, x)
            rows.append({"lc2st_nf": float(metric.compute().global_p_value)})
        cells.setdefault(mode, {})[f"{strength:g}"] = rows
    return cells


def combined(row: dict, name: str) -> float | None:
    """A member's p-value, or a combination of the members' (``overall``: the package's
    :func:`combine_verdicts` as committed, equal weights since issue 42; ``cauchy``: the
    Cauchy combination used before issue 23; ``weighted``: issue 23's weighted
    Bonferroni, ranks 0.9, KCCSD and TARP 0.05)."""
    if name in row:
        return row[name]
    if name not in ("overall", "cauchy", "weighted") or not all(m in row for m in MEMBERS):
        return None
    members = {m: row[m] for m in MEMBERS}
    if name == "overall":
        return combine_verdicts(members)
    p = torch.tensor(list(members.values()), dtype=torch.float64)
    if name == "weighted":
        weights = torch.tensor([ISSUE_23_WEIGHTS[m] for m in members], dtype=torch.float64)
        return float(combine_p_values(p, method="holm", weights=weights))
    return float(combine_p_values(p, method="cauchy"))


def rates(rows: list[dict], name: str) -> float | None:
    """Rejection rate at LEVEL; ``best@K``: the largest of the members' rates at
    LEVEL / K (K = 3), what the equal-weight verdict must reach on the same datasets."""
    if name == "best@K":
        found = [rates_at(rows, m, LEVEL / len(MEMBERS)) for m in MEMBERS]
        return None if None in found else max(found)
    return rates_at(rows, name, LEVEL)


def rates_at(rows: list[dict], name: str, level: float) -> float | None:
    values = [v for r in rows if (v := combined(r, name)) is not None]
    return None if not values else sum(v < level for v in values) / len(values)


def crossing(points: list[tuple[float, float | None]], target: float = 0.8) -> float | None:
    """First strength where power reaches ``target``, linear between grid points."""
    previous = None
    for strength, power in points:
        if power is None:
            return None
        if power >= target:
            if previous is None:
                return strength
            s0, p0 = previous
            return s0 + (target - p0) / (power - p0) * (strength - s0)
        previous = (strength, power)
    return float("inf")


def crossing_gap(cheap: dict, lc2st: dict | None, mode: str, best: str,
                 reps: int = BOOTSTRAP, seed: int = 0) -> tuple[float, float]:
    """95 % paired bootstrap interval of ``crossing(overall) - crossing(best)``: the
    datasets of each strength resampled with replacement, the overall verdict and the
    member read on the same resampled datasets (``inf`` where one never reaches 0.8)."""
    generator = torch.Generator().manual_seed(seed)
    grid = [(0.0, merged(cheap, lc2st, "exact", "0"))]
    grid += [(float(s), merged(cheap, lc2st, mode, s)) for s in cheap[mode]]
    resampled = []
    for _, rows in grid:
        pairs = [(combined(r, "overall"), combined(r, best)) for r in rows]
        rejected = torch.tensor([p for p in pairs if None not in p], dtype=torch.float64) < LEVEL
        draw = torch.randint(len(rejected), (reps, len(rejected)), generator=generator)
        resampled.append(rejected[draw].double().mean(1).tolist())  # (reps, 2)
    gaps = []
    for i in range(reps):
        ends = [crossing([(x, powers[i][k]) for (x, _), powers in zip(grid, resampled,
                                                                          strict=True)])
                for k in (0, 1)]  # fmt: skip
        gaps.append(0.0 if ends[0] == ends[1] else ends[0] - ends[1])  # inf - inf: equal
    gaps.sort()
    return gaps[int(0.025 * reps)], gaps[int(0.975 * reps) - 1]


def merged(cheap: dict, lc2st: dict | None, mode: str, strength: str) -> list[dict]:
    rows = [dict(r) for r in cheap[mode][strength]]
    if lc2st is not None and strength in lc2st.get(mode, {}):
        for r, extra in zip(rows, lc2st[mode][strength], strict=False):
            r.update(extra)
        for extra in lc2st[mode][strength][len(rows) :]:
            rows.append(dict(extra))
    return rows


def table(results: dict) -> list[str]:
    lines, misses = [], []  # misses: (block, mode, overall - best, interval has 0)
    for key, block in results.items():
        cheap, lc2st = block["cheap"], block.get("lc2st")
        lines += [f"### {key}", "",
                  "| mode | strength | datasets | " + " | ".join(CHECKS) + " |",
                  "| --- | --- | --- | " + " | ".join("---" for _ in CHECKS) + " |"]  # fmt: skip
        for mode in ("exact", "blind_prior", *STRENGTHS):
            for strength in cheap[mode]:
                rows = merged(cheap, lc2st, mode, strength)
                cells = [rates(rows, c) for c in CHECKS]
                count = len(cheap[mode][strength])
                lines.append(f"| {mode} | {strength} | {count} | " + " | ".join(
                    "-" if c is None else f"{c:.2f}" for c in cells) + " |")  # fmt: skip
        lines += ["", "Strength at which power first reaches 0.8 (inf: not on the grid; "
                  "the best member among KCCSD, ranks and TARP; the overall verdict):", "",
                  "| mode | " + " | ".join(CHECKS) + " | best member | overall <= best@K | "
                  "overall <= best | overall - best, 95 % paired bootstrap |",
                  "| --- | " + " | ".join("---" for _ in CHECKS)
                  + " | --- | --- | --- | --- |"]  # fmt: skip
        for mode in STRENGTHS:
            found = {}
            for c in CHECKS:
                points = [(0.0, rates(merged(cheap, lc2st, "exact", "0"), c))]
                points += [(float(s), rates(merged(cheap, lc2st, mode, s), c))
                           for s in cheap[mode]]  # fmt: skip
                found[c] = crossing(points)
            best = min(v for c, v in found.items() if c in MEMBERS and v is not None)
            ok = found["overall"] is not None and found["overall"] <= best + 1e-12
            name = min((c for c in MEMBERS if found[c] is not None), key=found.__getitem__)
            low, high = crossing_gap(cheap, lc2st, mode, name)
            gap = f"{low:+.3g} .. {high:+.3g}" + (" (0 inside)" if low <= 0 <= high else "")
            if not ok:
                misses.append((key, mode, found["overall"] - best, low <= 0 <= high))
            at_k = found["overall"] is not None and found["overall"] <= found["best@K"] + 1e-12
            lines.append(f"| {mode} | " + " | ".join(
                "-" if v is None else f"{v:.3g}" for v in found.values())
                + f" | {best:.3g} ({name}) | {'yes' if at_k else 'NO'} | "
                f"{'yes' if ok else 'NO'} | {gap} |")  # fmt: skip
        lines.append("")
    if misses:
        worst = max(misses, key=lambda m: m[2])
        lines += [f"Against the best member at the full level 0.05 (which equal weights do not "
                  f"promise: the goal is best@K): later in {len(misses)} of "
                  f"{len(STRENGTHS) * len(results)} mode x block cells, each time later than "
                  f"its best member by at most {worst[2]:.3g} in strength ({worst[1]}, "
                  f"{worst[0]}); in {sum(m[3] for m in misses)} of them the 95 % paired "
                  "bootstrap interval of the gap contains 0, i.e. the datasets cannot tell "
                  "the two crossings apart.", ""]  # fmt: skip
    return lines


def before_after(before: dict, after: dict) -> list[str]:
    """Rejection rates at 0.05 of a run before issue 42 (``before``: its TARP, its verdict
    read as issue 23's weighted rule) beside this run's, at every strength of the blocks
    both ran: the same datasets (seeded per block), the checks' own random numbers not."""
    lines = ["## Before and after issue 42", "",
             "Rejection rate at 0.05 on the same datasets (each block's data are seeded; "
             "the checks' own random numbers differ, so the ranks' columns move a little; "
             "before: "
             "commit 779939c's `power_curves.json`, TARP with one reference per pair and the "
             "verdict weighted ranks 0.9, KCCSD and TARP 0.05; after: this run, TARP over 16 "
             "references with its exact permutation null and the equal-weight verdict). "
             "KCCSD's and the ranks' code did not change.", "",
             "| block | mode | strength | TARP before | TARP after | KCCSD before | KCCSD after "
             "| ranks before | ranks after | verdict before | verdict after | best@K after |",
             "|" + " --- |" * 12]  # fmt: skip
    lower = []
    for key in [k for k in after if k in before]:
        old, new = before[key]["cheap"], after[key]["cheap"]
        for mode in ("exact", "blind_prior", *STRENGTHS):
            for strength in [s for s in new.get(mode, {}) if s in old.get(mode, {})]:
                was, now = old[mode][strength], new[mode][strength]
                cells = [rates(was, "tarp"), rates(now, "tarp"), rates(was, "kccsd"),
                         rates(now, "kccsd"), rates(was, "ranks"), rates(now, "ranks"),
                         rates(was, "weighted"), rates(now, "overall"), rates(now, "best@K")]
                lines.append(f"| {key} | {mode} | {strength} | " + " | ".join(
                    "-" if c is None else f"{c:.2f}" for c in cells) + " |")  # fmt: skip
                if mode not in ("exact", "blind_prior"):
                    lower += [(name, key, mode, strength, a - b) for name, a, b in
                              (("TARP", cells[0], cells[1]), ("verdict", cells[6], cells[7]))
                              if a is not None and b is not None and a - b > 0]  # fmt: skip
    worst = sorted(lower, key=lambda item: -item[4])[:4]
    lines += ["", f"Rows where a rate fell (miscalibrated modes): {len(lower)}; the largest "
              "drops: " + ("; ".join(f"{n} {k}, {m} {s}: -{d:.2f}" for n, k, m, s, d in worst)
                           or "none") + ".", ""]  # fmt: skip
    return lines


def figure(results: dict, path: Path) -> None:
    """A panel per failure mode (three a row, two rows per block), a line per check, and
    one legend under the panels."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullLocator

    keys, columns = list(results), 3
    per_block = -(-len(STRENGTHS) // columns)
    rows = per_block * len(keys)
    fig, axes = plt.subplots(rows, columns, squeeze=False, sharey=True,
                             figsize=(3.6 * columns, 2.5 * rows + 0.8))  # fmt: skip
    styles = {"overall": ("black", "-", 2.5), "kccsd": ("C0", "-", 1.2), "ranks": ("C1", "-", 1.2),
              "ranks_marginal": ("C1", ":", 1.2), "ranks_joint": ("C1", "--", 1.2),
              "tarp": ("C2", "-", 1.2), "latent": ("C3", "-", 1.2),
              "lc2st_nf": ("C4", "-", 1.2), "cauchy": ("grey", "--", 1.5),
              "weighted": ("C5", ":", 1.5), "best@K": ("C6", "--", 1.5)}  # fmt: skip
    legend: dict[str, object] = {}
    for i, key in enumerate(keys):
        cheap, lc2st = results[key]["cheap"], results[key].get("lc2st")
        for j, mode in enumerate(STRENGTHS):
            ax = axes[per_block * i + j // columns, j % columns]
            strengths = ["0", *cheap[mode]]
            for c in CHECKS:
                ys = [rates(merged(cheap, lc2st, "exact" if s == "0" else mode, s), c)
                      for s in strengths]  # fmt: skip
                pts = [(float(s), y) for s, y in zip(strengths, ys, strict=True) if y is not None]
                if len(pts) > 1:
                    color, style, width = styles[c]
                    (line,) = ax.plot(*zip(*pts, strict=True), color=color, ls=style, lw=width,
                                      marker=".", label=c)  # fmt: skip
                    legend.setdefault(c, line)
            ax.axhline(LEVEL, color="grey", lw=0.5)
            ax.axhline(0.8, color="grey", lw=0.5, ls=":")
            ax.set_xscale("symlog", linthresh=min(STRENGTHS[mode]))
            ax.set_xticks([float(s) for s in strengths], strengths)  # the grid, no overlaps
            ax.xaxis.set_minor_locator(NullLocator())
            ax.set_title(f"{mode}, {key}", fontsize=9)
            ax.tick_params(labelsize=8)
    order = [c for c in CHECKS if c in legend]
    fig.legend([legend[c] for c in order], order, loc="lower center", ncol=5, fontsize=9,
               frameon=False)  # fmt: skip
    inch = 1 / fig.get_figheight()  # the legend takes the bottom 0.5 in, the label above it
    fig.supxlabel("strength", y=0.55 * inch, va="bottom", fontsize=10)
    fig.supylabel(f"rejection rate at {LEVEL}", fontsize=10)
    fig.tight_layout(rect=(0.015, 0.8 * inch, 1.0, 1.0))
    fig.savefig(path, dpi=100)


def add_lc2st(path: Path, reps: int) -> None:
    """LC2STNF's p-values added to a saved run that has none (the cheap checks untouched),
    with the seeds a full run gives it; the run's seconds grow by LC2STNF's."""
    torch.set_num_threads(1)
    saved = json.loads(path.read_text())
    n = max(saved["args"]["sizes"])
    for d in saved["args"]["dims"]:
        key, begin = f"D = {d}, N = {n}", time.perf_counter()
        saved["results"][key]["lc2st"] = run_lc2st(NPTGaussian(dim=d), n, reps)
        saved["seconds"][key] += time.perf_counter() - begin
        print(f"{key}: LC2STNF {time.perf_counter() - begin:.0f} s", flush=True)
    saved["args"]["lc2st_reps"] = reps
    path.write_text(json.dumps(saved))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--dims", type=int, nargs="+", default=[3, 10])
    parser.add_argument("--sizes", type=int, nargs="+", default=[100, 1000])
    parser.add_argument("--reps", type=int, nargs="+", default=[80, 30],
                        help="datasets per strength, one number per size")  # fmt: skip
    parser.add_argument("--null-reps", type=int, nargs="+", default=[200, 100])
    parser.add_argument("--lc2st-reps", type=int, default=20)
    parser.add_argument("--name", default="power_curves", help="NAME.json, .png and .md")
    parser.add_argument("--from-json", type=Path, default=None,
                        help="re-render the table and figure from a run's p-values")  # fmt: skip
    parser.add_argument("--case", nargs=4, default=None,
                        metavar=("MODE", "STRENGTH", "N", "DATASETS"),
                        help="one cell only (D = --dims[0]): print each check's rejection "
                        "rate on DATASETS fresh sets and write nothing")  # fmt: skip
    parser.add_argument("--before", type=Path, default=None,
                        help="a run's p-values from before issue 42: add a before/after "
                        "table of the blocks both ran")  # fmt: skip
    parser.add_argument("--add-lc2st", type=Path, default=None,
                        help="a run's p-values without LC2STNF: run LC2STNF (--lc2st-reps) "
                        "at its largest N, add it and re-render")  # fmt: skip
    args = parser.parse_args()
    added, before = args.add_lc2st, args.before
    if args.case is not None:
        one_case(args.dims[0], *args.case)
        return
    if added is not None:
        add_lc2st(added, args.lc2st_reps)
        args.from_json = added
    name = args.name if args.from_json is None else args.from_json.stem
    torch.set_num_threads(1)
    if args.smoke:
        args.dims, args.sizes, args.reps, args.null_reps, args.lc2st_reps = [3], [100], [2], [2], 2
        for mode in STRENGTHS:
            STRENGTHS[mode] = STRENGTHS[mode][-1:]
        folder = Path(tempfile.mkdtemp())
    else:
        folder = Path(__file__).parent / "results"
    results, seconds = {}, {}
    if args.from_json is not None:
        folder, saved = args.from_json.parent, json.loads(args.from_json.read_text())
        results, seconds, args.__dict__ = saved["results"], saved["seconds"], saved["args"]
        args.from_json = True
    for d in [] if args.from_json else args.dims:
        task = NPTGaussian(dim=d)
        for k, n in enumerate(args.sizes):
            key, begin = f"D = {d}, N = {n}", time.perf_counter()
            results[key] = {
                "cheap": run_cheap(task, n, args.reps[k], args.null_reps[k], 1000 * d + n)
            }
            if n == max(args.sizes) and args.lc2st_reps:
                results[key]["lc2st"] = run_lc2st(task, n, args.lc2st_reps)
            seconds[key] = time.perf_counter() - begin
            print(f"{key}: {seconds[key]:.0f} s", flush=True)
            run = {
                "results": results,
                "seconds": seconds,
                "args": {**vars(args), "from_json": None},
            }
            (folder / f"{name}.json").write_text(json.dumps(run))  # after each block
    figure(results, folder / f"{name}.png")
    command = "python examples/benchmarks/power_curves.py" + (" --smoke" if args.smoke else "")
    if added is not None:
        command += (f" --name {name}`, LC2STNF added by `--add-lc2st .../{name}.json "
                    f"--lc2st-reps {args.lc2st_reps}")
    elif args.from_json:
        if name != "power_curves":
            command += f" --name {name}"
        command += f"`, table re-read by `--from-json .../{name}.json"
    elif name != "power_curves":
        command += f" --name {name}"
    if before is not None:  # BEFORE: git show 779939c:examples/benchmarks/results/power_curves.json
        command += " --before BEFORE"
    text = "\n".join([
        "# Power curves on the NPT perturbation suite", "",
        f"Written by `{command}`" + (" (BEFORE: `git show 779939c:examples/benchmarks/"
                                     "results/power_curves.json`)" if before else "")
        + f" (dims {args.dims}, N {args.sizes}, datasets per strength "
        f"{args.reps}, at strength 0 {args.null_reps}; LC2STNF {args.lc2st_reps} per "
        f"strength at N = {max(args.sizes)}, one x and one null per D). Rejection rate at "
        f"{LEVEL}; `overall` is the verdict of `cl.diagnose` without observations "
        "(KCCSD, ranks, TARP) as the package now combines them (equal-weight Bonferroni, "
        "`min(1, 3 min p)`, issue 42), `best@K` the largest rate of the three at 0.05 / 3 on "
        "the same datasets (the overall verdict is at least that on every row, by "
        "construction), `weighted` issue 23's rule (ranks 0.9, KCCSD and TARP 0.05 of the "
        "level), `cauchy` their Cauchy combination (the verdict before issue 23); "
        "`exact` is strength 0 of every mode. Figure: "
        f"[`{name}.png`]({name}.png); p-values: `{name}.json`.", "",
        *table(results),
        *(before_after(json.loads(before.read_text())["results"], results)
          if before is not None else []),
        "Seconds per block: " + ", ".join(f"{k}: {v:.0f}" for k, v in seconds.items())
        + f"; total {sum(seconds.values()):.0f} s.", "",
    ])  # fmt: skip
    (folder / f"{name}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
