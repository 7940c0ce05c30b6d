"""MPI collectives on torch tensors (and CuPy/NumPy arrays).

``Communicator`` is the only object in kfac_hpc that talks to MPI. Every collective
exists in a blocking form (returns the result) and a non-blocking form (``i``-prefixed,
returns a :class:`Handle` whose ``wait()`` returns the result). Handles keep every
buffer alive until completion: mpi4py does not do that for non-blocking reductions.

In-place semantics follow ``torch.distributed``: allreduce, reduce (at the root)
and broadcast overwrite their tensor; reduce-scatter and gathers return new tensors
(or fill ``out``). A CuPy or NumPy array in gives the same kind of array out.

CUDA tensors. Where the MPI library takes device memory for a call (the per-call
table of :mod:`kfac_hpc.comm.cuda`), MPI gets the device buffer; otherwise the data is
staged through pooled pinned host memory. The stream rule: every conversion a call
needs (contiguous copy, bf16 widening, device→host staging copy) is queued on the
caller's current stream, or on a side stream that waits for it, and an event is
recorded after the last of them; MPI touches a buffer only once that event has
completed. Blocking calls wait for the event. Non-blocking calls do not block the
calling stream or thread: the handle is queued and its MPI call is posted by a later
``test()``/``wait()`` (or the next call on this communicator) once the event has
completed, always in the order the calls were made, which is the order every rank
must use. Results land back (host→device, non-blocking) on the current stream of the
thread that completes the call. Call ``test()`` on handles from hooks to post them
early; ``wait()`` posts and completes.

Threads: backward hooks on CUDA run on autograd's worker thread; the library must
provide at least ``MPI_THREAD_SERIALIZED`` (see :mod:`kfac_hpc.comm.threads`).
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import pickle
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Generic, Literal, TypeVar, cast

import torch
from mpi4py import MPI

from kfac_hpc.comm import staging, threads
from kfac_hpc.comm.buffers import Wire, as_torch, to_wire
from kfac_hpc.comm.cuda import CudaSupport, detect
from kfac_hpc.comm.stats import TrafficStats

ReduceOp = Literal["sum", "avg", "max", "min"]
_MPI_OPS = {"sum": MPI.SUM, "avg": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}
AGREE_BYTES = 16  # Communicator.agree: one allreduce of (digest, -digest), two int64

T = TypeVar("T")
A = TypeVar("A")  # a torch tensor, or a CuPy/NumPy array: results come back as the same kind


class Handle(Generic[T]):
    """A collective in flight; ``wait()`` completes it and returns its result.

    A handle whose buffers are still being produced on a CUDA stream is *pending*: its
    MPI call is posted by ``test()`` once the producing work has completed, or by
    ``wait()`` after waiting for it (see :class:`Communicator`).
    """

    def __init__(self, comm: Communicator | None, start: Callable[[], MPI.Request | None],
                 finish: Callable[[], T], keep: Any, events: Sequence[Any] = ()) -> None:
        """Wrap a call that ``start`` posts and ``finish`` completes (see :class:`Communicator`).

        Args:
            comm: The communicator whose queue posts this call in order; None: post when
                first tested or waited for.
            start: Posts the MPI call; returns its request, or None for a call that
                completed when posted.
            finish: Runs after completion (lands staged data, divides for ``"avg"``);
                returns the result.
            keep: Buffers MPI reads or writes, kept alive until completion.
            events: CUDA events that must complete before the call is posted.
        """
        self._comm = comm
        self._start = start
        self._request: MPI.Request | None = None
        self._posted = False
        self._events = list(events)  # CUDA events MPI must wait for
        self._finish = finish
        self._keep = keep  # buffers MPI reads or writes until completion
        self._done = False
        self._result: T | None = None
        self._error: Exception | None = None  # the post failed: raised by wait()/test()

    # ------------------------------------------------------- posting (internal)
    def _ready(self) -> bool:
        return all(e.query() for e in self._events)

    def _wait_ready(self) -> None:
        for e in self._events:
            e.synchronize()

    def _post(self) -> None:
        with threads.mpi_guard():
            self._request = self._start()
        self._posted = True
        self._events = []

    def _ensure_posted(self, block: bool) -> bool:
        if not self._posted and self._error is None and self._comm is not None:
            self._comm._flush(upto=self, block=block)
        if self._error is not None:  # this call's own failure, whoever posted it
            raise self._error
        return self._posted

    # ----------------------------------------------------------------- public
    @property
    def posted(self) -> bool:
        """Whether the MPI call has been made (False while CUDA work it needs runs)."""
        return self._posted

    def test(self) -> bool:
        """Say whether the operation has completed, posting it if its data is ready.

        Drives MPI progress; never blocks on CUDA work.

        Returns:
            True once the operation has completed.
        """
        if self._done:
            return True
        if not self._ensure_posted(block=False):
            return False
        if self._request is None:
            return True
        with threads.mpi_guard():
            return bool(self._request.Test())

    def wait(self) -> T:
        """Complete the operation (idempotent) and return its result.

        Returns:
            The collective's result (the same object on every call).
        """
        if not self._done:
            if not self._ensure_posted(block=True):
                raise RuntimeError("a collective was waited for but never posted")
            if self._request is not None:
                if threads.provided_level() == MPI.THREAD_SERIALIZED:
                    # Test in a loop: the lock is free between tests for hook threads
                    while not self.test():
                        time.sleep(0)
                else:
                    with threads.mpi_guard():
                        self._request.Wait()
            self._result = self._finish()
            self._done = True
            self._keep = None
        return cast(T, self._result)

    @property
    def done(self) -> bool:
        """Whether :meth:`wait` has completed the operation."""
        return self._done


def wait_all(handles: Iterable[Handle[Any]]) -> list[Any]:
    """Wait for every handle, in the order given.

    Args:
        handles: Handles of non-blocking calls.

    Returns:
        Their results, in the same order.
    """
    return [h.wait() for h in handles]


def _check_counts(counts: Sequence[int], size: int, total: int | None, what: str) -> list[int]:
    counts = [int(c) for c in counts]
    if len(counts) != size:
        raise ValueError(f"{what}: got {len(counts)} counts for a communicator of {size} ranks")
    if any(c < 0 for c in counts):
        raise ValueError(f"{what}: counts must be >= 0, got {counts}")
    if total is not None and sum(counts) != total:
        raise ValueError(f"{what}: counts sum to {sum(counts)} but the tensor has {total} elements")
    return counts


def _displacements(counts: Sequence[int]) -> list[int]:
    out, acc = [], 0
    for c in counts:
        out.append(acc)
        acc += c
    return out


class Communicator:
    """Collectives over an ``mpi4py`` communicator (default ``MPI.COMM_WORLD``).

    A world of one process works without ``mpiexec``. See the module docstring for the
    stream rule on CUDA tensors. Every collective must be called by every rank of the
    communicator, in the same order.
    """

    def __init__(self, mpi_comm: MPI.Comm | None = None, *,
                 cuda_aware: bool | Literal["all"] | None = None, name: str = "world",
                 cuda: CudaSupport | None = None) -> None:
        """Wrap an MPI communicator.

        Args:
            mpi_comm: The MPI communicator (default ``MPI.COMM_WORLD``).
            cuda_aware: Overrides the detection of which calls take CUDA device memory:
                ``False`` stages every CUDA tensor through host memory, ``True`` trusts the
                MPI vendor's table (with its routing rules, as if detected), ``"all"``
                hands device memory to every call (no routing rules); ``None`` reads
                ``KFAC_HPC_CUDA_AWARE`` and then the evidence
                (:func:`kfac_hpc.comm.cuda.detect`).
            name: The name in messages and ``repr``.
            cuda: A ready :class:`~kfac_hpc.comm.cuda.CudaSupport`, instead of a detection
                (sub-communicators inherit their parent's).
        """
        self.mpi: MPI.Comm = mpi_comm if mpi_comm is not None else MPI.COMM_WORLD
        self.rank: int = self.mpi.Get_rank()
        self.size: int = self.mpi.Get_size()
        self.name = name
        self.cuda: CudaSupport = cuda if cuda is not None else detect(cuda_aware)
        self.cuda_aware: bool = self.cuda.aware
        self.stats = TrafficStats()
        self.children: list[Communicator] = []
        # shared by every Communicator over the same MPI communicator: call order is per
        # MPI communicator, whichever object made the call
        self._pending, self._queue_lock = _queue_of(self.mpi)

    def __repr__(self) -> str:
        """Name the communicator, this rank and the size."""
        return f"Communicator(name={self.name!r}, rank={self.rank}, size={self.size})"

    # ------------------------------------------------------------------ helpers
    def _count(self, kind: str, nbytes: int) -> None:
        if self.size > 1:
            self.stats.record(kind, nbytes)

    def _wire(self, tensor: torch.Tensor, call: str, *, reduction: bool,
              need_input: bool = True) -> Wire:
        wire = to_wire(tensor, reduction=reduction, device_ok=self.cuda.device_ok(call),
                       need_input=need_input)
        if wire.staged:
            staging.report_staging(self.cuda, call, wire.data.nbytes)
        return wire

    def _flush(self, upto: Handle[Any] | None = None, block: bool = True) -> None:
        """Post queued non-blocking calls in order.

        Posts all of them (``upto=None``) or up to ``upto``; ``block=False`` stops at the
        first whose CUDA work is not done yet.
        """
        with self._queue_lock:
            while self._pending:
                head = self._pending[0]
                if not head._ready():
                    if not block:
                        return
                    head._wait_ready()
                try:
                    head._post()
                except Exception as exc:  # its own wait() raises it, not another's
                    head._error = exc
                finally:  # posted, or refused (never to be posted): off the queue
                    self._pending.popleft()
                if head is upto:
                    return

    def _post(self, blocking: bool, run: Callable[[], MPI.Request | None],
              finish: Callable[[], Any], keep: Any, wires: Sequence[Wire],
              back: Callable[[torch.Tensor], Any]) -> Any:
        events = [w.ready for w in wires if w.ready is not None]
        if blocking:
            self._flush()  # calls made earlier on this communicator go first
            for event in events:
                event.synchronize()
            with threads.mpi_guard():
                run()
            return back(finish())
        handle: Handle[Any] = Handle(self, run, lambda: back(finish()), keep, events)
        with self._queue_lock:
            self._pending.append(handle)
            self._flush(upto=handle, block=False)
        if handle._error is not None:  # posted at once, and refused: raised by the call
            raise handle._error
        return handle

    def _blocking(self, fn: Callable[[], T]) -> T:
        """Make a blocking MPI call directly (objects, barrier, splits), after the queue."""
        self._flush()
        with threads.mpi_guard():
            return fn()

    def pending(self) -> int:
        """Count the non-blocking calls queued but not yet posted (waiting for CUDA work).

        Returns:
            The number of queued calls on this MPI communicator.
        """
        return len(self._pending)

    def traffic(self) -> TrafficStats:
        """Merge the counters of this communicator and every sub-communicator split from it.

        Returns:
            A new :class:`TrafficStats`; the communicators' own counters are not changed.
        """
        return TrafficStats.merged([self.stats, *(c.traffic() for c in self.children)])

    def reset_traffic(self) -> None:
        """Reset this communicator's counters and its sub-communicators'."""
        self.stats.reset()
        for c in self.children:
            c.reset_traffic()

    # ------------------------------------------------------------ allreduce
    def allreduce(self, tensor: A, op: ReduceOp = "sum") -> A:
        """Reduce ``tensor`` over all ranks, in place (collective).

        Args:
            tensor: A tensor or CuPy/NumPy array; overwritten with the result.
            op: ``"sum"``, ``"avg"`` (floating point only), ``"max"`` or ``"min"``.

        Returns:
            ``tensor``, holding the result.

        Raises:
            ValueError: ``op`` is unknown.
            TypeError: ``op="avg"`` on an integer tensor.
        """
        return cast(A, self._allreduce(tensor, op, blocking=True))

    def iallreduce(self, tensor: A, op: ReduceOp = "sum") -> Handle[A]:
        """Start a non-blocking :meth:`allreduce`; the arguments are the same.

        Returns:
            A handle whose ``wait()`` returns what :meth:`allreduce` returns.
        """
        return cast(Handle[A], self._allreduce(tensor, op, blocking=False))

    def _allreduce(self, obj: Any, op: ReduceOp, blocking: bool) -> Any:
        tensor, back = as_torch(obj)
        mpi_op = self._op(op, tensor)
        wire = self._wire(tensor, "allreduce" if blocking else "iallreduce", reduction=True)
        self._count("allreduce", wire.data.nbytes)
        spec = wire.spec()
        run = (lambda: self.mpi.Allreduce(MPI.IN_PLACE, spec, mpi_op)) if blocking else (
            lambda: self.mpi.Iallreduce(MPI.IN_PLACE, spec, mpi_op))
        return self._post(blocking, run, self._finisher(wire, op), wire, [wire], back)

    # -------------------------------------------------------- reduce-scatter
    def reduce_scatter(self, tensor: A, counts: Sequence[int], op: ReduceOp = "sum",
                       out: A | None = None) -> A:
        """Reduce the flat ``tensor`` over ranks; rank r receives ``counts[r]`` elements.

        Collective.

        Args:
            tensor: ``sum(counts)`` elements, rank r's part at offset ``sum(counts[:r])``;
                left unchanged.
            counts: Elements per rank, one per rank of the communicator; may be uneven and
                zero.
            op: ``"sum"``, ``"avg"``, ``"max"`` or ``"min"``.
            out: Receives this rank's ``counts[rank]`` elements (same dtype and device);
                default a new tensor.

        Returns:
            This rank's reduced part, flat (``out`` when given).

        Raises:
            ValueError: The counts do not match the tensor or the communicator, or ``out``
                has the wrong size, dtype or device.
        """
        return cast(A, self._reduce_scatter(tensor, counts, op, out, blocking=True))

    def ireduce_scatter(self, tensor: A, counts: Sequence[int], op: ReduceOp = "sum",
                        out: A | None = None) -> Handle[A]:
        """Start a non-blocking :meth:`reduce_scatter`; the arguments are the same.

        Returns:
            A handle whose ``wait()`` returns what :meth:`reduce_scatter` returns.
        """
        return cast(Handle[A], self._reduce_scatter(tensor, counts, op, out, blocking=False))

    def _reduce_scatter(self, obj: Any, counts: Sequence[int], op: ReduceOp,
                        out_obj: Any | None, blocking: bool) -> Any:
        tensor, back = as_torch(obj)
        mpi_op = self._op(op, tensor)
        counts = _check_counts(counts, self.size, tensor.numel(), "reduce_scatter")
        if out_obj is None:
            out = torch.empty(counts[self.rank], dtype=tensor.dtype, device=tensor.device)
        else:
            out, back = as_torch(out_obj)
            if out.numel() != counts[self.rank] or out.dtype != tensor.dtype:
                raise ValueError(f"reduce_scatter: out must hold {counts[self.rank]} elements "
                                 f"of {tensor.dtype}, got {out.numel()} of {out.dtype}")
            _check_same_device(tensor, out, "reduce_scatter")
        call = "reduce_scatter" if blocking else "ireduce_scatter"
        send = self._wire(tensor.reshape(-1), call, reduction=True)
        recv = self._wire(out, call, reduction=True, need_input=False)
        self._count("reduce_scatter", send.data.nbytes)
        sspec, rspec = send.spec(), recv.spec()
        run = (lambda: self.mpi.Reduce_scatter(sspec, rspec, counts, mpi_op)) if blocking else (
            lambda: self.mpi.Ireduce_scatter(sspec, rspec, counts, mpi_op))
        return self._post(blocking, run, self._finisher(recv, op, also=[send]), (send, recv),
                          [send, recv], back)

    # ---------------------------------------------------------------- reduce
    def reduce(self, tensor: A, root: int = 0, op: ReduceOp = "sum") -> A:
        """Reduce onto ``root``, in place there; other ranks' tensors stay unchanged (collective).

        Args:
            tensor: The contribution of this rank; at ``root``, overwritten with the result.
            root: The rank that receives the result.
            op: ``"sum"``, ``"avg"``, ``"max"`` or ``"min"``.

        Returns:
            ``tensor``.

        Raises:
            ValueError: ``root`` is not a rank of this communicator, or ``op`` is unknown.
        """
        return cast(A, self._reduce(tensor, root, op, blocking=True))

    def ireduce(self, tensor: A, root: int = 0, op: ReduceOp = "sum") -> Handle[A]:
        """Start a non-blocking :meth:`reduce`; the arguments are the same.

        Returns:
            A handle whose ``wait()`` returns what :meth:`reduce` returns.
        """
        return cast(Handle[A], self._reduce(tensor, root, op, blocking=False))

    def _reduce(self, obj: Any, root: int, op: ReduceOp, blocking: bool) -> Any:
        tensor, back = as_torch(obj)
        mpi_op = self._op(op, tensor)
        self._check_root(root)
        wire = self._wire(tensor, "reduce" if blocking else "ireduce", reduction=True)
        self._count("reduce", wire.data.nbytes)
        spec = wire.spec()
        send: Any
        recv: Any
        if self.rank == root:
            send, recv = MPI.IN_PLACE, spec
            finish = self._finisher(wire, op)
        else:
            send, recv = spec, None
            finish = _releaser(wire)
        run = (lambda: self.mpi.Reduce(send, recv, mpi_op, root)) if blocking else (
            lambda: self.mpi.Ireduce(send, recv, mpi_op, root))
        return self._post(blocking, run, finish, wire, [wire], back)

    # ------------------------------------------------------------- broadcast
    def broadcast(self, tensor: A, root: int = 0) -> A:
        """Overwrite ``tensor`` on every rank with ``root``'s values (collective).

        Args:
            tensor: Same shape and dtype on every rank; read at ``root``, overwritten
                elsewhere.
            root: The rank whose values are sent.

        Returns:
            ``tensor``.
        """
        return cast(A, self._broadcast(tensor, root, blocking=True))

    def ibroadcast(self, tensor: A, root: int = 0) -> Handle[A]:
        """Start a non-blocking :meth:`broadcast`; the arguments are the same.

        Returns:
            A handle whose ``wait()`` returns what :meth:`broadcast` returns.
        """
        return cast(Handle[A], self._broadcast(tensor, root, blocking=False))

    def _broadcast(self, obj: Any, root: int, blocking: bool) -> Any:
        tensor, back = as_torch(obj)
        self._check_root(root)
        wire = self._wire(tensor, "bcast" if blocking else "ibcast", reduction=False,
                          need_input=self.rank == root)
        self._count("broadcast", wire.data.nbytes)
        spec = wire.spec()
        run = (lambda: self.mpi.Bcast(spec, root)) if blocking else (
            lambda: self.mpi.Ibcast(spec, root))
        finish = _releaser(wire) if self.rank == root else wire.land
        return self._post(blocking, run, finish, wire, [wire], back)

    # ------------------------------------------------------------- allgather
    def allgather(self, tensor: A, out: A | None = None) -> A:
        """Gather equal-shaped tensors from every rank (collective).

        Args:
            tensor: This rank's part; the same shape and dtype on every rank.
            out: Receives the result (shape ``(size, *tensor.shape)``, same dtype and
                device); reuse it across calls for large messages: a fresh multi-MiB result
                costs page faults on every call.

        Returns:
            Shape ``(size, *tensor.shape)``, row r from rank r (``out`` when given).

        Raises:
            ValueError: ``out`` has the wrong shape, dtype or device.
        """
        return cast(A, self._allgather(tensor, out, blocking=True))

    def iallgather(self, tensor: A, out: A | None = None) -> Handle[A]:
        """Start a non-blocking :meth:`allgather`; the arguments are the same.

        Returns:
            A handle whose ``wait()`` returns what :meth:`allgather` returns.
        """
        return cast(Handle[A], self._allgather(tensor, out, blocking=False))

    def _allgather(self, obj: Any, out_obj: Any | None, blocking: bool) -> Any:
        tensor, back = as_torch(obj)
        shape = (self.size, *tensor.shape)
        if out_obj is None:
            out = torch.empty(shape, dtype=tensor.dtype, device=tensor.device)
        else:
            out, back = as_torch(out_obj)
            if tuple(out.shape) != shape or out.dtype != tensor.dtype:
                raise ValueError(f"allgather: out must have shape {shape} and dtype "
                                 f"{tensor.dtype}, got {tuple(out.shape)} {out.dtype}")
            _check_same_device(tensor, out, "allgather")
        call = "allgather" if blocking else "iallgather"
        send = self._wire(tensor, call, reduction=False)
        recv = self._wire(out, call, reduction=False, need_input=False)
        self._count("allgather", recv.data.nbytes)
        sspec = send.spec()
        buf, _, dtype = recv.spec()
        rspec = [buf, send.data.numel(), dtype]  # mpi4py: count per rank
        run = (lambda: self.mpi.Allgather(sspec, rspec)) if blocking else (
            lambda: self.mpi.Iallgather(sspec, rspec))
        return self._post(blocking, run, _lander(recv, [send]), (send, recv), [send, recv], back)

    def allgatherv(self, tensor: A, counts: Sequence[int] | None = None,
                   out: A | None = None) -> A:
        """Gather variable-length flat tensors into one 1-D tensor ordered by rank (collective).

        Args:
            tensor: This rank's elements (flattened).
            counts: Elements per rank; None learns them with an extra small allgather.
            out: Receives the ``sum(counts)`` elements (same dtype and device).

        Returns:
            A 1-D tensor of ``sum(counts)`` elements (``out`` when given).

        Raises:
            ValueError: The counts do not match this rank's tensor or the communicator, or
                ``out`` has the wrong size, dtype or device.
        """
        return cast(A, self._allgatherv(tensor, counts, out, blocking=True))

    def iallgatherv(self, tensor: A, counts: Sequence[int] | None = None,
                    out: A | None = None) -> Handle[A]:
        """Start a non-blocking :meth:`allgatherv`; the arguments are the same.

        Returns:
            A handle whose ``wait()`` returns what :meth:`allgatherv` returns.
        """
        return cast(Handle[A], self._allgatherv(tensor, counts, out, blocking=False))

    def _allgatherv(self, obj: Any, counts: Sequence[int] | None, out_obj: Any | None,
                    blocking: bool) -> Any:
        tensor, back = as_torch(obj)
        if counts is None:
            counts = self.allgather_object(tensor.numel())
        counts = _check_counts(counts, self.size, None, "allgatherv")
        if counts[self.rank] != tensor.numel():
            raise ValueError(f"allgatherv: counts[{self.rank}]={counts[self.rank]} but this rank's "
                             f"tensor has {tensor.numel()} elements")
        total = sum(counts)
        if out_obj is None:
            out = torch.empty(total, dtype=tensor.dtype, device=tensor.device)
        else:
            out, back = as_torch(out_obj)
            if out.numel() != total or out.dtype != tensor.dtype:
                raise ValueError(f"allgatherv: out must hold {total} elements of {tensor.dtype}")
            _check_same_device(tensor, out, "allgatherv")
        call = "allgatherv" if blocking else "iallgatherv"
        send = self._wire(tensor.reshape(-1), call, reduction=False)
        recv = self._wire(out, call, reduction=False, need_input=False)
        self._count("allgatherv", recv.data.nbytes)
        sspec = send.spec()
        buf, _, dtype = recv.spec()
        rspec = [buf, counts, _displacements(counts), dtype]
        run = (lambda: self.mpi.Allgatherv(sspec, rspec)) if blocking else (
            lambda: self.mpi.Iallgatherv(sspec, rspec))
        return self._post(blocking, run, _lander(recv, [send]), (send, recv), [send, recv], back)

    # -------------------------------------------------------- point to point
    def send(self, tensor: Any, dest: int, tag: int = 0) -> None:
        """Send a tensor to ``dest``, blocking until the buffer may be reused.

        Args:
            tensor: The data (a tensor or CuPy/NumPy array).
            dest: The receiving rank.
            tag: The MPI message tag; the receive must use the same.
        """
        t, back = as_torch(tensor)
        wire = self._wire(t, "send", reduction=False)
        self._count("send", wire.data.nbytes)
        spec = wire.spec()
        self._post(True, lambda: self.mpi.Send(spec, dest, tag), _releaser(wire), wire, [wire],
                   back)

    def recv(self, tensor: A, source: int, tag: int = 0) -> A:
        """Receive into ``tensor`` from ``source``, blocking.

        Args:
            tensor: Overwritten with the message; its size must match what was sent.
            source: The sending rank.
            tag: The MPI message tag the sender used.

        Returns:
            ``tensor``.
        """
        t, back = as_torch(tensor)
        wire = self._wire(t, "recv", reduction=False, need_input=False)
        self._count("recv", wire.data.nbytes)
        spec = wire.spec()
        return cast(A, self._post(True, lambda: self.mpi.Recv(spec, source, tag), wire.land,
                                  wire, [wire], back))

    # --------------------------------------------------------------- objects
    def broadcast_object(self, obj: Any, root: int = 0) -> Any:
        """Broadcast a picklable object (small metadata) from ``root`` (collective).

        Args:
            obj: The object at ``root``; ignored elsewhere.
            root: The sending rank.

        Returns:
            ``root``'s object (a copy on the other ranks).
        """
        self._check_root(root)
        payload = pickle.dumps(obj) if self.rank == root else None
        payload = self._blocking(lambda: self.mpi.bcast(payload, root))
        self._count("object", len(payload))
        return pickle.loads(payload) if self.rank != root else obj

    def allgather_object(self, obj: Any) -> list[Any]:
        """Gather one picklable object per rank (collective).

        Args:
            obj: This rank's object (small metadata).

        Returns:
            Every rank's object, ordered by rank.
        """
        mine = pickle.dumps(obj)
        payloads = self._blocking(lambda: self.mpi.allgather(mine))
        self._count("object", sum(len(p) for p in payloads))
        return [pickle.loads(p) for p in payloads]

    def any(self, flag: bool) -> bool:
        """Agree whether ``flag`` is true on at least one rank (collective, an allreduce MAX).

        Args:
            flag: This rank's vote.

        Returns:
            The same answer on every rank.
        """
        value = torch.tensor([1 if flag else 0], dtype=torch.int32, device="cpu")
        return bool(self.allreduce(value, "max").item())

    def agree(self, layout: Any, what: str, *, hint: str = "") -> None:
        """Raise the same ``ValueError`` on every rank unless every rank passed an equal ``layout``.

        Collective. Layouts are compared by the digest of their ``repr``. The guard of fused
        reductions: call it once per message layout (the sizes and dtypes of the buffers a
        structure will post), before MPI sees any of them, so ranks that would post
        different sizes get one clear error instead of a truncation, corrupted memory or a
        hang. Costs one 16-byte allreduce (counted as ``"agree"`` in :attr:`stats`); the
        layouts are gathered only when they differ. Nothing at world size 1.

        Args:
            layout: This rank's layout; its ``repr`` must be deterministic.
            what: What the layout describes, for the message.
            hint: How to fix a disagreement, appended to the message.

        Raises:
            ValueError: On every rank, when any two ranks' layouts differ; names the ranks
                that differ from rank 0.
        """
        if self.size == 1:
            return
        digest = int.from_bytes(hashlib.sha1(repr(layout).encode()).digest()[:8], "little") >> 2
        both = torch.tensor([digest, -digest], dtype=torch.int64, device="cpu")
        self._count("agree", both.nbytes)
        spec = [both.numpy(), MPI.INT64_T]
        self._blocking(lambda: self.mpi.Allreduce(MPI.IN_PLACE, spec, MPI.MAX))
        if int(both[0]) == -int(both[1]):
            return
        everyone = self.allgather_object(layout)
        differing = {r: _short(v) for r, v in enumerate(everyone) if v != everyone[0]}
        raise ValueError(
            f"ranks disagree on {what} (rank 0: {_short(everyone[0])}; other ranks that "
            f"differ: {differing}): they would post reductions of different sizes"
            + (f"; {hint}" if hint else ""))

    # ----------------------------------------------------------------- misc
    def barrier(self) -> None:
        """Block until every rank arrives (collective)."""
        self._count("barrier", 0)
        self._blocking(self.mpi.Barrier)

    def split(self, color: int, key: int | None = None, name: str | None = None) -> Communicator:
        """Make the sub-communicator of the ranks with the same ``color`` (collective).

        Args:
            color: Ranks with equal colors land in one sub-communicator.
            key: Orders the ranks in it (default: the rank here).
            name: The sub-communicator's name (default ``"<name>/split<color>"``).

        Returns:
            The sub-communicator; its traffic counts in this one's :meth:`traffic`.
        """
        mpi_comm = self._blocking(lambda: self.mpi.Split(color, self.rank if key is None else key))
        child = Communicator(mpi_comm, cuda=self.cuda, name=name or f"{self.name}/split{color}")
        return self._adopt(child)

    def _adopt(self, child: Communicator) -> Communicator:
        """Register a sub-communicator for :meth:`traffic` and this communicator's tags.

        Tags opened on this communicator (``stats.tagged``) apply to its calls too.
        """
        child.stats.share_tags_with(self.stats)
        self.children.append(child)
        return child

    def split_shared(self) -> Communicator:
        """Make the sub-communicator of the ranks that share this node's memory (collective).

        Returns:
            The node's communicator; its rank is the local rank.
        """
        mpi_comm = self._blocking(
            lambda: self.mpi.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank))
        child = Communicator(mpi_comm, cuda=self.cuda, name=f"{self.name}/node")
        return self._adopt(child)

    def free(self) -> None:
        """Release a sub-communicator (never the world); posts its queued calls first.

        A second call does nothing (MPI's handle is then ``COMM_NULL``).
        """
        if self.mpi != MPI.COMM_NULL and self.mpi not in (MPI.COMM_WORLD, MPI.COMM_SELF):
            self._flush()
            _forget_queue(self.mpi)
            self.mpi.Free()

    def abort(self, message: str, code: int = 1) -> None:
        """Print ``message`` with this rank's number and abort every rank of the job.

        Args:
            message: What went wrong, printed to standard error.
            code: The exit status of the job.
        """
        import sys

        print(f"[rank {self.rank}] {message}", file=sys.stderr, flush=True)
        MPI.COMM_WORLD.Abort(code)

    @contextlib.contextmanager
    def aborting(self, what: str) -> Iterator[None]:
        """A part no rank may leave alone: an exception inside aborts the job.

        For exchanges whose peers cannot be released once they have begun (a rank that
        stops receiving leaves its senders blocked, and no collective reaches them):
        the error is printed with ``what`` and every rank ends (:meth:`abort`).

        Args:
            what: The exchange, for the message (e.g. ``"checkpoint write"``).
        """
        try:
            yield
        except Exception as exc:
            self.abort(f"{what} failed on this rank ({type(exc).__name__}: {exc}); the other "
                       "ranks wait inside the same exchange and cannot be released, so the "
                       "job ends")
            raise  # where abort returns (a stand-in)

    # --------------------------------------------------------------- checks
    def _op(self, op: str, tensor: torch.Tensor) -> Any:
        if op not in _MPI_OPS:
            raise ValueError(f"unknown reduction op {op!r}; use one of {sorted(_MPI_OPS)}")
        if op == "avg" and not (tensor.is_floating_point() or tensor.is_complex()):
            raise TypeError(f"op='avg' needs a floating-point tensor, got {tensor.dtype}; "
                            "use op='sum' and divide yourself")
        return _MPI_OPS[op]

    def _check_root(self, root: int) -> None:
        if not 0 <= root < self.size:
            raise ValueError(f"root {root} is not a rank of a communicator of size {self.size}")

    def _finisher(self, wire: Wire, op: str,
                  also: Sequence[Wire] = ()) -> Callable[[], torch.Tensor]:
        divide_by = self.size if op == "avg" else 1

        def finish() -> torch.Tensor:
            for other in also:
                other.release()
            return wire.land(divide_by)

        return finish


_Queue = tuple["collections.deque[Handle[Any]]", threading.RLock]
_queues: dict[int, _Queue] = {}
_queues_lock = threading.Lock()


def _queue_of(mpi_comm: MPI.Comm) -> _Queue:
    """The queue of non-blocking calls not yet posted on ``mpi_comm``, and its lock."""
    with _queues_lock:
        key = mpi_comm.py2f()
        if key not in _queues:
            _queues[key] = (collections.deque(), threading.RLock())
        return _queues[key]


def _forget_queue(mpi_comm: MPI.Comm) -> None:
    """Drop a freed communicator's queue (its handle may be reused by a new one)."""
    with _queues_lock:
        _queues.pop(mpi_comm.py2f(), None)


def _releaser(wire: Wire) -> Callable[[], torch.Tensor]:
    """Finish of a call whose result is the caller's own tensor, unchanged."""
    def finish() -> torch.Tensor:
        wire.release()
        return wire.user

    return finish


def _lander(recv: Wire, also: Sequence[Wire]) -> Callable[[], torch.Tensor]:
    def finish() -> torch.Tensor:
        for other in also:
            other.release()
        return recv.land()

    return finish


def _short(value: Any, limit: int = 200) -> str:
    """``repr(value)``, cut to ``limit`` characters for error messages."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _check_same_device(tensor: torch.Tensor, out: torch.Tensor, what: str) -> None:
    if out.device != tensor.device:
        raise ValueError(f"{what}: out is on {out.device} but the tensor is on {tensor.device}; "
                         "pass an out on the same device")
