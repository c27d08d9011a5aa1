"""L-C2ST-NF with and without the latent's norm as a classifier feature, on the NPT suite.

``cl.LC2STNF(norm_feature=True)`` gives its classifiers (the null's too) the latent's
standardised squared norm beside the latent. This script runs ``power_curves.py``'s
L-C2ST-NF part both ways on the same datasets: :class:`calib_lightning.tasks.NPTGaussian`
at each ``D``, ``N`` calibration pairs, one calibration ``x`` and one null per ``D`` and
setting, ``--reps`` fresh ``theta ~ truth(x)`` per failure mode and strength (twice as
many at strength 0), 5 observations, the global p-value at 0.05. Writes
``results/lc2st_norm_feature.md`` and ``.json``.

    python examples/benchmarks/lc2st_norm_feature.py [--dims 3 10 50] [--reps 20]
    (``--smoke``: D = 3, N = 100, 2 datasets, a temporary folder)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

if not __package__:  # run as a file (python examples/x.py): make `examples` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from calib_lightning.tasks import NPTGaussian
from examples._smoke import add_smoke_argument, output_folder
from examples.benchmarks.power_curves import rates, run_lc2st

RESULTS = Path(__file__).resolve().parent / "results"
SETTINGS = {"latents": False, "latents + norm": True}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dims", type=int, nargs="*", default=[3, 10, 50])
    parser.add_argument("--n", type=int, default=1000)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--merge", type=Path, nargs="*", default=[],
                        help="json of runs over other settings: one table")  # fmt: skip
    add_smoke_argument(parser)
    args = parser.parse_args()
    if args.smoke:
        args.dims, args.n, args.reps = [3], 100, 2
    torch.set_num_threads(1)
    folder = output_folder(RESULTS, args.smoke)
    runs: dict = {}
    for path in args.merge:
        runs.update(json.loads(path.read_text()))
    for d in args.dims:
        for name in args.settings:
            start = time.perf_counter()
            cells = run_lc2st(NPTGaussian(dim=d), args.n, args.reps, SETTINGS[name])
            found = {mode: {s: rates(rows, "lc2st_nf") for s, rows in cell.items()}
                     for mode, cell in cells.items()}  # fmt: skip
            runs[f"{d}|{name}"] = {"rates": found, "seconds": time.perf_counter() - start}
            print(d, name, f"{runs[f'{d}|{name}']['seconds']:.0f} s", flush=True)
    stem = "lc2st_norm_feature" + ("_" + "_".join(args.settings).replace(" + ", "_")
                                   if len(args.settings) < len(SETTINGS) else "")  # fmt: skip
    (folder / f"{stem}.json").write_text(json.dumps(runs))
    command = " ".join(["python examples/benchmarks/lc2st_norm_feature.py", *sys.argv[1:]])
    lines = ["# L-C2ST-NF with and without the latent's norm as a feature (NPT suite)", "",
             f"Written by `{command}`. Rejection rate of the global p-value at 0.05 over "
             f"{args.reps} datasets per strength ({2 * args.reps} at strength 0), N = "
             f"{args.n} pairs, one calibration x and one null per D and setting, the same "
             "datasets for both settings (`power_curves.py`'s seeds); `exact` and "
             "`blind_prior` are strength 0. Seconds: the null and every check of a D.", ""]
    dims = sorted({int(k.split("|")[0]) for k in runs})
    for d in dims:
        names = [name for name in SETTINGS if f"{d}|{name}" in runs]
        if not names:
            continue
        first = runs[f"{d}|{names[0]}"]["rates"]
        lines += [f"## D = {d}", "", "| mode | strength | " + " | ".join(names) + " |",
                  "| --- | --- | " + " | ".join("---:" for _ in names) + " |"]  # fmt: skip
        for mode, cell in first.items():
            for s in cell:
                values = [runs[f"{d}|{name}"]["rates"][mode].get(s) for name in names]
                lines.append(f"| {mode} | {s} | " + " | ".join(
                    "-" if v is None else f"{v:.2f}" for v in values) + " |")  # fmt: skip
        seconds = [f"{name} {runs[f'{d}|{name}']['seconds']:.0f}" for name in names]
        lines += ["", "Seconds: " + ", ".join(seconds) + ".", ""]
    (folder / f"{stem}.md").write_text("\n".join(lines))
    print(f"wrote {folder / f'{stem}.md'} {folder / f'{stem}.json'}")


if __name__ == "__main__":
    main()
