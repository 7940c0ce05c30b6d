"""Communicator collectives against numpy references, at 1, 2 and 4 ranks.

Each rank's input is a deterministic function of (rank, seed), so every rank can
compute the expected result of the whole collective with numpy on its own.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

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
    tol = 1e-2 if dtype in (torch.float16, torch.bfloat16) else 1e-12
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


# ------------------------------------------------------------ traffic counters
@mpi(2)
def test_traffic_counters_exact(comm):
    comm.reset_traffic()
    comm.allreduce(torch.ones(10, dtype=torch.float32))            # 40 B
    comm.allreduce(torch.ones(10, dtype=torch.bfloat16))           # widened: 40 B
    comm.broadcast(torch.ones(3, dtype=torch.float64), root=0)     # 24 B
    counts = [2] * comm.size
    comm.reduce_scatter(torch.ones(2 * comm.size, dtype=torch.float16), counts)  # 4*size B
    comm.allgatherv(torch.ones(2, dtype=torch.int64), counts)      # 16*size B
    comm.iallreduce(torch.ones(5, dtype=torch.float64)).wait()     # 40 B
    s = comm.stats
    assert s.calls_of("allreduce") == 3 and s.bytes_of("allreduce") == 40 + 40 + 40
    assert s.bytes_of("broadcast") == 24
    assert s.bytes_of("reduce_scatter") == 4 * comm.size
    assert s.bytes_of("allgatherv") == 16 * comm.size
    assert s.total_bytes == 120 + 24 + 20 * comm.size
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
