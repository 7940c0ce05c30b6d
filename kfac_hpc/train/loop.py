"""The training loop: ``train(config) -> TrainResult``, usable from Python and the CLI.

Runs on every rank of ``comm`` (default: the world). Order of events:

1. ``config.validate()``: pure, identical on every rank, before any collective.
2. Setup (data, model, optimizer, preconditioner: :mod:`kfac_hpc.train.setup`) on every
   rank; the ranks then agree (one allgather) so that a bad path or option stops all
   of them with the same :class:`~kfac_hpc.train.config.ConfigError`, never a hang.
3. Optional resume from a checkpoint (:mod:`kfac_hpc.train.checkpoints`; the driver's
   state in it: :mod:`kfac_hpc.train.extra`).
4. Epochs of steps: ``lr`` from the schedule -> forward/backward (micro-batches) ->
   gradient averaging (``GradientAverager`` or DDP) -> ``preconditioner.step()``
   -> ``optimizer.step()``; then one small host-only allreduce of the stop/checkpoint
   flags on a separate communicator, so every rank takes the same decision at the same
   step boundary. The step's loss and accuracy stay on the device
   (:mod:`kfac_hpc.train.pending`) until the next *read point* (a logged step, a
   progress line, a checkpoint, a stop, the end of the epoch or of the run): then all
   of them are read in one go and accounted step by step, in order.
5. Evaluation on the sharded test set, epoch records, final summary
   (:mod:`kfac_hpc.train.tracking`, :mod:`kfac_hpc.train.result`).

Divergence (:mod:`kfac_hpc.train.divergence`): the global loss of every step (checked
at the read point that reads it, before any checkpoint is written) and every evaluation
must be finite; K-FAC's and Shampoo's numerical errors (raised alike on every rank) and a
checkpoint refused for NaN/Inf state end the same way: :class:`TrainingDiverged` on
every rank, naming the step, the epoch, the last finite checkpoint and the newest
checkpoint taken before the loss left its running range (:data:`RANGE_FACTOR`); no
checkpoint is written after it (``kfac-hpc train`` exits with :data:`DIVERGED_EXIT_CODE`).

Traffic accounting: ``bytes_per_step`` counts what the training communicator (the
gradient averager and K-FAC) put on the wire during training steps; metric
reductions, evaluation and checkpoints use other counters or are subtracted.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as _dt
import gc
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from kfac_hpc.phases import Phase
from kfac_hpc.runtime.discovery import singleton_under_srun
from kfac_hpc.runtime.watchdog import Watchdog
from kfac_hpc.shampoo.optimizer import DistributedShampoo
from kfac_hpc.solves import default_device_streams
from kfac_hpc.train.checkpoints import KFAC_DROPPED, CheckpointPolicy, Resumed, wants_checkpoints
from kfac_hpc.train.config import GPU_READ_EVERY_STEPS, ConfigError, TrainConfig
from kfac_hpc.train.data import ShardedLoader, rescaled_batch_size
from kfac_hpc.train.divergence import (
    DIVERGED_EXIT_CODE,
    RANGE_FACTOR,
    RANGE_MIN,
    RANGE_WINDOW,
    LossRange,
    TrainingDiverged,
    diverged,
    numerical_errors,
)
from kfac_hpc.train.extra import TrainExtra
from kfac_hpc.train.metrics import (
    MetricsWriter,
    PhaseTimer,
    WeightedMean,
    format_table,
    global_sums,
    recorded_means,
)
from kfac_hpc.train.optim import lr_schedule, saved_schedule_length, schedule_length
from kfac_hpc.train.outdirs import check_output_dirs
from kfac_hpc.train.pending import PendingMetrics, StepInfo, StepMetrics, read_columns
from kfac_hpc.train.result import (
    LANGUAGE_DATASETS,
    StopReason,
    TrainResult,
    param_checksum,
    perplexity,
)
from kfac_hpc.train.setup import (
    USAGE_ERRORS,
    agreed,
    build_core,
    build_ddp,
    build_distributed,
    check_same_data,
    local_cores,
    node_rank,
    pipeline_options,
    resolve_out_dir,
    select_device,
    sync_initial_state,
)
from kfac_hpc.train.tracking import Progress, RunTally, TrafficMeter, gradient_bytes

if TYPE_CHECKING:
    from kfac_hpc.comm import Communicator
    from kfac_hpc.kfac.preconditioner import KFACPreconditioner
    from kfac_hpc.step_graph import StepGraph

__all__ = ["DIVERGED_EXIT_CODE", "KFAC_DROPPED", "LANGUAGE_DATASETS", "RANGE_FACTOR",
           "RANGE_MIN", "RANGE_WINDOW", "USAGE_ERRORS", "StopReason", "TrainResult", "Trainer",
           "TrainingDiverged", "param_checksum", "perplexity", "token_view", "train"]


def token_view(out: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Flatten sequence outputs and targets to tokens.

    Sequence outputs ``(B, T, V)`` with targets ``(B, T)`` become ``(B·T, V)`` and
    ``(B·T,)``: the loss is the mean over tokens, accuracy counts tokens. Anything else
    (classifiers: ``(B, C)`` and ``(B,)``) is returned as is.

    Args:
        out: The model's output.
        y: The targets.

    Returns:
        ``(out, y)``, per token where they are sequences.
    """
    if out.dim() == y.dim() + 1 and y.dim() >= 2 and out.shape[:-1] == y.shape:
        return out.reshape(-1, out.shape[-1]), y.reshape(-1)
    return out, y


def train(
    cfg: TrainConfig,
    comm: Communicator | None = None,
    *,
    verbose: bool = True,
    should_stop: Callable[[], bool] | None = None,
) -> TrainResult:
    """Train as configured on every rank of ``comm`` and return the result.

    Args:
        cfg: The configuration (validated here, alike on every rank).
        comm: The ranks to train on (default: the world).
        verbose: Print the banner, progress and summary on rank 0.
        should_stop: A rank-local flag (e.g. set by a signal handler) polled at every
            step boundary; if any rank reports ``True`` all ranks checkpoint (when a
            checkpoint directory is configured) and return with
            ``stopped=StopReason.STOP_REQUESTED``.

    Returns:
        What the run achieved (the same on every rank).

    Raises:
        ConfigError: Invalid input (on every rank alike).
        TrainingDiverged: Training produced NaN/Inf (on every rank alike).
    """
    cfg.validate()
    trainer = Trainer(cfg, comm, verbose=verbose, should_stop=should_stop)
    try:
        return trainer.fit()
    finally:
        trainer.close()


@dataclass(frozen=True)
class _Span:
    """Where the training of this process started: the origin of its rates."""

    bytes_start: int  # TrafficMeter.total() then
    steps_start: int
    wall0: float  # perf_counter() less the training time of earlier runs (resume)


def step_graph_of(pre: KFACPreconditioner | None, opt: torch.optim.Optimizer
                  ) -> StepGraph | None:
    """The CUDA graph of the run's steps: K-FAC's, else the optimizer's (Shampoo's)."""
    if pre is not None:
        return pre.step_graph
    return opt.step_graph if isinstance(opt, DistributedShampoo) else None


#: The longest a setup stage may take, at most (:func:`setup_patience`).
SETUP_PATIENCE_S = 600.0


def setup_patience(timeout: float) -> float:
    """Seconds a stage of the setup may take under a watchdog of ``timeout`` seconds.

    Ten times the timeout, at most :data:`SETUP_PATIENCE_S`, never less than the timeout:
    reading a data set's listing or a large checkpoint takes longer than a step, and a
    timeout short enough to catch a hung step soon would end a sound setup.
    """
    return max(timeout, min(SETUP_PATIENCE_S, 10 * timeout))


class Trainer:
    """One run on every rank of ``comm``: built in ``__init__``, trained by :meth:`fit`.

    :func:`train` is the usual entry point. The parts: setup
    (:mod:`~kfac_hpc.train.setup`), the checkpoint policy
    (:class:`~kfac_hpc.train.checkpoints.CheckpointPolicy`), the loss's running range
    (:class:`~kfac_hpc.train.divergence.LossRange`), totals, traffic and progress
    (:mod:`~kfac_hpc.train.tracking`); this class holds them and runs the epochs.
    """

    def __init__(self, cfg: TrainConfig, comm: Communicator | None = None, *,
                 verbose: bool = True,
                 should_stop: Callable[[], bool] | None = None) -> None:
        """Build the run on every rank (collective) and resume it if configured.

        Args:
            cfg: The configuration (validated).
            comm: The ranks to train on (default: the world).
            verbose: Print on rank 0.
            should_stop: A rank-local stop flag (see :func:`train`).

        Raises:
            ConfigError: Bad input (on every rank alike).
        """
        from kfac_hpc.comm import Communicator, world

        t0 = time.perf_counter()
        self.cfg = cfg = cfg.resolved()
        self.comm = comm if comm is not None else world()
        from mpi4py import MPI

        # on MPI's world (kfac-hpc train passes it): a task srun started alone
        alone = (singleton_under_srun(self.comm.size) if self.comm.mpi == MPI.COMM_WORLD
                 else None)
        if alone is not None:  # every task alike: each is its own world
            raise ConfigError(alone)
        self.rank, self.size = self.comm.rank, self.comm.size
        self.verbose = verbose and self.rank == 0
        self.should_stop = should_stop
        self.progress = Progress(cfg, verbose=self.verbose)
        self._watchdog: Watchdog | None = None  # from setup on (hang_timeout_minutes)
        self._epoch = 0  # the epoch in progress (0-based)
        self._wall0 = time.perf_counter()  # the origin of the records' wall times (fit())
        self._step_loss: torch.Tensor | None = None  # this rank's loss sum of the step
        # (step, epoch records) of the last checkpoint written or being written
        self._written: tuple[int, int] | None = None
        self._numerical = numerical_errors()
        # What is acquired below is released by close(), in reverse order.
        self._resources = contextlib.ExitStack()
        if cfg.hang_timeout_minutes is not None:  # setup and resume hang too (collectives)
            self._watchdog = Watchdog(60 * cfg.hang_timeout_minutes, rank=self.rank).start()
            self._resources.callback(self._watchdog.stop)
            self._beat("setting up the communicators and the device", setup=True)
        self._resources.callback(self.progress.close)
        self._resources.callback(torch.set_num_threads, torch.get_num_threads())
        # Metrics, flags and setup agreement travel on a duplicate: never counted as
        # training traffic, never interleaved with the preconditioner's requests.
        self.aux = Communicator(self.comm.mpi.Dup(), name=f"{self.comm.name}/train-aux")
        self._resources.callback(self.aux.free)
        try:
            if cfg.deterministic:  # restored by close(), as the thread count is
                self._resources.callback(setattr, torch.backends.cudnn, "deterministic",
                                         torch.backends.cudnn.deterministic)
                torch.backends.cudnn.deterministic = True
            self.local_rank, self.local_size = node_rank(self.aux)
            share = max(1, local_cores() // self.local_size)  # this rank's cores
            torch.set_num_threads(cfg.threads or share)
            if cfg.decomposition_streams is None:  # 8, or fewer: one waiting thread each
                self.cfg = cfg = dataclasses.replace(
                    cfg, decomposition_streams=default_device_streams(share))
            self.device = select_device(cfg, self.comm, self.aux, self.local_rank,
                                        verbose=self.verbose)
            self._beat("building the data, the model and the optimizer", setup=True)
            core, wanted = agreed(self.aux, lambda: (build_core(cfg, self.comm, self.device),
                                                     wants_checkpoints(cfg)))
            self.data, self.model, self.opt = core.data, core.model, core.optimizer
            self._beat("comparing the ranks' data", setup=True)
            check_same_data(self.aux, self.data)
            self.loss_fn = core.loss_fn
            sync_initial_state(self.model, self.aux)
            self.train_loader = ShardedLoader(
                self.data.train, batch_size=cfg.batch_size, rank=self.rank,
                world_size=self.size, seed=cfg.seed, shuffle=True, drop_last=True,
                **pipeline_options(cfg, self.device))
            self.ddp = (build_ddp(self.model, self.device, self.aux, resources=self._resources,
                                  single_node=self.local_size == self.size)
                        if cfg.ddp else None)
            self._resources.callback(self._release_ddp)
            self.net = self.ddp if self.ddp is not None else self.model
            self.scaler = (torch.amp.GradScaler("cuda")
                           if cfg.amp and cfg.amp_dtype == "float16" else None)
            self.pre, self.averager, self.averaging = agreed(self.aux, lambda: build_distributed(
                cfg, core, self.comm, ddp=self.ddp is not None, device=self.device,
                sample_shape=self.data.input_shape, scaler=self.scaler,
                resources=self._resources))
            self.timer = self._phase_timer()
            # timing synchronises a GPU around every phase of a recorded step (every
            # step by default) and keeps the host from queueing ahead: auto is CPU only
            self.phase_times = cfg.phase_times == "on" or (
                cfg.phase_times == "auto" and self.device.type == "cpu")
            self.steps_per_epoch, self.total_steps, self.lr_fn = self._schedule()
            if cfg.lr_schedule != "constant" and cfg.warmup_epochs >= cfg.epochs:
                self.progress.print(
                    f"warning: the warm-up (--warmup-epochs {cfg.warmup_epochs:g}) lasts all "
                    f"--epochs {cfg.epochs}: the learning rate rises to --lr and the "
                    f"{cfg.lr_schedule} schedule never starts; lower --warmup-epochs or train "
                    "longer")
            self.out_dir = resolve_out_dir(cfg, self.aux)
            agreed(self.aux, lambda: check_output_dirs(self.rank, self.out_dir,
                                                       cfg.checkpoint_dir))
            self.checkpoints = CheckpointPolicy(cfg, self.comm, self.aux, enabled=wanted,
                                                say=self.progress.print, beat=self._beat)
            self._resources.callback(self.checkpoints.close)
            self.step = 0
            self.pending = PendingMetrics(self.aux)  # the steps not read yet
            self.tally = RunTally()
            self.loss_range = LossRange()
            self.traffic = TrafficMeter(self.comm, ddp_bytes_per_step=(
                0 if self.ddp is None else gradient_bytes(self.model)))
            self._beat("looking for a checkpoint to resume from, and loading it", setup=True)
            self.resumed = self._resume()
            if self.resumed is not None:  # the state resumed from is on disk
                self._written = (self.step, len(self.tally.history))
            agreed(self.aux, self.checkpoints.clear_completed)  # vouches for no later run
            self.writer = MetricsWriter(self.out_dir, enabled=self.rank == 0,
                                        append=self.resumed is not None,
                                        resumed_at=None if self.resumed is None else self.step,
                                        resumed_epochs=len(self.tally.history),
                                        tensorboard_dir=cfg.tensorboard)
            self._resources.callback(self.writer.close)
        except BaseException:
            self.close()
            raise
        self.setup_time = time.perf_counter() - t0

    # ------------------------------------------------------------------ setup
    def _phase_timer(self) -> PhaseTimer:
        """Make the timer of the step records' phases and hand it to K-FAC and Shampoo.

        Returns:
            The timer.
        """
        timer = PhaseTimer(self.device)
        # the library declares its phases (kfac_hpc.phases); the step records read them
        if self.pre is not None:
            self.pre.phase_timer = timer
        if isinstance(self.opt, DistributedShampoo):
            self.opt.phase_timer = timer
        return timer

    def _schedule(self) -> tuple[int, int, Callable[[int], float]]:
        """Compute the step schedule of the current loader and configuration.

        Returns:
            ``(steps per epoch, total steps, step -> learning rate)``.
        """
        steps_per_epoch = len(self.train_loader)
        total = schedule_length(steps_per_epoch, self.cfg.epochs, self.cfg.max_steps)
        return steps_per_epoch, total, lr_schedule(self.cfg, steps_per_epoch, total)

    def _release_ddp(self) -> None:
        """Release DDP's reducer while its process group still exists.

        On every rank at the same point (after the final collectives of the run).
        """
        if self.ddp is not None:
            self.net = self.model
            self.ddp = None
            gc.collect()

    def _resume(self) -> Resumed | None:
        """Resume from a checkpoint, if configured and one is there (collective).

        Returns:
            What was resumed from, or None.
        """
        resumed = self.checkpoints.resume(model=self.model, optimizer=self.opt,
                                          preconditioner=self.pre,
                                          position=self._resume_position)
        if resumed is None:
            return None
        extra = resumed.extra
        self.step = resumed.step
        if self.step > self.total_steps:  # alike on every rank
            raise ConfigError(
                f"{resumed.path} is at step {self.step}, past this run's last step "
                f"{self.total_steps} (--epochs {self.cfg.epochs}"
                + (f", --max-steps {self.cfg.max_steps}" if self.cfg.max_steps else "")
                + "): give at least as many epochs and steps, or resume from an earlier "
                "checkpoint (--resume PATH)")
        saved = saved_schedule_length(extra.config, self.steps_per_epoch)
        if saved is not None and saved != self.total_steps:
            self.progress.print(
                f"warning: the learning-rate schedule spans {self.total_steps} steps in this "
                f"run and spanned {saved} in the run that wrote {resumed.path} (--epochs or "
                "--max-steps changed; --max-steps also ends the schedule): the rate jumps at "
                "the resume, and the run is not the uninterrupted one")
        saved_seed = extra.config.get("seed")
        if saved_seed is not None and saved_seed != self.cfg.seed:
            self.progress.print(
                f"warning: --seed {self.cfg.seed} differs from the seed {saved_seed} of the run "
                f"that wrote {resumed.path}: the sample order keeps the saved seed, but the "
                "augmentation (and synthetic data) follow the new one, so the run is not "
                f"the uninterrupted one; resume with --seed {saved_seed} to continue it")
        self.tally = RunTally(history=list(extra.history), train_time=extra.train_time,
                              train_samples=extra.train_samples,
                              epoch_stats=WeightedMean(*extra.epoch_stats))
        self.loss_range = LossRange(extra.loss_window, extra.left_range)
        if self.scaler is not None and extra.grad_scaler is not None:
            self.scaler.load_state_dict(extra.grad_scaler)
        self.progress.print(
            f"resumed from {resumed.path} at step {self.step} "
            f"(epoch {self.train_loader.epoch}, batch {self.train_loader.batch_index})")
        if self.pre is None and resumed.dropped_kfac:
            self.progress.print(
                f"warning: {resumed.path} holds K-FAC state (Kronecker factors, eigenbases) "
                "that --preconditioner none does not use: it is dropped, and the "
                "checkpoints of this run will not have it; to keep it, resume with "
                "--preconditioner kfac, or keep a copy of that file")
        return resumed

    def _resume_position(self, extra: TrainExtra, saved_ranks: int) -> None:
        """Put the training loader where the checkpoint's was.

        A restart on a different number of ranks keeps the checkpoint's global batch
        (hence the sample order, the steps per epoch and the learning-rate schedule):
        the per-rank batch is rescaled, or a ValueError says why it cannot be. On the
        same number of ranks ``--batch-size`` is the user's choice (the loader checks it).

        Args:
            extra: The checkpoint's driver state.
            saved_ranks: Its world size (0: unknown).
        """
        if extra.loader is None:
            return
        saved = int(extra.loader.get("global_batch_size", 0) or 0)
        if saved and saved != self.train_loader.global_batch_size \
                and saved_ranks not in (0, self.size):
            batch = rescaled_batch_size(saved, self.size,
                                        multiple_of=self.cfg.accumulation_steps)
            self.progress.print(
                f"restart on {self.size} ranks (checkpoint: {saved_ranks}): --batch-size "
                f"{self.cfg.batch_size} -> {batch} per rank keeps the global batch {saved}")
            self.cfg = dataclasses.replace(self.cfg, batch_size=batch)
            self.train_loader = self.train_loader.with_batch_size(batch)
            self.steps_per_epoch, self.total_steps, self.lr_fn = self._schedule()
        self.train_loader.load_state_dict(extra.loader)

    # ------------------------------------------------------------- checkpoints
    @property
    def last_checkpoint(self) -> str | None:
        """The last good checkpoint (written or resumed from), if any."""
        return self.checkpoints.last

    def _extra(self) -> TrainExtra:
        """Collect the driver's state, as checkpoints keep it.

        Returns:
            The ``extra`` of a checkpoint of this state.
        """
        stats = self.tally.epoch_stats
        return TrainExtra(
            loader=self.train_loader.state_dict(), epoch=self.train_loader.epoch,
            history=self.tally.history, train_time=self.tally.train_time,
            train_samples=self.tally.train_samples,
            epoch_stats=(stats.loss_sum, stats.correct, stats.count),
            loss_window=tuple(self.loss_range.window), left_range=self.loss_range.left,
            best=self.checkpoints.best, config=self.cfg.to_dict(),
            grad_scaler=None if self.scaler is None else self.scaler.state_dict())

    def save_checkpoint(self, background: bool = False, stopping: bool = False) -> None:
        """Write a checkpoint of the current state (all ranks call this together).

        The steps not read yet are read first (their losses checked: a NaN/Inf loss
        ends the run here, before anything is written), then the write in flight, if
        any, is waited for (its failure raised here, unless ``stopping``).

        Args:
            background: Snapshot the state and write it while training goes on (when
                enabled); otherwise it is on disk when this returns.
            stopping: The checkpoint a stop (a preemption) exits with: a failed write in
                flight is reported and this one is written all the same, as the steps
                since the last good checkpoint would be lost otherwise.

        Raises:
            TrainingDiverged: A loss or the state holds NaN/Inf (nothing written).
        """
        from kfac_hpc import checkpoint

        self._read_pending()  # a read point precedes every save
        try:
            self.wait_for_checkpoint()  # at most one write in flight; its errors first
        except checkpoint.CheckpointError as exc:  # the same on every rank
            self._written = None
            if not stopping:
                raise
            self.progress.print(f"the checkpoint write in flight failed ({exc}); writing "
                                f"the stop's checkpoint at step {self.step} all the same")
        # the state changes with the steps, the driver's with its epoch records
        state = (self.step, len(self.tally.history))
        if self._written == state:
            return  # this very state is on disk already (e.g. the last epoch's, then the end)
        try:
            with self.traffic.excluding():  # not training traffic
                self.checkpoints.save(model=self.model, optimizer=self.opt,
                                      preconditioner=self.pre, step=self.step,
                                      extra=self._extra(), steps_per_epoch=self.steps_per_epoch,
                                      background=background)
        except checkpoint.NonFiniteStateError as exc:  # alike on every rank, nothing written
            raise self._diverged(f"{exc.tensor} became NaN/Inf", self.step) from exc
        self._written = state

    def wait_for_checkpoint(self) -> None:
        """Wait for the background checkpoint in flight, if any (collective).

        Its failure is raised as the same CheckpointError on every rank.
        """
        self.checkpoints.wait(self.step)

    # -------------------------------------------------------------- divergence
    def _numerical_failure(self, exc: BaseException) -> TrainingDiverged:
        """K-FAC or Shampoo gave up on this step (on every rank).

        The steps not read yet are read first: a NaN/Inf loss among them is the
        divergence (as it would have stopped the run at its step). If the failed step's
        loss was already NaN/Inf, that is the message (one allreduce, on this path only).

        Args:
            exc: Their numerical error.

        Returns:
            The error to raise.
        """
        self._read_pending()
        local = self._step_loss
        (loss,) = global_sums(self.aux, [float(local) if local is not None else 0.0])
        if not math.isfinite(loss):
            self.loss_range.track(self.step + 1, loss)
            return self._diverged("loss became NaN/Inf", self.step + 1)
        what = "Shampoo" if "Shampoo" in type(exc).__name__ else "K-FAC"
        return self._diverged(f"{what} statistics became NaN/Inf or unusable", self.step + 1,
                              exc)

    def _diverged(self, what: str, step: int, cause: BaseException | None = None, *,
                  epoch: int | None = None) -> TrainingDiverged:
        """Build the one error of a diverged run (every rank builds the same one; collective).

        Args:
            what: What became NaN/Inf.
            step: The step.
            cause: The numerical error of K-FAC or Shampoo, if that was it.
            epoch: The step's epoch (0-based; default: the epoch in progress).

        Returns:
            The error to raise.
        """
        with contextlib.suppress(Exception):  # agreed: a failed write is no good checkpoint
            self.wait_for_checkpoint()  # an earlier, good state being written
        # the checkpoints on disk are named only where this run writes them
        left = self.loss_range.left if self.checkpoints.directory else None
        before = self.checkpoints.newest_before(left.step) if left is not None else None
        return diverged(what, step=step, epoch=(self._epoch if epoch is None else epoch) + 1,
                        last_checkpoint=self.checkpoints.last,
                        checkpoint_dir=self.cfg.checkpoint_dir, left=left,
                        before_range=before, cause=cause)

    # ------------------------------------------------------------------ steps
    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        """Autocast to the AMP dtype, when AMP is on.

        Returns:
            The context.
        """
        if not self.cfg.amp:
            return contextlib.nullcontext()
        dtype = torch.float16 if self.cfg.amp_dtype == "float16" else torch.bfloat16
        return torch.autocast(device_type="cuda", dtype=dtype)

    def _no_sync(self, last: bool) -> contextlib.AbstractContextManager[Any]:
        """No gradient communication for micro-batches before the last one.

        Args:
            last: This is the step's last micro-batch.

        Returns:
            The context.
        """
        if last:
            return contextlib.nullcontext()
        if self.ddp is not None:
            return self.ddp.no_sync()
        if self.averager is not None:
            return self.averager.no_sync()
        return contextlib.nullcontext()

    def train_step(self, x: torch.Tensor, y: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """One optimizer step on this rank's batch (no host read of its own).

        Args:
            x: The inputs.
            y: The targets.

        Returns:
            ``(loss sum, correct, samples)`` of this rank: the loss summed over the
            samples and the correct predictions as 0-d tensors on the device, not read.
        """
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
        return loss_sum, correct, n

    @torch.no_grad()
    def evaluate(self) -> WeightedMean:
        """Global test loss/accuracy (sharded over ranks, weighted by samples).

        The batches' losses and correct counts stay on the device until the last batch,
        then are read in one go (no device sync per batch).

        Returns:
            The global sums (the same on every rank).
        """
        self._sync_buffers()
        self.model.eval()
        test = self.data.test
        n = len(test)  # type: ignore[arg-type]
        bs = max(1, min(self.cfg.eval_batch_size, n // self.size))
        loader = ShardedLoader(test, batch_size=bs, rank=self.rank, world_size=self.size,
                               seed=0, shuffle=False, drop_last=False, augment=False,
                               **pipeline_options(self.cfg, self.device))
        losses: list[torch.Tensor] = []
        correct: list[torch.Tensor] = []
        counts: list[int] = []
        for i, (x, y) in enumerate(loader):  # un-augmented; empty batches skipped
            self._beat(f"evaluation batch {i + 1} after step {self.step}")
            if y.numel() == 0:
                continue
            x = x.to(self.device, non_blocking=True)
            y = y.to(self.device, non_blocking=True)
            with self._autocast():
                out, y = token_view(self.model(x), y)
            losses.append(self.loss_fn(out.float(), y))
            correct.append((out.argmax(1) == y).sum())
            counts.append(int(y.numel()))
        stats = WeightedMean()
        if counts:
            for loss, right, n in zip(*read_columns(losses, correct), counts):  # one read
                stats.add(loss, right, n)
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
    def fit(self) -> TrainResult:
        """Run the configured epochs (or until ``max_steps``/target/stop) and summarise.

        Under the :class:`~kfac_hpc.runtime.watchdog.Watchdog` started with the setup
        (``hang_timeout_minutes``): a rank that makes no progress for that long ends the
        job with exit status 4.

        Returns:
            What the run achieved (the same on every rank).
        """
        self._beat("starting the training loop")
        return self._fit()

    def _beat(self, doing: str, *, setup: bool = False) -> None:
        """Progress for the watchdog (no-op without one).

        Args:
            doing: What this rank is about to do.
            setup: A stage of the setup (data, model, checkpoint load): it may take
                :func:`setup_patience` of the timeout.
        """
        if self._watchdog is not None:
            self._watchdog.beat(doing, patience=setup_patience(self._watchdog.timeout)
                                if setup else None)

    def _fit(self) -> TrainResult:
        """Run the epochs, then the final evaluation, checkpoint, completion marker and summary.

        Returns:
            What the run achieved.
        """
        cfg = self.cfg
        self._write_config()
        self.progress.start(total_steps=self.total_steps, start_step=self.step)
        span = _Span(bytes_start=self.traffic.total(), steps_start=self.step,
                     wall0=time.perf_counter() - self.tally.train_time)
        self._wall0 = span.wall0
        self.checkpoints.restart_clock()
        stopped = StopReason.COMPLETED
        target: tuple[float, int] | None = None  # (wall time, epochs) to the target
        last_eval: WeightedMean | None = None
        last_train = WeightedMean()
        epoch = self.train_loader.epoch
        while epoch < cfg.epochs:
            self.train_loader.set_epoch(epoch)
            t_epoch = time.perf_counter()
            if self.step < self.total_steps and self._run_epoch(epoch):
                stopped = StopReason.STOP_REQUESTED
                break  # checkpointed; leave quickly, without evaluating
            ran_out = self.step >= self.total_steps
            complete = (self.train_loader.epoch > epoch
                        or self.train_loader.batch_index >= self.steps_per_epoch)
            if not (complete or ran_out):
                break  # cannot happen: an epoch ends only at its end or at the last step
            recorded = self._recorded_end()
            if recorded is not None:  # resumed where this epoch had ended: not again
                self.progress.print(f"epoch {recorded['epoch']:g} ended at step {self.step} "
                                    "before the resume: nothing more to train in it")
                last_train, evaluation = recorded_means(recorded)
                record = recorded
            else:
                if self.tally.epoch_stats.count:
                    last_train = self.tally.epoch_stats
                evaluation = self._evaluation(epoch, ran_out)
                record = self._end_epoch(epoch, complete, evaluation, t_epoch, span)
            if evaluation is not None:
                last_eval = evaluation
            if (cfg.target_accuracy is not None and evaluation is not None
                    and evaluation.acc >= cfg.target_accuracy):
                target = (record["wall_time"], epoch + 1)
                stopped = StopReason.TARGET
                break
            if ran_out:
                if self.total_steps < self.steps_per_epoch * cfg.epochs:
                    stopped = StopReason.MAX_STEPS
                break
            epoch += 1
        self.progress.close()
        self.wait_for_checkpoint()
        if stopped != StopReason.STOP_REQUESTED:
            if last_eval is None:
                last_eval = self.evaluate()
            if cfg.checkpoint_dir:
                self.save_checkpoint()  # unless this very state is on disk already
                self.checkpoints.mark_completed(self.step)
        return self._result(stopped, last_train, last_eval or WeightedMean(), span, target)

    def _recorded_end(self) -> dict[str, Any] | None:
        """The epoch record of this very step, if the run resumed where one had ended.

        That is a resume at the end of an epoch (or of the run) whose record the
        checkpoint holds, with nothing trained since; else None.
        """
        history = self.tally.history
        if history and not self.tally.epoch_stats.count and \
                int(history[-1].get("step", -1)) == self.step:
            return history[-1]
        return None

    def _run_epoch(self, epoch: int) -> bool:
        """Run the steps of ``epoch`` from the loader's position.

        A step reads nothing from the device: its loss and accuracy wait in
        :attr:`pending` until the next read point (:meth:`_read_point`; the end of the
        epoch is one), where :meth:`_read_pending` accounts them in order. Every step
        agrees on the flags (a checkpoint due by time, a stop request) in a host-only
        allreduce.

        Args:
            epoch: The epoch (0-based).

        Returns:
            True if a stop was requested (then the state is checkpointed).
        """
        self._epoch = epoch
        self.pending.restart_clock()
        for x, y in self.train_loader:
            step = self.step + 1
            self._beat(f"step {step} (epoch {epoch + 1})")
            logged = self._logged(step)
            self.timer.start(self.phase_times and logged)
            traffic0 = self.traffic.counts() if logged else None
            try:
                loss_sum, correct, n = self.train_step(x, y)
            except self._numerical as exc:  # agreed: the same error on every rank
                raise self._numerical_failure(exc) from exc
            by_time, stop = self._agree_flags()
            self.pending.add(self._step_info(epoch, traffic0), loss_sum, correct, n)
            checkpoint = by_time or stop or self.checkpoints.due_by_step(self.step)
            if checkpoint or self._read_point(self.step):
                self._read_pending()
            if checkpoint:
                # periodic: in the background; on a stop: in the foreground (after the
                # write in flight), so that the process exits with it on disk
                self.save_checkpoint(background=not stop, stopping=stop)
                self.checkpoints.restart_clock()
                self.pending.restart_clock()  # not the steps' time
            if stop:
                return True
            if self.step >= self.total_steps:
                return False
        self._read_pending()  # the end of the epoch
        return False

    def _agree_flags(self) -> tuple[bool, bool]:
        """Agree on the step boundary's decisions (host memory only: no device sync).

        Returns:
            ``(checkpoint due by time, stop requested)``: each true on every rank if
            true on one.
        """
        want_stop = bool(self.should_stop is not None and self.should_stop())
        flags = np.array([self.checkpoints.due_by_time(), want_stop], dtype=np.int32)
        if self.size > 1:
            self.aux.allreduce(flags, "max")
        return bool(flags[0]), bool(flags[1])

    def _read_point(self, step: int) -> bool:
        """Whether the metrics are read after ``step`` (besides checkpoints and stops).

        Args:
            step: The step.

        Returns:
            True every :attr:`read_every_steps` steps, at the last step and at a
            progress line's step; the same on every rank. A logged step is read with
            its block: its record is written then.
        """
        cfg = self.cfg
        return (step % self.read_every_steps == 0 or step == self.total_steps
                or (cfg.progress and step % cfg.progress_every_steps == 0))

    @property
    def read_every_steps(self) -> int:
        """How often the steps' metrics are read: ``--read-every-steps``, else by device.

        Returns:
            The option; unset, ``--log-every-steps`` on a CPU device (a read costs
            nothing there: each record is written at its step) and at least
            :data:`~kfac_hpc.train.config.GPU_READ_EVERY_STEPS` on any other.
        """
        cfg = self.cfg
        if cfg.read_every_steps is not None:
            return cfg.read_every_steps
        if self.device.type == "cpu":
            return cfg.log_every_steps
        return max(cfg.log_every_steps, GPU_READ_EVERY_STEPS)

    def _logged(self, step: int) -> bool:
        """Whether ``step`` gets a step record (and its phase times).

        Args:
            step: The step.

        Returns:
            True every ``--log-every-steps`` steps and at the last step.
        """
        return step % self.cfg.log_every_steps == 0 or step == self.total_steps

    def _step_info(self, epoch: int, traffic0: dict[str, int] | None) -> StepInfo:
        """What the host knows of the step just taken (read with its metrics later).

        Args:
            epoch: Its epoch (0-based).
            traffic0: :meth:`TrafficMeter.counts` before it, if it is logged.

        Returns:
            Its host-side record.
        """
        fields: dict[str, float] | None = None
        if traffic0 is not None:
            traffic1 = self.traffic.counts()
            fields = {**self.timer.record(),
                      **{f"bytes_{k}": v1 - traffic0[k] for k, v1 in traffic1.items()}}
        return StepInfo(step=self.step, epoch=epoch,
                        epoch_progress=epoch + self.train_loader.batch_index
                        / self.steps_per_epoch,
                        lr=self.opt.param_groups[0]["lr"], fields=fields)

    def _read_pending(self) -> None:
        """A read point: account the steps not read yet, in order (collective).

        Each step as it would have been alone: the totals, its record and progress, the
        loss's running range, then the divergence check.

        Raises:
            TrainingDiverged: A step's global loss is NaN/Inf (named: that step).
        """
        for m in self.pending.read():
            self.tally.add_step(m.loss_sum, m.correct, m.samples, m.seconds)
            self._log_step(m)
            self.loss_range.track(m.info.step, m.loss)
            if not math.isfinite(m.loss_sum):  # the global sum: the same verdict everywhere
                raise self._diverged("loss became NaN/Inf", m.info.step, epoch=m.info.epoch)

    def _log_step(self, m: StepMetrics) -> None:
        """Record and show a step just read.

        Args:
            m: Its global metrics.
        """
        info = m.info
        if info.fields is not None:
            self.writer.step({
                "step": info.step, "epoch": info.epoch_progress, "lr": info.lr,
                "loss": m.loss, "acc": m.acc, "samples": m.samples,
                "step_time": m.seconds, "samples_per_s": m.samples / m.seconds,
                "wall_time": time.perf_counter() - self._wall0,
                **info.fields,
            })
        self.progress.step(step=info.step, epoch=info.epoch, loss=m.loss, acc=m.acc,
                           samples=m.samples, seconds=m.seconds,
                           epoch_progress=info.epoch_progress)

    def _evaluation(self, epoch: int, ran_out: bool) -> WeightedMean | None:
        """Evaluate at the end of ``epoch`` when it is time.

        Args:
            epoch: The epoch just ended (0-based).
            ran_out: The run's last step was taken.

        Returns:
            The global test metrics, or None when this epoch is not evaluated.

        Raises:
            TrainingDiverged: The test loss is NaN/Inf.
        """
        cfg = self.cfg
        if not ((epoch + 1) % cfg.eval_every_epochs == 0 or ran_out
                or epoch + 1 == cfg.epochs):
            return None
        stats = self.evaluate()
        if not math.isfinite(stats.loss_sum):
            raise self._diverged("test loss became NaN/Inf", self.step)
        return stats

    def _end_epoch(self, epoch: int, complete: bool, evaluation: WeightedMean | None,
                   t_epoch: float, span: _Span) -> dict[str, Any]:
        """Record the epoch, print its line, checkpoint it if it is the best so far.

        Args:
            epoch: The epoch (0-based).
            complete: It ran to its end (else the run's last step ended it).
            evaluation: Its test metrics, if evaluated.
            t_epoch: ``perf_counter()`` at its start.
            span: Where this process's training started.

        Returns:
            The epoch's record (as in ``metrics.jsonl``).
        """
        cfg = self.cfg
        stats = self.tally.epoch_stats
        record = {
            "epoch": (epoch + 1 if complete
                      else epoch + self.train_loader.batch_index / self.steps_per_epoch),
            "step": self.step,
            "lr": self.opt.param_groups[0]["lr"],
            "train_loss": stats.loss,
            "train_acc": stats.acc,
            "test_loss": evaluation.loss if evaluation is not None else math.nan,
            "test_acc": evaluation.acc if evaluation is not None else math.nan,
            "epoch_time": time.perf_counter() - t_epoch,
            "wall_time": time.perf_counter() - span.wall0,
            "samples_per_s": self.tally.samples_per_s,
            "bytes_per_step": self.traffic.per_step(span.bytes_start,
                                                    self.step - span.steps_start),
        }
        if cfg.dataset in LANGUAGE_DATASETS:  # next-token loss: perplexity = exp(loss)
            record["test_ppl"] = perplexity(record["test_loss"])
            record["train_ppl"] = perplexity(record["train_loss"])
        self.tally.epoch_stats = WeightedMean()
        self.tally.history.append(record)
        self.writer.epoch(record)
        test = f"test_acc {100 * record['test_acc']:.2f}%  " if evaluation is not None else ""
        self.progress.print(
            f"epoch {record['epoch']:g}/{cfg.epochs}  step {self.step}  "
            f"loss {record['train_loss']:.4f}  acc {100 * record['train_acc']:.2f}%  "
            f"{test}({record['epoch_time']:.1f} s)")
        if self.checkpoints.improves(record, self.step):
            self.save_checkpoint()
        return record

    def _result(self, stopped: StopReason, last_train: WeightedMean, last_eval: WeightedMean,
                span: _Span, target: tuple[float, int] | None) -> TrainResult:
        """Summarise the run: ``summary.json``, the table, the parameters' agreement.

        Args:
            stopped: Why it ended.
            last_train: The last epoch's training metrics.
            last_eval: The last test metrics.
            span: Where this process's training started.
            target: ``(wall time, epochs)`` to the target accuracy, if reached.

        Returns:
            The result (the same on every rank).
        """
        checksum = param_checksum(self.model)
        agree = len(set(self.aux.allgather_object(checksum))) == 1
        result = TrainResult(
            epochs=round(self.step / self.steps_per_epoch, 4),
            steps=self.step,
            wall_time=time.perf_counter() - span.wall0,
            setup_time=self.setup_time,
            train_loss=last_train.loss,
            train_acc=last_train.acc,
            test_loss=last_eval.loss,
            test_acc=last_eval.acc,
            samples_per_s=self.tally.samples_per_s,
            bytes_per_step=self.traffic.per_step(span.bytes_start,
                                                 self.step - span.steps_start),
            checksum=checksum,
            ranks_agree=agree,
            stopped=stopped,
            world_size=self.size,
            global_batch_size=self.train_loader.global_batch_size,
            device=str(self.device),
            averaging=self.averaging,
            out_dir=str(self.out_dir),
            time_to_target=None if target is None else target[0],
            epochs_to_target=None if target is None else target[1],
            traffic=self.comm.traffic().snapshot(),
            history=list(self.tally.history),
            step_graph=self._step_graph_report(),
            model=self.model,
        )
        summary = {k: v for k, v in result.__dict__.items() if k not in ("model", "history")}
        self.writer.write_json("summary.json", summary)
        if self.verbose:
            print(format_table(result.summary_rows(self.cfg), title="kfac-hpc train: summary"))
            if result.stopped != StopReason.STOP_REQUESTED:  # a stopped run: not evaluated
                print(f"final test accuracy: {100 * result.test_acc:.2f} %", flush=True)
        if not agree:
            self.progress.print("WARNING: final parameters differ between ranks")
        return result

    def _step_graph_report(self) -> dict[str, Any] | None:
        """The optimizer's CUDA graph over the ranks (None: none has one); collective.

        The fewest captures and replays of any rank, and the first rank's reason where
        a failed capture turned the graphs off (each rank captures its own work).
        """
        graph = step_graph_of(self.pre, self.opt)
        reports = self.aux.allgather_object(None if graph is None else graph.report())
        mine = [(rank, r) for rank, r in enumerate(reports) if r is not None]
        if not mine:
            return None
        off = next((f"rank {rank}: {r['disabled']}" for rank, r in mine if r["disabled"]),
                   None)
        return {"captures": min(r["captures"] for _, r in mine),
                "replays": min(r["replays"] for _, r in mine), "disabled": off,
                "ranks": len(mine)}

    def _write_config(self) -> None:
        """Write ``config.json``: the configuration and what this run made of it."""
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
                # the optimizer's steps captured as a CUDA graph (cuda_graphs None: the
                # device's default, kfac_hpc.step_graph.DEFAULT_DEVICES)
                "step_graph": step_graph_of(self.pre, self.opt) is not None,
                "kfac_hpc": kfac_hpc.__version__,
                "torch": torch.__version__,
                "started_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                "resumed_at_step": self.step if self.resumed is not None else None,
            },
        })

    def close(self) -> None:
        """Release what the run acquired, in reverse order (collective; idempotent).

        Open files, the background checkpoint writer, K-FAC, the gradient averager,
        DDP and its process group (if started here), the thread count, communicators.
        """
        self._resources.close()
