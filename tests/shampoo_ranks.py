"""A Shampoo run over the world against the same run over COMM_SELF (MPI tests' helpers).

Gradients are identical on every rank (each rank computes the full-batch gradient
itself) and per-block arithmetic does not depend on who computes it, so the two runs
must agree bit for bit. (Not yet for blocks whose bytes are not a multiple of 16, e.g.
9x9, on the CPU: MKL rounds them by their place in a stack; docs/design.md, Shampoo.)
"""

from __future__ import annotations

from typing import Any

import torch
from mpi4py import MPI
from shared_cases import SHAMPOO_KWARGS as KWARGS
from shared_cases import ShampooNet as Net
from torch import nn

from kfac_hpc.comm import Communicator
from kfac_hpc.shampoo import DistributedShampoo


def batches(steps: int, seed: int = 1, n: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, 2, 4, 4, generator=g), torch.randn(n, 3, generator=g))
            for _ in range(steps)]


def train(model: nn.Module, opt: DistributedShampoo, data: list[Any]) -> None:
    for x, y in data:
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def self_comm() -> Communicator:
    return Communicator(MPI.COMM_SELF, name="self")


def assert_same(a: nn.Module, b: nn.Module) -> None:
    for (name, x), y in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(x, y), f"{name} differs (max {float((x - y).abs().max()):.3e})"


def assert_identical_on_all_ranks(model: nn.Module, comm: Communicator) -> None:
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    rows = comm.allgather(flat)
    assert all(torch.equal(rows[0], row) for row in rows)


def distributed_vs_single(comm: Communicator, steps: int = 5, **overrides: Any
                          ) -> tuple[nn.Module, DistributedShampoo, DistributedShampoo]:
    """Train ShampooNet over ``comm`` and over COMM_SELF on the same batches; assert the
    parameters bitwise equal, and equal on every rank; return the distributed model and
    both optimizers."""
    kwargs = {**KWARGS, **overrides}
    dist_model, single_model = Net(), Net()
    dist = DistributedShampoo(dist_model.named_parameters(), comm=comm, **kwargs)
    single = DistributedShampoo(single_model.named_parameters(), comm=self_comm(), **kwargs)
    data = batches(steps)
    train(dist_model, dist, data)
    train(single_model, single, data)
    assert_same(dist_model, single_model)
    assert_identical_on_all_ranks(dist_model, comm)
    return dist_model, dist, single
