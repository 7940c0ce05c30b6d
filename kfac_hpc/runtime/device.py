"""Choose this rank's device before MPI starts.

``from mpi4py import MPI`` initialises MPI, and some MPI libraries (CUDA-aware builds
in particular) bind to the GPU that is current at that moment. So the device is
chosen from the *launcher's* variables, without importing mpi4py: call
:func:`select_device` first thing in a training script, before anything imports
``mpi4py`` or ``kfac_hpc.comm``.

Local-rank variables, first found wins (:data:`LOCAL_RANK_VARIABLES`): the MPI
launcher that started this process comes before SLURM, because processes started by
``mpirun``/``mpiexec`` inside a batch job inherit the batch shell's (or the per-node
daemon's) ``SLURM_LOCALID``, which is then 0 on every rank.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from mpi4py import MPI

__all__ = ["DEVICE_CHOICES", "LOCAL_RANK_VARIABLES", "LocalRank", "NoCudaDeviceError",
           "cuda_on_every_rank", "local_rank_from_environment", "select_device",
           "select_local_gpu", "selected_device", "synchronizer"]

#: ``(variable, launcher)`` in order of preference.
LOCAL_RANK_VARIABLES: tuple[tuple[str, str], ...] = (
    ("OMPI_COMM_WORLD_LOCAL_RANK", "Open MPI mpirun/mpiexec"),
    ("MV2_COMM_WORLD_LOCAL_RANK", "MVAPICH"),
    ("MPI_LOCALRANKID", "MPICH/Intel MPI (Hydra)"),
    ("PMI_LOCAL_RANK", "PMI (Cray MPICH on PALS, MPICH PMI2)"),
    ("PALS_LOCAL_RANKID", "Cray PALS"),
    ("FLUX_TASK_LOCAL_ID", "Flux"),
    ("SLURM_LOCALID", "SLURM srun"),
)

DEVICE_CHOICES = ("auto", "cuda", "cpu")

_selected: torch.device | None = None


class NoCudaDeviceError(RuntimeError):
    """``select_device("cuda")`` found no usable CUDA device."""


@dataclass(frozen=True)
class LocalRank:
    """This process's rank on its node and the variable it was read from."""

    rank: int
    variable: str | None  # None: no launcher variable, a single process (rank 0)


def local_rank_from_environment(env: Mapping[str, str] | None = None) -> LocalRank:
    """Read the node-local rank from the launcher's variables (no MPI call, no mpi4py import).

    Args:
        env: The environment to read (default ``os.environ``); the first variable of
            :data:`LOCAL_RANK_VARIABLES` that is set and not blank wins.

    Returns:
        The rank and the variable it came from; rank 0 and ``variable=None`` when no
        launcher variable is set (a single process).

    Raises:
        ValueError: The variable is not an integer or is negative.
    """
    env = os.environ if env is None else env
    for name, _ in LOCAL_RANK_VARIABLES:
        value = env.get(name)
        if value is None or not value.strip():
            continue
        try:
            rank = int(value)
        except ValueError:
            raise ValueError(f"{name}={value!r} is not an integer; the launcher sets it to this "
                             "process's rank on its node: unset it or fix the launch") from None
        if rank < 0:
            raise ValueError(f"{name}={rank} is negative; it should be this process's rank on "
                             "its node (0, 1, ...)")
        return LocalRank(rank, name)
    return LocalRank(0, None)


def select_device(device: str = "auto", *, local_rank: int | None = None,
                  env: Mapping[str, str] | None = None) -> torch.device:
    """Pick this rank's device, make it the current CUDA device, and return it.

    Call it before ``mpi4py`` is imported (``from mpi4py import MPI`` starts MPI)::

        import kfac_hpc
        device = kfac_hpc.runtime.select_device()   # before any MPI import
        from kfac_hpc.comm import world              # MPI starts here

    The GPU is ``cuda:<local rank mod visible GPUs>``: all of a node's GPUs shared by its
    ranks, or one each when the launcher narrowed ``CUDA_VISIBLE_DEVICES`` per task (e.g.
    SLURM ``--gpus-per-task=1``: every rank sees its own GPU as ``cuda:0``).

    Args:
        device: ``"auto"`` (a GPU when CUDA is available, else the CPU), ``"cuda"`` (a
            GPU, or :class:`NoCudaDeviceError`) or ``"cpu"``.
        local_rank: This process's rank on its node; None reads it from the launcher's
            variables (:func:`local_rank_from_environment`).
        env: The environment the launcher's variables are read from (default
            ``os.environ``).

    Returns:
        The chosen device, also remembered for :func:`selected_device`.

    Raises:
        ValueError: ``device`` or ``local_rank`` is not one of the allowed values.
        NoCudaDeviceError: ``device="cuda"`` and no CUDA device is usable.
    """
    global _selected
    if device not in DEVICE_CHOICES:
        raise ValueError(f"select_device: invalid device={device!r}; allowed: "
                         f"{', '.join(map(repr, DEVICE_CHOICES))}")
    if local_rank is not None and (isinstance(local_rank, bool) or not isinstance(local_rank, int)
                                   or local_rank < 0):
        raise ValueError(f"select_device: invalid local_rank={local_rank!r}; allowed: an "
                         "integer >= 0, or None to read it from the launcher's variables")
    if device == "cpu" or not torch.cuda.is_available():
        if device == "cuda":
            raise NoCudaDeviceError(_no_cuda_message(env))
        _selected = torch.device("cpu")
        return _selected
    rank = local_rank if local_rank is not None else local_rank_from_environment(env).rank
    chosen = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(chosen)
    _selected = chosen
    return chosen


def cuda_on_every_rank(mpi_comm: MPI.Comm) -> bool:
    """Whether every rank of ``mpi_comm`` sees a CUDA device (collective: all agree).

    Args:
        mpi_comm: The ranks.
    """
    from mpi4py import MPI

    return bool(mpi_comm.allreduce(int(torch.cuda.is_available()), op=MPI.MIN))


def select_local_gpu(mpi_comm: MPI.Comm) -> torch.device:
    """Select the GPU of this rank's rank on its node, read from MPI once it has started.

    For tools that start MPI before choosing a device (``kfac-hpc selfcheck``,
    ``kfac-hpc calibrate``): the node's ranks in the order of their ranks in
    ``mpi_comm`` take ``cuda:<local rank mod visible GPUs>`` (:func:`select_device`).
    Collective over ``mpi_comm``.

    Args:
        mpi_comm: The ranks that choose together.

    Returns:
        The chosen GPU, made current.

    Raises:
        NoCudaDeviceError: This rank sees no CUDA device.
    """
    from mpi4py import MPI

    node = mpi_comm.Split_type(MPI.COMM_TYPE_SHARED, key=mpi_comm.Get_rank())
    try:
        return select_device("cuda", local_rank=node.Get_rank())
    finally:
        node.Free()


def synchronizer(device: torch.device) -> Callable[[], None]:
    """What waits for the work queued on ``device`` (for clocks; nothing on the CPU).

    Args:
        device: The device whose queued work a timing must include.

    Returns:
        ``torch.cuda.synchronize`` of ``device`` on CUDA, else a call that does nothing.
    """
    if device.type == "cuda":
        return partial(torch.cuda.synchronize, device)
    return _no_sync


def _no_sync() -> None:
    """Nothing is queued on the CPU."""


def selected_device() -> torch.device | None:
    """Return what the last :func:`select_device` call in this process chose (None: no call yet)."""
    return _selected


def _no_cuda_message(env: Mapping[str, str] | None) -> str:
    env = os.environ if env is None else env
    if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
        why = (f"this torch ({torch.__version__}) is a CPU-only build: install a CUDA build "
               "of torch")
    else:
        visible = env.get("CUDA_VISIBLE_DEVICES")
        why = ("no GPU is visible to this process"
               + (f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else "")
               + ": run on a GPU node and check the job's GPU request (e.g. SLURM "
               "--gpus-per-node or --gpus-per-task)")
    return f"select_device('cuda'): {why}; or select 'auto' or 'cpu' to run on the CPU"
