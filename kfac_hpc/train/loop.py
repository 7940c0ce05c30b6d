"""The training loop: ``train(config) -> TrainResult``, usable from Python and the CLI.

Runs on every rank of ``comm`` (default: the world). Order of events:

1. ``config.validate()``: pure, identical on every rank, before any collective.
2. Setup (data, model, optimizer, preconditioner) on every rank; the ranks then
   agree (one allgather) so that a bad path or option stops all of them with the
   same :class:`~kfac_hpc.train.config.ConfigError`, never a hang.
3. Optional resume from a checkpoint (``kfac_hpc.checkpoint``, when installed).
4. Epochs of steps: ``lr`` from the schedule -> forward/backward (micro-batches) ->
   gradient averaging (``GradientAverager`` or DDP) -> ``preconditioner.step()``
   -> ``optimizer.step()``; global loss/accuracy per step (one small allreduce on a
   separate communicator that also carries the stop/checkpoint flags, so every rank
   takes the same decision at the same step boundary).
5. Evaluation on the sharded test set, epoch records, final summary.

Divergence: the global loss of every step (already reduced for the metrics, so
checking it costs nothing) and every evaluation must be finite; K-FAC's and Shampoo's
numerical errors (raised alike on every rank) and a checkpoint refused for NaN/Inf
state end the same way: :class:`TrainingDiverged` on every rank, naming the step,
the epoch, the last finite checkpoint and the newest checkpoint taken before the loss
left its running range (:data:`RANGE_FACTOR`); no checkpoint is written after it
(``kfac-hpc train`` exits with :data:`DIVERGED_EXIT_CODE`).

Traffic accounting: ``bytes_per_step`` counts what the training communicator (the
gradient averager and K-FAC) put on the wire during training steps; metric
reductions, evaluation and checkpoints use other counters or are subtracted.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as _dt
import gc
import hashlib
import math
import os
import statistics
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar, cast

import torch
from torch import nn

from kfac_hpc.models import build_model
from kfac_hpc.phases import Phase
from kfac_hpc.runtime.watchdog import Watchdog
from kfac_hpc.shampoo.optimizer import DistributedShampoo
from kfac_hpc.train.config import KEEP_BEST_METRICS, ConfigError, TrainConfig
from kfac_hpc.train.data import DatasetSplits, ShardedLoader, load_dataset, rescaled_batch_size
from kfac_hpc.train.metrics import (
    TRAFFIC_TAGS,
    MetricsWriter,
    PhaseTimer,
    ProgressReporter,
    WeightedMean,
    format_bytes,
    format_table,
    global_sums,
)
from kfac_hpc.train.optim import (
    build_averager,
    build_optimizer,
    build_preconditioner,
    lr_schedule,
)
from kfac_hpc.train.outdirs import check_output_dirs

if TYPE_CHECKING:
    from torch.nn.parallel import DistributedDataParallel

    from kfac_hpc.checkpoint import BackgroundSaver
    from kfac_hpc.comm import Communicator
    from kfac_hpc.comm.gradients import GradientAverager
    from kfac_hpc.kfac.preconditioner import KFACPreconditioner

_T = TypeVar("_T")

__all__ = ["DIVERGED_EXIT_CODE", "TrainResult", "Trainer", "TrainingDiverged", "param_checksum",
           "train"]

#: Exceptions raised by setup that mean "bad input", reported without a traceback.
USAGE_ERRORS: tuple[type[BaseException], ...] = (
    ConfigError, ValueError, FileNotFoundError, ImportError,
)

#: Exit status of ``kfac-hpc train`` after :class:`TrainingDiverged` (0 done, 2 bad input,
#: 75 checkpointed and asks for a requeue).
DIVERGED_EXIT_CODE = 3

#: How :func:`kfac_hpc.checkpoint.load` notes a checkpoint's K-FAC state it did not load
#: because no preconditioner was given.
KFAC_DROPPED = "K-FAC state in the checkpoint not loaded (no preconditioner given)"

#: The loss's running range (named in the divergence message): a step's loss is out of
#: range when it is NaN/Inf, or above ``RANGE_FACTOR`` x the median (when > 0) of the
#: losses of the previous ``RANGE_WINDOW`` steps, once ``RANGE_MIN`` of them are known.
#: The loss left its range at the first step of the out-of-range steps that lead up to
#: the divergence (an in-range step ends such a run).
RANGE_FACTOR = 10.0
RANGE_WINDOW = 50
RANGE_MIN = 10


class TrainingDiverged(FloatingPointError):
    """The loss, the parameters or the K-FAC/Shampoo statistics became NaN or Inf.

    Raised on every rank with the same message, at the same step; nothing was
    checkpointed after the last finite state. ``checkpoint`` is the last finite
    checkpoint (written or resumed from by this run; None if there is none),
    ``before_range`` the newest checkpoint on disk taken before the loss left its
    running range (:data:`RANGE_FACTOR`; None when it did not, or none is kept),
    ``exit_status`` what ``kfac-hpc train`` exits with.
    """

    exit_status = DIVERGED_EXIT_CODE

    def __init__(self, message: str, *, step: int, epoch: int,
                 checkpoint: str | None, before_range: str | None = None) -> None:
        super().__init__(message)
        self.step = step
        self.epoch = epoch
        self.checkpoint = checkpoint
        self.before_range = before_range


def _numerical_errors() -> tuple[type[BaseException], ...]:
    """K-FAC's and Shampoo's numerical errors: raised alike on every rank (agreed).
    Imported here, not at the top: ``kfac_hpc.shampoo`` starts MPI on import."""
    from kfac_hpc.kfac.errors import KFACNumericalError
    from kfac_hpc.shampoo.errors import ShampooNumericalError

    return (KFACNumericalError, ShampooNumericalError)


@dataclass
class TrainResult:
    """What a run achieved; identical on every rank (metrics are global)."""

    epochs: float
    steps: int
    wall_time: float
    setup_time: float
    train_loss: float
    train_acc: float
    test_loss: float
    test_acc: float
    samples_per_s: float
    bytes_per_step: float
    checksum: str
    ranks_agree: bool
    stopped: str  # "completed" | "max_steps" | "target" | "stop_requested"
    world_size: int
    global_batch_size: int
    device: str
    averaging: str
    out_dir: str | None
    time_to_target: float | None = None
    epochs_to_target: int | None = None
    traffic: dict[str, dict[str, int]] = field(default_factory=dict)
    history: list[dict[str, Any]] = field(default_factory=list)
    model: nn.Module | None = field(default=None, repr=False)

    def summary_rows(self, cfg: TrainConfig) -> list[tuple[str, str]]:
        """Rows of the final summary table."""
        rows = [
            ("ranks x device", f"{self.world_size} x {self.device}"),
            ("data / model", f"{cfg.dataset} / {cfg.model}"),
            ("optimizer", cfg.describe_optimizer()),
            ("gradient averaging", self.averaging),
            ("global batch", str(self.global_batch_size)),
            ("epochs / steps", f"{self.epochs:g} / {self.steps}"),
            ("wall time", f"{self.wall_time:.1f} s (+ {self.setup_time:.1f} s setup)"),
            ("final train loss", f"{self.train_loss:.4f}"),
            ("final train accuracy", f"{100 * self.train_acc:.2f} %"),
            ("test loss", f"{self.test_loss:.4f}"),
            ("test accuracy", f"{100 * self.test_acc:.2f} %"),
            *([("test perplexity", f"{perplexity(self.test_loss):.3f}")]
              if cfg.dataset in LANGUAGE_DATASETS else []),
            ("samples/s (training)", f"{self.samples_per_s:,.0f}"),
            ("communicated per step", format_bytes(self.bytes_per_step)),
            ("parameter checksum", self.checksum[:16]
             + ("" if self.ranks_agree else "  (RANKS DIFFER!)")),
        ]
        if self.stopped != "completed":
            rows.insert(5, ("stopped by", self.stopped.replace("_", " ")))
        if cfg.target_accuracy is not None:
            reached = (f"epoch {self.epochs_to_target}, {self.time_to_target:.1f} s"
                       if self.time_to_target is not None else "not reached")
            rows.insert(-3, (f"time to {100 * cfg.target_accuracy:g} %", reached))
        if self.out_dir:
            rows.append(("metrics", self.out_dir))
        return rows


LANGUAGE_DATASETS = ("stdlib-text",)
"""Data sets of next-token prediction: their records add perplexity (``exp`` of the mean
per-token cross-entropy); accuracy there is next-token accuracy."""


def token_view(out: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence outputs ``(B, T, V)`` with targets ``(B, T)`` as ``(B·T, V)`` and
    ``(B·T,)``: the loss is the mean over tokens, accuracy counts tokens. Anything else
    (classifiers: ``(B, C)`` and ``(B,)``) is returned as is."""
    if out.dim() == y.dim() + 1 and y.dim() >= 2 and out.shape[:-1] == y.shape:
        return out.reshape(-1, out.shape[-1]), y.reshape(-1)
    return out, y


def perplexity(loss: float) -> float:
    """``exp(loss)`` of a mean per-token cross-entropy (``inf`` on overflow, NaN stays)."""
    try:
        return math.exp(loss)
    except OverflowError:
        return math.inf


def param_checksum(model: nn.Module) -> str:
    """SHA-256 of the parameters' names and bytes (named order): equal iff bitwise equal."""
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        h.update(name.encode())
        h.update(p.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def train(
    cfg: TrainConfig,
    comm: Communicator | None = None,
    *,
    verbose: bool = True,
    should_stop: Callable[[], bool] | None = None,
) -> TrainResult:
    """Train as configured on every rank of ``comm`` (default: world) and return the result.

    ``should_stop`` (a rank-local flag, e.g. set by a signal handler) is polled at
    every step boundary; if any rank reports ``True`` all ranks checkpoint (when a
    checkpoint directory is configured) and return with ``stopped="stop_requested"``.
    Raises :class:`ConfigError` (on every rank alike) for invalid input and
    :class:`TrainingDiverged` (on every rank alike) when training produced NaN/Inf.
    """
    cfg.validate()
    trainer = Trainer(cfg, comm, verbose=verbose, should_stop=should_stop)
    try:
        return trainer.fit()
    finally:
        trainer.close()


def _local_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


class Trainer:
    """State of one run; :func:`train` is the usual entry point."""

    def __init__(self, cfg: TrainConfig, comm: Communicator | None = None, *,
                 verbose: bool = True,
                 should_stop: Callable[[], bool] | None = None) -> None:
        from kfac_hpc.comm import Communicator, world

        t0 = time.perf_counter()
        cfg = cfg.resolved()
        self.cfg = cfg
        self.comm = comm if comm is not None else world()
        self.rank, self.size = self.comm.rank, self.comm.size
        self.verbose = verbose and self.rank == 0
        self.should_stop = should_stop
        self._pg_owned = False
        self.writer = MetricsWriter(None, enabled=False)
        self.ddp: DistributedDataParallel | None = None
        self.pre: KFACPreconditioner | None = None
        self.scaler: torch.amp.GradScaler | None = None
        self._checkpoints = False  # kfac_hpc.checkpoint in use (--checkpoint-dir/--resume)
        self._bg: BackgroundSaver | None = None  # made at the first background save
        self._watchdog: Watchdog | None = None  # during fit()
        self.last_checkpoint: str | None = None  # the last good one (written or resumed)
        self._epoch = 0  # the epoch in progress (0-based)
        self._step_loss: torch.Tensor | None = None  # this rank's loss sum of the step
        self._losses: deque[float] = deque(maxlen=RANGE_WINDOW)  # finite global losses
        self._left_range: list[float] | None = None  # [step, loss, median, n] (_track_loss)
        self._best: dict[str, Any] | None = None  # --checkpoint-keep-best (_keep_best)
        self._reporter: ProgressReporter | None = None  # progress lines without a terminal
        self._numerical = _numerical_errors()
        self._threads_before = torch.get_num_threads()
        # Metrics, flags and setup agreement travel on a duplicate: never counted as
        # training traffic, never interleaved with the preconditioner's requests.
        self.aux = Communicator(self.comm.mpi.Dup(), name=f"{self.comm.name}/train-aux")
        try:
            self._setup(t0)
        except BaseException:
            self.close()
            raise

    def _setup(self, t0: float) -> None:
        cfg = self.cfg
        node = self.aux.split_shared()
        self.local_rank, self.local_size = node.rank, node.size
        node.free()
        torch.set_num_threads(cfg.threads or max(1, _local_cores() // self.local_size))
        self.device = self._select_device()

        splits, model, opt = self._agreed(self._build_core)
        self.data: DatasetSplits = splits
        self.model: nn.Module = model
        self.opt: torch.optim.Optimizer = opt
        self._sync_initial_state()
        self.train_loader = ShardedLoader(splits.train, batch_size=cfg.batch_size,
                                          rank=self.rank, world_size=self.size, seed=cfg.seed,
                                          shuffle=True, drop_last=True,
                                          **self._pipeline_options())
        if cfg.ddp:
            self._init_ddp()
        self.net: nn.Module = self.ddp if self.ddp is not None else self.model
        if cfg.amp and cfg.amp_dtype == "float16":
            self.scaler = torch.amp.GradScaler("cuda")
        self.averager, self.averaging = self._agreed(self._build_distributed)
        self.timer = PhaseTimer(self.device)
        # the library declares its phases (kfac_hpc.phases); the step records read them
        if self.pre is not None:
            self.pre.phase_timer = self.timer
        if isinstance(self.opt, DistributedShampoo):
            self.opt.phase_timer = self.timer
        self.steps_per_epoch = len(self.train_loader)
        full = self.steps_per_epoch * cfg.epochs
        self.total_steps = min(full, cfg.max_steps) if cfg.max_steps else full
        self.lr_fn = lr_schedule(cfg, self.steps_per_epoch, self.total_steps)
        self.out_dir = self._resolve_out_dir()
        self._agreed(lambda: check_output_dirs(self.rank, self.out_dir, cfg.checkpoint_dir))
        self.step = 0
        self.history: list[dict[str, Any]] = []
        self.train_time = 0.0
        self.train_samples = 0
        self.epoch_stats = WeightedMean()
        self.excluded_bytes = 0
        self._resumed = self._maybe_resume()
        self.writer = MetricsWriter(self.out_dir, enabled=self.rank == 0, append=self._resumed,
                                    tensorboard_dir=cfg.tensorboard)
        self.setup_time = time.perf_counter() - t0

    # ------------------------------------------------------------------ setup
    def _pipeline_options(self) -> dict[str, Any]:
        """Input pipeline of the loaders: workers, prefetch, pinned memory on CUDA."""
        return {"num_workers": self.cfg.loader_workers,
                "prefetch_factor": self.cfg.prefetch_factor,
                "pin_memory": self.device.type == "cuda"}

    def _select_device(self) -> torch.device:
        from kfac_hpc.comm import mpi_vendor
        from kfac_hpc.runtime.device import selected_device
        from kfac_hpc.runtime.discovery import banner, from_mpi, select_device

        # the CLI chose the device before MPI started; a direct caller of train() may not
        device = selected_device()
        if device is None or (self.cfg.device == "cpu") != (device.type == "cpu"):
            device = select_device(self.local_rank, prefer_cuda=self.cfg.device != "cpu")
        job = from_mpi(self.aux)
        if self.rank == 0 and self.verbose:
            print(banner(job, device=device, mpi_library=mpi_vendor(),
                         cuda_aware=self.comm.cuda_aware), flush=True)
        return device

    def _agreed(self, fn: Callable[[], _T]) -> _T:
        """Run ``fn`` on every rank; if it fails anywhere, fail everywhere alike.

        A usage error (bad path, option...) becomes the same :class:`ConfigError` on
        all ranks (the lowest failing rank's message); any other exception is re-raised
        where it happened and reported as a ``RuntimeError`` on the other ranks.
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
        reports = self.aux.allgather_object(
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

    def _build_core(self) -> tuple[DatasetSplits, nn.Module, torch.optim.Optimizer]:
        cfg = self.cfg
        from kfac_hpc.train import plugins

        if cfg.tensorboard is not None:  # on every rank: a missing package stops all alike
            from kfac_hpc.train.metrics import require_tensorboard

            require_tensorboard()
        self.loss_fn = plugins.resolve_loss(cfg.loss)
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
        model = model.to(self.device)
        n = len(splits.train)  # type: ignore[arg-type]
        if cfg.batch_size * self.size > n:
            raise ConfigError(
                f"--batch-size {cfg.batch_size} x {self.size} ranks = global batch "
                f"{cfg.batch_size * self.size} exceeds the {n} training samples of "
                f"{cfg.dataset!r}; lower --batch-size")
        opt = build_optimizer(cfg, model, self.comm)
        self._checkpoints = self._wants_checkpoints()
        return splits, model, opt

    def _build_distributed(self) -> tuple[GradientAverager | None, str]:
        cfg = self.cfg
        if cfg.uses_kfac:
            self.pre = build_preconditioner(cfg, self.model, self.comm, self.opt, self.scaler,
                                            sample_shape=self.data.input_shape)
        if self.ddp is not None:
            return None, "torch DDP (" + ("nccl" if self.device.type == "cuda" else "gloo") + ")"
        if self.size == 1:
            return None, "none (1 rank)"
        return build_averager(self.model, self.comm, cfg.grad_bucket_mb)

    def _wants_checkpoints(self) -> bool:
        """Whether this run writes or reads checkpoints (:mod:`kfac_hpc.checkpoint`)."""
        cfg = self.cfg
        wanted = cfg.checkpoint_dir is not None or cfg.resume not in ("auto", "never")
        if wanted and cfg.resume not in ("auto", "never") and not Path(cfg.resume).exists():
            raise FileNotFoundError(f"--resume: no such checkpoint: {cfg.resume}")
        return wanted

    def _sync_initial_state(self) -> None:
        """Start from rank 0's parameters and buffers (seeded init makes this a no-op
        on CPU; it guards against nondeterministic initialisation elsewhere)."""
        if self.size == 1:
            return
        from kfac_hpc.comm import flatten, unflatten_into

        tensors = [t for t in self.model.state_dict().values() if t.is_floating_point()]
        if tensors:
            flat = self.aux.broadcast(flatten(tensors), 0)
            unflatten_into(flat, tensors)

    def _init_ddp(self) -> None:
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        if dist.is_initialized():
            if dist.get_world_size() != self.size or dist.get_rank() != self.rank:
                raise ConfigError("--ddp: torch.distributed is already initialised with a "
                                  "different rank/size than this communicator")
        else:
            # Rank 0's store binds a port the OS picks (no bind-close-reuse race), then
            # tells the others where it is.
            timeout = _dt.timedelta(minutes=10)
            store, address = None, None
            if self.rank == 0:
                host = _ddp_host(self.local_size == self.size)
                store = dist.TCPStore(host, 0, self.size, is_master=True, timeout=timeout,
                                      wait_for_workers=False)
                address = (host, store.port)
            host, port = self.aux.broadcast_object(address, 0)
            if store is None:
                store = dist.TCPStore(host, port, self.size, is_master=False, timeout=timeout)
            backend = "nccl" if self.device.type == "cuda" else "gloo"
            dist.init_process_group(backend, store=store, rank=self.rank,
                                    world_size=self.size, timeout=timeout)
            self._pg_owned = True
        ids = [self.device.index] if self.device.type == "cuda" else None
        self.ddp = DistributedDataParallel(self.model, device_ids=ids)

    def _resolve_out_dir(self) -> Path:
        cfg = self.cfg
        if cfg.out is not None:
            return Path(cfg.out)
        if cfg.checkpoint_dir is not None:
            return Path(cfg.checkpoint_dir)
        name = None
        if self.rank == 0:
            stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
            name, i = f"runs/{stamp}", 1
            while Path(name).exists():
                name, i = f"runs/{stamp}-{i}", i + 1
        return Path(self.aux.broadcast_object(name, 0))

    # ----------------------------------------------------------------- resume
    def _maybe_resume(self) -> bool:
        """Load the checkpoint to resume from, if any (collective). ``--resume auto``
        tries the newest first and, when a file turns out damaged (checksums, truncated,
        NaN/Inf), says so and goes on to the one before it: a damaged newest file never
        ends a run that has a good older one."""
        from kfac_hpc import checkpoint
        from kfac_hpc.checkpoint.atomic import candidates

        cfg = self.cfg
        if not self._checkpoints or cfg.resume == "never":
            return False
        auto = cfg.resume == "auto"
        paths: list[str] = []
        if self.rank == 0:
            paths = ([str(p) for p in candidates(cfg.checkpoint_dir)] if cfg.checkpoint_dir
                     else []) if auto else [cfg.resume]
        paths = self.aux.broadcast_object(paths, 0)
        if not paths:
            return False
        # load() raises the same error on every rank; the loader check is deterministic:
        # so all ranks report the problem together (exit 2 from the CLI).
        errors = (ValueError, KeyError, checkpoint.CheckpointError)
        damaged: list[str] = []
        for path in paths:
            try:
                info = checkpoint.load(path, model=self.model, optimizer=self.opt,
                                       preconditioner=self.pre, comm=self.comm)
                extra = dict(info.extra or {})
                if "loader" in extra:
                    self._keep_global_batch(extra["loader"], int(info.world_size or 0))
                    self.train_loader.load_state_dict(extra["loader"])
                break
            except errors as exc:
                # all-or-nothing: nothing was applied. A damaged file is skipped (auto);
                # anything else (another model, other options) is the user's to fix.
                problems = (checkpoint.verify_file(path).problems
                            if auto and self.rank == 0 else [])
                problems = self.aux.broadcast_object(problems, 0)
                if not problems:
                    raise ConfigError(f"cannot resume from {path}: {exc}") from None
                damaged.append(path)
                more = f"; {len(problems) - 1} more problem(s)" if len(problems) > 1 else ""
                self._print(f"warning: checkpoint {path} is damaged ({problems[0]}{more}); "
                            "trying the one before it")
        else:
            raise ConfigError(f"no usable checkpoint in {cfg.checkpoint_dir}: every one is "
                              f"damaged ({', '.join(damaged)}); move them away to start "
                              "afresh, or --resume PATH")
        self.step = int(info.step)
        self.last_checkpoint = str(info.path or path)
        metrics = dict(extra.get("metrics") or {})
        self.history = list(metrics.get("history", []))
        self.train_time = float(metrics.get("train_time", 0.0))
        self.train_samples = int(metrics.get("train_samples", 0))
        self.epoch_stats = WeightedMean(*metrics.get("epoch_stats", (0.0, 0.0, 0.0)))
        loss_range = dict(metrics.get("loss_range") or {})
        self._losses.extend(float(v) for v in loss_range.get("window", ()))
        left = loss_range.get("left")
        self._left_range = [float(v) for v in left] if left else None
        best = metrics.get("best")  # the best so far (a checkpoint of another metric: none)
        self._best = dict(best) if best and best.get("metric") == cfg.checkpoint_keep_best \
            else None
        if self.scaler is not None and "grad_scaler" in extra:
            self.scaler.load_state_dict(extra["grad_scaler"])
        self._print(f"resumed from {path} at step {self.step} "
                    f"(epoch {self.train_loader.epoch}, batch {self.train_loader.batch_index})")
        if self.pre is None and any(n.startswith(KFAC_DROPPED) for n in info.mismatches):
            self._print(f"warning: {path} holds K-FAC state (Kronecker factors, eigenbases) "
                        "that --preconditioner none does not use: it is dropped, and the "
                        "checkpoints of this run will not have it; to keep it, resume with "
                        "--preconditioner kfac, or keep a copy of that file")
        return True

    def _background_enabled(self) -> bool:
        """Periodic checkpoints in the background (default on; off with
        ``--no-checkpoint-background`` or ``KFAC_HPC_CHECKPOINT_BACKGROUND=0``)."""
        env = os.environ.get("KFAC_HPC_CHECKPOINT_BACKGROUND", "1").strip().lower()
        on = self.cfg.checkpoint_background and env not in ("0", "false", "no", "off")
        return on and self._checkpoints

    def wait_for_checkpoint(self) -> None:
        """Wait for the background checkpoint in flight, if any (collective); its
        failure is raised as the same CheckpointError on every rank."""
        if self._bg is not None and self._bg.in_flight:
            self._beat(f"waiting for the checkpoint write in flight (step {self.step})")
            path = self._bg.wait()
            if path is not None:
                self.last_checkpoint = str(path)

    def _keep_global_batch(self, loader_state: dict[str, Any], saved_ranks: int) -> None:
        """A restart on a different number of ranks keeps the checkpoint's global batch
        (hence the sample order, the steps per epoch and the learning-rate schedule): the
        per-rank batch is rescaled, or a ValueError says why it cannot be. On the same
        number of ranks ``--batch-size`` is the user's choice (the loader checks it)."""
        saved = int(loader_state.get("global_batch_size", 0) or 0)
        current = self.train_loader.global_batch_size
        if not saved or saved == current or saved_ranks in (0, self.size):
            return
        batch = rescaled_batch_size(saved, self.size, multiple_of=self.cfg.accumulation_steps)
        self._print(f"restart on {self.size} ranks (checkpoint: {saved_ranks}): --batch-size "
                    f"{self.cfg.batch_size} -> {batch} per rank keeps the global batch {saved}")
        self.cfg = dataclasses.replace(self.cfg, batch_size=batch)
        self.train_loader = self.train_loader.with_batch_size(batch)
        self.steps_per_epoch = len(self.train_loader)
        full = self.steps_per_epoch * self.cfg.epochs
        self.total_steps = min(full, self.cfg.max_steps) if self.cfg.max_steps else full
        self.lr_fn = lr_schedule(self.cfg, self.steps_per_epoch, self.total_steps)

    def save_checkpoint(self, background: bool = False) -> None:
        """Write a checkpoint of the current state (all ranks call this together).

        The write in flight, if any, is waited for first (its failure raised here).
        ``background``: snapshot the state and write it while training goes on (when
        enabled); otherwise it is on disk when this returns.
        """
        from kfac_hpc import checkpoint

        if not self._checkpoints or self.cfg.checkpoint_dir is None:
            return
        background = background and self._background_enabled()
        self.wait_for_checkpoint()  # at most one write in flight; its errors first
        self._beat(f"{'snapshot for a background' if background else 'writing a'} "
                   f"checkpoint at step {self.step}")
        before = self.comm.traffic().total_bytes
        extra = {
            "loader": self.train_loader.state_dict(),
            "epoch": self.train_loader.epoch,
            "metrics": {"history": self.history, "train_time": self.train_time,
                        "train_samples": self.train_samples,
                        "epoch_stats": [self.epoch_stats.loss_sum, self.epoch_stats.correct,
                                        self.epoch_stats.count],
                        "loss_range": {"window": list(self._losses), "left": self._left_range},
                        "best": self._best},
            "config": self.cfg.to_dict(),
        }
        if self.scaler is not None:
            extra["grad_scaler"] = self.scaler.state_dict()
        # Between two inverse updates the preconditioner uses stale decompositions: store
        # them, or a resumed run would recompute them from newer factors (not exact). With
        # an inverse update every step they are recomputed anyway: not worth the bytes.
        kwargs: dict[str, Any] = ({} if self.pre is None else
                                  {"store_eigenbases": self.cfg.inv_update_steps > 1})
        every = self.cfg.checkpoint_keep_every_epochs
        if every:  # milestones, never rotated away
            kwargs["keep_every_steps"] = every * self.steps_per_epoch
        if self._best is not None:  # the best by --checkpoint-keep-best, never rotated away
            kwargs["keep"] = (self._best["checkpoint"],)
        try:
            if background:
                if self._bg is None:
                    self._bg = checkpoint.BackgroundSaver(self.comm)
                self._bg.save(self.cfg.checkpoint_dir, model=self.model, optimizer=self.opt,
                              preconditioner=self.pre, step=self.step, extra=extra,
                              keep_last=self.cfg.checkpoint_keep, **kwargs)
                path = None  # known once written (wait_for_checkpoint)
            else:
                path = checkpoint.save(self.cfg.checkpoint_dir, model=self.model,
                                       optimizer=self.opt, preconditioner=self.pre,
                                       step=self.step, comm=self.comm, extra=extra,
                                       keep_last=self.cfg.checkpoint_keep, **kwargs)
        except checkpoint.NonFiniteStateError as exc:  # alike on every rank, nothing written
            raise self._diverged(f"{exc.tensor} became NaN/Inf", self.step) from exc
        if path is not None:
            self.last_checkpoint = str(path)
        self.excluded_bytes += self.comm.traffic().total_bytes - before

    def _numerical_failure(self, exc: BaseException) -> TrainingDiverged:
        """K-FAC or Shampoo gave up on this step (on every rank): if the step's loss was
        already NaN/Inf, that is the message (one allreduce, on this path only)."""
        local = self._step_loss
        (loss,) = global_sums(self.aux, [float(local) if local is not None else 0.0])
        if not math.isfinite(loss):
            self._track_loss(self.step + 1, loss)
            return self._diverged("loss became NaN/Inf", self.step + 1)
        what = "Shampoo" if "Shampoo" in type(exc).__name__ else "K-FAC"
        return self._diverged(f"{what} statistics became NaN/Inf or unusable", self.step + 1,
                              exc)

    def _diverged(self, what: str, step: int, cause: BaseException | None = None
                  ) -> TrainingDiverged:
        """The one message of a diverged run (every rank builds the same one)."""
        with contextlib.suppress(Exception):  # agreed: a failed write is no good checkpoint
            self.wait_for_checkpoint()  # an earlier, good state being written
        if self.last_checkpoint is not None:
            where = self.last_checkpoint
        elif self.cfg.checkpoint_dir is None:
            where = "none (no --checkpoint-dir)"
        else:
            where = f"none yet in {self.cfg.checkpoint_dir}"
        detail = f" ({type(cause).__name__}: {cause})" if cause is not None else ""
        message = (f"{what} at step {step} (epoch {self._epoch + 1}){detail}; "
                   f"last finite checkpoint: {where}")
        before, clause = self._before_range()
        return TrainingDiverged(message + clause, step=step, epoch=self._epoch + 1,
                                checkpoint=self.last_checkpoint, before_range=before)

    def _keep_best(self, record: dict[str, Any]) -> None:
        """``--checkpoint-keep-best METRIC``: when the epoch's ``record`` improves the
        best value of METRIC so far (ties do not), checkpoint this state as the new best.

        The best (metric, value, step, file name) is stored in every checkpoint's
        metrics, so a resumed run goes on from the best so far; its file is passed to
        the rotation as kept. Collective (the record's values are global).
        """
        metric = self.cfg.checkpoint_keep_best
        if not metric or not self._checkpoints or not self.cfg.checkpoint_dir:
            return
        from kfac_hpc.checkpoint.layout import checkpoint_name

        value = float(record.get(metric, math.nan))
        sign = KEEP_BEST_METRICS[metric]
        if not math.isfinite(value) or (self._best is not None
                                        and sign * value <= sign * float(self._best["value"])):
            return
        self._best = {"metric": metric, "value": value, "step": self.step,
                      "checkpoint": checkpoint_name(self.step)}
        self.save_checkpoint()

    def _track_loss(self, step: int, loss: float) -> None:
        """Follow the running range of the global loss of ``step`` (the same on every
        rank; definition: :data:`RANGE_FACTOR`)."""
        window = self._losses
        median = statistics.median(window) if len(window) >= RANGE_MIN else math.nan
        out = not math.isfinite(loss) or (median > 0 and loss > RANGE_FACTOR * median)
        if not out:
            self._left_range = None
        elif self._left_range is None:
            self._left_range = [float(step), loss, median, float(len(window))]
        if math.isfinite(loss):
            window.append(loss)

    def _before_range(self) -> tuple[str | None, str]:
        """The newest checkpoint on disk taken before the loss left its running range
        and the message's clause naming it; ``(None, "")`` while the loss is in range or
        without a checkpoint directory (collective: rank 0 lists the directory)."""
        from kfac_hpc.checkpoint.atomic import list_checkpoints
        from kfac_hpc.checkpoint.layout import step_of_name

        if self._left_range is None or not self._checkpoints or not self.cfg.checkpoint_dir:
            return None, ""
        step, loss, median, n = self._left_range
        found = None
        if self.rank == 0:
            # a checkpoint of step c holds the state that computed the loss of step c + 1
            before = [p for p in list_checkpoints(self.cfg.checkpoint_dir)
                      if (s := step_of_name(p.name)) is not None and s + 1 < step]
            found = str(before[-1]) if before else None
        found = self.aux.broadcast_object(found, 0)
        how = ("NaN/Inf" if not math.isfinite(loss) else
               f"{loss:.4g} > {RANGE_FACTOR:g}x the median {median:.4g} of the previous "
               f"{int(n)} steps")
        name = found or "none kept (--checkpoint-keep-every-epochs keeps milestones)"
        return found, (f"; the loss left its running range at step {int(step)} ({how}); "
                       f"newest checkpoint before that: {name}")

    # ------------------------------------------------------------------ steps
    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        if not self.cfg.amp:
            return contextlib.nullcontext()
        dtype = torch.float16 if self.cfg.amp_dtype == "float16" else torch.bfloat16
        return torch.autocast(device_type="cuda", dtype=dtype)

    def _no_sync(self, last: bool) -> contextlib.AbstractContextManager[Any]:
        """No gradient communication for micro-batches before the last one."""
        if last:
            return contextlib.nullcontext()
        owner = self.ddp if self.ddp is not None else self.averager
        no_sync = getattr(owner, "no_sync", None)
        return no_sync() if no_sync is not None else contextlib.nullcontext()

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float, int]:
        """One optimizer step on this rank's batch: ``(mean loss, correct, samples)``."""
        lr = self.lr_fn(self.step)
        for group in self.opt.param_groups:
            group["lr"] = lr
        self.net.train()
        self.opt.zero_grad(set_to_none=True)
        x = x.to(self.device, non_blocking=True)
        y = y.to(self.device, non_blocking=True)
        n = int(y.numel())
        acc = self.cfg.accumulation_steps
        loss_sum = torch.zeros((), device=self.device)
        correct = torch.zeros((), device=self.device, dtype=torch.long)
        timer = self.timer
        with timer.phase(Phase.FORWARD_BACKWARD):
            for i, (xm, ym) in enumerate(zip(x.tensor_split(acc), y.tensor_split(acc))):
                last = i == acc - 1
                with self._no_sync(last):
                    with self._autocast():
                        out, ym = token_view(self.net(xm), ym)  # language models: per token
                        loss = self.loss_fn(out, ym)
                    scaled = loss * (ym.numel() / n)
                    (self.scaler.scale(scaled) if self.scaler is not None else scaled).backward()
                loss_sum += loss.detach().float() * ym.numel()
                correct += (out.detach().argmax(1) == ym).sum()
        self._step_loss = loss_sum  # read only if K-FAC or Shampoo fail below
        if self.averager is not None:
            with timer.phase(Phase.GRAD_SYNC):
                self.averager.synchronize()
        if self.scaler is not None:
            self.scaler.unscale_(self.opt)
        if self.pre is not None:
            with timer.phase(Phase.KFAC):
                self.pre.step()
        with timer.phase(Phase.OPTIMIZER):
            if self.scaler is not None:
                self.scaler.step(self.opt)
                self.scaler.update()
            else:
                self.opt.step()
        self.step += 1
        return float(loss_sum) / n, float(correct), n

    @torch.no_grad()
    def evaluate(self) -> WeightedMean:
        """Global test loss/accuracy (sharded over ranks, weighted by samples)."""
        self._sync_buffers()
        self.model.eval()
        test = self.data.test
        n = len(test)  # type: ignore[arg-type]
        bs = max(1, min(self.cfg.eval_batch_size, n // self.size))
        loader = ShardedLoader(test, batch_size=bs, rank=self.rank, world_size=self.size,
                               seed=0, shuffle=False, drop_last=False,
                               **self._pipeline_options())
        stats = WeightedMean()
        for i, (x, y) in enumerate(loader):  # epoch 0, un-augmented; empty batches skipped
            self._beat(f"evaluation batch {i + 1} after step {self.step}")
            if y.numel() == 0:
                continue
            x = x.to(self.device, non_blocking=True)
            y = y.to(self.device, non_blocking=True)
            with self._autocast():
                out, y = token_view(self.model(x), y)
            loss = self.loss_fn(out.float(), y)
            stats.add(float(loss), float((out.argmax(1) == y).sum()), int(y.numel()))
        return stats.reduced(self.aux)

    def _sync_buffers(self) -> None:
        """Average floating buffers (BatchNorm running statistics) over ranks."""
        if self.size == 1 or self.ddp is not None:
            return  # DDP broadcasts rank 0's buffers every forward
        from kfac_hpc.comm import flatten, unflatten_into

        bufs = [b for b in self.model.buffers() if b.is_floating_point()]
        if bufs:
            unflatten_into(self.aux.allreduce(flatten(bufs), "avg"), bufs)

    # ------------------------------------------------------------------- loop
    def _progress(self) -> Any:
        # mpiexec (Open MPI) gives ranks a pseudo-terminal for stdout only; srun none.
        stream = next((f for f in (sys.stderr, sys.stdout) if f.isatty()), None)
        if not (self.verbose and self.cfg.progress and stream is not None):
            return None
        try:
            from tqdm import tqdm
        except ImportError:
            return None
        return tqdm(total=self.total_steps, initial=self.step, unit="step", dynamic_ncols=True,
                    file=stream, leave=False)

    def _print(self, text: str, bar: Any = None) -> None:
        if not self.verbose:
            return
        if bar is not None:
            bar.write(text, file=sys.stdout)
        else:
            print(text, flush=True)

    def fit(self) -> TrainResult:
        """Run the configured epochs (or until ``max_steps``/target/stop) and summarise.

        Under a :class:`~kfac_hpc.runtime.watchdog.Watchdog` (``hang_timeout_minutes``):
        a rank that makes no progress for that long ends the job with exit status 4."""
        minutes = self.cfg.hang_timeout_minutes
        if minutes is None:
            return self._fit()
        with Watchdog(60 * minutes, rank=self.rank) as self._watchdog:
            try:
                return self._fit()
            finally:
                self._watchdog = None

    def _beat(self, doing: str) -> None:
        """Progress for the watchdog (no-op without one)."""
        if self._watchdog is not None:
            self._watchdog.beat(doing)

    def _fit(self) -> TrainResult:
        cfg = self.cfg
        self._write_config()
        bar = self._progress()
        self._reporter = (ProgressReporter(
            total_steps=self.total_steps, start_step=self.step, epochs=cfg.epochs,
            every_steps=cfg.progress_every_steps, every_minutes=cfg.progress_every_minutes)
            if self.verbose and cfg.progress and bar is None else None)
        stopped = "completed"
        time_to_target: float | None = None
        epochs_to_target: int | None = None
        last_eval: WeightedMean | None = None
        last_train = WeightedMean()
        bytes_start = self.comm.traffic().total_bytes - self.excluded_bytes
        steps_start = self.step
        wall0 = time.perf_counter() - self.train_time
        self._last_ckpt = time.monotonic()
        epoch = self.train_loader.epoch
        while epoch < cfg.epochs:
            self.train_loader.set_epoch(epoch)
            t_epoch = time.perf_counter()
            if self.step < self.total_steps and self._run_epoch(epoch, bar, wall0):
                stopped = "stop_requested"
            if stopped == "stop_requested":
                break  # checkpointed; leave quickly, without evaluating
            ran_out = self.step >= self.total_steps
            complete = (self.train_loader.epoch > epoch
                        or self.train_loader.batch_index >= self.steps_per_epoch)
            if not (complete or ran_out):
                break  # cannot happen: an epoch ends only at its end or at the last step
            if self.epoch_stats.count:
                last_train = self.epoch_stats
            evaluated = ((epoch + 1) % cfg.eval_every_epochs == 0 or ran_out
                         or epoch + 1 == cfg.epochs)
            if evaluated:
                last_eval = self.evaluate()
                if not math.isfinite(last_eval.loss_sum):
                    raise self._diverged("test loss became NaN/Inf", self.step)
            record = {
                "epoch": (epoch + 1 if complete
                          else epoch + self.train_loader.batch_index / self.steps_per_epoch),
                "step": self.step,
                "lr": self.opt.param_groups[0]["lr"],
                "train_loss": self.epoch_stats.loss,
                "train_acc": self.epoch_stats.acc,
                "test_loss": last_eval.loss if evaluated and last_eval else math.nan,
                "test_acc": last_eval.acc if evaluated and last_eval else math.nan,
                "epoch_time": time.perf_counter() - t_epoch,
                "wall_time": time.perf_counter() - wall0,
                "samples_per_s": self.train_samples / max(self.train_time, 1e-9),
                "bytes_per_step": self._bytes_per_step(bytes_start, steps_start),
            }
            if cfg.dataset in LANGUAGE_DATASETS:  # next-token loss: perplexity = exp(loss)
                record["test_ppl"] = perplexity(record["test_loss"])
                record["train_ppl"] = perplexity(record["train_loss"])
            self.epoch_stats = WeightedMean()
            self.history.append(record)
            self.writer.epoch(record)
            test = f"test_acc {100 * record['test_acc']:.2f}%  " if evaluated else ""
            self._print(
                f"epoch {record['epoch']:g}/{cfg.epochs}  step {self.step}  "
                f"loss {record['train_loss']:.4f}  acc {100 * record['train_acc']:.2f}%  "
                f"{test}({record['epoch_time']:.1f} s)", bar)
            self._keep_best(record)
            if (cfg.target_accuracy is not None and evaluated and last_eval is not None
                    and last_eval.acc >= cfg.target_accuracy):
                time_to_target, epochs_to_target = record["wall_time"], epoch + 1
                stopped = "target"
                break
            if ran_out:
                if self.total_steps < self.steps_per_epoch * cfg.epochs:
                    stopped = "max_steps"
                break
            epoch += 1
        if bar is not None:
            bar.close()
        self.wait_for_checkpoint()
        if stopped != "stop_requested":
            if last_eval is None:
                last_eval = self.evaluate()
            if cfg.checkpoint_dir:
                self.save_checkpoint()
        return self._result(stopped, last_train, last_eval or WeightedMean(), wall0,
                            bytes_start, steps_start, time_to_target, epochs_to_target)

    def _run_epoch(self, epoch: int, bar: Any, wall0: float) -> bool:
        """Steps of ``epoch`` from the loader's position; True if a stop was requested."""
        cfg = self.cfg
        self._epoch = epoch
        t_step = time.perf_counter()
        traffic0 = self._traffic_counts()
        for x, y in self.train_loader:
            self._beat(f"step {self.step + 1} (epoch {epoch + 1})")
            logged = (self.step + 1) % cfg.log_every_steps == 0 or self.step + 1 == self.total_steps
            self.timer.start(logged)
            try:
                loss, correct, n = self.train_step(x, y)
            except self._numerical as exc:  # agreed: the same error on every rank
                raise self._numerical_failure(exc) from exc
            want_ckpt = (cfg.checkpoint_every_minutes is not None and
                         time.monotonic() - self._last_ckpt >= 60 * cfg.checkpoint_every_minutes)
            want_stop = bool(self.should_stop is not None and self.should_stop())
            # One reduction: global metrics plus the flags every rank must agree on.
            g_loss, g_correct, g_n, g_ckpt, g_stop = global_sums(
                self.aux, [loss * n, correct, n, float(want_ckpt), float(want_stop)])
            dt = time.perf_counter() - t_step
            self.train_time += dt
            self.train_samples += int(g_n)
            self.epoch_stats.add(g_loss / g_n, g_correct, int(g_n))
            traffic1 = self._traffic_counts()
            if self.step % cfg.log_every_steps == 0 or self.step == self.total_steps:
                self.writer.step({
                    "step": self.step,
                    "epoch": epoch + self.train_loader.batch_index / self.steps_per_epoch,
                    "lr": self.opt.param_groups[0]["lr"],
                    "loss": g_loss / g_n, "acc": g_correct / g_n, "samples": int(g_n),
                    "step_time": dt, "samples_per_s": g_n / dt,
                    "wall_time": time.perf_counter() - wall0,
                    **self.timer.record(),
                    **{f"bytes_{k}": v1 - traffic0[k] for k, v1 in traffic1.items()},
                })
            traffic0 = traffic1
            line = (self._reporter.update(self.step, epoch + self.train_loader.batch_index
                                          / self.steps_per_epoch, g_loss / g_n, int(g_n))
                    if self._reporter is not None and bar is None else None)
            if line is not None:
                self._print(line)
            if bar is not None:
                bar.update(1)
                bar.set_postfix_str(
                    f"ep {epoch + 1}/{cfg.epochs} loss {g_loss / g_n:.3f} "
                    f"acc {100 * g_correct / g_n:.1f}% {1000 * dt:.0f} ms/step "
                    f"{g_n / dt:,.0f} samples/s", refresh=False)
            self._track_loss(self.step, g_loss / g_n)
            if not math.isfinite(g_loss):  # the global sum: the same verdict on every rank
                raise self._diverged("loss became NaN/Inf", self.step)
            every = cfg.checkpoint_every_steps
            if g_stop > 0 or g_ckpt > 0 or (every and self.step % every == 0):
                # periodic: in the background; on a stop: in the foreground (after the
                # write in flight), so that the process exits with it on disk
                self.save_checkpoint(background=g_stop <= 0)
                self._last_ckpt = time.monotonic()
                traffic0 = self._traffic_counts()  # not the checkpoint's bytes
            if g_stop > 0:
                return True
            if self.step >= self.total_steps:
                return False
            t_step = time.perf_counter()
        return False

    def _traffic_counts(self) -> dict[str, int]:
        """Bytes so far of the training communicator: ``step`` (all, less what metrics
        and checkpoints excluded) and one entry per K-FAC tag (:data:`TRAFFIC_TAGS`)."""
        traffic = self.comm.traffic()
        counts = {"step": traffic.total_bytes - self.excluded_bytes}
        counts.update({tag: traffic.tag_bytes(tag) for tag in TRAFFIC_TAGS})
        return counts

    def _bytes_per_step(self, bytes_start: int, steps_start: int) -> float:
        steps = self.step - steps_start
        if steps <= 0:
            return 0.0
        counted = self.comm.traffic().total_bytes - self.excluded_bytes - bytes_start
        if self.ddp is not None:  # gloo/nccl allreduce of every gradient, not seen by MPI
            counted += steps * sum(p.numel() * p.element_size()
                                   for p in self.model.parameters() if p.requires_grad)
        return counted / steps

    def _result(self, stopped: str, last_train: WeightedMean, last_eval: WeightedMean,
                wall0: float, bytes_start: int, steps_start: int,
                time_to_target: float | None, epochs_to_target: int | None) -> TrainResult:
        checksum = param_checksum(self.model)
        agree = len(set(self.aux.allgather_object(checksum))) == 1
        result = TrainResult(
            epochs=round(self.step / self.steps_per_epoch, 4),
            steps=self.step,
            wall_time=time.perf_counter() - wall0,
            setup_time=self.setup_time,
            train_loss=last_train.loss,
            train_acc=last_train.acc,
            test_loss=last_eval.loss,
            test_acc=last_eval.acc,
            samples_per_s=self.train_samples / max(self.train_time, 1e-9),
            bytes_per_step=self._bytes_per_step(bytes_start, steps_start),
            checksum=checksum,
            ranks_agree=agree,
            stopped=stopped,
            world_size=self.size,
            global_batch_size=self.train_loader.global_batch_size,
            device=str(self.device),
            averaging=self.averaging,
            out_dir=str(self.out_dir),
            time_to_target=time_to_target,
            epochs_to_target=epochs_to_target,
            traffic=self.comm.traffic().snapshot(),
            history=list(self.history),
            model=self.model,
        )
        summary = {k: v for k, v in result.__dict__.items() if k not in ("model", "history")}
        self.writer.write_json("summary.json", summary)
        if self.verbose:
            print(format_table(result.summary_rows(self.cfg), title="kfac-hpc train: summary"))
            if result.stopped != "stop_requested":  # a stopped run was not evaluated
                print(f"final test accuracy: {100 * result.test_acc:.2f} %", flush=True)
        if not agree:
            self._print("WARNING: final parameters differ between ranks")
        return result

    def _write_config(self) -> None:
        import kfac_hpc

        self.writer.write_json("config.json", {
            "config": self.cfg.to_dict(),
            "run": {
                "label": self.cfg.describe_optimizer(),
                "world_size": self.size,
                "device": str(self.device),
                "gradient_averaging": self.averaging,
                "global_batch_size": self.train_loader.global_batch_size,
                "steps_per_epoch": self.steps_per_epoch,
                "total_steps": self.total_steps,
                "torch_threads": torch.get_num_threads(),
                "kfac_hpc": kfac_hpc.__version__,
                "torch": torch.__version__,
                "started_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                "resumed_at_step": self.step if self._resumed else None,
            },
        })

    def close(self) -> None:
        """Release communicators, the DDP process group (if ours) and open files."""
        self.writer.close()
        if self._bg is not None:
            self._bg.close()  # after wait_for_checkpoint(); on an error path: abandoned
        if self.pre is not None:
            self.pre.close()
        averager = getattr(self, "averager", None)  # unset when setup failed before it
        if averager is not None:
            averager.remove()
        if self.ddp is not None:
            # Release DDP's reducer while its process group still exists, on every rank
            # at the same point (after the final collectives of the run).
            self.net = self.model
            self.ddp = None
            gc.collect()
        if self._pg_owned:
            import torch.distributed as dist

            dist.barrier()
            dist.destroy_process_group()
            self._pg_owned = False
        torch.set_num_threads(self._threads_before)
        if self.aux.mpi is not None:
            self.aux.free()
            self.aux.mpi = None  # type: ignore[assignment]


# --------------------------------------------------------------------- helpers


def _ddp_host(single_node: bool) -> str:
    import socket

    if os.environ.get("MASTER_ADDR"):
        return os.environ["MASTER_ADDR"]
    return "127.0.0.1" if single_node else socket.gethostname()
