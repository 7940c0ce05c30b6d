"""Where this process runs: rank, size, local rank, node, job, device.

MPI is the source of truth (``Split_type(COMM_TYPE_SHARED)`` gives the local rank);
the launcher's variables (Open MPI, MVAPICH, MPICH/Hydra/PMI, Flux, SLURM) are the
fallback when MPI is not initialised yet. Choosing the GPU before MPI starts is
:func:`kfac_hpc.runtime.select_device` (:mod:`kfac_hpc.runtime.device`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kfac_hpc.runtime import device as _device

if TYPE_CHECKING:
    from kfac_hpc.comm import Communicator

# (rank, size, local rank(s), local size(s)) variables by launcher, in order of
# preference: the MPI launcher that started this process before SLURM, whose variables
# ranks started by mpirun/mpiexec inside a batch job inherit from the batch shell or
# the per-node daemon (then SLURM_PROCID/SLURM_LOCALID are wrong for them).
_LAUNCHER_VARIABLES: dict[str, tuple[str, str, tuple[str, ...], tuple[str, ...]]] = {
    "openmpi": ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", ("OMPI_COMM_WORLD_LOCAL_RANK",),
                ("OMPI_COMM_WORLD_LOCAL_SIZE",)),
    "mvapich": ("MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE", ("MV2_COMM_WORLD_LOCAL_RANK",),
                ("MV2_COMM_WORLD_LOCAL_SIZE",)),
    "pmi": ("PMI_RANK", "PMI_SIZE", ("MPI_LOCALRANKID", "PMI_LOCAL_RANK", "PALS_LOCAL_RANKID"),
            ("MPI_LOCALNRANKS", "PMI_LOCAL_SIZE")),
    "flux": ("FLUX_TASK_RANK", "FLUX_JOB_SIZE", ("FLUX_TASK_LOCAL_ID",), ()),
    "slurm": ("SLURM_PROCID", "SLURM_NTASKS", ("SLURM_LOCALID",), ("SLURM_NTASKS_PER_NODE",)),
}


@dataclass(frozen=True)
class JobEnvironment:
    """What a rank knows of the job it belongs to.

    Attributes:
        rank: This process's rank in the job.
        size: The number of ranks in the job.
        local_rank: This process's rank on its node.
        local_size: The number of ranks on this node.
        nodes: The number of nodes of the job.
        host: This node's name.
        source: Where it was read: ``"mpi"``, a launcher (``"openmpi"``, ``"mvapich"``,
            ``"pmi"``, ``"flux"``, ``"slurm"``) or ``"single"`` (no launcher variables).
        job_id: SLURM's job id, if any.
        restart_count: SLURM's restart count of a requeued job (0 on the first run).
    """

    rank: int
    size: int
    local_rank: int
    local_size: int
    nodes: int
    host: str
    source: str  # "mpi", "openmpi", "mvapich", "pmi", "flux", "slurm" or "single"
    job_id: str | None = None
    restart_count: int = 0


def from_environment(env: Mapping[str, str] | None = None) -> JobEnvironment:
    """Describe the job as the launcher's variables do (no MPI call).

    Args:
        env: The environment to read (default ``os.environ``); the MPI launcher's
            variables win over SLURM's.

    Returns:
        The job; a single process (rank 0 of 1, ``source="single"``) when no launcher
        variables are set.

    Raises:
        ValueError: A variable is not an integer, or rank and size do not agree.
    """
    env = os.environ if env is None else env
    for source, (rank_v, size_v, local_vs, local_size_vs) in _LAUNCHER_VARIABLES.items():
        if rank_v in env and size_v in env:
            rank, size = _int(env, rank_v), _int(env, size_v)
            local_v = next((v for v in local_vs if v in env), local_vs[0])
            local_rank = _int(env, local_v) if local_v in env else 0
            local_size_v = next((v for v in local_size_vs if v in env), None)
            local_size = _local_size(env, local_size_v) if local_size_v else 1
            nodes = _int(env, "SLURM_NNODES") if "SLURM_NNODES" in env else max(
                1, -(-size // max(local_size, 1)))
            if not 0 <= rank < size or not 0 <= local_rank < max(local_size, local_rank + 1):
                raise ValueError(f"inconsistent launcher variables: {rank_v}={rank}, "
                                 f"{size_v}={size}, {local_v}={local_rank}")
            return JobEnvironment(rank, size, local_rank, local_size, nodes,
                                  env.get("SLURMD_NODENAME", os.uname().nodename), source,
                                  env.get("SLURM_JOB_ID"), _int(env, "SLURM_RESTART_COUNT", 0))
    return JobEnvironment(0, 1, 0, 1, 1, os.uname().nodename, "single",
                          env.get("SLURM_JOB_ID"), _int(env, "SLURM_RESTART_COUNT", 0))


def from_mpi(comm: Communicator | None = None,
             env: Mapping[str, str] | None = None) -> JobEnvironment:
    """Describe the job as MPI sees it (local rank from the shared-memory split).

    Collective over ``comm`` (a communicator split and an allreduce); starts MPI if it has
    not started.

    Args:
        comm: The communicator (default: the world).
        env: Where the SLURM job id and restart count are read (default ``os.environ``).

    Returns:
        The job with ``source="mpi"``.
    """
    from mpi4py import MPI

    from kfac_hpc.comm import world

    env = os.environ if env is None else env
    comm = comm if comm is not None else world()
    node = comm.split_shared()
    try:
        leader = torch.tensor([1 if node.rank == 0 else 0], dtype=torch.int64)
        nodes = int(comm.allreduce(leader).item())
        return JobEnvironment(comm.rank, comm.size, node.rank, node.size, nodes,
                              MPI.Get_processor_name(), "mpi", env.get("SLURM_JOB_ID"),
                              _int(env, "SLURM_RESTART_COUNT", 0))
    finally:
        comm.children.remove(node)
        node.free()


def select_device(local_rank: int, *, prefer_cuda: bool = True) -> torch.device:
    """Return ``cuda:<local_rank mod visible GPUs>`` (made current) or the CPU.

    Kept for existing callers; new code calls :func:`kfac_hpc.runtime.select_device`,
    which also reads the local rank from the launcher before MPI starts.

    Args:
        local_rank: This process's rank on its node.
        prefer_cuda: Take a GPU when CUDA is available; False: always the CPU.

    Returns:
        The chosen device.
    """
    return _device.select_device("auto" if prefer_cuda else "cpu", local_rank=local_rank)


def singleton_under_srun(world_size: int, env: Mapping[str, str] | None = None) -> str | None:
    """Say why this process is alone in its MPI world although srun started several.

    ``srun`` without the MPI plugin its MPI needs (Open MPI 5: ``--mpi=pmix``) starts
    every task as a singleton: N tasks that each think they are rank 0 of 1, train
    alone and write one checkpoint directory. Only a task srun started itself is
    checked (``SLURM_STEP_NUM_TASKS``, no other launcher's variables: ranks that
    ``mpirun`` started inside a job carry its own).

    Args:
        world_size: The size of the MPI world.
        env: The environment (default ``os.environ``).

    Returns:
        The message (what happened and the fix), or None when nothing is wrong.
    """
    env = os.environ if env is None else env
    tasks = _int(env, "SLURM_STEP_NUM_TASKS", 1)
    launched = any(_LAUNCHER_VARIABLES[name][1] in env for name in _LAUNCHER_VARIABLES
                   if name != "slurm")
    if world_size != 1 or tasks <= 1 or launched or "SLURM_PROCID" not in env:
        return None
    return (f"srun started {tasks} tasks for this step, but MPI sees 1 rank: every task "
            "runs alone (srun lacks the MPI plugin your MPI needs), and all of them would "
            "train and write the same checkpoints. Launch with the plugin: `srun "
            "--mpi=pmix` for Open MPI 5 and most MPIs built with PMIx (`srun --mpi=list` "
            "shows what this cluster has; jobs/lib/site.sh sets KFAC_SRUN_MPI)")


def time_left(env: Mapping[str, str] | None = None, now: float | None = None) -> float | None:
    """Return the seconds until SLURM ends the job (``SLURM_JOB_END_TIME``), or None if unknown.

    Args:
        env: The environment to read (default ``os.environ``).
        now: The current UNIX time in seconds (default ``time.time()``).

    Returns:
        Seconds left (negative once past the end), or None when the variable is unset or
        not a number.
    """
    env = os.environ if env is None else env
    end = env.get("SLURM_JOB_END_TIME")
    if not end:
        return None
    try:
        return float(end) - (time.time() if now is None else now)
    except ValueError:
        return None


def banner(job: JobEnvironment, *, device: torch.device, mpi_library: str,
           cuda_aware: bool) -> str:
    """Format the one-line job description rank 0 prints at start.

    Args:
        job: The job's ranks, nodes, id and restart count.
        device: This rank's device (``cuda``: the GPUs rank 0 sees; with one GPU bound
            per task, as ``--gpus-per-task=1`` binds it, that is one per rank).
        mpi_library: The MPI library's name and version.
        cuda_aware: Whether MPI takes CUDA device memory.

    Returns:
        One line, without a newline.
    """
    gpus = (f"{torch.cuda.device_count()} GPU(s) visible to rank 0" if device.type == "cuda"
            else "CPU")
    job_id = f" job {job.job_id}" if job.job_id else ""
    restart = f", restart {job.restart_count}" if job.restart_count else ""
    return (f"kfac_hpc{job_id}: {job.size} rank(s) on {job.nodes} node(s), {gpus}, "
            f"{mpi_library}, CUDA-aware MPI: {'yes' if cuda_aware else 'no'}{restart}")


def _int(env: Mapping[str, str], name: str, default: int | None = None) -> int:
    value = env.get(name)
    if value is None:
        if default is None:
            raise KeyError(name)
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} is not an integer") from None


def _local_size(env: Mapping[str, str], name: str) -> int:
    """Read a per-node task count, the first of e.g. ``4`` or ``4(x2)`` (SLURM's forms)."""
    value = env.get(name)
    if value is None:
        return 1
    head = value.split("(")[0].split(",")[0]
    try:
        return int(head)
    except ValueError:
        raise ValueError(f"{name}={value!r} is not a task count") from None
