"""DistributedShampoo's device hygiene, checked on the CPU at 1, 2 and 4 ranks.

Stand-in for a GPU: the model and data live on the CPU, then ``meta_default_device``
sends every tensor created without ``device=`` to ``meta``, so a tensor the optimizer
creates without naming its parameter's device fails loudly (on a GPU it would land
on the CPU). Every tensor the optimizer holds is then checked to be on the
parameters' device, and the run must equal one made without the stand-in, bitwise.

Host synchronisation: a step reads device values on the host exactly once (the
gathered status words), whatever the number of blocks. Counted by wrapping the
Python-level reads (``bool``, ``item``, ``tolist``, ...) of ``torch.Tensor``.

Run: ``pytest tests/test_shampoo_device.py`` and ``launch/local -n 2 (and 4) python -m
mpi4py -m pytest --with-mpi --only-mpi tests/test_shampoo_device.py``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from shared_cases import SHAMPOO_KWARGS as KWARGS
from shared_cases import ShampooNet as Net
from shared_cases import held_tensors
from torch import Tensor, nn

from kfac_hpc.comm import Communicator
from kfac_hpc.shampoo import DistributedShampoo

HOST_READS = ("__bool__", "__float__", "__int__", "__index__", "item", "tolist")


def batches(steps: int, seed: int = 1) -> list[tuple[Tensor, Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 2, 4, 4, generator=g), torch.randn(8, 3, generator=g))
            for _ in range(steps)]


def train(model: Net, opt: DistributedShampoo, data: list[tuple[Tensor, Tensor]]) -> None:
    for step, (x, y) in enumerate(data):
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        if step == 1:
            model.fc1.weight.grad = None  # a step without gradient for some blocks
        opt.step()


def assert_on(opt: DistributedShampoo, device: torch.device) -> None:
    wrong = {k: str(v.device) for k, v in held_tensors(opt).items() if v.device != device}
    assert not wrong, f"not on {device}: {wrong}"


def state_dict_tensors(sd: dict[str, Any]) -> list[Tensor]:
    return [v for blocks in sd["state"].values() for block in blocks.values()
            for v in block.values() if isinstance(v, Tensor)]


def assert_same(a: nn.Module, b: nn.Module) -> None:
    for (name, x), y in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(x, y), f"{name} differs"


def check_device_hygiene(comm: Communicator, meta: Callable[[], None]) -> None:
    """Train, state_dict, load into a twin, continue: under the stand-in and without."""
    data = batches(5)
    ref_model, model = Net(), Net()
    ref = DistributedShampoo(ref_model.named_parameters(), comm=comm, **KWARGS)
    train(ref_model, ref, data[:3])
    twin = copy.deepcopy(ref_model)
    meta()  # from here on, a tensor created without device= lands on meta
    opt = DistributedShampoo(model.named_parameters(), comm=comm, **KWARGS)
    assert_on(opt, torch.device("cpu"))
    train(model, opt, data[:3])
    assert_on(opt, torch.device("cpu"))
    assert_same(model, ref_model)
    assert any(opt.state.values()) or not opt._owned  # owners hold state
    sd = opt.state_dict()
    assert state_dict_tensors(sd) and all(t.device.type == "cpu" for t in state_dict_tensors(sd))
    other = DistributedShampoo(twin.named_parameters(), comm=comm, **KWARGS)
    other.load_state_dict(sd)
    assert_on(other, torch.device("cpu"))
    for m, o in ((ref_model, ref), (model, opt), (twin, other)):
        train(m, o, data[3:])
    assert_same(model, ref_model)
    assert_same(twin, ref_model)


def test_device_hygiene_one_rank(meta_default_device: Callable[[], None]) -> None:
    from mpi4py import MPI

    check_device_hygiene(Communicator(MPI.COMM_SELF, name="self"), meta_default_device)


def test_file_round_trip_form_loads_under_the_stand_in(
        meta_default_device: Callable[[], None]) -> None:
    """numpy arrays and ``block_<i>`` keys (what HDF5 gives back) become tensors on the
    parameters' device, not on the default device."""
    model = Net()
    opt = DistributedShampoo(model.named_parameters(), **KWARGS)
    train(model, opt, batches(2))
    sd = opt.state_dict()
    sd["state"] = {name: {f"block_{i}": {k: v.numpy() if isinstance(v, Tensor) else v
                                         for k, v in block.items()}
                          for i, block in blocks.items()}
                   for name, blocks in sd["state"].items()}
    twin = copy.deepcopy(model)
    meta_default_device()
    other = DistributedShampoo(twin.named_parameters(), **KWARGS)
    other.load_state_dict(sd)
    assert_on(other, torch.device("cpu"))
    assert len(held_tensors(other)) > 3


def test_load_state_dict_moves_state_to_the_parameters_device() -> None:
    """A CPU state dict loaded into an optimizer whose parameters live elsewhere (meta
    here, CUDA in real runs) puts every state tensor on the parameters' device."""
    model = Net()
    opt = DistributedShampoo(model.named_parameters(), **KWARGS)
    train(model, opt, batches(2))
    sd = opt.state_dict()
    elsewhere = Net().to("meta")
    other = DistributedShampoo(elsewhere.named_parameters(), **KWARGS)
    other.load_state_dict(sd)
    assert_on(other, torch.device("meta"))
    loaded = sum(len(blocks) for blocks in other.state.values())
    assert loaded == sum(len(blocks) for blocks in sd["state"].values()) > 0


@pytest.mark.mpi(min_size=2)
def test_device_hygiene_two_ranks(comm: Communicator,
                                  meta_default_device: Callable[[], None]) -> None:
    check_device_hygiene(comm, meta_default_device)


@pytest.mark.mpi(min_size=2)
def test_ranks_without_blocks_under_the_stand_in(comm: Communicator,
                                                 meta_default_device: Callable[[], None]
                                                 ) -> None:
    """One 3-element parameter: every rank but the owner has no block, no state and an
    empty part of the gather, also in ``state_dict()``."""
    w = nn.Parameter(torch.tensor([1.0, -2.0, 0.5]))
    meta_default_device()
    opt = DistributedShampoo([("w", w)], comm=comm, lr=0.1)
    for step in range(3):
        w.grad = torch.full_like(w, float(step + 1))
        opt.step()
    assert_on(opt, torch.device("cpu"))
    sd = opt.state_dict()
    assert sd["state"]["w"][0]["step"] == 3
    assert all(t.device.type == "cpu" for t in state_dict_tensors(sd))
    opt.load_state_dict(sd)
    assert_on(opt, torch.device("cpu"))


@pytest.mark.mpi(min_size=4)
def test_device_hygiene_four_ranks_and_checkpoint_to_two(
        comm: Communicator, meta_default_device: Callable[[], None]) -> None:
    """Under the stand-in: train on all ranks, checkpoint, continue on half of them."""
    data = batches(6, seed=3)
    ref_model, model, twin = Net(), Net(), Net()
    ref = DistributedShampoo(ref_model.named_parameters(), comm=comm, **KWARGS)
    train(ref_model, ref, data[:3])
    train(ref_model, ref, data[3:])
    half = comm.split(comm.rank % 2, name="half")
    try:
        meta_default_device()
        opt = DistributedShampoo(model.named_parameters(), comm=comm, **KWARGS)
        train(model, opt, data[:3])
        assert_on(opt, torch.device("cpu"))
        sd = opt.state_dict()
        twin.load_state_dict(model.state_dict())
        other = DistributedShampoo(twin.named_parameters(), comm=half, **KWARGS)
        other.load_state_dict(sd)
        assert_on(other, torch.device("cpu"))
        train(twin, other, data[3:])
    finally:
        half.free()
    assert_same(twin, ref_model)


# ------------------------------------------------------------------ host reads
@contextmanager
def counting_host_reads(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Record every Python-level read of a tensor's value on the host."""
    reads: list[str] = []
    with monkeypatch.context() as m:
        for name in HOST_READS:
            real = getattr(torch.Tensor, name)

            def wrapper(self: Tensor, *args: Any, _real: Any = real, _name: str = name,
                        **kwargs: Any) -> Any:
                reads.append(_name)
                return _real(self, *args, **kwargs)

            m.setattr(torch.Tensor, name, wrapper)
        yield reads


def test_one_host_read_per_step_whatever_the_number_of_blocks(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Steps between root recomputations read the device once (the status words), for
    one block as for 14; a root recomputation adds at most one read per root."""
    from mpi4py import MPI

    comm = Communicator(MPI.COMM_SELF, name="self")
    g = torch.Generator().manual_seed(0)
    per_step, root_step = [], []
    for shapes in ([(4, 4)], [(4, 4), (10,), (6, 10), (4, 5, 6)]):
        params = [nn.Parameter(torch.randn(s, generator=g)) for s in shapes]
        opt = DistributedShampoo(params, comm=comm, lr=0.01, momentum=0.9, weight_decay=0.01,
                                 max_preconditioner_dim=4, precondition_frequency=1000)
        counts = []
        for _ in range(4):
            for p in params:
                p.grad = torch.randn(p.shape, generator=g)
            with counting_host_reads(monkeypatch) as reads:
                opt.step()
            counts.append(len(reads))
        roots = sum(b.order for b in opt.layout.blocks)
        root_step.append(counts[0] <= 1 + roots)
        per_step.append(counts[1:])
    assert len(opt.layout.blocks) == 14
    assert per_step == [[1, 1, 1], [1, 1, 1]]
    assert root_step == [True, True]
