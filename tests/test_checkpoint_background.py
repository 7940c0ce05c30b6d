"""Background checkpoint writes (kfac_hpc.checkpoint.BackgroundSaver).

The state is snapshotted when ``save`` returns: changing it afterwards does not change
the file; ``latest`` moves only once the write is done; a failed write is raised at
the next ``wait``/``save`` on every rank; a kill -9 during a background write leaves the
previous checkpoint loadable with its exact values.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from fresh_env import fresh_env
from test_checkpoint_support import FakeKFAC, Net, make_optimizer, weights_equal
from torch import nn

from kfac_hpc import checkpoint
from kfac_hpc.checkpoint import BackgroundSaver, CheckpointError, writer

ROOT = Path(__file__).resolve().parents[1]


class LocalComm:
    """A one-process stand-in for the Communicator (no MPI)."""

    rank, size, name = 0, 1, "local"

    def allgather_object(self, obj: Any) -> list[Any]:
        return [obj]

    def broadcast_object(self, obj: Any, root: int = 0) -> Any:
        return obj

    def barrier(self) -> None:
        pass


def stamp(model: nn.Module, value: float) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(value)


def big_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(512, 512), nn.Linear(512, 512))


def test_snapshot_is_what_gets_written(tmp_path: Path) -> None:
    comm = LocalComm()
    model = big_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    saver = BackgroundSaver(comm)  # type: ignore[arg-type]
    stamp(model, 1.0)
    assert saver.save(tmp_path, model=model, optimizer=opt, step=1) is None
    assert saver.in_flight
    stamp(model, 99.0)  # training goes on while the file is written
    assert saver.wait() == tmp_path / "ckpt_00000001.h5"
    assert not saver.in_flight
    stamp(model, 2.0)
    saver.save(tmp_path, model=model, optimizer=opt, step=2)
    stamp(model, 98.0)
    done = saver.save(tmp_path, model=model, optimizer=opt, step=3)  # waits for step 2
    assert done == tmp_path / "ckpt_00000002.h5"
    saver.wait()
    assert checkpoint.latest(tmp_path) == tmp_path / "ckpt_00000003.h5"
    for step, value in ((2, 2.0), (3, 98.0)):
        fresh = big_model()
        path = tmp_path / f"ckpt_{step:08d}.h5"
        assert checkpoint.verify_file(path).ok
        checkpoint.load(path, model=fresh, optimizer=None, comm=comm)  # type: ignore[arg-type]
        assert all(bool((p == value).all()) for p in fresh.parameters())
    assert not list(tmp_path.glob("*.tmp"))
    saver.close()


def test_failed_background_write_is_raised_at_the_next_wait(tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch
                                                            ) -> None:
    comm = LocalComm()
    model = big_model()
    saver = BackgroundSaver(comm)  # type: ignore[arg-type]
    saver.save(tmp_path, model=model, optimizer=None, step=1)
    saver.wait()
    monkeypatch.setattr(writer, "_commit", lambda *a, **k: "the disk said no")
    saver.save(tmp_path, model=model, optimizer=None, step=2)
    with pytest.raises(CheckpointError, match="the disk said no"):
        saver.wait()
    assert checkpoint.latest(tmp_path) == tmp_path / "ckpt_00000001.h5"
    assert not list(tmp_path.glob("*.tmp"))
    monkeypatch.undo()
    saver.save(tmp_path, model=model, optimizer=None, step=3)  # the next one works again
    assert saver.wait() == tmp_path / "ckpt_00000003.h5"


KILL_SCRIPT = r'''
import json, os, sys, time
import mpi4py
mpi4py.rc.initialize = False
import torch
from torch import nn
torch.set_num_threads(1)
from kfac_hpc import checkpoint

class LocalComm:
    rank, size, name = 0, 1, "local"
    def allgather_object(self, obj): return [obj]
    def broadcast_object(self, obj, root=0): return obj
    def barrier(self): pass

d = sys.argv[1]
torch.manual_seed(0)
model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(6)])  # 24 MiB
opt = torch.optim.Adam(model.parameters())
opt.zero_grad(); model(torch.randn(2, 1024)).sum().backward(); opt.step()
def stamp(v):
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float(v))
saver = checkpoint.BackgroundSaver(LocalComm())
stamp(7); saver.save(d, model=model, optimizer=opt, step=7); saver.wait()
print("committed", flush=True)
step = 8
while True:  # background writes back to back; training (stamping) goes on meanwhile
    stamp(step)
    saver.save(d, model=model, optimizer=opt, step=step)
    for k in range(1000):
        stamp(1000 + k)
    step += 1
'''


@pytest.mark.timeout(300)
def test_kill_minus_nine_during_background_write_keeps_the_previous_checkpoint(
        tmp_path: Path) -> None:
    script = tmp_path / "kill.py"
    script.write_text(KILL_SCRIPT)
    env = fresh_env()
    d = tmp_path / "ckpt"
    for trial in range(5):
        child = subprocess.Popen([sys.executable, str(script), str(d)], cwd=ROOT, env=env,
                                 stdout=subprocess.PIPE, text=True)
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "committed"
        # kill the moment a partial file of a later step exists (mid background write)
        deadline = __import__("time").monotonic() + 60
        while not [f for f in os.listdir(d) if f.endswith(".h5.tmp")]:
            assert __import__("time").monotonic() < deadline, "no background write seen"
        child.kill()
        child.wait()
        latest = checkpoint.latest(d)
        assert latest is not None
        assert checkpoint.verify_file(latest).ok, checkpoint.verify_file(latest).problems
        for path in checkpoint.list_checkpoints(d):
            assert checkpoint.verify_file(path).ok
        torch.manual_seed(1)
        fresh = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(6)])
        info = checkpoint.load(latest, model=fresh, optimizer=None,
                               comm=LocalComm())  # type: ignore[arg-type]
        assert info.step >= 7
        # the values of the step it names, exactly (not those stamped during the write)
        assert all(bool((p == float(info.step)).all()) for p in fresh.parameters()), \
            json.dumps({"trial": trial, "latest": latest.name})


# --------------------------------------------------------------------------- MPI
@pytest.mark.mpi(min_size=2)
def test_background_write_across_ranks(comm: Any, tmp_path: Path) -> None:
    """Factors owned by every rank reach the file as they were at ``save``; a failed
    write on rank 0 is raised on every rank at the next wait."""
    d = Path(comm.broadcast_object(str(tmp_path)))
    torch.manual_seed(0)  # the same weights on every rank (data parallel)
    model = Net()
    opt = make_optimizer("sgd", model)
    pre = FakeKFAC(model, comm, "mem-opt")
    for _ in range(3):
        pre.update()
    saver = BackgroundSaver(comm)
    saver.save(d, model=model, optimizer=opt, preconditioner=pre, step=3,
               store_eigenbases=True)
    reference = Net()
    reference.load_state_dict(model.state_dict())
    for _ in range(2):  # training goes on: factors and weights change during the write
        pre.update()
    stamp(model, 5.0)
    assert saver.wait() == d / "ckpt_00000003.h5"
    fresh_model, fresh = Net(), FakeKFAC(model, comm, "mem-opt")
    checkpoint.load(d, model=fresh_model, optimizer=None, preconditioner=fresh, comm=comm)
    fresh.check(3)
    assert weights_equal(fresh_model, reference)

    original = writer._commit
    try:
        writer._commit = lambda *a, **k: "no luck"  # type: ignore[assignment]
        saver.save(d, model=model, optimizer=opt, preconditioner=pre, step=5)
        with pytest.raises(CheckpointError, match="no luck"):
            saver.wait()
    finally:
        writer._commit = original  # type: ignore[assignment]
    assert checkpoint.latest(d) == d / "ckpt_00000003.h5"
    saver.close()
    comm.barrier()


@pytest.mark.mpi(min_size=2)
def test_a_snapshot_that_fails_on_one_rank_fails_the_save_on_every_rank(
        comm: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Copying the state for the background write runs out of memory on rank 0 only:
    every rank raises the same error from ``save`` (no rank goes on to send its state to
    a rank that will not receive it), and the saver stays usable."""
    d = Path(comm.broadcast_object(str(tmp_path)))
    torch.manual_seed(0)
    model = Net()
    opt = make_optimizer("sgd", model)
    saver = BackgroundSaver(comm)
    snapshot = writer._snapshot
    if comm.rank == 0:
        def exhausted(*args: Any) -> Any:
            raise MemoryError("no host memory for the copy")

        monkeypatch.setattr(writer, "_snapshot", exhausted)
    with pytest.raises(CheckpointError, match="no host memory for the copy"):
        saver.save(d, model=model, optimizer=opt, step=1)
    monkeypatch.setattr(writer, "_snapshot", snapshot)
    saver.save(d, model=model, optimizer=opt, step=2)
    assert saver.wait() == d / "ckpt_00000002.h5"
    saver.close()
    comm.barrier()


@pytest.mark.mpi(min_size=2)
def test_a_background_saver_needs_thread_multiple(comm: Any,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Below MPI_THREAD_MULTIPLE the writer thread's blocking sends and training's
    blocking collectives would wait for each other (a deadlock under SERIALIZED's lock):
    the saver is refused on every rank, saying why and what to do."""
    from mpi4py import MPI

    from kfac_hpc.comm import threads

    monkeypatch.setattr(threads, "_provided", MPI.THREAD_SERIALIZED)
    with pytest.raises(threads.ThreadLevelError, match="MPI_THREAD_SERIALIZED"):
        BackgroundSaver(comm)


def test_the_driver_writes_in_the_foreground_below_thread_multiple(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The driver's periodic checkpoints go to the foreground (said once) where the MPI
    library provides less than MPI_THREAD_MULTIPLE, on more than one rank."""
    from mpi4py import MPI

    from kfac_hpc.comm import threads
    from kfac_hpc.train.checkpoints import CheckpointPolicy
    from kfac_hpc.train.config import TrainConfig

    said: list[str] = []

    class TwoRanks:
        size = 2

    policy = CheckpointPolicy(TrainConfig(checkpoint_dir="ck"), TwoRanks(),  # type: ignore[arg-type]
                              TwoRanks(), enabled=True, say=said.append,  # type: ignore[arg-type]
                              beat=lambda doing: None)
    assert policy.background_enabled()
    monkeypatch.setattr(threads, "_provided", MPI.THREAD_SERIALIZED)
    assert not policy.background_enabled() and not policy.background_enabled()
    assert len(said) == 1 and "written in the foreground" in said[0]


def test_a_receive_that_fails_ends_the_job(monkeypatch: pytest.MonkeyPatch) -> None:
    """Receiving a rank's dataset for the write fails (no memory for its buffer): its
    sender, and every later one, would wait forever, so the job is aborted, with the
    dataset named; the prefetching thread hands the error to the writer, not a hang."""
    comm = _self_comm()
    aborted: list[str] = []

    def abort(message: str, code: int = 1) -> None:
        aborted.append(message)

    def no_memory(*args: Any, **kwargs: Any) -> torch.Tensor:
        raise MemoryError("no memory for the receive buffer")

    monkeypatch.setattr(comm, "abort", abort)
    monkeypatch.setattr(writer.torch, "empty", no_memory)
    entry = writer.Entry("/kfac/x", owner=1, shape=(4,), dtype="<f4")
    for prefetch in (False, True):
        aborted.clear()
        receiver = writer._Receiver(comm, [entry], prefetch)
        with pytest.raises(MemoryError):
            receiver.next()
        assert len(aborted) == 1 and "receiving /kfac/x from rank 1" in aborted[0]


# ------------------------------------------------------------------ the driver
def _self_comm() -> Any:
    from mpi4py import MPI

    from kfac_hpc.comm import Communicator

    return Communicator(MPI.COMM_SELF, name="self")


def test_driver_writes_periodic_checkpoints_in_the_background(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Periodic checkpoints go through BackgroundSaver; the last one is complete when
    the run returns; a failed background write stops the run with CheckpointError."""
    from kfac_hpc.train.config import TrainConfig
    from kfac_hpc.train.loop import train

    started: list[int] = []
    save = BackgroundSaver.save

    def counting(self: Any, *args: Any, **kwargs: Any) -> Any:
        started.append(int(kwargs["step"]))
        return save(self, *args, **kwargs)

    monkeypatch.setattr(BackgroundSaver, "save", counting)
    cfg = TrainConfig(batch_size=64, epochs=1, max_steps=12, preconditioner="none",
                      progress=False, threads=1, out=str(tmp_path / "run"),
                      checkpoint_dir=str(tmp_path / "ck"), checkpoint_every_steps=5,
                      checkpoint_keep=10)
    train(cfg, _self_comm(), verbose=False)
    assert started == [5, 10]
    names = [p.name for p in checkpoint.list_checkpoints(tmp_path / "ck")]
    assert names == ["ckpt_00000005.h5", "ckpt_00000010.h5", "ckpt_00000012.h5"]
    assert all(checkpoint.verify_file(p).ok for p in checkpoint.list_checkpoints(tmp_path / "ck"))

    calls = [0]
    commit = writer._commit

    def failing_first(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return "disk on fire" if calls[0] == 1 else commit(*args, **kwargs)

    monkeypatch.setattr(writer, "_commit", failing_first)
    cfg2 = dataclasses.replace(cfg, checkpoint_dir=str(tmp_path / "ck2"),
                               out=str(tmp_path / "run2"))
    with pytest.raises(CheckpointError, match="disk on fire"):
        train(cfg2, _self_comm(), verbose=False)
    assert checkpoint.latest(tmp_path / "ck2") is None
