"""Shampoo checkpoints stream the owners' blocks to the writer (bounded memory).

``checkpoint.save`` of a DistributedShampoo never gathers the whole state: each owner
sends its blocks' tensors to rank 0 one message at a time, so rank 0 holds its own
blocks plus at most one other tensor (the same bound as K-FAC factors). The file is
the one ``state_dict()`` describes: it loads on a different number of ranks.
Run under MPI (``launch/local -n 2|4 ... --with-mpi --only-mpi``).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from test_checkpoint_support import Net, train_steps, weights_equal

from kfac_hpc import checkpoint
from kfac_hpc.checkpoint import writer

pytestmark = pytest.mark.mpi(min_size=2)


def _shampoo(model: torch.nn.Module, comm: Any) -> Any:
    from kfac_hpc.shampoo import DistributedShampoo

    # small blocks: many blocks, spread over every rank
    return DistributedShampoo(model.named_parameters(), lr=0.01, comm=comm,
                              precondition_frequency=2, max_preconditioner_dim=8)


def _state_bytes(opt: Any) -> tuple[int, int]:
    """(bytes of this rank's block tensors, largest single tensor)."""
    sizes = [v.numel() * v.element_size() for per in opt.state.values()
             for block in per.values() for v in block.values() if isinstance(v, torch.Tensor)]
    return sum(sizes), max(sizes, default=0)


def test_shampoo_save_streams_blocks_and_loads_on_one_rank(comm: Any, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    import kfac_hpc.shampoo.optimizer as shampoo_optimizer

    d = Path(comm.broadcast_object(str(tmp_path)))
    torch.manual_seed(0)
    model = Net()
    opt = _shampoo(model, comm)
    train_steps(model, opt, comm, 0, 3)
    own, largest = _state_bytes(opt)
    owns = comm.allgather_object(own)
    largest = max(comm.allgather_object(largest))
    assert sum(1 for b in owns if b) > 1  # really distributed

    def no_gather(*_: Any, **__: Any) -> Any:
        raise AssertionError("the save gathered the whole Shampoo state")

    received: list[int] = []
    held: list[int] = []
    recv, plan = writer._Receiver._recv, writer._plan

    def counting_recv(self: Any, e: Any) -> Any:
        if e.path.startswith("/optimizer/"):
            received.append(e.nbytes)
        return recv(self, e)

    def measuring_plan(c: Any, mine: Any, *args: Any, **kwargs: Any) -> Any:
        out = plan(c, mine, *args, **kwargs)
        held.append(sum(a.nbytes for p, a in out[1].local.items()
                        if p.startswith("/optimizer/")))
        return out

    monkeypatch.setattr(shampoo_optimizer, "gather_block_states", no_gather)
    monkeypatch.setattr(writer._Receiver, "_recv", counting_recv)
    monkeypatch.setattr(writer, "_plan", measuring_plan)
    path = checkpoint.save(d, model=model, optimizer=opt, step=3, comm=comm)
    monkeypatch.undo()

    # what the writer held of the Shampoo state at once: its own blocks (held anyway by
    # the optimizer; no copy) plus one received tensor at a time
    assert held == [own]
    if comm.rank == 0:
        assert len(received) > 0 and max(received) <= largest
        assert sum(received) == sum(owns) - own  # every other block, streamed once
        assert own + max(received) < sum(owns)  # well below the whole state
        assert checkpoint.verify_file(path).ok
    full = opt.state_dict()  # the gathered reference (collective)

    # the file loads on a different number of ranks: rank 0 alone
    if comm.rank == 0:
        from mpi4py import MPI

        from kfac_hpc.comm import Communicator

        solo = Communicator(MPI.COMM_SELF, name="self")
        torch.manual_seed(7)
        fresh_model = Net()
        fresh = _shampoo(fresh_model, solo)
        checkpoint.load(path, model=fresh_model, optimizer=fresh, comm=solo)
        assert weights_equal(fresh_model, model)
        again = fresh.state_dict()
        assert again["steps"] == full["steps"]
        assert again["state"].keys() == full["state"].keys()
        for name, blocks in full["state"].items():
            for index, block in blocks.items():
                for key, value in block.items():
                    other = again["state"][name][index][key]
                    if isinstance(value, torch.Tensor):
                        assert torch.equal(value, other), (name, index, key)
                    else:
                        assert value == other, (name, index, key)
    comm.barrier()

    # and on the same ranks, training continues exactly (the reference: no save at all)
    torch.manual_seed(0)
    ref = Net()
    ref_opt = _shampoo(ref, comm)
    train_steps(ref, ref_opt, comm, 0, 6)
    torch.manual_seed(3)
    resumed = Net()
    resumed_opt = _shampoo(resumed, comm)
    checkpoint.load(d, model=resumed, optimizer=resumed_opt, comm=comm)
    train_steps(resumed, resumed_opt, comm, 3, 6)
    assert all(comm.allgather_object(weights_equal(ref, resumed)))


def _saved_after_three_steps(comm: Any, tmp_path: Path,
                             make: Callable[[torch.nn.Module, Any], Any] = _shampoo
                             ) -> tuple[Path, Any]:
    """The checkpoint directory and the Shampoo optimizer (``make(model, comm)``) saved
    in it after 3 steps."""
    d = Path(comm.broadcast_object(str(tmp_path)))
    torch.manual_seed(0)
    model = Net()
    opt = make(model, comm)
    train_steps(model, opt, comm, 0, 3)
    checkpoint.save(d, model=model, optimizer=opt, step=3, comm=comm)
    return d, opt


def _block_bytes(opt: Any) -> int:
    return _state_bytes(opt)[0]


def _same_blocks(a: dict[str, Any], b: dict[str, Any]) -> bool:
    if a.keys() != b.keys():
        return False
    for name, blocks in a.items():
        if blocks.keys() != b[name].keys():
            return False
        for index, block in blocks.items():
            for key, value in block.items():
                other = b[name][index][key]
                same = (torch.equal(value.cpu(), other.cpu()) if isinstance(value, torch.Tensor)
                        else value == other)
                if not same:
                    return False
    return True


def test_shampoo_load_reads_each_block_on_its_owner_only(comm: Any, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    """Saved on all ranks, loaded on one rank fewer (or the same two): each rank stages
    exactly the bytes of the blocks it owns now, once, and the state is the saved one."""
    from kfac_hpc.checkpoint import apply

    d, opt = _saved_after_three_steps(comm, tmp_path)
    full = opt.state_dict()
    total = sum(comm.allgather_object(_block_bytes(opt)))

    size = comm.size - 1 if comm.size > 2 else comm.size
    sub = comm.split(0 if comm.rank < size else 1)
    if comm.rank < size:
        staged: list[int] = []
        prepare = apply.prepare

        def recording(c: Any, plan: Any, arrays: Any, *args: Any, **kwargs: Any) -> Any:
            staged.append(sum(a.nbytes for p, a in arrays.items()
                              if p.startswith("/optimizer/state/")))
            return prepare(c, plan, arrays, *args, **kwargs)

        monkeypatch.setattr(apply, "prepare", recording)
        torch.manual_seed(9)
        fresh_model = Net()
        fresh = _shampoo(fresh_model, sub)
        checkpoint.load(d, model=fresh_model, optimizer=fresh, comm=sub)
        monkeypatch.undo()
        own = _block_bytes(fresh)
        assert staged == [own]  # its own blocks, nothing else
        assert sum(sub.allgather_object(own)) == total
        assert sum(1 for b in sub.allgather_object(own) if b) > 1
        assert _same_blocks(full["state"], fresh.state_dict()["state"])
    sub.free()
    comm.barrier()


class _RefusingNet(Net):
    refuse = False

    def load_state_dict(self, *args: Any, **kwargs: Any) -> Any:
        if self.refuse:
            raise RuntimeError("this model refuses to load")
        return super().load_state_dict(*args, **kwargs)


def test_a_failing_model_load_puts_every_ranks_shampoo_blocks_back(comm: Any,
                                                                   tmp_path: Path) -> None:
    """The rollback snapshot of a sharded optimizer is each rank's own blocks."""
    from kfac_hpc.checkpoint import CheckpointError

    d, opt = _saved_after_three_steps(comm, tmp_path)

    torch.manual_seed(4)
    live = _RefusingNet()
    live_opt = _shampoo(live, comm)
    train_steps(live, live_opt, comm, 0, 2)
    kept = live_opt.state_dict()
    live.refuse = comm.rank == comm.size - 1
    with pytest.raises(CheckpointError, match="loading the model state failed") as err:
        checkpoint.load(d, model=live, optimizer=live_opt, comm=comm)
    assert "nothing was loaded" in str(err.value)
    assert _same_blocks(kept["state"], live_opt.state_dict()["state"])
    assert not _same_blocks(kept["state"], opt.state_dict()["state"])


@pytest.mark.parametrize("option", ["subspace", "vectors"])
def test_options_that_change_the_block_state_resume_bitwise(comm: Any, tmp_path: Path,
                                                            option: str) -> None:
    """SubspaceRoots' bases (``basis_<i>``) and vectors without factors
    (``precondition_vectors=False``) go through the streamed HDF5 file: a run resumed
    at step 3 (a refresh follows at step 5) equals the uninterrupted one bit for bit."""
    from kfac_hpc.shampoo import DistributedShampoo, SubspaceRoots

    kwargs: dict[str, Any] = ({"root_method": SubspaceRoots(fresh_every=3, tolerance=1.0)}
                              if option == "subspace" else {"precondition_vectors": False})

    def make(model: torch.nn.Module) -> Any:
        return DistributedShampoo(model.named_parameters(), lr=0.01, comm=comm,
                                  precondition_frequency=2, max_preconditioner_dim=8, **kwargs)

    d = Path(comm.broadcast_object(str(tmp_path)))
    torch.manual_seed(0)
    straight = Net()
    opt = make(straight)
    train_steps(straight, opt, comm, 0, 3)
    checkpoint.save(d, model=straight, optimizer=opt, step=3, comm=comm)
    train_steps(straight, opt, comm, 3, 8)
    states = comm.allgather_object([sorted(k for k in s if k.startswith(("factor_", "basis_")))
                                    for per in opt.state.values() for s in per.values()])
    blocks = [keys for rank in states for keys in rank]
    if option == "subspace":
        assert blocks and all("basis_0" in keys for keys in blocks)
    else:  # the vectors (biases, batch-norm) have none, the matrices have factors
        assert [] in blocks and any("factor_0" in keys for keys in blocks)

    torch.manual_seed(123)  # the load restores the RNG
    resumed = Net()
    again = make(resumed)
    checkpoint.load(d, model=resumed, optimizer=again, comm=comm)
    train_steps(resumed, again, comm, 3, 8)
    assert weights_equal(straight, resumed)


@pytest.mark.parametrize("saved, built", [(True, False), (False, True)])
def test_a_checkpoint_of_the_other_vectors_setting_loads_every_block(
        comm: Any, tmp_path: Path, saved: bool, built: bool) -> None:
    """Saved with one ``precondition_vectors``, loaded into an optimizer built with the
    other: the file hands each rank the blocks it owns, and the load keeps those owners,
    so every saved block's state arrives (none starts again from zero)."""
    from kfac_hpc.shampoo import DistributedShampoo

    def make(model: torch.nn.Module, vectors: bool) -> Any:
        return DistributedShampoo(model.named_parameters(), lr=0.01, comm=comm,
                                  max_preconditioner_dim=8, precondition_vectors=vectors)

    d, opt = _saved_after_three_steps(comm, tmp_path, lambda model, _: make(model, saved))
    reference = opt.state_dict()
    torch.manual_seed(0)
    resumed = Net()
    again = make(resumed, built)
    checkpoint.load(d, model=resumed, optimizer=again, comm=comm)
    loaded = again.state_dict()
    assert again.param_groups[0]["precondition_vectors"] is saved
    assert {(n, i) for n in loaded["state"] for i in loaded["state"][n]} == \
        {(n, i) for n in reference["state"] for i in reference["state"][n]}
    assert _same_blocks(loaded["state"], reference["state"])
