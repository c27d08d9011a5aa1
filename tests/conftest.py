"""Test-session settings shared by every test module."""

import os
from pathlib import Path

import matplotlib
import pytest
import torch

from calib_lightning.testing import fork_is_safe

matplotlib.use("Agg")

#: read by mypy (test_typing.py), never imported: --doctest-modules would run it
collect_ignore = ["typing"]

if os.environ.get("PYTEST_XDIST_WORKER"):
    # pytest -n K runs K workers: one thread each, so the workers do not oversubscribe
    # the cores (BLAS and eigendecompositions slow down badly when they do)
    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _forks_need_a_process_without_cuda(request):
    """Tests marked ``forks`` (DDP ranks by fork) skip in a worker whose forks could not
    use CUDA or autograd: on a GPU machine, after the CUDA tests or after any backward
    pass in the same worker (autograd's device threads do not survive a fork)."""
    if request.node.get_closest_marker("forks") is not None and not fork_is_safe():
        pytest.skip("forks DDP ranks, and a fork of this test worker could not use CUDA or "
                    "autograd (calib_lightning.testing.fork_is_safe)")


#: node ids of the slow tier (``slow_tests.txt``: one per line, ``#`` comments)
SLOW = frozenset(
    line.strip() for line in (Path(__file__).parent / "slow_tests.txt").read_text().splitlines()
    if line.strip() and not line.startswith("#")
)


def pytest_collection_modifyitems(config, items):
    """Mark ``slow`` the tests listed in ``slow_tests.txt`` (a parametrized test by its
    full id, or all its cases by its name) and every benchmark's smoke run."""
    for item in items:
        base = item.nodeid.split("[", 1)[0]
        if (item.nodeid in SLOW or base in SLOW
                or item.nodeid.startswith("tests/test_examples.py::test_smoke[benchmarks/")):
            item.add_marker(pytest.mark.slow)
