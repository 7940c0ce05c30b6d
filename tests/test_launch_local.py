"""``launch/local`` started from inside an MPI process starts a job of its own.

A process that has called ``MPI_Init`` (without mpiexec, or as a rank of a job) holds
what its MPI runtime set for it in its environment (its rank, its job, its process
manager's address); a program that starts ``launch/local -n 2`` from there passes all of
it on. The new job must still run as a world of its own, and settings the user made
(``OMPI_MCA_*``) must reach its ranks. Open MPI 4's mpiexec died at once on the
inherited variables (and without ssh); launch/local drops the runtime's own.

Serial: a fresh Python initialises MPI, then starts the nested job. MPI
(``launch/local -n 2 python -m mpi4py -m pytest --with-mpi --only-mpi``): rank 0 of the
job starts it while the other ranks wait.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.timeout(180),
              pytest.mark.skipif(shutil.which("mpiexec") is None, reason="needs mpiexec")]

LAUNCH = str(Path(__file__).resolve().parent.parent / "launch" / "local")
USER_SETTING = ("OMPI_MCA_mpi_warn_on_fork", "0")  # an MCA parameter a user sets

# Each rank of the nested job writes FOLDER/rank<R>.json: its place in its world, a sum
# over that world, and the user's setting as it arrived.
INNER = f"""\
import json, os, sys
from mpi4py import MPI
world = MPI.COMM_WORLD
total = world.allreduce(world.Get_rank() + 1)
with open(os.path.join(sys.argv[1], f"rank{{world.Get_rank()}}.json"), "w") as f:
    json.dump({{"rank": world.Get_rank(), "size": world.Get_size(), "total": total,
               "setting": os.environ.get({USER_SETTING[0]!r})}}, f)
"""


def nested_job() -> dict[str, Any]:
    """Start ``launch/local -n 2`` from this process with its environment as the MPI
    library left it (no ``env=``: the C environment, with what ``MPI_Init`` set).

    Returns:
        The job's exit status, output's tail and what its ranks wrote.
    """
    with tempfile.TemporaryDirectory(prefix="kfac_hpc-nested-") as folder:
        p = subprocess.run([LAUNCH, "-n", "2", "--timeout", "60", sys.executable, "-c", INNER,
                            folder], capture_output=True, text=True, timeout=90, check=False)
        ranks = [json.loads(f.read_text()) for f in sorted(Path(folder).glob("rank*.json"))]
    return {"rc": p.returncode, "output": p.stdout[-2000:] + p.stderr[-3000:], "ranks": ranks}


def check(job: dict[str, Any]) -> None:
    """The nested job ran as a world of 2 ranks that saw the user's setting."""
    assert job["rc"] == 0, job["output"]
    ranks = sorted(job["ranks"], key=lambda r: r["rank"])
    assert [r["rank"] for r in ranks] == [0, 1], job
    assert all(r["size"] == 2 and r["total"] == 3 for r in ranks), job
    assert all(r["setting"] == USER_SETTING[1] for r in ranks), job


# A fresh Python (not this test process, which pytest may or may not have started under
# MPI): MPI_Init without mpiexec, then the nested job; prints the job as JSON.
OUTER = f"""\
import json, sys
sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})
from mpi4py import MPI
MPI.COMM_WORLD.Barrier()
from test_launch_local import nested_job
print(json.dumps(nested_job()))
"""


def test_launch_from_a_process_that_initialised_mpi() -> None:
    env = {**os.environ, USER_SETTING[0]: USER_SETTING[1]}
    p = subprocess.run([sys.executable, "-c", OUTER], env=env, capture_output=True, text=True,
                       timeout=150, check=False)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    check(json.loads(p.stdout.strip().splitlines()[-1]))


@pytest.mark.mpi(min_size=2)
def test_launch_from_a_rank() -> None:
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    job: dict[str, Any] | None = None
    if world.Get_rank() == 0:
        os.environ[USER_SETTING[0]] = USER_SETTING[1]
        try:
            job = nested_job()
        finally:
            del os.environ[USER_SETTING[0]]
    done = world.Ibarrier()  # the other ranks wait without spinning on the CPU
    while not done.Test():
        time.sleep(0.05)
    job = world.bcast(job, root=0)
    assert job is not None
    check(job)


# Names the MPI runtimes set (dropped) and settings users make (kept).
RUNTIME_NAMES = ("OMPI_MCA_ess", "OMPI_MCA_orte_hnp_uri", "OMPI_COMM_WORLD_RANK",
                 "OMPI_MCA_num_procs", "PMIX_RANK", "PMIX_SERVER_URI41", "PMI_RANK",
                 "PRTE_LAUNCHED", "MV2_COMM_WORLD_SIZE", "HYDI_CONTROL_FD")
USER_NAMES = ("OMPI_MCA_btl_tcp_if_include", "OMPI_MCA_plm", "OMPI_MCA_mpi_warn_on_fork",
              "PMIX_MCA_gds", "PRTE_MCA_ras", "OMPI_ALLOW_RUN_AS_ROOT", "OPAL_PREFIX",
              "SLURM_PROCID", "MPIR_CVAR_CH4_NETMOD", "PATH")


def test_launch_local_and_the_tests_drop_the_same_variables(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """launch/local (bash globs) and fresh_env (fnmatch) read one list the same way."""
    from fresh_env import fresh_env, mpi_runtime_var

    names = RUNTIME_NAMES + USER_NAMES
    script = ('source "$1"; shift; for n in "$@"; do '
              'if mpi_runtime_var "$n"; then echo drop; else echo keep; fi; done')
    sourced = str(Path(LAUNCH).parent / "mpi-runtime-vars.sh")
    p = subprocess.run(["bash", "-c", script, "bash", sourced, *names], capture_output=True,
                       text=True, timeout=30, check=True)
    in_bash = dict(zip(names, (line == "drop" for line in p.stdout.split())))
    in_python = {n: mpi_runtime_var(n) for n in names}
    assert in_bash == in_python
    assert all(in_python[n] for n in RUNTIME_NAMES), in_python
    assert not any(in_python[n] for n in USER_NAMES), in_python
    for n in names:
        if n != "PATH":
            monkeypatch.setenv(n, "1")
    kept = fresh_env()
    assert set(USER_NAMES) <= set(kept) and not set(RUNTIME_NAMES) & set(kept)
