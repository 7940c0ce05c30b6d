"""Communicator collectives against numpy references, at 1, 2 and 4 ranks.

Each rank's input is a deterministic function of (rank, seed), so every rank can
compute the expected result of the whole collective with numpy on its own.
"""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest
import torch
from mpi4py import MPI

from kfac_hpc.comm import Communicator, wait_all

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64,
          torch.int32, torch.int64, torch.uint8]
SIZES = [0, 1, 7, 1000]


def rank_data(rank: int, n: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Small integers (exact in every dtype, no overflow when summed over 4 ranks)."""
    g = np.random.default_rng(seed * 100 + rank)
    values = g.integers(0, 8, size=n)
    return torch.tensor(values, dtype=torch.int64).to(dtype)


def all_data(comm: Communicator, n: int, dtype: torch.dtype, seed: int = 0) -> np.ndarray:
    return np.stack([rank_data(r, n, dtype, seed).to(torch.float64).numpy()
                     for r in range(comm.size)])


def as_np(t: torch.Tensor) -> np.ndarray:
    return t.to(torch.float64).numpy()


def mpi(n: int = 1):
    return pytest.mark.mpi(min_size=n)


# ------------------------------------------------------------------ reductions
@mpi()
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("op", ["sum", "max", "min"])
def test_allreduce(comm, dtype, n, op):
    t = rank_data(comm.rank, n, dtype)
    out = comm.allreduce(t, op)
    assert out is t and t.dtype == dtype
    expected = getattr(np, op)(all_data(comm, n, dtype), axis=0)
    np.testing.assert_array_equal(as_np(t), expected)


@mpi()
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_allreduce_avg(comm, dtype):
    t = rank_data(comm.rank, 33, dtype)
    comm.allreduce(t, "avg")
    expected = all_data(comm, 33, dtype).mean(axis=0)
    # the dtype's rounding of the mean (a float32 sum over 3 ranks divided by 3 is not
    # exact: 2 ulps, 2.4e-7 relative)
    tol = {torch.float16: 1e-2, torch.bfloat16: 1e-2, torch.float32: 3e-7}.get(dtype, 1e-12)
    np.testing.assert_allclose(as_np(t), expected, rtol=tol)


@mpi()
def test_avg_on_integers_is_refused(comm):
    with pytest.raises(TypeError, match="floating-point"):
        comm.allreduce(torch.ones(3, dtype=torch.int32), "avg")


@mpi()
def test_unknown_op_is_refused(comm):
    with pytest.raises(ValueError, match="unknown reduction op"):
        comm.allreduce(torch.ones(3), "prod")  # type: ignore[arg-type]


@mpi()
def test_noncontiguous_and_grad_tensors(comm):
    base = torch.arange(12.0).reshape(3, 4) + comm.rank
    view = base.t()  # non-contiguous
    comm.allreduce(view, "sum")
    expected = sum(torch.arange(12.0).reshape(3, 4) + r for r in range(comm.size))
    torch.testing.assert_close(base, expected)
    p = torch.nn.Parameter(torch.full((5,), float(comm.rank + 1)))
    comm.allreduce(p, "sum")
    assert p.requires_grad
    torch.testing.assert_close(p.detach(), torch.full((5,), float(sum(range(1, comm.size + 1)))))


def counts_for(size: int, case: str) -> list[int]:
    if case == "even":
        return [5] * size
    if case == "uneven":
        return [r * 3 + 1 for r in range(size)]
    return [0 if r % 2 == 0 else 4 for r in range(size)]  # zero-length parts


@mpi()
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", ["even", "uneven", "zeros"])
@pytest.mark.parametrize("op", ["sum", "max"])
def test_reduce_scatter(comm, dtype, case, op):
    counts = counts_for(comm.size, case)
    total = sum(counts)
    t = rank_data(comm.rank, total, dtype, seed=1)
    out = comm.reduce_scatter(t, counts, op)
    full = getattr(np, op)(all_data(comm, total, dtype, seed=1), axis=0)
    start = sum(counts[:comm.rank])
    assert out.dtype == dtype and out.numel() == counts[comm.rank]
    np.testing.assert_array_equal(as_np(out), full[start:start + counts[comm.rank]])


@mpi()
def test_reduce_scatter_bad_counts(comm):
    with pytest.raises(ValueError, match="counts sum to"):
        comm.reduce_scatter(torch.ones(3), [4] * comm.size)
    with pytest.raises(ValueError, match="counts for a communicator"):
        comm.reduce_scatter(torch.ones(3), [1, 1, 1, 0, 0][: comm.size + 1])


@mpi()
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int64])
def test_reduce_to_every_root(comm, dtype):
    for root in range(comm.size):
        t = rank_data(comm.rank, 9, dtype, seed=root)
        before = t.clone()
        comm.reduce(t, root=root, op="sum")
        if comm.rank == root:
            np.testing.assert_array_equal(as_np(t), all_data(comm, 9, dtype, seed=root).sum(0))
        else:
            assert torch.equal(t, before)


@mpi()
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES)
def test_broadcast_from_every_root(comm, dtype, n):
    for root in range(comm.size):
        t = rank_data(comm.rank, n, dtype, seed=3)
        comm.broadcast(t, root=root)
        np.testing.assert_array_equal(as_np(t), as_np(rank_data(root, n, dtype, seed=3)))


@mpi()
def test_broadcast_bf16_is_bit_exact(comm):
    values = torch.randn(64, generator=torch.Generator().manual_seed(comm.rank)).bfloat16()
    comm.broadcast(values, root=comm.size - 1)
    expected = torch.randn(64, generator=torch.Generator().manual_seed(comm.size - 1)).bfloat16()
    assert torch.equal(values.view(torch.int16), expected.view(torch.int16))


@mpi()
def test_bad_root(comm):
    with pytest.raises(ValueError, match="is not a rank"):
        comm.broadcast(torch.ones(2), root=comm.size)


@mpi()
@pytest.mark.parametrize("dtype", DTYPES)
def test_allgather(comm, dtype):
    t = rank_data(comm.rank, 6, dtype, seed=4).reshape(2, 3)
    out = comm.allgather(t)
    assert out.shape == (comm.size, 2, 3)
    np.testing.assert_array_equal(as_np(out).reshape(comm.size, 6), all_data(comm, 6, dtype, 4))
    given = torch.full((comm.size, 2, 3), 7, dtype=dtype)  # a caller's reused buffer
    assert comm.allgather(t, out=given) is given
    np.testing.assert_array_equal(as_np(given).reshape(comm.size, 6), all_data(comm, 6, dtype, 4))


@mpi()
def test_allgather_refuses_a_wrong_out(comm):
    with pytest.raises(ValueError, match=r"allgather: out must have shape \(\d+, 3\)"):
        comm.allgather(torch.ones(3), out=torch.empty(comm.size + 1, 3))


@mpi()
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("given_counts", [True, False])
def test_allgatherv(comm, dtype, given_counts):
    counts = counts_for(comm.size, "zeros" if dtype == torch.uint8 else "uneven")
    mine = rank_data(comm.rank, counts[comm.rank], dtype, seed=5)
    out = comm.allgatherv(mine, counts if given_counts else None)
    expected = np.concatenate([as_np(rank_data(r, counts[r], dtype, seed=5))
                               for r in range(comm.size)])
    np.testing.assert_array_equal(as_np(out), expected)


@mpi()
def test_objects_and_any(comm):
    assert comm.broadcast_object({"a": comm.rank}, root=0) == {"a": 0}
    assert comm.allgather_object(comm.rank * 2) == [2 * r for r in range(comm.size)]
    assert comm.any(comm.rank == comm.size - 1) is True
    assert comm.any(False) is False


# ----------------------------------------------------------- non-blocking
@mpi()
def test_nonblocking_out_of_order(comm):
    """Several operations in flight, completed in reverse order of posting."""
    n = 4096
    a = rank_data(comm.rank, n, torch.float32, seed=6)
    b = rank_data(comm.rank, n, torch.float64, seed=7)
    counts = counts_for(comm.size, "uneven")
    c = rank_data(comm.rank, sum(counts), torch.float32, seed=8)
    d = rank_data(comm.rank, 10, torch.int64, seed=9)
    e = rank_data(comm.rank, counts[comm.rank], torch.float32, seed=10)
    handles = [
        comm.iallreduce(a, "sum"),
        comm.iallreduce(b, "avg"),
        comm.ireduce_scatter(c, counts, "sum"),
        comm.ibroadcast(d, root=comm.size - 1),
        comm.iallgatherv(e, counts),
    ]
    # The caller drops its own references: the handles must keep the buffers alive.
    del c, e
    results = wait_all(reversed(handles))[::-1]
    np.testing.assert_array_equal(as_np(results[0]), all_data(comm, n, torch.float32, 6).sum(0))
    np.testing.assert_allclose(as_np(results[1]), all_data(comm, n, torch.float64, 7).mean(0))
    start = sum(counts[: comm.rank])
    full = all_data(comm, sum(counts), torch.float32, 8).sum(0)
    np.testing.assert_array_equal(as_np(results[2]), full[start:start + counts[comm.rank]])
    np.testing.assert_array_equal(as_np(results[3]),
                                  as_np(rank_data(comm.size - 1, 10, torch.int64, 9)))
    np.testing.assert_array_equal(
        as_np(results[4]),
        np.concatenate([as_np(rank_data(r, counts[r], torch.float32, 10))
                        for r in range(comm.size)]))
    assert all(h.done for h in handles)
    assert handles[0].wait() is results[0]  # idempotent


@mpi()
def test_nonblocking_bf16_and_noncontiguous(comm):
    t = (torch.arange(8.0).reshape(2, 4) + comm.rank).bfloat16()
    view = t.t()
    h = comm.iallreduce(view, "sum")
    h.wait()
    expected = sum(torch.arange(8.0).reshape(2, 4) + r for r in range(comm.size))
    torch.testing.assert_close(t.float(), expected)


@mpi()
def test_handle_test_polls(comm):
    t = torch.ones(10)
    h = comm.iallreduce(t)
    while not h.test():
        pass
    assert torch.equal(h.wait(), torch.full((10,), float(comm.size)))


# ---------------------------------------------------------- sub-communicators
@mpi(2)
def test_split_subcommunicators(comm):
    color = comm.rank % 2
    sub = comm.split(color)
    members = [r for r in range(comm.size) if r % 2 == color]
    assert sub.size == len(members) and sub.rank == members.index(comm.rank)
    t = torch.tensor([float(comm.rank)])
    sub.allreduce(t)
    assert t.item() == float(sum(members))
    root_world = members[-1]
    x = torch.tensor([float(comm.rank)])
    sub.broadcast(x, root=sub.size - 1)
    assert x.item() == float(root_world)
    # traffic of sub-communicators is visible from the parent
    assert comm.traffic().calls_of("allreduce") == sub.stats.calls_of("allreduce")
    sub.free()


def test_a_message_past_mpis_int_counts_is_refused_clearly(monkeypatch) -> None:
    """Below MPI 4 a count is a C int: a larger message is one clear error naming the
    fixes, not MPI_ERR_ARG (checked with the bound lowered: no 2**31-element tensor)."""
    from kfac_hpc.comm import buffers

    monkeypatch.setattr(buffers, "MAX_COUNT", 10)
    comm = Communicator()
    with pytest.raises(ValueError, match="more than this MPI library can send in one call"):
        comm.allreduce(torch.ones(11))
    comm.allreduce(torch.ones(10))


@mpi(2)
def test_a_failed_post_is_raised_by_its_own_wait(monkeypatch) -> None:
    """Two calls queued behind unfinished device work; the first one's post fails (a
    bitwise AND of floats: MPI refuses the op; bool sums, used here before, are refused
    before any post now). The second's wait gives its own result, and the first's wait
    raises its error every time (it returned the unreduced input, as if done, on the
    second try)."""
    comm = Communicator()

    class NotYet:  # a CUDA event whose work has not completed
        done = False

        def query(self) -> bool:
            return NotYet.done

        def synchronize(self) -> None:
            NotYet.done = True

    wire = Communicator._wire

    def pending(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        w = wire(self, *args, **kwargs)
        w.ready = NotYet()
        return w

    monkeypatch.setattr(Communicator, "_wire", pending)
    op = Communicator._op
    monkeypatch.setattr(Communicator, "_op", lambda self, name, tensor: (
        MPI.BAND if name == "max" else op(self, name, tensor)))
    bad = comm.iallreduce(torch.tensor([1.0, 2.0]), "max")
    good = comm.iallreduce(torch.tensor([1.0 + comm.rank]), "sum")
    assert float(good.wait()) == sum(1.0 + r for r in range(comm.size))
    for _ in range(2):
        with pytest.raises(Exception, match="MPI_ERR_OP"):
            bad.wait()


def test_fused_messages_keep_every_value() -> None:
    """A message of float32 and float64 tensors travels in float64; integers fused with
    floating-point tensors (or integers of two widths) are refused, not rounded."""
    from kfac_hpc.comm import flatten

    mixed = flatten([torch.ones(2), torch.full((1,), 1 + 1e-12, dtype=torch.float64)])
    assert mixed.dtype == torch.float64 and float(mixed[2]) == 1 + 1e-12
    with pytest.raises(ValueError, match="without losing values"):
        flatten([torch.ones(2), torch.tensor([2**40 + 1], dtype=torch.int64)])


@mpi()
def test_float16_reductions_add_in_float32() -> None:
    """A float16 sum or average over the ranks is the float32 one rounded once: no
    overflow of partial sums past 65504 (an average of 30000 over three ranks was inf),
    no rounding of each partial sum (2048 + 1 + 1 lost both ones)."""
    comm = Communicator()
    big = torch.full((4,), 30000.0, dtype=torch.float16)
    comm.allreduce(big, op="avg")
    assert torch.equal(big, torch.full((4,), 30000.0, dtype=torch.float16))
    small = torch.tensor([2048.0 if comm.rank == 0 else 1.0], dtype=torch.float16)
    comm.allreduce(small)
    # the float32 sum rounded once (at 3 ranks 2050; float16 partial sums gave 2048)
    assert torch.equal(small, torch.tensor([2048.0 + comm.size - 1]).half())


# ------------------------------------------------------------ traffic counters
@mpi(2)
def test_traffic_counters_exact(comm):
    comm.reset_traffic()
    comm.allreduce(torch.ones(10, dtype=torch.float32))            # 40 B
    comm.allreduce(torch.ones(10, dtype=torch.bfloat16))           # widened: 40 B
    comm.broadcast(torch.ones(3, dtype=torch.float64), root=0)     # 24 B
    counts = [2] * comm.size
    comm.reduce_scatter(torch.ones(2 * comm.size, dtype=torch.float16), counts)  # 8*size B
    half = 4  # a reduction widens float16 to float32 (a sum in float16 overflows, rounds)
    comm.allgatherv(torch.ones(2, dtype=torch.int64), counts)      # 16*size B
    comm.iallreduce(torch.ones(5, dtype=torch.float64)).wait()     # 40 B
    s = comm.stats
    assert s.calls_of("allreduce") == 3 and s.bytes_of("allreduce") == 40 + 40 + 40
    assert s.bytes_of("broadcast") == 24
    assert s.bytes_of("reduce_scatter") == 2 * half * comm.size
    assert s.bytes_of("allgatherv") == 16 * comm.size
    assert s.total_bytes == 120 + 24 + (2 * half + 16) * comm.size
    with s.tagged("phase"):
        comm.allreduce(torch.ones(4))
    assert s.tag_bytes("phase") == 16
    comm.reset_traffic()
    assert s.total_bytes == 0 and s.total_calls == 0


def test_single_rank_counts_nothing():
    comm = Communicator()
    if comm.size != 1:
        pytest.skip("serial test")
    t = torch.arange(4.0)
    comm.allreduce(t, "avg")
    assert torch.equal(t, torch.arange(4.0))
    assert comm.reduce_scatter(torch.arange(3.0), [3]).tolist() == [0.0, 1.0, 2.0]
    assert comm.stats.total_calls == 0


def test_unsupported_dtype_is_refused():
    comm = Communicator()
    with pytest.raises(TypeError, match="cannot travel over MPI"):
        comm.allreduce(torch.ones(2, dtype=torch.complex64))
    # bool moves (a broadcast), but is never reduced: MPI has no sum of C_BOOL (an
    # MPI_ERR_OP from inside MPI before, on every rank that got that far)
    with pytest.raises(TypeError, match="bool tensor cannot be reduced"):
        comm.allreduce(torch.ones(2, dtype=torch.bool))
    flags = torch.tensor([True, False])
    assert torch.equal(comm.broadcast(flags.clone()), flags)


def test_numpy_and_cupy_adapter():
    from kfac_hpc.comm.buffers import as_torch

    a = np.arange(3.0)
    t, back = as_torch(a)
    t += 1
    np.testing.assert_array_equal(back(t), [1.0, 2.0, 3.0])
    np.testing.assert_array_equal(a, [1.0, 2.0, 3.0])  # zero-copy
    with pytest.raises(TypeError, match="expected a torch tensor"):
        as_torch([1, 2])


# --------------------------------------------------------------------- GPU
@pytest.mark.gpu
@mpi()
@pytest.mark.parametrize("aware", [False, True])
def test_cuda_tensors(aware):
    from kfac_hpc.comm.cuda import CUDA_AWARE_ENV, detect

    found = detect(env={k: v for k, v in os.environ.items() if k != CUDA_AWARE_ENV})
    if aware and not found.aware:  # device memory would crash a library that refuses it
        pytest.skip(f"the MPI library is not CUDA-aware here: {found.summary()}")
    comm = Communicator(cuda_aware=aware)
    dev = torch.device("cuda", 0)
    t = torch.arange(16.0, device=dev) + comm.rank
    comm.allreduce(t, "sum")
    expected = sum(torch.arange(16.0) + r for r in range(comm.size))
    torch.testing.assert_close(t.cpu(), expected)
    h = comm.iallreduce(torch.ones(8, device=dev, dtype=torch.bfloat16), "avg")
    assert h.wait().device.type == "cuda"
    counts = [3] * comm.size
    out = comm.reduce_scatter(torch.ones(3 * comm.size, device=dev), counts)
    assert out.device.type == "cuda" and torch.all(out.cpu() == comm.size)


@mpi(2)
def test_tags_reach_subcommunicators_and_nest_once(comm):
    sub = comm.split(comm.rank % 2)
    comm.reset_traffic()
    with comm.stats.tagged("phase"), comm.stats.tagged("phase"):
        sub.allreduce(torch.ones(3))
        comm.allreduce(torch.ones(2))
    total = comm.traffic()
    assert total.tag_bytes("phase") == (12 if sub.size > 1 else 0) + 8
    assert comm.stats.tag_bytes("phase") == 8  # counted once although opened twice
    sub.free()
    sub.free()  # a second release does nothing (MPI raised on the freed handle before)


# --------------------------------------------- device hygiene (the CPU stand-in)
@mpi()
def test_collectives_name_the_device_of_every_tensor_they_make(comm, meta_default_device):
    """Under a ``meta`` default device, every tensor the Communicator makes for itself
    (results, widened and contiguous copies, any()'s flag) must still be on the CPU."""
    size, rank, n = comm.size, comm.rank, 10
    counts = counts_for(size, "zeros")
    inputs = {
        "avg": rank_data(rank, n, torch.float32),
        "bf16": rank_data(rank, n, torch.bfloat16, 1),
        "strided": rank_data(rank, 12, torch.float64, 2).reshape(3, 4),
        "rs": rank_data(rank, sum(counts), torch.float32, 3),
        "ag": rank_data(rank, 6, torch.int64, 4).reshape(2, 3),
        "agv": rank_data(rank, counts[rank], torch.bfloat16, 5),
        "bcast": rank_data(rank, 5, torch.bfloat16, 6).t(),
        "nb": rank_data(rank, n, torch.float16, 7),
        "nbrs": rank_data(rank, sum(counts), torch.bfloat16, 8),
    }
    expect = {
        "avg": all_data(comm, n, torch.float32).mean(0),
        "bf16": all_data(comm, n, torch.bfloat16, 1).sum(0),
        "strided": all_data(comm, 12, torch.float64, 2).max(0).reshape(3, 4).T,
        "rs": all_data(comm, sum(counts), torch.float32, 3).sum(0),
        "ag": all_data(comm, 6, torch.int64, 4).reshape(size, 2, 3),
        "agv": np.concatenate([as_np(rank_data(r, counts[r], torch.bfloat16, 5))
                               for r in range(size)]),
        "bcast": as_np(rank_data(size - 1, 5, torch.bfloat16, 6)),
        "nb": all_data(comm, n, torch.float16, 7).sum(0),
        "nbrs": all_data(comm, sum(counts), torch.bfloat16, 8).sum(0),
    }
    start = sum(counts[:rank])
    mine = slice(start, start + counts[rank])
    meta_default_device()
    results = {
        "avg": comm.allreduce(inputs["avg"], "avg"),
        "bf16": comm.allreduce(inputs["bf16"], "sum"),
        "strided": comm.allreduce(inputs["strided"].t(), "max"),
        "rs": comm.reduce_scatter(inputs["rs"], counts),
        "ag": comm.allgather(inputs["ag"]),
        "agv": comm.allgatherv(inputs["agv"]),  # counts learned: an object allgather
        "bcast": comm.broadcast(inputs["bcast"], root=size - 1),
    }
    flags = (comm.any(rank == size - 1), comm.any(False))
    handles = {"nb": comm.iallreduce(inputs["nb"]),
               "nbrs": comm.ireduce_scatter(inputs["nbrs"], counts)}
    results.update({k: h.wait() for k, h in handles.items()})
    reduced = comm.reduce(inputs["avg"].clone(), root=0)
    assert flags == (True, False)
    for key, out in [*results.items(), ("reduced", reduced)]:
        assert out.device.type == "cpu", key
    np.testing.assert_allclose(as_np(results["avg"]), expect["avg"], rtol=1e-6)
    for key in ("bf16", "strided", "ag", "agv", "bcast", "nb"):
        np.testing.assert_array_equal(as_np(results[key]), expect[key], err_msg=key)
    np.testing.assert_array_equal(as_np(results["rs"]), expect["rs"][mine])
    np.testing.assert_array_equal(as_np(results["nbrs"]), expect["nbrs"][mine])


@mpi(4)
def test_subcommunicators_under_the_meta_stand_in(comm, meta_default_device):
    """Pairs of ranks: split, reduce-scatter with a zero count, any() per pair."""
    pair = [comm.rank - comm.rank % 2, comm.rank - comm.rank % 2 + 1]
    data = rank_data(comm.rank, 5, torch.float32, 9)
    expected = sum(as_np(rank_data(r, 5, torch.float32, 9)) for r in pair if r < comm.size)
    meta_default_device()
    sub = comm.split(comm.rank // 2)
    try:
        counts = [5, 0] if sub.size == 2 else [5]
        out = sub.reduce_scatter(data, counts)
        assert out.device.type == "cpu" and out.numel() == counts[sub.rank]
        if sub.rank == 0:
            np.testing.assert_array_equal(as_np(out), expected)
        assert sub.any(sub.rank == 1) is (sub.size == 2)
    finally:
        sub.free()


def test_meta_tensors_are_refused_clearly():
    from kfac_hpc.comm.buffers import to_wire

    with pytest.raises(ValueError, match="device 'meta' has no memory"):
        to_wire(torch.empty(3, device="meta"), reduction=True, device_ok=False)


# ------------------------------------------------------- NumPy through collectives
@mpi()
def test_numpy_arrays_through_the_collectives(comm):
    a = as_np(rank_data(comm.rank, 6, torch.float64))
    assert comm.allreduce(a, "sum") is a  # in place, the same array back
    np.testing.assert_array_equal(a, all_data(comm, 6, torch.float64).sum(0))
    counts = [2] * comm.size
    part = comm.reduce_scatter(np.ones(2 * comm.size), counts)
    assert isinstance(part, np.ndarray) and part.tolist() == [float(comm.size)] * 2
    gathered = comm.iallgather(np.full(3, comm.rank, dtype=np.int64)).wait()
    assert isinstance(gathered, np.ndarray)
    assert gathered.tolist() == [[r] * 3 for r in range(comm.size)]
    out = np.zeros(comm.size * 2)
    assert comm.allgatherv(np.full(2, float(comm.rank)), counts, out=out) is out
    np.testing.assert_array_equal(out, np.repeat(np.arange(comm.size, dtype=float), 2))


# -------------------------------------- non-blocking calls that wait for device work
class FakeEvent:
    """A CUDA event stand-in: the producing work is done when ``done`` is set."""

    def __init__(self, done: bool = False) -> None:
        self.done, self.synchronized = done, 0

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.synchronized += 1
        self.done = True


def events_for_next_wires(comm, monkeypatch, events):
    """The next wires ``comm`` makes carry ``events`` (as if their data were on a GPU)."""
    queue = list(events)
    original = comm._wire

    def wire(*args, **kwargs):
        w = original(*args, **kwargs)
        if queue:
            w.ready = queue.pop(0)
        return w

    monkeypatch.setattr(comm, "_wire", wire)


@mpi()
def test_pending_handles_post_in_call_order(comm, monkeypatch):
    first = FakeEvent()
    events_for_next_wires(comm, monkeypatch, [first])
    a, b = torch.ones(5), torch.full((7,), 2.0)
    h1 = comm.iallreduce(a)  # its data is "still being produced"
    h2 = comm.iallreduce(b)  # ready, but must not overtake h1
    assert comm.pending() == 2 and not h1.posted and not h2.posted
    assert not h2.test() and not h1.posted and not h2.posted
    first.done = True
    h2.test()  # posts h1, then h2
    assert h1.posted and h2.posted and comm.pending() == 0 and first.synchronized == 0
    assert torch.equal(h2.wait(), torch.full((7,), 2.0 * comm.size))
    assert torch.equal(h1.wait(), torch.full((5,), float(comm.size)))


@mpi()
def test_order_is_kept_across_communicator_objects(comm, monkeypatch):
    """Two Communicator objects over one MPI communicator share one call order."""
    other = Communicator()
    late = FakeEvent(done=comm.rank != 0)
    events_for_next_wires(comm, monkeypatch, [late])
    h1 = comm.iallreduce(torch.ones(5))
    h2 = other.iallreduce(torch.ones(9, dtype=torch.float64))
    if comm.rank == 0:
        assert not h2.test() and not h2.posted
        late.done = True
    assert torch.equal(h2.wait(), torch.full((9,), float(comm.size), dtype=torch.float64))
    assert torch.equal(h1.wait(), torch.full((5,), float(comm.size)))
    sub = comm.split(0)
    assert sub.pending() == 0 and sub._pending is not comm._pending
    sub.free()


@mpi()
def test_wait_and_blocking_calls_wait_for_device_work(comm, monkeypatch):
    first, second = FakeEvent(), FakeEvent()
    events_for_next_wires(comm, monkeypatch, [first, second])
    h = comm.iallreduce(torch.ones(3))
    comm.allreduce(torch.ones(2))  # blocking: posts the queued call first, then its own
    assert h.posted and first.synchronized == 1 and second.synchronized == 1
    assert torch.equal(h.wait(), torch.full((3,), float(comm.size)))
    third = FakeEvent()
    events_for_next_wires(comm, monkeypatch, [third])
    h = comm.ibroadcast(torch.full((4,), float(comm.rank)), root=0)
    assert torch.equal(h.wait(), torch.zeros(4)) and third.synchronized == 1


@mpi(2)
def test_late_device_work_on_one_rank_keeps_the_order(comm, monkeypatch):
    """Rank 0's first call waits for its (fake) GPU; every other rank posts at once.
    Calls of different sizes would be mismatched if rank 0 posted out of order."""
    late = FakeEvent(done=comm.rank != 0)
    events_for_next_wires(comm, monkeypatch, [late])
    h1 = comm.iallreduce(torch.ones(5))
    h2 = comm.iallgatherv(torch.full((comm.rank + 1,), float(comm.rank)),
                          [r + 1 for r in range(comm.size)])
    h3 = comm.ireduce_scatter(torch.ones(2 * comm.size), [2] * comm.size)
    if comm.rank == 0:
        for _ in range(50):
            assert not h3.test() and not h2.posted
        late.done = True
    assert torch.equal(h3.wait(), torch.full((2,), float(comm.size)))
    assert h2.wait().tolist() == [float(r) for r in range(comm.size) for _ in range(r + 1)]
    assert torch.equal(h1.wait(), torch.full((5,), float(comm.size)))


# ------------------------------------------------------------------- threads
@mpi()
def test_calls_from_another_thread_need_a_thread_level(monkeypatch):
    from mpi4py import MPI

    from kfac_hpc.comm import threads

    comm = Communicator()
    errors: list[BaseException] = []

    def post(level: int, out: list) -> None:
        monkeypatch.setattr(threads, "provided_level", lambda: level)
        try:
            out.append(comm.iallreduce(torch.ones(4)))
        except BaseException as exc:  # reported below
            errors.append(exc)

    worker = threading.Thread(target=post, args=(MPI.THREAD_FUNNELED, []), name="hook")
    worker.start()
    worker.join()
    assert len(errors) == 1 and isinstance(errors[0], threads.ThreadLevelError)
    assert "thread 'hook'" in str(errors[0]) and "MPI_THREAD_SERIALIZED" in str(errors[0])
    assert comm.pending() == 0  # the refused call is not left to be posted later

    comm = Communicator()  # SERIALIZED: calls from the hook thread, serialised by a lock
    handles: list = []
    worker = threading.Thread(target=post, args=(MPI.THREAD_SERIALIZED, handles))
    worker.start()
    worker.join()
    assert len(errors) == 1 and len(handles) == 1
    assert torch.equal(handles[0].wait(), torch.full((4,), float(comm.size)))


# ------------------------------------------------------------- pinned staging pool
def test_pinned_pool_reuses_buffers_after_their_copies():
    from kfac_hpc.comm.staging import PinnedPool, size_class

    assert [size_class(n) for n in (0, 1, 512, 513, 4096, 5000)] == \
        [512, 512, 512, 1024, 4096, 8192]
    pool = PinnedPool(max_cached_bytes=4096,
                      allocate=lambda n: torch.empty(n, dtype=torch.uint8, device="cpu"))
    a = pool.acquire((3, 4), torch.float32)
    assert a.tensor.shape == (3, 4) and a.tensor.dtype == torch.float32
    copying = FakeEvent()
    a.release(copying)  # a host->device copy still reads it
    a.release(FakeEvent(done=True))  # a second release is ignored
    b = pool.acquire((12,), torch.int32)
    assert b.base.data_ptr() != a.base.data_ptr() and pool.allocations == 2
    copying.done = True
    c = pool.acquire((2,), torch.float64)
    assert c.base.data_ptr() == a.base.data_ptr() and pool.reuses == 1
    big = pool.acquire((2048,), torch.float32)  # 8 KiB: more than the pool keeps
    big.release()
    b.release()
    assert pool.cached_bytes == 512


# ------------------------------------------- the CUDA code paths, on a CPU stand-in
class CudaStandIn(torch.Tensor):
    """A CPU tensor that says it is on CUDA: it drives the staged and device-direct code
    paths without a GPU (with the fixture below: plain copies, fake events, and fake
    streams: ``record_stream`` notes the stream in :data:`RECORDED`)."""

    @property
    def is_cuda(self) -> bool:  # type: ignore[override]
        return True

    def record_stream(self, stream) -> None:  # type: ignore[override]
        RECORDED.append((self, stream))


RECORDED: list[tuple[torch.Tensor, object]] = []


class LaterEvent(FakeEvent):
    """Completes on its third query: the work it stands for takes a while."""

    queries = 0

    def query(self) -> bool:
        self.queries += 1
        self.done = self.done or self.queries >= 3
        return self.done


@pytest.fixture
def cuda_stand_in(monkeypatch):
    """Staging copies become CPU copies into a pool of plain buffers, CUDA events become
    :class:`LaterEvent`; returns the pool and the events made."""
    from kfac_hpc.comm import staging

    pool = staging.PinnedPool(allocate=lambda n: torch.empty(n, dtype=torch.uint8, device="cpu"))
    events: list[LaterEvent] = []

    def event(*_args) -> LaterEvent:
        events.append(LaterEvent())
        return events[-1]

    def stage_out(data, pool_, need_input):
        pinned = pool_.acquire(data.shape, data.dtype)
        if need_input:
            pinned.tensor.copy_(data.as_subclass(torch.Tensor))
        return pinned, event() if need_input and data.numel() else None

    monkeypatch.setattr(staging, "pinned_pool", lambda: pool)
    monkeypatch.setattr(staging, "stage_out", stage_out)
    monkeypatch.setattr(staging, "land_in", lambda host, device: (host.clone(), event()))
    monkeypatch.setattr(staging, "record_event", event)
    # each thread's current stream: "main", or what a test sets in FAKE_STREAMS.current
    monkeypatch.setattr(torch.cuda, "current_stream",
                        lambda device=None: getattr(FAKE_STREAMS, "current", "main"))
    staging.reset_warning()
    RECORDED.clear()
    yield pool, events
    RECORDED.clear()
    staging.reset_warning()


FAKE_STREAMS = threading.local()


@mpi()
@pytest.mark.parametrize("path", ["staged", "device"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64])
@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("blocking", [True, False])
def test_cuda_code_paths_on_a_stand_in(cuda_stand_in, path, dtype, strided, blocking):
    pool, events = cuda_stand_in
    comm = Communicator(cuda_aware=False if path == "staged" else "all")
    size, rank = comm.size, comm.rank

    def dev(t: torch.Tensor) -> torch.Tensor:
        t = (t.t().contiguous() if t.dim() == 2 else t.repeat_interleave(2)) if strided else t
        t = t.as_subclass(CudaStandIn)
        return (t.t() if t.dim() == 2 else t[::2]) if strided else t

    def run(name, *args, **kwargs):
        if blocking:
            return getattr(comm, name)(*args, **kwargs)
        handle = getattr(comm, "i" + name)(*args, **kwargs)
        return handle.wait()

    x = dev(rank_data(rank, 12, dtype, 11).reshape(3, 4))
    assert run("allreduce", x) is x and isinstance(x, CudaStandIn)
    np.testing.assert_array_equal(as_np(x), all_data(comm, 12, dtype, 11).sum(0).reshape(3, 4))
    if dtype.is_floating_point:
        y = dev(rank_data(rank, 12, dtype, 12).reshape(3, 4))
        run("allreduce", y, "avg")
        np.testing.assert_allclose(as_np(y), all_data(comm, 12, dtype, 12).mean(0).reshape(3, 4),
                                   rtol=1e-2 if dtype.itemsize == 2 else 1e-6)
    counts = counts_for(size, "zeros")
    src = dev(rank_data(rank, sum(counts), dtype, 13))
    out = torch.full((counts[rank],), 99, dtype=dtype).as_subclass(CudaStandIn)
    assert run("reduce_scatter", src, counts, out=out) is out
    start = sum(counts[:rank])
    np.testing.assert_array_equal(
        as_np(out), all_data(comm, sum(counts), dtype, 13).sum(0)[start:start + counts[rank]])
    b = dev(rank_data(rank, 12, dtype, 14).reshape(3, 4))
    run("broadcast", b, root=size - 1)
    np.testing.assert_array_equal(as_np(b), as_np(rank_data(size - 1, 12, dtype, 14)).reshape(3, 4))
    root = size - 1
    r = dev(rank_data(rank, 12, dtype, 15).reshape(3, 4))
    run("reduce", r, root=root)
    expected = all_data(comm, 12, dtype, 15).sum(0) if rank == root else \
        as_np(rank_data(rank, 12, dtype, 15))
    np.testing.assert_array_equal(as_np(r), expected.reshape(3, 4))
    g = dev(rank_data(rank, 12, dtype, 16).reshape(3, 4))
    gathered = torch.zeros(size, 3, 4, dtype=dtype).as_subclass(CudaStandIn)
    run("allgather", g, out=gathered)
    np.testing.assert_array_equal(as_np(gathered).reshape(size, 12), all_data(comm, 12, dtype, 16))
    v = dev(rank_data(rank, counts[rank], dtype, 17))
    flat = torch.zeros(sum(counts), dtype=dtype).as_subclass(CudaStandIn)
    run("allgatherv", v, counts, out=flat)
    np.testing.assert_array_equal(as_np(flat), np.concatenate(
        [as_np(rank_data(q, counts[q], dtype, 17)) for q in range(size)]))
    assert comm.pending() == 0 and events  # every call waited for its (fake) device work
    if path == "staged":
        assert pool.allocations + pool.reuses > 0 and pool.reuses > 0
    else:
        assert pool.allocations == 0  # device memory went to MPI directly


def test_device_reductions_widen_every_16_bit_float(cuda_stand_in):
    """Reductions on device memory handed to MPI widen float16 as well as bfloat16 (no MPI
    documents 16-bit float arithmetic on device memory), on the device; staged ones keep
    the host's half type where the library has one; data movement never widens."""
    from kfac_hpc.comm.buffers import to_wire

    for dtype in (torch.float16, torch.bfloat16):
        x = torch.ones(6, dtype=dtype).as_subclass(CudaStandIn)
        direct = to_wire(x, reduction=True, device_ok=True)
        assert direct.data.dtype == torch.float32 and direct.copy_back and not direct.staged
        assert isinstance(direct.data, CudaStandIn)  # widened on the "device", not staged
        assert direct.ready is not None  # MPI waits for the widening
        moved = to_wire(x, reduction=False, device_ok=True)
        assert moved.data.element_size() == 2 and not moved.staged
        staged = to_wire(x, reduction=True, device_ok=False)
        assert staged.staged and staged.data.dtype == torch.float32
        staged.release()
        receive = to_wire(x, reduction=True, device_ok=True, need_input=False)
        assert receive.data.dtype == torch.float32 and receive.copy_back


@mpi()
@pytest.mark.parametrize("path", ["staged", "device"])
def test_fp16_device_reductions_are_exact_on_the_wire(cuda_stand_in, path):
    """float16 sums through the device path equal the staged path's (both widened), and
    the traffic counters count what travelled."""
    comm = Communicator(cuda_aware=False if path == "staged" else "all")
    x = rank_data(comm.rank, 10, torch.float16).as_subclass(CudaStandIn)
    comm.reset_traffic()
    comm.allreduce(x)
    assert x.dtype == torch.float16
    np.testing.assert_array_equal(as_np(x), all_data(comm, 10, torch.float16).sum(0))
    assert comm.stats.bytes_of("allreduce") == 40 * (comm.size > 1)


@mpi()
@pytest.mark.parametrize("path", ["staged", "device"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_results_landed_on_another_stream_are_marked_used_there(cuda_stand_in, path, dtype):
    """A call made on a hook thread (its current stream "hook") and completed on the main
    thread (stream "main"): the landing queues work on "main", so every device tensor it
    touches (the wire's device buffer, the caller's tensor) is marked as used by "main"
    (``record_stream``), or the caching allocator could hand that memory to the "hook"
    stream while "main" still reads or writes it."""
    comm = Communicator(cuda_aware=False if path == "staged" else "all")
    made: dict[str, object] = {}

    def hook() -> None:
        FAKE_STREAMS.current = "hook"
        x = rank_data(comm.rank, 8, dtype).as_subclass(CudaStandIn)
        part = rank_data(comm.rank, 2 * comm.size, dtype).as_subclass(CudaStandIn)
        out = torch.zeros(2, dtype=dtype).as_subclass(CudaStandIn)  # as K-FAC's hooks do
        made.update(x=x, handle=comm.iallreduce(x, "avg"), out=out,
                    scatter=comm.ireduce_scatter(part, [2] * comm.size, out=out))

    worker = threading.Thread(target=hook)
    worker.start()
    worker.join()
    assert not RECORDED  # nothing landed yet
    wire_data = made["handle"]._keep.data
    out = made["handle"].wait()
    assert out is made["x"]
    np.testing.assert_allclose(as_np(out), all_data(comm, 8, dtype).mean(0),
                               rtol=1e-2 if dtype == torch.bfloat16 else 1e-6)
    marked = [(t, stream) for t, stream in RECORDED]
    assert all(stream == "main" for _, stream in marked)
    assert any(t is out for t, _ in marked)  # the caller's tensor, written on "main"
    if path == "device":  # MPI's device buffer (the tensor itself, or its fp32 copy)
        assert any(t is wire_data for t, _ in marked)
    RECORDED.clear()
    assert made["scatter"].wait() is made["out"]
    assert [stream for t, stream in RECORDED if t is made["out"]] == ["main"]


@mpi()
def test_calls_an_aware_library_leaves_out_are_staged_with_per_call_advice(cuda_stand_in, caplog):
    """Open MPI without UCX: blocking calls take device memory, non-blocking ones are
    staged; the staging warning names the call and does not ask for a CUDA-aware MPI."""
    import logging

    from kfac_hpc.comm import staging
    from kfac_hpc.comm.cuda import BLOCKING, OPEN_MPI, CudaSupport

    pool, _ = cuda_stand_in
    comm = Communicator(cuda=CudaSupport(OPEN_MPI, True, BLOCKING, "test"))
    x = rank_data(comm.rank, 6, torch.float32).as_subclass(CudaStandIn)
    comm.allreduce(x)
    assert pool.allocations == 0  # blocking: device memory to MPI
    with caplog.at_level(logging.DEBUG, logger="kfac_hpc.comm"):
        comm.iallreduce(x).wait()
    assert pool.allocations == 1  # non-blocking reduction: staged
    np.testing.assert_array_equal(as_np(x), all_data(comm, 6, torch.float32).sum(0) * comm.size)
    text = "".join(r.getMessage() for r in caplog.records if r.name == "kfac_hpc.comm")
    assert "Open MPI does not take device memory in iallreduce" in text
    assert staging.PER_CALL_ADVICE in text and staging.NOT_AWARE_ADVICE not in text


OB1 = "Open MPI v4.1.4, package: Open MPI root@build Distribution, ident: 4.1.4"


def comm_messages(caplog, level: int) -> str:
    return "".join(r.getMessage() for r in caplog.records
                   if r.name == "kfac_hpc.comm" and r.levelno >= level)


@mpi()
def test_routed_reductions_are_staged_without_a_warning(cuda_stand_in, caplog):
    """Open MPI without UCX, as detected: the blocking reductions are staged by routing
    (no warning: it is the intended route, said once at INFO), data movement goes direct,
    and the non-blocking calls the library leaves out are warned about with that cause."""
    import logging

    from kfac_hpc.comm import staging
    from kfac_hpc.comm.cuda import detect

    pool, _ = cuda_stand_in
    comm = Communicator(cuda=detect(env={}, library=OB1, query=lambda: 1, maps="",
                                    opal_cuda=lambda: True))
    assert comm.cuda.aware and comm.cuda.routed == {"allreduce", "reduce", "reduce_scatter"}
    x = rank_data(comm.rank, 6, torch.float32).as_subclass(CudaStandIn)
    with caplog.at_level(logging.DEBUG, logger="kfac_hpc.comm"):
        comm.allreduce(x)
        assert pool.allocations == 1  # staged, by routing
        comm.broadcast(x, root=0)
        assert pool.allocations == 1 and pool.reuses == 0  # direct: no pinned buffer
        comm.reduce_scatter(rank_data(comm.rank, 2 * comm.size, torch.float32)
                            .as_subclass(CudaStandIn), [2] * comm.size)
        assert pool.allocations + pool.reuses >= 2  # staged, by routing
        assert comm_messages(caplog, logging.WARNING) == ""
        notes = [r for r in caplog.records if r.name == "kfac_hpc.comm"]
        assert len(notes) == 1  # once, whichever routed call came first
        text = notes[0].getMessage()
        assert notes[0].levelno <= logging.INFO
        assert "allreduce, reduce, reduce_scatter on CUDA tensors are staged" in text
        assert "by design" in text and "2-3.5x slower direct" in text
        assert "not CUDA-aware" not in text and "Use a CUDA-aware MPI" not in text
        comm.iallreduce(x).wait()  # outside Open MPI's table: warned, with that cause
    np.testing.assert_array_equal(as_np(x), all_data(comm, 6, torch.float32).sum(0) * comm.size)
    warnings = [r for r in caplog.records if r.name == "kfac_hpc.comm" and "Cause:" in
                r.getMessage()]
    assert len(warnings) == 1
    text = warnings[0].getMessage()
    assert "staged through pinned host memory for iallreduce, ireduce, ireduce_scatter, " \
           "ibcast, iallgather, iallgatherv (first: iallreduce" in text
    assert "Cause: Open MPI does not take device memory in iallreduce." in text
    assert staging.PER_CALL_ADVICE in text and "not CUDA-aware" not in text


@mpi()
@pytest.mark.parametrize("how", ["argument", "environment"])
def test_forced_staging_says_it_was_forced(cuda_stand_in, caplog, monkeypatch, how):
    """A CUDA-aware library staged by ``cuda_aware=False`` or ``KFAC_HPC_CUDA_AWARE=0``: the
    warning names the override, not a library that is not CUDA-aware."""
    import logging

    from kfac_hpc.comm import staging
    from kfac_hpc.comm.cuda import CUDA_AWARE_ENV, detect

    env = {CUDA_AWARE_ENV: "0"} if how == "environment" else {}
    support = detect(False if how == "argument" else None, env=env, library=OB1,
                     query=lambda: 1, maps="", opal_cuda=lambda: True)
    comm = Communicator(cuda=support)
    x = rank_data(comm.rank, 4, torch.float32).as_subclass(CudaStandIn)
    with caplog.at_level(logging.DEBUG, logger="kfac_hpc.comm"):
        comm.broadcast(x, root=0)
    text = comm_messages(caplog, logging.DEBUG)
    source = "Communicator(cuda_aware=False)" if how == "argument" else f"{CUDA_AWARE_ENV}=0"
    assert f"Cause: staging forced by {source} (detected: CUDA-aware)." in text
    assert staging.FORCED_ADVICE in text
    assert "not CUDA-aware here" not in text and staging.NOT_AWARE_ADVICE not in text
