"""The hang watchdog: no progress for ``--hang-timeout-minutes`` ends the job with exit
status 4 on every rank, with one message naming the rank and what it was doing."""

from __future__ import annotations

import io
import shutil
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from kfac_hpc.runtime.watchdog import HANG_EXIT_CODE, Watchdog

ROOT = Path(__file__).resolve().parent.parent


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _wait_until(predicate: object, seconds: float = 5.0) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if predicate():  # type: ignore[operator]
            return True
        time.sleep(0.005)
    return False


def test_beats_keep_it_quiet_and_silence_ends_the_job_once() -> None:
    clock, aborted, exited = FakeClock(), [], []
    out = io.StringIO()
    dog = Watchdog(60, rank=3, abort=aborted.append, exit=exited.append, stream=out,
                   poll=0.01, grace=0.05, clock=clock)
    with dog:
        for step in range(1, 8):  # 7 steps of 50 s: never 60 s without a beat
            clock.now += 50
            dog.beat(f"step {step}")
            time.sleep(0.03)
        assert aborted == [] and not dog.fired
        clock.now += 61
        assert _wait_until(lambda: aborted == [HANG_EXIT_CODE])
        # the abort returned (a stand-in): after the grace period the process exits
        assert _wait_until(lambda: exited == [HANG_EXIT_CODE])
    time.sleep(0.05)
    assert aborted == [HANG_EXIT_CODE]  # once
    text = out.getvalue()
    assert "rank 3: no progress for 61 s" in text and "last: step 7" in text
    assert f"exit status {HANG_EXIT_CODE}" in text


def test_a_beat_with_patience_allows_longer_until_the_next() -> None:
    """A setup stage may take longer than a step (ten times the timeout, at most ten
    minutes: ``setup_patience``); the next plain beat is held to the timeout again."""
    from kfac_hpc.train.loop import setup_patience

    clock, fired, out = FakeClock(), [], io.StringIO()
    dog = Watchdog(5.0, rank=0, abort=fired.append, exit=fired.append, poll=0.01,
                   grace=0.05, stream=out, clock=clock)
    with dog:
        dog.beat("loading", patience=setup_patience(5.0))
        clock.now += 40  # 40 s into a 50 s allowance
        time.sleep(0.1)
        assert not fired
        dog.beat("step 1")
        clock.now += 6  # 6 s after the step's beat: over the timeout
        assert _wait_until(lambda: bool(fired))
    assert "no progress for 6 s (limit 5 s" in out.getvalue()
    assert setup_patience(6.0) == 60.0 and setup_patience(1800.0) == 1800.0
    assert setup_patience(120.0) == 600.0


def test_stop_ends_the_thread_without_firing() -> None:
    clock, aborted = FakeClock(), []
    dog = Watchdog(1, rank=0, abort=aborted.append, exit=aborted.append, poll=0.01,
                   clock=clock).start()
    dog.stop()
    clock.now += 100
    time.sleep(0.05)
    assert aborted == [] and not any(t.name == "kfac-hpc-watchdog"
                                     for t in threading.enumerate())


@pytest.mark.parametrize("timeout", [0, -1.0, float("nan")])
def test_a_timeout_that_is_not_positive_is_refused(timeout: float) -> None:
    with pytest.raises(ValueError, match="timeout must be > 0"):
        Watchdog(timeout, rank=0)


def test_the_driver_option_is_validated() -> None:
    from kfac_hpc.train.config import TrainConfig

    assert TrainConfig().hang_timeout_minutes == 30.0
    text = "\n".join(TrainConfig(hang_timeout_minutes=0).problems())
    assert "hang_timeout_minutes" in text.replace("-", "_") and "must be > 0" in text
    assert not TrainConfig(hang_timeout_minutes=None).problems()


STALLING_MODEL = """
    import os
    import time

    from torch import nn


    class Stalls(nn.Module):
        '''A linear model whose third training forward pass never ends on rank 1.'''

        def __init__(self, input_dim: int, num_classes: int) -> None:
            super().__init__()
            self.fc = nn.Linear(input_dim, num_classes)
            self.calls = 0

        def forward(self, x):
            if self.training:
                self.calls += 1
                rank = os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("PMI_RANK"))
                if rank == "1" and self.calls == 3:
                    time.sleep(600)
            return self.fc(x.flatten(1))


    def build_model(*, num_classes: int, input_dim: int) -> nn.Module:
        return Stalls(input_dim, num_classes)


    def build_model_slowly(*, num_classes: int, input_dim: int) -> nn.Module:
        '''Never returns on rank 1: a hang during the setup.'''
        rank = os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("PMI_RANK"))
        if rank == "1":
            time.sleep(600)
        return Stalls(input_dim, num_classes)
"""


@pytest.mark.skipif(shutil.which("mpiexec") is None, reason="needs mpiexec")
@pytest.mark.parametrize("factory, minutes, last", [
    ("build_model", "0.25", "last: step 3 (epoch 1)"),
    # the setup is watched too (it was not: the job waited for the launcher's limit), with
    # ten times the timeout's patience (3 s: 30 s)
    ("build_model_slowly", "0.05", "last: building the data, the model and the optimizer")])
def test_a_rank_that_hangs_ends_the_job_with_exit_4(tmp_path: Path, factory: str,
                                                    minutes: str, last: str) -> None:
    import os

    (tmp_path / "stalling_model.py").write_text(textwrap.dedent(STALLING_MODEL))
    prefixes = ("OMPI_", "PMIX_", "PRTE_", "PMI_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(prefixes)}
    env["OMPI_MCA_btl_tcp_if_include"] = "lo"
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), str(ROOT), env.get("PYTHONPATH", "")])
    t0 = time.monotonic()
    p = subprocess.run([str(ROOT / "launch" / "local"), "-n", "2", "--timeout", "200",
                        sys.executable, "-m", "kfac_hpc", "train", "--model",
                        f"stalling_model:{factory}", "--optimizer", "sgd", "--epochs", "1",
                        "--hang-timeout-minutes", minutes, "--out", str(tmp_path / "run")],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
                       check=False)
    took = time.monotonic() - t0
    assert p.returncode == HANG_EXIT_CODE, p.stdout + p.stderr
    assert "no progress for" in p.stderr and last in p.stderr, p.stderr
    assert "Thread" in p.stderr or "File" in p.stderr  # the stacks of the rank
    assert took < 150  # ended by the watchdog, not by the launcher's timeout
