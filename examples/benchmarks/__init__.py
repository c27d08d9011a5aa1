"""Benchmark scripts: each writes its tables and figures to ``results/`` (``--smoke``: a
tiny run writing to a temporary folder instead)."""
