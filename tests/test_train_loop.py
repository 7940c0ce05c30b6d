"""The training loop end to end on the embedded digits data.

MPI tests (``@pytest.mark.mpi(min_size=2)``) run under
``launch/local -n 2 --timeout 300 python -m mpi4py -m pytest -q --with-mpi --only-mpi
tests/test_train_*.py`` (and at 4 ranks by tests/run_all.sh): every rank trains
in-process. The global batch is kept at 64 whatever the world size.
"""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any

import pytest
import torch

from kfac_hpc.train.config import TrainConfig
from kfac_hpc.train.loop import TrainResult, train

GLOBAL_BATCH = 64



def has_kfac() -> bool:
    import kfac_hpc

    return hasattr(kfac_hpc, "KFACPreconditioner")


needs_kfac = pytest.mark.skipif(not has_kfac(), reason="kfac_hpc.KFACPreconditioner missing")


def config(tmp_path: Path, world_size: int = 1, **changes: Any) -> TrainConfig:
    base: dict[str, Any] = {
        "batch_size": GLOBAL_BATCH // world_size, "epochs": 2, "preconditioner": "none",
        "progress": False, "threads": 1, "out": str(tmp_path / "run"),
    }
    return TrainConfig(**{**base, **changes})


def params(result: TrainResult) -> dict[str, torch.Tensor]:
    assert result.model is not None
    return {n: p.detach().clone() for n, p in result.model.named_parameters()}


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def self_comm() -> Any:
    from mpi4py import MPI

    from kfac_hpc.comm import Communicator

    return Communicator(MPI.COMM_SELF, name="self")


# ------------------------------------------------------------------ MPI runs


@pytest.mark.mpi(min_size=2)
def test_sgd_reaches_95_percent_within_6_epochs(comm: Any, tmp_path: Path) -> None:
    """SGD (momentum 0.9, lr 0.1, cosine over 6 epochs) on P ranks: >= 95 % test accuracy
    within 6 epochs (measured, seeds 0-2, 2 and 4 ranks alike: first >= 95 % at epoch 3;
    97-99 % after 6). Stops at the target, so it also checks ``--target-accuracy``."""
    cfg = config(tmp_path, comm.size, epochs=6, target_accuracy=0.95)
    result = train(cfg, comm, verbose=False)
    assert result.ranks_agree
    assert result.epochs_to_target is not None, [h["test_acc"] for h in result.history]
    assert result.test_acc >= 0.95
    assert result.world_size == comm.size and result.global_batch_size == GLOBAL_BATCH
    if comm.rank == 0:
        files = {p.name for p in Path(cfg.out or "").iterdir()}
        assert {"config.json", "metrics.jsonl", "steps.csv", "epochs.csv",
                "summary.json"} <= files


@needs_kfac
@pytest.mark.mpi(min_size=2)
def test_kfac_reaches_95_percent_within_4_epochs(comm: Any, tmp_path: Path) -> None:
    """K-FAC (comm-opt, damping 0.1) on SGD, cosine over 4 epochs: >= 95 % test accuracy
    within 4 epochs (measured, seeds 0-2, 2 and 4 ranks: first >= 95 % at epoch 2-3)."""
    cfg = config(tmp_path, comm.size, epochs=4, preconditioner="kfac", target_accuracy=0.95)
    result = train(cfg, comm, verbose=False)
    assert result.ranks_agree
    assert result.epochs_to_target is not None, [h["test_acc"] for h in result.history]
    assert result.bytes_per_step > 0


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("pre", ["none", "kfac"])
def test_p_ranks_equal_one_rank_with_the_global_batch(comm: Any, tmp_path: Path,
                                                      pre: str) -> None:
    """P ranks with batch B equal 1 rank with batch P*B: the loader gives the same
    global batches and the averaged gradient is the global-batch gradient.

    Tolerance: only the order of float32 reductions differs (mean of P local means vs
    one mean). Observed max |difference| after 44 steps on 2 and 4 ranks: 1.2-1.5e-7
    (SGD), 3.6-4.8e-7 (K-FAC with float64 factors); 1e-5 leaves a 20x margin and is far
    below the ~1e-2 change of a single step. With float32 factors the eigensolver
    amplifies the reduction-order noise (measured 4e-4 after an inverse update on 2
    ranks), hence float64 here.
    """
    if pre == "kfac" and not has_kfac():
        pytest.skip("kfac_hpc.KFACPreconditioner missing")
    dtypes = {"kfac_factor_dtype": "float64", "kfac_inv_dtype": "float64"} if pre == "kfac" else {}
    many = train(config(tmp_path, comm.size, preconditioner=pre, **dtypes), comm, verbose=False)
    one = train(config(tmp_path, 1, preconditioner=pre, out=str(tmp_path / "one"), **dtypes),
                self_comm(), verbose=False)
    assert many.steps == one.steps == 2 * (1437 // GLOBAL_BATCH)
    diff = max_diff(params(many), params(one))
    assert diff < 1e-5, diff
    assert many.train_loss == pytest.approx(one.train_loss, rel=1e-4)
    assert many.test_acc == pytest.approx(one.test_acc, abs=1 / 360)  # at most one sample


@pytest.mark.mpi(min_size=2)
def test_ddp_equals_mpi_gradient_averaging(comm: Any, tmp_path: Path) -> None:
    mpi = train(config(tmp_path, comm.size, epochs=1), comm, verbose=False)
    ddp = train(config(tmp_path, comm.size, epochs=1, ddp=True), comm, verbose=False)
    assert ddp.averaging.startswith("torch DDP") and "MPI" in mpi.averaging
    assert max_diff(params(mpi), params(ddp)) < 1e-5


@pytest.mark.mpi(min_size=2)
def test_stop_request_on_one_rank_stops_all_at_the_same_step(comm: Any,
                                                             tmp_path: Path) -> None:
    calls = {"n": 0}

    def should_stop() -> bool:  # only the last rank ever asks to stop
        calls["n"] += 1
        return comm.rank == comm.size - 1 and calls["n"] >= 5

    result = train(config(tmp_path, comm.size), comm, verbose=False, should_stop=should_stop)
    assert result.stopped == "stop_requested" and result.steps == 5 and result.ranks_agree


# ---------------------------------------------------------------- serial runs


def test_accumulation_equals_one_big_batch(tmp_path: Path) -> None:
    """4 micro-batches of 16 give the gradient of the 64-sample batch (float tolerance)."""
    comm = self_comm()
    plain = train(config(tmp_path, epochs=1), comm, verbose=False)
    accum = train(config(tmp_path, epochs=1, accumulation_steps=4), comm, verbose=False)
    assert max_diff(params(plain), params(accum)) < 1e-5


def test_max_steps_stops_mid_epoch(tmp_path: Path) -> None:
    result = train(config(tmp_path, max_steps=7), self_comm(), verbose=False)
    assert result.stopped == "max_steps" and result.steps == 7
    assert result.epochs == pytest.approx(7 / 22, abs=1e-4)
    assert result.test_acc == result.test_acc  # evaluated (not NaN)


class FakeCheckpoint(types.ModuleType):
    """The ``kfac_hpc.checkpoint`` API (issue 6) backed by ``torch.save``."""

    def __init__(self) -> None:
        super().__init__("kfac_hpc.checkpoint")
        self.saved: list[int] = []

    def save(self, directory: str, *, model: Any, optimizer: Any, preconditioner: Any = None,
             step: int, comm: Any = None, extra: Any = None, keep_last: int = 3,
             store_eigenbases: bool = False) -> Path:
        path = Path(directory) / f"ckpt-{step:06d}.pt"
        path.parent.mkdir(parents=True, exist_ok=True)
        pre = preconditioner.state_dict(eigenbases=store_eigenbases) if preconditioner else None
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                    "pre": pre,
                    "step": step, "extra": extra}, path)
        self.saved.append(step)
        return path

    def latest(self, directory: str) -> Path | None:
        files = sorted(Path(directory).glob("ckpt-*.pt"))
        return files[-1] if files else None

    def load(self, path: str, *, model: Any, optimizer: Any, preconditioner: Any = None,
             comm: Any = None, strict: bool = True) -> dict[str, Any]:
        state = torch.load(path, weights_only=False)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        if preconditioner is not None:
            preconditioner.load_state_dict(state["pre"])
        return {"step": state["step"], "extra": state["extra"]}


def real_checkpoint_module() -> Any:
    try:
        import kfac_hpc.checkpoint as ckpt
    except ImportError:
        return None
    return ckpt if all(hasattr(ckpt, f) for f in ("save", "load", "latest")) else None


@pytest.mark.parametrize("stop", [20, 23])
@pytest.mark.parametrize("store", ["fake", "hdf5"])
@pytest.mark.parametrize("pre", ["none", "kfac"])
def test_stop_checkpoint_resume_is_bitwise_exact(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 pre: str, store: str, stop: int) -> None:
    """Stop at step ``stop`` (mid-epoch 1; 20 is a K-FAC inverse step, 23 is between two,
    where the stale eigenbases must come from the checkpoint), resume:
    the final parameters are bitwise those of the uninterrupted run, and the metrics
    continue (3 epoch records). ``fake``: the issue-6 API over torch.save (tests the
    loop alone); ``hdf5``: kfac_hpc.checkpoint itself."""
    if pre == "kfac" and not has_kfac():
        pytest.skip("kfac_hpc.KFACPreconditioner missing")
    comm = self_comm()
    saved: list[int]
    if store == "fake":
        fake = FakeCheckpoint()
        monkeypatch.setitem(__import__("sys").modules, "kfac_hpc.checkpoint", fake)
        saved = fake.saved
    else:
        real = real_checkpoint_module()
        if real is None:
            pytest.skip("kfac_hpc.checkpoint (save/load/latest) missing")
        saved = []
        original = real.save

        def recording_save(*args: Any, **kwargs: Any) -> Any:
            saved.append(kwargs["step"])
            return original(*args, **kwargs)

        monkeypatch.setattr(real, "save", recording_save)
    ref = train(config(tmp_path, epochs=3, preconditioner=pre), comm, verbose=False)
    cfg = config(tmp_path, epochs=3, preconditioner=pre, checkpoint_dir=str(tmp_path / "ck"))
    calls = {"n": 0}

    def stop_at() -> bool:
        calls["n"] += 1
        return calls["n"] == stop

    first = train(cfg, comm, verbose=False, should_stop=stop_at)
    assert first.stopped == "stop_requested" and first.steps == stop and saved == [stop]
    second = train(cfg, comm, verbose=False)
    assert second.stopped == "completed" and second.steps == ref.steps
    assert second.checksum == ref.checksum
    assert [round(h["epoch"]) for h in second.history] == [1, 2, 3]
    assert second.test_acc == ref.test_acc
    assert saved[-1] == ref.steps  # the final checkpoint


def test_checkpoint_flags_without_the_module(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    from kfac_hpc.train.config import ConfigError

    monkeypatch.setitem(__import__("sys").modules, "kfac_hpc.checkpoint",
                        types.ModuleType("kfac_hpc.checkpoint"))
    with pytest.raises(ConfigError, match="checkpoints are not available yet"):
        train(config(tmp_path, checkpoint_dir=str(tmp_path / "ck")), self_comm(), verbose=False)


def test_resume_errors_are_usage_errors(tmp_path: Path) -> None:
    from kfac_hpc.train.config import ConfigError

    if real_checkpoint_module() is None:
        pytest.skip("kfac_hpc.checkpoint (save/load/latest) missing")
    with pytest.raises(ConfigError, match="no such checkpoint"):
        train(config(tmp_path, resume=str(tmp_path / "nope.h5")), self_comm(), verbose=False)
    bad = tmp_path / "bad.h5"
    bad.write_bytes(b"not an HDF5 file")
    with pytest.raises(ConfigError, match="cannot resume from"):
        train(config(tmp_path, resume=str(bad)), self_comm(), verbose=False)
