"""Preemption: a signal only sets a flag; all ranks agree at a step boundary.

SLURM sends ``USR1`` (``#SBATCH --signal=B:USR1@120``, forwarded to the tasks by the
batch script) or ``TERM`` (preemption without ``send_user_signal``) before it kills a
job. The handler records the signal and returns; the training loop asks
:meth:`PreemptionGuard.should_stop` at each step boundary, which agrees across ranks
(allreduce MAX) so every rank checkpoints at the same step, then exits with
:data:`REQUEUE_EXIT_CODE` for the batch script to requeue the job. A second signal
while the checkpoint is written only sets the flag again: nothing is interrupted.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable, Iterable
from types import FrameType
from typing import TYPE_CHECKING

from kfac_hpc.runtime.discovery import time_left
from kfac_hpc.signals import REQUEUE_EXIT_CODE as REQUEUE_EXIT_CODE  # re-exported
from kfac_hpc.signals import parse_signal

if TYPE_CHECKING:  # importing the communicator starts MPI: not needed to parse signals
    from kfac_hpc.comm import Communicator

class PreemptionGuard:
    """Turn signals and the job's time limit into one agreed "stop now" per step.

    Use as a context manager (installs and uninstalls the handlers) and ask
    :meth:`should_stop` at every step boundary.
    """

    def __init__(self, comm: Communicator, *, signals: Iterable[str | int] = ("USR1", "TERM"),
                 time_margin_s: float | None = None, deadline: float | None = None,
                 check_every: int = 1, clock: Callable[[], float] = time.time) -> None:
        """Make a guard; nothing is installed until :meth:`install`.

        Args:
            comm: The communicator the ranks agree over.
            signals: Signals to catch, by name (``"USR1"``, ``"SIGTERM"``) or number.
            time_margin_s: Stop when the job's remaining wall time (``SLURM_JOB_END_TIME``,
                or ``deadline``) falls below this many seconds; None: no time limit check.
            deadline: The job's end as a UNIX time, instead of ``SLURM_JOB_END_TIME``.
            check_every: Agree every N steps (the agreement costs one 4-byte allreduce).
            clock: Returns the current UNIX time in seconds (tests pass a stand-in).

        Raises:
            ValueError: ``check_every`` is below 1, or a signal name is unknown.
        """
        if check_every < 1:
            raise ValueError(f"check_every must be >= 1, got {check_every}")
        self.comm = comm
        self.signals = [parse_signal(s) for s in signals]
        self.time_margin_s = time_margin_s
        self.deadline = deadline
        self.check_every = check_every
        self.clock = clock
        self.received: list[str] = []
        self._previous: dict[signal.Signals, object] = {}
        self._calls = 0
        self.reason: str | None = None

    def install(self) -> PreemptionGuard:
        """Install the handlers (main thread only).

        Returns:
            This guard.

        Raises:
            RuntimeError: Called from a thread other than the main thread.
        """
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("PreemptionGuard.install() must run in the main thread")
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def uninstall(self) -> None:
        """Restore the handlers that were installed before :meth:`install`."""
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)  # type: ignore[arg-type]
        self._previous.clear()

    def ignore_from_now_on(self) -> None:
        """Ignore the signals for the rest of the process.

        For its last moments (``MPI_Finalize``, interpreter shutdown), so that a repeated
        signal cannot kill a rank that has checkpointed and is exiting with the requeue
        status. Python only restores default handlers at shutdown for signals it was
        catching, not for ignored ones.
        """
        for sig in self.signals:
            signal.signal(sig, signal.SIG_IGN)
        self._previous.clear()

    def __enter__(self) -> PreemptionGuard:
        """Install the handlers; see :meth:`install`."""
        return self.install()

    def __exit__(self, *exc: object) -> None:
        """Uninstall the handlers; see :meth:`uninstall`."""
        self.uninstall()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.received.append(signal.Signals(signum).name)

    def local_reason(self) -> str | None:
        """Say why this rank wants to stop, if it does (no communication).

        Returns:
            The first signal received or the wall time left under the margin, as text;
            None when this rank would go on.
        """
        if self.received:
            return f"signal {self.received[0]}"
        if self.time_margin_s is not None:
            remaining = (self.deadline - self.clock()) if self.deadline is not None else (
                time_left(now=self.clock()))
            if remaining is not None and remaining < self.time_margin_s:
                return f"{remaining:.0f} s of wall time left (margin {self.time_margin_s:.0f} s)"
        return None

    def should_stop(self, *, force_check: bool = False) -> bool:
        """Agree at a step boundary whether to stop: True everywhere if any rank wants to.

        Collective: every rank must call it at the same steps. Sets :attr:`reason` the first time it
        returns True.

        Args:
            force_check: Agree now even if this is not a ``check_every``-th call.

        Returns:
            The same answer on every rank; False without communication on the calls
            between checks.
        """
        self._calls += 1
        if not force_check and self._calls % self.check_every:
            return False
        reason = self.local_reason()
        stop = self.comm.any(reason is not None)
        if stop and self.reason is None:
            self.reason = reason or "another rank was signalled"
        return stop
