"""Runnable examples of calib_lightning: NPE training scripts and, under ``benchmarks/``,
the measurements quoted in the README and the documentation pages (docs/).

A package so that scripts and tests share code by ordinary imports
(``from examples._npe import NPE``). Run a script as a file from the repository root,
``python examples/npe_two_moons.py``, or as a module, ``python -m examples.npe_two_moons``;
every script takes ``--smoke`` (tiny sizes, seconds, output in a temporary folder), which
``tests/test_examples.py`` runs.
"""
