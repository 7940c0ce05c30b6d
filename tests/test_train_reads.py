"""The driver reads the device only at read points (``kfac_hpc.train.pending``).

A training step keeps its loss and accuracy on the device; they are read, all at once,
at the next read point (a logged step, a progress line, a checkpoint, a stop, the end of
an epoch or of the run). Checked here: steps between read points do no host read of a
tensor value (on a GPU each would be a device sync); a run's records, checkpoints and
final parameters do not depend on how often it reads; a NaN loss at a step that is not
read at once is found at the next read point, named with its step, and nothing is
checkpointed after it.

MPI: ``launch/local -n 2 --timeout 600 python -m mpi4py -m pytest -q --with-mpi
--only-mpi tests/test_train_reads.py``.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
import torch
from op_count import HostReads

from kfac_hpc.train.config import TrainConfig
from kfac_hpc.train.loop import Trainer, TrainingDiverged, train
from kfac_hpc.train.metrics import read_jsonl
from tests.test_train_loop import _nan_output_from, config, has_kfac, self_comm


def shared_path(comm: Any, tmp_path: Path) -> Path:
    """Rank 0's ``tmp_path`` on every rank (one run directory, one checkpoint directory)."""
    return Path(comm.broadcast_object(str(tmp_path))) if comm.size > 1 else tmp_path


def reads_per_step(comm: Any, cfg: TrainConfig) -> list[dict[str, int]]:
    """Train ``cfg``; the host reads of tensor values from each step's start to the next's.

    Step ``s``'s entry covers its ``train_step``, the flags' agreement, the read point
    if it is one, and fetching the next batch. What K-FAC's own ``step()`` reads is the
    library's, not the driver's: it is left out.
    """
    cfg.validate()
    trainer = Trainer(cfg, comm, verbose=False)
    reads = HostReads()
    marks: list[dict[str, int]] = []
    library: dict[str, int] = {}
    train_step = trainer.train_step

    def counted_train_step(x: torch.Tensor, y: torch.Tensor) -> Any:
        marks.append({k: v - library.get(k, 0) for k, v in reads.calls.items()})
        return train_step(x, y)

    trainer.train_step = counted_train_step  # type: ignore[method-assign]
    if trainer.pre is not None:
        pre_step = trainer.pre.step

        def uncounted_pre_step(*args: Any, **kwargs: Any) -> Any:
            before = dict(reads.calls)
            try:
                return pre_step(*args, **kwargs)
            finally:
                for k, v in reads.calls.items():
                    library[k] = library.get(k, 0) + v - before.get(k, 0)

        trainer.pre.step = uncounted_pre_step  # type: ignore[method-assign]
    try:
        with reads:
            trainer.fit()
    finally:
        trainer.close()
    marks.append({k: v - library.get(k, 0) for k, v in reads.calls.items()})
    return [{k: b[k] - a.get(k, 0) for k in b if b[k] != a.get(k, 0)}
            for a, b in itertools.pairwise(marks)]


def _check_reads(comm: Any, tmp_path: Path, pre: str, progress_every: int | None,
                 **every: int) -> None:
    """Reads at steps 5 and 10 (``every``: ``log_every_steps`` or ``read_every_steps``)."""
    cfg = config(tmp_path, comm.size, epochs=1, max_steps=12, preconditioner=pre,
                 progress=progress_every is not None,
                 progress_every_steps=progress_every or 100, **(every or {"log_every_steps": 5}))
    per_step = reads_per_step(comm, cfg)
    assert len(per_step) == 12
    read_points = {5, 10} | ({3, 6, 9} if progress_every else set())
    for step, reads in enumerate(per_step[:-1], start=1):  # the last: the run's end
        if step in read_points:
            assert reads == {"tolist": 1}, (step, per_step)  # the one read of the block
        else:
            assert reads == {}, (step, per_step)


@pytest.mark.parametrize("progress_every", [None, 3])
@pytest.mark.parametrize("pre", ["none", "kfac"])
def test_steps_between_read_points_read_no_tensor(tmp_path: Path, pre: str,
                                                  progress_every: int | None) -> None:
    """``--log-every-steps 5`` (and progress lines every 3 steps): the steps that are
    not read points read nothing from a tensor; a read point reads once."""
    if pre == "kfac" and not has_kfac():
        pytest.skip("kfac_hpc.KFACPreconditioner missing")
    _check_reads(self_comm(), tmp_path, pre, progress_every)


@pytest.mark.parametrize("pre", ["none", "kfac"])
def test_every_step_logged_but_read_every_5(tmp_path: Path, pre: str) -> None:
    """``--log-every-steps 1 --read-every-steps 5``: a record for every step, but only
    every fifth step reads, as a GPU run does by default (every 50)."""
    if pre == "kfac" and not has_kfac():
        pytest.skip("kfac_hpc.KFACPreconditioner missing")
    _check_reads(self_comm(), tmp_path, pre, None, log_every_steps=1, read_every_steps=5)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("pre", ["none", "kfac"])
def test_steps_between_read_points_read_no_tensor_on_every_rank(comm: Any, tmp_path: Path,
                                                                pre: str) -> None:
    _check_reads(comm, tmp_path, pre, None)


# ----------------------------------------------------------- the same run, read less often
STEP_KEYS = ("step", "epoch", "lr", "loss", "acc", "samples")
EPOCH_KEYS = ("epoch", "step", "lr", "train_loss", "train_acc", "test_loss", "test_acc")


def _run(comm: Any, root: Path, name: str, **changes: Any) -> tuple[Any, list[dict[str, Any]]]:
    cfg = config(root, comm.size, out=str(root / name / "run"),
                 checkpoint_dir=str(root / name / "ck"), checkpoint_every_steps=4,
                 checkpoint_keep=100, **changes)
    result = train(cfg, comm, verbose=False)
    records = read_jsonl(root / name / "run" / "metrics.jsonl") if comm.rank == 0 else []
    return result, records


def _checkpoint_state(path: Path) -> dict[str, Any]:
    """The metrics a checkpoint keeps, and its parameters."""
    from kfac_hpc import checkpoint
    from kfac_hpc.models import build_model

    model = build_model("mlp", input_dim=64, num_classes=10)
    info = checkpoint.load(path, model=model, optimizer=None, comm=self_comm(),
                           restore_rng=False)
    metrics = info.extra["metrics"]
    return {"step": info.step, "epoch_stats": list(metrics["epoch_stats"]),
            "train_samples": metrics["train_samples"],
            "window": list(metrics["loss_range"]["window"]),
            "params": {k: v.clone() for k, v in model.state_dict().items()}}


def _check_same_run(comm: Any, tmp_path: Path, pre: str) -> None:
    root = shared_path(comm, tmp_path)
    every, every_rec = _run(comm, root, "every", log_every_steps=1, read_every_steps=1,
                            preconditioner=pre)
    runs = {"sparse": _run(comm, root, "sparse", log_every_steps=5, read_every_steps=5,
                           preconditioner=pre),
            "read5": _run(comm, root, "read5", log_every_steps=1, read_every_steps=5,
                          preconditioner=pre)}
    logged_steps = {"sparse": [*range(5, 44, 5), 44], "read5": list(range(1, 45))}
    from kfac_hpc import checkpoint

    files = {"every": checkpoint.list_checkpoints(root / "every" / "ck")}
    assert len(files["every"]) == 11  # every 4 steps (the last: the final one)
    for name, (result, records) in runs.items():
        assert result.checksum == every.checksum and result.steps == every.steps == 44
        for key in ("train_loss", "train_acc", "test_loss", "test_acc"):
            assert getattr(result, key) == getattr(every, key), (name, key)
        if comm.rank != 0:
            continue
        steps = {r["step"]: r for r in every_rec if r["kind"] == "step"}
        logged = [r for r in records if r["kind"] == "step"]
        assert [r["step"] for r in logged] == logged_steps[name]
        for r in logged:  # bitwise: floats read back from JSON as written
            assert {k: r[k] for k in STEP_KEYS} == {k: steps[r["step"]][k] for k in STEP_KEYS}
        epochs = [[r[k] for k in EPOCH_KEYS] for r in every_rec if r["kind"] == "epoch"]
        assert [[r[k] for k in EPOCH_KEYS] for r in records if r["kind"] == "epoch"] == epochs
        files[name] = checkpoint.list_checkpoints(root / name / "ck")
        assert [f.name for f in files[name]] == [f.name for f in files["every"]]
        for a, b in zip(files["every"], files[name]):
            sa, sb = _checkpoint_state(a), _checkpoint_state(b)
            params_a, params_b = sa.pop("params"), sb.pop("params")
            assert sa == sb, (name, a.name, sa, sb)
            assert all(torch.equal(params_a[k], params_b[k]) for k in params_a), (name, a.name)


@pytest.mark.parametrize("pre", ["none", "kfac"])
def test_records_checkpoints_and_parameters_do_not_depend_on_the_reads(
        tmp_path: Path, pre: str) -> None:
    """Two epochs (22 steps each) with a checkpoint every 4 steps, step records every
    step or every 5 steps: the records both have, the epoch records, the metrics each
    checkpoint keeps, its parameters and the final checksum are bitwise the same."""
    if pre == "kfac" and not has_kfac():
        pytest.skip("kfac_hpc.KFACPreconditioner missing")
    _check_same_run(self_comm(), tmp_path, pre)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("pre", ["none", "kfac"])
def test_records_do_not_depend_on_the_reads_on_every_rank(comm: Any, tmp_path: Path,
                                                          pre: str) -> None:
    _check_same_run(comm, tmp_path, pre)


# ------------------------------------------------------------------------ a late NaN
def _check_late_nan(comm: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The loss of step 6 is NaN; steps 5 (logged) and 4 (checkpointed) were read, step 6
    is not a read point: steps 7 and 8 run, and the read point of step 8's checkpoint
    finds step 6's loss before writing anything."""
    from kfac_hpc import checkpoint

    _nan_output_from(6, monkeypatch)
    root = shared_path(comm, tmp_path)
    ck = root / "ck"
    cfg = config(root, comm.size, log_every_steps=5, checkpoint_dir=str(ck),
                 checkpoint_every_steps=4, checkpoint_keep=3)
    calls = {"n": 0}
    original = Trainer.train_step

    def counted(self: Trainer, x: torch.Tensor, y: torch.Tensor) -> Any:
        calls["n"] += 1
        return original(self, x, y)

    monkeypatch.setattr(Trainer, "train_step", counted)
    with pytest.raises(TrainingDiverged) as err:
        train(cfg, comm, verbose=False)
    exc = err.value
    messages = comm.allgather_object(str(exc)) if comm.size > 1 else [str(exc)]
    assert len(set(messages)) == 1, messages
    assert calls["n"] == 8  # found late, at the read point of step 8
    assert (exc.step, exc.epoch) == (6, 1)
    assert str(exc) == (f"loss became NaN/Inf at step 6 (epoch 1); last finite checkpoint: "
                        f"{ck / 'ckpt_00000004.h5'}; the loss left its running range at step "
                        f"6 (NaN/Inf); newest checkpoint before that: {ck / 'ckpt_00000004.h5'}")
    if comm.rank == 0:
        assert [f.name for f in checkpoint.list_checkpoints(ck)] == ["ckpt_00000004.h5"]
        records = [r for r in read_jsonl(root / "run" / "metrics.jsonl")
                   if r["kind"] == "step"]
        assert [r["step"] for r in records] == [5]  # no record after the NaN


def test_nan_loss_between_read_points_is_found_at_the_next(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _check_late_nan(self_comm(), tmp_path, monkeypatch)


@pytest.mark.mpi(min_size=2)
def test_nan_loss_between_read_points_is_found_on_every_rank(
        comm: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _check_late_nan(comm, tmp_path, monkeypatch)


@pytest.mark.parametrize("every", [1, 5])
def test_nan_loss_between_read_points_is_named_before_a_later_kfac_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, every: int) -> None:
    """The loss of step 6 is NaN and K-FAC raises its agreed error at step 8 (before any
    read point after step 5): the steps not read yet are read first, so the run ends
    with step 6's loss, as it would have when reading every step."""
    if not has_kfac():
        pytest.skip("kfac_hpc.KFACPreconditioner missing")
    from kfac_hpc.kfac.errors import KFACNumericalError
    from kfac_hpc.kfac.preconditioner import KFACPreconditioner

    _nan_output_from(6, monkeypatch)
    error = KFACNumericalError("K-FAC step 8: non-finite factor statistics", step=8, ranks=1,
                               local=["0/A"])
    real_step, calls = KFACPreconditioner.step, {"n": 0}

    def step(self: Any, *args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 8:
            raise error
        if calls["n"] >= 6:  # NaN statistics: K-FAC would have raised at step 6 itself
            return None
        return real_step(self, *args, **kwargs)

    monkeypatch.setattr(KFACPreconditioner, "step", step)
    with pytest.raises(TrainingDiverged) as err:
        train(config(tmp_path, preconditioner="kfac", log_every_steps=every), self_comm(),
              verbose=False)
    assert calls["n"] == (6 if every == 1 else 8)  # every step read: found at step 6
    assert str(err.value).startswith("loss became NaN/Inf at step 6 (epoch 1); "
                                     "last finite checkpoint: none"), str(err.value)


def test_evaluation_reads_once_whatever_its_batches(tmp_path: Path) -> None:
    """The evaluation reads its batches' losses in one go: as many host reads with 45
    batches as with 6 (before: two per batch)."""
    reads = {}
    for batch in (8, 64):
        cfg = config(tmp_path, epochs=1, max_steps=1, eval_batch_size=batch)
        cfg.validate()
        trainer = Trainer(cfg, self_comm(), verbose=False)
        try:
            counter = HostReads()
            with counter:
                stats = trainer.evaluate()
            reads[batch] = dict(counter.calls)
        finally:
            trainer.close()
        assert stats.count == 360  # the digits' test set
    assert reads[8] == reads[64] and reads[8]["tolist"] == 1, reads


@pytest.mark.parametrize("device, log_every, read_every, want", [
    ("cpu", 1, None, 1), ("cpu", 5, None, 5), ("cuda", 1, None, 50), ("cuda", 80, None, 80),
    ("cuda", 1, 3, 3), ("cpu", 5, 2, 2),
])
def test_reads_default_to_the_logged_steps_on_a_cpu_and_every_50_on_a_gpu(
        tmp_path: Path, device: str, log_every: int, read_every: int | None, want: int) -> None:
    from types import SimpleNamespace

    cfg = config(tmp_path, log_every_steps=log_every, read_every_steps=read_every)
    host = SimpleNamespace(cfg=cfg, device=torch.device(device))
    assert Trainer.read_every_steps.fget(host) == want  # type: ignore[attr-defined]
