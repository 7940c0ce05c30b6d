"""Faults in the first seconds of ``kfac-hpc train`` and Ctrl-C, at 2 (and 4) ranks.

* A usage error (unknown flag, ``--lr nan``, ``--max-steps abc``, a broken TOML file)
  must reach the user on every launch, even when a rank other than 0 finds it first
  (the launcher kills the other ranks as soon as one exits with an error). The race
  is made deterministic by delaying rank 0 before it starts.
* A preemption signal before the training loop's guard exists (torch and MPI still
  loading) must exit 75 (requeue), not die of the signal (138).
* Ctrl-C (SIGINT to the launcher's process group, as a terminal sends it) must
  checkpoint, say what was written and exit 130.

The drivers run as subprocesses through ``launch/local`` (serial tests only).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fresh_env import fresh_env

from kfac_hpc.train import cli as train_cli

pytestmark = [pytest.mark.timeout(300),
              pytest.mark.skipif(shutil.which("mpiexec") is None, reason="needs mpiexec")]

ROOT = Path(__file__).resolve().parent.parent
LAUNCH = str(ROOT / "launch" / "local")

# Runs `python -m kfac_hpc.train` after delaying rank 0 (the race of a lost message),
# and/or announcing and slowing down the first import of torch (a signal that lands
# while the job is still starting, after the entry point's first line).
WRAPPER = """\
import os, runpy, sys, time

rank = os.environ.get("OMPI_COMM_WORLD_RANK", "0")
if rank == "0":
    time.sleep(float(os.environ.get("TEST_RANK0_DELAY", "0")))
slow = float(os.environ.get("TEST_SLOW_TORCH", "0"))
if slow:
    class SlowTorch:
        def find_spec(self, name, path=None, target=None):
            if name == "torch":
                sys.meta_path.remove(self)
                print(f"STARTING {os.getpid()}", file=sys.stderr, flush=True)
                time.sleep(slow)
            return None
    sys.meta_path.insert(0, SlowTorch())
sys.argv[0] = "python -m kfac_hpc.train"
runpy.run_module("kfac_hpc.train", run_name="__main__", alter_sys=True)
"""


def clean_env(**extra: str) -> dict[str, str]:
    """The environment of a new job (:func:`fresh_env`), TCP on the loopback only."""
    return fresh_env(OMPI_MCA_btl_tcp_if_include="lo", **extra)


def wrapper(tmp_path: Path) -> str:
    path = tmp_path / "wrapper.py"
    path.write_text(WRAPPER)
    return str(path)


# ------------------------------------------------------------- lost usage errors

BROKEN_TOML = "epochs = [1,\nlr = 0.1\n"


@pytest.mark.parametrize(("args", "expected"), [
    (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    (["--lr", "nan"], "--lr: expected a finite number, got 'nan'"),
    (["--max-steps", "abc"], "--max-steps: expected an integer, got 'abc'"),
    (["--config", "broken.toml"], "broken.toml"),
])
def test_usage_error_is_printed_when_another_rank_exits_first(
        tmp_path: Path, args: list[str], expected: str) -> None:
    """Rank 0 starts 1.5 s late: on today's code rank 1 exits 2 first and the launcher
    kills rank 0 before it prints (the message was lost in 14 % of real launches)."""
    (tmp_path / "broken.toml").write_text(BROKEN_TOML)
    p = subprocess.run([LAUNCH, "-n", "2", "--timeout", "120", sys.executable,
                        wrapper(tmp_path), *args], cwd=tmp_path,
                       env=clean_env(TEST_RANK0_DELAY="1.5"), capture_output=True,
                       text=True, timeout=180, check=False)
    assert p.returncode == 2, p.stdout + p.stderr
    assert p.stderr.count(expected) == 1, p.stderr
    assert p.stderr.count("error:") == 1, p.stderr
    assert "Traceback" not in p.stderr


def test_usage_error_at_four_ranks_every_launch(tmp_path: Path) -> None:
    """Several launches at 4 ranks, rank 0 delayed on every other one: always one message."""
    for i in range(4):
        p = subprocess.run([LAUNCH, "-n", "4", "--timeout", "120", sys.executable,
                            wrapper(tmp_path), "--no-such-flag"], cwd=tmp_path,
                           env=clean_env(TEST_RANK0_DELAY="1.0" if i % 2 else "0"),
                           capture_output=True, text=True, timeout=180, check=False)
        assert p.returncode == 2, p.stdout + p.stderr
        assert p.stderr.count("unrecognized arguments: --no-such-flag") == 1, (i, p.stderr)


def test_usage_error_found_by_one_rank_only_is_printed(tmp_path: Path) -> None:
    """A config file that only rank 1 cannot read (a file missing on one node): the job
    still ends with status 2 and the message, naming the rank."""
    script = tmp_path / "one_rank.py"
    script.write_text(
        "import os, runpy, sys\n"
        "if os.environ.get('OMPI_COMM_WORLD_RANK') == '1':\n"
        "    sys.argv += ['--config', 'missing-here.toml']\n"
        "sys.argv[0] = 'python -m kfac_hpc.train'\n"
        "runpy.run_module('kfac_hpc.train', run_name='__main__', alter_sys=True)\n")
    p = subprocess.run([LAUNCH, "-n", "2", "--timeout", "120", sys.executable, str(script),
                        "--epochs", "1"], cwd=tmp_path, env=clean_env(),
                       capture_output=True, text=True, timeout=180, check=False)
    assert p.returncode == 2, p.stdout + p.stderr
    assert "missing-here.toml" in p.stderr and "[on rank(s) 1]" in p.stderr, p.stderr


# ------------------------------------------------- preemption in the first seconds


def _start_slow(tmp_path: Path, ranks: int) -> tuple[subprocess.Popen[str], list[int]]:
    """Start the driver with a slow torch import; return it once every rank is inside."""
    cmd = [sys.executable, wrapper(tmp_path), "--checkpoint-dir", "ck", "--epochs", "1"]
    if ranks > 1:
        cmd = [LAUNCH, "-n", str(ranks), "--timeout", "120", *cmd]
    p = subprocess.Popen(cmd, cwd=tmp_path, env=clean_env(TEST_SLOW_TORCH="20"),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    assert p.stderr is not None
    pids: list[int] = []
    deadline = time.monotonic() + 60
    while len(pids) < ranks and time.monotonic() < deadline:
        line = p.stderr.readline()
        if line.startswith("STARTING "):
            pids.append(int(line.split()[1]))
        elif not line and p.poll() is not None:
            break
    assert len(pids) == ranks, "the ranks did not start"
    return p, pids


@pytest.mark.parametrize(("ranks", "sig", "to_launcher"), [
    (1, signal.SIGUSR1, False),
    (2, signal.SIGUSR1, True),   # as the batch script forwards it: mpiexec passes it on
    (2, signal.SIGTERM, False),  # as SLURM sends it to every task
])
def test_preemption_signal_while_starting_asks_for_a_requeue(
        tmp_path: Path, ranks: int, sig: signal.Signals, to_launcher: bool) -> None:
    """Today the signal's default action kills the job (status 138/143, no checkpoint),
    which the batch script counts as a crash without progress."""
    p, pids = _start_slow(tmp_path, ranks)
    for pid in [p.pid] if to_launcher else pids:
        os.kill(pid, sig)
    out, err = p.communicate(timeout=60)
    assert p.returncode == train_cli.REQUEUE_EXIT_CODE, out + err
    assert f"preempted ({sig.name}) while starting" in err, err
    assert err.count("preempted") == 1, err
    assert not list((tmp_path / "ck").glob("ckpt_*"))


def test_requeue_status_is_the_preemption_modules() -> None:
    from kfac_hpc.runtime.preemption import REQUEUE_EXIT_CODE

    assert train_cli.REQUEUE_EXIT_CODE == REQUEUE_EXIT_CODE


def test_startup_signals_hand_over_and_restore() -> None:
    before = signal.getsignal(signal.SIGUSR2)
    before_int = signal.getsignal(signal.SIGINT)  # SIG_IGN where the suite runs in the background
    startup = train_cli.StartupSignals(["USR1", "USR2", "nonsense"]).install()
    assert signal.getsignal(signal.SIGUSR2) == startup._handle
    assert signal.getsignal(signal.SIGINT) == startup._handle
    try:
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # "the guard" takes USR1
        startup.hand_over([signal.SIGUSR1])
        assert signal.getsignal(signal.SIGUSR1) == signal.SIG_IGN
        assert signal.getsignal(signal.SIGUSR2) == before
        assert signal.getsignal(signal.SIGINT) == before_int
    finally:
        signal.signal(signal.SIGUSR1, signal.SIG_DFL)


def test_startup_handles_the_signals_the_run_will(tmp_path: Path) -> None:
    """The run's own signals from the first second: the flag's, else the config file's
    (read without the config machinery), else USR1 and TERM; ``none`` or nothing: none
    but Ctrl-C. (The defaults were always added, and a config file was never read: a
    USR2 named there killed the starting job, exit 140, which a requeue counts as a
    crash.)"""
    def names(argv: list[str]) -> set[str]:
        return {s.name for s in train_cli.StartupSignals.from_argv(argv).signals}

    assert names([]) == {"SIGINT", "SIGUSR1", "SIGTERM"}
    assert names(["--preempt-signals", "USR2,HUP"]) == {"SIGINT", "SIGUSR2", "SIGHUP"}
    assert names(["--preempt-signals=none"]) == {"SIGINT"}
    assert names(["--preempt-signals="]) == {"SIGINT"}
    config = tmp_path / "run.toml"
    config.write_text('[checkpoint]\npreempt-signals = ["USR2"]\n')
    assert names(["--config", str(config)]) == {"SIGINT", "SIGUSR2"}
    assert names([f"--config={config}", "--preempt-signals", "TERM"]) == {"SIGINT", "SIGTERM"}
    config.write_text("preempt_signals = this is not toml\n")
    assert names(["--config", str(config)]) == {"SIGINT", "SIGUSR1", "SIGTERM"}
    from kfac_hpc.train.config import TrainConfig

    assert TrainConfig.from_dict({"preempt_signals": "none"}).preempt_signals == ()


# ------------------------------------------------------------------------ Ctrl-C


def _as_in_a_terminal() -> None:
    """SIGINT handled by default, as in a terminal's foreground job.

    A suite started in the background (``cmd &`` without job control, ``nohup``) passes
    SIGINT on ignored, and a shell cannot trap a signal ignored when it started.
    """
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_checkpoints_says_what_was_written_and_exits_130(tmp_path: Path) -> None:
    """Today: exit 1 half a second later with no message (Open MPI's mpiexec SIGTERMs and
    then SIGKILLs the ranks), although a stop checkpoint was written."""
    p = subprocess.Popen([LAUNCH, "-n", "2", "--timeout", "240", sys.executable, "-m",
                          "kfac_hpc", "train", "--checkpoint-dir", "ck", "--epochs", "100"],
                         cwd=tmp_path, env=clean_env(), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True,
                         preexec_fn=_as_in_a_terminal)
    assert p.stdout is not None
    for line in p.stdout:
        if line.startswith("epoch 1/"):
            break
    os.killpg(p.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
    out, err = p.communicate(timeout=120)
    assert p.returncode == train_cli.INTERRUPT_EXIT_CODE, out + err
    assert "interrupted (signal SIGINT) at step" in err, err
    name = (tmp_path / "ck" / "latest").read_text().strip()
    assert f"checkpoint saved: ck/{name};" in err, err
    assert "Traceback" not in err
    verify = subprocess.run([sys.executable, "-m", "kfac_hpc", "ckpt", "verify",
                             str(tmp_path / "ck" / name)], env=clean_env(),
                            capture_output=True, text=True, timeout=120, check=False)
    assert verify.returncode == 0, verify.stdout + verify.stderr
