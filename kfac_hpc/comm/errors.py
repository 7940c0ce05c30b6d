"""Failure on one rank must end the whole job, loudly, instead of hanging the others."""

from __future__ import annotations

import sys
import threading
import traceback
from types import TracebackType

from mpi4py import MPI

_installed = False


def _report_and_abort(exc_type: type[BaseException], exc: BaseException,
                      tb: TracebackType | None) -> None:
    rank = MPI.COMM_WORLD.Get_rank()
    text = "".join(traceback.format_exception(exc_type, exc, tb))
    sys.stderr.write("".join(f"[rank {rank}] {line}\n" for line in text.rstrip().splitlines()))
    sys.stderr.flush()
    if MPI.COMM_WORLD.Get_size() > 1:
        MPI.COMM_WORLD.Abort(1)


def install_abort_on_error() -> None:
    """Make an uncaught exception (main or any thread) abort every rank with its message.

    Equivalent to running under ``python -m mpi4py``; safe to call more than once.
    """
    global _installed
    if _installed:
        return
    previous = sys.excepthook

    def hook(exc_type: type[BaseException], exc: BaseException,
             tb: TracebackType | None) -> None:
        if issubclass(exc_type, KeyboardInterrupt | SystemExit):
            previous(exc_type, exc, tb)
            return
        _report_and_abort(exc_type, exc, tb)

    def thread_hook(args: threading.ExceptHookArgs) -> None:
        if args.exc_value is not None:
            _report_and_abort(args.exc_type, args.exc_value, args.exc_traceback)

    sys.excepthook = hook
    threading.excepthook = thread_hook
    _installed = True
