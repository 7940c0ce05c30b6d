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
    per_rank = []
    for r in range(comm.size):  # every rank's gradient, computed locally as the reference
        net.zero_grad()
        x = torch.randn(5, 4, generator=torch.Generator().manual_seed(r))
        forward(net, x).square().sum().backward()
        per_rank.append({n: p.grad.clone() for n, p in net.named_parameters()
                         if p.grad is not None})
    net.zero_grad()
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
