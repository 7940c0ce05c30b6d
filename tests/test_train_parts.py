"""The driver's parts: the checkpoint ``extra`` layout, StopReason, the loss range and
the divergence message, and the Trainer's one place of attribute setup.

* ``TrainExtra`` writes the layout checkpoints have always had (key by key), reads it
  back unchanged, and reads the ``extra`` of older checkpoints (no loss range, no best,
  nothing at all) with defaults; a run resumes from a checkpoint of the older layout.
* ``StopReason`` is a ``str`` enum whose values are what summaries and JSON held.
* ``LossRange`` and ``diverged`` give the message the retention tests parse.
* Every attribute of ``Trainer`` is first set in ``__init__``.
"""

from __future__ import annotations

import ast
import inspect
import json
import math
import textwrap
from pathlib import Path
from typing import Any

import pytest

from kfac_hpc.train.config import TrainConfig
from kfac_hpc.train.divergence import RANGE_MIN, LossRange, diverged
from kfac_hpc.train.extra import Best, LeftRange, TrainExtra
from kfac_hpc.train.result import StopReason


def full_extra() -> TrainExtra:
    return TrainExtra(
        loader={"epoch": 1, "batch_index": 2, "global_batch_size": 64, "seed": 0},
        epoch=1, history=[{"epoch": 1, "step": 21, "train_loss": 0.5}], train_time=3.25,
        train_samples=1344, epoch_stats=(1.5, 40.0, 64.0), loss_window=(0.75, 0.5),
        left_range=LeftRange(step=23, loss=math.inf, median=0.5, n=10),
        best=Best(metric="test_acc", value=0.9, step=21, checkpoint="ckpt_00000021.h5"),
        config={"lr": 0.1}, grad_scaler={"scale": 1024.0})


def test_extra_writes_the_layout_checkpoints_have() -> None:
    assert full_extra().to_dict() == {
        "loader": {"epoch": 1, "batch_index": 2, "global_batch_size": 64, "seed": 0},
        "epoch": 1,
        "metrics": {"history": [{"epoch": 1, "step": 21, "train_loss": 0.5}],
                    "train_time": 3.25, "train_samples": 1344,
                    "epoch_stats": [1.5, 40.0, 64.0],
                    "loss_range": {"window": [0.75, 0.5], "left": [23.0, math.inf, 0.5, 10.0]},
                    "best": {"metric": "test_acc", "value": 0.9, "step": 21,
                             "checkpoint": "ckpt_00000021.h5"}},
        "config": {"lr": 0.1},
        "grad_scaler": {"scale": 1024.0},
    }
    assert "grad_scaler" not in TrainExtra().to_dict()  # only with AMP float16


def test_extra_reads_back_what_it_wrote() -> None:
    extra = full_extra()
    assert TrainExtra.from_dict(extra.to_dict()) == extra
    assert TrainExtra.from_dict(TrainExtra().to_dict()) == TrainExtra()


def test_extra_of_older_checkpoints_reads_with_defaults() -> None:
    assert TrainExtra.from_dict(None) == TrainExtra()  # written by the library API
    old = full_extra().to_dict()
    del old["metrics"]["loss_range"], old["metrics"]["best"], old["grad_scaler"]
    read = TrainExtra.from_dict(old)
    assert read.loss_window == () and read.left_range is None and read.best is None
    assert read.grad_scaler is None and read.loader == old["loader"]
    assert read.history == old["metrics"]["history"] and read.epoch_stats == (1.5, 40.0, 64.0)
    assert TrainExtra.from_dict({"loader": old["loader"]}).train_samples == 0


def self_comm() -> Any:
    from mpi4py import MPI

    from kfac_hpc.comm import Communicator

    return Communicator(MPI.COMM_SELF, name="self")


def test_a_run_resumes_from_a_checkpoint_of_the_older_layout(tmp_path: Path) -> None:
    """A checkpoint whose ``extra`` lacks the loss range and the best (as written before
    they existed) resumes at its step and history, to the parameters of a run that
    never stopped."""
    pytest.importorskip("h5py")
    from kfac_hpc import checkpoint
    from kfac_hpc.models import build_model
    from kfac_hpc.train.loop import train
    from kfac_hpc.train.optim import build_optimizer

    comm = self_comm()

    def config(**changes: Any) -> TrainConfig:
        return TrainConfig(**{"batch_size": 64, "epochs": 2, "preconditioner": "none",
                              "progress": False, "threads": 1, "out": str(tmp_path / "run"),
                              "checkpoint_background": False, **changes})

    whole = train(config(), comm, verbose=False)
    new, polls = tmp_path / "new", iter(range(1, 1000))
    first = train(config(checkpoint_dir=str(new)), comm, verbose=False,
                  should_stop=lambda: next(polls) == 30)  # checkpointed at step 30
    assert first.stopped == StopReason.STOP_REQUESTED and first.steps == 30
    model = build_model("mlp", input_dim=64, num_classes=10)
    opt = build_optimizer(config().resolved(), model)
    info = checkpoint.load(str(new / "ckpt_00000030.h5"), model=model, optimizer=opt,
                           comm=comm)
    old = dict(info.extra or {})
    old["metrics"] = {k: v for k, v in old["metrics"].items() if k not in ("loss_range", "best")}
    path = checkpoint.save(str(tmp_path / "old"), model=model, optimizer=opt, step=30,
                           comm=comm, extra=old)
    resumed = train(config(resume=str(path)), comm, verbose=False)
    assert resumed.steps == whole.steps and resumed.checksum == whole.checksum
    assert resumed.stopped == StopReason.COMPLETED
    assert [r["step"] for r in resumed.history] == [r["step"] for r in whole.history]


def test_stop_reasons_are_the_strings_summaries_hold() -> None:
    assert [r.value for r in StopReason] == ["completed", "max_steps", "target",
                                             "stop_requested"]
    reason = StopReason.STOP_REQUESTED
    assert reason == "stop_requested" and isinstance(reason, str)
    assert str(reason) == f"{reason}" == "stop_requested"
    assert json.dumps({"stopped": reason}) == '{"stopped": "stop_requested"}'
    assert StopReason("max_steps") is StopReason.MAX_STEPS


def test_the_loss_range_starts_at_the_first_step_out_of_it() -> None:
    losses = LossRange()
    for step in range(1, RANGE_MIN + 1):
        losses.track(step, 1.0)
    losses.track(11, 10.5)  # over 10x the median 1.0
    losses.track(12, math.nan)
    assert losses.left == LeftRange(step=11, loss=10.5, median=1.0, n=RANGE_MIN)
    assert list(losses.window)[-1] == 10.5  # NaN never enters the window
    losses.track(13, 1.0)
    assert losses.left is None


def test_the_divergence_message_names_both_checkpoints() -> None:
    left = LeftRange(step=17, loss=math.inf, median=0.5, n=12)
    err = diverged("loss became NaN/Inf", step=19, epoch=2, last_checkpoint="ck/c19.h5",
                   checkpoint_dir="ck", left=left, before_range="ck/c15.h5")
    assert str(err) == ("loss became NaN/Inf at step 19 (epoch 2); last finite checkpoint: "
                        "ck/c19.h5; the loss left its running range at step 17 (NaN/Inf); "
                        "newest checkpoint before that: ck/c15.h5")
    assert (err.step, err.epoch, err.checkpoint, err.before_range) == (19, 2, "ck/c19.h5",
                                                                       "ck/c15.h5")
    plain = diverged("test loss became NaN/Inf", step=3, epoch=1, last_checkpoint=None,
                     checkpoint_dir=None, before_range="ignored without a range")
    assert str(plain) == ("test loss became NaN/Inf at step 3 (epoch 1); last finite "
                          "checkpoint: none (no --checkpoint-dir)")
    assert plain.before_range is None and plain.exit_status == 3


def test_every_trainer_attribute_is_first_set_in_init() -> None:
    """``close()`` may rely on every attribute: none appears first in another method."""
    from kfac_hpc.train.loop import Trainer

    tree = ast.parse(textwrap.dedent(inspect.getsource(Trainer)))
    in_init: set[str] = set()
    elsewhere: dict[str, str] = {}
    for method in tree.body[0].body:  # type: ignore[attr-defined]
        if not isinstance(method, ast.FunctionDef):
            continue
        for node in ast.walk(method):
            targets = (node.targets if isinstance(node, ast.Assign) else
                       [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else
                       [node.optional_vars] if isinstance(node, ast.withitem) else [])
            for target in targets:
                for t in ast.walk(target) if target is not None else ():
                    if (isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name)
                            and t.value.id == "self"):
                        if method.name == "__init__":
                            in_init.add(t.attr)
                        else:
                            elsewhere.setdefault(t.attr, method.name)
    assert {a: m for a, m in elsewhere.items() if a not in in_init} == {}
    assert "getattr(self" not in inspect.getsource(Trainer)


def test_deterministic_holds_cudnn_deterministic_for_the_run(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch
                                                             ) -> None:
    """``--deterministic``: cuDNN's deterministic algorithms while the run builds and
    trains, the caller's setting back after it."""
    import torch

    from kfac_hpc.train import loop

    seen: list[bool] = []
    build = loop.build_core
    monkeypatch.setattr(loop, "build_core", lambda *a, **k: seen.append(
        torch.backends.cudnn.deterministic) or build(*a, **k))
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", False)
    for deterministic in (True, False):
        loop.train(TrainConfig(epochs=1, max_steps=2, preconditioner="none", progress=False,
                               threads=1, deterministic=deterministic,
                               out=str(tmp_path / str(deterministic))),
                   self_comm(), verbose=False)
        assert torch.backends.cudnn.deterministic is False
        run = json.loads((tmp_path / str(deterministic) / "config.json").read_text())["run"]
        assert run["step_graph"] is False  # SGD on the CPU: no step graph
    assert seen == [True, False]
