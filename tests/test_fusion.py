"""Message fusion and symmetric packing: exact round trips and exact byte counts."""

from __future__ import annotations

import pytest
import torch

from kfac_hpc.comm import (
    FusedAllreduce,
    buckets_by_size,
    flatten,
    pack_upper,
    triu_count,
    unflatten_into,
    unpack_upper,
)


@pytest.mark.parametrize("n", [1, 2, 5, 64])
def test_pack_unpack_symmetric_round_trip(n):
    x = torch.randn(n, n, dtype=torch.float64)
    sym = x + x.T
    packed = pack_upper(sym)
    assert packed.numel() == triu_count(n) == n * (n + 1) // 2
    assert torch.equal(unpack_upper(packed, n), sym)


def test_pack_rejects_non_square():
    with pytest.raises(ValueError, match="square"):
        pack_upper(torch.zeros(2, 3))
    with pytest.raises(ValueError, match="upper triangle"):
        unpack_upper(torch.zeros(4), 3)


def test_flatten_round_trip_mixed_shapes():
    tensors = [torch.randn(3, 4), torch.randn(0), torch.randn(7), torch.randn(2, 2, 2)]
    flat = flatten(tensors)
    assert flat.numel() == 12 + 0 + 7 + 8
    targets = [torch.empty_like(t) for t in tensors]
    unflatten_into(flat, targets)
    for a, b in zip(tensors, targets):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="tensors hold"):
        unflatten_into(flat, targets[:2])


def test_buckets_by_size():
    assert buckets_by_size([4, 4, 4, 4], 8) == [[0, 1], [2, 3]]
    assert buckets_by_size([10, 1, 1], 8) == [[0], [1, 2]]
    assert buckets_by_size([], 8) == []
    with pytest.raises(ValueError, match="positive"):
        buckets_by_size([1], 0)


@pytest.mark.mpi(min_size=1)
def test_fused_allreduce_matches_unfused(comm):
    gen = torch.Generator().manual_seed(comm.rank)
    tensors = [torch.randn(s, generator=gen, dtype=torch.float64) for s in (10, 300, 1, 64)]
    reference = [t.clone() for t in tensors]
    for t in reference:
        comm.allreduce(t, "avg")
    comm.reset_traffic()
    cap_mb = 2500 / 2**20  # 80+2400 bytes fit, then 8+512: two buckets
    fused = FusedAllreduce(comm, tensors, op="avg", cap_mb=cap_mb)
    assert len(fused.groups) == 2
    fused.start().wait()
    for a, b in zip(tensors, reference):
        torch.testing.assert_close(a, b, rtol=1e-14, atol=1e-14)
    if comm.size > 1:
        assert comm.stats.calls_of("allreduce") == 2
        assert comm.stats.bytes_of("allreduce") == 8 * (10 + 300 + 1 + 64)


@pytest.mark.mpi(min_size=2)
def test_packed_factor_reduction_bytes(comm):
    """Reducing packed symmetric factors moves n(n+1)/2 elements per factor, exactly."""
    dims = [3, 8, 17]
    mats = []
    for n in dims:
        x = torch.randn(n, n, generator=torch.Generator().manual_seed(comm.rank + n))
        mats.append(x @ x.T)
    expected = [sum(
        (lambda x: x @ x.T)(torch.randn(n, n, generator=torch.Generator().manual_seed(r + n)))
        for r in range(comm.size)) for n in dims]
    comm.reset_traffic()
    flat = torch.cat([pack_upper(m) for m in mats])
    comm.allreduce(flat, "sum")
    offset = 0
    for n, want in zip(dims, expected):
        k = triu_count(n)
        torch.testing.assert_close(unpack_upper(flat[offset:offset + k], n), want)
        offset += k
    assert comm.stats.bytes_of("allreduce") == 4 * sum(triu_count(n) for n in dims)


@pytest.mark.mpi(min_size=1)
def test_fusion_under_the_meta_stand_in(comm, meta_default_device):
    """Flattening (an empty list included) and fused reductions make CPU tensors only."""
    tensors = [torch.arange(5.0) + comm.rank, torch.ones(3, 2, dtype=torch.float64)]
    expected = [sum(torch.arange(5.0) + r for r in range(comm.size)) / comm.size,
                torch.ones(3, 2, dtype=torch.float64)]
    meta_default_device()
    assert flatten([]).device.type == "cpu"
    assert flatten([], torch.bfloat16).device.type == "cpu"
    FusedAllreduce(comm, tensors, op="avg", cap_mb=1e-5).start().wait()
    torch.set_default_device(None)
    for got, want in zip(tensors, expected):
        torch.testing.assert_close(got, want)
