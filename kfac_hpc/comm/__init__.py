"""MPI on torch tensors: the only part of kfac_hpc that calls MPI collectives."""

from kfac_hpc.comm.buffers import SUPPORTED_DTYPES, detect_cuda_aware, mpi_vendor
from kfac_hpc.comm.communicator import Communicator, Handle, ReduceOp, wait_all
from kfac_hpc.comm.cuda import CUDA_AWARE_ENV, CudaSupport
from kfac_hpc.comm.cuda import detect as detect_cuda_support
from kfac_hpc.comm.errors import install_abort_on_error
from kfac_hpc.comm.fusion import (
    FusedAllreduce,
    buckets_by_size,
    flatten,
    pack_upper,
    triu_count,
    unflatten_into,
    unpack_upper,
)
from kfac_hpc.comm.stats import TrafficStats
from kfac_hpc.comm.threads import ThreadLevelError

__all__ = [
    "CUDA_AWARE_ENV",
    "SUPPORTED_DTYPES",
    "Communicator",
    "CudaSupport",
    "FusedAllreduce",
    "Handle",
    "ReduceOp",
    "ThreadLevelError",
    "TrafficStats",
    "buckets_by_size",
    "detect_cuda_aware",
    "detect_cuda_support",
    "flatten",
    "install_abort_on_error",
    "mpi_vendor",
    "pack_upper",
    "triu_count",
    "unflatten_into",
    "unpack_upper",
    "wait_all",
]

_world: Communicator | None = None


def world() -> Communicator:
    """Return the process-wide communicator over ``MPI.COMM_WORLD`` (created on first use)."""
    global _world
    if _world is None:
        _world = Communicator()
    return _world
