"""``kfac-hpc selfcheck``: every collective against numpy, then a short timing table.

Run it on the ranks to check: ``launch/local -n 4 kfac-hpc selfcheck`` here,
``srun kfac-hpc selfcheck`` on a cluster. Rank 0 prints one PASS/FAIL line per check
(a check passes only if it passed on every rank), the latency and bandwidth of the
:class:`~kfac_hpc.comm.Communicator` for a few sizes, and its traffic counters. The
exit status is 0 only if every check passed on every rank.

Inputs are small integers, a deterministic function of (rank, index, salt), so every
rank computes the expected result of the whole collective with numpy on its own. Sums
are then exact in every dtype checked (the reference is rounded to the dtype, which
covers bfloat16 at any world size); averages must match to the dtype's epsilon.

The timing helpers (:func:`time_calls`, :func:`communicator_op`) are shared with
``benchmarks/comm.py``. Sizes there and here are the bytes of one rank's block: the
vector for allreduce and broadcast, each rank's part of the result for
reduce-scatter (its input is ``size`` blocks), each rank's contribution to allgather.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from mpi4py import MPI

from kfac_hpc.comm.communicator import Communicator, Handle, ReduceOp
from kfac_hpc.comm.cuda import CudaSupport
from kfac_hpc.comm.errors import install_abort_on_error
from kfac_hpc.runtime.device import cuda_on_every_rank, select_local_gpu, synchronizer
from kfac_hpc.units import parse_bytes

CHECK_DTYPES = (torch.float32, torch.float64, torch.bfloat16)
# Shapes for allreduce, reduce, broadcast and allgather: empty, tiny, odd, 2-D, large.
CHECK_SHAPES: tuple[tuple[int, ...], ...] = ((0,), (1,), (7,), (3, 5), (1000,), (65_537,))
# Per-rank block scales for the uneven collectives (see uneven_counts).
UNEVEN_SCALES = (0, 1, 5, 4099)
COLLECTIVES = ("allreduce", "reduce_scatter", "broadcast", "allgather")
DEFAULT_SIZES = (8, 1 << 10, 64 << 10, 1 << 20, 4 << 20)
DEFAULT_REPEAT = 10


# ---------------------------------------------------------------------- data
CPU = torch.device("cpu")


def rank_values(rank: int, n: int, dtype: torch.dtype, salt: int = 0,
                device: torch.device = CPU) -> torch.Tensor:
    """Make rank ``rank``'s ``n`` input values: integers in [-4, 4], exact in every dtype.

    Args:
        rank: The rank whose values these are.
        n: How many values.
        dtype: Their dtype.
        salt: Varies the values between calls of one check.
        device: Where the tensor is made.

    Returns:
        A 1-D tensor of ``n`` values.
    """
    return torch.from_numpy(_values(rank, n, salt)).to(device=device, dtype=dtype)


def _values(rank: int, n: int, salt: int) -> np.ndarray:
    i = np.arange(n, dtype=np.int64)
    return ((i * 7 + rank * 5 + salt * 3) % 9 - 4).astype(np.float64)


def _sum_over_ranks(size: int, n: int, salt: int) -> np.ndarray:
    total = np.zeros(n)
    for r in range(size):
        total += _values(r, n, salt)
    return total


def uneven_counts(size: int, scale: int) -> list[int]:
    """Return element counts per rank, uneven and with zeros: ``[s, 0, s+2, s+3, 0, ...]``.

    Args:
        size: The number of ranks.
        scale: The base count ``s``.

    Returns:
        One count per rank.
    """
    return [0 if r % 3 == 1 else scale + r for r in range(size)]


def _offsets(counts: Sequence[int]) -> list[int]:
    return [sum(counts[:r]) for r in range(len(counts))]


def _compare(got: torch.Tensor, expected: np.ndarray, dtype: torch.dtype,
             exact: bool = True) -> str | None:
    """None when ``got`` equals ``expected`` rounded to ``dtype``; else what differs."""
    if got.dtype != dtype:
        return f"dtype {got.dtype}, expected {dtype}"
    if tuple(got.shape) != expected.shape:
        return f"shape {tuple(got.shape)}, expected {expected.shape}"
    g = got.detach().to(torch.float64).cpu().numpy()
    e = torch.from_numpy(np.ascontiguousarray(expected)).to(dtype).to(torch.float64).numpy()
    if exact:
        bad = g != e
    else:
        eps = torch.finfo(dtype).eps
        bad = ~(np.abs(g - e) <= eps * np.maximum(np.abs(e), 1.0))
    if not bad.any():
        return None
    idx = tuple(int(i) for i in np.argwhere(bad)[0])
    return (f"{int(bad.sum())} of {bad.size} elements wrong; first at {idx}: "
            f"got {g[idx]!r}, expected {e[idx]!r}")


# -------------------------------------------------------------------- checks
CheckFn = Callable[[Communicator, torch.dtype], "str | None"]  # device bound (functools.partial)


class _Findings:
    """The first problem a check finds.

    Checks never stop early: every rank must make the same collective calls, whatever it
    found, or the others would wait forever.
    """

    def __init__(self) -> None:
        self.first: str | None = None

    def note(self, context: str, problem: str | None) -> None:
        """Remember ``problem`` (with its context) if it is the first one."""
        if problem is not None and self.first is None:
            self.first = f"{context}: {problem}"


def check_allreduce(comm: Communicator, dtype: torch.dtype, op: ReduceOp = "sum",
                    device: torch.device = CPU) -> str | None:
    """Check in-place allreduce of every shape, plus a non-contiguous (transposed) tensor.

    Collective: every rank runs it with the same arguments.

    Args:
        comm: The ranks to check.
        dtype: The dtype of the tensors.
        op: The reduction to check.
        device: Where the tensors live.

    Returns:
        The first problem this rank saw, in words, or None.
    """
    found = _Findings()
    cases = [(shape, False) for shape in CHECK_SHAPES] + [((5, 3), True)]
    for salt, (shape, transposed) in enumerate(cases):
        n = int(np.prod(shape))
        stored = shape[::-1] if transposed else shape
        t = rank_values(comm.rank, n, dtype, salt, device=device).reshape(stored)
        if transposed:
            t = t.t()
        out = comm.allreduce(t, op)
        ref = _sum_over_ranks(comm.size, n, salt).reshape(stored)
        if transposed:
            ref = ref.T
        if op == "avg":
            ref = ref / comm.size
        context = f"shape {tuple(t.shape)}{' (transposed)' if transposed else ''}"
        found.note(context, None if out is t else "result is not the (in-place) input tensor")
        found.note(context, _compare(out, ref, dtype, exact=op == "sum"))
    return found.first


def check_reduce_scatter(comm: Communicator, dtype: torch.dtype,
                         device: torch.device = CPU) -> str | None:
    """Check reduce-scatter with uneven counts, zeros included; sum, and avg once.

    Collective: every rank runs it with the same arguments.

    Args:
        comm: The ranks to check.
        dtype: The dtype of the tensors.
        device: Where the tensors live.

    Returns:
        The first problem this rank saw, in words, or None.
    """
    found = _Findings()
    for salt, scale in enumerate(UNEVEN_SCALES):
        counts = uneven_counts(comm.size, scale)
        op: ReduceOp = "avg" if scale == 5 else "sum"
        t = rank_values(comm.rank, sum(counts), dtype, salt, device=device)
        out = comm.reduce_scatter(t, counts, op)
        start = _offsets(counts)[comm.rank]
        ref = _sum_over_ranks(comm.size, sum(counts), salt)[start:start + counts[comm.rank]]
        if op == "avg":
            ref = ref / comm.size
        found.note(f"counts {counts} op {op}", _compare(out, ref, dtype, exact=op == "sum"))
    return found.first


def reduce_root(size: int) -> int:
    """Return the root for reduce: rank 1 (a non-zero root) when there is one."""
    return 1 if size > 1 else 0


def check_reduce(comm: Communicator, dtype: torch.dtype,
                 device: torch.device = CPU) -> str | None:
    """Check reduce onto a non-zero root; the other ranks' tensors stay unchanged.

    Collective: every rank runs it with the same arguments.

    Args:
        comm: The ranks to check.
        dtype: The dtype of the tensors.
        device: Where the tensors live.

    Returns:
        The first problem this rank saw, in words, or None.
    """
    found = _Findings()
    root = reduce_root(comm.size)
    for salt, shape in enumerate(CHECK_SHAPES):
        n = int(np.prod(shape))
        t = rank_values(comm.rank, n, dtype, salt, device=device).reshape(shape)
        out = comm.reduce(t, root)
        ref = _sum_over_ranks(comm.size, n, salt) if comm.rank == root else \
            _values(comm.rank, n, salt)
        found.note(f"shape {shape} root {root}", _compare(out, ref.reshape(shape), dtype))
    return found.first


def check_broadcast(comm: Communicator, dtype: torch.dtype,
                    device: torch.device = CPU) -> str | None:
    """Check that broadcast from the last rank overwrites every rank's tensor.

    Collective: every rank runs it with the same arguments.

    Args:
        comm: The ranks to check.
        dtype: The dtype of the tensors.
        device: Where the tensors live.

    Returns:
        The first problem this rank saw, in words, or None.
    """
    found = _Findings()
    root = comm.size - 1
    for salt, shape in enumerate(CHECK_SHAPES):
        n = int(np.prod(shape))
        t = rank_values(comm.rank, n, dtype, salt, device=device).reshape(shape)
        out = comm.broadcast(t, root)
        context = f"shape {shape} root {root}"
        found.note(context, None if out is t else "result is not the (in-place) input tensor")
        found.note(context, _compare(out, _values(root, n, salt).reshape(shape), dtype))
    return found.first


def check_allgather(comm: Communicator, dtype: torch.dtype,
                    device: torch.device = CPU) -> str | None:
    """Check allgather of equal shapes: result ``(size, *shape)`` ordered by rank.

    Collective: every rank runs it with the same arguments.

    Args:
        comm: The ranks to check.
        dtype: The dtype of the tensors.
        device: Where the tensors live.

    Returns:
        The first problem this rank saw, in words, or None.
    """
    found = _Findings()
    for salt, shape in enumerate(CHECK_SHAPES):
        n = int(np.prod(shape))
        t = rank_values(comm.rank, n, dtype, salt, device=device).reshape(shape)
        out = comm.allgather(t)
        ref = np.stack([_values(r, n, salt).reshape(shape) for r in range(comm.size)])
        found.note(f"shape {shape}", _compare(out, ref, dtype))
    return found.first


def check_allgatherv(comm: Communicator, dtype: torch.dtype,
                     device: torch.device = CPU) -> str | None:
    """Check allgatherv with uneven counts (zeros included), counts given and learned.

    Collective: every rank runs it with the same arguments.

    Args:
        comm: The ranks to check.
        dtype: The dtype of the tensors.
        device: Where the tensors live.

    Returns:
        The first problem this rank saw, in words, or None.
    """
    found = _Findings()
    for salt, scale in enumerate(UNEVEN_SCALES):
        counts = uneven_counts(comm.size, scale)
        given = salt % 2 == 0
        t = rank_values(comm.rank, counts[comm.rank], dtype, salt, device=device)
        out = comm.allgatherv(t, counts if given else None)
        ref = np.concatenate([_values(r, c, salt) for r, c in enumerate(counts)])
        found.note(f"counts {counts} ({'given' if given else 'learned'})",
                   _compare(out, ref, dtype))
    return found.first


def check_nonblocking(comm: Communicator, dtype: torch.dtype,
                      device: torch.device = CPU) -> str | None:
    """Check seven non-blocking collectives in flight at once, completed in reverse order.

    Collective: every rank runs it with the same arguments.

    Args:
        comm: The ranks to check.
        dtype: The dtype of the tensors.
        device: Where the tensors live.

    Returns:
        The first problem this rank saw, in words, or None.
    """
    size, rank, n = comm.size, comm.rank, 1000
    counts = uneven_counts(size, 300)
    root = reduce_root(size)
    total = _sum_over_ranks
    posted: list[tuple[str, Handle[torch.Tensor], np.ndarray, bool]] = []

    def post(name: str, handle: Handle[torch.Tensor], ref: np.ndarray, exact: bool = True) -> None:
        posted.append((name, handle, ref, exact))

    def values(n: int, salt: int) -> torch.Tensor:
        return rank_values(rank, n, dtype, salt, device=device)

    post("iallreduce sum", comm.iallreduce(values(n, 1)), total(size, n, 1))
    post("iallreduce avg", comm.iallreduce(values(n, 2), "avg"),
         total(size, n, 2) / size, exact=False)
    start = _offsets(counts)[rank]
    post("ireduce_scatter", comm.ireduce_scatter(values(sum(counts), 3), counts),
         total(size, sum(counts), 3)[start:start + counts[rank]])
    post("ireduce", comm.ireduce(values(n, 4), root),
         total(size, n, 4) if rank == root else _values(rank, n, 4))
    post("ibroadcast", comm.ibroadcast(values(n, 5), size - 1),
         _values(size - 1, n, 5))
    post("iallgather", comm.iallgather(values(n, 6)),
         np.stack([_values(r, n, 6) for r in range(size)]))
    post("iallgatherv", comm.iallgatherv(values(counts[rank], 7), counts),
         np.concatenate([_values(r, c, 7) for r, c in enumerate(counts)]))
    results = {name: handle.wait() for name, handle, _, _ in reversed(posted)}
    found = _Findings()
    for name, handle, ref, exact in posted:
        same = handle.done and handle.wait() is results[name]
        found.note(name, None if same else "handle not done, or wait() not idempotent")
        found.note(name, _compare(results[name], ref, dtype, exact))
    return found.first


def check_split(comm: Communicator, dtype: torch.dtype,
                device: torch.device = CPU) -> str | None:
    """Check allreduce on sub-communicators of the even and the odd ranks.

    Collective: every rank runs it with the same arguments.

    Args:
        comm: The ranks to check.
        dtype: The dtype of the tensors.
        device: Where the tensors live.

    Returns:
        The first problem this rank saw, in words, or None.
    """
    found = _Findings()
    sub = comm.split(comm.rank % 2, name="selfcheck/parity")
    try:
        members = [r for r in range(comm.size) if r % 2 == comm.rank % 2]
        if sub.size != len(members) or sub.rank != members.index(comm.rank):
            found.note("split", f"rank {sub.rank} of {sub.size}, expected {members}")
        out = sub.allreduce(rank_values(comm.rank, 257, dtype, 8, device=device))
        ref = np.sum([_values(r, 257, 8) for r in members], axis=0)
        found.note(f"ranks {members}", _compare(out, ref, dtype))
    finally:
        sub.free()
    return found.first


def checks(dtypes: Sequence[torch.dtype] = CHECK_DTYPES, size: int = 1,
           device: torch.device = CPU) -> Iterator[tuple[str, torch.dtype, CheckFn]]:
    """List every (name, dtype, check) of the self-check on ``device``, in order.

    Args:
        dtypes: The dtypes to check each collective in.
        size: The number of ranks (which checks apply and how they are set up).
        device: Where the tensors live.

    Yields:
        ``(name, dtype, check)``; ``check(comm)`` runs it.
    """
    root, last = reduce_root(size), size - 1
    on = functools.partial
    for dtype in dtypes:
        yield "allreduce sum", dtype, on(check_allreduce, op="sum", device=device)
        yield "allreduce avg", dtype, on(check_allreduce, op="avg", device=device)
        yield "reduce_scatter uneven+zero counts", dtype, on(check_reduce_scatter, device=device)
        yield f"reduce to root {root}", dtype, on(check_reduce, device=device)
        yield f"broadcast from root {last}", dtype, on(check_broadcast, device=device)
        yield "allgather", dtype, on(check_allgather, device=device)
        yield "allgatherv uneven+zero counts", dtype, on(check_allgatherv, device=device)
        yield "7 non-blocking, waited in reverse", dtype, on(check_nonblocking, device=device)
    yield "allreduce on split sub-communicators", torch.float32, on(check_split, device=device)


@dataclass
class CheckResult:
    """One check's outcome, agreed over all ranks."""

    name: str
    dtype: torch.dtype
    failed_ranks: list[int] = field(default_factory=list)
    detail: str = ""  # the first failing rank's message

    @property
    def ok(self) -> bool:
        """Whether no rank failed."""
        return not self.failed_ranks

    def line(self) -> str:
        """Format the outcome as one line: name, dtype, and the failing ranks with their problem."""
        dtype = str(self.dtype).removeprefix("torch.")
        text = f"{'PASS' if self.ok else 'FAIL'}  {dtype:<9} {self.name}"
        if not self.ok:
            text += f"  [ranks {self.failed_ranks}] {self.detail}"
        return text


def run_one(comm: Communicator, name: str, dtype: torch.dtype, check: CheckFn) -> CheckResult:
    """Run one check on every rank and agree on its outcome (raw mpi4py allgather).

    An exception counts as a failure of that rank. A rank that raises before a collective
    the others entered would leave them waiting: run under a launcher timeout
    (``launch/local --timeout``) on suspect systems.

    Args:
        comm: The ranks to check (collective).
        name: The check's name.
        dtype: The dtype it runs in.
        check: The check.

    Returns:
        The outcome, the same on every rank.
    """
    try:
        detail = check(comm, dtype)
    except Exception as exc:
        detail = f"raised {type(exc).__name__}: {exc}"
    details = comm._blocking(lambda: comm.mpi.allgather(detail))  # after anything queued
    failed = [r for r, d in enumerate(details) if d is not None]
    return CheckResult(name, dtype, failed, details[failed[0]] if failed else "")


def check_traffic_consistent(comm: Communicator) -> CheckResult:
    """Check that the traffic counters are identical on every rank (collective).

    They count whole collectives, so any difference is a counting bug.

    Args:
        comm: The communicator whose counters are compared.

    Returns:
        The outcome, the same on every rank.
    """
    snapshots = comm.mpi.allgather(comm.traffic().snapshot())
    failed = [r for r, s in enumerate(snapshots) if s != snapshots[0]]
    detail = f"rank 0 {snapshots[0]} vs rank {failed[0]} {snapshots[failed[0]]}" if failed else ""
    return CheckResult("traffic counters equal on every rank", torch.float32, failed, detail)


def run_checks(comm: Communicator, dtypes: Sequence[torch.dtype] = CHECK_DTYPES,
               report: Callable[[CheckResult], None] | None = None,
               device: torch.device = CPU, label: str = "") -> list[CheckResult]:
    """Run every check (see :func:`checks`) on ``device`` (collective).

    Args:
        comm: The ranks to check.
        dtypes: The dtypes to check each collective in.
        report: Sees each result as it lands.
        device: Where the tensors live.
        label: Appended to the check names.

    Returns:
        Every outcome, in order, the same on every rank.
    """
    results = []
    for name, dtype, check in checks(dtypes, comm.size, device):
        results.append(run_one(comm, name + label, dtype, check))
        if report is not None:
            report(results[-1])
    results.append(check_traffic_consistent(comm))
    if report is not None:
        report(results[-1])
    return results


# -------------------------------------------------------------------- timing
@dataclass
class Samples:
    """Timing samples of one call: seconds per call, one value per sample."""

    seconds: np.ndarray  # the slowest rank's time per call in each sample
    inner: int  # back-to-back calls per sample

    @property
    def median(self) -> float:
        """The median seconds per call."""
        return float(np.median(self.seconds))


def time_calls(calls: Mapping[str, Callable[[], object]], mpi_comm: MPI.Comm, *, repeat: int,
               sample_s: float = 2e-3, max_inner: int = 64, warmup: int = 1,
               inner_groups: Sequence[Collection[str]] | None = None,
               sync: Callable[[], None] | None = None) -> dict[str, Samples]:
    """Time the seconds per call of each entry of ``calls``: ``repeat`` samples each.

    A sample times a batch of back-to-back calls after a barrier and its value is the
    slowest rank's. A batch lasts about ``sample_s`` (at most ``max_inner`` calls), as
    measured by a few single calls after ``warmup`` calls; the entries of one of
    ``inner_groups`` use the same batch length, the shortest of theirs, so the barrier's
    exit skew weighs on them alike. Samples of the entries are interleaved in an order
    rotated every round (a, b, c; b, c, a; ...), so that drift of a shared machine, and
    what one call leaves behind in caches and progress engines, hit all alike.

    Collective: every rank must pass the same calls in the same order.

    Args:
        calls: Zero-argument calls by name.
        mpi_comm: The MPI communicator for the barriers and the max over ranks.
        repeat: Samples per entry.
        sample_s: The target length of one sample, in seconds.
        max_inner: The most calls in one sample.
        warmup: Calls of each entry before measuring.
        inner_groups: Entries that share a batch length (default: all entries form one
            group).
        sync: Waits for work the calls queue on a device (e.g. the copies back of
            staged GPU buffers); called before every clock read, so a sample counts it.

    Returns:
        The samples of each entry, by name.
    """
    wait = sync if sync is not None else (lambda: None)
    names = list(calls)
    probe = np.empty(len(names))
    for k, fn in enumerate(calls.values()):
        for _ in range(warmup):
            fn()
        wait()
        # the fastest of up to 5 single calls (within sample_s): robust to a hiccup.
        # Times are agreed over ranks, so every rank makes the same number of calls.
        best, spent, tries = float("inf"), 0.0, 0
        while tries < 5 and spent < sample_s:
            mpi_comm.Barrier()
            start = time.perf_counter()
            fn()
            wait()
            took = mpi_comm.allreduce(time.perf_counter() - start, op=MPI.MAX)
            best, spent, tries = min(best, took), spent + took, tries + 1
        probe[k] = best
    inner = {name: int(max(1, min(max_inner, sample_s // max(t, 1e-9))))
             for name, t in zip(names, probe)}
    for group in [names] if inner_groups is None else inner_groups:
        members = [name for name in group if name in inner]
        if members:
            shortest = min(inner[name] for name in members)
            inner.update(dict.fromkeys(members, shortest))
    seconds = {name: np.empty(repeat) for name in names}
    for i in range(repeat):
        for name in names[i % len(names):] + names[:i % len(names)]:
            fn, n = calls[name], inner[name]
            mpi_comm.Barrier()
            start = time.perf_counter()
            for _ in range(n):
                fn()
            wait()
            seconds[name][i] = (time.perf_counter() - start) / n
    for values in seconds.values():
        mpi_comm.Allreduce(MPI.IN_PLACE, values, op=MPI.MAX)
    return {name: Samples(seconds[name], inner[name]) for name in names}


def block_elements(nbytes: int, dtype: torch.dtype = torch.float32) -> int:
    """Count the elements of ``dtype`` in a block of ``nbytes`` (at least one)."""
    return max(1, nbytes // dtype.itemsize)


def communicator_op(comm: Communicator, collective: str, nbytes: int,
                    dtype: torch.dtype = torch.float32,
                    device: torch.device = CPU) -> Callable[[], object]:
    """Make a zero-argument call of one Communicator collective on a block of ``nbytes``.

    Buffers are zeros on ``device``, allocated once (repeated sums stay finite);
    broadcast is from rank 0; reduce-scatter gives every rank an equal block.

    Args:
        comm: The communicator.
        collective: One of :data:`COLLECTIVES`.
        nbytes: The block's size in bytes.
        dtype: The block's dtype.
        device: Where the buffers live.

    Returns:
        The call; every rank must make it together.
    """
    n = block_elements(nbytes, dtype)

    def zeros(*shape: int) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype, device=device)

    if collective == "allreduce":
        t = zeros(n)
        return lambda: comm.allreduce(t)
    if collective == "reduce_scatter":
        t, out, counts = zeros(n * comm.size), zeros(n), [n] * comm.size
        return lambda: comm.reduce_scatter(t, counts, out=out)
    if collective == "broadcast":
        t = zeros(n)
        return lambda: comm.broadcast(t, 0)
    if collective == "allgather":
        t, gathered = zeros(n), zeros(comm.size, n)
        return lambda: comm.allgather(t, out=gathered)
    raise ValueError(f"unknown collective {collective!r}; use one of {COLLECTIVES}")


@dataclass
class Timing:
    """Median seconds per call of one collective at one block size."""

    collective: str
    nbytes: int
    seconds: float

    @property
    def gbps(self) -> float:
        """Block bytes per second, in GB/s."""
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")


def time_collectives(comm: Communicator, sizes: Sequence[int], repeat: int,
                     report: Callable[[str], None] | None = None,
                     device: torch.device = CPU) -> list[Timing]:
    """Time every collective of :data:`COLLECTIVES` at ``sizes`` (collective).

    Args:
        comm: The ranks to time over.
        sizes: Block sizes in bytes.
        repeat: Samples per collective and size.
        report: Sees a line of progress per size.
        device: Where the buffers live.

    Returns:
        The median time per call of each collective at each size.
    """
    out = []
    for nbytes in sizes:
        calls = {c: communicator_op(comm, c, nbytes, device=device) for c in COLLECTIVES}
        samples = time_calls(calls, comm.mpi, repeat=repeat, sync=synchronizer(device))
        out += [Timing(c, nbytes, s.median) for c, s in samples.items()]
        if report is not None:
            report(f"timed {format_bytes(nbytes)}")
    return out


# --------------------------------------------------------------- formatting
def format_bytes(n: float) -> str:
    """Format a byte count as ``8 B``, ``64 KiB``, ``1.5 MiB``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if n == int(n) else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} GiB"  # pragma: no cover


def timing_table(timings: Sequence[Timing]) -> str:
    """Format the timings: rows are sizes; columns each collective's µs per call and GB/s."""
    sizes = sorted({t.nbytes for t in timings})
    names = [c for c in COLLECTIVES if any(t.collective == c for t in timings)]
    by = {(t.collective, t.nbytes): t for t in timings}
    lines = [f"{'size':>9}" + "".join(f"  {c:>20}" for c in names),
             f"{'':>9}" + "".join(f"  {'us':>10}{'GB/s':>10}" for _ in names)]
    for nbytes in sizes:
        cells = [by.get((c, nbytes)) for c in names]
        lines.append(f"{format_bytes(nbytes):>9}" + "".join(
            f"  {t.seconds * 1e6:>10.1f}{t.gbps:>10.3f}" if t else f"  {'-':>20}" for t in cells))
    return "\n".join(lines)


def traffic_table(comm: Communicator) -> str:
    """Format this rank's traffic counters, one line per collective kind."""
    snap = comm.traffic().snapshot()
    if not snap:
        return "  (nothing counted: a world of one rank sends nothing)"
    width = max(len(k) for k in snap)
    return "\n".join(f"  {kind:<{width}}  {v['calls']:>8} calls  {format_bytes(v['bytes']):>12}"
                     for kind, v in sorted(snap.items()))


# ----------------------------------------------------------------------- CLI
def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``kfac-hpc selfcheck`` options to ``parser``.

    Args:
        parser: The subcommand's parser.
    """
    parser.add_argument("--sizes", nargs="+", type=parse_bytes, metavar="SIZE",
                        default=list(DEFAULT_SIZES),
                        help="block sizes to time (bytes; K/M suffixes), default 8 1K 64K 1M 4M")
    parser.add_argument("--repeat", type=int, default=DEFAULT_REPEAT, metavar="N",
                        help=f"timing samples per size (median reported), default "
                             f"{DEFAULT_REPEAT}")
    parser.add_argument("--no-timing", action="store_true", help="checks only, no timing table")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="where the tensors live (cuda: each rank uses the GPU of its local "
                             "rank; checked both staged and device-direct where the MPI library "
                             "takes device memory); skipped with a message without a GPU")


def _ranks_text(ranks: list[int], shown: int = 8) -> str:
    """``0, 1, 2`` (the first ``shown``, then how many more)."""
    more = len(ranks) - shown
    return ", ".join(map(str, ranks[:shown])) + (f" and {more} more" if more > 0 else "")


def run(args: argparse.Namespace) -> int:
    """Check every collective, time them, and print on rank 0 (collective).

    Args:
        args: The parsed options.

    Returns:
        The exit status: 0 only if all ranks passed every check.
    """
    install_abort_on_error()
    torch.set_num_threads(1)
    begin = time.perf_counter()
    comm = Communicator(name="selfcheck")
    lead = comm.rank == 0

    def say(text: str) -> None:
        if lead:
            print(text, flush=True)

    import mpi4py

    library = MPI.Get_library_version().splitlines()[0].split(",")[0].strip()
    say(f"kfac-hpc selfcheck: {comm.size} rank(s); {library}; mpi4py {mpi4py.__version__}; "
        f"torch {torch.__version__}")
    device = CPU
    passes: list[tuple[str, Communicator]] = [("", comm)]
    if getattr(args, "device", "cpu") == "cuda":
        if not cuda_on_every_rank(comm.mpi):
            seeing = [r for r, sees in enumerate(comm.mpi.allgather(torch.cuda.is_available()))
                      if sees]
            if seeing:  # a node's GPU is missing (a fault, a wrong --gpus request): fail
                blind = sorted(set(range(comm.size)) - set(seeing))
                say(f"selfcheck --device cuda: FAILED: rank(s) {_ranks_text(blind)} see no "
                    f"CUDA device while rank(s) {_ranks_text(seeing)} do; check those "
                    "nodes' GPUs and the job's GPU request")
                return 1
            say("selfcheck --device cuda: SKIPPED: no CUDA device visible to any rank "
                f"(torch {torch.__version__}, CUDA build {torch.version.cuda}); run it on GPU "
                "nodes, or without --device to check CPU tensors")
            return 0
        device = select_local_gpu(comm.mpi)
        say(f"device: cuda (GPU of each rank's local rank); {comm.cuda.summary()}")
        staged = Communicator(comm.mpi, cuda=CudaSupport.staged(comm.cuda.vendor, "selfcheck"),
                              name="selfcheck/staged")
        comm._adopt(staged)
        passes = [(" [staged]", staged)] + ([(" [as detected]", comm)] if comm.cuda.aware else [])
    dtypes = ", ".join(str(d).removeprefix("torch.") for d in CHECK_DTYPES)
    say(f"checks ({dtypes}; shapes {[s for s in CHECK_SHAPES]}; uneven scales "
        f"{list(UNEVEN_SCALES)}):")
    results = []
    for label, pass_comm in passes:
        results += run_checks(pass_comm, report=lambda r: say("  " + r.line()), device=device,
                              label=label)
    failed = sum(not r.ok for r in results)

    if not args.no_timing and args.repeat > 0:
        say(f"timing: Communicator, float32 on {device.type}, median of {args.repeat} samples "
            "(slowest rank each); size = one rank's block")
        timings = time_collectives(comm, args.sizes, args.repeat, device=device)
        say(timing_table(timings))
    say("traffic counters (rank 0; the same on every rank):")
    say(traffic_table(comm))

    failed = comm.mpi.allreduce(failed, op=MPI.MAX)  # every rank returns the same status
    elapsed = time.perf_counter() - begin
    if failed:
        say(f"selfcheck: FAILED {failed} of {len(results)} checks on {comm.size} rank(s) "
            f"({elapsed:.1f} s)")
    else:
        say(f"selfcheck: all {len(results)} checks passed on {comm.size} rank(s) "
            f"({elapsed:.1f} s)")
    sys.stdout.flush()
    return 1 if failed else 0
