"""DistributedShampoo across MPI ranks.

Run: ``launch/local -n 2 --timeout 300 python -m mpi4py -m pytest -q --with-mpi --only-mpi
tests/test_shampoo*.py`` (and ``-n 4``).

Each test compares an optimizer over the world with one over ``COMM_SELF`` (a
single-rank run) in the same process, on gradients that are identical on every
rank (each rank computes the full-batch gradient itself). Per-block arithmetic does
not depend on who computes it, so the results must be bitwise equal
(``torch.equal``), not merely close; the one data-parallel test that averages
shard gradients with an MPI allreduce states its tolerance. (The blocks here are of
sizes whose bytes are multiples of 16: on the CPU, MKL still rounds other sizes, e.g.
9x9, by their place in a stack; docs/design.md, Shampoo.)
"""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import torch
from shampoo_ranks import (
    assert_identical_on_all_ranks,
    assert_same,
    batches,
    distributed_vs_single,
    self_comm,
    train,
)
from shared_cases import SHAMPOO_KWARGS as KWARGS
from shared_cases import ShampooNet as Net
from torch import nn

from kfac_hpc.comm import Communicator
from kfac_hpc.shampoo import DistributedShampoo, ShampooNumericalError


@pytest.mark.mpi(min_size=2)
def test_distributed_equals_single_rank_bitwise(comm: Communicator) -> None:
    """9 steps, roots at 1, 3, 5, 7, 9 (before the inverse-root scales were raised row by
    row on the CPU, a 4x4 factor's root differed by an ulp at step 7 on 2 ranks)."""
    _, opt, _ = distributed_vs_single(comm, steps=9)
    owners = set(opt.block_owners().values())
    assert owners == set(range(comm.size)) or len(opt.layout.blocks) < comm.size
    # Owner-only state: this rank holds exactly its own blocks.
    mine = {k for k, r in opt.block_owners().items() if r == comm.rank}
    held = {(opt._name_of[p], i) for p, blocks in opt.state.items() for i in blocks}
    assert held == mine


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_communication_equals_single_rank(comm: Communicator,
                                                         dtype: torch.dtype) -> None:
    distributed_vs_single(comm, steps=3, communication_dtype=dtype)


@pytest.mark.mpi(min_size=2)
def test_adam_grafting_only_and_float64_factors(comm: Communicator) -> None:
    distributed_vs_single(comm, steps=3, start_preconditioning_step=3, momentum=0.0,
                          nesterov=False, factor_dtype=torch.float64)


@pytest.mark.mpi(min_size=2)
def test_exactly_one_allgatherv_per_step(comm: Communicator) -> None:
    model = Net()
    opt = DistributedShampoo(model.named_parameters(), comm=comm, **KWARGS)
    comm.reset_traffic()
    train(model, opt, batches(3))
    opt.zero_grad(set_to_none=True)
    opt.step()  # no gradients anywhere: still joins the collective
    stats = comm.traffic()
    numel = sum(p.numel() for p in model.parameters())
    assert stats.calls_of("allgatherv") == 4
    assert stats.total_calls == 4  # nothing else
    assert stats.bytes_of("allgatherv") == 4 * (numel + comm.size) * 4  # fp32 + status words


@pytest.mark.mpi(min_size=2)
def test_ranks_without_blocks(comm: Communicator) -> None:
    """One 3-element parameter: one block, so every rank but its owner owns nothing."""
    torch.manual_seed(0)
    w_dist = nn.Parameter(torch.randn(3))
    w_single = nn.Parameter(w_dist.detach().clone())
    dist = DistributedShampoo([("w", w_dist)], comm=comm, lr=0.1)
    single = DistributedShampoo([("w", w_single)], comm=self_comm(), lr=0.1)
    owner = dist.block_owners()[("w", 0)]
    assert owner == 0 and len(dist._owned) == (1 if comm.rank == 0 else 0)
    comm.reset_traffic()
    for step in range(4):
        g = torch.tensor([1.0, -2.0, 0.5]) * (step + 1)
        for w in (w_dist, w_single):
            w.grad = None if step == 2 else g.clone()  # step 3: no gradient on any rank
        dist.step()
        single.step()
        assert torch.equal(w_dist, w_single)
    assert comm.traffic().calls_of("allgatherv") == 4
    sd = dist.state_dict()
    assert sd["state"]["w"][0]["step"] == 3  # the step without gradient was skipped


@pytest.mark.mpi(min_size=2)
def test_parameter_without_gradient_is_skipped_everywhere(comm: Communicator) -> None:
    dist_model, single_model = Net(), Net()
    dist = DistributedShampoo(dist_model.named_parameters(), comm=comm, **KWARGS)
    single = DistributedShampoo(single_model.named_parameters(), comm=self_comm(), **KWARGS)
    frozen = dist_model.fc1.weight.detach().clone()
    for model, opt in ((dist_model, dist), (single_model, single)):
        for x, y in batches(3):
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            model.fc1.weight.grad = None
            opt.step()
    assert_same(dist_model, single_model)
    assert torch.equal(dist_model.fc1.weight, frozen)
    assert "fc1.weight" not in dist.state_dict()["state"]


@pytest.mark.mpi(min_size=2)
def test_data_parallel_shards_with_allreduce(comm: Communicator) -> None:
    """Each rank a shard, gradients allreduce-averaged; reference: one process averages
    per-shard gradients. Equal up to the MPI summation order, in float64: sums of P
    terms differ by ~1e-16 relative, which the roots (ε = 1e-6) amplify; measured
    after 3 steps at 4 ranks: 8e-15, so 1e-10 leaves room. (In float32 the same
    amplification reached 1.3e-5 at 4 ranks, above the 1e-5 this test once allowed.)"""
    per_rank, p = 4, comm.size
    data = [(x.double(), y.double()) for x, y in batches(3, n=per_rank * p)]
    dist_model, ref_model = Net().double(), Net().double()
    kwargs = {**KWARGS, "epsilon": 1e-6, "factor_dtype": torch.float64,
              "communication_dtype": torch.float64}
    dist = DistributedShampoo(dist_model.named_parameters(), comm=comm, **kwargs)
    ref = DistributedShampoo(ref_model.named_parameters(), comm=self_comm(), **kwargs)
    for x, y in data:
        shard = slice(comm.rank * per_rank, (comm.rank + 1) * per_rank)
        dist.zero_grad()
        nn.functional.mse_loss(dist_model(x[shard]), y[shard]).backward()
        for q in dist_model.parameters():
            comm.allreduce(q.grad, "avg")
        dist.step()
        grads = [torch.zeros_like(q) for q in ref_model.parameters()]
        for r in range(p):
            ref.zero_grad()
            s = slice(r * per_rank, (r + 1) * per_rank)
            nn.functional.mse_loss(ref_model(x[s]), y[s]).backward()
            for acc, q in zip(grads, ref_model.parameters()):
                acc += q.grad
        for acc, q in zip(grads, ref_model.parameters()):
            q.grad = acc / p
        ref.step()
    for a, b in zip(dist_model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    assert_identical_on_all_ranks(dist_model, comm)


@pytest.mark.mpi(min_size=2)
def test_nan_in_a_remote_block_raises_on_every_rank(comm: Communicator) -> None:
    model = Net()
    opt = DistributedShampoo(model.named_parameters(), comm=comm, **KWARGS)
    owners = opt.block_owners()
    name, index = next(k for k, r in owners.items() if r == comm.size - 1)
    spec = opt.layout.blocks[[b.key for b in opt.layout.blocks].index((name, index))]
    param = dict(model.named_parameters())[name]
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    param.grad.reshape(spec.merged_shape)[spec.slices].view(-1)[0] = math.inf
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ShampooNumericalError) as info:
        opt.step()
    assert info.value.blocks == [(name, index)]
    assert f"{name!r} block {index}" in str(info.value)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    comm.barrier()  # every rank got here: nobody is stuck in a collective


@pytest.mark.mpi(min_size=2)
def test_exception_on_one_owner_does_not_hang(comm: Communicator,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """An unexpected error in one rank's block update: that rank re-raises it after the
    collective, the others raise ShampooNumericalError naming it; nobody hangs."""
    import kfac_hpc.shampoo.optimizer as optimizer_module

    real = optimizer_module.update_statistics
    failing_rank = comm.size - 1

    def update_statistics(*args: Any, **kwargs: Any) -> Any:
        if comm.rank == failing_rank:
            raise MemoryError("injected")
        return real(*args, **kwargs)

    monkeypatch.setattr(optimizer_module, "update_statistics", update_statistics)
    model = Net()
    opt = DistributedShampoo(model.named_parameters(), comm=comm, **KWARGS)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    expected = MemoryError if comm.rank == failing_rank else ShampooNumericalError
    with pytest.raises(expected) as info:
        opt.step()
    if comm.rank != failing_rank:
        assert f"rank(s) [{failing_rank}] raised" in str(info.value)
    comm.barrier()


def _checkpoint_transfer(source: Communicator, target: Communicator, comm: Communicator) -> None:
    """Train on ``source`` ranks, state_dict, load into an optimizer over ``target``;
    both continue and must agree bitwise."""
    model = Net()
    opt = DistributedShampoo(model.named_parameters(), comm=source, **KWARGS)
    train(model, opt, batches(3, seed=5))
    sd = opt.state_dict()
    digest = sorted((n, i, float(s["factor_0"].double().sum())) for n, blocks in
                    sd["state"].items() for i, s in blocks.items())
    assert all(d == digest for d in comm.allgather_object(digest))  # same dict on every rank
    twin = copy.deepcopy(model)
    other = DistributedShampoo(twin.named_parameters(), comm=target, **KWARGS)
    other.load_state_dict(sd)
    more = batches(3, seed=6)
    train(model, opt, more)
    train(twin, other, more)
    assert_same(model, twin)


@pytest.mark.mpi(min_size=2)
def test_state_dict_moves_between_world_sizes(comm: Communicator) -> None:
    _checkpoint_transfer(comm, self_comm(), comm)  # P ranks → 1
    _checkpoint_transfer(self_comm(), comm, comm)  # 1 → P ranks


@pytest.mark.mpi(min_size=4)
def test_state_dict_four_to_two_and_back(comm: Communicator) -> None:
    half = comm.split(comm.rank % 2, name="half")  # two communicators of size P/2
    try:
        _checkpoint_transfer(comm, half, comm)
        _checkpoint_transfer(half, comm, comm)
    finally:
        half.free()


@pytest.mark.mpi(min_size=4)
def test_four_ranks_all_own_blocks(comm: Communicator) -> None:
    _, opt, _ = distributed_vs_single(comm, steps=4)
    assert set(opt.block_owners().values()) == set(range(comm.size))
    loads = opt.layout.load()
    assert max(loads) <= sum(loads) / comm.size + max(b.cost for b in opt.layout.blocks)


@pytest.mark.mpi(min_size=2)
def test_different_models_fail_clearly_on_every_rank(comm: Communicator) -> None:
    """A rank with a wider layer would gather directions of another size (MPI truncation,
    heap corruption): the constructor raises the same error on every rank."""
    torch.manual_seed(0)
    width = 8 if comm.rank == comm.size - 1 else 6
    model = nn.Sequential(nn.Linear(4, width), nn.Linear(width, 2))
    with pytest.raises(ValueError, match=r"ranks hold different models .*0\.weight"):
        DistributedShampoo(model.named_parameters(), comm=comm)


@pytest.mark.mpi(min_size=2)
def test_different_settings_fail_clearly_on_every_rank(comm: Communicator) -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    with pytest.raises(ValueError, match="max_preconditioner_dim"):
        DistributedShampoo(model.named_parameters(), comm=comm,
                           max_preconditioner_dim=2 if comm.rank == 0 else 3)
