"""The public API type-checks as a user's code sees it (the package ships ``py.typed``):
mypy on ``tests/typing/public_api.py``, the package's own modules followed silently,
reports exactly the one call that is wrong there."""

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
USAGE = Path(__file__).parent / "typing" / "public_api.py"


def test_a_users_calls_type_check_and_a_wrong_one_is_reported(tmp_path):
    pytest.importorskip("mypy", reason="the test extra installs mypy")
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "--follow-imports=silent", "--ignore-missing-imports",
         "--no-error-summary", "--cache-dir", str(tmp_path), str(USAGE)],
        capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip
    errors = [line for line in done.stdout.splitlines() if ": error:" in line]
    wrong = next(k for k, line in enumerate(USAGE.read_text().splitlines(), 1)
                 if line.endswith("# WRONG"))  # fmt: skip
    assert len(errors) == 1, done.stdout + done.stderr
    assert f"public_api.py:{wrong}: error:" in errors[0]
    assert '"seed" to "KCCSD"' in errors[0]
