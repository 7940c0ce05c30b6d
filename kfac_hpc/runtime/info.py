"""``kfac-hpc info``: what this job runs on."""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
from typing import Any

import torch


def cuda_detection(run_ompi_info: bool = True) -> dict[str, Any]:
    """Detect which MPI calls take CUDA device memory here, with the evidence and the override.

    Args:
        run_ompi_info: Run Open MPI's ``ompi_info`` when it is found (slow; one rank is
            enough).

    Returns:
        The detection as a JSON-ready dict (vendor, aware, source, evidence, per-call
        table) with ``"override"``, the variable that overrides it.
    """
    from kfac_hpc.comm import cuda

    def ompi_info() -> str | None:
        executable = cuda.find_ompi_info(cuda.read_maps())
        if executable is None:
            return None
        try:
            return cuda.run_ompi_info(executable)
        except (OSError, subprocess.SubprocessError):
            return None

    support = cuda.detect(ompi_info=ompi_info if run_ompi_info else None)
    out = support.as_dict()
    out["override"] = f"{cuda.CUDA_AWARE_ENV}=0|1|all (unset: detect)"
    return out


def collect(run_ompi_info: bool = True) -> dict[str, Any]:
    """Collect versions, MPI library and CUDA-awareness, ranks and devices of this process.

    Collective over the world communicator (a shared-memory split); starts MPI.

    Args:
        run_ompi_info: Let rank 0 run ``ompi_info`` for the CUDA detection.

    Returns:
        A JSON-ready dict, one key per fact.
    """
    import h5py
    import mpi4py
    from mpi4py import MPI

    from kfac_hpc import __version__

    world = MPI.COMM_WORLD
    detection = cuda_detection(run_ompi_info and world.Get_rank() == 0)  # rank 0 prints
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
        "cuda_aware_mpi": detection["aware"],
        "world_size": world.Get_size(),
        "rank": world.Get_rank(),
        "local_size": node.Get_size(),
        "local_rank": node.Get_rank(),
        "host": MPI.Get_processor_name(),
        "cuda_devices": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        "cpu_threads": torch.get_num_threads(),
        "torch_cuda": torch.version.cuda,
        "cuda_detection": detection,
    }
    node.Free()
    return info


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``kfac-hpc info`` options to ``parser``.

    Args:
        parser: The subcommand's parser.
    """
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def run(args: argparse.Namespace) -> int:
    """Run ``kfac-hpc info``: rank 0 prints the facts as a table or as JSON.

    Args:
        args: The parsed options (``--json``).

    Returns:
        The exit status (0).
    """
    info = collect()
    if info["rank"] != 0:
        return 0
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        print(format_table(info))
    return 0


def format_table(info: dict[str, Any]) -> str:
    """Format the facts as ``key  value`` lines, the CUDA detection as evidence and table.

    Args:
        info: What :func:`collect` returned.

    Returns:
        The table, lines joined by newlines.
    """
    flat = {k: v for k, v in info.items() if k != "cuda_detection"}
    width = max(len(k) for k in flat)
    lines = [f"{key:<{width}}  {value}" for key, value in flat.items()]
    detection = info.get("cuda_detection")
    if detection:
        lines.append(f"CUDA-aware MPI detection: {detection['vendor']}, "
                     f"{'aware' if detection['aware'] else 'not aware'} [{detection['source']}]")
        lines += [f"  evidence: {line}" for line in detection["evidence"]]
        table = detection["table"]
        device = [c for c, how in table.items() if how == "device"]
        staged = [c for c, how in table.items() if how == "staged"]
        lines.append(f"  device memory to MPI: {', '.join(device) or '(none)'}")
        lines.append(f"  staged through pinned host memory: {', '.join(staged) or '(none)'}")
        routed = detection.get("routed") or []
        if routed:
            lines.append(f"  of which staged by routing, faster than the library's device "
                         f"path: {', '.join(routed)}")
        lines.append(f"  override: {detection['override']}")
    return "\n".join(lines)
