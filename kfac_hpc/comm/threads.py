"""MPI calls from more than one thread: what level they need, and serialising them.

On CUDA, autograd runs backward hooks on its per-device worker thread, not on the
thread that called ``backward()``; hooks that post reductions (GradientAverager, the
K-FAC FactorPipeline) therefore call MPI from a thread that is not the main thread.
``MPI_THREAD_FUNNELED`` (only the main thread calls MPI) is not enough.
``MPI_THREAD_SERIALIZED`` is: the Communicator takes a process-wide lock around every
MPI call when that is the level provided, so calls from different threads never
overlap. ``MPI_THREAD_MULTIPLE`` (what mpi4py requests by default) needs no lock.
A call from a non-main thread under a lower level raises :class:`ThreadLevelError`.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from mpi4py import MPI

_LEVEL_NAMES = {MPI.THREAD_SINGLE: "MPI_THREAD_SINGLE", MPI.THREAD_FUNNELED: "MPI_THREAD_FUNNELED",
                MPI.THREAD_SERIALIZED: "MPI_THREAD_SERIALIZED",
                MPI.THREAD_MULTIPLE: "MPI_THREAD_MULTIPLE"}
NEEDED_FOR_HOOKS = MPI.THREAD_SERIALIZED

_lock = threading.RLock()


class ThreadLevelError(RuntimeError):
    """MPI would be called from a thread the MPI library was not initialised for."""


_provided: int | None = None


def provided_level() -> int:
    """Return the thread level the MPI library provides (``MPI_Query_thread``, asked once)."""
    global _provided
    if _provided is None:
        _provided = int(MPI.Query_thread())
    return _provided


def level_name(level: int) -> str:
    """Name an MPI thread level, e.g. ``"MPI_THREAD_SERIALIZED"`` (the number when unknown)."""
    return _LEVEL_NAMES.get(level, str(level))


def _advice(level: int, what: str) -> str:
    return (f"{what}, but the MPI library provides only {level_name(level)}. Backward hooks on "
            "CUDA tensors run on autograd's worker thread, so MPI must be initialised with at "
            "least MPI_THREAD_SERIALIZED: leave mpi4py.rc.thread_level at its default "
            "'multiple' (or set it to 'serialized') before `from mpi4py import MPI`, and use "
            "an MPI library built with thread support")


def require_hook_level(level: int | None = None, what: str = "MPI is called from hooks") -> None:
    """Raise :class:`ThreadLevelError` unless hooks may call MPI (SERIALIZED or higher).

    Args:
        level: The thread level to judge (default: the library's).
        what: What calls MPI from hooks, for the message.

    Raises:
        ThreadLevelError: The level is below ``MPI_THREAD_SERIALIZED``; says how to fix it.
    """
    level = provided_level() if level is None else level
    if level < NEEDED_FOR_HOOKS:
        raise ThreadLevelError(_advice(level, what))


@contextlib.contextmanager
def mpi_guard(level: int | None = None) -> Iterator[None]:
    """Wrap one MPI call: serialised under SERIALIZED, refused off the main thread below.

    Args:
        level: The thread level (default: the library's).

    Yields:
        Nothing; the MPI call runs inside the block.

    Raises:
        ThreadLevelError: Below SERIALIZED, on a thread other than the main thread.
    """
    level = provided_level() if level is None else level
    if level >= MPI.THREAD_MULTIPLE:
        yield
        return
    if level >= MPI.THREAD_SERIALIZED:
        with _lock:
            yield
        return
    if threading.current_thread() is not threading.main_thread():
        raise ThreadLevelError(_advice(
            level, f"MPI would be called from thread {threading.current_thread().name!r}"))
    yield
