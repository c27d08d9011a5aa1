"""The level-audit benchmark runs end to end (``--smoke``: tiny sizes, seconds)."""

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[1] / "examples" / "benchmarks" / "level_audit.py"


@pytest.fixture(scope="module")
def audit():
    spec = importlib.util.spec_from_file_location("level_audit", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_binomial_band(audit):
    lo, hi = audit.band(200)
    assert 0.0 < lo < 0.05 < hi < 0.1


def test_smoke_run_writes_every_test(audit, tmp_path):
    output = tmp_path / "audit.md"
    text = audit.main(["--smoke", "--output", str(output)])
    assert output.read_text() == text
    for model in audit.MODELS:
        assert f"### {model}" in text
    rows = [line for line in text.splitlines() if line.startswith("| ") and "---" not in line]
    tests = {row.split(" | ")[0].strip("| ") for row in rows}
    assert set(audit.TESTS) <= tests
    # every H0 rate is a number or n/a (a key the metric does not return yet)
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        if cells[0] != "test":
            assert cells[2] == "n/a" or 0.0 <= float(cells[2].split()[0]) <= 1.0
