"""Peak memory and time of the sampling checks on a spline flow, under the memory budget.

``RankCalibration``, ``TARP`` and ``cl.diagnose`` (KCCSD, ranks, TARP, the joint
classifier test and recovery; 1,000 draws per pair) on an untrained
``zuko.flows.NSF(5, 5)``, each case in a fresh Python
process whose peak resident memory (``resource.getrusage(...).ru_maxrss``) is read after
the check, minus the peak after importing and building the flow. Three chunkings:

* ``budget``: the default memory budget (``cl.get_memory_budget()``, 256 MiB), chunks
  sized by the measured peak of the first chunks;
* ``old default``: the chunking before the budget, ``2**20`` numbers of draws per
  sampling call (``max_chunk_elements`` / ``chunk_size`` given explicitly);
* ``unchunked``: every draw of every pair in one sampling call.

The old default and unchunked run at the smaller ``N`` only: at ``N = 2,000`` the old
default's chunks are the same size as at ``N = 500`` (issue 24 measured 5-6 GB there),
and unchunked grows with ``N``; the benchmark machine is shared. At the larger ``N`` only
the checks in ``--large-checks`` run (default ``RankCalibration``: on the 2-core machine
one NSF check at ``N = 2,000`` takes about 15 minutes).

On a GPU (``--device cuda``) the peak is ``torch.cuda.max_memory_allocated()`` during the
check above what was allocated before it, and the table is ``memory_cuda.md``.

Run: python examples/benchmarks/memory.py [--sizes 200 2000] [--large-checks RankCalibration]
[--device cuda]
(``--smoke``: N = 20, 50 draws, the table in a temporary folder)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

if not __package__:  # run as a file (python examples/x.py): make `examples` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from examples._smoke import add_smoke_argument, output_folder

RESULTS = Path(__file__).resolve().parent / "results"
ROOT = Path(__file__).resolve().parents[2]

CASE = r"""
import json, resource, sys, time
import torch, zuko
torch.set_num_threads(1)
import calib_lightning as cl
check, chunking, n, draws = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
device = torch.device(sys.argv[5])
torch.manual_seed(0)
flow = zuko.flows.NSF(5, 5).to(device)
theta, x = torch.randn(n, 5).to(device), torch.randn(n, 5).to(device)
with torch.no_grad():
    flow(x[:2]).sample((2,))  # warm up the flow's code paths
if device.type == "cuda":  # the allocator's peak above what is allocated now
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated() / 2**20
    torch.cuda.reset_peak_memory_stats()
    rss = lambda: torch.cuda.max_memory_allocated() / 2**20 if used else allocated
else:
    rss = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # MiB (Linux: KiB)
used = False
before = rss()
used = True
elements = {"budget": None, "old default": 2**20, "unchunked": n * draws * 5}[chunking]
start = time.perf_counter()
if check == "RankCalibration":
    metric = cl.RankCalibration(draws, max_chunk_elements=elements)
    metric.update(flow, theta, x)
    p = float(metric.compute().global_p_value)
elif check == "TARP":
    rows = None if elements is None else max(1, elements // (draws * 5))
    metric = cl.TARP(draws, chunk_size=rows)
    metric.update(flow, theta, x)
    p = float(metric.compute().p_value)
else:
    import calib_lightning.diagnosis._run as run
    if elements is not None:  # diagnose's one sampling pass, in the chunks asked for
        inner = run.draw_chunks
        run.draw_chunks = lambda *a, **k: inner(*a, max_chunk_elements=elements)
    report = cl.diagnose(flow, theta, x, num_posterior_samples=draws)
    p = float(report.checks["ranks"].global_p_value)
if device.type == "cuda":
    torch.cuda.synchronize()
seconds = time.perf_counter() - start
print(json.dumps({"seconds": seconds, "peak_mib": rss() - before, "p": p,
                  "budget_mib": cl.get_memory_budget() / 2**20}))
"""


def run_case(check: str, chunking: str, n: int, draws: int, device: str = "cpu") -> dict:
    out = subprocess.run(
        [sys.executable, "-c", CASE, check, chunking, str(n), str(draws), device],
        capture_output=True, text=True, cwd=ROOT, check=True,
    )  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[200, 2000])
    parser.add_argument("--draws", type=int, default=1000)
    parser.add_argument("--large-checks", nargs="+", default=["RankCalibration"],
                        choices=["RankCalibration", "TARP", "diagnose"])  # fmt: skip
    parser.add_argument("--device", default="cpu", help="cpu, or cuda: the peak is then "
                        "torch.cuda.max_memory_allocated above what was allocated before")
    parser.add_argument("--out", type=Path, help="the table's path (default: results/)")
    add_smoke_argument(parser)
    args = parser.parse_args()
    if args.smoke:
        args.sizes, args.draws = [20], 50
    name = "memory.md" if args.device == "cpu" else f"memory_{args.device}.md"
    results = args.out or output_folder(RESULTS, args.smoke) / name
    small = min(args.sizes)
    rows = []
    for n in args.sizes:
        for check in ("RankCalibration", "TARP", "diagnose"):
            for chunking in ("budget", "old default", "unchunked"):
                if n != small and (chunking != "budget" or check not in args.large_checks):
                    continue
                out = run_case(check, chunking, n, args.draws, args.device)
                print(check, chunking, n, out, flush=True)
                rows.append((n, check, chunking, out))
    budget = rows[0][3]["budget_mib"]
    lines = [
        "# Peak memory of the sampling checks on zuko.flows.NSF(5, 5)",
        "",
        f"Written by `examples/benchmarks/memory.py --device {args.device}` ({args.draws:,} "
        "draws per pair, untrained NSF(5, 5), D = 5, one torch thread, each case in a fresh "
        "process, on " + (torch_device_name(args.device)) + "). Peak: " + (
            "`ru_maxrss` after the check minus after building the flow"
            if args.device == "cpu" else "`torch.cuda.max_memory_allocated()` during the "
            "check minus what was allocated before it") + ", MiB. Budget: "
        f"{budget:.0f} MiB, the default. Time ratio: to the unchunked run at the same N.",
        "",
        "| N | check | chunking | peak MiB | seconds | time / unchunked | p-value |",
        "| ---: | --- | --- | ---: | ---: | ---: | ---: |",
    ]
    base = {(n, c): o["seconds"] for n, c, k, o in rows if k == "unchunked"}
    for n, check, chunking, out in rows:
        ratio = out["seconds"] / base[(n, check)] if (n, check) in base else float("nan")
        ratio_text = "-" if ratio != ratio else f"{ratio:.2f}"
        lines.append(f"| {n:,} | {check} | {chunking} | {out['peak_mib']:.0f} | "
                     f"{out['seconds']:.1f} | {ratio_text} | {out['p']:.3g} |")  # fmt: skip
    results.write_text("\n".join(lines) + "\n")
    print("wrote", results)


def torch_device_name(device: str) -> str:
    import platform

    import torch

    if device.startswith("cuda"):
        return f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}"
    return f"{platform.machine()} CPU, torch {torch.__version__}"


if __name__ == "__main__":
    main()
