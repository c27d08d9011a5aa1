"""The ``--smoke`` mode every example and benchmark script has.

``--smoke`` runs the script's own code path at tiny sizes (seconds) and writes what it
would write (tables, figures, TensorBoard logs) to a fresh temporary folder, never over
the committed results in ``examples/benchmarks/results/`` or ``examples/figures/``.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

__all__ = ["add_smoke_argument", "has_sbibm", "output_folder"]


def add_smoke_argument(parser: argparse.ArgumentParser) -> None:
    """Add the ``--smoke`` flag to a script's command line."""
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="tiny sizes (seconds); outputs go to a temporary folder, committed results "
        "are left alone",
    )


def output_folder(folder: Path | str, smoke: bool) -> Path:
    """``folder`` (created if missing), or in smoke mode a fresh temporary folder."""
    if smoke:
        return Path(tempfile.mkdtemp(prefix="calib_lightning_smoke_"))
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def has_sbibm() -> bool:
    """Whether sbibm is installed; if not, say so (the sbibm benchmarks then skip: sbibm is
    no test dependency, its install recipe is in examples/benchmarks/README.md)."""
    try:
        import sbibm  # noqa: F401
    except ImportError:
        print("sbibm is not installed: skipped (install it as the module docstring says)")
        return False
    return True
