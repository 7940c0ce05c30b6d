"""The Communicator on CUDA tensors, against NumPy, staged and device-direct.

The matrix: every collective, blocking and non-blocking, x float32/float64/bfloat16/
float16/int64 x contiguous/strided x staged (``cuda_aware=False``) / device-direct
(the vendor's table with the routing rules undone, ``detect(True).unrouted()``, so the
library's own device reductions are checked too; skipped where the library is not
CUDA-aware, where handing it device memory would crash). Inputs are small integers,
exact in every dtype, so sums are compared exactly. On CUDA each case also checks the
route taken: a staged call draws a pinned buffer from the pool, a device-direct one
does not.

``KFAC_HPC_TEST_DEVICE=cpu`` runs the same logic on CPU tensors (the checks of this
file, not of CUDA); CUDA-only tests skip themselves there.
"""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Any

import numpy as np
import pytest
import torch
from shared_cases import direct_or_staged

from kfac_hpc.comm import Communicator, staging
from kfac_hpc.comm.cuda import detect
from kfac_hpc.comm.cupy_compat import external_stream

pytestmark = pytest.mark.gpu
ON_CUDA = os.environ.get("KFAC_HPC_TEST_DEVICE", "cuda") == "cuda"
cuda_only = pytest.mark.skipif(not ON_CUDA, reason="CUDA-only check (KFAC_HPC_TEST_DEVICE)")

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64]
LAYOUTS = ["contiguous", "strided"]
PATHS = ["staged", "device"]
CASES = ["allreduce", "allreduce_avg", "reduce_scatter", "reduce", "broadcast", "allgather",
         "allgatherv"]


def values(rank: int, n: int, salt: int) -> np.ndarray:
    """Integers in [-4, 4]: exact in every dtype, sums too."""
    i = np.arange(n)
    return ((i * 7 + rank * 5 + salt * 3) % 9 - 4).astype(np.float64)


def make(arr: np.ndarray, dtype: torch.dtype, layout: str, device: torch.device) -> torch.Tensor:
    """``arr``'s values as a tensor: contiguous, or a strided view (transposed storage for
    2-D, every other element for 1-D)."""
    if layout == "contiguous":
        return torch.from_numpy(arr.copy()).to(device=device, dtype=dtype)
    if arr.ndim == 2:
        t = torch.from_numpy(arr.T.copy()).to(device=device, dtype=dtype).t()
    else:
        wide = np.zeros(2 * arr.size)
        wide[::2] = arr
        t = torch.from_numpy(wide).to(device=device, dtype=dtype)[::2]
    assert t.numel() <= 1 or not t.is_contiguous()
    return t


def compare(got: torch.Tensor, expected: np.ndarray, dtype: torch.dtype, exact: bool) -> None:
    assert got.dtype == dtype and tuple(got.shape) == expected.shape
    g = got.detach().to(torch.float64).cpu().numpy()
    e = torch.from_numpy(np.ascontiguousarray(expected)).to(dtype).to(torch.float64).numpy()
    if exact:
        np.testing.assert_array_equal(g, e)
    else:
        eps = torch.finfo(dtype).eps
        np.testing.assert_allclose(g, e, rtol=2 * eps, atol=2 * eps)


def uneven(size: int) -> list[int]:
    return [0 if r % 3 == 1 else 3 + r for r in range(size)]


def pool_draws() -> int:
    pool = staging.pinned_pool()
    return pool.allocations + pool.reuses


def run_case(comm: Communicator, case: str, dtype: torch.dtype, layout: str,
             device: torch.device, blocking: bool) -> str:
    """Run one collective and check it; returns the MPI call's name."""
    size, rank, salt = comm.size, comm.rank, CASES.index(case)

    def vals(r: int, n: int) -> np.ndarray:
        return values(r, n, salt)

    def done(handle_or_result):
        return handle_or_result if blocking else handle_or_result.wait()

    prefix = "" if blocking else "i"
    if case in ("allreduce", "allreduce_avg"):
        op = "avg" if case == "allreduce_avg" else "sum"
        x = make(vals(rank, 15).reshape(3, 5), dtype, layout, device)
        out = done(comm.allreduce(x, op) if blocking else comm.iallreduce(x, op))
        ref = sum(vals(r, 15) for r in range(size)).reshape(3, 5)
        assert out is x
        compare(out, ref / size if op == "avg" else ref, dtype, exact=op == "sum")
        return prefix + "allreduce"
    if case == "reduce_scatter":
        counts = uneven(size)
        x = make(vals(rank, sum(counts)), dtype, layout, device)
        out = done(comm.reduce_scatter(x, counts) if blocking else comm.ireduce_scatter(x, counts))
        start = sum(counts[:rank])
        ref = sum(vals(r, sum(counts)) for r in range(size))[start:start + counts[rank]]
        compare(out, ref, dtype, exact=True)
        assert out.device == x.device
        return prefix + "reduce_scatter"
    if case == "reduce":
        root = 1 if size > 1 else 0
        x = make(vals(rank, 15).reshape(3, 5), dtype, layout, device)
        out = done(comm.reduce(x, root) if blocking else comm.ireduce(x, root))
        ref = sum(vals(r, 15) for r in range(size)) if rank == root else vals(rank, 15)
        assert out is x
        compare(out, ref.reshape(3, 5), dtype, exact=True)
        return prefix + "reduce"
    if case == "broadcast":
        root = size - 1
        x = make(vals(rank, 15).reshape(3, 5), dtype, layout, device)
        out = done(comm.broadcast(x, root) if blocking else comm.ibroadcast(x, root))
        assert out is x
        compare(out, vals(root, 15).reshape(3, 5), dtype, exact=True)
        return prefix + "bcast"
    if case == "allgather":
        x = make(vals(rank, 15).reshape(3, 5), dtype, layout, device)
        out = done(comm.allgather(x) if blocking else comm.iallgather(x))
        compare(out, np.stack([vals(r, 15).reshape(3, 5) for r in range(size)]), dtype, True)
        assert out.device == x.device
        return prefix + "allgather"
    assert case == "allgatherv"
    counts = uneven(size)
    x = make(vals(rank, counts[rank]), dtype, layout, device)
    out = done(comm.allgatherv(x, counts) if blocking else comm.iallgatherv(x, counts))
    compare(out, np.concatenate([vals(r, c) for r, c in enumerate(counts)]), dtype, True)
    assert out.device == x.device
    return prefix + "allgatherv"


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "nonblocking"])
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_collective_matrix(device: torch.device, dtype: torch.dtype, layout: str, path: str,
                           blocking: bool) -> None:
    comm = direct_or_staged(path, device)
    for case in CASES:
        if case == "allreduce_avg" and not dtype.is_floating_point:
            continue
        before = pool_draws()
        call = run_case(comm, case, dtype, layout, device, blocking)
        if device.type == "cuda":
            staged = pool_draws() > before
            assert staged == (not comm.cuda.device_ok(call)), (case, call, comm.cuda.summary())
    assert comm.pending() == 0


@cuda_only
@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("case", ["contiguous", "strided", "bfloat16"])
def test_no_pending_work_reaches_mpi(device: torch.device, path: str, case: str) -> None:
    """The input is written by a kernel queued behind a long sleep: MPI must see the
    written values, blocking or not (conversions first, then the event, then MPI)."""
    comm = direct_or_staged(path, device)
    dtype = torch.bfloat16 if case == "bfloat16" else torch.float32
    for blocking in (True, False):
        base = torch.zeros(64, 48, dtype=dtype, device=device)
        torch.cuda.synchronize(device)
        torch.cuda._sleep(int(1e8))  # tens of milliseconds of GPU time on this stream
        base.fill_(comm.rank + 1)  # queued behind the sleep
        x = base.t() if case == "strided" else base
        if blocking:
            out = comm.allreduce(x)
        else:
            handle = comm.iallreduce(x)
            assert not handle.posted  # MPI must not see a buffer the GPU has not written
            out = handle.wait()
        expected = float(sum(r + 1 for r in range(comm.size)))
        assert torch.equal(out.float().cpu(), torch.full(x.shape, expected)), (blocking, path)
        # a broadcast root's values written behind a sleep, too
        y = torch.zeros(1000, dtype=dtype, device=device)
        torch.cuda._sleep(int(1e8))
        y.fill_(comm.rank + 1)
        got = comm.broadcast(y, root=comm.size - 1) if blocking else \
            comm.ibroadcast(y, root=comm.size - 1).wait()
        assert torch.equal(got.float().cpu(), torch.full((1000,), float(comm.size)))


@cuda_only
@pytest.mark.mpi(min_size=1)
def test_staging_buffers_are_pinned_and_reused(device: torch.device) -> None:
    comm = Communicator(cuda_aware=False)
    pool = staging.pinned_pool()
    x = torch.ones(1 << 16, device=device)
    comm.allreduce(x)
    torch.cuda.synchronize(device)  # the host->device copy that used the buffer is done
    reuses = pool.reuses
    comm.iallreduce(x).wait()
    assert pool.reuses > reuses
    buffer = pool.acquire((16,), torch.float32)
    assert buffer.tensor.is_pinned() and buffer.tensor.device.type == "cpu"
    buffer.release()


@cuda_only
@pytest.mark.mpi(min_size=1)
def test_cupy_arrays_zero_copy(device: torch.device) -> None:
    cupy = pytest.importorskip("cupy")
    comm = direct_or_staged("device", device) if detect().aware else Communicator()
    with cupy.cuda.Device(device.index):
        a = cupy.arange(1000, dtype=cupy.float32) + comm.rank
        pointer = a.data.ptr
        out = comm.allreduce(a)
        assert out is a and a.data.ptr == pointer  # in place, no copy of the array
        expected = sum(np.arange(1000, dtype=np.float32) + r for r in range(comm.size))
        np.testing.assert_array_equal(cupy.asnumpy(a), expected)
        # work queued on a CuPy stream (behind a sleep on that stream) is seen by MPI
        torch_stream = torch.cuda.Stream(device)
        with external_stream(cupy, torch_stream):
            b = cupy.zeros(512, dtype=cupy.float64)
            with torch.cuda.stream(torch_stream):
                torch.cuda._sleep(int(1e8))
            b.fill(comm.rank + 1)
            handle = comm.iallreduce(b)
            got = handle.wait()
        assert got is b
        np.testing.assert_array_equal(cupy.asnumpy(b),
                                      np.full(512, sum(r + 1 for r in range(comm.size))))
        part = comm.reduce_scatter(cupy.ones(2 * comm.size, dtype=cupy.float32),
                                   [2] * comm.size)
        assert isinstance(part, cupy.ndarray)
        np.testing.assert_array_equal(cupy.asnumpy(part), np.full(2, comm.size))


@cuda_only
@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("path", PATHS)
def test_earlier_readers_of_a_receive_buffer_see_its_old_values(device: torch.device,
                                                                path: str) -> None:
    """A kernel queued (behind a sleep) to read a receive buffer before the call must read
    the old values: MPI may write device memory only once the work queued before the
    call is done (the direct path's event covers receive buffers too)."""
    comm = direct_or_staged(path, device)
    n, root = 1 << 16, 0
    for blocking in (True, False):
        y = torch.full((n,), -1.0, device=device)
        torch.cuda.synchronize(device)
        torch.cuda._sleep(int(1e8))  # tens of milliseconds of GPU time on this stream
        seen = y.clone()  # reads the old values, behind the sleep
        if comm.rank == root:
            y.fill_(7.0)
        got = comm.broadcast(y, root) if blocking else comm.ibroadcast(y, root).wait()
        assert torch.equal(got.cpu(), torch.full((n,), 7.0)), (path, blocking)
        if comm.rank != root:
            assert torch.equal(seen.cpu(), torch.full((n,), -1.0)), (path, blocking)
        out = torch.full((n,), -1.0, device=device)  # a reduce-scatter's out, read first
        torch.cuda._sleep(int(1e8))
        seen = out.clone()
        src = torch.ones(n * comm.size, device=device)
        got = comm.reduce_scatter(src, [n] * comm.size, out=out) if blocking else \
            comm.ireduce_scatter(src, [n] * comm.size, out=out).wait()
        assert got is out and torch.equal(out.cpu(), torch.full((n,), float(comm.size)))
        assert torch.equal(seen.cpu(), torch.full((n,), -1.0)), (path, blocking)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("path", PATHS)
def test_calls_made_on_another_thread_and_stream_complete_on_the_main_one(
        device: torch.device, path: str) -> None:
    """As a backward hook does: the buffers are written (behind a sleep) on a side stream
    of another thread, the calls made there; the main thread completes them on its own
    stream and reads the results."""
    comm = direct_or_staged(path, device)
    handles: dict[str, Any] = {}

    def hook() -> None:
        side = torch.cuda.Stream(device) if device.type == "cuda" else None
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            if side is not None:
                torch.cuda._sleep(int(1e8))
            x = torch.full((4096,), float(comm.rank + 1), device=device)
            handles["x"] = x
            handles["sum"] = comm.iallreduce(x)
            handles["part"] = comm.ireduce_scatter(torch.ones(8 * comm.size, device=device),
                                                   [8] * comm.size)
            handles["root"] = comm.ibroadcast(x.clone(), root=comm.size - 1)

    worker = threading.Thread(target=hook, name="hook")
    worker.start()
    worker.join()
    total = float(sum(r + 1 for r in range(comm.size)))
    assert handles["sum"].wait() is handles["x"]
    assert torch.equal(handles["x"].cpu(), torch.full((4096,), total))
    part = handles["part"].wait()
    assert part.device == device and torch.equal(part.cpu(), torch.full((8,), float(comm.size)))
    root = handles["root"].wait()
    assert torch.equal(root.cpu(), torch.full((4096,), float(comm.size)))
    assert comm.pending() == 0
