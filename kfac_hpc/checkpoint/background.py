"""Checkpoints written in the background: training stalls only for the snapshot.

:class:`BackgroundSaver.save` does the collective part of :func:`~kfac_hpc.checkpoint.save`
in the caller's thread (``state_dict()`` calls, NaN/Inf refusal, planning, the free-space
check) and copies every dataset this rank contributes into host memory of its own; a
thread then writes the file exactly as ``save`` does (owners send their K-FAC factors
and RNG states to rank 0 one message at a time, rank 0 writes through the guarded
storage layer, fsyncs, renames, points ``latest`` at the new file and prunes), while
training goes on. The file is as atomic and as verified as a foreground save: a kill
during the write leaves a ``.tmp`` file (removed by the next save) and the previous
checkpoint and ``latest`` as they were; ``latest`` moves only after the write completed.

At most one write is in flight: the next :meth:`~BackgroundSaver.save` first waits for
the previous one. :meth:`~BackgroundSaver.wait` (collective) waits and raises a failure
of the write as the same :class:`CheckpointError` on every rank; call it before exiting
(the driver also does before a preemption checkpoint). The thread talks over a
duplicate of the communicator (point to point only), never interleaved with the
training's collectives; h5py releases the GIL while HDF5 writes, and the CRC-32
digests and MPI receives release it too, so training threads keep running. The
snapshot buffers are kept for the next save (one more copy of this rank's share of the
state in host memory, in exchange for no page faults on later snapshots). With
parallel HDF5 the save is done in the foreground.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from torch import nn

from kfac_hpc.checkpoint.contracts import CheckpointOptimizer, CheckpointPreconditioner
from kfac_hpc.checkpoint.writer import (
    _stage,
    _Staged,
    _write_and_agree,
    _write_commit,
    agree,
    resolve_comm,
)

if TYPE_CHECKING:
    from kfac_hpc.comm import Communicator

__all__ = ["BackgroundSaver"]


class BackgroundSaver:
    """Background checkpoint writes over ``comm`` (construct on every rank together)."""

    def __init__(self, comm: Communicator | None = None) -> None:
        """Make the saver (collective: it duplicates ``comm`` for the writer thread).

        Args:
            comm: The ranks that save together (default: the world).

        Raises:
            ThreadLevelError: Several ranks, and an MPI below ``MPI_THREAD_MULTIPLE``.
        """
        from mpi4py import MPI

        from kfac_hpc.comm import Communicator, threads

        self.comm = resolve_comm(comm, None)
        self._wire: Communicator | None = None
        level = threads.provided_level() if self.comm.size > 1 else MPI.THREAD_MULTIPLE
        if level < MPI.THREAD_MULTIPLE:  # alike on every rank
            raise threads.ThreadLevelError(
                "a background checkpoint write sends this rank's state from its own thread "
                "while training runs collectives: that needs MPI_THREAD_MULTIPLE, and the "
                f"MPI library provides {threads.level_name(level)} (under it the two "
                "threads' blocking calls would wait for each other). Save in the "
                "foreground (checkpoint.save), or use an MPI library built with thread "
                "support (mpi4py requests MPI_THREAD_MULTIPLE by default)")
        if self.comm.size > 1:
            self._wire = Communicator(self.comm.mpi.Dup(), cuda=self.comm.cuda,
                                      name=f"{self.comm.name}/ckpt-background")
        self._thread: threading.Thread | None = None
        self._staged: _Staged | None = None
        self._result: tuple[str | None, str | None] = (None, None)
        self._buffers: dict[str, np.ndarray] = {}  # snapshot memory, reused by the next save
        self.last_path: Path | None = None  # the last completed background checkpoint

    @property
    def in_flight(self) -> bool:
        """Whether a write was started and not yet waited for."""
        return self._thread is not None

    def save(self, directory_or_path: str | os.PathLike[str], *, model: nn.Module,
             optimizer: CheckpointOptimizer | None,
             preconditioner: CheckpointPreconditioner | None = None, step: int,
             extra: dict[str, Any] | None = None, keep_last: int | None = 3,
             store_eigenbases: bool = True, fletcher32: bool = True,
             parallel: bool | None = None, prefetch: bool = False,
             check_finite: bool = True, keep_every_steps: int | None = None,
             keep: tuple[str, ...] = ()) -> Path | None:
        """Start a checkpoint write (collective).

        Waits for the previous write first and raises its failure, if any (on every
        rank). Errors found before writing (NaN/Inf, no room, ...) are raised at once.
        The new file's path is known once :meth:`wait` returns.

        Args:
            directory_or_path: As for :func:`~kfac_hpc.checkpoint.save`.
            model: As for ``save``.
            optimizer: As for ``save``.
            preconditioner: As for ``save``.
            step: As for ``save``.
            extra: As for ``save``.
            keep_last: As for ``save``.
            store_eigenbases: As for ``save``.
            fletcher32: As for ``save``.
            parallel: As for ``save`` (parallel HDF5 writes in the foreground).
            prefetch: As for ``save``.
            check_finite: As for ``save``.
            keep_every_steps: As for ``save``.
            keep: As for ``save``.

        Returns:
            The previous write's path (None if there was none).

        Raises:
            TypeError: As ``save`` (an object lacking a member of its protocol).
            CheckpointError: The previous write failed, or this one cannot start.
        """
        previous = self.wait()
        st = _stage(self.comm, directory_or_path, model=model, optimizer=optimizer,
                    preconditioner=preconditioner, step=step, extra=extra,
                    keep_last=keep_last, store_eigenbases=store_eigenbases,
                    fletcher32=fletcher32, parallel=parallel, prefetch=prefetch,
                    check_finite=check_finite, snapshot=self._buffers)
        st.keep_every_steps, st.keep = keep_every_steps, tuple(keep)
        if st.use_parallel:  # pragma: no cover - needs parallel h5py (collective writes)
            self.last_path = _write_and_agree(self.comm, st)
            return previous
        self._staged = st
        self._result = (None, None)
        self._thread = threading.Thread(target=self._run, args=(st,), daemon=True,
                                        name="ckpt-background")
        self._thread.start()
        return previous

    def _run(self, st: _Staged) -> None:
        wire = self._wire if self._wire is not None else self.comm
        try:
            self._result = _write_commit(wire, st)
        except BaseException as exc:  # reported at the next wait(), on every rank
            self._result = (None, f"background write: {type(exc).__name__}: {exc}")

    def wait(self) -> Path | None:
        """Wait for the write in flight (collective).

        Returns:
            Its path (None if none was in flight).

        Raises:
            CheckpointError: The write failed (the same error on every rank).
        """
        if self._thread is None:
            return None
        self._thread.join()
        st = self._staged
        assert st is not None
        self._thread = self._staged = None
        path, error = self._result
        self._result = (None, None)
        agree(self.comm, error, f"background checkpoint write of {st.final}")
        if self.comm.rank == 0:
            assert path is not None
        self.last_path = st.final
        return st.final

    def close(self) -> None:
        """Release the duplicate communicator (after :meth:`wait`).

        A write still in flight (an error path) is abandoned: its ``.tmp`` file is never
        committed.
        """
        if self._thread is not None and self._thread.is_alive():
            return  # the daemon thread may still use the communicator
        if self._wire is not None and self._wire.mpi is not None:
            self._wire.free()
            self._wire = None
        self._buffers.clear()

