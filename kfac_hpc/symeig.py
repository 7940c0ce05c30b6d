"""Symmetric eigendecompositions of stacked batches, the small ones on the host.

K-FAC's inverse updates and Shampoo's root steps decompose many symmetric matrices, one
batched ``torch.linalg.eigh`` per distinct size. On CUDA, torch hands float32 matrices
of 32 to 512 rows to cuSOLVER's Jacobi solver (``syevj``) and everything else to divide
and conquer (``syevd``), one matrix at a time either way: the small ones are latency
bound (a 512x512 factor of ResNet-50 took 14 ms on an H200, a 1024x1024 one 11 ms), and
Jacobi's time grows with how far a matrix is from diagonal. The host's LAPACK solves
those sizes in a few milliseconds on one core, while the device is busy with the large
ones. So :func:`eigh_batches` sends every batch of at most ``host_max_dim`` rows that
lives on a CUDA device to one host worker thread (copied out after the device has
produced it, copied back without blocking) and runs the rest on the device meanwhile;
the two overlap, and an inverse update costs about its large factors' time.

Results equal those of ``torch.linalg.eigh`` on the host for the host's batches (the
same LAPACK call); which batches go there depends only on their size and device, so a
run and its resumption decompose alike.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import cast

import torch
from torch import Tensor

__all__ = ["DEFAULT_HOST_MAX_DIM", "EighResult", "eigh_batches", "solves_on_host"]

#: Matrices up to this size are decomposed on the host when they live on a CUDA device:
#: torch's Jacobi range for float32 on CUDA (32..512), where the device is slowest
#: per flop, and small enough that the host (one core, LAPACK) keeps up with the
#: device's large factors (ResNet-50's K-FAC factors up to 512 rows: 0.27 s on one core
#: of a 2-core Xeon, against about 1 s of device time for the larger ones).
DEFAULT_HOST_MAX_DIM = 512

#: ``(eigenvalues, eigenvectors)`` of a batch, or the error its solver raised.
EighResult = tuple[Tensor, Tensor] | Exception

_worker: ThreadPoolExecutor | None = None
_worker_lock = threading.Lock()


def _host_worker() -> ThreadPoolExecutor:
    """The one host thread that runs the host's decompositions, in submission order."""
    global _worker
    with _worker_lock:
        if _worker is None:
            _worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kfac-hpc-host-eigh")
        return _worker


def solves_on_host(batch: Tensor, host_max_dim: int) -> bool:
    """Whether :func:`eigh_batches` decomposes ``batch`` on the host.

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


def _solve_on_host(host: Tensor, ready: torch.cuda.Event | None) -> tuple[Tensor, Tensor]:
    """Decompose ``host`` once its copy is complete; the results pinned for the way back."""
    if ready is not None:
        ready.synchronize()
    evals, evecs = torch.linalg.eigh(host)
    if ready is not None:
        evals, evecs = evals.pin_memory(), evecs.pin_memory()
    return evals, evecs


def _submit(batch: Tensor) -> Future[tuple[Tensor, Tensor]]:
    host, ready = _to_host(batch)
    return _host_worker().submit(_solve_on_host, host, ready)


def _collect(future: Future[tuple[Tensor, Tensor]], device: torch.device) -> EighResult:
    try:
        evals, evecs = future.result()
    except RuntimeError as exc:  # torch.linalg.LinAlgError and backend errors
        return exc
    return (evals.to(device, non_blocking=True), evecs.to(device, non_blocking=True))


def eigh_batches(batches: Sequence[Tensor], host_max_dim: int = DEFAULT_HOST_MAX_DIM
                 ) -> list[EighResult]:
    """``torch.linalg.eigh`` of every batch; the small CUDA ones on the host meanwhile.

    The host's batches (:func:`solves_on_host`) are queued first, to one worker thread,
    then the device decomposes the others on the calling thread; the host's results
    come back to the batch's device (asynchronous copies on the current stream). A
    solver that raises gives its exception in the batch's place, so one failure never
    hides the other results. Only the lower triangle of each matrix is read.

    Args:
        batches: Stacked symmetric matrices ``(..., n, n)``, any devices and sizes.
        host_max_dim: The largest ``n`` decomposed on the host (0: all on their device).

    Returns:
        Per batch, ``(eigenvalues, eigenvectors)`` in ascending order, or the exception.
    """
    if host_max_dim < 0:
        raise ValueError(f"host_max_dim must be >= 0, got {host_max_dim}")
    on_host = {i: _submit(b) for i, b in enumerate(batches) if solves_on_host(b, host_max_dim)}
    out: list[EighResult | None] = [None] * len(batches)
    for i, batch in enumerate(batches):
        if i in on_host:
            continue
        try:
            out[i] = torch.linalg.eigh(batch)
        except RuntimeError as exc:
            out[i] = exc
    for i, future in on_host.items():
        out[i] = _collect(future, batches[i].device)
    return cast(list[EighResult], out)
