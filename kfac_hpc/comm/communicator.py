"""MPI collectives on torch tensors.

``Communicator`` is the only object in kfac_hpc that talks to MPI. Every collective
exists in a blocking form (returns the result tensor) and a non-blocking form
(``i``-prefixed, returns a :class:`Handle` whose ``wait()`` returns the result).
Handles keep every buffer alive until completion: mpi4py does not do that for
non-blocking reductions.

In-place semantics follow ``torch.distributed``: allreduce, reduce (at the root)
and broadcast overwrite their tensor; reduce-scatter and gathers return new tensors
(or fill ``out``).
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Generic, Literal, TypeVar, cast

import torch
from mpi4py import MPI

from kfac_hpc.comm.buffers import Wire, detect_cuda_aware, mpi_vendor, to_wire
from kfac_hpc.comm.stats import TrafficStats

ReduceOp = Literal["sum", "avg", "max", "min"]
_MPI_OPS = {"sum": MPI.SUM, "avg": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}

T = TypeVar("T")


class Handle(Generic[T]):
    """A collective in flight. ``wait()`` completes it and returns its result."""

    def __init__(self, request: MPI.Request | None, finish: Callable[[], T], keep: Any) -> None:
        self._request = request
        self._finish = finish
        self._keep = keep  # buffers MPI reads or writes until completion
        self._done = False
        self._result: T | None = None

    def test(self) -> bool:
        """True when the operation has completed (drives MPI progress)."""
        if self._done:
            return True
        return self._request is None or bool(self._request.Test())

    def wait(self) -> T:
        """Complete the operation (idempotent) and return its result."""
        if not self._done:
            if self._request is not None:
                self._request.Wait()
            self._result = self._finish()
            self._done = True
            self._keep = None
        return cast(T, self._result)

    @property
    def done(self) -> bool:
        return self._done


def wait_all(handles: Iterable[Handle[Any]]) -> list[Any]:
    """Wait for every handle, in the order given; return their results."""
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

    A world of one process works without ``mpiexec``. ``cuda_aware`` overrides the
    detection of a CUDA-aware MPI (otherwise: ``KFAC_HPC_CUDA_AWARE``, then the
    library's ``MPIX_Query_cuda_support``).
    """

    def __init__(self, mpi_comm: MPI.Comm | None = None, *, cuda_aware: bool | None = None,
                 name: str = "world") -> None:
        self.mpi: MPI.Comm = mpi_comm if mpi_comm is not None else MPI.COMM_WORLD
        self.rank: int = self.mpi.Get_rank()
        self.size: int = self.mpi.Get_size()
        self.name = name
        self.cuda_aware: bool = detect_cuda_aware(cuda_aware)
        # Open MPI's non-blocking reductions do not take device memory even when CUDA-aware.
        self._nonblocking_reductions_on_device = self.cuda_aware and mpi_vendor() != "Open MPI"
        self.stats = TrafficStats()
        self.children: list[Communicator] = []

    def __repr__(self) -> str:
        return f"Communicator(name={self.name!r}, rank={self.rank}, size={self.size})"

    # ------------------------------------------------------------------ helpers
    def _count(self, kind: str, nbytes: int) -> None:
        if self.size > 1:
            self.stats.record(kind, nbytes)

    def _device_ok(self, reduction: bool, blocking: bool) -> bool:
        if not self.cuda_aware:
            return False
        return blocking or not reduction or self._nonblocking_reductions_on_device

    def _post(self, blocking: bool, run: Callable[[], MPI.Request | None],
              finish: Callable[[], T], keep: Any) -> T | Handle[T]:
        request = run()
        handle: Handle[T] = Handle(request, finish, keep)
        return handle.wait() if blocking else handle

    def traffic(self) -> TrafficStats:
        """Counters of this communicator and every sub-communicator split from it."""
        return TrafficStats.merged([self.stats, *(c.traffic() for c in self.children)])

    def reset_traffic(self) -> None:
        """Reset this communicator's counters and its sub-communicators'."""
        self.stats.reset()
        for c in self.children:
            c.reset_traffic()

    # ------------------------------------------------------------ allreduce
    def allreduce(self, tensor: torch.Tensor, op: ReduceOp = "sum") -> torch.Tensor:
        """Reduce ``tensor`` over all ranks, in place; returns it."""
        return self._allreduce(tensor, op, blocking=True)

    def iallreduce(self, tensor: torch.Tensor, op: ReduceOp = "sum") -> Handle[torch.Tensor]:
        """Non-blocking :meth:`allreduce`."""
        return self._allreduce(tensor, op, blocking=False)

    def _allreduce(self, tensor: torch.Tensor, op: ReduceOp, blocking: bool) -> Any:
        mpi_op = self._op(op, tensor)
        wire = to_wire(tensor, reduction=True, device_ok=self._device_ok(True, blocking))
        self._count("allreduce", wire.data.nbytes)
        spec = wire.spec()
        run = (lambda: self.mpi.Allreduce(MPI.IN_PLACE, spec, mpi_op)) if blocking else (
            lambda: self.mpi.Iallreduce(MPI.IN_PLACE, spec, mpi_op))
        return self._post(blocking, run, self._finisher(wire, op), wire)

    # -------------------------------------------------------- reduce-scatter
    def reduce_scatter(self, tensor: torch.Tensor, counts: Sequence[int], op: ReduceOp = "sum",
                       out: torch.Tensor | None = None) -> torch.Tensor:
        """Reduce the flat ``tensor`` over ranks; rank r receives ``counts[r]`` elements.

        ``tensor`` holds ``sum(counts)`` elements, rank r's part at offset
        ``sum(counts[:r])``. Counts may be uneven and zero.
        """
        return self._reduce_scatter(tensor, counts, op, out, blocking=True)

    def ireduce_scatter(self, tensor: torch.Tensor, counts: Sequence[int], op: ReduceOp = "sum",
                        out: torch.Tensor | None = None) -> Handle[torch.Tensor]:
        """Non-blocking :meth:`reduce_scatter`."""
        return self._reduce_scatter(tensor, counts, op, out, blocking=False)

    def _reduce_scatter(self, tensor: torch.Tensor, counts: Sequence[int], op: ReduceOp,
                        out: torch.Tensor | None, blocking: bool) -> Any:
        mpi_op = self._op(op, tensor)
        counts = _check_counts(counts, self.size, tensor.numel(), "reduce_scatter")
        if out is None:
            out = torch.empty(counts[self.rank], dtype=tensor.dtype, device=tensor.device)
        elif out.numel() != counts[self.rank] or out.dtype != tensor.dtype:
            raise ValueError(f"reduce_scatter: out must hold {counts[self.rank]} elements of "
                             f"{tensor.dtype}, got {out.numel()} of {out.dtype}")
        device_ok = self._device_ok(True, blocking)
        send = to_wire(tensor.reshape(-1), reduction=True, device_ok=device_ok)
        recv = to_wire(out, reduction=True, device_ok=device_ok, need_input=False)
        self._count("reduce_scatter", send.data.nbytes)
        sspec, rspec = send.spec(), recv.spec()
        run = (lambda: self.mpi.Reduce_scatter(sspec, rspec, counts, mpi_op)) if blocking else (
            lambda: self.mpi.Ireduce_scatter(sspec, rspec, counts, mpi_op))
        return self._post(blocking, run, self._finisher(recv, op), (send, recv))

    # ---------------------------------------------------------------- reduce
    def reduce(self, tensor: torch.Tensor, root: int = 0, op: ReduceOp = "sum") -> torch.Tensor:
        """Reduce onto ``root``, in place there; other ranks' tensors are left unchanged."""
        return self._reduce(tensor, root, op, blocking=True)

    def ireduce(self, tensor: torch.Tensor, root: int = 0,
                op: ReduceOp = "sum") -> Handle[torch.Tensor]:
        """Non-blocking :meth:`reduce`."""
        return self._reduce(tensor, root, op, blocking=False)

    def _reduce(self, tensor: torch.Tensor, root: int, op: ReduceOp, blocking: bool) -> Any:
        mpi_op = self._op(op, tensor)
        self._check_root(root)
        wire = to_wire(tensor, reduction=True, device_ok=self._device_ok(True, blocking))
        self._count("reduce", wire.data.nbytes)
        spec = wire.spec()
        send: Any
        recv: Any
        if self.rank == root:
            send, recv = MPI.IN_PLACE, spec
            finish = self._finisher(wire, op)
        else:
            send, recv = spec, None
            finish = lambda: wire.user
        run = (lambda: self.mpi.Reduce(send, recv, mpi_op, root)) if blocking else (
            lambda: self.mpi.Ireduce(send, recv, mpi_op, root))
        return self._post(blocking, run, finish, wire)

    # ------------------------------------------------------------- broadcast
    def broadcast(self, tensor: torch.Tensor, root: int = 0) -> torch.Tensor:
        """Overwrite ``tensor`` on every rank with ``root``'s values; returns it."""
        return self._broadcast(tensor, root, blocking=True)

    def ibroadcast(self, tensor: torch.Tensor, root: int = 0) -> Handle[torch.Tensor]:
        """Non-blocking :meth:`broadcast`."""
        return self._broadcast(tensor, root, blocking=False)

    def _broadcast(self, tensor: torch.Tensor, root: int, blocking: bool) -> Any:
        self._check_root(root)
        wire = to_wire(tensor, reduction=False, device_ok=self._device_ok(False, blocking),
                       need_input=self.rank == root)
        self._count("broadcast", wire.data.nbytes)
        spec = wire.spec()
        run = (lambda: self.mpi.Bcast(spec, root)) if blocking else (
            lambda: self.mpi.Ibcast(spec, root))
        return self._post(blocking, run, wire.land, wire)

    # ------------------------------------------------------------- allgather
    def allgather(self, tensor: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Gather equal-shaped tensors: result has shape ``(size, *tensor.shape)``.

        ``out`` (that shape and dtype) receives the result; reuse it across calls for
        large messages: a fresh multi-MiB result costs page faults on every call.
        """
        return self._allgather(tensor, out, blocking=True)

    def iallgather(self, tensor: torch.Tensor,
                   out: torch.Tensor | None = None) -> Handle[torch.Tensor]:
        """Non-blocking :meth:`allgather`."""
        return self._allgather(tensor, out, blocking=False)

    def _allgather(self, tensor: torch.Tensor, out: torch.Tensor | None, blocking: bool) -> Any:
        shape = (self.size, *tensor.shape)
        if out is None:
            out = torch.empty(shape, dtype=tensor.dtype, device=tensor.device)
        elif tuple(out.shape) != shape or out.dtype != tensor.dtype:
            raise ValueError(f"allgather: out must have shape {shape} and dtype {tensor.dtype}, "
                             f"got {tuple(out.shape)} {out.dtype}")
        device_ok = self._device_ok(False, blocking)
        send = to_wire(tensor, reduction=False, device_ok=device_ok)
        recv = to_wire(out, reduction=False, device_ok=device_ok, need_input=False)
        self._count("allgather", recv.data.nbytes)
        sspec = send.spec()
        buf, _, dtype = recv.spec()
        rspec = [buf, send.data.numel(), dtype]  # mpi4py: count per rank
        run = (lambda: self.mpi.Allgather(sspec, rspec)) if blocking else (
            lambda: self.mpi.Iallgather(sspec, rspec))
        return self._post(blocking, run, recv.land, (send, recv))

    def allgatherv(self, tensor: torch.Tensor, counts: Sequence[int] | None = None,
                   out: torch.Tensor | None = None) -> torch.Tensor:
        """Gather variable-length flat tensors into one 1-D tensor ordered by rank.

        ``counts`` (elements per rank) avoids an extra small allgather to learn them.
        """
        return self._allgatherv(tensor, counts, out, blocking=True)

    def iallgatherv(self, tensor: torch.Tensor, counts: Sequence[int] | None = None,
                    out: torch.Tensor | None = None) -> Handle[torch.Tensor]:
        """Non-blocking :meth:`allgatherv`."""
        return self._allgatherv(tensor, counts, out, blocking=False)

    def _allgatherv(self, tensor: torch.Tensor, counts: Sequence[int] | None,
                    out: torch.Tensor | None, blocking: bool) -> Any:
        if counts is None:
            counts = self.allgather_object(tensor.numel())
        counts = _check_counts(counts, self.size, None, "allgatherv")
        if counts[self.rank] != tensor.numel():
            raise ValueError(f"allgatherv: counts[{self.rank}]={counts[self.rank]} but this rank's "
                             f"tensor has {tensor.numel()} elements")
        total = sum(counts)
        if out is None:
            out = torch.empty(total, dtype=tensor.dtype, device=tensor.device)
        elif out.numel() != total or out.dtype != tensor.dtype:
            raise ValueError(f"allgatherv: out must hold {total} elements of {tensor.dtype}")
        device_ok = self._device_ok(False, blocking)
        send = to_wire(tensor.reshape(-1), reduction=False, device_ok=device_ok)
        recv = to_wire(out, reduction=False, device_ok=device_ok, need_input=False)
        self._count("allgatherv", recv.data.nbytes)
        sspec = send.spec()
        buf, _, dtype = recv.spec()
        rspec = [buf, counts, _displacements(counts), dtype]
        run = (lambda: self.mpi.Allgatherv(sspec, rspec)) if blocking else (
            lambda: self.mpi.Iallgatherv(sspec, rspec))
        return self._post(blocking, run, recv.land, (send, recv))

    # -------------------------------------------------------- point to point
    def send(self, tensor: torch.Tensor, dest: int, tag: int = 0) -> None:
        """Blocking send of a tensor to ``dest``."""
        wire = to_wire(tensor, reduction=False, device_ok=self.cuda_aware)
        self._count("send", wire.data.nbytes)
        self.mpi.Send(wire.spec(), dest, tag)

    def recv(self, tensor: torch.Tensor, source: int, tag: int = 0) -> torch.Tensor:
        """Blocking receive into ``tensor`` from ``source``; returns it."""
        wire = to_wire(tensor, reduction=False, device_ok=self.cuda_aware, need_input=False)
        self._count("recv", wire.data.nbytes)
        self.mpi.Recv(wire.spec(), source, tag)
        return wire.land()

    # --------------------------------------------------------------- objects
    def broadcast_object(self, obj: Any, root: int = 0) -> Any:
        """Broadcast a picklable object (small metadata) from ``root``."""
        self._check_root(root)
        payload = pickle.dumps(obj) if self.rank == root else None
        payload = self.mpi.bcast(payload, root)
        self._count("object", len(payload))
        return pickle.loads(payload) if self.rank != root else obj

    def allgather_object(self, obj: Any) -> list[Any]:
        """Gather one picklable object per rank, ordered by rank."""
        payloads = self.mpi.allgather(pickle.dumps(obj))
        self._count("object", sum(len(p) for p in payloads))
        return [pickle.loads(p) for p in payloads]

    def any(self, flag: bool) -> bool:
        """True on every rank when ``flag`` is true on at least one (allreduce MAX)."""
        value = torch.tensor([1 if flag else 0], dtype=torch.int32)
        return bool(self.allreduce(value, "max").item())

    # ----------------------------------------------------------------- misc
    def barrier(self) -> None:
        """Block until every rank arrives."""
        self._count("barrier", 0)
        self.mpi.Barrier()

    def split(self, color: int, key: int | None = None, name: str | None = None) -> Communicator:
        """Sub-communicator of the ranks with the same ``color`` (ordered by ``key``)."""
        child = Communicator(self.mpi.Split(color, self.rank if key is None else key),
                             cuda_aware=self.cuda_aware,
                             name=name or f"{self.name}/split{color}")
        return self._adopt(child)

    def _adopt(self, child: Communicator) -> Communicator:
        """Register a sub-communicator: its traffic shows in :meth:`traffic`, and tags
        opened on this communicator (``stats.tagged``) apply to its calls too."""
        child.stats.share_tags_with(self.stats)
        self.children.append(child)
        return child

    def split_shared(self) -> Communicator:
        """Sub-communicator of the ranks that share this node's memory (local ranks)."""
        child = Communicator(self.mpi.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank),
                             cuda_aware=self.cuda_aware, name=f"{self.name}/node")
        return self._adopt(child)

    def free(self) -> None:
        """Release a sub-communicator (never the world)."""
        if self.mpi not in (MPI.COMM_WORLD, MPI.COMM_SELF):
            self.mpi.Free()

    def abort(self, message: str, code: int = 1) -> None:
        """Print ``message`` with this rank's number and abort every rank of the job."""
        import sys

        print(f"[rank {self.rank}] {message}", file=sys.stderr, flush=True)
        MPI.COMM_WORLD.Abort(code)

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

    def _finisher(self, wire: Wire, op: str) -> Callable[[], torch.Tensor]:
        size = self.size

        def finish() -> torch.Tensor:
            if op == "avg" and size > 1:
                wire.data.div_(size)
            return wire.land()

        return finish

