"""Staging CUDA tensors through pinned host memory without stalling the GPU.

A staged call copies device→host with ``non_blocking=True`` on a side stream that
first waits for the caller's current stream, and records a CUDA event; MPI sees the
host buffer only once that event has completed. Results come back host→device, again
``non_blocking``, on the caller's current stream. Host buffers are pinned (page-locked,
so the copies are asynchronous DMA) and persistent: a :class:`PinnedPool` hands out
buffers by size class and takes them back with the event of the last copy that uses
them, so a buffer is reused only once the GPU is done with it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from kfac_hpc.comm.cuda import CudaSupport, StagingCause

log = logging.getLogger("kfac_hpc.comm")

MIN_CLASS_BYTES = 512
DEFAULT_MAX_CACHED_BYTES = 2 << 30


def size_class(nbytes: int) -> int:
    """Return the bytes of the pooled buffer for ``nbytes`` (a power of two, at least 512)."""
    return max(MIN_CLASS_BYTES, 1 << max(nbytes - 1, 0).bit_length())


def _pinned_bytes(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, device="cpu", pin_memory=True)


@dataclass
class PinnedBuffer:
    """A pooled host buffer lent out; ``tensor`` is the typed view the caller uses."""

    pool: PinnedPool
    base: torch.Tensor  # uint8, one size class
    tensor: torch.Tensor
    released: bool = False

    def release(self, event: Any | None = None) -> None:
        """Give the buffer back to its pool.

        Args:
            event: The CUDA event of the last copy that uses it; the buffer is reused only
                after it has completed (None: at once).
        """
        if not self.released:
            self.released = True
            self.pool._give_back(self.base, event)


@dataclass
class PinnedPool:
    """Persistent pinned host buffers, reused across calls, keyed by size class.

    ``allocate(nbytes)`` makes a new uint8 host buffer (pinned by default; tests on a
    machine without CUDA pass a plain allocator). At most ``max_cached_bytes`` of free
    buffers are kept.
    """

    max_cached_bytes: int = DEFAULT_MAX_CACHED_BYTES
    allocate: Callable[[int], torch.Tensor] = _pinned_bytes
    allocations: int = 0  # buffers made (for tests and diagnostics)
    reuses: int = 0
    _free: dict[int, list[tuple[torch.Tensor, Any | None]]] = field(default_factory=dict)
    _cached: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def acquire(self, shape: torch.Size | tuple[int, ...], dtype: torch.dtype) -> PinnedBuffer:
        """Lend a host buffer for a tensor of ``shape`` and ``dtype``.

        Args:
            shape: The tensor's shape.
            dtype: The tensor's dtype.

        Returns:
            The buffer, whose ``tensor`` is a contiguous view of that shape and dtype.
        """
        numel = 1
        for s in shape:
            numel *= int(s)
        nbytes = numel * dtype.itemsize
        cls = size_class(nbytes)
        base = None
        with self._lock:
            entries = self._free.get(cls, [])
            for i, (buffer, event) in enumerate(entries):
                if event is None or event.query():
                    base = buffer
                    del entries[i]
                    self._cached -= cls
                    self.reuses += 1
                    break
        if base is None:
            base = self.allocate(cls)
            with self._lock:
                self.allocations += 1
        return PinnedBuffer(self, base, base[:nbytes].view(dtype).view(shape))

    def _give_back(self, base: torch.Tensor, event: Any | None) -> None:
        cls = base.numel()
        with self._lock:
            if self._cached + cls > self.max_cached_bytes:
                return  # dropped: torch frees it once the last copy is done
            self._free.setdefault(cls, []).append((base, event))
            self._cached += cls

    @property
    def cached_bytes(self) -> int:
        """Bytes of free buffers kept for reuse."""
        return self._cached

    def clear(self) -> None:
        """Drop every free buffer (lent ones come back as usual)."""
        with self._lock:
            self._free.clear()
            self._cached = 0


_pool: PinnedPool | None = None
_pool_lock = threading.Lock()


def pinned_pool() -> PinnedPool:
    """Return the process-wide pool of staging buffers."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = PinnedPool()
        return _pool


_side_streams: dict[int, Any] = {}


def side_stream(device: torch.device) -> Any:
    """Return the stream staging copies of ``device`` run on (one per device, made once)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _pool_lock:
        stream = _side_streams.get(index)
        if stream is None:
            stream = _side_streams[index] = torch.cuda.Stream(device=index)
        return stream


def record_event(stream: Any) -> Any:
    """Record a CUDA event on ``stream`` now and return it."""
    event = torch.cuda.Event()
    event.record(stream)
    return event


def stage_out(data: torch.Tensor, pool: PinnedPool,
              need_input: bool) -> tuple[PinnedBuffer, Any | None]:
    """Copy the device tensor ``data`` into pinned host memory, with the event marking the end.

    The copy runs on the side stream after everything already queued on the current
    stream (the producer of ``data``); ``data`` is marked as used by the side stream so
    the caching allocator does not hand its memory out before the copy has read it.

    Args:
        data: A contiguous CUDA tensor.
        pool: Where the host buffer comes from.
        need_input: Copy the values (False: a receive buffer, no copy, no event).

    Returns:
        The pinned buffer and the copy's event (None when nothing was copied).
    """
    pinned = pool.acquire(data.shape, data.dtype)
    if not need_input or data.numel() == 0:
        return pinned, None
    with torch.cuda.device(data.device):
        current = torch.cuda.current_stream(data.device)
        side = side_stream(data.device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            pinned.tensor.copy_(data, non_blocking=True)
        data.record_stream(side)
        return pinned, record_event(side)


def used_on_current_stream(*tensors: torch.Tensor) -> None:
    """Mark CUDA tensors as used by the current stream (``record_stream``; others: nothing).

    The caching allocator then keeps their memory from the stream each was allocated on
    until the work queued on the current stream so far is done: a tensor allocated by a
    hook on autograd's stream and read or written here on another stays valid. Nothing
    happens for the stream a tensor was allocated on, nor for memory torch did not
    allocate (CuPy's, through DLPack).

    Args:
        tensors: Tensors the current stream has queued work on.
    """
    for t in tensors:
        if t.is_cuda:
            t.record_stream(torch.cuda.current_stream(t.device))


def land_in(host: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, Any]:
    """Copy ``host`` to ``device`` (non-blocking, on the current stream).

    Args:
        host: A host tensor, usually pinned.
        device: The destination device.

    Returns:
        The device tensor and the copy's event (after which ``host`` may be reused).
    """
    out = torch.empty(host.shape, dtype=host.dtype, device=device)
    out.copy_(host, non_blocking=True)
    return out, record_event(torch.cuda.current_stream(device))


_warned = threading.Event()
_noted = threading.Event()


NOT_AWARE_ADVICE = ("Use a CUDA-aware MPI, or set KFAC_HPC_CUDA_AWARE=1 if this library is "
                    "CUDA-aware and detection missed it (`kfac-hpc info` shows the evidence)")
PER_CALL_ADVICE = ("The other calls take device memory here (`kfac-hpc info` shows the per-call "
                   "table); KFAC_HPC_CUDA_AWARE=all hands device memory to every call, only for "
                   "a library known to take it in these calls")
FORCED_ADVICE = ("Leave KFAC_HPC_CUDA_AWARE unset and Communicator(cuda_aware=None) to let "
                 "detection decide (`kfac-hpc info` shows what it finds)")
ADVICE = {StagingCause.NOT_AWARE: NOT_AWARE_ADVICE, StagingCause.NOT_IN_TABLE: PER_CALL_ADVICE,
          StagingCause.FORCED: FORCED_ADVICE}


def warn_staging_once(call: str, nbytes: int, why: str, staged_calls: tuple[str, ...],
                      advice: str = NOT_AWARE_ADVICE) -> None:
    """Say once per process (loudly on world rank 0) that CUDA tensors go through host memory.

    Args:
        call: The call that staged first.
        nbytes: Its message size.
        why: Why it is staged.
        staged_calls: Every call that stages here for that reason.
        advice: What to do about it (:data:`NOT_AWARE_ADVICE` where the library takes no
            device memory; :data:`PER_CALL_ADVICE` where it does in other calls;
            :data:`FORCED_ADVICE` where an override staged it).
    """
    if _warned.is_set():
        return
    _warned.set()
    from mpi4py import MPI

    level = logging.WARNING if MPI.COMM_WORLD.Get_rank() == 0 else logging.DEBUG
    log.log(level,
            "kfac_hpc.comm: CUDA tensors are staged through pinned host memory for %s "
            "(first: %s of %d bytes). Each staged call adds a device-to-host and a "
            "host-to-device copy of its buffers (about 2 x bytes / PCIe bandwidth, e.g. "
            "8 ms per 100 MB at 25 GB/s), and MPI works on host memory (reductions on the "
            "CPU). Cause: %s. %s. This warning is shown once.",
            ", ".join(staged_calls) or call, call, nbytes, why, advice)


def report_staging(support: CudaSupport, call: str, nbytes: int) -> None:
    """Say why a CUDA tensor of ``call`` was staged, once per process and cause group.

    A call staged by a routing rule (faster staged than on the library's own device
    path) is the intended route: said once at INFO level, never as a warning. Any other
    cause (not CUDA-aware, an override, a call outside the library's table) is warned
    about once (:func:`warn_staging_once`), naming that cause and the calls it stages.

    Args:
        support: The detection that routed the call.
        call: The call that staged (one of ``support.staged_calls``).
        nbytes: Its message size.
    """
    routed = call in support.routed
    if (_noted if routed else _warned).is_set():
        return
    cause, why = support.why_staged(call)
    if routed:
        _noted.set()
        from mpi4py import MPI

        log.log(logging.INFO if MPI.COMM_WORLD.Get_rank() == 0 else logging.DEBUG,
                "kfac_hpc.comm: %s on CUDA tensors are staged through pinned host memory "
                "by design (first: %s of %d bytes): %s. `kfac-hpc info` shows the per-call "
                "table. Said once.", ", ".join(support.calls_staged_for(cause)), call, nbytes,
                why)
        return
    warn_staging_once(call, nbytes, why, support.calls_staged_for(cause), ADVICE[cause])


def reset_warning() -> None:
    """Forget that the staging warning and the routing note were shown (tests)."""
    _warned.clear()
    _noted.clear()
