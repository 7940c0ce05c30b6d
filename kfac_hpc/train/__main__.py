"""``python -m kfac_hpc.train``: the same job as ``kfac-hpc train``."""

import sys

from kfac_hpc.train.cli import main

if __name__ == "__main__":
    sys.exit(main())
