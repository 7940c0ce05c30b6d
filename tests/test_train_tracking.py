"""Tracking: TensorBoard event files from rank 0, per-phase times and bytes per step in
the step records, progress lines when stdout is not a terminal.

MPI: ``launch/local -n 2 python -m mpi4py -m pytest --with-mpi --only-mpi
tests/test_train_tracking.py``.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kfac_hpc.train.config import ConfigError, TrainConfig
from kfac_hpc.train.metrics import (
    PHASES,
    STEP_FIELDS,
    TRAFFIC_TAGS,
    MetricsWriter,
    ProgressReporter,
    read_jsonl,
    require_tensorboard,
)

ROOT = Path(__file__).resolve().parent.parent
needs_tensorboard = pytest.mark.skipif(importlib.util.find_spec("tensorboard") is None,
                                       reason="needs the tensorboard package")


def test_progress_lines_every_n_steps_and_every_m_minutes() -> None:
    now = [0.0]
    rep = ProgressReporter(total_steps=100, start_step=0, epochs=4, every_steps=10,
                           every_minutes=1.0, clock=lambda: now[0])
    lines = {}
    for step in range(1, 101):
        now[0] += 0.5 if step < 50 else 10.0  # slow steps from 50 on: the time trigger
        line = rep.update(step, step / 25, 2.0 / step, 32)
        if line is not None:
            lines[step] = line
    assert [s for s in lines if s < 50] == [10, 20, 30, 40]
    assert 56 in lines and 100 in lines  # 60 s after the line at step 50
    assert lines[10].startswith("step 10/100 (10.0%)  epoch 0.40/4  loss 0.2000")
    assert "64 samples/s" in lines[10]  # 10 steps x 32 samples in 5 s
    assert "elapsed 0:00:05" in lines[10] and "ETA 0:00:45" in lines[10]
    assert lines[100].endswith("ETA 0:00:00")


def test_step_fields_hold_every_phase_and_traffic_tag() -> None:
    assert all(f"time_{p}" in STEP_FIELDS for p in PHASES)
    assert all(f"bytes_{t}" in STEP_FIELDS for t in TRAFFIC_TAGS)


def test_missing_tensorboard_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(ImportError, match=r"--tensorboard needs the tensorboard package"):
        require_tensorboard()


def test_a_resumed_run_purges_the_tensorboard_events_after_its_checkpoint(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """As the CSV and JSON records of later steps are dropped, so are the events: the
    writer opens with ``purge_step`` one past the step resumed from (a fresh run: none)."""
    from kfac_hpc.train import metrics

    opened: list[dict[str, object]] = []

    class Writer:
        def __init__(self, **kwargs: object) -> None:
            opened.append(kwargs)

        def close(self) -> None:
            pass

    monkeypatch.setattr(metrics, "require_tensorboard", lambda: Writer)
    MetricsWriter(tmp_path / "run", tensorboard_dir=tmp_path / "tb").close()
    MetricsWriter(tmp_path / "run", append=True, resumed_at=40,
                  tensorboard_dir=tmp_path / "tb").close()
    assert [o["purge_step"] for o in opened] == [None, 41]


def test_missing_tensorboard_stops_the_driver_with_exit_2(tmp_path: Path) -> None:
    """Every rank checks during setup: a ConfigError (exit 2), one message, no traceback."""
    code = ("import sys; sys.modules['torch.utils.tensorboard'] = None; "
            "from kfac_hpc.cli import main; sys.exit(main(sys.argv[1:]))")
    p = subprocess.run([sys.executable, "-c", code, "train", "--epochs", "1",
                        "--tensorboard", str(tmp_path / "tb"), "--out", str(tmp_path / "r")],
                       cwd=tmp_path, capture_output=True, text=True, timeout=240, check=False)
    assert p.returncode == 2, p.stdout + p.stderr
    assert p.stderr.count("error:") == 1 and "pip install 'kfac_hpc[tensorboard]'" in p.stderr
    assert "Traceback" not in p.stderr


@needs_tensorboard
def test_tensorboard_event_files_hold_the_records(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with MetricsWriter(tmp_path / "run", tensorboard_dir=tmp_path / "tb") as w:
        for step in (1, 2):
            w.step({"step": step, "loss": 1.0 / step, "time_kfac": 0.01, "bytes_factors": 8})
        w.epoch({"step": 2, "epoch": 1, "test_acc": 0.5, "train_loss": float("nan")})
    off = MetricsWriter(tmp_path / "run1", enabled=False, tensorboard_dir=tmp_path / "tb1")
    off.close()
    assert not (tmp_path / "tb1").exists()  # other ranks write nothing
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"train/loss", "time/time_kfac", "bytes/bytes_factors", "epoch/test_acc"} <= tags
    assert "epoch/train_loss" not in tags  # NaN is left out
    assert [e.value for e in acc.Scalars("train/loss")] == [1.0, 0.5]


def test_step_records_have_phase_times_and_progress_lines_without_a_terminal(
        tmp_path: Path) -> None:
    """stdout to a pipe (a batch .out file): progress lines every N steps, no bar."""
    args = ["train", "--epochs", "1", "--batch-size", "32", "--threads", "1",
            "--progress-every-steps", "10", "--out", str(tmp_path / "run")]
    if importlib.util.find_spec("tensorboard") is not None:
        args += ["--tensorboard", str(tmp_path / "tb")]
    p = subprocess.run([sys.executable, "-m", "kfac_hpc", *args], cwd=tmp_path,
                       capture_output=True, text=True, timeout=240, check=False)
    assert p.returncode == 0, p.stdout + p.stderr
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("step ")]
    assert [ln.split()[1] for ln in lines] == ["10/44", "20/44", "30/44", "40/44", "44/44"]
    assert all("samples/s" in ln and "ETA" in ln and "loss" in ln for ln in lines)
    steps = [r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if r["kind"] == "step"]
    # digits + K-FAC (default): every K-FAC phase timed; 1 rank sends nothing
    for key in ("time_forward_backward", "time_kfac", "time_kfac_factors",
                "time_kfac_precondition", "time_optimizer"):
        assert all(r[key] >= 0 for r in steps), key
    assert steps[0]["time_kfac_decompositions"] > 0  # step 1 is an inverse step
    assert all(r["bytes_step"] == 0 and r["bytes_factors"] == 0 for r in steps)
    if importlib.util.find_spec("tensorboard") is not None:
        assert list((tmp_path / "tb").glob("events.out.tfevents.*"))


@pytest.mark.parametrize("phase_times, timed", [("off", False), ("on", True),
                                                ("auto", True)])
def test_phase_times_are_recorded_only_when_asked(tmp_path: Path, phase_times: str,
                                                  timed: bool) -> None:
    """``--phase-times off`` leaves the timer disabled (on a GPU it would synchronise the
    device around every phase); ``auto`` times on a CPU device."""
    from kfac_hpc.train.loop import train

    cfg = TrainConfig(epochs=1, max_steps=3, batch_size=32, progress=False, threads=1,
                      out=str(tmp_path / "run"), device="cpu", phase_times=phase_times)
    train(cfg, verbose=False)
    steps = [r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if r["kind"] == "step"]
    assert len(steps) == 3
    times = [{k for k, v in r.items() if k.startswith("time_") and v is not None}
             for r in steps]
    assert all(bool(t) == timed for t in times), times
    if timed:
        assert all({"time_kfac", "time_kfac_factors"} <= t for t in times)


def test_phase_times_setting_is_checked() -> None:
    with pytest.raises(ConfigError, match="--phase-times: unknown value 'always'"):
        TrainConfig(phase_times="always").validate()


@pytest.mark.mpi(min_size=2)
def test_mpi_bytes_per_step_by_tag(comm: Any, tmp_path: Path) -> None:
    """On P ranks K-FAC's tags carry bytes; the tags and the gradient averaging add up to
    the step's bytes; only rank 0 writes; phase times present."""
    from kfac_hpc.train.loop import train

    out = Path(comm.allgather_object(str(tmp_path))[0]) / "run"
    cfg = TrainConfig(epochs=1, max_steps=12, batch_size=64 // comm.size, progress=False,
                      threads=1, out=str(out), inv_update_steps=5)
    result = train(cfg, comm, verbose=False)
    assert result.ranks_agree
    if comm.rank != 0:
        return
    steps = [r for r in read_jsonl(out / "metrics.jsonl") if r["kind"] == "step"]
    assert len(steps) == 12
    # comm-opt: factors reduced every step, decompositions broadcast at inverse steps
    # (1, 6, 11), nothing else from K-FAC; the rest of bytes_step is gradient averaging
    assert all(r["bytes_factors"] > 0 and r["bytes_agreement"] > 0 for r in steps)
    assert [r["step"] for r in steps if r["bytes_decompositions"] > 0] == [1, 6, 11]
    assert all(r["bytes_step"] > sum(r[f"bytes_{t}"] for t in TRAFFIC_TAGS) for r in steps)
    assert all(r["time_grad_sync"] >= 0 and r["time_kfac"] > 0 for r in steps)
    inverse_steps = [r["step"] for r in steps if r.get("time_kfac_decompositions", 0) > 0]
    assert inverse_steps == [1, 6, 11], inverse_steps
    with pytest.raises(ConfigError):  # the config checks the new options
        TrainConfig(progress_every_steps=0).validate()


def test_shampoo_phases_in_the_step_records(tmp_path: Path) -> None:
    from mpi4py import MPI

    from kfac_hpc.comm import Communicator
    from kfac_hpc.train.loop import train

    cfg = TrainConfig(optimizer="shampoo", preconditioner="none", epochs=1, max_steps=3,
                      batch_size=32, progress=False, threads=1, out=str(tmp_path / "run"))
    train(cfg, Communicator(MPI.COMM_SELF, name="self"), verbose=False)
    steps = [r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if r["kind"] == "step"]
    assert len(steps) == 3
    for r in steps:
        assert r["time_optimizer"] >= r["time_shampoo_blocks"] + r["time_shampoo_apply"] > 0
        assert "time_kfac" not in r
