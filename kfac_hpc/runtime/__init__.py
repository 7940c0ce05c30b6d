"""Where this process runs, and choosing its device before MPI starts.

``kfac_hpc.runtime.select_device()`` picks the GPU from the launcher's local-rank
variables without importing mpi4py; call it before anything imports ``mpi4py`` or
``kfac_hpc.comm`` (see :mod:`kfac_hpc.runtime.device`). Importing this package does
not start MPI; :mod:`.preemption` and :func:`.discovery.from_mpi` do.
"""

from kfac_hpc.runtime.device import (
    LOCAL_RANK_VARIABLES,
    LocalRank,
    NoCudaDeviceError,
    local_rank_from_environment,
    select_device,
    selected_device,
)

__all__ = ["LOCAL_RANK_VARIABLES", "LocalRank", "NoCudaDeviceError",
           "local_rank_from_environment", "select_device", "selected_device"]
