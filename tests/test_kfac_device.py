"""K-FAC keeps every tensor it creates on the model's device.

The CPU stand-in for a GPU run: the model and data live on the CPU, and the default
device is ``meta`` (fixture ``meta_default_device``), so a tensor made without naming
its device lands on ``meta`` and the step fails ("Tensor on device meta is not on the
expected device cpu"), where on a GPU it would have landed on the CPU. Each run is
compared with the same run without the stand-in: bitwise equal, and all state on the CPU.
Runs at 1 rank (serial stage) and at 2 and 4 ranks (MPI stages).
"""

from __future__ import annotations

import pytest
import torch
from mpi4py import MPI
from shared_cases import case_ids, fraction_for, kfac_cases, small_cnn, small_cnn_batches
from torch import nn

from kfac_hpc import KFACPreconditioner
from kfac_hpc.comm import Communicator

STEPS = 5
CASES = kfac_cases(input_shape=(4, 2, 5, 5))
IDS = case_ids(CASES)


def run(comm: Communicator, strategy: str, options: dict, stand_in=None, *,
        save_at: int | None = None, resume: bool = False) -> tuple[nn.Module, KFACPreconditioner]:
    """``STEPS`` steps of K-FAC on SGD (every rank the same batch: no averaging needed).

    ``save_at``: after that many steps, take the state dicts (between inverse updates);
    ``resume``: then rebuild model, optimizer and preconditioner from them and go on.
    """
    strategy, fraction = fraction_for(strategy, comm.size)
    batches = small_cnn_batches(STEPS * 2)

    def build(model: nn.Module) -> tuple[torch.optim.Optimizer, KFACPreconditioner]:
        pre = KFACPreconditioner(model, comm=comm, strategy=strategy, grad_worker_fraction=fraction,
                                 damping=0.01, inv_update_steps=2, inv_dtype=torch.float64,
                                 **options)
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), pre

    model = small_cnn()
    if stand_in is not None:
        stand_in()
    opt, pre = build(model)
    for step in range(STEPS):
        if step == save_at:
            saved = (model.state_dict(), opt.state_dict(), pre.state_dict())
        if step == save_at and resume:
            pre.close()
            with torch.device("cpu"):  # the user's model, on the CPU as before
                model = small_cnn()
            opt, pre = build(model)
            model.load_state_dict(saved[0])
            opt.load_state_dict(saved[1])
            pre.load_state_dict(saved[2])
        x, y = batches[step]
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        pre.step()
        opt.step()
    return model, pre


def check(comm: Communicator, strategy: str, options: dict, stand_in, resume_at=None) -> None:
    reference, _ = run(comm, strategy, options, save_at=resume_at)
    model, pre = run(comm, strategy, options, stand_in, save_at=resume_at,
                     resume=resume_at is not None)
    torch.set_default_device(None)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert p.device.type == "cpu"
        assert torch.equal(p, q), f"{name} differs from the run without the stand-in"
    state = pre.state_dict()
    tensors = [*state["factors"].values(),
               *(t for parts in state["eigenbases"].values() for t in parts.values()),
               *(t for parts in pre.decompositions.values() for t in parts.values())]
    assert {t.device.type for t in tensors} <= {"cpu"}  # a rank may own nothing (mem-opt)


@pytest.mark.parametrize("strategy, options", CASES, ids=IDS)
def test_stand_in_one_rank(strategy, options, meta_default_device):
    check(Communicator(MPI.COMM_SELF), strategy, options, meta_default_device)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("strategy, options", CASES, ids=IDS)
def test_stand_in_ranks(comm, strategy, options, meta_default_device):
    check(comm, strategy, options, meta_default_device)


@pytest.mark.parametrize("strategy, options", CASES[:5] + CASES[6:7], ids=IDS[:5] + IDS[6:7])
def test_stand_in_resume_between_inverse_updates(strategy, options, meta_default_device):
    check(Communicator(MPI.COMM_SELF), strategy, options, meta_default_device, resume_at=3)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("strategy, options", CASES, ids=IDS)
def test_stand_in_resume_ranks(comm, strategy, options, meta_default_device):
    check(comm, strategy, options, meta_default_device, resume_at=3)
