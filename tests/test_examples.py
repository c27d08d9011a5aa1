"""Every example and benchmark script runs in its ``--smoke`` mode (tiny sizes, seconds).

The scripts are found by glob (``examples/*.py``, ``examples/benchmarks/*.py``, not the
``_`` helpers), so a new script without ``--smoke`` fails here. Each one runs in this
process as ``python <script> --smoke`` would run it (``runpy``, ``__name__ ==
"__main__"``; no interpreter start-up per script), from a temporary working folder. A
smoke run must exit cleanly, leave every committed file under ``examples/`` as it was,
and write what it reports (``wrote <path> ...``) to a temporary folder.
"""

import os
import random
import runpy
import sys
import tempfile
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
SCRIPTS = sorted(
    path
    for path in [*EXAMPLES.glob("*.py"), *EXAMPLES.glob("benchmarks/*.py")]
    if not path.name.startswith("_")
)
# what a smoke run prints: a summary, or "wrote <file> ..." for the files it wrote (a
# script not listed here only has to exit cleanly and leave examples/ as it was)
EXPECTED = {
    "npe_two_moons.py": ["Calibration on 64 held-out pairs", "lc2st_nf", "Cost of the checks"],
    "npe_slcp_nflows.py": ["Calibration on 64 held-out pairs", "lc2st_nf", "Cost of the checks"],
    "npe_regularized.py": ["plain NPE", "LatentScale (val)", "NPE + 5 * latent coverage",
                           "joint-rank p-value"],
    "diagnose_posthoc.py": ["Verdict: ", "misspecification", "report: "],
    "fmpe_sbi.py": ["Verdict: ", "kccsd", "lc2st_nf", "reference", "report: "],
    "kccsd_demo.py": ["MGM, calibrated (delta=0)", "HGM, variance inflated near c"],
    "callback_overhead.py": ["| npe_two_moons |", "| npe_slcp_nflows |", "wrote "],
    "kccsd_rejection.py": ["| MGM (calibrated) | 32 |", "wrote "],
    "kccsd_speed.py": ["| 64 |", "wrote "],
    "lc2st_speed.py": ["sbi FMPE D=2: latents", "sbi NPSE D=2: latents", "wrote "],
    "lc2st_vs_sbi.py": ["wrote "],
    "local_hpd.py": ["| local-HPD |", "wrote "],
    "ranks_vs_sbi.py": ["| 100 | exact |", "wrote "],
    "regularizer_design.py": ["| latent | 2 |", "| TwoMoons (2) |", "wrote "],
    "regularizer_study.py": ["| two_moons | 100 | npe |", "wrote "],
    "scale.py": ["## D = 3: seconds per check", "| latent |", "## Images", "wrote "],
    "tarp_vs_sbi.py": ["| exact posterior |", "wrote "],
    # every model, every test of the package (a renamed test or result key shows here)
    "level_audit.py": [
        "### corr2", "### flow2", "### diag6", "| kccsd | p_value |", "| skce | p_value |",
        "| ranks | global_p_value |", "| tarp | p_value |", "| lc2st | global_p_value |",
        "| lc2stnf | global_p_value |",
    ],
}


def committed_files() -> dict[Path, tuple[int, int]]:
    """Size and modification time of every file under examples/ (caches aside)."""
    return {
        path: (path.stat().st_size, path.stat().st_mtime_ns)
        for path in EXAMPLES.rglob("*")
        if path.is_file() and "__pycache__" not in path.parts
    }


@pytest.fixture
def isolated(tmp_path, monkeypatch):
    """A script's global side effects (argv, path, cwd, temp folder, seeds, threads) undone."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [*sys.path])
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setenv("PL_GLOBAL_SEED", "0")  # lightning's seed_everything sets it
    threads, python_state = torch.get_num_threads(), random.getstate()
    numpy_state = np.random.get_state()  # noqa: NPY002 - the global state that scripts seed
    with torch.random.fork_rng():
        yield tmp_path
    torch.set_num_threads(threads)
    np.random.set_state(numpy_state)  # noqa: NPY002
    random.setstate(python_state)
    plt.close("all")


def test_every_script_is_found():
    names = {path.name for path in SCRIPTS}
    assert {"npe_two_moons.py", "kccsd_demo.py", "callback_overhead.py"} <= names
    assert set(EXPECTED) <= names


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda path: str(path.relative_to(EXAMPLES)))
def test_smoke(script, isolated, monkeypatch, capsys):
    assert "--smoke" in script.read_text(), f"{script.name} has no --smoke mode"
    before = committed_files()
    monkeypatch.setattr(sys, "argv", [str(script), "--smoke"])
    code = 0
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as exit_:  # argparse's error for an unknown --smoke, or sys.exit
        code = exit_.code
    out = capsys.readouterr().out

    assert code in (None, 0), f"{script.name} --smoke exited with {code}"

    assert committed_files() == before, "a smoke run changed files under examples/"
    for text in EXPECTED.get(script.name, []):
        assert text in out, f"{text!r} not in the output of {script.name} --smoke:\n{out}"
    written = [
        Path(word) for line in out.splitlines() if line.startswith("wrote ")
        for word in line.split()[1:] if os.sep in word
    ]  # fmt: skip
    for path in written:
        assert path.is_file(), f"{script.name} reported {path}, which does not exist"
        assert path.resolve().is_relative_to(isolated.resolve()), (
            f"{script.name} --smoke wrote {path} outside its temporary folder"
        )
