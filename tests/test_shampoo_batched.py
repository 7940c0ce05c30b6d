"""DistributedShampoo's batched step: the same numbers as block by block, few kernels,
no collective on one rank.

* Numerics: the batched step against the frozen block-by-block algorithm
  (``tests/shampoo_reference.py``) in float64. Grafting, filtering, weight decay,
  momentum and the update keep the operation order (``torch._foreach_*`` per tensor),
  so a run that never preconditions is bitwise equal. With preconditioning the
  factor update is one fused ``baddbmm`` (last-bit rounding differs from a product
  followed by ``mul_``/``add_``), and the CPU's batched products of small matrices and
  its matrix-vector products sum in another order: ~1e-16 relative per operation,
  which the roots amplify by their condition number (ε = 1e-3 on unit-scale
  factors); 1e-11 relative over the run leaves room, while any wrong term is O(1).
* Kernels: operators dispatched by one ``step()`` (``tests/op_count.py``: each is
  about one launch on a GPU) do not depend on the number of same-shape blocks, for
  steps that recompute roots and steps that do not.
* One rank: no collective at all (a communicator whose collectives fail).

Run: ``pytest tests/test_shampoo_batched.py``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from mpi4py import MPI
from op_count import count_ops
from shampoo_reference import ReferenceShampoo
from torch import Tensor, nn

from kfac_hpc.comm import Communicator
from kfac_hpc.shampoo import DistributedShampoo

NEVER = 10**9
BASE: dict[str, Any] = dict(
    lr=0.05, betas=(0.9, 0.99), epsilon=1e-3, momentum=0.0, nesterov=False, weight_decay=0.0,
    decoupled_weight_decay=True, max_preconditioner_dim=4, precondition_frequency=3,
    start_preconditioning_step=2, grafting="adam", grafting_epsilon=1e-8,
    grafting_beta2=0.999, use_bias_correction=True)
# orders 1, 2 and 3; several same-shape blocks per parameter and across parameters
SHAPES = [(6, 10), (10,), (4, 5, 6), (6, 10), (3,), (8, 4)]
CASES = {
    "adam": {},
    "sgd-momentum-coupled-decay": dict(grafting="sgd", momentum=0.9, weight_decay=0.01,
                                       decoupled_weight_decay=False, betas=(0.0, 1.0)),
    "adagrad-nesterov-decoupled": dict(grafting="adagrad", momentum=0.5, nesterov=True,
                                       weight_decay=0.02),
    "rmsprop-no-bias-correction": dict(grafting="rmsprop", use_bias_correction=False,
                                       betas=(0.5, 0.9)),
    "no-grafting-big-blocks": dict(grafting=None, max_preconditioner_dim=16, betas=(0.0, 1.0)),
    "every-step": dict(precondition_frequency=1, start_preconditioning_step=1),
}


def _params(seed: int = 0) -> list[nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(s, generator=g, dtype=torch.float64)) for s in SHAPES]


def _run(make: Callable[[list[nn.Parameter]], Any], steps: int) -> list[Tensor]:
    params = _params()
    opt = make(params)
    g = torch.Generator().manual_seed(1)
    for step in range(steps):
        for k, p in enumerate(params):
            p.grad = torch.randn(p.shape, generator=g, dtype=torch.float64)
            if step == 3 and k == 1:
                p.grad = None  # a step without gradient: that block's step count lags
        opt.step()
    return [p.detach() for p in params]


def _self() -> Communicator:
    return Communicator(MPI.COMM_SELF, name="self")


def _pair(options: dict[str, Any], steps: int = 7) -> tuple[list[Tensor], list[Tensor]]:
    hp = {**BASE, **options}
    ours = _run(lambda ps: DistributedShampoo(ps, comm=_self(), factor_dtype=torch.float64,
                                              communication_dtype=torch.float64, **hp), steps)
    theirs = _run(lambda ps: ReferenceShampoo(ps, hp, torch.float64, torch.float64), steps)
    return ours, theirs


@pytest.mark.parametrize("case", sorted(CASES))
def test_batched_equals_block_by_block(case: str) -> None:
    ours, theirs = _pair(CASES[case])
    for k, (a, b) in enumerate(zip(ours, theirs)):
        torch.testing.assert_close(a, b, rtol=1e-11, atol=1e-13, msg=f"parameter {k}")
    assert any(not torch.equal(a, p) for a, p in zip(ours, _params()))  # it moved


@pytest.mark.parametrize("options", [dict(momentum=0.9, nesterov=True, weight_decay=0.01),
                                     dict(grafting="sgd", momentum=0.9, weight_decay=0.01,
                                          decoupled_weight_decay=False)])
def test_grafting_only_is_bitwise_block_by_block(options: dict[str, Any]) -> None:
    """Before preconditioning starts nothing changed order: bitwise equal."""
    ours, theirs = _pair({**options, "start_preconditioning_step": NEVER})
    for k, (a, b) in enumerate(zip(ours, theirs)):
        assert torch.equal(a, b), f"parameter {k}"


# -------------------------------------------------------------------- kernels
def _linears(n: int) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Conv2d(3, 8, 3)]
    layers += [nn.Linear(24, 24) for _ in range(n)]  # 24 > max dim 16: 2x2 blocks each
    return nn.Sequential(*layers)


def _kernels_per_step(n: int, comm: Communicator | None = None,
                      **options: Any) -> tuple[int, int]:
    """Kernels of a root step (the first) and of a step between root steps."""
    model = _linears(n)
    opt = DistributedShampoo(model.named_parameters(), comm=comm or _self(), lr=0.01,
                             momentum=0.9,
                             weight_decay=1e-4, max_preconditioner_dim=16,
                             precondition_frequency=10, **options)
    g = torch.Generator().manual_seed(0)
    counts = []
    for _ in range(2):
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=g)
        counts.append(count_ops(opt.step).kernels)
    return counts[0], counts[1]


@pytest.mark.parametrize("options", [{}, dict(grafting="sgd", nesterov=True),
                                     dict(decoupled_weight_decay=False, betas=(0.0, 1.0))])
def test_kernels_per_step_do_not_grow_with_same_shape_blocks(options: dict[str, Any]) -> None:
    """16 layers of 4 same-shape blocks each cost what 4 layers cost: a loop over blocks
    (or parameters) that launches kernels would add at least 12 per operation."""
    few, many = _kernels_per_step(4, **options), _kernels_per_step(16, **options)
    assert few == many, (few, many)
    root, plain = few
    assert plain < root < 400, (root, plain)


@pytest.mark.mpi(min_size=2)
def test_kernels_per_step_do_not_grow_with_same_shape_blocks_on_ranks(
        comm: Communicator) -> None:
    """With the gather too: 4 times the blocks, at most 2 more kernels per kind of
    block (7 kinds; a run of one block is a view, not a stacked copy, of gradients and
    parameters), where a loop over blocks would add at least one per extra block (24)."""
    few, many = _kernels_per_step(8, comm), _kernels_per_step(32, comm)
    assert all(0 <= m - f <= 2 * 7 for f, m in zip(few, many)), (comm.rank, few, many)


# -------------------------------------------------------------------- one rank
class _NoCollectives(Communicator):
    """A one-rank communicator that fails any collective or point-to-point call."""

    CALLS = ("allreduce", "iallreduce", "reduce_scatter", "ireduce_scatter", "reduce",
             "ireduce", "broadcast", "ibroadcast", "allgather", "iallgather", "allgatherv",
             "iallgatherv", "send", "recv", "broadcast_object", "allgather_object", "any",
             "barrier")

    def __init__(self) -> None:
        super().__init__(MPI.COMM_SELF, name="no-collectives")
        self.calls: list[str] = []
        for name in self.CALLS:
            setattr(self, name, self._refuse(name))

    def _refuse(self, name: str) -> Callable[..., Any]:
        def refuse(*args: Any, **kwargs: Any) -> Any:
            self.calls.append(name)
            raise AssertionError(f"{name} called on one rank")
        return refuse


def test_one_rank_steps_without_any_collective() -> None:
    """Root steps, plain steps, a step without some gradients, a failed step."""
    model = _linears(2)
    comm = _NoCollectives()
    opt = DistributedShampoo(model.named_parameters(), comm=comm, check_replicas=False,
                             max_preconditioner_dim=16, precondition_frequency=2)
    twin = copy.deepcopy(model)
    ref = DistributedShampoo(twin.named_parameters(), comm=_self(), max_preconditioner_dim=16,
                             precondition_frequency=2)
    g = torch.Generator().manual_seed(0)
    for step in range(4):
        for p, q in zip(model.parameters(), twin.parameters()):
            p.grad = torch.randn(p.shape, generator=g)
            q.grad = p.grad.clone()
        if step == 2:
            model[1].weight.grad = twin[1].weight.grad = None
        opt.step()
        ref.step()
    assert comm.calls == []
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.equal(a, b)
    assert opt.memory_bytes()["buffers"] == 0  # no gather buffers either
    # but the last step's directions, one per parameter with a gradient, until the next
    held = opt.memory_bytes()["directions"]
    assert held >= sum(p.numel() * 4 for p in model.parameters() if p.grad is not None)
    model[1].bias.grad = torch.full_like(model[1].bias, float("nan"))
    with pytest.raises(Exception, match=r"'1\.bias' block"):
        opt.step()
    assert comm.calls == []
