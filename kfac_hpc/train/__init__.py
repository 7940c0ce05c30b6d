"""Reference training driver: model zoo (``models``), data sets and sharded loader (``data``).

Nothing else in ``kfac_hpc`` imports this package.
"""
