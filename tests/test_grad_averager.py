"""GradientAverager: averages .grad over ranks, overlapping with backward."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kfac_hpc import GradientAverager


def model_with_unused() -> nn.Module:
    torch.manual_seed(0)
    net = nn.ModuleDict({"a": nn.Linear(4, 8), "b": nn.Linear(8, 3), "unused": nn.Linear(2, 2)})
    return net


def forward(net, x):
    return net["b"](torch.relu(net["a"](x)))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("cap_mb", [25.0, 1e-4])
def test_average_equals_mean_of_rank_gradients(comm, cap_mb):
    net = model_with_unused()
    averager = GradientAverager(net, comm, bucket_cap_mb=cap_mb)
    per_rank = rank_gradients(net, comm.size)
    averager.synchronize()  # the first step: ranks agree on the bucket posting order
    net.zero_grad()
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(comm.rank))
    forward(net, x).square().sum().backward()
    if cap_mb < 1:
        assert averager._next > 0  # some buckets were posted from hooks during backward
    averager.synchronize()
    for name, p in net.named_parameters():
        if name.startswith("unused"):
            assert p.grad is None  # parameters without gradients keep grad=None
            continue
        expected = sum(g[name] for g in per_rank) / comm.size
        torch.testing.assert_close(p.grad, expected, rtol=1e-6, atol=1e-7)


@pytest.mark.mpi(min_size=2)
def test_a_float64_layer_beside_a_float32_one_is_averaged_in_float64(comm):
    """One bucket holds a float64 layer's gradient after a float32 one's: it travels in
    float64 (it was cast to the first gradient's float32, losing its digits)."""
    for order in ("float32 first", "float64 first"):
        torch.manual_seed(0)
        layers = [nn.Linear(3, 2), nn.Linear(2, 2).double()]
        net = nn.Sequential(*(layers if order == "float32 first" else layers[::-1]))
        wide_layer = layers[1]
        averager = GradientAverager(net, comm)
        for p in net.parameters():
            p.grad = torch.ones_like(p)
        wide = 1.0 + (comm.rank + 1) * 1e-9  # not a float32 number
        wide_layer.weight.grad = torch.full_like(wide_layer.weight, wide)
        averager.synchronize()
        expected = sum(1.0 + (r + 1) * 1e-9 for r in range(comm.size)) / comm.size
        torch.testing.assert_close(wide_layer.weight.grad,
                                   torch.full_like(wide_layer.weight, expected),
                                   rtol=1e-15, atol=0, msg=order)


@pytest.mark.mpi(min_size=2)
def test_no_sync_accumulates_locally(comm):
    net = model_with_unused()
    averager = GradientAverager(net, comm)
    comm.reset_traffic()
    with averager.no_sync():
        forward(net, torch.ones(2, 4) * (comm.rank + 1)).sum().backward()
    assert comm.stats.total_calls == 0
    forward(net, torch.ones(2, 4) * (comm.rank + 1)).sum().backward()
    averager.synchronize()
    local = model_with_unused()
    for r in range(comm.size):
        forward(local, torch.ones(2, 4) * (r + 1)).sum().backward()
        forward(local, torch.ones(2, 4) * (r + 1)).sum().backward()
    for p, q in zip(net.parameters(), local.parameters()):
        if p.grad is not None:
            torch.testing.assert_close(p.grad, q.grad / comm.size, rtol=1e-6, atol=1e-6)


def rank_gradients(net, size):
    """Every rank's gradients, computed locally (the reference for the average)."""
    per_rank = []
    for r in range(size):
        net.zero_grad()
        x = torch.randn(5, 4, generator=torch.Generator().manual_seed(r))
        forward(net, x).square().sum().backward()
        per_rank.append({n: p.grad.clone() for n, p in net.named_parameters()
                         if p.grad is not None})
    net.zero_grad()
    return per_rank


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("cap_mb", [25.0, 1e-4])
@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_overlap_under_the_meta_stand_in_and_a_hook_thread(comm, meta_default_device, cap_mb,
                                                           dtype):
    """Buckets posted from hooks that run on another thread (as CUDA's autograd worker
    does), while every tensor made without ``device=`` would land on ``meta``."""
    import threading

    net = model_with_unused()
    per_rank = rank_gradients(net, comm.size)
    averager = GradientAverager(net, comm, bucket_cap_mb=cap_mb, dtype=dtype)
    xs = [torch.randn(5, 4, generator=torch.Generator().manual_seed(comm.rank))
          for _ in range(2)]
    meta_default_device()
    posted_early = []
    for x in xs:  # step 1 agrees on the posting order, step 2 overlaps
        net.zero_grad()
        loss = forward(net, x).square().sum()
        worker = threading.Thread(target=loss.backward, name="autograd-stand-in")
        worker.start()
        worker.join()
        posted_early.append(averager._next)
        averager.synchronize()
    torch.set_default_device(None)
    if comm.size > 1 and cap_mb < 1:
        assert posted_early[1] > 0  # buckets were posted from the hook thread
    tol = {"rtol": 2e-2, "atol": 2e-2} if dtype == torch.bfloat16 else {"rtol": 1e-6, "atol": 1e-7}
    for name, p in net.named_parameters():
        if name.startswith("unused"):
            assert p.grad is None
            continue
        assert p.grad.device.type == "cpu"
        expected = sum(g[name] for g in per_rank[:comm.size]) / comm.size
        torch.testing.assert_close(p.grad, expected, **tol)


def test_parameters_on_two_devices_are_refused(comm):
    net = model_with_unused()
    net["b"].to("meta")
    with pytest.raises(ValueError, match=r"one device, got cpu, meta: move the model"):
        GradientAverager(net, comm)


@pytest.mark.mpi(min_size=2)
def test_different_models_fail_clearly_on_every_rank(comm):
    """A rank with a wider layer would post reductions of another size (MPI truncation,
    heap corruption or a hang): the constructor raises the same error on every rank."""
    torch.manual_seed(0)
    width = 8 if comm.rank == comm.size - 1 else 6
    model = nn.Sequential(nn.Linear(4, width), nn.Linear(width, 2))
    with pytest.raises(ValueError, match=r"ranks hold different models .*0\.weight"):
        GradientAverager(model, comm)


@pytest.mark.mpi(min_size=2)
def test_different_values_fail_clearly_on_every_rank(comm):
    torch.manual_seed(comm.rank)
    with pytest.raises(ValueError, match="parameters differ across ranks"):
        GradientAverager(nn.Linear(4, 3), comm)
