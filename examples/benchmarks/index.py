"""Write ``results/INDEX.md``: every result file with its question, the command that
writes it, and the commit and date at which it last changed, so that a reader can tell
what is current and rerun it.

The question is the file's first heading (for a Markdown result; data files and figures
point to the table they belong to); the command is the first ``python ...`` command
quoted in its first lines, else the script of the same name; the status is
``superseded`` or ``stale`` when the file's first lines say so (a banner above the
table), else ``current``.

    python examples/benchmarks/index.py          # after committing new results
    python examples/benchmarks/index.py --smoke  # seconds, written to a temporary folder
"""

from __future__ import annotations

import argparse
import re
import subprocess
import tempfile
from pathlib import Path

HERE = Path(__file__).parent
RESULTS = HERE / "results"
COMMAND = re.compile(r"`((?:PYTHONPATH=\. )?python [^`]*examples/benchmarks/[^`]+)`")
STATUS = re.compile(r"\*\*(Partly superseded|Superseded|Stale)\b", re.IGNORECASE)


def last_change(path: Path) -> tuple[str, str]:
    """The short hash and date of the last commit that changed ``path`` (``-`` if none)."""
    out = subprocess.run(["git", "log", "-1", "--format=%h %ad", "--date=short", "--",
                          path.name], cwd=path.parent, capture_output=True, text=True,
                         check=False).stdout.split()  # fmt: skip
    return (out[0], out[1]) if len(out) == 2 else ("-", "-")


def describe(path: Path) -> tuple[str, str, str]:
    """``(question, command, status)`` of one result file."""
    if path.suffix != ".md":
        table = next((f"{p}.md" for p in prefixes(path.stem.removesuffix("_runs"))
                      if (RESULTS / f"{p}.md").exists()), None)  # fmt: skip
        question = f"data of [`{table}`]({table})" if table else "data"
        return question, command_of(path, ""), "-"
    text = path.read_text()
    head = "\n".join(text.splitlines()[:12])
    question = next((line.lstrip("# ").strip() for line in text.splitlines()
                     if line.startswith("#")), path.stem)  # fmt: skip
    found = STATUS.search(head)
    status = found.group(1).lower() if found else "current"
    return question, command_of(path, head), status


def prefixes(stem: str) -> list[str]:
    """``a_b_c`` -> ``a_b_c``, ``a_b``, ``a``: the names a result file's script may have."""
    parts = stem.split("_")
    return ["_".join(parts[:k]) for k in range(len(parts), 0, -1)]


def command_of(path: Path, head: str) -> str:
    found = COMMAND.search(head)
    if found:
        return found.group(1)
    script = next((p for p in prefixes(path.stem) if (HERE / f"{p}.py").exists()), None)
    return "-" if script is None else f"python examples/benchmarks/{script}.py"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    rows = []
    for path in sorted(RESULTS.iterdir()):
        if path.name == "INDEX.md" or path.name.startswith(".") or path.suffix in (".lock",):
            continue
        question, command, status = describe(path)
        commit, date = last_change(path)
        rows.append(f"| [`{path.name}`]({path.name}) | {question.replace('|', '/')} | "
                    f"`{command}` | {commit} | {date} | {status} |")  # fmt: skip
    text = "\n".join([
        "# Every result file", "",
        "Written by `python examples/benchmarks/index.py`. Commit and date: the last commit "
        "that changed the file (the run that wrote it, or an edit of its text). Status: "
        "`superseded` or `stale` where the file says so at its top (it names what replaced "
        "it), `current` otherwise; `-` for data files, read with their table. What each "
        "benchmark answers, with its headline numbers: [the benchmarks page](../README.md).",
        "", "| file | question | command | commit | date | status |",
        "| --- | --- | --- | --- | --- | --- |", *rows, "",
    ])  # fmt: skip
    out = Path(tempfile.mkdtemp()) if args.smoke else RESULTS
    (out / "INDEX.md").write_text(text)
    print(f"wrote {out / 'INDEX.md'} ({len(rows)} files)")


if __name__ == "__main__":
    main()
