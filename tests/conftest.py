"""Test-session settings shared by every test module."""

import os

import matplotlib
import torch

matplotlib.use("Agg")

if os.environ.get("PYTEST_XDIST_WORKER"):
    # pytest -n K runs K workers: one thread each, so the workers do not oversubscribe
    # the cores (BLAS and eigendecompositions slow down badly when they do)
    torch.set_num_threads(1)
