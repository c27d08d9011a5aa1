"""The package's floor: helpers every layer shares, importing nothing else of the package.

``validation`` (argument checks and the errors about non-finite pairs), ``chunks`` (row
blocks), ``distributed`` (DDP helpers of the metrics), ``prior`` (a prior's support),
``random`` (seeded, isolated randomness).
"""

__all__: list[str] = []
