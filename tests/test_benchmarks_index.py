"""The benchmarks' index lists every result file, and every table with its command."""

from pathlib import Path

RESULTS = Path(__file__).resolve().parents[1] / "examples" / "benchmarks" / "results"


def test_every_result_file_has_a_row_and_every_table_a_command():
    index = (RESULTS / "INDEX.md").read_text()
    rows = {line.split("`")[1]: line for line in index.splitlines()
            if line.startswith("| [`")}  # fmt: skip
    files = {p.name for p in RESULTS.iterdir()
             if p.name != "INDEX.md" and not p.name.startswith(".") and p.suffix != ".lock"}
    missing = sorted(files - set(rows))
    assert not missing, f"not in results/INDEX.md (run examples/benchmarks/index.py): {missing}"
    assert not sorted(set(rows) - files), "rows of files that no longer exist"
    without = sorted(name for name, row in rows.items()
                     if name.endswith(".md") and "| `-` |" in row)  # fmt: skip
    assert not without, f"tables without the command that writes them: {without}"
