"""Exact resume in a new process group: two separate ``launch/local -n 2`` jobs.

Job 1 trains 3 steps, checkpoints, trains on to step 6 and records the parameters.
Job 2 (new processes, other initial weights, other RNG seeds) loads the checkpoint,
trains steps 3..5 and must reproduce job 1's parameters bitwise on every rank, for
SGD, SGD + K-FAC (comm-opt, dp-kfac) and DistributedShampoo (when built). Dropout and
a random augmentation use each rank's RNG, so the resume needs every rank's RNG
state and the data position (stored in ``extra``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = r'''
import random, sys
from pathlib import Path
import numpy as np
import torch
import kfac_hpc
from kfac_hpc import checkpoint
from kfac_hpc.comm import install_abort_on_error, world
from test_checkpoint_support import Net, make_optimizer, train_steps

install_abort_on_error()
job, d = sys.argv[1], Path(sys.argv[2])
comm = world()
KFAC = getattr(kfac_hpc, "KFACPreconditioner", None)
try:
    from kfac_hpc.shampoo import DistributedShampoo
except ImportError:
    DistributedShampoo = None
CONFIGS = [("sgd", None), ("shampoo", None), ("sgd", "comm-opt"), ("sgd", "dp-kfac")]

def build(kind, strategy, seed):
    torch.manual_seed(seed)  # the same on every rank (replicas)
    model = Net()
    if kind == "shampoo":
        opt = DistributedShampoo(model.named_parameters(), lr=0.01, comm=comm)
    else:
        opt = make_optimizer(kind, model)
    pre = KFAC(model, comm=comm, strategy=strategy, lr=0.05) if strategy else None
    return model, opt, pre

def seed_rank(base):
    torch.manual_seed(base + comm.rank); np.random.seed(base + comm.rank)
    random.seed(base + comm.rank)

def weights(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])

done = []
for kind, strategy in CONFIGS:
    if (kind == "shampoo" and DistributedShampoo is None) or (strategy and KFAC is None):
        continue
    name = f"{kind}-{strategy}"
    if job == "first":
        model, opt, pre = build(kind, strategy, 0)
        seed_rank(100)
        train_steps(model, opt, comm, 0, 3, preconditioner=pre)
        checkpoint.save(d / name, model=model, optimizer=opt, preconditioner=pre, step=3,
                        comm=comm, extra={"next_step": 3})
        train_steps(model, opt, comm, 3, 6, preconditioner=pre)
        torch.save(weights(model), d / f"{name}-rank{comm.rank}.pt")
    else:
        seed_rank(555)
        model, opt, pre = build(kind, strategy, 1)
        info = checkpoint.load(d / name, model=model, optimizer=opt, preconditioner=pre,
                               comm=comm)
        start = info.extra["next_step"]
        train_steps(model, opt, comm, start, 6, preconditioner=pre)
        want = torch.load(d / f"{name}-rank{comm.rank}.pt")
        assert torch.equal(weights(model), want), (name, comm.rank)
    done.append(name)
if comm.rank == 0:
    print(job, "OK", " ".join(done), flush=True)
'''


def _launch(job: str, directory: Path, script: Path) -> str:
    env = {k: v for k, v in os.environ.items()  # a fresh job, even when pytest runs under MPI
           if not k.startswith(("OMPI_", "PMIX_", "PRTE_", "PMI_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "tests"), env.get("PYTHONPATH", "")])
    cmd = [str(ROOT / "launch" / "local"), "-n", "2", "--timeout", "300",
           sys.executable, "-m", "mpi4py", str(script), job, str(directory)]
    done = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=330)
    assert done.returncode == 0, f"job {job} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout


@pytest.mark.timeout(900)
def test_exact_resume_in_new_processes(tmp_path: Path) -> None:
    from mpi4py import MPI

    if MPI.COMM_WORLD.Get_size() > 1:
        pytest.skip("launches its own MPI jobs; runs in the serial stage")
    script = tmp_path / "restart.py"
    script.write_text(SCRIPT)
    first = _launch("first", tmp_path, script)
    second = _launch("second", tmp_path, script)
    assert "first OK sgd-None" in first
    assert "second OK sgd-None" in second
    assert first.split("OK")[1] == second.split("OK")[1]  # every config resumed
    print(first, second)
