"""``kfac-hpc info``: what this job runs on."""

from __future__ import annotations

import argparse
import json
import platform
from typing import Any

import torch


def collect() -> dict[str, Any]:
    """Versions, MPI library and CUDA-awareness, ranks and devices of this process."""
    import h5py
    import mpi4py
    from mpi4py import MPI

    from kfac_hpc import __version__
    from kfac_hpc.comm import detect_cuda_aware

    world = MPI.COMM_WORLD
    node = world.Split_type(MPI.COMM_TYPE_SHARED, key=world.Get_rank())
    info = {
        "kfac_hpc": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "mpi4py": mpi4py.__version__,
        "h5py": h5py.__version__,
        "hdf5": h5py.version.hdf5_version,
        "parallel_hdf5": bool(h5py.get_config().mpi),
        "mpi_library": MPI.Get_library_version().splitlines()[0].strip(),
        "mpi_standard": "{}.{}".format(*MPI.Get_version()),
        "mpi_thread_level": {MPI.THREAD_SINGLE: "single", MPI.THREAD_FUNNELED: "funneled",
                             MPI.THREAD_SERIALIZED: "serialized",
                             MPI.THREAD_MULTIPLE: "multiple"}[MPI.Query_thread()],
        "cuda_aware_mpi": detect_cuda_aware(),
        "world_size": world.Get_size(),
        "rank": world.Get_rank(),
        "local_size": node.Get_size(),
        "local_rank": node.Get_rank(),
        "host": MPI.Get_processor_name(),
        "cuda_devices": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        "cpu_threads": torch.get_num_threads(),
    }
    node.Free()
    return info


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def run(args: argparse.Namespace) -> int:
    info = collect()
    if info["rank"] != 0:
        return 0
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        width = max(len(k) for k in info)
        for key, value in info.items():
            print(f"{key:<{width}}  {value}")
    return 0
