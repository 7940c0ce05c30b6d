"""Batched solves of small symmetric matrices on the host, beside the device's.

K-FAC's inverse updates and Shampoo's root steps decompose (or invert) many symmetric
matrices, one batched call per distinct size. On CUDA each call is latency bound for
small matrices: torch loops over a batch one matrix at a time, syncing for its error
flags, and hands float32 matrices of 32 to 512 rows to cuSOLVER's Jacobi solver
(``syevj``; everything else to divide and conquer, ``syevd``), whose time grows with how
far a matrix is from diagonal (a 512x512 ResNet-50 factor took 14 ms on an H200, a
1024x1024 one 11 ms). The host's LAPACK solves those sizes in a few milliseconds on one
core, while the device is busy with the large ones. So :func:`solve_batches` sends
every batch of at most ``host_max_dim`` rows that lives on a CUDA device to one host
worker thread (copied out after the device has produced it, copied back without
blocking) and solves the rest on the device meanwhile; the two overlap, and an update
costs about its large matrices' time. :func:`eigh_batches` is the eigendecomposition.

Results equal those of the same solver on the host for the host's batches (the same
LAPACK call); which batches go there depends only on their size and device, so a run
and its resumption compute alike.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import cast

import torch
from torch import Tensor

__all__ = ["DEFAULT_HOST_MAX_DIM", "BatchResult", "EighResult", "Solver", "eigh_batches",
           "solve_batches", "solves_on_host", "symmetric_eigh"]

#: Matrices up to this size are decomposed on the host when they live on a CUDA device:
#: torch's Jacobi range for float32 on CUDA (32..512), where the device is slowest
#: per flop, and small enough that the host (one core, LAPACK) keeps up with the
#: device's large factors (ResNet-50's K-FAC factors up to 512 rows: 0.27 s on one core
#: of a 2-core Xeon, against about 1 s of device time for the larger ones).
DEFAULT_HOST_MAX_DIM = 512

#: What a solver returned for a batch, or the error it raised.
BatchResult = tuple[Tensor, ...] | Exception
#: ``(eigenvalues, eigenvectors)`` of a batch, or the error its solver raised.
EighResult = tuple[Tensor, Tensor] | Exception
#: A batched solver: stacked matrices in, a tuple of tensors out (host or device alike).
Solver = Callable[[Tensor], tuple[Tensor, ...]]

_worker: ThreadPoolExecutor | None = None
_worker_lock = threading.Lock()


def _host_worker() -> ThreadPoolExecutor:
    """The one host thread that runs the host's solves, in submission order."""
    global _worker
    with _worker_lock:
        if _worker is None:
            _worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kfac-hpc-host-solves")
        return _worker


def solves_on_host(batch: Tensor, host_max_dim: int) -> bool:
    """Whether :func:`solve_batches` solves ``batch`` on the host.

    Args:
        batch: Stacked square matrices ``(..., n, n)``.
        host_max_dim: The largest ``n`` sent to the host (0: none).

    Returns:
        True for a batch on a CUDA device with ``n <= host_max_dim``.
    """
    return batch.device.type == "cuda" and 0 < batch.shape[-1] <= host_max_dim


def _to_host(batch: Tensor) -> tuple[Tensor, torch.cuda.Event | None]:
    """Copy ``batch`` into pinned host memory without blocking.

    Returns the copy and the event the worker waits for before reading it.
    """
    if batch.device.type != "cuda":
        return batch.to("cpu", copy=True), None
    host = torch.empty(batch.shape, dtype=batch.dtype, device="cpu", pin_memory=True)
    host.copy_(batch, non_blocking=True)
    ready = torch.cuda.Event()
    ready.record(torch.cuda.current_stream(batch.device))
    return host, ready


def _solve_on_host(host: Tensor, ready: torch.cuda.Event | None, solve: Solver
                   ) -> tuple[Tensor, ...]:
    """Solve ``host`` once its copy is complete; the results pinned for the way back."""
    if ready is not None:
        ready.synchronize()
    results = tuple(solve(host))
    if ready is not None:
        results = tuple(t.pin_memory() for t in results)
    return results


def _collect(future: Future[tuple[Tensor, ...]], device: torch.device) -> BatchResult:
    try:
        results = future.result()
    except Exception as exc:  # LinAlgError, backend errors: in the batch's place
        return exc
    return tuple(t.to(device, non_blocking=True) for t in results)


def solve_batches(batches: Sequence[Tensor], solve: Solver,
                  host_max_dim: int = DEFAULT_HOST_MAX_DIM) -> list[BatchResult]:
    """``solve`` every batch; the small CUDA ones on the host meanwhile.

    The host's batches (:func:`solves_on_host`) are queued first, to one worker thread,
    then the device solves the others on the calling thread; the host's results come
    back to the batch's device (asynchronous copies on the current stream). A solver
    that raises gives its exception in the batch's place, so one failure never hides
    the other results.

    Args:
        batches: Stacked square matrices ``(..., n, n)``, any devices and sizes.
        solve: The batched solver, the same function on both sides, returning a tuple
            of tensors.
        host_max_dim: The largest ``n`` solved on the host (0: all on their device).

    Returns:
        Per batch, what ``solve`` returned, or the exception it raised.
    """
    if host_max_dim < 0:
        raise ValueError(f"host_max_dim must be >= 0, got {host_max_dim}")
    on_host: dict[int, Future[tuple[Tensor, ...]]] = {}
    for i, batch in enumerate(batches):
        if solves_on_host(batch, host_max_dim):
            host, ready = _to_host(batch)
            on_host[i] = _host_worker().submit(_solve_on_host, host, ready, solve)
    out: list[BatchResult | None] = [None] * len(batches)
    for i, batch in enumerate(batches):
        if i in on_host:
            continue
        try:
            out[i] = tuple(solve(batch))
        except Exception as exc:  # in the batch's place, as the host's
            out[i] = exc
    for i, future in on_host.items():
        out[i] = _collect(future, batches[i].device)
    return cast(list[BatchResult], out)


def eigh_batches(batches: Sequence[Tensor], host_max_dim: int = DEFAULT_HOST_MAX_DIM
                 ) -> list[EighResult]:
    """``torch.linalg.eigh`` of every batch; the small CUDA ones on the host meanwhile.

    :func:`solve_batches` with the symmetric eigensolver, which reads only the lower
    triangle of each matrix.

    Args:
        batches: Stacked symmetric matrices ``(..., n, n)``, any devices and sizes.
        host_max_dim: The largest ``n`` decomposed on the host (0: all on their device).

    Returns:
        Per batch, ``(eigenvalues, eigenvectors)`` in ascending order, or the exception.
    """
    return cast(list[EighResult], solve_batches(batches, symmetric_eigh, host_max_dim))


def symmetric_eigh(batch: Tensor) -> tuple[Tensor, ...]:
    """``torch.linalg.eigh`` as a :data:`Solver`: ``(eigenvalues, eigenvectors)``."""
    return tuple(torch.linalg.eigh(batch))
