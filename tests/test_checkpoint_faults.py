"""Faults on one process: NaN/Inf state, a full disk, loads that fail half-way.

* ``save`` refuses state holding NaN or Inf before anything is written or pruned;
  ``verify`` fails such a file and ``load`` refuses it.
* A full disk (or quota, or I/O error) while writing gives one ``CheckpointError``
  naming the directory and its free space; the ``.tmp`` is gone, the earlier
  checkpoints and ``latest`` are as they were, HDF5 has no file left open, and the
  process exits normally (on a real, tiny file system: in a subprocess, at 1 and 2
  ranks, where a user namespace can mount one).
* Damaged bytes: no single flipped bit makes ``verify`` or ``latest(valid=True)`` raise
  (h5py raises ``OSError``, ``KeyError``, ``RuntimeError``... for some); the file is BAD
  and ``latest(valid=True)`` passes over it.
* ``load`` applies everything or nothing: a section that fails after others were
  applied puts every section back; what can be checked beforehand (dtypes, RNG
  states, NaN) is checked before anything is applied.

MPI versions (a failure on one rank) are in ``test_checkpoint_mpi.py``.
"""

from __future__ import annotations

import errno
import gc
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest
import torch
from fresh_env import fresh_env
from test_checkpoint_support import (
    FakeKFAC,
    Net,
    flip_bit,
    make_optimizer,
    raw_read_raises,
    spread_bits,
    train_steps,
)
from torch import nn

from kfac_hpc import checkpoint
from kfac_hpc.checkpoint import CheckpointError, rng, storage
from kfac_hpc.checkpoint.errors import NonFiniteStateError
from kfac_hpc.cli import main as cli_main

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def comm1() -> Any:
    from mpi4py import MPI

    from kfac_hpc.comm import Communicator

    return Communicator(MPI.COMM_SELF, name="self")


def _setup(comm: Any, kind: str = "adam") -> tuple[Net, Any, FakeKFAC]:
    torch.manual_seed(0)
    model = Net()
    opt = make_optimizer(kind, model)
    train_steps(model, opt, comm, 0, 2)
    pre = FakeKFAC(model, comm)
    pre.update()
    return model, opt, pre


def _listing(directory: Path) -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in sorted(directory.iterdir())}


def _open_hdf5_ids() -> int:
    """Open HDF5 files, groups, datasets and attributes (in any file)."""
    gc.collect()
    kinds = h5py.h5f.OBJ_FILE | h5py.h5f.OBJ_GROUP | h5py.h5f.OBJ_DATASET | h5py.h5f.OBJ_ATTR
    return int(h5py.h5f.get_obj_count(h5py.h5f.OBJ_ALL, kinds))


def _state(model: nn.Module, opt: Any, pre: FakeKFAC) -> tuple[Any, ...]:
    """Everything load may change, copied."""
    return ({k: v.clone() for k, v in model.state_dict().items()}, repr(opt.state_dict()),
            {k: None if v is None else v.clone() for k, v in pre.factors.items()},
            dict(pre.updates), pre.steps, torch.get_rng_state().clone())


def _same_state(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    models = a[0].keys() == b[0].keys() and all(torch.equal(a[0][k], b[0][k]) for k in a[0])
    factors = a[2].keys() == b[2].keys() and all(
        (x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))
        for x, y in zip(a[2].values(), b[2].values()))
    return (models and a[1] == b[1] and factors and a[3] == b[3] and a[4] == b[4]
            and torch.equal(a[5], b[5]))


# ------------------------------------------------------------------ NaN / Inf
def _poison(section: str, model: nn.Module, opt: Any, pre: FakeKFAC) -> str:
    """Put a NaN or Inf into one section; returns the dataset that must be named."""
    if section == "model":
        with torch.no_grad():
            model.fc1.weight[3, 5] = float("nan")
        return "/model/fc1.weight"
    if section == "optimizer":
        opt.state[model.fc2.bias]["exp_avg_sq"][0] = float("inf")
        return "/optimizer/state/fc2.bias/exp_avg_sq"
    key = "fc1/G"
    factor = pre.factors[key]
    assert factor is not None
    factor[0, 0] = float("nan")
    return f"/kfac/{key}"


@pytest.mark.parametrize("section", ["model", "optimizer", "kfac"])
def test_nonfinite_state_is_refused_before_anything_is_written(tmp_path: Path, comm1: Any,
                                                               section: str) -> None:
    model, opt, pre = _setup(comm1)
    for step in (1, 2):
        checkpoint.save(tmp_path, model=model, optimizer=opt, preconditioner=pre, step=step,
                        comm=comm1, keep_last=2)
    before = _listing(tmp_path)
    name = _poison(section, model, opt, pre)
    with pytest.raises(NonFiniteStateError) as err:
        checkpoint.save(tmp_path, model=model, optimizer=opt, preconditioner=pre, step=3,
                        comm=comm1, keep_last=2)
    assert err.value.tensor == name and err.value.rank == 0
    assert f"{name} holds NaN/Inf" in str(err.value) and "step 3" in str(err.value)
    assert _listing(tmp_path) == before  # nothing written, nothing pruned, latest as it was
    assert checkpoint.latest(tmp_path) == tmp_path / "ckpt_00000002.h5"

    # written anyway on request: verify fails it, load refuses it and changes nothing
    bad = checkpoint.save(tmp_path / "bad.h5", model=model, optimizer=opt, preconditioner=pre,
                          step=3, comm=comm1, check_finite=False)
    report = checkpoint.verify_file(bad)
    assert not report.ok and any(p.startswith(f"dataset {name} holds NaN/Inf")
                                 for p in report.problems), report.problems
    assert cli_main(["ckpt", "verify", "-q", str(bad)]) == 1
    fresh, fresh_opt, fresh_pre = _setup(comm1)
    kept = _state(fresh, fresh_opt, fresh_pre)
    with pytest.raises(CheckpointError, match=f"dataset {name} holds NaN/Inf") as err2:
        checkpoint.load(bad, model=fresh, optimizer=fresh_opt, preconditioner=fresh_pre,
                        comm=comm1)
    assert "nothing was loaded" in str(err2.value)
    assert _same_state(kept, _state(fresh, fresh_opt, fresh_pre))


def test_nan_in_extra_is_fine(tmp_path: Path, comm1: Any) -> None:
    """Metrics may be NaN (a run stopped before its first evaluation)."""
    model, opt, _ = _setup(comm1)
    path = checkpoint.save(tmp_path, model=model, optimizer=opt, step=1, comm=comm1,
                           extra={"test_loss": torch.tensor(float("nan")), "acc": float("nan")})
    assert checkpoint.verify_file(path).ok
    info = checkpoint.load(path, model=model, optimizer=opt, comm=comm1)
    assert info.extra is not None and torch.isnan(info.extra["test_loss"])


# ------------------------------------------------------------------ a full disk
def _enospc_after(monkeypatch: pytest.MonkeyPatch, budget: int, code: int = errno.ENOSPC) -> None:
    """From now on, writes fail once ``budget`` bytes have been written."""
    real = storage._pwrite
    left = [budget]

    def pwrite(fd: int, data: Any, offset: int) -> int:
        n = memoryview(data).nbytes
        if left[0] < n:
            raise OSError(code, os.strerror(code))
        left[0] -= n
        return real(fd, data, offset)

    monkeypatch.setattr(storage, "_pwrite", pwrite)


@pytest.mark.parametrize("budget", [0, 3000, 60_000])
@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT, errno.EIO])
def test_write_failure_gives_one_error_and_keeps_everything(
        tmp_path: Path, comm1: Any, monkeypatch: pytest.MonkeyPatch, budget: int,
        code: int) -> None:
    model, opt, pre = _setup(comm1)
    good = checkpoint.save(tmp_path, model=model, optimizer=opt, preconditioner=pre, step=1,
                           comm=comm1)
    before, ids = _listing(tmp_path), _open_hdf5_ids()
    _enospc_after(monkeypatch, budget, code)
    with pytest.raises(CheckpointError) as err:
        checkpoint.save(tmp_path, model=model, optimizer=opt, preconditioner=pre, step=2,
                        comm=comm1)
    text = str(err.value)
    assert type(err.value) is CheckpointError
    assert os.strerror(code) in text and str(tmp_path) in text and " free" in text, text
    assert _listing(tmp_path) == before and not list(tmp_path.glob("*.tmp"))
    assert _open_hdf5_ids() == ids  # the file was closed: nothing left for HDF5's exit
    monkeypatch.undo()
    assert checkpoint.latest(tmp_path) == good and checkpoint.verify_file(good).ok
    checkpoint.load(tmp_path, model=model, optimizer=opt, preconditioner=pre, comm=comm1)
    again = checkpoint.save(tmp_path, model=model, optimizer=opt, preconditioner=pre, step=2,
                            comm=comm1)
    assert checkpoint.verify_file(again).ok and checkpoint.latest(tmp_path) == again


def test_write_back_error_fails_the_save(tmp_path: Path, comm1: Any,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """An error that only the background write-back sees (NFS reports ENOSPC there) is
    not lost: the save fails."""
    model, opt, _ = _setup(comm1)

    def fdatasync(fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(storage, "FLUSH_BYTES", 1)
    monkeypatch.setattr(storage, "_fdatasync", fdatasync)
    with pytest.raises(CheckpointError, match="No space left on device"):
        checkpoint.save(tmp_path, model=model, optimizer=opt, step=1, comm=comm1)
    assert list(tmp_path.iterdir()) == []


def test_too_little_free_space_is_refused_before_writing(tmp_path: Path, comm1: Any,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    model, opt, _ = _setup(comm1)
    good = checkpoint.save(tmp_path, model=model, optimizer=opt, step=1, comm=comm1)
    before = _listing(tmp_path)
    monkeypatch.setattr(storage, "free_bytes", lambda directory: 1000)
    opened: list[Path] = []
    real = storage.GuardedFile.__init__

    def spy(self: storage.GuardedFile, path: Any) -> None:
        opened.append(Path(path))
        real(self, path)

    monkeypatch.setattr(storage.GuardedFile, "__init__", spy)
    with pytest.raises(CheckpointError, match=f"not enough space in {tmp_path}: 1000 B free, "
                                              "the checkpoint needs at least"):
        checkpoint.save(tmp_path, model=model, optimizer=opt, step=2, comm=comm1)
    assert opened == [] and _listing(tmp_path) == before
    assert checkpoint.latest(tmp_path) == good


def test_pointer_failure_takes_the_new_file_back_out(tmp_path: Path, comm1: Any,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    model, opt, _ = _setup(comm1)
    good = checkpoint.save(tmp_path, model=model, optimizer=opt, step=1, comm=comm1)
    before = _listing(tmp_path)

    def full(*args: Any, **kwargs: Any) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint.atomic, "write_pointer", full)
    with pytest.raises(CheckpointError, match=r"updating .*latest: No space left on device"):
        checkpoint.save(tmp_path, model=model, optimizer=opt, step=2, comm=comm1)
    assert _listing(tmp_path) == before and checkpoint.latest(tmp_path) == good


FULL_DISK_SCRIPT = r'''
import json, os, sys
import torch
from torch import nn
from kfac_hpc import checkpoint
from kfac_hpc.checkpoint import storage
from kfac_hpc.comm import Communicator

comm = Communicator()
directory, width, precheck = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "precheck"
torch.manual_seed(0)
small = nn.Linear(10, 10)
checkpoint.save(directory, model=small, optimizer=None, step=1, comm=comm)
if not precheck:  # let the write itself run into the full disk
    storage.free_bytes = lambda d: None
big = nn.Linear(width, 500, bias=False)
message = ""
try:
    checkpoint.save(directory, model=big, optimizer=None, step=2, comm=comm)
except checkpoint.CheckpointError as exc:
    message = str(exc)
latest = checkpoint.latest(directory)
checkpoint.load(directory, model=small, optimizer=None, comm=comm)
print("RESULT " + json.dumps({"rank": comm.rank, "message": message,
                              "files": sorted(os.listdir(directory)),
                              "latest": latest.name if latest else None,
                              "ok": checkpoint.verify_file(latest).ok}), flush=True)
'''


def _mount_tiny_fs(mountpoint: Path) -> list[str]:
    """A command prefix that runs a command with a 1 MiB tmpfs at ``mountpoint`` (in a
    private mount namespace); skips the test where that is not possible."""
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare(1) to mount a small file system")
    prefix = ["unshare", "-rm", "sh", "-c",
              'mount -t tmpfs -o size=1m tmpfs "$0" && exec "$@"', str(mountpoint)]
    probe = subprocess.run([*prefix, "true"], capture_output=True, text=True, check=False)
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs in a user namespace here: {probe.stderr.strip()}")
    return prefix


@pytest.mark.parametrize("ranks", [1, 2])
@pytest.mark.parametrize("when", ["precheck", "while-writing"])
def test_full_file_system_ends_cleanly(tmp_path: Path, ranks: int, when: str) -> None:
    """A real 1 MiB file system: the second save does not fit. Every rank gets the same
    CheckpointError naming the directory and its free space, the first checkpoint and
    ``latest`` are intact, no ``.tmp`` is left, and every process exits normally (no
    MPI_Abort, no segmentation fault in HDF5 at exit)."""
    mountpoint = tmp_path / "fs"
    mountpoint.mkdir()
    script = tmp_path / "full_disk.py"
    script.write_text(FULL_DISK_SCRIPT)
    prefix = _mount_tiny_fs(mountpoint)
    python = [sys.executable, "-m", "mpi4py", str(script), str(mountpoint / "ck"), "2000",
              when]  # 4 MB of parameters
    launch = [str(ROOT / "launch" / "local"), "-n", str(ranks), "--timeout", "240"]
    env = fresh_env()
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    done = subprocess.run([*prefix, *launch, *python], capture_output=True, text=True,
                          timeout=300, check=False, env=env, cwd=ROOT)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    results = [json.loads(line[len("RESULT "):]) for line in done.stdout.splitlines()
               if line.startswith("RESULT ")]
    assert sorted(r["rank"] for r in results) == list(range(ranks)), out
    messages = {r["message"] for r in results}
    assert len(messages) == 1, messages
    message = messages.pop()
    assert str(mountpoint / "ck") in message and " free" in message, message
    assert "Traceback" not in out and "MPI_ABORT" not in out, out
    assert ("not enough space" if when == "precheck" else "No space left on device") in message
    for r in results:
        assert r["files"] == ["ckpt_00000001.h5", "latest"] and r["latest"] == "ckpt_00000001.h5"
        assert r["ok"]


# ------------------------------------------------------------------ all or nothing
class _RefusingNet(Net):
    """A model whose own load fails (after the optimizer and K-FAC were applied)."""

    def _load_from_state_dict(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError("this model refuses to load")


class _RefusingOptimizer(torch.optim.Adam):
    """Refuses its next load (once: putting its own state back works)."""

    refuse = False

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.refuse:
            self.refuse = False
            raise RuntimeError("this optimizer refuses to load")
        super().load_state_dict(state_dict)


def test_a_failing_model_load_puts_everything_back(tmp_path: Path, comm1: Any) -> None:
    model, opt, pre = _setup(comm1)
    checkpoint.save(tmp_path, model=model, optimizer=opt, preconditioner=pre, step=2,
                    comm=comm1)
    torch.manual_seed(5)
    live = _RefusingNet()
    live_opt = make_optimizer("adam", live)
    train_steps(live, live_opt, comm1, 0, 1)
    live_pre = FakeKFAC(live, comm1)
    for _ in range(2):
        live_pre.update()
    kept = _state(live, live_opt, live_pre)
    with pytest.raises(CheckpointError, match="loading the model state failed") as err:
        checkpoint.load(tmp_path, model=live, optimizer=live_opt, preconditioner=live_pre,
                        comm=comm1)
    assert "nothing was loaded" in str(err.value) and "refuses to load" in str(err.value)
    assert _same_state(kept, _state(live, live_opt, live_pre))
    live_pre.check(2)  # its own factors, not the file's


def test_a_failing_optimizer_load_puts_kfac_back(tmp_path: Path, comm1: Any) -> None:
    model = Net()
    opt = _RefusingOptimizer(model.parameters(), lr=1e-2)
    train_steps(model, opt, comm1, 0, 2)
    pre = FakeKFAC(model, comm1)
    pre.update()
    checkpoint.save(tmp_path, model=model, optimizer=opt, preconditioner=pre, step=2,
                    comm=comm1)
    live = Net()
    live_opt = _RefusingOptimizer(live.parameters(), lr=1e-2)
    live_pre = FakeKFAC(live, comm1)
    for _ in range(3):
        live_pre.update()
    live_opt.refuse = True
    kept = _state(live, live_opt, live_pre)
    with pytest.raises(CheckpointError, match="loading the optimizer state failed"):
        checkpoint.load(tmp_path, model=live, optimizer=live_opt, preconditioner=live_pre,
                        comm=comm1)
    assert _same_state(kept, _state(live, live_opt, live_pre))
    live_pre.check(3)


def test_bad_rng_state_is_found_before_anything_is_applied(
        tmp_path: Path, comm1: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    model, opt, pre = _setup(comm1)
    real = rng.capture

    def short() -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        arrays, attrs = real()
        arrays["torch_cpu"] = arrays["torch_cpu"][:100]  # not a torch generator state
        return arrays, attrs

    monkeypatch.setattr(rng, "capture", short)
    checkpoint.save(tmp_path, model=model, optimizer=opt, preconditioner=pre, step=2,
                    comm=comm1)
    monkeypatch.undo()
    live, live_opt, live_pre = _setup(comm1)
    with torch.no_grad():
        live.fc1.weight.add_(1.0)
    kept = _state(live, live_opt, live_pre)
    with pytest.raises(CheckpointError, match=r"RNG state: torch_cpu is \|u1\[100\], expected "
                                              r"u1\[\d+\] \(saved by rank 0\)") as err:
        checkpoint.load(tmp_path, model=live, optimizer=live_opt, preconditioner=live_pre,
                        comm=comm1)
    assert "nothing was loaded" in str(err.value)
    assert _same_state(kept, _state(live, live_opt, live_pre))
    info = checkpoint.load(tmp_path, model=live, optimizer=live_opt, preconditioner=live_pre,
                           comm=comm1, restore_rng=False)
    assert info.loaded == ["kfac", "optimizer", "model"]


def test_a_dtype_of_another_kind_is_refused(tmp_path: Path, comm1: Any) -> None:
    class Counter(nn.Module):
        def __init__(self, dtype: torch.dtype) -> None:
            super().__init__()
            self.register_buffer("count", torch.zeros(3, dtype=dtype))

    checkpoint.save(tmp_path, model=Counter(torch.int64), optimizer=None, step=1, comm=comm1)
    live = Counter(torch.float32)
    with pytest.raises(CheckpointError, match=r"model: count is torch.int64 in the checkpoint, "
                                              r"torch.float32 in the model"):
        checkpoint.load(tmp_path, model=live, optimizer=None, comm=comm1)
    # the same kind in another precision loads (as torch's load_state_dict does)
    checkpoint.save(tmp_path, model=Counter(torch.float64), optimizer=None, step=2, comm=comm1)
    checkpoint.load(tmp_path, model=live, optimizer=None, comm=comm1)


# ------------------------------------------------------------------ other K-FAC entries
class _KFACWithMore(FakeKFAC):
    """A preconditioner whose state_dict() has entries the checkpoint does not know."""

    def state_dict(self, eigenbases: bool = False) -> dict[str, Any]:
        sd = super().state_dict(eigenbases)
        sd["history"] = sorted(self.factor_keys())
        sd["local"] = {"deltas": {k: torch.full((2,), float(self.comm.rank)) for k in
                                  self.factor_keys()[:2]}, "coefficient": 0.5}
        return sd

    def load_state_dict(self, state: Any) -> None:
        super().load_state_dict(state)
        self.extra = {k: v for k, v in state.items() if k in ("history", "local")}


def test_other_kfac_entries_round_trip(tmp_path: Path, comm1: Any) -> None:
    model, opt, _ = _setup(comm1)
    pre = _KFACWithMore(model, comm1)
    pre.update()
    path = checkpoint.save(tmp_path, model=model, optimizer=opt, preconditioner=pre, step=1,
                           comm=comm1)
    with h5py.File(path, "r") as f:
        assert "kfac/@rank_0/local/deltas/conv%2FA" in f
    fresh = _KFACWithMore(model, comm1)
    checkpoint.load(path, model=model, optimizer=opt, preconditioner=fresh, comm=comm1)
    assert fresh.extra["history"] == sorted(pre.factor_keys())
    assert fresh.extra["local"]["coefficient"] == 0.5
    assert torch.equal(fresh.extra["local"]["deltas"]["conv/A"], torch.zeros(2))
    fresh.check(1)


# ------------------------------------------------------------------ damaged bytes
def test_no_single_bit_flip_makes_verify_or_latest_raise(
        tmp_path: Path, comm1: Any, capsys: pytest.CaptureFixture[str]) -> None:
    """200 single-bit flips spread over a checkpoint: ``verify_file`` reports OK or BAD
    with a reason and never raises, ``kfac-hpc ckpt verify`` prints OK or BAD, and
    ``latest(valid=True)`` gives the flipped file when it verifies, else the good older
    one. Some of these flips made h5py raise (and ``verify`` crash) before."""
    model, opt, pre = _setup(comm1)
    source = checkpoint.save(tmp_path / "src.h5", model=model, optimizer=opt,
                             preconditioner=pre, step=2, comm=comm1)
    data = source.read_bytes()
    directory = tmp_path / "ck"
    small = nn.Linear(2, 2)  # the good older checkpoint: small, quick to verify
    older = checkpoint.save(directory, model=small, optimizer=None, step=1, comm=comm1)
    newest = directory / "ckpt_00000002.h5"
    checkpoint.atomic.write_pointer(directory, newest.name)  # as save leaves it
    raised_before, bad = 0, 0
    for i, bit in enumerate(spread_bits(len(data), 200)):
        newest.write_bytes(flip_bit(data, bit))
        crashed = raw_read_raises(newest)
        raised_before += crashed
        report = checkpoint.verify_file(newest)
        assert report.ok or report.problems, bit
        bad += not report.ok
        if crashed or i % 4 == 0:  # latest(valid=True) verifies again: a sample
            want = newest if report.ok else older
            assert checkpoint.latest(directory, valid=True) == want, bit
        if crashed or i % 8 == 0:  # the command too: it prints, never a traceback
            status = cli_main(["ckpt", "verify", str(newest)])
            out = capsys.readouterr().out
            assert out.startswith("OK" if report.ok else "BAD") and status == (not report.ok)
    assert raised_before >= 5, raised_before  # the sample holds flips that crashed before
    assert bad >= 100, bad
