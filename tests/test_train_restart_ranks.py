"""Restart on a different number of ranks keeps the global batch and the LR schedule.

Run under MPI (``launch/local -n 2 ... --with-mpi --only-mpi``): a run on P ranks is
stopped mid-epoch (checkpoint), then resumed by rank 0 alone with the same
``--batch-size`` (per rank): the per-rank batch is rescaled to keep the global batch,
the steps per epoch and learning rates are those of the uninterrupted P-rank run, and
so are the final parameters (up to the order of floating-point reductions). A global
batch the new number of ranks does not divide is a clear error on every rank.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from shared_cases import SMOOTH_MLP

from kfac_hpc.train.config import ConfigError, TrainConfig
from kfac_hpc.train.data import rescaled_batch_size
from kfac_hpc.train.loop import train

GLOBAL_BATCH = 64


def config(out: Path, world_size: int, **changes: Any) -> TrainConfig:
    # the smooth MLP: the runs compared differ in the order of float32 reductions
    base: dict[str, Any] = {
        "batch_size": GLOBAL_BATCH // world_size, "epochs": 2, "preconditioner": "none",
        "progress": False, "threads": 1, "out": str(out), "momentum": 0.9, **SMOOTH_MLP,
    }
    return TrainConfig(**{**base, **changes})


def self_comm() -> Any:
    from mpi4py import MPI

    from kfac_hpc.comm import Communicator

    return Communicator(MPI.COMM_SELF, name="self")


def test_rescaled_batch_size_rules() -> None:
    assert rescaled_batch_size(64, 4) == 16
    assert rescaled_batch_size(64, 1) == 64
    with pytest.raises(ValueError, match=r"not a multiple of 3.*1, 2, 4, 8, 16, 32, 64"):
        rescaled_batch_size(64, 3)
    with pytest.raises(ValueError, match="accumulation-steps 3"):
        rescaled_batch_size(64, 2, multiple_of=3)


@pytest.mark.mpi(min_size=2)
def test_restart_on_one_rank_keeps_global_batch_and_schedule(comm: Any, tmp_path: Path) -> None:
    d = Path(comm.broadcast_object(str(tmp_path)))
    ref = train(config(d / f"ref{comm.rank}", comm.size), comm, verbose=False)
    calls = [0]

    def stop() -> bool:  # a preemption at step 11 of 2 epochs (mid-epoch)
        calls[0] += 1
        return calls[0] == 11

    ck = d / "ck"
    first = train(config(d / f"a{comm.rank}", comm.size, checkpoint_dir=str(ck)), comm,
                  verbose=False, should_stop=stop)
    assert first.stopped == "stop_requested" and first.steps == 11
    comm.barrier()
    if comm.rank == 0:  # the same --batch-size (per rank) on 1 rank: rescaled to 64
        second = train(config(d / "b", comm.size, checkpoint_dir=str(ck), resume="auto"),
                       self_comm(), verbose=False)
        assert second.world_size == 1 and second.global_batch_size == GLOBAL_BATCH
        assert second.steps == ref.steps
        assert [h["lr"] for h in second.history] == [h["lr"] for h in ref.history]
        assert second.model is not None and ref.model is not None
        for a, b in zip(second.model.parameters(), ref.model.parameters(), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    comm.barrier()


@pytest.mark.mpi(min_size=2)
def test_global_batch_the_ranks_cannot_share_is_a_clear_error(comm: Any,
                                                             tmp_path: Path) -> None:
    d = Path(comm.broadcast_object(str(tmp_path)))
    ck = d / "ck"
    if comm.rank == 0:  # global batch 63 on one rank
        train(config(d / "a", 1, batch_size=63, max_steps=3, checkpoint_dir=str(ck)),
              self_comm(), verbose=False)
    comm.barrier()
    with pytest.raises(ConfigError, match=f"global batch 63 on {comm.size} ranks: 63 is not "
                       f"a multiple of {comm.size}"):
        train(config(d / f"b{comm.rank}", comm.size, batch_size=63, checkpoint_dir=str(ck),
                     resume="auto", max_steps=3), comm, verbose=False)
    comm.barrier()
