"""Faults a network brings, on 2 nodes x 2 ranks of ``kfac-hpc train``:

1. node2's link is cut mid-run: every rank of node1 stops in a collective; the hang
   watchdog (``--hang-timeout-minutes``) of each rank prints what it was doing and
   aborts with status 4; the job ends within the watchdog's bound (timeout + grace),
   Open MPI naming node2 as the host it lost;
2. the job resumes (``--resume auto``, the link back: a fresh set of nodes) from the
   last complete checkpoint, and node2 is killed (every process on it): the job ends at
   once, Open MPI naming node2;
3. the job resumes again from the last complete checkpoint and finishes.

What ``mpiexec`` returns after a lost node is Open MPI's, not the ranks' (docs/multinode.md),
and it is not checked here: after a cut link 0 or 1, whichever TCP timer fires first (the
watchdog's 4 never survives), after a killed node 0
(:func:`test_mpiexec_status_after_a_node_is_killed`, a known failure). Under ``srun
--kill-on-bad-exit=1`` a rank's 4 is the step's status. The job scripts do not trust
that 0: a job whose node2 is killed is requeued and finishes
(:func:`test_job_script_requeues_after_a_node_is_killed`).
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
from netns_cluster import (
    JOB_SCRIPT,
    run,
    start,
    start_job_script,
    wait_for_lines,
    wait_until,
)

from kfac_hpc.runtime.watchdog import HANG_EXIT_CODE

pytestmark = pytest.mark.timeout(400)
HANG_MINUTES = 0.1  # 6 s without progress ends the job
GRACE = 30.0  # the watchdog's wait for MPI_Abort before os._exit
TRAIN = ["kfac-hpc", "train", "--dataset", "digits", "--data-path", "none", "--model", "mlp",
         "--epochs", "3", "--batch-size", "8", "--device", "cpu", "--threads", "1",
         "--kfac-strategy", "mem-opt", "--inv-update-steps", "2", "--no-progress",
         "--checkpoint-every-steps", "4", "--hang-timeout-minutes", str(HANG_MINUTES),
         "--resume", "auto"]
LOST_NODE2 = re.compile(r"Remote (host|daemon):.*node2")


def latest(ck: Path) -> str:
    return (ck / "latest").read_text().strip()


def resumed_at(out: str) -> int:
    found = re.search(r"resumed from \S+ckpt_(\d+)\.h5 at step (\d+)", out)
    assert found, out[-3000:]
    assert int(found.group(1)) == int(found.group(2))
    return int(found.group(2))


def test_link_cut_then_node_killed_then_resumed(tmp_path: Path) -> None:
    ck = tmp_path / "checkpoints"
    args = [*TRAIN, "--checkpoint-dir", str(ck)]

    # 1. the link of node2 cut mid-run
    job = start(2, 2, [*args, "--out", str(tmp_path / "a")], case="node2's link cut mid-run",
                timeout=150)
    wait_for_lines(tmp_path / "a" / "steps.csv", 10, job)
    cut = time.monotonic()
    job.link(2, "down")
    rc, out, _ = job.finish(timeout=170, fault_at=cut)  # rc: Open MPI's, 0 or 1 (docstring)
    ended = time.monotonic() - cut
    # node1's ranks wait in a collective; the first watchdog to fire aborts the job, which
    # kills the other rank before its own fires when their last beats were more than a poll
    # apart (rank 0 was still writing a checkpoint: CI saw rank 1 alone report)
    assert any(re.search(rf"kfac_hpc: rank {rank}: no progress for \d+ s .*ending the job "
                         rf"with exit status {HANG_EXIT_CODE}", out) for rank in (0, 1)), \
        out[-5000:]
    assert LOST_NODE2.search(out), out[-5000:]
    assert ended < HANG_MINUTES * 60 * 1.2 + GRACE + 10, f"ended {ended:.1f} s after the cut"
    first = latest(ck)
    assert not (tmp_path / "a" / "summary.json").exists()

    # 2. resumed from the last complete checkpoint; then node2 killed
    job = start(2, 2, [*args, "--out", str(tmp_path / "b")], case="resumed, then node2 killed",
                timeout=150)
    wait_for_lines(tmp_path / "b" / "steps.csv", 1, job)
    wait_until(lambda: latest(ck) != first, job)  # a new checkpoint committed
    killed = time.monotonic()
    job.kill(2)
    rc, out, _ = job.finish(timeout=170, fault_at=killed)
    ended = time.monotonic() - killed
    assert resumed_at(out) == int(first.removeprefix("ckpt_").removesuffix(".h5"))
    assert LOST_NODE2.search(out), out[-5000:]
    assert ended < 15, f"ended {ended:.1f} s after node2 was killed"
    assert not (tmp_path / "b" / "summary.json").exists()  # it did not finish
    second = latest(ck)
    assert second > first

    # 3. resumed again, to the end
    stop = int(second.removeprefix("ckpt_").removesuffix(".h5")) + 3
    rc, out, _ = run(2, 2, [*args, "--out", str(tmp_path / "c"), "--max-steps", str(stop)],
                     case="resumed again, finished", timeout=150)
    assert rc == 0, out[-5000:]
    assert resumed_at(out) == stop - 3
    assert "4 rank(s) on 2 node(s)" in out


@pytest.mark.xfail(strict=True, reason="Open MPI 5.0.x (PRRTE) exits 0 when it loses a node's "
                   "daemon; the job scripts check the run's completion marker instead "
                   "(test_job_script_requeues_after_a_node_is_killed, docs/multinode.md)")
def test_mpiexec_status_after_a_node_is_killed() -> None:
    job = start(2, 1, ["python", "tests/multinode/probe.py", "300"], case="probe, node2 killed",
                timeout=120)
    assert job.proc.stdout is not None
    for _ in range(2):
        job.proc.stdout.readline()  # both ranks reported: the job runs
    killed = time.monotonic()
    job.kill(2)
    rc, out, seconds = job.finish(timeout=60, fault_at=killed)
    assert seconds < 30 and LOST_NODE2.search(out), out
    assert rc != 0, f"mpiexec exited {rc} after losing node2"


def test_job_script_requeues_after_a_node_is_killed(tmp_path: Path) -> None:
    """jobs/cifar10_resnet32_shampoo.sbatch under the fake SLURM on 2 nodes x 1 rank;
    node2 killed after a new checkpoint: mpiexec exits 0 (see above), but the run left
    no completion marker, so jobs/lib/requeue.sh requeues the job, which resumes from
    the last complete checkpoint, finishes and leaves the marker."""
    extra = ("--dataset digits --data-path none --model mlp --no-augment --epochs 1 "
             "--max-steps 40 --batch-size 8 --warmup-epochs 1 --device cpu --threads 1 "
             "--checkpoint-every-steps 5 --checkpoint-every-minutes 1000 "
             "--shampoo-options precondition_frequency=2")
    slurm = tmp_path / "slurm"
    job = start_job_script(tmp_path, extra, f"{JOB_SCRIPT}, node2 killed, requeued")
    run_dir = tmp_path / "runs" / "cifar10-resnet32-shampoo"
    ck = run_dir / "checkpoints"
    wait_until(lambda: (ck / "latest").exists(), job)
    wait_for_lines(run_dir / "steps.csv", 12, job)
    killed = time.monotonic()
    job.kill(2)
    rc, out, _ = job.finish(timeout=270, fault_at=killed)
    assert rc == 0, out[-5000:]
    assert LOST_NODE2.search(out), out[-5000:]
    assert ("job step ended with status 0 but the run did not report completion (a lost "
            "node under mpiexec?)") in out, out[-5000:]
    assert "ended incomplete; requeueing job 1001" in out, out[-5000:]
    assert (slurm / "requeues").read_text().split() == ["1001"]
    assert 5 <= resumed_at(out) < 40
    assert "job step finished with status 0 (done)" in out, out[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["world_size"], summary["ranks_agree"], summary["steps"]) == (2, True, 40)
    assert json.loads((ck / "completed").read_text()) == {"step": 40}
