"""The driver's checkpoint policy: when to save, what to keep, where to resume from.

* When: every ``--checkpoint-every-steps`` steps, every ``--checkpoint-every-minutes``
  (a rank-local clock; the loop agrees on it with the step's metrics), on a stop
  request, at the end, and at every epoch that improves ``--checkpoint-keep-best``.
* How: periodic checkpoints in the background (:class:`~kfac_hpc.checkpoint.BackgroundSaver`,
  at most one write in flight), the others in the foreground.
* What is kept: the last ``--checkpoint-keep``, milestones
  (``--checkpoint-keep-every-epochs``) and the best (``--checkpoint-keep-best``).
* Resume: ``--resume auto`` tries the newest checkpoint first and goes on to older ones
  while they are damaged; ``--resume PATH`` that file.
* Completion: a run that ends complete (not stopped, no error) leaves the marker
  ``completed`` (:data:`~kfac_hpc.checkpoint.layout.COMPLETED`) beside its final
  checkpoint; a run removes an earlier run's marker before it trains.

The driver's state travels in the checkpoint's ``extra`` (:mod:`kfac_hpc.train.extra`).
Every method is collective unless it says otherwise.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from kfac_hpc.train.config import KEEP_BEST_METRICS, ConfigError, TrainConfig
from kfac_hpc.train.extra import Best, TrainExtra

if TYPE_CHECKING:
    from kfac_hpc.checkpoint import BackgroundSaver
    from kfac_hpc.comm import Communicator
    from kfac_hpc.kfac.preconditioner import KFACPreconditioner

__all__ = ["KFAC_DROPPED", "CheckpointPolicy", "Resumed", "wants_checkpoints"]

#: How :func:`kfac_hpc.checkpoint.load` notes a checkpoint's K-FAC state it did not load
#: because no preconditioner was given.
KFAC_DROPPED = "K-FAC state in the checkpoint not loaded (no preconditioner given)"


def wants_checkpoints(cfg: TrainConfig) -> bool:
    """Whether a run writes or reads checkpoints (:mod:`kfac_hpc.checkpoint`).

    Args:
        cfg: The run's configuration.

    Returns:
        True with ``--checkpoint-dir`` or ``--resume PATH``.

    Raises:
        FileNotFoundError: ``--resume PATH`` names no file.
    """
    wanted = cfg.checkpoint_dir is not None or cfg.resume not in ("auto", "never")
    if wanted and cfg.resume not in ("auto", "never") and not Path(cfg.resume).exists():
        raise FileNotFoundError(f"--resume: no such checkpoint: {cfg.resume}")
    return wanted


@dataclass(frozen=True)
class Resumed:
    """The checkpoint a run resumed from.

    Attributes:
        path: Its file.
        step: Its step.
        extra: The driver's state in it.
        dropped_kfac: It held K-FAC state that this run (no preconditioner) dropped.
    """

    path: str
    step: int
    extra: TrainExtra
    dropped_kfac: bool


class CheckpointPolicy:
    """When the driver checkpoints, what it keeps, and where it resumes from.

    Attributes:
        enabled: This run writes or reads checkpoints.
        last: The last good checkpoint (written or resumed from), if any.
        best: The best epoch so far by ``--checkpoint-keep-best``, if any.
    """

    def __init__(self, cfg: TrainConfig, comm: Communicator, aux: Communicator, *,
                 enabled: bool, say: Callable[[str], None],
                 beat: Callable[[str], None]) -> None:
        """Set the policy of a run.

        Args:
            cfg: The run's configuration (its checkpoint options).
            comm: The training communicator (checkpoints are written over it).
            aux: The driver's own communicator (agreements, listings).
            enabled: Whether the run writes or reads checkpoints
                (:func:`wants_checkpoints`).
            say: Prints a line on rank 0 (warnings, resume notes).
            beat: Tells the hang watchdog what is being done.
        """
        self.cfg = cfg
        self.comm = comm
        self.aux = aux
        self.enabled = enabled
        self.say = say
        self.beat = beat
        self.last: str | None = None
        self.best: Best | None = None
        self._bg: BackgroundSaver | None = None  # made at the first background save
        self._said_threads = False  # the note on MPI's thread level, once
        self._last_time = time.monotonic()

    @property
    def directory(self) -> str | None:
        """The directory checkpoints are written to (None: none are)."""
        return self.cfg.checkpoint_dir if self.enabled else None

    # ------------------------------------------------------------------ when
    def restart_clock(self) -> None:
        """Count ``--checkpoint-every-minutes`` from now (local)."""
        self._last_time = time.monotonic()

    def due_by_time(self) -> bool:
        """Whether ``--checkpoint-every-minutes`` have passed on this rank (local).

        Returns:
            This rank's wish; the loop agrees on it with the other ranks.
        """
        minutes = self.cfg.checkpoint_every_minutes
        return minutes is not None and time.monotonic() - self._last_time >= 60 * minutes

    def due_by_step(self, step: int) -> bool:
        """Whether ``--checkpoint-every-steps`` asks for a checkpoint after ``step``.

        Args:
            step: The step just taken.

        Returns:
            The same answer on every rank.
        """
        every = self.cfg.checkpoint_every_steps
        return bool(every and step % every == 0)

    def improves(self, record: Mapping[str, Any], step: int) -> bool:
        """``--checkpoint-keep-best``: note the epoch's ``record`` if it improves the best.

        Ties do not improve. The caller then checkpoints this state as the new best; its
        file is kept by the rotation, and the best travels in every checkpoint's
        metrics, so a resumed run goes on from the best so far.

        Args:
            record: The epoch's record (global values: the same on every rank).
            step: The step it ends at.

        Returns:
            True when it is the new best (to be checkpointed).
        """
        metric = self.cfg.checkpoint_keep_best
        if not metric or self.directory is None:
            return False
        from kfac_hpc.checkpoint.layout import checkpoint_name

        value = float(record.get(metric, math.nan))
        sign = KEEP_BEST_METRICS[metric]
        if not math.isfinite(value) or (self.best is not None
                                        and sign * value <= sign * self.best.value):
            return False
        self.best = Best(metric=metric, value=value, step=step,
                         checkpoint=checkpoint_name(step))
        return True

    # ------------------------------------------------------------------ write
    def background_enabled(self) -> bool:
        """Whether periodic checkpoints are written in the background (local).

        Default on; off with ``--no-checkpoint-background`` or
        ``KFAC_HPC_CHECKPOINT_BACKGROUND=0``.

        Returns:
            True when they are.
        """
        env = os.environ.get("KFAC_HPC_CHECKPOINT_BACKGROUND", "1").strip().lower()
        on = self.cfg.checkpoint_background and env not in ("0", "false", "no", "off")
        if on and self.enabled and self.comm.size > 1 and not self._threads_ok():
            return False
        return on and self.enabled

    def _threads_ok(self) -> bool:
        """Whether the MPI library lets a writer thread run beside training (MULTIPLE).

        Said once on rank 0 when not: the checkpoints are then written in the foreground.
        """
        from mpi4py import MPI

        from kfac_hpc.comm import threads

        level = threads.provided_level()
        if level >= MPI.THREAD_MULTIPLE:
            return True
        if not self._said_threads:
            self._said_threads = True
            self.say(f"note: the MPI library provides {threads.level_name(level)}, not "
                     "MPI_THREAD_MULTIPLE: checkpoints are written in the foreground")
        return False

    def save(self, *, model: nn.Module, optimizer: torch.optim.Optimizer,
             preconditioner: KFACPreconditioner | None, step: int, extra: TrainExtra,
             steps_per_epoch: int, background: bool) -> None:
        """Write a checkpoint of this state (no-op without a checkpoint directory).

        The write in flight, if any, is waited for first (its failure raised here).

        Args:
            model: The model.
            optimizer: The optimizer.
            preconditioner: K-FAC, if used.
            step: The step the state is at.
            extra: The driver's state.
            steps_per_epoch: Steps per epoch (milestones are given in epochs).
            background: Snapshot the state and write it while training goes on (when
                enabled); otherwise it is on disk when this returns.

        Raises:
            kfac_hpc.checkpoint.NonFiniteStateError: The state holds NaN/Inf (alike on
                every rank; nothing written).
        """
        from kfac_hpc import checkpoint

        directory = self.directory
        if directory is None:
            return
        background = background and self.background_enabled()
        self.wait(step)  # at most one write in flight; its errors first
        self.beat(f"{'snapshot for a background' if background else 'writing a'} "
                  f"checkpoint at step {step}")
        # Between two inverse updates the preconditioner uses stale decompositions: store
        # them, or a resumed run would recompute them from newer factors (not exact). With
        # an inverse update every step they are recomputed anyway: not worth the bytes.
        kwargs: dict[str, Any] = ({} if preconditioner is None else
                                  {"store_eigenbases": self.cfg.base_update_steps[1] > 1})
        every = self.cfg.checkpoint_keep_every_epochs
        if every:  # milestones, never rotated away
            kwargs["keep_every_steps"] = every * steps_per_epoch
        if self.best is not None:  # the best by --checkpoint-keep-best, never rotated away
            kwargs["keep"] = (self.best.checkpoint,)
        if background:
            if self._bg is None:
                self._bg = checkpoint.BackgroundSaver(self.comm)
            self._bg.save(directory, model=model, optimizer=optimizer,
                          preconditioner=preconditioner, step=step, extra=extra.to_dict(),
                          keep_last=self.cfg.checkpoint_keep, **kwargs)
            return  # its path is known once written (wait)
        path = checkpoint.save(directory, model=model, optimizer=optimizer,
                               preconditioner=preconditioner, step=step, comm=self.comm,
                               extra=extra.to_dict(), keep_last=self.cfg.checkpoint_keep,
                               **kwargs)
        self.last = str(path)

    def wait(self, step: int) -> None:
        """Wait for the background checkpoint in flight, if any.

        Args:
            step: The step training is at (for the hang watchdog's note).

        Raises:
            kfac_hpc.checkpoint.CheckpointError: The write failed (alike on every rank).
        """
        if self._bg is not None and self._bg.in_flight:
            self.beat(f"waiting for the checkpoint write in flight (step {step})")
            path = self._bg.wait()
            if path is not None:
                self.last = str(path)

    def newest_before(self, step: int) -> str | None:
        """Find the newest checkpoint on disk whose state computed a loss before ``step``.

        Rank 0 lists the directory and tells the others.

        Args:
            step: A step (where the loss left its running range).

        Returns:
            Its file, or None (none kept, or no checkpoint directory).
        """
        from kfac_hpc.checkpoint.atomic import list_checkpoints
        from kfac_hpc.checkpoint.layout import step_of_name

        directory = self.directory
        if directory is None:
            return None
        found = None
        if self.aux.rank == 0:
            # a checkpoint of step c holds the state that computed the loss of step c + 1
            before = [p for p in list_checkpoints(directory)
                      if (s := step_of_name(p.name)) is not None and s + 1 < step]
            found = str(before[-1]) if before else None
        agreed: str | None = self.aux.broadcast_object(found, 0)
        return agreed

    # ------------------------------------------------------------- completion
    def clear_completed(self) -> None:
        """Remove the completion marker of an earlier run (rank 0; no-op elsewhere).

        Called once the run has decided where it resumes from, before it trains: a
        marker then only ever vouches for the run that wrote it.

        Raises:
            ConfigError: The marker is there and cannot be removed.
        """
        from kfac_hpc.checkpoint.layout import COMPLETED

        directory = self.directory
        if directory is None or self.aux.rank != 0:
            return
        marker = Path(directory) / COMPLETED
        try:
            marker.unlink(missing_ok=True)
        except OSError as exc:
            raise ConfigError(f"--checkpoint-dir {directory}: cannot remove {marker} of an "
                              f"earlier run ({exc.strerror or exc}); remove it and run "
                              "again") from None

    def mark_completed(self, step: int) -> None:
        """Write the completion marker (rank 0; no-op elsewhere or without a directory).

        Called when the run ended complete, after its final checkpoint is on disk. A job
        script (``jobs/lib/requeue.sh``) reads exit status 0 as "done" only with it.
        The file is one JSON line, ``{"step": <final step>}``, written atomically. A
        failure to write it is a warning: the run is then taken for incomplete and a
        rerun resumes from the final checkpoint.

        Args:
            step: The final step.
        """
        from kfac_hpc.checkpoint.layout import COMPLETED, to_json
        from kfac_hpc.files import write_text_atomic

        directory = self.directory
        if directory is None or self.aux.rank != 0:
            return
        try:
            write_text_atomic(Path(directory) / COMPLETED, to_json({"step": step}) + "\n")
        except OSError as exc:
            self.say(f"warning: cannot write {Path(directory) / COMPLETED} "
                     f"({exc.strerror or exc}): a job script will take this run for "
                     "incomplete")

    def close(self) -> None:
        """Release the background writer (after :meth:`wait`; on an error: abandoned)."""
        if self._bg is not None:
            self._bg.close()

    # ----------------------------------------------------------------- resume
    def resume(self, *, model: nn.Module, optimizer: torch.optim.Optimizer,
               preconditioner: KFACPreconditioner | None,
               position: Callable[[TrainExtra, int], None]) -> Resumed | None:
        """Load the checkpoint to resume from, if any.

        ``--resume auto`` tries the newest first and, when a file turns out damaged
        (checksums, truncated, NaN/Inf), says so and goes on to the one before it: a
        damaged newest file never ends a run that has a good older one.

        Args:
            model: Loaded in place.
            optimizer: Loaded in place.
            preconditioner: Loaded in place (None: K-FAC state in the file is dropped).
            position: Applies the loaded ``extra`` (the loader position) given the
                checkpoint's world size; may raise ValueError (it cannot be applied).

        Returns:
            What was resumed from, or None (nothing to resume from).

        Raises:
            ConfigError: The checkpoint does not fit this run, or every one is damaged.
        """
        from kfac_hpc import checkpoint
        from kfac_hpc.checkpoint.atomic import candidates

        cfg = self.cfg
        if not self.enabled or cfg.resume == "never":
            return None
        auto = cfg.resume == "auto"
        paths: list[str] = []
        if self.aux.rank == 0:
            paths = ([str(p) for p in candidates(cfg.checkpoint_dir)] if cfg.checkpoint_dir
                     else []) if auto else [cfg.resume]
        paths = self.aux.broadcast_object(paths, 0)
        if not paths:
            return None
        # load() raises the same error on every rank; the loader check is deterministic:
        # so all ranks report the problem together (exit 2 from the CLI).
        errors = (ValueError, KeyError, checkpoint.CheckpointError)
        damaged: list[str] = []
        for path in paths:
            try:
                info = checkpoint.load(path, model=model, optimizer=optimizer,
                                       preconditioner=preconditioner, comm=self.comm)
                extra = TrainExtra.from_dict(info.extra)
                position(extra, int(info.world_size or 0))
                break
            except errors as exc:
                # all-or-nothing: nothing was applied. A damaged file is skipped (auto);
                # anything else (another model, other options) is the user's to fix.
                problems = (checkpoint.verify_file(path).problems
                            if auto and self.aux.rank == 0 else [])
                problems = self.aux.broadcast_object(problems, 0)
                if not problems:
                    raise ConfigError(f"cannot resume from {path}: {exc}") from None
                damaged.append(path)
                more = f"; {len(problems) - 1} more problem(s)" if len(problems) > 1 else ""
                self.say(f"warning: checkpoint {path} is damaged ({problems[0]}{more}); "
                         "trying the one before it")
        else:
            raise ConfigError(f"no usable checkpoint in {cfg.checkpoint_dir}: every one is "
                              f"damaged ({', '.join(damaged)}); move them away to start "
                              "afresh, or --resume PATH")
        self.last = str(info.path or path)
        # the best so far (a checkpoint of another metric: none)
        best = extra.best
        self.best = best if best is not None and best.metric == cfg.checkpoint_keep_best \
            else None
        dropped = any(n.startswith(KFAC_DROPPED) for n in info.mismatches)
        return Resumed(path=path, step=int(info.step), extra=extra, dropped_kfac=dropped)
