"""Loaded state lands on the live model's device, and the checkpoint code names the
device of every tensor it creates.

* A model on ``meta`` (a device other than the CPU, without a GPU): after a load, the
  optimizer state, the preconditioner's factors and decompositions sit on ``meta``,
  not on the CPU where the file's bytes were read.
* The CPU stand-in for a GPU run (fixture ``meta_default_device``): model and data on
  the CPU, every tensor created without ``device=`` on ``meta``. K-FAC saves between two
  inverse updates and a fresh run resumes from the file: bitwise the uninterrupted run,
  all state on the CPU. At 1 rank (serial stage) and at 2 and 4 ranks (MPI stages).

The same resume on a real GPU is in ``tests/gpu/test_checkpoint_gpu.py``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from mpi4py import MPI
from shared_cases import small_cnn, small_cnn_batches, train_kfac
from test_checkpoint_support import FakeKFAC, Net, make_optimizer, train_steps
from torch import nn

from kfac_hpc import checkpoint
from kfac_hpc.checkpoint.devices import model_device, place_torch_optimizer
from kfac_hpc.comm import Communicator

STEPS, SAVE_AT = 6, 3  # inverse updates at K-FAC steps 0, 2, 4: the save is between two


def _self_comm() -> Communicator:
    return Communicator(MPI.COMM_SELF, name="self")


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, list | tuple):
        return [t for v in obj for t in _tensors(v)]
    return []


# ------------------------------------------------------------------ the rule
@pytest.mark.filterwarnings("ignore:for .* copying from a non-meta parameter")
def test_state_follows_the_model_to_its_device(tmp_path: Path) -> None:
    """Saved from the CPU, loaded into a model on ``meta``: nothing loaded stays on the
    CPU except what torch itself keeps there (Adam's ``step``)."""
    comm = _self_comm()
    torch.manual_seed(0)
    model = Net()
    opt = make_optimizer("adam", model)
    pre = FakeKFAC(model, comm)
    train_steps(model, opt, comm, 0, 2)
    pre.update()
    checkpoint.save(tmp_path, model=model, optimizer=opt, preconditioner=pre, step=2, comm=comm)

    meta = Net().to("meta")
    meta_opt = make_optimizer("adam", meta)
    meta_pre = FakeKFAC(meta, comm)
    assert model_device(meta) == torch.device("meta")
    info = checkpoint.load(tmp_path, model=meta, optimizer=meta_opt, preconditioner=meta_pre,
                           comm=comm)
    assert info.loaded == ["kfac", "optimizer", "model", "rng"]
    state = meta_opt.state_dict()["state"]
    assert state and all(s["exp_avg"].device.type == "meta" for s in state.values())
    assert all(s["step"].device.type == "cpu" for s in state.values())  # torch's own rule
    factors = [t for t in meta_pre.factors.values() if t is not None]
    eigen = _tensors(meta_pre.loaded_eigenbases)
    assert factors and eigen
    assert {t.device.type for t in factors + eigen} == {"meta"}


def test_fused_or_capturable_step_goes_to_the_device() -> None:
    """torch keeps ``step`` on the host unless the group is fused or capturable."""
    p = torch.zeros(2, device="meta", requires_grad=True)
    opt = torch.optim.Adam([p], capturable=True)
    sd = {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.zeros(2)}},
          "param_groups": opt.state_dict()["param_groups"]}
    placed = place_torch_optimizer(opt, sd)
    assert {t.device.type for t in placed["state"][0].values()} == {"meta"}


# ------------------------------------------------------------------ the stand-in run
KFAC_CASES = [("comm-opt", {}), ("mem-opt", {}), ("dp-kfac", {}),
              ("comm-opt", {"factor_sync": "inverse"})]
KFAC_IDS = [s + "".join(f"-{k}={v}" for k, v in o.items()) for s, o in KFAC_CASES]


def build(model: nn.Module, comm: Communicator, strategy: str,
          options: dict[str, Any]) -> tuple[torch.optim.Optimizer, Any]:
    from kfac_hpc import KFACPreconditioner

    pre = KFACPreconditioner(model, comm=comm, strategy=strategy, damping=0.01,
                             inv_update_steps=2, inv_dtype=torch.float64, **options)
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), pre


def resume_under_stand_in(comm: Communicator, directory: Path, strategy: str,
                          options: dict[str, Any], stand_in: Any) -> None:
    data = small_cnn_batches(STEPS)
    ref = small_cnn()
    stand_in()  # from here on, a tensor made without device= lands on meta
    ref_opt, ref_pre = build(ref, comm, strategy, options)
    train_kfac(ref, ref_opt, ref_pre, data[:SAVE_AT])
    checkpoint.save(directory, model=ref, optimizer=ref_opt, preconditioner=ref_pre,
                    step=SAVE_AT, comm=comm)
    train_kfac(ref, ref_opt, ref_pre, data[SAVE_AT:])  # the uninterrupted run

    with torch.device("cpu"):  # the user's model, on the CPU as before
        model = small_cnn()
    opt, pre = build(model, comm, strategy, options)
    train_kfac(model, opt, pre, data[:1])  # some state of its own, replaced by the load
    info = checkpoint.load(directory, model=model, optimizer=opt, preconditioner=pre, comm=comm)
    assert "kfac" in info.loaded and info.step == SAVE_AT
    loaded = _tensors(opt.state_dict()["state"]) + _tensors(pre.state_dict())
    assert loaded and {t.device.type for t in loaded} == {"cpu"}
    train_kfac(model, opt, pre, data[SAVE_AT:])
    same = all(torch.equal(p, q) for p, q in zip(ref.parameters(), model.parameters()))
    assert all(comm.allgather_object(same)), "the resumed run differs from the uninterrupted one"
    mine = _tensors(pre.state_dict())  # a rank may own no factor at all
    assert {t.device.type for t in mine} <= {"cpu"} and sum(comm.allgather_object(len(mine)))


def _shared_dir(comm: Communicator, tmp_path: Path) -> Path:
    return Path(comm.broadcast_object(str(tmp_path)))


@pytest.mark.parametrize("strategy, options", KFAC_CASES, ids=KFAC_IDS)
def test_kfac_resume_under_the_stand_in_one_rank(tmp_path: Path, meta_default_device: Any,
                                                 strategy: str, options: dict[str, Any]) -> None:
    resume_under_stand_in(_self_comm(), tmp_path, strategy, options, meta_default_device)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("strategy, options", KFAC_CASES, ids=KFAC_IDS)
def test_kfac_resume_under_the_stand_in_ranks(comm: Communicator, tmp_path: Path,
                                              meta_default_device: Any, strategy: str,
                                              options: dict[str, Any]) -> None:
    resume_under_stand_in(comm, _shared_dir(comm, tmp_path), strategy, options,
                          meta_default_device)


@pytest.mark.mpi(min_size=4)
def test_kfac_resume_under_the_stand_in_four_ranks(comm: Communicator, tmp_path: Path,
                                                   meta_default_device: Any) -> None:
    resume_under_stand_in(comm, _shared_dir(comm, tmp_path), "hybrid-opt",
                          {"grad_worker_fraction": 0.5}, meta_default_device)
