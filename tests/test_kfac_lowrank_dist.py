"""Low-rank factors on several ranks: world-size invariance, owners' sketches, resume.

MPI: ``launch/local -n 2|4 python -m mpi4py -m pytest -q --with-mpi --only-mpi
tests/test_kfac_lowrank_dist.py``. The sketch of a factor is seeded by its name and the
K-FAC step, not by the rank that owns it, so P ranks reproduce one rank with the whole
batch (every strategy but DP-KFAC; float64: only the summation order differs), and a
checkpoint between two inverse updates resumes bitwise.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from mpi4py import MPI
from torch import nn

from kfac_hpc import GradientAverager, KFACPreconditioner, checkpoint
from kfac_hpc.comm import Communicator
from kfac_hpc.kfac.lowrank import randomized_eigh, sketch_generator

GLOBAL_BATCH = 8
LOW = {"low_rank": 4, "low_rank_min_dim": 20}  # A 48, G 40, A 41, G 30, A 31 sketched; G 5 full


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(47, 40), nn.Tanh(), nn.Linear(40, 30), nn.Tanh(),
                         nn.Linear(30, 5)).double()


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(70 + step)
    return (torch.randn(GLOBAL_BATCH, 47, generator=g, dtype=torch.float64),
            torch.randint(0, 5, (GLOBAL_BATCH,), generator=g))


class Run:
    """A model with its preconditioner, averager and SGD (momentum), from the same init."""

    def __init__(self, comm: Communicator, strategy: str, **kwargs: Any) -> None:
        self.model = net()
        fraction = 0.5 if strategy == "hybrid-opt" else None
        self.pre = KFACPreconditioner(
            self.model, comm=comm, strategy=strategy, grad_worker_fraction=fraction,
            damping=0.01, inv_update_steps=2, inv_dtype=torch.float64, **LOW, **kwargs)
        self.avg = GradientAverager(self.model, comm)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.1, momentum=0.9)

    def train(self, steps: range) -> None:
        train(self.model, self.pre, self.avg, self.opt, steps)


def train(model: nn.Module, pre: KFACPreconditioner, avg: GradientAverager,
          opt: torch.optim.Optimizer, steps: range) -> None:
    comm = pre.comm
    per_rank = GLOBAL_BATCH // comm.size
    mine = slice(comm.rank * per_rank, (comm.rank + 1) * per_rank)
    for step in steps:
        x, y = batch(step)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x[mine]), y[mine]).backward()
        avg.synchronize()
        pre.step()
        opt.step()


STRATEGIES = ["comm-opt", "mem-opt", "hybrid-opt"]


def check_owner_sketches(pre: KFACPreconditioner, step: int) -> None:
    """Every low-rank decomposition an owner holds is randomized_eigh of its factor with
    the (name, step) seed, whichever rank owns it (receivers hold the owner's bits)."""
    checked = 0
    for name, parts in pre.decompositions.items():
        state = pre.factors.get(name)
        if "rho" not in parts or state is None or state.average is None:
            continue
        ref = randomized_eigh(state.average, rank=4,
                              generator=sketch_generator(name, step, torch.device("cpu")))
        assert torch.equal(parts["Q"], ref.q) and torch.equal(parts["lambda"], ref.lam), name
        checked += 1
    assert sum(pre.comm.allgather_object(checked)) >= 5  # every low-rank factor, somewhere


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_low_rank_world_size_invariance(comm: Communicator, strategy: str) -> None:
    if strategy == "hybrid-opt" and comm.size % 2:
        pytest.skip("fraction 1/2 needs an even world")
    distributed = Run(comm, strategy)
    distributed.train(range(5))
    check_owner_sketches(distributed.pre, step=4)  # decomposed at this (last) step
    single = Run(Communicator(MPI.COMM_SELF), "comm-opt")
    single.train(range(5))
    for (name, p), q in zip(distributed.model.named_parameters(), single.model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-9, atol=1e-11, msg=f"{name} differs")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("strategy", [*STRATEGIES, "dp-kfac"])
def test_low_rank_checkpoint_resume_is_bitwise(comm: Communicator, tmp_path: Path,
                                               strategy: str) -> None:
    """checkpoint.save after step 3 (decomposed at step 2, next at 4) and load: the
    stored low-rank decompositions carry the run on exactly (then recomputed at 4)."""
    if strategy == "hybrid-opt" and comm.size % 2:
        pytest.skip("fraction 1/2 needs an even world")
    shared = Path(comm.broadcast_object(str(tmp_path)))
    ref = Run(comm, strategy)
    ref.train(range(3))
    checkpoint.save(shared, model=ref.model, optimizer=ref.opt, preconditioner=ref.pre, step=3,
                    comm=comm)
    ref.train(range(3, 5))
    check_owner_sketches(ref.pre, step=4)  # DP-KFAC too: its owners' own factors
    resumed = Run(comm, strategy)
    resumed.train(range(1))  # some state of its own first
    checkpoint.load(shared, model=resumed.model, optimizer=resumed.opt,
                    preconditioner=resumed.pre, comm=comm)
    resumed.train(range(3, 5))
    same = all(torch.equal(p, q) for p, q in zip(ref.model.parameters(),
                                                 resumed.model.parameters()))
    assert all(comm.allgather_object(same))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("strategy", [*STRATEGIES, "dp-kfac"])
def test_low_rank_names_its_device_on_ranks(comm: Communicator, strategy: str,
                                            meta_default_device: Any) -> None:
    """The CPU stand-in for a GPU at 2 and 4 ranks, resumed between inverse updates."""
    from test_kfac_device import check

    check(comm, strategy, {"low_rank": 3, "low_rank_min_dim": 16}, meta_default_device,
          resume_at=3)
