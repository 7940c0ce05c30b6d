"""The contracts of ``kfac_hpc.checkpoint.contracts``: who follows them, who is refused.

* ``KFACPreconditioner`` follows ``CheckpointPreconditioner``; torch optimizers and
  ``DistributedShampoo`` follow ``CheckpointOptimizer``; Shampoo alone is sharded and
  streams (asked with ``isinstance``, never by calling and catching an error).
* ``save``, ``BackgroundSaver.save`` and ``load`` refuse an object that lacks a member
  of its protocol with one ``TypeError`` naming the class, what it lacks and what to
  pass instead, before any state is taken: nothing is written, nothing is loaded.
* On several ranks, one rank's wrong object is refused on every rank (no rank waits).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import typing_extensions
from test_checkpoint_support import FakeKFAC, Net, make_optimizer, train_steps

from kfac_hpc import checkpoint
from kfac_hpc.checkpoint import contracts
from kfac_hpc.checkpoint.contracts import (
    CheckpointOptimizer,
    CheckpointPreconditioner,
    ShardedState,
    StreamingState,
)


@pytest.fixture
def comm1() -> Any:
    from mpi4py import MPI

    from kfac_hpc.comm import Communicator

    return Communicator(MPI.COMM_SELF, name="self")


class _NoLoad(FakeKFAC):
    """A preconditioner without ``load_state_dict``."""

    load_state_dict = None  # type: ignore[assignment]


class _NoEigenbases(FakeKFAC):
    """A preconditioner whose ``state_dict`` takes no ``eigenbases``."""

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        return super().state_dict(False)


class _NoStateDict:
    """An "optimizer" that can load but not report its state."""

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Take ``state_dict``."""


def _setup(comm: Any) -> tuple[Net, torch.optim.Optimizer, FakeKFAC]:
    torch.manual_seed(0)
    model = Net()
    opt = make_optimizer("sgd", model)
    train_steps(model, opt, comm, 0, 2)
    pre = FakeKFAC(model, comm)
    pre.update()
    return model, opt, pre


def test_member_tables_are_the_protocols() -> None:
    """The names an error lists are exactly the protocols' members."""
    assert typing_extensions.get_protocol_members(CheckpointPreconditioner) == set(
        contracts.PRECONDITIONER_MEMBERS)
    assert typing_extensions.get_protocol_members(CheckpointOptimizer) == set(
        contracts.OPTIMIZER_MEMBERS)


def test_the_package_objects_follow_the_contracts(comm1: Any) -> None:
    from kfac_hpc.kfac import KFACPreconditioner
    from kfac_hpc.shampoo import DistributedShampoo

    model = Net(batchnorm=False, dropout=0.0)
    sgd = make_optimizer("sgd", model)
    pre = KFACPreconditioner(model, comm=comm1, strategy="comm-opt", lr=0.05)
    shampoo = DistributedShampoo(model.named_parameters(), lr=0.01, comm=comm1)
    assert contracts.problems(optimizer=sgd, preconditioner=pre) == []
    assert contracts.problems(optimizer=shampoo, preconditioner=None) == []
    assert isinstance(pre, CheckpointPreconditioner)
    assert not isinstance(sgd, CheckpointPreconditioner)
    assert isinstance(shampoo, ShardedState) and isinstance(shampoo, StreamingState)
    assert not isinstance(sgd, ShardedState) and not isinstance(sgd, StreamingState)
    # the typed state dict is what state_dict() returns
    sd = pre.state_dict(eigenbases=True)
    assert {"step", "factors", "factor_updates", "config"} <= set(sd)


@pytest.mark.parametrize("kind", ["save", "background", "load"])
@pytest.mark.parametrize("wrong", ["no_load", "no_eigenbases", "optimizer"])
def test_an_object_lacking_a_member_is_refused(tmp_path: Path, comm1: Any, kind: str,
                                               wrong: str) -> None:
    model, opt, pre = _setup(comm1)
    good = checkpoint.save(tmp_path / "good.h5", model=model, optimizer=opt,
                           preconditioner=pre, step=2, comm=comm1)
    optimizer: Any = opt
    preconditioner: Any = pre
    if wrong == "no_load":
        preconditioner, lacks = _NoLoad(model, comm1), "_NoLoad) lacks load_state_dict(state)"
    elif wrong == "no_eigenbases":
        preconditioner, lacks = (_NoEigenbases(model, comm1), "_NoEigenbases) lacks the "
                                 "keyword argument eigenbases of state_dict()")
    else:
        optimizer, lacks = _NoStateDict(), "_NoStateDict) lacks state_dict()"
    directory = tmp_path / "ck"
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(TypeError) as caught:
        if kind == "save":
            checkpoint.save(directory, model=model, optimizer=optimizer,
                            preconditioner=preconditioner, step=3, comm=comm1)
        elif kind == "background":
            saver = checkpoint.BackgroundSaver(comm1)
            try:
                saver.save(directory, model=model, optimizer=optimizer,
                           preconditioner=preconditioner, step=3)
            finally:
                saver.wait()
                saver.close()
        else:
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1.0)
            before = {k: v.clone() for k, v in model.state_dict().items()}
            checkpoint.load(good, model=model, optimizer=optimizer,
                            preconditioner=preconditioner, comm=comm1)
    message = str(caught.value)
    assert lacks in message, message
    assert "nothing was done" in message
    assert "kfac_hpc.checkpoint.contracts.Checkpoint" in message  # what to pass instead
    assert not directory.exists() or not any(directory.iterdir())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_a_placeholder_outside_the_optimizer_is_refused(tmp_path: Path, comm1: Any) -> None:
    """Only a streaming optimizer's state may hold another rank's tensors."""
    from kfac_hpc.shampoo.state_io import RemoteTensor

    model, opt, pre = _setup(comm1)
    with pytest.raises(checkpoint.CheckpointError, match=r"/train/x: a placeholder of rank 1"):
        checkpoint.save(tmp_path, model=model, optimizer=opt, preconditioner=pre, step=2,
                        comm=comm1, extra={"x": RemoteTensor(1, (2,), "float32")})
    assert not any(tmp_path.iterdir())


def test_store_eigenbases_false_asks_the_preconditioner(tmp_path: Path, comm1: Any) -> None:
    """``store_eigenbases`` is passed to ``state_dict(eigenbases=...)``; no retry."""
    model, opt, pre = _setup(comm1)
    asked: list[bool] = []
    original = pre.state_dict

    def state_dict(eigenbases: bool = False) -> dict[str, Any]:
        asked.append(eigenbases)
        return original(eigenbases)

    pre.state_dict = state_dict  # type: ignore[method-assign]
    for store in (False, True):
        asked.clear()
        path = checkpoint.save(tmp_path / f"{store}.h5", model=model, optimizer=opt,
                               preconditioner=pre, step=2, comm=comm1, store_eigenbases=store)
        assert asked == [store]
        fresh = FakeKFAC(model, comm1)
        checkpoint.load(path, model=model, optimizer=opt, preconditioner=fresh, comm=comm1)
        assert bool(fresh.loaded_eigenbases) == store
        fresh.check(1)


@pytest.mark.mpi(min_size=2)
def test_one_ranks_wrong_object_is_refused_on_every_rank(comm: Any, tmp_path: Path) -> None:
    directory = Path(comm.broadcast_object(str(tmp_path))) / "ck"
    torch.manual_seed(0)
    model = Net()
    opt = make_optimizer("sgd", model)
    train_steps(model, opt, comm, 0, 1)
    last = comm.size - 1
    pre = (_NoLoad if comm.rank == last else FakeKFAC)(model, comm)
    pre.update()
    with pytest.raises(TypeError) as caught:
        checkpoint.save(directory, model=model, optimizer=opt, preconditioner=pre, step=1,
                        comm=comm)
    messages = comm.allgather_object(str(caught.value))
    assert len(set(messages)) == 1, messages
    assert "_NoLoad) lacks load_state_dict(state)" in messages[0]
    assert f"(rank {last})" in messages[0]
    assert not directory.exists() or not any(directory.iterdir())
    comm.barrier()
