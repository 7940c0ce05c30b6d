"""Checkpoint retention and what a resumed or diverged run says about its checkpoints.

* K-FAC state in a checkpoint that a ``--preconditioner none`` run does not use: one
  warning naming it and how to keep it.
* ``--checkpoint-keep-every-epochs E``: milestone checkpoints that the rotation of
  ``--checkpoint-keep`` never deletes.
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
    assert out.count("warning: ") == 1, out
    assert out.count(f"warning: {ck / 'ckpt_00000003.h5'} holds K-FAC state") == 1, out
    assert "--preconditioner none does not use: it is dropped" in out
    assert "resume with --preconditioner kfac" in out
    # the same checkpoint resumed by K-FAC: nothing dropped, no warning
    train(config(tmp_path, preconditioner="kfac", resume=str(ck / "ckpt_00000003.h5"),
                 max_steps=4), comm, verbose=True)
    assert "holds K-FAC state" not in capsys.readouterr().out
