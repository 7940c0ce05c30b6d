"""HDF5 checkpoints across MPI ranks (run under mpiexec; see tests/run_all.sh).

Every rank has its own RNG streams and owns different K-FAC factors, so these tests
see the per-rank parts of the format: RNG under ``/rng/rank_<r>``, factors sent to the
writer and routed back to their (current) owners, errors agreed on by all ranks.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest
import torch
from test_checkpoint_support import (
    FakeKFAC,
    Net,
    make_optimizer,
    optimizer_states_equal,
    train_steps,
    weights_equal,
)

import kfac_hpc
from kfac_hpc import checkpoint
from kfac_hpc.checkpoint import CheckpointError

pytestmark = pytest.mark.mpi(min_size=2)


def _shared_dir(comm: Any, tmp_path: Path) -> Path:
    """One directory for all ranks (rank 0's tmp_path)."""
    return Path(comm.broadcast_object(str(tmp_path)))


def _seed_per_rank(comm: Any, base: int) -> None:
    torch.manual_seed(base + comm.rank)
    np.random.seed(base + comm.rank)
    random.seed(base + comm.rank)


def _draws() -> tuple[list[float], float, float]:
    return torch.rand(3).tolist(), float(np.random.rand()), random.random()


def _agree_all(comm: Any, ok: bool) -> bool:
    return all(comm.allgather_object(bool(ok)))


def test_round_trip_with_per_rank_rng(comm: Any, tmp_path: Path) -> None:
    d = _shared_dir(comm, tmp_path)
    torch.manual_seed(0)
    model = Net()
    opt = make_optimizer("adam", model)
    _seed_per_rank(comm, 100)
    train_steps(model, opt, comm, 0, 2)
    path = checkpoint.save(d, model=model, optimizer=opt, step=2, comm=comm,
                           extra={"rank0_says": comm.rank})
    want = _draws()
    assert len({str(x) for x in comm.allgather_object(want)}) == comm.size  # ranks differ

    _seed_per_rank(comm, 5)
    torch.manual_seed(1)
    fresh = Net()
    fresh_opt = make_optimizer("adam", fresh)
    info = checkpoint.load(d, model=fresh, optimizer=fresh_opt, comm=comm)
    assert info.path == path and info.world_size == comm.size
    assert info.extra == {"rank0_says": 0}  # extra is rank 0's
    assert info.rng == "restored: each rank its own state"
    assert _agree_all(comm, _draws() == want)
    assert _agree_all(comm, weights_equal(model, fresh) and optimizer_states_equal(opt, fresh_opt))
    # Buffers (BatchNorm running statistics) are rank 0's on every rank.
    reference = comm.broadcast_object(model.state_dict() if comm.rank == 0 else None)
    assert _agree_all(comm, all(torch.equal(reference[k], v)
                                for k, v in fresh.state_dict().items()))


@pytest.mark.parametrize("read_mode", ["root", "owners", "all"])
def test_exact_resume_sgd_data_parallel(comm: Any, tmp_path: Path, read_mode: str) -> None:
    d = _shared_dir(comm, tmp_path)
    torch.manual_seed(0)
    ref = Net()
    ref_opt = make_optimizer("sgd", ref)
    _seed_per_rank(comm, 7)
    train_steps(ref, ref_opt, comm, 0, 3)
    checkpoint.save(d, model=ref, optimizer=ref_opt, step=3, comm=comm)
    train_steps(ref, ref_opt, comm, 3, 6)

    torch.manual_seed(42)
    model = Net()
    opt = make_optimizer("sgd", model)
    checkpoint.load(d, model=model, optimizer=opt, comm=comm, read_mode=read_mode)  # type: ignore[arg-type]
    train_steps(model, opt, comm, 3, 6)
    assert _agree_all(comm, weights_equal(ref, model) and optimizer_states_equal(ref_opt, opt))


@pytest.mark.parametrize("strategy", ["mem-opt", "dp-kfac"])
@pytest.mark.parametrize("read_mode", ["root", "owners", "all"])
def test_factors_go_to_their_owners(comm: Any, tmp_path: Path, strategy: str,
                                    read_mode: str) -> None:
    d = _shared_dir(comm, tmp_path)
    model = Net()
    pre = FakeKFAC(model, comm, strategy)
    assert len({pre.factor_owner(k) for k in pre.factor_keys()}) > 1  # really distributed
    for _ in range(3):
        pre.update()
    comm.reset_traffic()
    path = checkpoint.save(d, model=model, optimizer=None, preconditioner=pre, step=3,
                           comm=comm, store_eigenbases=True, prefetch=read_mode == "all")
    # Serial HDF5: one message per factor (and eigenbasis part) owned elsewhere, none for
    # its own. Parallel HDF5: every owner writes its own, nothing travels.
    foreign = [k for k in pre.factor_keys() if pre.factor_owner(k) != 0]
    if h5py.get_config().mpi:
        assert comm.stats.calls_of("recv") == comm.stats.calls_of("send") == 0
    elif comm.rank == 0:
        rng_parts = 3 * (comm.size - 1)
        assert comm.stats.calls_of("recv") == 3 * len(foreign) + rng_parts
    else:
        assert comm.stats.calls_of("send") == 3 * len(pre.owned()) + 3

    fresh = FakeKFAC(model, comm, strategy)
    info = checkpoint.load(path, model=model, optimizer=None, preconditioner=fresh, comm=comm,
                           read_mode=read_mode)  # type: ignore[arg-type]
    assert "kfac" in info.loaded
    fresh.check(3)
    assert set(fresh.loaded_eigenbases) == set(fresh.owned())

    # Elastic: the same file on one rank (rank 0 alone, COMM_SELF) gets every factor.
    if comm.rank == 0:
        from mpi4py import MPI

        from kfac_hpc.comm import Communicator

        solo = Communicator(MPI.COMM_SELF, name="self")
        one = FakeKFAC(model, solo, strategy)
        info = checkpoint.load(path, model=model, optimizer=None, preconditioner=one,
                               comm=solo)
        one.check(3)
        assert sorted(one.owned()) == sorted(one.factor_keys())
        assert info.rng.startswith("not restored: world size changed")
    comm.barrier()


@pytest.mark.parametrize("read_mode", ["root", "owners", "all"])
def test_damaged_factor_fails_on_every_rank_with_the_same_error(
        comm: Any, tmp_path: Path, read_mode: str) -> None:
    d = _shared_dir(comm, tmp_path)
    model = Net()
    pre = FakeKFAC(model, comm, "mem-opt")
    pre.update()
    path = checkpoint.save(d, model=model, optimizer=None, preconditioner=pre, step=1,
                           comm=comm)
    victim = next(k for k in pre.factor_keys() if pre.factor_owner(k) == 1)
    if comm.rank == 0:
        import h5py

        with h5py.File(path, "r") as f:
            ds = f["kfac/" + victim]
            where = ds.id.get_chunk_info(0).byte_offset if ds.chunks else ds.id.get_offset()
        with open(path, "r+b") as fh:
            fh.seek(where + 4)
            b = fh.read(1)
            fh.seek(where + 4)
            fh.write(bytes([b[0] ^ 1]))
    comm.barrier()
    torch.manual_seed(3)
    live = Net()
    before = {k: v.clone() for k, v in live.state_dict().items()}
    fresh = FakeKFAC(live, comm, "mem-opt")
    message = ""
    try:
        checkpoint.load(path, model=live, optimizer=None, preconditioner=fresh, comm=comm,
                        read_mode=read_mode)  # type: ignore[arg-type]
    except CheckpointError as exc:
        message = str(exc)
    messages = comm.allgather_object(message)
    assert messages[0] and len(set(messages)) == 1, messages
    assert f"/kfac/{victim}" in messages[0] and "nothing was loaded" in messages[0]
    assert all(torch.equal(before[k], v) for k, v in live.state_dict().items())
    assert all(v is None for v in fresh.factors.values())


class _Failing(FakeKFAC):
    def state_dict(self, eigenbases: bool = False) -> dict[str, Any]:
        if self.comm.rank == self.comm.size - 1:
            raise RuntimeError("disk quota of the imagination exceeded")
        return super().state_dict(eigenbases)


def test_save_errors_are_raised_on_every_rank(comm: Any, tmp_path: Path) -> None:
    d = _shared_dir(comm, tmp_path)
    model = Net()
    opt = make_optimizer("sgd", model)
    with pytest.raises(CheckpointError, match="cannot store a object"):
        checkpoint.save(d, model=model, optimizer=opt, step=1, comm=comm,
                        extra={"x": object()} if comm.rank == 0 else None)
    with pytest.raises(CheckpointError, match=f"rank {comm.size - 1}: .*imagination"):
        checkpoint.save(d, model=model, optimizer=opt, preconditioner=_Failing(model, comm),
                        step=2, comm=comm)
    assert checkpoint.latest(d) is None
    comm.barrier()


# ------------------------------------------------------ the real K-FAC and Shampoo
KFACPreconditioner = getattr(kfac_hpc, "KFACPreconditioner", None)


def _shampoo() -> Any:
    try:
        from kfac_hpc.shampoo import DistributedShampoo
    except ImportError:
        return None
    return DistributedShampoo


@pytest.mark.skipif(KFACPreconditioner is None, reason="kfac_hpc.KFACPreconditioner not built")
@pytest.mark.parametrize("strategy", ["comm-opt", "mem-opt", "hybrid-opt", "dp-kfac"])
@pytest.mark.parametrize("eigen", [False, True])
def test_exact_resume_kfac(comm: Any, tmp_path: Path, strategy: str, eigen: bool) -> None:
    """eigen=False: decompositions every step, recomputed after the load. eigen=True:
    decompositions every 4th step and the checkpoint (after step 3, mid-interval)
    stores them (``store_eigenbases=True``) - otherwise the resume would differ."""
    assert KFACPreconditioner is not None
    d = _shared_dir(comm, tmp_path)
    kwargs: dict[str, Any] = {"grad_worker_fraction": 0.5} if strategy == "hybrid-opt" else {}
    if eigen:
        kwargs["inv_update_steps"] = 4

    def build(seed: int) -> tuple[Net, Any, Any]:
        torch.manual_seed(seed)
        model = Net()
        opt = make_optimizer("sgd", model)
        pre = KFACPreconditioner(model, comm=comm, strategy=strategy, lr=0.05, **kwargs)
        return model, opt, pre

    ref, ref_opt, ref_pre = build(0)
    _seed_per_rank(comm, 11)
    train_steps(ref, ref_opt, comm, 0, 3, preconditioner=ref_pre)
    checkpoint.save(d, model=ref, optimizer=ref_opt, preconditioner=ref_pre, step=3, comm=comm,
                    store_eigenbases=eigen)
    train_steps(ref, ref_opt, comm, 3, 6, preconditioner=ref_pre)

    model, opt, pre = build(0)  # same init (K-FAC checks replicas), state from the file
    train_steps(model, opt, comm, 0, 1, preconditioner=pre)  # and some state of its own
    info = checkpoint.load(d, model=model, optimizer=opt, preconditioner=pre, comm=comm)
    assert info.strategy == strategy and "kfac" in info.loaded
    train_steps(model, opt, comm, 3, 6, preconditioner=pre)
    assert _agree_all(comm, weights_equal(ref, model) and optimizer_states_equal(ref_opt, opt))


@pytest.mark.skipif(_shampoo() is None, reason="kfac_hpc.shampoo.DistributedShampoo not built")
def test_exact_resume_shampoo(comm: Any, tmp_path: Path) -> None:
    shampoo = _shampoo()
    d = _shared_dir(comm, tmp_path)
    torch.manual_seed(0)
    ref = Net()
    ref_opt = shampoo(ref.named_parameters(), lr=0.01, comm=comm, precondition_frequency=2)
    _seed_per_rank(comm, 13)
    train_steps(ref, ref_opt, comm, 0, 3)
    checkpoint.save(d, model=ref, optimizer=ref_opt, step=3, comm=comm)
    train_steps(ref, ref_opt, comm, 3, 6)

    torch.manual_seed(5)
    model = Net()
    opt = shampoo(model.named_parameters(), lr=0.01, comm=comm, precondition_frequency=2)
    info = checkpoint.load(d, model=model, optimizer=opt, comm=comm)
    assert info.loaded == ["optimizer", "model", "rng"]
    train_steps(model, opt, comm, 3, 6)
    assert _agree_all(comm, weights_equal(ref, model))


# ------------------------------------------------------ elastic: P ranks <-> P/2 ranks
def _half(comm: Any) -> tuple[Any, bool]:
    """A communicator of the first P/2 ranks (and one of the others), and membership."""
    small = comm.rank < comm.size // 2
    return comm.split(0 if small else 1, name="half"), small


@pytest.mark.parametrize("strategy", ["mem-opt", "dp-kfac"])
def test_elastic_fake_factors_reach_new_owners(comm: Any, tmp_path: Path,
                                               strategy: str) -> None:
    d = _shared_dir(comm, tmp_path)
    sub, small = _half(comm)
    model = Net()
    pre = FakeKFAC(model, comm, strategy)
    for _ in range(2):
        pre.update()
    checkpoint.save(d / "big", model=model, optimizer=None, preconditioner=pre, step=2,
                    comm=comm)
    if small:  # P -> P/2
        fresh = FakeKFAC(model, sub, strategy)
        info = checkpoint.load(d / "big", model=model, optimizer=None, preconditioner=fresh,
                               comm=sub)
        assert info.world_size == comm.size and "kfac" in info.loaded
        fresh.check(2)
        few = FakeKFAC(model, sub, strategy)
        few.update()
        checkpoint.save(d / "small", model=model, optimizer=None, preconditioner=few, step=1,
                        comm=sub)
    comm.barrier()
    many = FakeKFAC(model, comm, strategy)  # P/2 -> P
    checkpoint.load(d / "small", model=model, optimizer=None, preconditioner=many, comm=comm)
    many.check(1)
    sub.free()


ELASTIC = ["comm-opt", "mem-opt", "hybrid-opt"]


@pytest.mark.skipif(KFACPreconditioner is None, reason="kfac_hpc.KFACPreconditioner not built")
@pytest.mark.parametrize("strategy", ELASTIC)
def test_elastic_kfac_resume_matches_the_run_at_the_new_size(comm: Any, tmp_path: Path,
                                                             strategy: str) -> None:
    """P -> P/2 and P/2 -> P resumes equal the uninterrupted run at the new size.

    The global batch and the data are the same on any number of ranks, so runs on P
    and P/2 ranks differ only by float32 rounding (sums in another order, amplified by
    the eigendecompositions): the resumed run must be as close to the uninterrupted
    one at its size as the uninterrupted runs on P and P/2 ranks are to each other
    (2x that distance, at most 1e-4 relative), and far closer than a resume that
    drops the K-FAC state.
    """
    assert KFACPreconditioner is not None
    d = _shared_dir(comm, tmp_path)
    sub, small = _half(comm)

    def kfac(c: Any, model: Net) -> Any:
        fraction = 0.5 if c.size >= 2 else 1.0
        kw = {"grad_worker_fraction": fraction} if strategy == "hybrid-opt" else {}
        return KFACPreconditioner(model, comm=c, strategy=strategy, lr=0.05, **kw)

    def build(c: Any) -> tuple[Net, Any, Any]:
        torch.manual_seed(0)
        model = Net(batchnorm=False, dropout=0.0)
        return model, make_optimizer("sgd", model), kfac(c, model)

    def flat(model: Net) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1) for p in model.parameters()])

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a - b).norm() / b.norm())

    def run(c: Any, model: Net, opt: Any, pre: Any, a: int, b: int) -> None:
        train_steps(model, opt, c, a, b, preconditioner=pre, augment=False)

    # Uninterrupted references; the big run also writes the step-3 checkpoint.
    model, opt, pre = build(comm)
    run(comm, model, opt, pre, 0, 3)
    checkpoint.save(d / "big", model=model, optimizer=opt, preconditioner=pre, step=3,
                    comm=comm)
    run(comm, model, opt, pre, 3, 6)
    big_ref = flat(model)
    small_ref = None
    if small:
        model, opt, pre = build(sub)
        run(sub, model, opt, pre, 0, 3)
        checkpoint.save(d / "small", model=model, optimizer=opt, preconditioner=pre, step=3,
                        comm=sub)
        run(sub, model, opt, pre, 3, 6)
        small_ref = flat(model)
    small_ref = comm.broadcast_object(small_ref)
    noise = rel(big_ref, small_ref)
    bound = min(1e-4, 2 * noise + 1e-7)

    errors: dict[str, float] = {}
    if small:  # P -> P/2, and the same without the K-FAC state
        model, opt, pre = build(sub)
        checkpoint.load(d / "big", model=model, optimizer=opt, preconditioner=pre, comm=sub)
        run(sub, model, opt, pre, 3, 6)
        errors["down"] = rel(flat(model), small_ref)
        model, opt, fresh = build(sub)
        checkpoint.load(d / "big", model=model, optimizer=opt, comm=sub)
        run(sub, model, opt, fresh, 3, 6)
        errors["down, K-FAC state dropped"] = rel(flat(model), small_ref)
    comm.barrier()
    model, opt, pre = build(comm)  # P/2 -> P
    checkpoint.load(d / "small", model=model, optimizer=opt, preconditioner=pre, comm=comm)
    run(comm, model, opt, pre, 3, 6)
    errors["up"] = rel(flat(model), big_ref)
    errors = comm.broadcast_object(errors)
    sub.free()
    assert errors["down"] <= bound and errors["up"] <= bound, (errors, noise)
    assert errors["down, K-FAC state dropped"] > 100 * bound, (errors, noise)


def test_parallel_hdf5_plan_is_identical_on_every_rank(comm: Any) -> None:
    """The parallel-HDF5 path creates every dataset collectively from a plan every rank
    builds; it must be the same on all ranks and the same as the serial writer's."""
    from kfac_hpc.checkpoint import writer

    model = Net()
    opt = make_optimizer("sgd", model)
    pre = FakeKFAC(model, comm)
    pre.update()

    def plan(everything: bool) -> tuple[list[Any], Any]:
        opt_sd, pre_sd = opt.state_dict(), pre.state_dict()
        prep = writer._prepare(comm, model, opt, pre, 1, {"epoch": 1}, False, opt_sd, pre_sd,
                               defer=False)
        entries, full, error = writer._plan(comm, prep, pre, pre_sd, everything=everything)
        assert error is None
        return [(e.path, e.owner, e.shape, e.dtype, e.attrs) for e in entries], full

    parallel, full = plan(everything=True)
    assert all(p == parallel for p in comm.allgather_object(parallel))
    assert all(g == full.groups for g in comm.allgather_object(full.groups))
    assert all(e[0] in full.local for e in parallel if e[1] == comm.rank)
    serial, _ = plan(everything=False)
    if comm.rank == 0:
        assert serial == parallel
    else:
        assert serial == []


# ------------------------------------------------------------------ faults on one rank
def _messages(comm: Any, action: Any, kind: type[BaseException] = CheckpointError) -> list[str]:
    """Every rank's message of the error ``action()`` raises ("" where none)."""
    message = ""
    try:
        action()
    except kind as exc:
        message = str(exc)
    return comm.allgather_object(message)


def test_nonfinite_factor_on_one_rank_is_refused_everywhere(comm: Any, tmp_path: Path) -> None:
    from kfac_hpc.checkpoint.errors import NonFiniteStateError

    d = _shared_dir(comm, tmp_path)
    model = Net()
    pre = FakeKFAC(model, comm, "mem-opt")
    pre.update()
    checkpoint.save(d, model=model, optimizer=None, preconditioner=pre, step=1, comm=comm)
    victim_rank = comm.size - 1
    victim = sorted(pre.owned())[0] if comm.rank == victim_rank else None
    if victim is not None:
        factor = pre.factors[victim]
        assert factor is not None
        factor[0, 0] = float("inf")
    victim = comm.broadcast_object(victim, victim_rank)
    before = sorted(p.name for p in d.iterdir())
    messages = _messages(comm, lambda: checkpoint.save(
        d, model=model, optimizer=None, preconditioner=pre, step=2, comm=comm),
        NonFiniteStateError)
    assert messages[0] and len(set(messages)) == 1, messages
    assert f"/kfac/{victim} (on rank {victim_rank}) holds NaN/Inf" in messages[0]
    comm.barrier()
    assert sorted(p.name for p in d.iterdir()) == before
    assert checkpoint.latest(d) == d / "ckpt_00000001.h5"


def test_full_disk_on_the_writer_fails_every_rank_alike(comm: Any, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    import errno

    from kfac_hpc.checkpoint import storage

    d = _shared_dir(comm, tmp_path)
    model = Net()
    opt = make_optimizer("sgd", model)
    pre = FakeKFAC(model, comm, "mem-opt")
    pre.update()
    good = checkpoint.save(d, model=model, optimizer=opt, preconditioner=pre, step=1, comm=comm)
    real, left = storage._pwrite, [20_000]

    def pwrite(fd: int, data: Any, offset: int) -> int:  # rank 0 writes; the disk fills up
        left[0] -= memoryview(data).nbytes
        if left[0] < 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data, offset)

    monkeypatch.setattr(storage, "_pwrite", pwrite)
    messages = _messages(comm, lambda: checkpoint.save(
        d, model=model, optimizer=opt, preconditioner=pre, step=2, comm=comm))
    monkeypatch.undo()
    assert messages[0] and len(set(messages)) == 1, messages
    assert "No space left on device" in messages[0] and str(d) in messages[0]
    comm.barrier()
    assert sorted(p.name for p in d.iterdir()) == ["ckpt_00000001.h5", "latest"]
    assert checkpoint.latest(d) == good and checkpoint.verify_file(good).ok
    again = checkpoint.save(d, model=model, optimizer=opt, preconditioner=pre, step=2, comm=comm)
    assert checkpoint.verify_file(again).ok


class _RefusesOnOneRank(Net):
    def _load_from_state_dict(self, *args: Any, **kwargs: Any) -> None:
        from mpi4py import MPI

        if MPI.COMM_WORLD.Get_rank() == MPI.COMM_WORLD.Get_size() - 1:
            raise RuntimeError("the last rank's model refuses to load")
        super()._load_from_state_dict(*args, **kwargs)


def test_a_load_failing_on_one_rank_is_undone_on_every_rank(comm: Any, tmp_path: Path) -> None:
    d = _shared_dir(comm, tmp_path)
    torch.manual_seed(0)
    model = Net()
    opt = make_optimizer("adam", model)
    _seed_per_rank(comm, 3)
    train_steps(model, opt, comm, 0, 2)
    pre = FakeKFAC(model, comm, "mem-opt")
    pre.update()
    checkpoint.save(d, model=model, optimizer=opt, preconditioner=pre, step=2, comm=comm)

    torch.manual_seed(9)
    live = _RefusesOnOneRank()
    live_opt = make_optimizer("adam", live)
    train_steps(live, live_opt, comm, 0, 1)
    live_pre = FakeKFAC(live, comm, "mem-opt")
    for _ in range(3):
        live_pre.update()
    weights = {k: v.clone() for k, v in live.state_dict().items()}
    state, rng_state = repr(live_opt.state_dict()), torch.get_rng_state()
    messages = _messages(comm, lambda: checkpoint.load(
        d, model=live, optimizer=live_opt, preconditioner=live_pre, comm=comm))
    assert messages[0] and len(set(messages)) == 1, messages
    assert f"rank {comm.size - 1}: RuntimeError: the last rank's model refuses" in messages[0]
    assert "nothing was loaded" in messages[0]
    assert _agree_all(comm, all(torch.equal(weights[k], v) for k, v in live.state_dict().items())
                      and repr(live_opt.state_dict()) == state
                      and torch.equal(torch.get_rng_state(), rng_state))
    live_pre.check(3)


class _KFACWithPerRankEntries(FakeKFAC):
    """state_dict() has entries the checkpoint does not know: one the same on every
    rank, one that differs per rank."""

    def __init__(self, *args: Any, differ: bool = True, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.differ = differ
        self.extra: dict[str, Any] = {}

    def state_dict(self, eigenbases: bool = False) -> dict[str, Any]:
        sd = super().state_dict(eigenbases)
        sd["history"] = sorted(self.factor_keys())
        sd["local"] = torch.full((3,), float(self.comm.rank if self.differ else 7))
        return sd

    def load_state_dict(self, state: Any) -> None:
        super().load_state_dict(state)
        self.extra = {k: v for k, v in state.items() if k in ("history", "local")}


@pytest.mark.parametrize("differ", [True, False])
def test_other_kfac_entries_go_back_to_their_rank(comm: Any, tmp_path: Path,
                                                  differ: bool) -> None:
    from mpi4py import MPI

    from kfac_hpc.comm import Communicator

    d = _shared_dir(comm, tmp_path)
    model = Net()
    pre = _KFACWithPerRankEntries(model, comm, "mem-opt", differ=differ)
    pre.update()
    path = checkpoint.save(d, model=model, optimizer=None, preconditioner=pre, step=1, comm=comm)
    fresh = _KFACWithPerRankEntries(model, comm, "mem-opt", differ=differ)
    checkpoint.load(path, model=model, optimizer=None, preconditioner=fresh, comm=comm)
    want = float(comm.rank if differ else 7)
    assert torch.equal(fresh.extra["local"], torch.full((3,), want))
    assert fresh.extra["history"] == sorted(pre.factor_keys())
    fresh.check(1)
    if comm.rank == 0:  # another world size: only what every rank had in common
        solo = Communicator(MPI.COMM_SELF, name="self")
        one = _KFACWithPerRankEntries(model, solo, "mem-opt", differ=differ)
        info = checkpoint.load(path, model=model, optimizer=None, preconditioner=one, comm=solo)
        one.check(1)
        if differ:
            assert one.extra == {}
            assert any("per-rank entries of state_dict() were not restored" in m
                       for m in info.mismatches)
        else:
            assert torch.equal(one.extra["local"], torch.full((3,), 7.0))
    comm.barrier()
