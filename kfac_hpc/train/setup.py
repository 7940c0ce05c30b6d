"""Building a run: device, data, model, optimizer, K-FAC, gradient averaging, DDP.

Every builder runs on every rank. Those that can fail on bad input run under
:func:`agreed`, so that a bad path or option stops all ranks with the same
:class:`~kfac_hpc.train.config.ConfigError`, never a hang. What a builder acquires
(a process group, hooks, threads) is released by a callback it registers on the
caller's :class:`contextlib.ExitStack`, in reverse order of acquisition.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar, cast

import torch
from torch import nn

from kfac_hpc.models import build_model
from kfac_hpc.solves import usable_cores as local_cores
from kfac_hpc.train.config import ConfigError, TrainConfig
from kfac_hpc.train.data import DatasetSplits, load_dataset
from kfac_hpc.train.optim import build_averager, build_optimizer, build_preconditioner

if TYPE_CHECKING:
    from torch.nn.parallel import DistributedDataParallel

    from kfac_hpc.comm import Communicator
    from kfac_hpc.comm.gradients import GradientAverager
    from kfac_hpc.kfac.preconditioner import KFACPreconditioner

_T = TypeVar("_T")

__all__ = ["USAGE_ERRORS", "Core", "agreed", "build_core", "build_ddp", "build_distributed",
           "check_same_data", "local_cores", "node_rank",
           "pipeline_options", "resolve_out_dir", "select_device", "sync_initial_state"]

#: Exceptions raised by setup that mean "bad input", reported without a traceback.
USAGE_ERRORS: tuple[type[BaseException], ...] = (
    ConfigError, ValueError, FileNotFoundError, ImportError,
)


def agreed(aux: Communicator, fn: Callable[[], _T]) -> _T:
    """Run ``fn`` on every rank; if it fails anywhere, fail everywhere alike.

    A usage error (bad path, option...) becomes the same :class:`ConfigError` on
    all ranks (the lowest failing rank's message); any other exception is re-raised
    where it happened and reported as a ``RuntimeError`` on the other ranks.

    Args:
        aux: The communicator the ranks agree over (one allgather).
        fn: What to run.

    Returns:
        What ``fn`` returned (on every rank, when it returned on every rank).
    """
    value: _T | None = None
    error: BaseException | None = None
    kind = ""
    try:
        value = fn()
    except USAGE_ERRORS as exc:
        error, kind = exc, "usage"
    except Exception as exc:
        error, kind = exc, "crash"
    reports = aux.allgather_object(
        None if error is None else (kind, f"{type(error).__name__}: {error}", str(error)))
    failed = [(r, rep) for r, rep in enumerate(reports) if rep is not None]
    if not failed:
        return cast(_T, value)  # fn() returned (None is a value too)
    if kind == "crash" and error is not None:
        raise error
    crashes = [(r, rep) for r, rep in failed if rep[0] == "crash"]
    if crashes:
        r, rep = crashes[0]
        raise RuntimeError(f"rank {r} failed during setup: {rep[1]}")
    raise ConfigError(failed[0][1][2])


def check_same_data(aux: Communicator, splits: DatasetSplits) -> None:
    """Refuse data that differs between ranks, on every rank alike (collective).

    Every rank loads its own copy and shards its own sample count: a copy that differs
    (a node-local copy lacking files, a plugin that reads per-rank data) would hang the
    ranks' collectives or silently duplicate and drop samples. Compares the sizes and
    :func:`~kfac_hpc.train.data.fingerprint.fingerprint` of the training and test sets.

    Args:
        aux: The driver's communicator.
        splits: This rank's data.

    Raises:
        ConfigError: Some rank's data differs from rank 0's (naming the ranks).
    """
    from kfac_hpc.train.data.fingerprint import fingerprint

    def identity() -> tuple[int, int, str, str]:
        train, test = splits.train, splits.test
        return (len(train), len(test),  # type: ignore[arg-type]
                fingerprint(train), fingerprint(test))

    everyone = aux.allgather_object(agreed(aux, identity))
    differ = [rank for rank, seen in enumerate(everyone) if seen != everyone[0]]
    if differ:
        def describe(rank: int) -> str:
            n_train, n_test, f_train, f_test = everyone[rank]
            return (f"rank {rank}: {n_train} training samples (digest {f_train}), {n_test} "
                    f"test samples (digest {f_test})")

        shown = ", ".join(describe(r) for r in differ[:4]) + (
            f" and {len(differ) - 4} more rank(s)" if len(differ) > 4 else "")
        raise ConfigError(
            f"the ranks read different data for {splits.name!r}: {describe(0)}; {shown}. "
            "Every rank must read the same data: check that each node's copy (--data-path) "
            "is complete and equal, or that a --dataset plugin returns the same data on "
            "every rank")


def node_rank(aux: Communicator) -> tuple[int, int]:
    """Find this rank's place on its node.

    Args:
        aux: The driver's communicator (split by shared memory, then freed).

    Returns:
        ``(local rank, ranks on this node)``.
    """
    node = aux.split_shared()
    try:
        return node.rank, node.size
    finally:
        node.free()


def select_device(cfg: TrainConfig, comm: Communicator, aux: Communicator, local_rank: int,
                  *, verbose: bool) -> torch.device:
    """Choose this rank's device (the CLI chose it before MPI started; a caller may not).

    Args:
        cfg: The run's configuration (``device``).
        comm: The training communicator (is it CUDA-aware?).
        aux: The driver's communicator (the job's layout is gathered over it).
        local_rank: This rank's index on its node.
        verbose: Print the job's banner (rank 0).

    Returns:
        The device.
    """
    from kfac_hpc.comm import mpi_vendor
    from kfac_hpc.runtime.device import selected_device
    from kfac_hpc.runtime.discovery import banner, from_mpi
    from kfac_hpc.runtime.discovery import select_device as select

    device = selected_device()
    if device is None or (cfg.device == "cpu") != (device.type == "cpu"):
        device = select(local_rank, prefer_cuda=cfg.device != "cpu")
    job = from_mpi(aux)
    if verbose:
        print(banner(job, device=device, mpi_library=mpi_vendor(),
                     cuda_aware=comm.cuda_aware), flush=True)
    return device


def pipeline_options(cfg: TrainConfig, device: torch.device) -> dict[str, Any]:
    """Input pipeline of the loaders: workers, prefetch, pinned memory on CUDA.

    Args:
        cfg: The run's configuration.
        device: The device batches go to.

    Returns:
        Keyword arguments of :class:`~kfac_hpc.train.data.ShardedLoader`.
    """
    return {"num_workers": cfg.loader_workers, "prefetch_factor": cfg.prefetch_factor,
            "pin_memory": device.type == "cuda"}


@dataclass(frozen=True)
class Core:
    """What a run trains: data, model, optimizer and loss.

    Attributes:
        data: The training and test sets.
        model: The model, on its device.
        optimizer: The base optimizer (or Shampoo).
        loss_fn: ``loss_fn(output, target) -> mean loss``.
    """

    data: DatasetSplits
    model: nn.Module
    optimizer: torch.optim.Optimizer
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def build_core(cfg: TrainConfig, comm: Communicator, device: torch.device) -> Core:
    """Load the data, build the model (seeded) and the optimizer.

    Args:
        cfg: The run's configuration.
        comm: The training communicator (Shampoo's).
        device: The model's device.

    Returns:
        The parts.

    Raises:
        ConfigError: The global batch exceeds the training set (or a plugin's errors).
    """
    from kfac_hpc.train import plugins

    if cfg.tensorboard is not None:  # on every rank: a missing package stops all alike
        from kfac_hpc.train.metrics import require_tensorboard

        require_tensorboard()
    loss_fn = plugins.resolve_loss(cfg.loss)
    if plugins.is_plugin(cfg.dataset):
        splits = plugins.load_plugin_dataset(
            cfg.dataset, seed=cfg.seed, path=cfg.data_path, augment=cfg.augment,
            image_size=cfg.image_size, split_seed=cfg.split_seed)
    else:
        splits = load_dataset(
            cfg.dataset, path=cfg.data_path, seed=cfg.seed, flat=cfg.model == "mlp",
            augment=cfg.augment, split_seed=cfg.split_seed, image_size=cfg.image_size,
            input_shape=cfg.synthetic_shape, num_classes=cfg.synthetic_classes,
            train_size=cfg.synthetic_train_size, test_size=cfg.synthetic_test_size,
            num_threads=cfg.loader_threads)
    torch.manual_seed(cfg.seed)
    kwargs: dict[str, Any] = dict(splits.model_kwargs())
    if plugins.is_plugin(cfg.model):
        model = plugins.build_plugin_model(cfg.model, **kwargs, **cfg.model_options)
    else:
        model = build_model(cfg.model, **kwargs, **cfg.model_options)
    model = model.to(device)
    _check_model_takes_data(model, splits, cfg, device)
    n = len(splits.train)  # type: ignore[arg-type]
    if cfg.batch_size * comm.size > n:
        raise ConfigError(
            f"--batch-size {cfg.batch_size} x {comm.size} ranks = global batch "
            f"{cfg.batch_size * comm.size} exceeds the {n} training samples of "
            f"{cfg.dataset!r}; lower --batch-size (resuming a checkpoint on more ranks: "
            "give the per-rank batch that keeps its global batch, the global batch "
            "divided by the ranks)")
    return Core(data=splits, model=model, optimizer=build_optimizer(cfg, model, comm),
                loss_fn=loss_fn)


def _check_model_takes_data(model: nn.Module, splits: Any, cfg: TrainConfig,
                            device: torch.device) -> None:
    """Run one test sample through the model (eval mode, no gradient, random states kept).

    A model that cannot take the data set's samples (token ids into an MLP, images
    into a language model, another input size) is one clear error before training,
    not a traceback at the first step.

    Raises:
        ConfigError: The forward failed.
    """
    sample = splits.test[0][0]
    x = sample.unsqueeze(0).to(device) if isinstance(sample, torch.Tensor) else sample
    training = model.training
    devices = [device] if device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            model.eval()
            model(x)
    except (RuntimeError, TypeError, ValueError, IndexError) as exc:
        if isinstance(exc, torch.cuda.OutOfMemoryError):
            raise
        shape = tuple(sample.shape) if isinstance(sample, torch.Tensor) else type(sample)
        dtype = f", {sample.dtype}" if isinstance(sample, torch.Tensor) else ""
        raise ConfigError(
            f"--model {cfg.model} cannot take the samples of --dataset {cfg.dataset} "
            f"(one is {shape}{dtype}): {type(exc).__name__}: {exc}; pick a model for this "
            "data (`kfac-hpc train --help` lists both)") from exc
    finally:
        model.train(training)


def sync_initial_state(model: nn.Module, aux: Communicator) -> None:
    """Start every rank from rank 0's parameters and buffers.

    Seeded initialisation makes this a no-op on CPU; it guards against
    nondeterministic initialisation elsewhere.

    Args:
        model: The model, overwritten in place.
        aux: The communicator to broadcast over.
    """
    if aux.size == 1:
        return
    from kfac_hpc.comm import flatten, unflatten_into

    tensors = [t for t in model.state_dict().values() if t.is_floating_point()]
    if tensors:
        flat = aux.broadcast(flatten(tensors), 0)
        unflatten_into(flat, tensors)


def build_ddp(model: nn.Module, device: torch.device, aux: Communicator, *,
              single_node: bool, resources: contextlib.ExitStack) -> DistributedDataParallel:
    """Wrap ``model`` in torch DDP, starting a process group unless one is running.

    A process group started here is destroyed by ``resources`` (after a barrier).

    Args:
        model: The model.
        device: Its device (nccl on CUDA, gloo otherwise).
        aux: The driver's communicator (rank, size; rank 0 tells where its store is).
        single_node: All ranks run on this machine (the store listens on 127.0.0.1).
        resources: Gets the process group's release.

    Returns:
        The wrapped model.

    Raises:
        ConfigError: torch.distributed runs with another rank or size.
    """
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    rank, size = aux.rank, aux.size
    if dist.is_initialized():
        if dist.get_world_size() != size or dist.get_rank() != rank:
            raise ConfigError("--ddp: torch.distributed is already initialised with a "
                              "different rank/size than this communicator")
    else:
        # Rank 0's store binds a port the OS picks (no bind-close-reuse race), then
        # tells the others where it is.
        timeout = _dt.timedelta(minutes=10)
        store, address = None, None
        if rank == 0:
            host = _ddp_host(single_node)
            store = dist.TCPStore(host, 0, size, is_master=True, timeout=timeout,
                                  wait_for_workers=False)
            address = (host, store.port)
        host, port = aux.broadcast_object(address, 0)
        if store is None:
            store = dist.TCPStore(host, port, size, is_master=False, timeout=timeout)
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=store, rank=rank, world_size=size,
                                timeout=timeout)
        resources.callback(_destroy_process_group)
    ids = [device.index] if device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=ids)


def _destroy_process_group() -> None:
    """End the process group started by :func:`build_ddp` (every rank together)."""
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()


def _ddp_host(single_node: bool) -> str:
    """Where rank 0's DDP store listens.

    Args:
        single_node: All ranks run on this machine.

    Returns:
        ``MASTER_ADDR`` if set, else 127.0.0.1 on one node, else this host's name.
    """
    import socket

    if os.environ.get("MASTER_ADDR"):
        return os.environ["MASTER_ADDR"]
    return "127.0.0.1" if single_node else socket.gethostname()


def build_distributed(cfg: TrainConfig, core: Core, comm: Communicator, *,
                      ddp: bool, device: torch.device, sample_shape: tuple[int, ...],
                      scaler: torch.amp.GradScaler | None, resources: contextlib.ExitStack
                      ) -> tuple[KFACPreconditioner | None, GradientAverager | None, str]:
    """K-FAC and the gradient averaging of a run.

    ``resources`` gets the preconditioner's close and the averager's removal.

    Args:
        cfg: The run's configuration.
        core: The model and optimizer.
        comm: The training communicator.
        ddp: Gradients are averaged by torch DDP.
        device: The model's device.
        sample_shape: One input sample's shape (K-FAC's shape-only pass).
        scaler: The AMP gradient scaler, if any.
        resources: Gets the releases.

    Returns:
        ``(preconditioner or None, averager or None, how gradients are averaged)``.
    """
    pre = None
    if cfg.uses_kfac:
        pre = build_preconditioner(cfg, core.model, comm, core.optimizer, scaler,
                                   sample_shape=sample_shape)
        if pre is not None:
            resources.callback(pre.close)
    if ddp:
        return pre, None, "torch DDP (" + ("nccl" if device.type == "cuda" else "gloo") + ")"
    if comm.size == 1:
        return pre, None, "none (1 rank)"
    averager, name = build_averager(core.model, comm, cfg.grad_bucket_mb)
    resources.callback(averager.remove)
    return pre, averager, name


def resolve_out_dir(cfg: TrainConfig, aux: Communicator) -> Path:
    """Name the run directory of the metrics files.

    Args:
        cfg: The run's configuration (``out``, ``checkpoint_dir``).
        aux: The driver's communicator (rank 0 names a new directory for all).

    Returns:
        ``--out``, else ``--checkpoint-dir``, else a new ``runs/<date>-<time>``.
    """
    if cfg.out is not None:
        return Path(cfg.out)
    if cfg.checkpoint_dir is not None:
        return Path(cfg.checkpoint_dir)
    name = None
    if aux.rank == 0:
        stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
        name, i = f"runs/{stamp}", 1
        while Path(name).exists():
            name, i = f"runs/{stamp}-{i}", i + 1
    return Path(aux.broadcast_object(name, 0))
