"""The ``--smoke`` mode every example and benchmark script has.

``--smoke`` runs the script's own code path at tiny sizes (seconds) and writes what it
would write (tables, figures, TensorBoard logs) to a fresh temporary folder, never over
the committed results in ``examples/benchmarks/results/`` or ``examples/figures/``.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

__all__ = ["add_smoke_argument", "output_folder"]


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
