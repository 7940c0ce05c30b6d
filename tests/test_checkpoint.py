"""HDF5 checkpoints on one process: round trips, exact resume, atomicity, bad files, CLI.

MPI tests are in ``test_checkpoint_mpi.py``; launches on several ranks from a serial
test (elastic P -> Q) in ``test_checkpoint_elastic.py``; crash safety in
``test_checkpoint_crash.py``.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest
import torch
from test_checkpoint_support import (
    FakeKFAC,
    Net,
    expected_factor,
    flip_byte,
    make_optimizer,
    optimizer_states_equal,
    params_equal,
    train_steps,
)
from torch import nn

from kfac_hpc import checkpoint
from kfac_hpc.checkpoint import CheckpointError, atomic, tree
from kfac_hpc.checkpoint.layout import (
    ALIGNMENT,
    FORMAT_VERSION,
    aligned_empty,
    escape,
    storage_to_tensor,
    tensor_to_storage,
    unescape,
)
from kfac_hpc.cli import main as cli_main


@pytest.fixture
def comm1():
    """A one-rank communicator (COMM_SELF), so these tests also run inside mpiexec."""
    from mpi4py import MPI

    from kfac_hpc.comm import Communicator

    return Communicator(MPI.COMM_SELF, name="self")


def _trained(kind: str, comm: Any, steps: int = 3, seed: int = 0) -> tuple[Net, Any]:
    torch.manual_seed(seed)
    model = Net()
    opt = make_optimizer(kind, model)
    train_steps(model, opt, comm, 0, steps)
    return model, opt


def _rng_draws() -> tuple[torch.Tensor, float, float]:
    return torch.rand(4), float(np.random.rand()), random.random()


def _scramble_rng() -> None:
    torch.manual_seed(12345)
    np.random.seed(12345)
    random.seed(12345)


# ---------------------------------------------------------------- round trips
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.int64])
def test_restored_tensors_are_aligned_as_torch_allocates(dtype: torch.dtype) -> None:
    """Stored data comes back as a tensor aligned as torch's own (64 bytes), like the
    live tensor it replaces (MKL may pick another kernel, and round differently, for an
    operand NumPy allocated 16-byte aligned); data already in such memory (what the
    reader reads into) is taken without a copy."""
    t = torch.arange(35, dtype=torch.float64).reshape(5, 7).to(dtype)
    arr, name = tensor_to_storage(t)
    raw = np.empty(arr.nbytes + ALIGNMENT, dtype=np.uint8)
    start = (8 - raw.ctypes.data) % ALIGNMENT  # an address 8 bytes past an aligned one
    shifted = raw[start:start + arr.nbytes].view(arr.dtype).reshape(arr.shape)
    shifted[...] = arr
    assert shifted.ctypes.data % ALIGNMENT == 8
    back = storage_to_tensor(shifted, name)
    assert back.dtype == dtype and torch.equal(back, t) and back.is_contiguous()
    assert back.data_ptr() % ALIGNMENT == 0
    staged = aligned_empty(arr.shape, arr.dtype)
    staged[...] = arr
    assert staged.ctypes.data % ALIGNMENT == 0
    assert storage_to_tensor(staged, name).data_ptr() == staged.ctypes.data


@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_round_trip_model_optimizer_rng_extra(tmp_path: Path, comm1: Any, kind: str) -> None:
    model, opt = _trained(kind, comm1)
    np.random.seed(7)
    random.seed(7)
    random.gauss(0, 1)  # python's cached gaussian is part of the state
    extra = {"epoch": 2, "position": 17, "loss": 0.1 + 0.2, "nan": float("nan"),
             "hist": torch.tensor([1.5, 2.5], dtype=torch.bfloat16), "ids": np.arange(4),
             "nested": {"a": [1, (2, None)], 3: "int key", ("x", 1): True}}
    path = checkpoint.save(tmp_path, model=model, optimizer=opt, step=3, comm=comm1,
                           extra=extra)
    want = _rng_draws()

    _scramble_rng()
    torch.manual_seed(99)
    fresh = Net()
    fresh_opt = make_optimizer(kind, fresh)
    for g in fresh_opt.param_groups:
        g["lr"] = 123.0
    info = checkpoint.load(tmp_path, model=fresh, optimizer=fresh_opt, comm=comm1)

    assert info.path == path and info.step == 3 and info.world_size == 1
    assert info.loaded == ["optimizer", "model", "rng"] and not info.mismatches
    assert params_equal(model, fresh)
    assert optimizer_states_equal(opt, fresh_opt)
    got = _rng_draws()
    assert torch.equal(got[0], want[0]) and got[1:] == want[1:]
    x = info.extra
    assert x is not None
    assert x["epoch"] == 2 and x["position"] == 17 and x["loss"] == 0.1 + 0.2
    assert np.isnan(x["nan"])
    assert x["hist"].dtype == torch.bfloat16 and torch.equal(x["hist"], extra["hist"])
    assert isinstance(x["ids"], np.ndarray) and np.array_equal(x["ids"], np.arange(4))
    assert x["nested"] == {"a": [1, (2, None)], 3: "int key", ("x", 1): True}


def test_wrapped_model_loads_into_plain_model(tmp_path: Path, comm1: Any) -> None:
    model, opt = _trained("sgd", comm1)
    wrapped = nn.DataParallel(model)  # same unwrapping as DDP: names without "module."
    checkpoint.save(tmp_path, model=wrapped, optimizer=opt, step=1, comm=comm1)
    fresh = Net()
    checkpoint.load(tmp_path, model=fresh, optimizer=make_optimizer("sgd", fresh), comm=comm1)
    assert params_equal(model, fresh)


class OddOptimizer(torch.optim.SGD):
    """An optimizer with its own state_dict layout (stored generically)."""

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        return {"format": "odd", "per_block": {("fc1.weight", 0): {"m": torch.ones(2, 3)},
                                               ("fc1.weight", 1): {"m": torch.zeros(1)}},
                "by_int": {0: torch.arange(3), 7: None}, "steps": 5, "lr": 0.1,
                "dtype": torch.float16, "scalar": np.float32(1.25)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        self.loaded = state_dict


def test_generic_optimizer_state_round_trips_exactly(tmp_path: Path, comm1: Any) -> None:
    model = Net()
    opt = OddOptimizer(model.parameters(), lr=0.1)
    checkpoint.save(tmp_path, model=model, optimizer=opt, step=1, comm=comm1)
    fresh = OddOptimizer(model.parameters(), lr=0.1)
    checkpoint.load(tmp_path, model=model, optimizer=fresh, comm=comm1)
    got, want = fresh.loaded, opt.state_dict()
    assert got.keys() == want.keys()
    assert torch.equal(got["per_block"][("fc1.weight", 0)]["m"], torch.ones(2, 3))
    assert torch.equal(got["by_int"][0], torch.arange(3)) and got["by_int"][7] is None
    assert got["dtype"] is torch.float16 and got["scalar"] == np.float32(1.25)
    assert type(got["scalar"]) is np.float32 and got["steps"] == 5
    with h5py.File(checkpoint.latest(tmp_path), "r") as f:
        assert f["optimizer"].attrs["layout"] == "generic"
        assert "optimizer/per_block/fc1.weight,0/m" in f


def test_tree_codec_and_escaping() -> None:
    obj = {"a/b": torch.tensor(1.0), "%": [torch.zeros(0)], ".": (1, 2), "": None,
           1: {"x": torch.ones(2)}, "1": {"y": torch.ones(1)}}
    structure, leaves = tree.encode(obj)
    paths = [p for p, _ in leaves]
    assert len(set(paths)) == len(paths)
    assert all(not p.startswith(q + "/") for p in paths for q in paths)
    back = tree.decode(json.loads(json.dumps(structure)), dict(leaves).__getitem__)
    assert back.keys() == obj.keys() and back["."] == (1, 2) and back[""] is None
    for name in ["fc1.weight", "a/b", "%2F", ".", "..", ""]:
        assert unescape(escape(name)) == name and "/" not in escape(name)
    with pytest.raises(tree.UnsupportedValue, match="cannot store a object"):
        tree.encode({"x": object()}, "/train")


# ---------------------------------------------------------------- exact resume
def test_exact_resume_sgd(tmp_path: Path, comm1: Any) -> None:
    torch.manual_seed(0)
    ref = Net()
    ref_opt = make_optimizer("sgd", ref)
    train_steps(ref, ref_opt, comm1, 0, 4)
    checkpoint.save(tmp_path, model=ref, optimizer=ref_opt, step=4, comm=comm1,
                    extra={"next_step": 4})
    train_steps(ref, ref_opt, comm1, 4, 8)  # the uninterrupted run

    torch.manual_seed(1)  # a different start: everything must come from the file
    model = Net()
    opt = make_optimizer("sgd", model)
    info = checkpoint.load(tmp_path, model=model, optimizer=opt, comm=comm1)
    assert info.extra == {"next_step": 4}
    train_steps(model, opt, comm1, 4, 8)
    assert params_equal(ref, model)
    assert optimizer_states_equal(ref_opt, opt)


def test_resume_without_rng_differs(tmp_path: Path, comm1: Any) -> None:
    """The exact-resume test can fail: without the RNG state the runs diverge."""
    torch.manual_seed(0)
    ref = Net()
    ref_opt = make_optimizer("sgd", ref)
    train_steps(ref, ref_opt, comm1, 0, 2)
    checkpoint.save(tmp_path, model=ref, optimizer=ref_opt, step=2, comm=comm1)
    train_steps(ref, ref_opt, comm1, 2, 4)
    model = Net()
    opt = make_optimizer("sgd", model)
    info = checkpoint.load(tmp_path, model=model, optimizer=opt, comm=comm1, restore_rng=False)
    assert "not restored" in info.rng
    train_steps(model, opt, comm1, 2, 4)
    assert not params_equal(ref, model)


def test_load_says_which_generators_it_could_not_restore(
        tmp_path: Path, comm1: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A checkpoint saved where the rank saw one GPU, loaded where it sees another
    number: the CUDA generator keeps its state, and ``LoadInfo.rng`` says so (a resume
    that is not bitwise must not read as one)."""
    from kfac_hpc.checkpoint import rng

    capture = rng.capture

    def on_one_gpu() -> Any:
        arrays, attrs = capture()
        arrays["cuda_0"] = np.zeros(16, np.uint8)
        attrs["cuda_devices"] = 1
        return arrays, attrs

    model = Net()
    opt = make_optimizer("sgd", model)
    with monkeypatch.context() as m:
        m.setattr(rng, "capture", on_one_gpu)
        checkpoint.save(tmp_path, model=model, optimizer=opt, step=1, comm=comm1)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    info = checkpoint.load(tmp_path, model=model, optimizer=opt, comm=comm1)
    assert info.rng.startswith("restored: each rank its own state, but not every generator")
    assert "rank 0: cuda not restored (saved 1 device(s), 2 here)" in info.rng


# ---------------------------------------------------------------- preconditioner state
@pytest.mark.parametrize("eigen", [False, True])
def test_fake_preconditioner_round_trip(tmp_path: Path, comm1: Any, eigen: bool) -> None:
    model = Net()
    opt = make_optimizer("sgd", model)
    pre = FakeKFAC(model, comm1)
    for _ in range(3):
        pre.update()
    path = checkpoint.save(tmp_path / "x.h5", model=model, optimizer=opt, preconditioner=pre,
                           step=3, comm=comm1, store_eigenbases=eigen)
    fresh = FakeKFAC(model, comm1)
    info = checkpoint.load(path, model=model, optimizer=opt, preconditioner=fresh, comm=comm1)
    assert info.strategy == "mem-opt" and "kfac" in info.loaded
    fresh.check(3)
    assert fresh.steps == 3
    assert bool(fresh.loaded_eigenbases) == eigen
    if eigen:
        for k, parts in fresh.loaded_eigenbases.items():
            assert torch.equal(parts["eigenvectors"], pre.eigen[k][1])
    with h5py.File(path, "r") as f:
        assert f["kfac/fc1/A"].shape == (65, 65) and f["kfac/conv/G"].shape == (4, 4)
        assert ("kfac/fc1/A_eigenvectors" in f) == eigen
        assert f["kfac/fc1/A"].fletcher32 and f["kfac/fc1/A"].attrs["updates"] == 3


def test_factors_before_first_update_round_trip(tmp_path: Path, comm1: Any) -> None:
    model = Net()
    opt = make_optimizer("sgd", model)
    pre = FakeKFAC(model, comm1)  # no update yet: factors are None, counts 0
    checkpoint.save(tmp_path, model=model, optimizer=opt, preconditioner=pre, step=0,
                    comm=comm1)
    fresh = FakeKFAC(model, comm1)
    fresh.factors = {k: torch.eye(2) for k in fresh.factors}
    checkpoint.load(tmp_path, model=model, optimizer=opt, preconditioner=fresh, comm=comm1)
    fresh.check(0)


# ---------------------------------------------------------------- atomicity, latest, keep_last
def test_keep_last_latest_pointer_and_stale_tmp(tmp_path: Path, comm1: Any) -> None:
    model, opt = _trained("sgd", comm1, steps=1)
    assert checkpoint.latest(tmp_path) is None
    (tmp_path / "ckpt_00000099.h5.tmp").write_bytes(b"half a file")  # a crashed save
    for step in range(1, 6):
        path = checkpoint.save(tmp_path, model=model, optimizer=opt, step=step, comm=comm1,
                               keep_last=3)
        assert path == tmp_path / f"ckpt_{step:08d}.h5"
        assert (tmp_path / "latest").read_text().strip() == path.name
    names = sorted(os.listdir(tmp_path))
    assert names == ["ckpt_00000003.h5", "ckpt_00000004.h5", "ckpt_00000005.h5", "latest"]
    assert checkpoint.latest(tmp_path) == tmp_path / "ckpt_00000005.h5"
    assert checkpoint.list_checkpoints(tmp_path)[0].name == "ckpt_00000003.h5"

    # Without a usable pointer: the newest complete file.
    (tmp_path / "latest").write_text("ckpt_00000777.h5\n")
    assert checkpoint.latest(tmp_path) == tmp_path / "ckpt_00000005.h5"
    (tmp_path / "latest").unlink()
    assert checkpoint.latest(tmp_path) == tmp_path / "ckpt_00000005.h5"

    # A save at a lower step (resumed from an older checkpoint) becomes latest; the
    # later steps, of the run it abandoned, are moved to abandoned/<UTC time>/.
    checkpoint.save(tmp_path, model=model, optimizer=opt, step=2, comm=comm1, keep_last=2)
    assert checkpoint.latest(tmp_path) == tmp_path / "ckpt_00000002.h5"
    assert sorted(os.listdir(tmp_path)) == ["abandoned", "ckpt_00000002.h5", "latest"]
    (moved,) = (tmp_path / "abandoned").iterdir()
    assert sorted(os.listdir(moved)) == [f"ckpt_{s:08d}.h5" for s in (3, 4, 5)]

    # keep_last=None keeps everything; an explicit .h5 path touches no pointer.
    for step in (10, 11, 12, 13):
        checkpoint.save(tmp_path, model=model, optimizer=opt, step=step, comm=comm1,
                        keep_last=None)
    assert len(checkpoint.list_checkpoints(tmp_path)) == 5
    single = checkpoint.save(tmp_path / "sub" / "final.h5", model=model, optimizer=opt,
                             step=14, comm=comm1)
    assert single.is_file() and sorted(os.listdir(single.parent)) == ["final.h5"]
    assert checkpoint.latest(tmp_path) == tmp_path / "ckpt_00000013.h5"


def test_a_run_resumed_from_an_older_checkpoint_owns_the_rotation(
        tmp_path: Path, comm1: Any, caplog: pytest.LogCaptureFixture) -> None:
    """Run A saves steps 100, 200, 300; run B resumes from 100 and saves 110, 120, 130
    (``keep_last=3``). B's files fill the rotation (A's later ones would otherwise keep
    their places, newest by step, and B would hold one file); with B's newest damaged a
    resume falls back to B's previous one, not to A's step 300. A's files are kept,
    moved aside, and loadable."""
    model, opt = _trained("sgd", comm1, steps=1)
    for step in (100, 200, 300, 110, 120, 130):
        with caplog.at_level("WARNING", logger="kfac_hpc"):
            checkpoint.save(tmp_path, model=model, optimizer=opt, step=step, comm=comm1,
                            keep_last=3)
    assert [p.name for p in checkpoint.list_checkpoints(tmp_path)] == [
        f"ckpt_{s:08d}.h5" for s in (110, 120, 130)]
    assert "moved to" in caplog.text
    (moved,) = (tmp_path / "abandoned").iterdir()
    assert sorted(os.listdir(moved)) == ["ckpt_00000200.h5", "ckpt_00000300.h5"]
    assert checkpoint.load(moved / "ckpt_00000300.h5", model=model, optimizer=opt,
                           comm=comm1).step == 300
    newest = tmp_path / "ckpt_00000130.h5"
    os.truncate(newest, newest.stat().st_size // 2)
    assert checkpoint.latest(tmp_path, valid=True) == tmp_path / "ckpt_00000120.h5"


def test_a_failure_to_tidy_the_directory_does_not_fail_the_save(
        tmp_path: Path, comm1: Any, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """Pruning old checkpoints fails (a file that cannot be deleted) after ``latest``
    names the new one: the save has succeeded and returns its path; a warning says what
    remains."""
    model, opt = _trained("sgd", comm1, steps=1)
    checkpoint.save(tmp_path, model=model, optimizer=opt, step=1, comm=comm1, keep_last=1)

    def refuse(*args: Any, **kwargs: Any) -> list[Path]:
        raise PermissionError(13, "Permission denied", str(tmp_path / "ckpt_00000001.h5"))

    monkeypatch.setattr(atomic, "prune", refuse)
    with caplog.at_level("WARNING", logger="kfac_hpc"):
        path = checkpoint.save(tmp_path, model=model, optimizer=opt, step=2, comm=comm1,
                               keep_last=1)
    assert path == tmp_path / "ckpt_00000002.h5"
    assert checkpoint.latest(tmp_path) == path
    assert "tidying" in caplog.text and "Permission denied" in caplog.text


def test_latest_valid_skips_a_damaged_newest(tmp_path: Path, comm1: Any) -> None:
    model, opt = _trained("sgd", comm1, steps=1)
    for step in (1, 2):
        checkpoint.save(tmp_path, model=model, optimizer=opt, step=step, comm=comm1)
    newest = tmp_path / "ckpt_00000002.h5"
    os.truncate(newest, newest.stat().st_size // 2)
    assert checkpoint.latest(tmp_path) == newest
    assert checkpoint.latest(tmp_path, valid=True) == tmp_path / "ckpt_00000001.h5"


def test_failed_save_raises_and_keeps_previous(tmp_path: Path, comm1: Any) -> None:
    model, opt = _trained("sgd", comm1, steps=1)
    good = checkpoint.save(tmp_path, model=model, optimizer=opt, step=1, comm=comm1)
    with pytest.raises(CheckpointError, match="cannot store a object"):
        checkpoint.save(tmp_path, model=model, optimizer=opt, step=2, comm=comm1,
                        extra={"bad": object()})
    assert checkpoint.latest(tmp_path) == good and not list(tmp_path.glob("*.tmp"))
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(CheckpointError, match="cannot prepare"):
        checkpoint.save(blocker / "sub", model=model, optimizer=opt, step=3, comm=comm1)


# ---------------------------------------------------------------- bad files
def _damage(kind: str, path: Path) -> str:
    """Damage ``path`` one way; returns a regex the error must match."""
    if kind == "truncated":
        os.truncate(path, path.stat().st_size * 2 // 3)
        return "truncated checkpoint"
    if kind == "bitflip-chunked":
        flip_byte(path, "/model/fc1.weight", 100)
        return r"dataset /model/fc1\.weight: (cannot read|checksum mismatch)"
    if kind == "bitflip-contiguous":
        flip_byte(path, "/model/fc2.bias")
        return r"dataset /model/fc2\.bias: checksum mismatch"
    if kind == "bitflip-scalar":
        flip_byte(path, "/model/bn.num_batches_tracked")
        return r"dataset /model/bn\.num_batches_tracked: checksum mismatch"
    if kind == "missing-dataset":
        with h5py.File(path, "r+") as f:
            del f["/model/fc2.bias"]
        return r"missing dataset /model/fc2\.bias"
    if kind == "edited-attribute":
        with h5py.File(path, "r+") as f:
            f["/kfac"].attrs["step"] = 999
        return "attributes do not match attrs_digest"
    if kind == "newer-version":
        with h5py.File(path, "r+") as f:
            f.attrs["format_version"] = FORMAT_VERSION + 1
        return "newer kfac_hpc.*upgrade"
    if kind == "not-hdf5":
        path.write_text("this is not a checkpoint\n")
        return "not an HDF5 file"
    if kind == "empty":
        path.write_bytes(b"")
        return "empty file"
    if kind == "other-hdf5":
        path.unlink()
        with h5py.File(path, "w") as f:
            f["x"] = 1
        return "not a kfac_hpc checkpoint"
    raise ValueError(kind)


BAD = ["truncated", "bitflip-chunked", "bitflip-contiguous", "bitflip-scalar",
       "missing-dataset", "edited-attribute", "newer-version", "not-hdf5", "empty",
       "other-hdf5"]


def _snapshot(model: nn.Module, opt: Any, pre: FakeKFAC) -> Any:
    return ({k: v.clone() for k, v in model.state_dict().items()}, repr(opt.state_dict()),
            {k: None if v is None else v.clone() for k, v in pre.factors.items()},
            torch.get_rng_state().clone())


@pytest.mark.parametrize("kind", BAD)
def test_bad_file_gives_one_clear_error_and_loads_nothing(tmp_path: Path, comm1: Any,
                                                          kind: str) -> None:
    model, opt = _trained("adam", comm1, steps=2, seed=3)
    pre = FakeKFAC(model, comm1)
    pre.update()
    path = checkpoint.save(tmp_path, model=model, optimizer=opt, preconditioner=pre, step=2,
                           comm=comm1)
    assert checkpoint.verify_file(path).ok
    pattern = _damage(kind, path)

    torch.manual_seed(50)
    live = Net()
    live_opt = make_optimizer("adam", live)
    train_steps(live, live_opt, comm1, 0, 1)
    live_pre = FakeKFAC(live, comm1)
    before = _snapshot(live, live_opt, live_pre)
    with pytest.raises(CheckpointError, match=pattern) as err:
        checkpoint.load(path, model=live, optimizer=live_opt, preconditioner=live_pre,
                        comm=comm1)
    assert str(path) in str(err.value)
    after = _snapshot(live, live_opt, live_pre)
    assert all(torch.equal(a, b) for a, b in zip(before[0].values(), after[0].values()))
    assert before[1] == after[1] and torch.equal(before[3], after[3])
    assert all(v is None for v in after[2].values())

    report = checkpoint.verify_file(path)
    assert not report.ok and any(__import__("re").search(pattern, p) for p in report.problems)
    assert cli_main(["ckpt", "verify", "-q", str(path)]) == 1


def test_wrong_model_lists_every_mismatch_and_strict_false_loads_the_rest(
        tmp_path: Path, comm1: Any) -> None:
    model, opt = _trained("sgd", comm1)
    pre = FakeKFAC(model, comm1)
    pre.update()
    checkpoint.save(tmp_path, model=model, optimizer=opt, preconditioner=pre, step=3,
                    comm=comm1)

    other = Net(hidden=32)  # fc1/fc2 shapes differ
    other_opt = make_optimizer("sgd", other)
    other_pre = FakeKFAC(other, comm1)
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(CheckpointError, match="does not match") as err:
        checkpoint.load(tmp_path, model=other, optimizer=other_opt, preconditioner=other_pre,
                        comm=comm1)
    text = str(err.value)
    for fragment in ("model: fc1.weight has shape (16, 64) in the checkpoint, (32, 64)",
                     "model: fc2.weight", "preconditioner: factor fc1/G is (16, 16)"):
        assert fragment in text
    assert all(torch.equal(before[k], v) for k, v in other.state_dict().items())

    info = checkpoint.load(tmp_path, model=other, optimizer=other_opt,
                           preconditioner=other_pre, comm=comm1, strict=False)
    assert info.loaded == ["optimizer", "model", "rng"]  # K-FAC left alone (mismatched)
    assert any("fc1.weight" in m for m in info.mismatches)
    assert any("K-FAC state not loaded" in m for m in info.mismatches)
    sd = other.state_dict()
    assert torch.equal(sd["conv.weight"], model.state_dict()["conv.weight"])
    assert torch.equal(sd["fc1.weight"], before["fc1.weight"])
    state = other_opt.state_dict()["state"]
    assert 0 in state and torch.equal(state[0]["momentum_buffer"],
                                      opt.state_dict()["state"][0]["momentum_buffer"])
    assert all(v is None for v in other_pre.factors.values())


def test_missing_optimizer_or_preconditioner_state_is_a_mismatch(tmp_path: Path,
                                                                  comm1: Any) -> None:
    model, opt = _trained("sgd", comm1)
    checkpoint.save(tmp_path, model=model, optimizer=None, step=1, comm=comm1)
    with pytest.raises(CheckpointError, match="no optimizer state"):
        checkpoint.load(tmp_path, model=model, optimizer=opt, comm=comm1)
    with pytest.raises(CheckpointError, match="no K-FAC state"):
        checkpoint.load(tmp_path, model=model, optimizer=None,
                        preconditioner=FakeKFAC(model, comm1), comm=comm1)
    adam = make_optimizer("adam", model)
    checkpoint.save(tmp_path, model=model, optimizer=opt, step=2, comm=comm1)
    with pytest.raises(CheckpointError, match="holds SGD state, the optimizer is Adam"):
        checkpoint.load(tmp_path, model=model, optimizer=adam, comm=comm1)
    with pytest.raises(CheckpointError, match="no such checkpoint"):
        checkpoint.load(tmp_path / "nothing.h5", model=model, optimizer=opt, comm=comm1)
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no checkpoint in"):
        checkpoint.load(tmp_path / "empty", model=model, optimizer=opt, comm=comm1)


def test_parameter_order_does_not_matter(tmp_path: Path, comm1: Any) -> None:
    model, opt = _trained("adam", comm1)
    checkpoint.save(tmp_path, model=model, optimizer=opt, step=3, comm=comm1)
    fresh = Net()
    params = dict(fresh.named_parameters())
    order = ["fc2.weight", "fc2.bias", "conv.weight", "conv.bias", "bn.weight", "bn.bias",
             "fc1.weight", "fc1.bias"]
    fresh_opt = torch.optim.Adam([params[n] for n in order], lr=1e-2)
    checkpoint.load(tmp_path, model=fresh, optimizer=fresh_opt, comm=comm1)
    want = {n: s for n, s in zip((n for n, _ in model.named_parameters()),
                                 (opt.state[p] for p in model.parameters()))}
    for n in order:
        assert torch.equal(fresh_opt.state[params[n]]["exp_avg"], want[n]["exp_avg"])


# ---------------------------------------------------------------- CLI
def test_cli_inspect_and_verify(tmp_path: Path, comm1: Any,
                                capsys: pytest.CaptureFixture[str]) -> None:
    model, opt = _trained("sgd", comm1)
    pre = FakeKFAC(model, comm1, strategy="dp-kfac")
    pre.update()
    path = checkpoint.save(tmp_path, model=model, optimizer=opt, preconditioner=pre, step=3,
                           comm=comm1, extra={"epoch": 1})
    assert cli_main(["ckpt", "verify", str(tmp_path)]) == 0
    assert "OK" in capsys.readouterr().out
    assert cli_main(["ckpt", "inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "step 3" in out and "strategy dp-kfac" in out and "fc1" in out and "65x65" in out
    assert cli_main(["ckpt", "inspect", "--json", str(path)]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["kfac"]["layers"]["fc1"]["A"] == {"shape": [65, 65], "updates": 1,
                                                  "owner": 0, "stored": True}
    assert data["extra"] == {"epoch": 1} and data["problems"] == []
    copy = tmp_path / "copy.h5"
    shutil.copy(path, copy)
    flip_byte(copy, "/kfac/fc1/A", 8)
    assert cli_main(["ckpt", "verify", str(copy)]) == 1
    assert "BAD" in capsys.readouterr().out
    assert cli_main(["ckpt", "verify", "--no-data", "-q", str(copy)]) == 0
    assert cli_main(["ckpt", "verify", "-q", str(tmp_path / "missing.h5")]) == 1
    assert cli_main(["ckpt", "inspect", str(tmp_path / "missing.h5")]) == 1
    atomic.write_pointer(tmp_path, "copy.h5")
    assert cli_main(["ckpt", "verify", "-q", str(tmp_path)]) == 1


def test_factor_values_on_disk_are_the_preconditioners(tmp_path: Path, comm1: Any) -> None:
    """Independent check of the file content with plain h5py."""
    model = Net()
    pre = FakeKFAC(model, comm1)
    for _ in range(2):
        pre.update()
    path = checkpoint.save(tmp_path, model=model, optimizer=None, preconditioner=pre, step=2,
                           comm=comm1)
    with h5py.File(path, "r") as f:
        table = json.loads(f["kfac"].attrs["factors"])
        for key, entry in table.items():
            dim = entry["shape"][0]
            want = expected_factor(key, 2, dim)
            assert want is not None
            assert np.array_equal(f[entry["path"]][()], want.numpy())
        assert f.attrs["format"] == "kfac_hpc" and f.attrs["step"] == 2
