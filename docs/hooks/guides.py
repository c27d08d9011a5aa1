"""The how-to guides: Python scripts with Markdown cells, run by the tests, shown as pages.

A guide is ``docs/guides/<name>.py``, a plain script cut into cells by ``# %%`` lines
(the "percent" format of jupytext, VS Code and Spyder): a ``# %% [markdown]`` cell holds
Markdown as comment lines, any other cell is code. It saves its figures as PNG files under
``figures/`` of the folder it runs in, and its Markdown shows them as
``![caption](figures/<file>.png)``.

Running a guide::

    python docs/hooks/guides.py docs/guides/<name>.py

executes its code cells in order in a fresh temporary folder (one torch thread), keeps
what each one prints, and replaces ``docs/guides/runs/<name>/`` with the figures it saved
and ``run.json``: the printed output of each code cell, the SHA-256 of the script it ran,
the commit and the date. The figures are committed with the guide, so the site shows the
figures of the last run, and the page says which run. ``--runs DIR`` writes the run to
``DIR/<name>/`` instead: ``tests/test_guides.py`` runs every guide that way, into a
temporary folder, so that running the tests leaves the checkout as it was.

As an MkDocs hook, it adds the page ``guides/<name>.md`` for each guide: the Markdown
cells as they are, each code cell as a Python block followed by what it printed, and the
figure links pointed at ``runs/<name>/``. Building the site never executes a guide (the
build stays a few seconds); a guide edited after its run is reported as a warning, which
``mkdocs build --strict`` turns into a failure, so the page never shows the output of
another version of its script.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import io
import json
import logging
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, NamedTuple

_ROOT = Path(__file__).resolve().parents[2]
GUIDES = _ROOT / "docs" / "guides"
RUNS = GUIDES / "runs"
_CELL = re.compile(r"^# %%(?P<tag>.*)$")
_FIGURE_LINK = re.compile(r"(!\[[^\]]*\]\()figures/([^)\s]+\.png)(\))")
_log = logging.getLogger("mkdocs.hooks.guides")


class Cell(NamedTuple):
    """One cell of a guide: ``kind`` is ``"markdown"`` or ``"code"``, ``source`` its text
    (Markdown without the comment marks), ``line`` the script line of its first line."""

    kind: str
    source: str
    line: int


def cells(script: str) -> list[Cell]:
    """Cut a percent-format script into cells (text before the first ``# %%`` is code)."""
    found: list[Cell] = []
    kind, start, lines = "code", 1, []

    def close() -> None:
        text = "\n".join(lines).strip("\n")
        if kind == "markdown":
            text = "\n".join(_uncomment(line) for line in text.split("\n"))
        if text.strip():
            found.append(Cell(kind, text, start))

    for number, line in enumerate(script.splitlines(), start=1):
        match = _CELL.match(line)
        if match is None:
            if not lines:
                start = number
            lines.append(line)
            continue
        close()
        kind = "markdown" if "[markdown]" in match.group("tag") else "code"
        start, lines = number + 1, []
    close()
    return found


def _uncomment(line: str) -> str:
    if line.startswith("# "):
        return line[2:]
    if line.strip() == "#":
        return ""
    raise ValueError(f"a Markdown cell line must start with '# ' or be '#', got {line!r}")


def script_hash(path: Path) -> str:
    """SHA-256 of a script's text, line endings normalized."""
    text = path.read_text(encoding="utf-8").replace("\r\n", "\n")
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def figure_links(markdown: str) -> list[str]:
    """File names of the ``![...](figures/X.png)`` links in a guide's Markdown."""
    return [m.group(2) for m in _FIGURE_LINK.finditer(markdown)]


# -- running a guide ---------------------------------------------------------------------


def _git(*args: str) -> str:
    run = subprocess.run(["git", *args], cwd=_ROOT, capture_output=True, text=True)
    return run.stdout.strip() if run.returncode == 0 else ""


def run(path: Path, runs: Path = RUNS) -> dict[str, Any]:
    """Execute the guide at ``path`` cell by cell in a temporary folder; write its
    figures and ``run.json`` to ``runs/<name>/`` and return what ``run.json`` holds."""
    import matplotlib
    import torch

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # small networks gain nothing from more threads, and on a shared machine the extra
    # threads mostly wait for each other: one thread keeps the run times comparable
    torch.set_num_threads(1)

    path = path.resolve()
    digest = script_hash(path)
    namespace: dict[str, Any] = {"__name__": "__main__", "__file__": str(path)}
    outputs, cell_seconds = [], []
    here = Path.cwd()
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=f"guide_{path.stem}_") as folder:
        os.chdir(folder)
        try:
            for cell in cells(path.read_text(encoding="utf-8")):
                if cell.kind != "code":
                    continue
                # padded so that a traceback names the script's own line numbers
                code = compile("\n" * (cell.line - 1) + cell.source, str(path), "exec")
                printed = io.StringIO()
                started = time.perf_counter()
                with contextlib.redirect_stdout(printed):
                    exec(code, namespace)
                cell_seconds.append(round(time.perf_counter() - started, 1))
                outputs.append(printed.getvalue())
                sys.stdout.write(printed.getvalue())
            seconds = time.perf_counter() - start
            plt.close("all")
            figures = sorted(Path(folder, "figures").glob("*.png"))
            target = runs / path.stem
            target.mkdir(parents=True, exist_ok=True)
            for figure in figures:  # each file replaced at once: a site build may be reading
                shutil.copyfile(figure, target / f".{figure.name}.new")
                os.replace(target / f".{figure.name}.new", target / figure.name)
        finally:
            os.chdir(here)
    changed = _git("status", "--porcelain", "--", "calib_lightning", str(path))
    record = {
        "script": path.name,
        "script_sha256": digest,
        "commit": _git("rev-parse", "--short=10", "HEAD"),
        "uncommitted_changes": bool(changed),
        "date": datetime.date.today().isoformat(),
        "seconds": round(seconds, 1),
        "cpu_count": os.cpu_count(),
        "torch_threads": 1,
        "python": platform.python_version(),
        "cell_seconds": cell_seconds,
        "figures": [figure.name for figure in figures],
        "outputs": outputs,
    }
    (target / ".run.json.new").write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    os.replace(target / ".run.json.new", target / "run.json")
    for stale in set(target.glob("*.png")) - {target / figure.name for figure in figures}:
        stale.unlink()  # a figure this run did not save
    return record


# -- the pages ---------------------------------------------------------------------------


def load_run(name: str, runs: Path = RUNS) -> dict[str, Any] | None:
    """The ``run.json`` of a guide, or ``None`` when it never ran."""
    path = runs / name / "run.json"
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None


def _run_note(name: str, record: dict[str, Any] | None) -> str:
    if record is None:
        return f"!!! warning\n    This guide has not been run: no `runs/{name}/run.json`.\n"
    commit = record["commit"] or "an unknown commit"
    if record["uncommitted_changes"]:
        commit += " with uncommitted changes"
    return (
        f'!!! note "A script that runs"\n    This page is [`{name}.py`]({name}.py) '
        f"(download it and run `python {name}.py`). The output and figures below are "
        f"from its last run (`python docs/hooks/guides.py docs/guides/{name}.py`): "
        f"commit {commit}, "
        f"{record['date']}, {record['seconds']:.0f} s on one torch thread "
        f"({record['cpu_count']} CPU cores).\n"
    )


def render(path: Path, runs: Path = RUNS) -> str:
    """The Markdown page of the guide at ``path``, with the output of its last run."""
    name = path.stem
    record = load_run(name, runs)
    if record is not None and record["script_sha256"] != script_hash(path):
        _log.warning(
            "guides: %s changed since its last run; run `python docs/hooks/guides.py %s` "
            "to refresh its output and figures, and commit them",
            path.name, path.relative_to(_ROOT).as_posix(),
        )  # fmt: skip
    outputs = list(record["outputs"]) if record is not None else []
    parts = []
    note_placed = False
    code_index = 0
    for cell in cells(path.read_text(encoding="utf-8")):
        if cell.kind == "markdown":
            text = _FIGURE_LINK.sub(rf"\g<1>runs/{name}/\g<2>\g<3>", cell.source)
            parts.append(text)
            if not note_placed:  # after the title and the introduction
                parts.append(_run_note(name, record))
                note_placed = True
            continue
        parts.append(f"```python\n{cell.source}\n```")
        printed = outputs[code_index] if code_index < len(outputs) else ""
        code_index += 1
        if printed.strip():
            parts.append(f"```text\n{printed.rstrip()}\n```")
    if not note_placed:
        parts.insert(0, _run_note(name, record))
    return "\n\n".join(parts) + "\n"


def on_files(files: Any, config: Any) -> Any:
    """Add the page ``guides/<name>.md`` for each ``docs/guides/<name>.py``."""
    from mkdocs.structure.files import File

    for path in sorted(GUIDES.glob("*.py")):
        uri = f"guides/{path.stem}.md"
        if files.get_file_from_path(uri) is None:
            page = File.generated(config, uri, content=render(path))
            # the script is the page's source: links in its Markdown are relative to it
            page.abs_src_path = str(path)
            files.append(page)
    return files


def main(argv: list[str] | None = None) -> None:
    """The command line: run each guide named, writing to ``--runs`` (the committed
    ``docs/guides/runs/`` by default)."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="python docs/hooks/guides.py",
        description="Run how-to guides and save their output and figures.",
    )
    parser.add_argument("guides", nargs="+", type=Path, help="docs/guides/<name>.py ...")
    parser.add_argument(
        "--runs",
        type=Path,
        default=RUNS,
        help="folder that receives <name>/run.json and the figures (default: %(default)s)",
    )
    arguments = parser.parse_args(argv)
    sys.path.insert(0, str(_ROOT))  # the checkout's package, as the tests import it
    for guide in arguments.guides:
        done = run(guide, arguments.runs.resolve())
        print(f"{guide}: {done['seconds']} s, figures {done['figures']}", file=sys.stderr)


if __name__ == "__main__":
    main()
