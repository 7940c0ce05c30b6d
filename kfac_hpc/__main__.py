"""``python -m kfac_hpc`` is the ``kfac-hpc`` command."""

import sys

from kfac_hpc.cli import main

sys.exit(main())
