"""A hang ends the job: no progress for ``timeout`` seconds aborts every rank.

A rank lost in a collective (a peer hung on a GPU fault or a dead link, a deadlock)
otherwise holds the whole allocation until the job's time limit, and prints nothing.
The training loop calls :meth:`Watchdog.beat` at every step, every evaluation batch and
around checkpoint writes; a daemon thread checks the time since the last beat. When it
exceeds ``timeout``, the rank prints one message (its rank, how long, what it was doing
last), the Python stacks of all its threads (:mod:`faulthandler`), and aborts the job
with :data:`HANG_EXIT_CODE` (``MPI_Abort``; ``os._exit`` if that does not return within
``grace`` seconds, which ``srun --kill-on-bad-exit=1`` and ``mpiexec`` turn into the end
of every rank). The batch scripts treat status 4 as a crash: requeued only after
progress (a new valid checkpoint). A checkpoint being written is never half-committed:
the file is renamed into place only when complete (:mod:`kfac_hpc.checkpoint.atomic`).

No MPI is imported here: ``abort`` is given (tests pass a stand-in).
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import sys
import threading
import time
from collections.abc import Callable
from types import TracebackType
from typing import TextIO

__all__ = ["HANG_EXIT_CODE", "Watchdog", "mpi_abort"]

HANG_EXIT_CODE = 4  # "no progress for --hang-timeout-minutes": a crash to the batch scripts


def mpi_abort(code: int) -> None:
    """Call ``MPI_Abort`` on the world communicator, without the communicator's lock.

    The thread that holds the lock may be the one that hangs.

    Args:
        code: The exit status every rank ends with.
    """
    from mpi4py import MPI

    MPI.COMM_WORLD.Abort(code)


class Watchdog:
    """Abort the job when :meth:`beat` is not called for ``timeout`` seconds.

    Use as a context manager around the training loop.
    """

    def __init__(self, timeout: float, *, rank: int, abort: Callable[[int], None] = mpi_abort,
                 exit: Callable[[int], None] = os._exit, stream: TextIO | None = None,
                 poll: float | None = None, grace: float = 30.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """Make a watchdog; its thread starts with :meth:`start`.

        Args:
            timeout: Seconds without a beat after which the job is aborted (> 0).
            rank: This process's rank, for the message.
            abort: Ends the job with a status (default :func:`mpi_abort`).
            exit: Ends this process if ``abort`` has not returned within ``grace`` seconds
                (default ``os._exit``).
            stream: Where the message and the stacks go (default ``sys.stderr``).
            poll: Seconds between looks (default: a tenth of the timeout, at most 10 s).
            grace: Seconds ``abort`` is given before ``exit``.
            clock: Returns a monotonic time in seconds (tests pass a stand-in).

        Raises:
            ValueError: ``timeout`` is not positive.
        """
        if not timeout > 0:
            raise ValueError(f"watchdog timeout must be > 0 seconds, got {timeout}")
        self.timeout = float(timeout)
        self.rank = rank
        self.poll = poll if poll is not None else min(10.0, self.timeout / 10)
        self.grace = grace
        self._abort, self._exit, self._clock = abort, exit, clock
        self._stream = stream
        self._last = clock()
        self._doing = "starting"
        self._allowed = self.timeout  # seconds the current beat may last
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.fired = False

    def beat(self, doing: str, *, patience: float | None = None) -> None:
        """Record progress: this rank is now ``doing`` this (e.g. ``"step 120"``).

        Args:
            doing: What the rank does now; the message names the last one.
            patience: Seconds this one may take, when longer than the timeout (a run's
                setup: loading data sets and checkpoints, whatever the timeout that
                guards its steps); until the next beat.
        """
        self._last = self._clock()  # first (the watcher reads the allowance first)
        self._doing = doing
        self._allowed = self.timeout if patience is None else max(self.timeout, patience)

    def start(self) -> Watchdog:
        """Start the watching thread (a daemon), counting from now.

        Returns:
            This watchdog.
        """
        self.beat("starting")
        self._thread = threading.Thread(target=self._watch, name="kfac-hpc-watchdog",
                                        daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the watching thread and wait for it (unless called from it)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        self._thread = None

    def __enter__(self) -> Watchdog:
        """Start watching; see :meth:`start`."""
        return self.start()

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 trace: TracebackType | None) -> None:
        """Stop watching; see :meth:`stop`."""
        self.stop()

    def _watch(self) -> None:
        while not self._stop.wait(self.poll):
            allowed = self._allowed  # before the time of the beat (beat() sets them in
            idle = self._clock() - self._last  # the other order): never a stale pair
            if idle > allowed:
                self._fire(idle, allowed)
                return

    def _fire(self, idle: float, allowed: float) -> None:
        self.fired = True
        stream = self._stream or sys.stderr
        stream.write(
            f"kfac_hpc: rank {self.rank}: no progress for {idle:.0f} s (limit "
            f"{allowed:.0f} s, --hang-timeout-minutes); last: {self._doing}. A collective "
            f"is probably waiting for a rank that hangs or died. Python stacks of rank "
            f"{self.rank} follow; ending the job with exit status {HANG_EXIT_CODE} (the last "
            "complete checkpoint stays the newest; requeued only after progress).\n")
        stream.flush()
        # a stream without a file descriptor (tests) gets the message only
        with contextlib.suppress(ValueError, OSError, AttributeError):
            faulthandler.dump_traceback(file=stream, all_threads=True)
        stream.flush()
        timer = threading.Timer(self.grace, self._exit, args=(HANG_EXIT_CODE,))
        timer.daemon = True
        timer.start()
        self._abort(HANG_EXIT_CODE)
