"""``kfac-hpc train`` and the SLURM job scripts across nodes.

* a run on 2 nodes x 2 ranks over slow links (50 Mbit/s on every node's link) ends
  with the parameters of the same run on one host, bit for bit; its checkpoint (K-FAC
  mem-opt: factors owned by ranks of both nodes, one file in a directory every node
  sees) resumes on 3 nodes x 2 ranks (elastic restart, global batch kept);
* the 2-node job script (jobs/cifar10_resnet32_shampoo.sbatch) under the fake SLURM on
  2 nodes x 1 rank (SLURM_NNODES=2, SLURM_NODELIST=node[1-2]): discovery sees 2 nodes,
  a preemption signal reaches the ranks of both nodes, every rank checkpoints, the job
  requeues and finishes.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from netns_cluster import (
    JOB_SCRIPT,
    ROOT,
    environment,
    run,
    start_job_script,
    wait_for_lines,
)

pytestmark = pytest.mark.timeout(300)
# every node's link at 50 Mbit/s (this kernel has no netem for a delay: docs/multinode.md)
SLOW = "tbf rate 50mbit burst 64kb latency 200ms"
TRAIN = ["kfac-hpc", "train", "--dataset", "digits", "--data-path", "none", "--model", "mlp",
         "--epochs", "1", "--batch-size", "6", "--device", "cpu", "--threads", "1",
         "--kfac-strategy", "mem-opt", "--factor-update-steps", "1", "--inv-update-steps", "2",
         "--no-progress"]


def summary(out: Path) -> dict:
    return json.loads((out / "summary.json").read_text())


def test_slow_link_is_exact_and_restarts_on_more_nodes(tmp_path: Path) -> None:
    ck = tmp_path / "checkpoints"
    first = [*TRAIN, "--max-steps", "6", "--checkpoint-dir", str(ck),
             "--checkpoint-every-steps", "3"]
    script = (f"launch/local -n 4 --timeout 120 {' '.join(first)} --out {tmp_path / 'a'} && "
              f"launch/local -n 6 --timeout 120 {' '.join(TRAIN)} --max-steps 12 "
              f"--checkpoint-dir {ck} --resume auto --out {tmp_path / 'b'}")
    rc, out, _ = run(3, 2, ["bash", "-c", script], shell=True, qdisc=SLOW,
                     case="train 2x2 (links at 50 Mbit/s), then resumed 3x2", timeout=240)
    assert rc == 0, out[-5000:]
    assert "4 rank(s) on 2 node(s)" in out and "6 rank(s) on 3 node(s)" in out, out[-3000:]
    assert f"resumed from {ck / 'ckpt_00000006.h5'} at step 6" in out, out[-3000:]
    a, b = summary(tmp_path / "a"), summary(tmp_path / "b")
    assert (a["world_size"], a["steps"], a["ranks_agree"]) == (4, 6, True)
    assert (b["world_size"], b["steps"], b["ranks_agree"]) == (6, 12, True)
    assert a["global_batch_size"] == b["global_batch_size"] == 24
    # the same run on one host, no namespaces, no delay: the same bits
    here = subprocess.run(["launch/local", "-n", "4", "--timeout", "120", *first,
                           "--checkpoint-dir", str(tmp_path / "ck-local"),
                           "--out", str(tmp_path / "local")],
                          cwd=ROOT, env=environment(), capture_output=True, text=True)
    assert here.returncode == 0, here.stdout[-3000:] + here.stderr[-3000:]
    assert summary(tmp_path / "local")["checksum"] == a["checksum"]


def test_job_script_across_two_nodes_preempted_and_requeued(tmp_path: Path) -> None:
    extra = ("--dataset digits --data-path none --model mlp --no-augment --epochs 1 --max-steps 20 "
             "--batch-size 8 --warmup-epochs 1 --device cpu --checkpoint-every-minutes 1000 "
             "--shampoo-options precondition_frequency=2")
    slurm = tmp_path / "slurm"
    job = start_job_script(tmp_path, extra, f"{JOB_SCRIPT}, USR1, requeued")
    run_dir = tmp_path / "runs" / "cifar10-resnet32-shampoo"
    wait_for_lines(run_dir / "steps.csv", 10, job)
    os.kill(int((slurm / "batch_pid").read_text()), 10)  # SIGUSR1 to the batch shell
    rc, out, _ = job.finish(timeout=270)
    assert rc == 0, out[-5000:]
    assert out.count("2 rank(s) on 2 node(s)") == 2, out[-3000:]  # both runs of the job
    assert "checkpointed on preemption; requeueing job" in out, out[-3000:]
    assert (slurm / "requeues").read_text().split() == ["1001"]
    assert "resumed from" in out
    done = summary(run_dir)
    assert (done["world_size"], done["ranks_agree"], done["steps"]) == (2, True, 20)
