"""Checkpoints on CUDA: a GPU run resumes on the GPU, bitwise, between inverse updates.

K-FAC (inverse updates every 2nd step) saves after step 3, between two inverse
updates, so the stale decompositions must come from the file. A fresh run (other
initial weights, some state of its own) loads it and continues: its parameters equal
the uninterrupted run's bitwise, and everything loaded (model, optimizer state,
factors, decompositions) is on the device, where the uninterrupted run keeps it. At 1
rank and at 2 ranks (``@pytest.mark.mpi(min_size=2)``). ``KFAC_HPC_TEST_DEVICE=cpu``
runs the same logic on the CPU (a check of the test on a machine without a GPU).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from mpi4py import MPI
from shared_cases import train_kfac
from torch import nn

from kfac_hpc import KFACPreconditioner, checkpoint
from kfac_hpc.comm import Communicator

pytestmark = pytest.mark.gpu

STEPS, SAVE_AT = 6, 3  # inverse updates at K-FAC steps 0, 2, 4
CASES = [("comm-opt", {}), ("mem-opt", {}), ("dp-kfac", {}),
         ("comm-opt", {"factor_sync": "inverse"})]
IDS = [s + "".join(f"-{k}={v}" for k, v in o.items()) for s, o in CASES]


def cnn(device: torch.device, seed: int) -> nn.Module:
    """Two 3x3 layers of one input shape and three of one output shape: on the GPU path
    their statistics are grouped (kfac_hpc.kfac.statistics_groups), so the resumed run's
    first factor step must group as the uninterrupted run's does."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(2, 8, 3, padding=1), nn.ReLU(),
                         nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(),
                         nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, stride=2),
                         nn.ReLU(), nn.Flatten(), nn.Linear(32, 3)).to(device=device,
                                                                      dtype=torch.float64)


def batches(device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(11)
    return [(torch.randn(4, 2, 6, 6, generator=g, dtype=torch.float64).to(device),
             torch.randint(0, 3, (4,), generator=g).to(device)) for _ in range(STEPS)]


def build(model: nn.Module, comm: Communicator, strategy: str, options: dict[str, Any],
          optimizer: str) -> tuple[torch.optim.Optimizer, KFACPreconditioner]:
    pre = KFACPreconditioner(model, comm=comm, strategy=strategy, damping=0.01,
                             inv_update_steps=2, inv_dtype=torch.float64, **options)
    if optimizer == "adam":
        return torch.optim.Adam(model.parameters(), lr=0.01), pre
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), pre


def tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in tensors(v)]
    if isinstance(obj, list | tuple):
        return [t for v in obj for t in tensors(v)]
    return []


def kfac_tensors(pre: KFACPreconditioner) -> list[torch.Tensor]:
    found = [s.average for s in pre.factors.values() if s.average is not None]
    return found + [t for parts in pre.decompositions.values() for t in parts.values()]


def devices_of_state(opt: torch.optim.Optimizer) -> dict[tuple[int, str], torch.device]:
    return {(i, k): v.device for i, s in opt.state_dict()["state"].items()
            for k, v in s.items() if isinstance(v, torch.Tensor)}


def resume_on(device: torch.device, comm: Communicator, directory: Path, strategy: str,
              options: dict[str, Any], optimizer: str = "sgd") -> None:
    data = batches(device)
    ref = cnn(device, seed=0)
    ref_opt, ref_pre = build(ref, comm, strategy, options, optimizer)
    train_kfac(ref, ref_opt, ref_pre, data[:SAVE_AT])
    checkpoint.save(directory, model=ref, optimizer=ref_opt, preconditioner=ref_pre,
                    step=SAVE_AT, comm=comm)
    saved_devices = devices_of_state(ref_opt)
    train_kfac(ref, ref_opt, ref_pre, data[SAVE_AT:])  # the uninterrupted run

    model = cnn(device, seed=1)  # everything must come from the file
    opt, pre = build(model, comm, strategy, options, optimizer)
    train_kfac(model, opt, pre, data[:1])
    info = checkpoint.load(directory, model=model, optimizer=opt, preconditioner=pre, comm=comm)
    assert "kfac" in info.loaded and info.step == SAVE_AT
    # on the device, as the run that saved had it (torch keeps Adam's step on the host)
    assert devices_of_state(opt) == saved_devices
    assert all(t.device == device for t in tensors(opt.state_dict()["state"])
               if t.is_floating_point() and t.dim() > 0)
    mine = tensors(pre.state_dict()) + kfac_tensors(pre)
    assert {t.device for t in mine} <= {device} and sum(comm.allgather_object(len(mine)))
    assert all(p.device == device for p in model.parameters())

    train_kfac(model, opt, pre, data[SAVE_AT:])
    same = all(torch.equal(p, q) for p, q in zip(ref.parameters(), model.parameters()))
    assert all(comm.allgather_object(same)), "the resumed run differs from the uninterrupted one"
    assert {t.device for t in kfac_tensors(pre)} <= {device}


@pytest.mark.parametrize("strategy, options", CASES, ids=IDS)
def test_exact_resume_on_the_device_one_rank(device: torch.device, tmp_path: Path,
                                             strategy: str, options: dict[str, Any]) -> None:
    resume_on(device, Communicator(MPI.COMM_SELF, name="self"), tmp_path, strategy, options)


def test_adam_state_keeps_torchs_placement(device: torch.device, tmp_path: Path) -> None:
    resume_on(device, Communicator(MPI.COMM_SELF, name="self"), tmp_path, "comm-opt", {},
              optimizer="adam")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("strategy, options", CASES, ids=IDS)
def test_exact_resume_on_the_device_ranks(device: torch.device, comm: Communicator,
                                          tmp_path: Path, strategy: str,
                                          options: dict[str, Any]) -> None:
    directory = Path(comm.broadcast_object(str(tmp_path)))
    resume_on(device, comm, directory, strategy, options)
