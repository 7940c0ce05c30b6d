"""Checkpoint retention and what a resumed or diverged run says about its checkpoints.

* K-FAC state in a checkpoint that a ``--preconditioner none`` run does not use: one
  warning naming it and how to keep it.
* ``--checkpoint-keep-every-epochs E``: milestone checkpoints that the rotation of
  ``--checkpoint-keep`` never deletes.
* ``--checkpoint-keep-best METRIC``: the checkpoint of the best epoch by METRIC, which
  the rotation never deletes, across a resume too.
* A diverged run names, besides the last finite checkpoint, the newest one taken before
  the loss left its running range (:data:`kfac_hpc.train.loop.RANGE_FACTOR`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kfac_hpc.train.config import TrainConfig
from kfac_hpc.train.loop import train

pytest.importorskip("h5py")


def has_kfac() -> bool:
    import kfac_hpc

    return hasattr(kfac_hpc, "KFACPreconditioner")


def config(tmp_path: Path, world_size: int = 1, **changes: Any) -> TrainConfig:
    base: dict[str, Any] = {
        "batch_size": 64 // world_size, "epochs": 1, "preconditioner": "none",
        "progress": False, "threads": 1, "out": str(tmp_path / "run"),
    }
    return TrainConfig(**{**base, **changes})


def self_comm() -> Any:
    from mpi4py import MPI

    from kfac_hpc.comm import Communicator

    return Communicator(MPI.COMM_SELF, name="self")


@pytest.mark.skipif(not has_kfac(), reason="kfac_hpc.KFACPreconditioner missing")
def test_resuming_kfac_without_a_preconditioner_warns_once(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    comm, ck = self_comm(), tmp_path / "ck"
    first = config(tmp_path, preconditioner="kfac", checkpoint_dir=str(ck), max_steps=3)
    train(first, comm, verbose=False)
    capsys.readouterr()
    train(config(tmp_path, checkpoint_dir=str(ck), max_steps=5), comm, verbose=True)
    out = capsys.readouterr().out
    # one warning about the K-FAC state, one about the schedule (--max-steps 3 -> 5), one
    # about the warm-up (1 epoch of 1)
    assert out.count("warning: ") == 3 and "learning-rate schedule spans 5" in out, out
    assert out.count(f"warning: {ck / 'ckpt_00000003.h5'} holds K-FAC state") == 1, out
    assert "--preconditioner none does not use: it is dropped" in out
    assert "resume with --preconditioner kfac" in out
    # the same checkpoint resumed by K-FAC: nothing dropped, no warning
    train(config(tmp_path, preconditioner="kfac", resume=str(ck / "ckpt_00000003.h5"),
                 max_steps=4), comm, verbose=True)
    assert "holds K-FAC state" not in capsys.readouterr().out


def test_milestones_are_kept_besides_the_last_n(tmp_path: Path) -> None:
    """prune: the first checkpoint at or after every multiple of the interval survives
    the rotation and never counts against keep_last."""
    from kfac_hpc.checkpoint import atomic
    from kfac_hpc.checkpoint.layout import checkpoint_name

    def steps() -> list[int]:
        return [int(p.stem.split("_")[1]) for p in atomic.list_checkpoints(tmp_path)]

    for step in (3, 6, 9, 12, 15, 21, 24, 27):
        (tmp_path / checkpoint_name(step)).write_bytes(b"x")
        atomic.prune(tmp_path, 2, protect=checkpoint_name(step), keep_every_steps=10)
    assert steps() == [12, 21, 24, 27]  # milestones of [10, 20) and [20, 30), then the last 2
    atomic.prune(tmp_path, 1, protect=checkpoint_name(27), keep_every_steps=10)
    assert steps() == [12, 21, 27]
    atomic.prune(tmp_path, 1, protect=checkpoint_name(27))  # no milestones: the last 1
    assert steps() == [27]


def test_a_milestone_checkpoint_survives_the_rotation_of_a_run(tmp_path: Path) -> None:
    """--checkpoint-every-steps 5 --checkpoint-keep 2 --checkpoint-keep-every-epochs 1:
    the last two, and the first checkpoint of every epoch, are on disk."""
    from kfac_hpc.checkpoint import atomic, verify_file

    ck = tmp_path / "ck"
    result = train(config(tmp_path, epochs=3, checkpoint_dir=str(ck), checkpoint_every_steps=5,
                          checkpoint_keep=2, checkpoint_keep_every_epochs=1,
                          checkpoint_background=False), self_comm(), verbose=False)
    per_epoch = result.steps // 3
    saved = [s for s in range(1, result.steps + 1) if s % 5 == 0 or s == result.steps]
    milestones = {min(s for s in saved if s >= k * per_epoch) for k in (1, 2, 3)}
    rotated = [s for s in saved if s not in milestones][-2:]
    files = atomic.list_checkpoints(ck)
    assert [int(p.stem.split("_")[1]) for p in files] == sorted(milestones | set(rotated))
    assert all(verify_file(p).ok for p in files)
    assert len(files) > 2


def blow_up_run(comm: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """SGD at lr 0.05 for 15 steps, then lr 1e4 (checkpoints every step, all kept): the
    message names, besides the last finite checkpoint, the newest one taken before the
    loss left its running range, which holds the sane parameters of before the blow-up."""
    import math
    import re

    import kfac_hpc.train.loop as loop
    from kfac_hpc import checkpoint
    from kfac_hpc.models import build_model

    def schedule(*_: Any) -> Any:
        return lambda step: 0.05 if step < 15 else 1e4

    monkeypatch.setattr(loop, "lr_schedule", schedule)
    ck = tmp_path / "ck"
    cfg = config(tmp_path, comm.size, checkpoint_dir=str(ck), checkpoint_every_steps=1,
                 checkpoint_keep=1000, checkpoint_background=False)
    with pytest.raises(loop.TrainingDiverged) as err:
        train(cfg, comm, verbose=False)
    exc = err.value
    messages = comm.allgather_object(str(exc)) if comm.size > 1 else [str(exc)]
    assert len(set(messages)) == 1, messages
    m = re.search(r"last finite checkpoint: (?P<finite>.+?); the loss left its running range "
                  r"at step (?P<left>\d+) \((?P<how>.+)\); newest checkpoint before that: "
                  r"(?P<before>.+)$", str(exc))
    assert m is not None, str(exc)
    left = int(m["left"])
    assert 17 <= left <= exc.step, str(exc)  # the first step after the update at lr 1e4
    assert m["finite"] == exc.checkpoint and m["before"] == exc.before_range
    assert exc.before_range == str(ck / f"ckpt_{left - 2:08d}.h5") != exc.checkpoint
    if comm.rank == 0:
        def largest(path: str) -> float:
            model = build_model("mlp", input_dim=64, num_classes=10)
            checkpoint.load(path, model=model, optimizer=None, comm=self_comm(),
                            restore_rng=False)
            return max(float(p.detach().abs().max()) for p in model.parameters())

        sane = largest(exc.before_range)
        assert math.isfinite(sane) and sane < 100
        assert exc.checkpoint is not None and largest(exc.checkpoint) > 10 * sane


def test_divergence_names_the_checkpoint_before_the_blow_up(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blow_up_run(self_comm(), tmp_path, monkeypatch)


@pytest.mark.mpi(min_size=2)
def test_divergence_names_the_checkpoint_before_the_blow_up_on_every_rank(
        comm: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blow_up_run(comm, Path(comm.broadcast_object(str(tmp_path))), monkeypatch)


def test_the_keep_best_option_is_validated() -> None:
    """--checkpoint-keep-best: one of the documented metrics, with --checkpoint-dir."""
    from kfac_hpc.train.config import KEEP_BEST_METRICS, ConfigError

    assert set(KEEP_BEST_METRICS) == {"test_acc", "test_loss", "train_loss"}
    for metric in KEEP_BEST_METRICS:
        assert TrainConfig(checkpoint_dir="ck", checkpoint_keep_best=metric).problems() == []
    problems = TrainConfig(checkpoint_dir="ck", checkpoint_keep_best="acc").problems()
    assert problems == ["--checkpoint-keep-best: unknown value 'acc'; valid: test_acc, "
                        "test_loss, train_loss" + problems[0].split("train_loss", 1)[1]]
    assert TrainConfig(checkpoint_keep_best="test_acc").problems() == [
        "--checkpoint-keep-best: needs --checkpoint-dir"]
    with pytest.raises(ConfigError, match="--checkpoint-keep-best: unknown value 'accuracy'"):
        TrainConfig(checkpoint_dir="ck", checkpoint_keep_best="accuracy").validate()


def scripted_accuracy(monkeypatch: pytest.MonkeyPatch, accuracies: list[float]) -> None:
    """Trainer.evaluate reports ``accuracies[epoch]`` (0-based epoch in progress)."""
    import kfac_hpc.train.loop as loop
    from kfac_hpc.train.metrics import WeightedMean

    def evaluate(self: Any) -> WeightedMean:
        return WeightedMean(1.0 - accuracies[self._epoch], 100 * accuracies[self._epoch], 100)

    monkeypatch.setattr(loop.Trainer, "evaluate", evaluate)


def best_of(path: Path) -> dict[str, Any]:
    """The best so far recorded in the metrics of the checkpoint ``path``."""
    from kfac_hpc import checkpoint
    from kfac_hpc.models import build_model

    model = build_model("mlp", input_dim=64, num_classes=10)
    info = checkpoint.load(str(path), model=model, optimizer=None, comm=self_comm(),
                           restore_rng=False)
    return dict((info.extra or {})["metrics"]["best"])


def keep_best_run(comm: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Accuracy 0.5, 0.9, 0.6, 0.7 over four epochs, a checkpoint every 5 steps, keep 1:
    the end of epoch 2 (the best) survives the later, worse checkpoints; its value and
    step are in every later checkpoint's metrics. A resume for two more epochs (0.8,
    0.95) goes on from that best: 0.8 does not replace it, 0.95 does."""
    from kfac_hpc.checkpoint import atomic
    from kfac_hpc.checkpoint.layout import checkpoint_name

    scripted_accuracy(monkeypatch, [0.5, 0.9, 0.6, 0.7, 0.8, 0.95])
    ck = tmp_path / "ck"
    opts: dict[str, Any] = {"checkpoint_dir": str(ck), "checkpoint_every_steps": 5,
                            "checkpoint_keep": 1, "checkpoint_keep_best": "test_acc",
                            "checkpoint_background": False}
    result = train(config(tmp_path, comm.size, epochs=4, **opts), comm, verbose=False)
    per_epoch = result.steps // 4
    best = ck / checkpoint_name(2 * per_epoch)
    last = ck / checkpoint_name(4 * per_epoch)
    names = [p.name for p in atomic.list_checkpoints(ck)]
    assert names == [best.name, last.name], names
    if comm.rank == 0:
        recorded = {"metric": "test_acc", "value": 0.9, "step": 2 * per_epoch,
                    "checkpoint": best.name}
        assert best_of(best) == best_of(last) == recorded
    comm.barrier()
    # resumed (from the last): epoch 5 at 0.8 is worse than the 0.9 of before the resume
    cfg = config(tmp_path, comm.size, epochs=6, max_steps=5 * per_epoch, **opts)
    train(cfg, comm, verbose=False)
    names = [p.name for p in atomic.list_checkpoints(ck)]
    assert names == [best.name, checkpoint_name(5 * per_epoch)], names
    # epoch 6 at 0.95: the new best, which (kept) does not count against the last 1; the
    # old best goes by the rotation
    train(config(tmp_path, comm.size, epochs=6, **opts), comm, verbose=False)
    names = [p.name for p in atomic.list_checkpoints(ck)]
    periodic = (6 * per_epoch - 1) // 5 * 5
    assert names == [checkpoint_name(periodic), checkpoint_name(6 * per_epoch)], names
    if comm.rank == 0:
        assert best_of(ck / names[1])["value"] == 0.95


def test_the_best_checkpoint_survives_rotation_and_resume(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    keep_best_run(self_comm(), tmp_path, monkeypatch)


@pytest.mark.mpi(min_size=2)
def test_the_best_checkpoint_survives_rotation_and_resume_on_every_rank(
        comm: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    keep_best_run(comm, Path(comm.broadcast_object(str(tmp_path))), monkeypatch)
