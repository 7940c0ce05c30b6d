"""Batched solves of symmetric matrices: the solver's precision, and where it runs.

K-FAC's inverse updates and Shampoo's root steps decompose (or invert) many symmetric
matrices, one batched call per distinct size. On CUDA, torch hands float32 matrices of
32 to 512 rows to cuSOLVER's Jacobi solver (``syevj``) and everything else to divide and
conquer (``syevd``); a batch is solved one matrix at a time either way. Jacobi's time
grows with how far a matrix is from diagonal, and on real factors it is the slow choice:
on an NVIDIA H200, ResNet-50's K-FAC factors took (ms per matrix, float32 ``syevj``
against float64 ``syevd``) 147 rows 2.24 vs 1.22, 256 rows 4.68 vs 2.10, 512 rows 14.02
vs 4.66 (64 and 128 rows: equal). So :func:`symmetric_eigh` decomposes float32 CUDA
matrices of that range in float64 (:func:`eigh_dtype`): faster, and more accurate; the
results come back in float32.

:func:`solve_batches` can also send every CUDA batch of at most ``host_max_dim`` rows to
one host worker thread (copied out after the device has produced it, solved by LAPACK,
copied back without blocking) while the device solves the others. It is off by default
(:data:`DEFAULT_HOST_MAX_DIM`): on the H200's host, LAPACK took 35.8 ms per 512-row
factor, and one ResNet-50 K-FAC inverse update took 1340 ms with the factors up to 512
rows on the host against 1482 ms on the device in float32 Jacobi; the float64 device
solves above take those factors from about 420 ms of device time to about 175 ms. It can
pay where the host is fast and the device small.

With ``device_streams`` > 1, :func:`solve_batches` also spreads the device's batches
(of more than 32 rows) over that many worker threads, each on its own CUDA stream: a
batch is split into chunks of matrices, and the chunks go to the streams by cost
(n³ per matrix, the largest first). cuSOLVER decomposes one matrix at a time and is far
from filling a large GPU with a 1024x1024 matrix (10.5 ms on an H200, against 25 ms for
eight times the flops at 2048), so independent solves on separate streams may overlap.
Every matrix is solved by the same call as on one stream, so the results are the same
bits whatever the spread, as far as cuSOLVER is reproducible on concurrent streams: on an
H200 (torch 2.11, CUDA 13) repeated solves on 8 streams were bitwise equal by default and
under ``torch.use_deterministic_algorithms(True)`` alone, but with
``CUBLAS_WORKSPACE_CONFIG=:4096:8`` added (which deterministic mode asks for) 11 to 19
of 19 repeats differed from the first, against none on one stream
(``benchmarks/reproducibility.py``; benchmarks/RESULTS.md, GPU, sixth session). So under
deterministic algorithms nothing is spread: every batch is solved on the calling
stream, whatever ``device_streams`` says (:func:`spreads_over_streams`), and a
deterministic run pays one stream's time for its inverse updates. The default is 8 streams
(:data:`DEFAULT_DEVICE_STREAMS`; fewer on fewer cores, :func:`default_device_streams`):
on an NVIDIA H200 (torch 2.11, CUDA 13), ResNet-50's K-FAC inverse update (108 factors)
took 1279 ms on one stream, 1052 on 2, 932 on 4 and 881 on 8 (``gpu_profile.py``), and
Shampoo's root step (250 factors) 1107 ms on one, 902, 818 and 762 (``shampoo_roots.py``;
benchmarks/RESULTS.md, GPU). The streams are made, with their threads, only when a CUDA
batch is spread; the CPU never is.

Results equal those of the same solver on the host for the host's batches (the same
LAPACK call); which batches go where, and in which precision, depends only on their
size, dtype and device, so a run and its resumption compute alike.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TypeVar, cast

import torch
from torch import Tensor

__all__ = ["DEFAULT_DEVICE_STREAMS", "DEFAULT_HOST_MAX_DIM", "DEFAULT_PLACEMENT", "JACOBI_ROWS",
           "BatchResult", "EighResult", "SolvePlacement", "Solver", "default_device_streams",
           "eigh_batches", "eigh_dtype", "load_cuda_linalg", "solve_batches", "solves_on_host",
           "spreads_over_streams", "symmetric_eigh", "usable_cores"]

#: The largest CUDA matrix decomposed on the host by default: none (0). Measured on an
#: NVIDIA H200 (module docstring): the device, with :func:`eigh_dtype`, is faster.
DEFAULT_HOST_MAX_DIM = 0

#: The most CUDA streams (a worker thread each) the device's decompositions of more than
#: 32 rows are spread over by default: 8, the fastest of 1, 2, 4 and 8 for K-FAC's inverse
#: update and Shampoo's root step on an NVIDIA H200 (module docstring); fewer where the
#: process may run on fewer cores (:func:`default_device_streams`).
DEFAULT_DEVICE_STREAMS = 8


def usable_cores() -> int:
    """The cores this process may run on.

    Its affinity mask (a batch system's binding), else the machine's cores.
    """
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity masks on this platform
        return os.cpu_count() or 1


def default_device_streams(cores: int | None = None) -> int:
    """The default ``decomposition_streams``.

    :data:`DEFAULT_DEVICE_STREAMS`, or the cores when fewer: each stream's worker thread
    waits on its solver's host read, and CUDA spins while it waits, so a rank bound to 2
    cores gets 2 streams.

    Args:
        cores: The cores the streams' threads may use (default: :func:`usable_cores`;
            ``kfac-hpc train`` passes its rank's share of the node's).
    """
    return max(1, min(DEFAULT_DEVICE_STREAMS, usable_cores() if cores is None else cores))

#: The rows of the float32 CUDA matrices torch decomposes with cuSOLVER's Jacobi solver
#: (``linalg_eigh_cusolver`` in ATen: ``syevj`` for 32 <= n <= 512), inclusive.
JACOBI_ROWS = (32, 512)


@dataclass(frozen=True)
class SolvePlacement:
    """Where :func:`solve_batches` runs the batches of CUDA matrices (module docstring).

    Attributes:
        host_max_dim: Batches of at most this many rows go to the host worker (0: none;
            ``host_decomposition_max_dim`` of K-FAC and Shampoo).
        device_streams: The CUDA streams, each with a worker thread, the device's
            batches are spread over (1: the calling thread's stream;
            ``decomposition_streams``; default :func:`default_device_streams`).
    """

    host_max_dim: int = DEFAULT_HOST_MAX_DIM
    device_streams: int = field(default_factory=default_device_streams)

    @classmethod
    def of(cls, host_max_dim: int, device_streams: int | None) -> SolvePlacement:
        """The placement of two options (``decomposition_streams`` None: the default).

        Args:
            host_max_dim: ``host_decomposition_max_dim``.
            device_streams: ``decomposition_streams``; None: :func:`default_device_streams`.
        """
        if device_streams is None:
            return cls(host_max_dim)
        return cls(host_max_dim, device_streams)

    def __post_init__(self) -> None:
        """Validate both (one error naming the first problem and its fix)."""
        if not isinstance(self.host_max_dim, int) or isinstance(self.host_max_dim, bool) \
                or self.host_max_dim < 0:
            raise ValueError(f"host_decomposition_max_dim must be an integer >= 0 (0: every "
                             f"decomposition on the device), got {self.host_max_dim!r}")
        if not isinstance(self.device_streams, int) or isinstance(self.device_streams, bool) \
                or self.device_streams < 1:
            raise ValueError(f"decomposition_streams must be an integer >= 1 (1: the calling "
                             f"thread's stream), got {self.device_streams!r}")


#: The default placement: every CUDA batch on the device, spread over the default streams.
DEFAULT_PLACEMENT = SolvePlacement()

#: What a solver returned for a batch, or the error it raised.
BatchResult = tuple[Tensor, ...] | Exception
#: ``(eigenvalues, eigenvectors)`` of a batch, or the error its solver raised.
EighResult = tuple[Tensor, Tensor] | Exception
#: A batched solver: stacked matrices in, a tuple of tensors out (host or device alike).
Solver = Callable[[Tensor], tuple[Tensor, ...]]

_worker: ThreadPoolExecutor | None = None
_worker_lock = threading.Lock()
_lanes: ThreadPoolExecutor | None = None
_lane_threads = 0
_lane_streams: dict[tuple[torch.device, int], torch.cuda.Stream] = {}
#: A chunk of a batch: (batch index, chunk index, its matrices).
_Piece = tuple[int, int, Tensor]
_T = TypeVar("_T")


_linalg_loaded: set[torch.device] = set()


def load_cuda_linalg(device: torch.device) -> None:
    """Make torch load its CUDA linear algebra before worker threads call it (once a device).

    Torch's CUDA builds load their linear-algebra kernels on the first such call, and
    two threads making that first call together make one of them fail with "lazy
    wrapper should be called at most once" (pytorch/pytorch#90613). So before starting
    threads that decompose on CUDA (the stream lanes here, K-FAC's background
    decompositions), the calling thread makes one small call: ``cholesky_ex`` of a 1x1
    matrix, which reads nothing back. Nothing to do on other devices.

    Args:
        device: The device the threads will decompose on.
    """
    if device.type != "cuda" or device in _linalg_loaded:
        return
    with _worker_lock:
        if device not in _linalg_loaded:
            torch.linalg.cholesky_ex(torch.ones(1, 1, device=device))
            _linalg_loaded.add(device)


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


def _solve_on_host(host: Tensor, ready: torch.cuda.Event | None, solve: Solver,
                   device: torch.device) -> tuple[Tensor, ...]:
    """Solve ``host`` once its copy is complete; the results pinned for the way back.

    On CUDA the worker thread makes the batch's device current first: a thread starts on
    device 0, and its event wait and pinned allocations would otherwise create a context
    there on a rank that uses another GPU.
    """
    if ready is None:  # a CPU batch: nothing to wait for, nothing to copy back
        return tuple(solve(host))
    with torch.cuda.device(device):
        ready.synchronize()
        return tuple(t.pin_memory() for t in solve(host))


def _collect(future: Future[tuple[Tensor, ...]], device: torch.device) -> BatchResult:
    try:
        results = future.result()
    except Exception as exc:  # LinAlgError, backend errors: in the batch's place
        return exc
    return tuple(t.to(device, non_blocking=True) for t in results)


def spreads_over_streams(batch: Tensor, device_streams: int) -> bool:
    """Whether :func:`solve_batches` spreads ``batch`` over ``device_streams`` streams.

    Args:
        batch: Stacked square matrices ``(..., n, n)``.
        device_streams: The streams asked for.

    Returns:
        True for a batch on a CUDA device with more than 32 rows (at most 32, cuSOLVER
        may solve a batch in one batched Jacobi call, which chunks would change) when
        more than one stream is asked for, unless PyTorch's deterministic algorithms are
        on (``torch.use_deterministic_algorithms``): cuSOLVER on concurrent streams was
        not reproducible under them (module docstring).
    """
    return (device_streams > 1 and batch.device.type == "cuda" and batch.shape[-1] > 32
            and not torch.are_deterministic_algorithms_enabled())


def _submit_to_lanes(lanes: int, calls: Sequence[tuple[Callable[..., _T], tuple[object, ...]]]
                     ) -> list[Future[_T]]:
    """Submit ``calls`` to the streams' worker threads (grown to ``lanes`` threads first).

    A pool too small for ``lanes`` is replaced by a larger one and shut down without
    waiting: work already queued on it still runs, and its threads exit once idle. The
    calls are submitted under the same lock, so no caller submits to a pool another has
    just shut down.
    """
    global _lanes, _lane_threads
    with _worker_lock:
        if _lanes is None or _lane_threads < lanes:
            replaced = _lanes
            _lanes = ThreadPoolExecutor(max_workers=lanes,
                                        thread_name_prefix="kfac-hpc-stream-solves")
            _lane_threads = lanes
            if replaced is not None:
                replaced.shutdown(wait=False)
        return [_lanes.submit(fn, *args) for fn, args in calls]


def _lane_stream(device: torch.device, lane: int) -> torch.cuda.Stream:
    with _worker_lock:
        key = (device, lane)
        if key not in _lane_streams:
            _lane_streams[key] = torch.cuda.Stream(device)
        return _lane_streams[key]


def _solve_lane(pieces: list[_Piece], solve: Solver, lane: int,
                ready: torch.cuda.Event | None, consumer: torch.cuda.Stream | None
                ) -> tuple[torch.cuda.Event | None, dict[tuple[int, int], BatchResult]]:
    """Solve ``pieces`` in order on lane ``lane``'s stream (after ``ready``).

    Returns the event that marks the lane's end and every piece's result (or error).
    """
    results: dict[tuple[int, int], BatchResult] = {}
    device = pieces[0][2].device
    # the CPU (tests) has no streams: the same loop, nothing to order
    stream = _lane_stream(device, lane) if consumer is not None else None
    with (contextlib.ExitStack() if stream is None else
          _on_stream(device, stream, cast(torch.cuda.Event, ready))):
        for i, j, chunk in pieces:
            if stream is not None:
                chunk.record_stream(stream)  # made on the consumer's stream, read here
            try:
                solved = tuple(solve(chunk))
            except Exception as exc:  # in the piece's place
                results[(i, j)] = exc
                continue
            if consumer is not None:
                for t in solved:
                    t.record_stream(consumer)  # made on this stream, read on the consumer's
            results[(i, j)] = solved
    if stream is None:
        return None, results
    done = torch.cuda.Event()
    done.record(stream)
    return done, results


@contextlib.contextmanager
def _on_stream(device: torch.device, stream: torch.cuda.Stream, ready: torch.cuda.Event
               ) -> Iterator[None]:
    """Make ``stream`` current on ``device`` in this thread, after ``ready``."""
    with torch.cuda.device(device), torch.cuda.stream(stream):
        stream.wait_event(ready)
        yield


def _solve_on_streams(batches: dict[int, Tensor], solve: Solver, lanes: int
                      ) -> dict[int, BatchResult]:
    """Solve ``batches`` spread over ``lanes`` worker threads and streams.

    Each batch is split into up to ``lanes`` chunks of matrices; the chunks go to the
    lanes by cost (``n³`` per matrix, the largest first, each to the least loaded
    lane). The caller's current stream waits for every lane before the results,
    concatenated per batch, are used.
    """
    pieces: list[_Piece] = []
    for i, batch in batches.items():
        chunks = torch.tensor_split(batch, min(lanes, batch.shape[0])) if batch.dim() > 2 \
            else (batch,)
        pieces.extend((i, j, chunk) for j, chunk in enumerate(chunks))

    def cost(piece: _Piece) -> float:
        chunk = piece[2]
        return float(chunk.shape[-1]) ** 3 * (chunk.numel() // chunk.shape[-1] ** 2)

    plan: list[list[_Piece]] = [[] for _ in range(lanes)]
    load = [0.0] * lanes
    for piece in sorted(pieces, key=cost, reverse=True):
        lane = min(range(lanes), key=load.__getitem__)
        plan[lane].append(piece)
        load[lane] += cost(piece)
    device = pieces[0][2].device
    ready: torch.cuda.Event | None = None
    consumer: torch.cuda.Stream | None = None
    if device.type == "cuda":
        load_cuda_linalg(device)  # before the lanes' first calls, which would race
        consumer = torch.cuda.current_stream(device)
        ready = torch.cuda.Event()
        ready.record(consumer)
    futures = _submit_to_lanes(lanes, [(_solve_lane, (lane_pieces, solve, lane, ready, consumer))
                                       for lane, lane_pieces in enumerate(plan) if lane_pieces])
    solved: dict[tuple[int, int], BatchResult] = {}
    for future in futures:
        done, results = future.result()
        if done is not None and consumer is not None:
            consumer.wait_event(done)
        solved.update(results)
    out: dict[int, BatchResult] = {}
    for i in batches:
        parts = [solved[key] for key in sorted(k for k in solved if k[0] == i)]
        failed = next((p for p in parts if isinstance(p, Exception)), None)
        if failed is not None:
            out[i] = failed
            continue
        ordered = cast(list[tuple[Tensor, ...]], parts)
        out[i] = ordered[0] if len(ordered) == 1 else tuple(
            _concatenate([r[t] for r in ordered]) for t in range(len(ordered[0])))
    return out


def _concatenate(parts: list[Tensor]) -> Tensor:
    """The chunks' results as one batch, in the layout one call on the whole batch gives.

    ``torch.linalg.eigh`` returns each matrix of eigenvectors column-major; a plain
    ``torch.cat`` would make them row-major, and the GEMMs that read them afterwards could
    then take other kernels (other roundings) than after a solve on one stream.
    """
    first = parts[0]
    if first.dim() >= 2 and not first.is_contiguous() and first.mT.is_contiguous():
        return torch.cat([p.mT for p in parts]).mT
    return torch.cat(parts)


def solve_batches(batches: Sequence[Tensor], solve: Solver,
                  placement: SolvePlacement = DEFAULT_PLACEMENT) -> list[BatchResult]:
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
        placement: The batches for the host and the device's streams.

    Returns:
        Per batch, what ``solve`` returned, or the exception it raised.
    """
    host_max_dim, device_streams = placement.host_max_dim, placement.device_streams
    on_host: dict[int, Future[tuple[Tensor, ...]]] = {}
    for i, batch in enumerate(batches):
        if solves_on_host(batch, host_max_dim):
            host, ready = _to_host(batch)
            on_host[i] = _host_worker().submit(_solve_on_host, host, ready, solve,
                                               batch.device)
    out: list[BatchResult | None] = [None] * len(batches)
    spread = {i: b for i, b in enumerate(batches)
              if i not in on_host and spreads_over_streams(b, device_streams)}
    if spread:
        for i, result in _solve_on_streams(spread, solve, device_streams).items():
            out[i] = result
    for i, batch in enumerate(batches):
        if i in on_host or i in spread:
            continue
        try:
            out[i] = tuple(solve(batch))
        except Exception as exc:  # in the batch's place, as the host's
            out[i] = exc
    for i, future in on_host.items():
        out[i] = _collect(future, batches[i].device)
    return cast(list[BatchResult], out)


def eigh_batches(batches: Sequence[Tensor], placement: SolvePlacement = DEFAULT_PLACEMENT
                 ) -> list[EighResult]:
    """``torch.linalg.eigh`` of every batch; the small CUDA ones on the host meanwhile.

    :func:`solve_batches` with the symmetric eigensolver, which reads only the lower
    triangle of each matrix.

    Args:
        batches: Stacked symmetric matrices ``(..., n, n)``, any devices and sizes.
        placement: The batches for the host and the device's streams.

    Returns:
        Per batch, ``(eigenvalues, eigenvectors)`` in ascending order, or the exception.
    """
    return cast(list[EighResult], solve_batches(batches, symmetric_eigh, placement))


def eigh_dtype(batch: Tensor) -> torch.dtype:
    """The dtype :func:`symmetric_eigh` decomposes ``batch`` in.

    float64 for a float32 batch on a CUDA device with rows in :data:`JACOBI_ROWS` (where
    torch would pick cuSOLVER's Jacobi solver; in float64 it picks divide and conquer,
    2-3x faster there on real factors: module docstring); else ``batch``'s own dtype.

    Args:
        batch: Stacked square matrices ``(..., n, n)``.

    Returns:
        The dtype to decompose in.
    """
    low, high = JACOBI_ROWS
    if (batch.device.type == "cuda" and batch.dtype == torch.float32
            and low <= batch.shape[-1] <= high):
        return torch.float64
    return batch.dtype


def symmetric_eigh(batch: Tensor) -> tuple[Tensor, ...]:
    """``torch.linalg.eigh`` as a :data:`Solver`: ``(eigenvalues, eigenvectors)``.

    Computed in :func:`eigh_dtype` (float64 for float32 CUDA batches of Jacobi's range)
    and returned in ``batch``'s dtype.
    """
    work = eigh_dtype(batch)
    if work == batch.dtype:
        return tuple(torch.linalg.eigh(batch))
    values, vectors = torch.linalg.eigh(batch.to(work))
    return values.to(batch.dtype), vectors.to(batch.dtype)
