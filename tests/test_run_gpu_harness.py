"""``tests/run_gpu.sh``, the harness of ``make gpu-test``, on the CPU.

A copy of the harness (with ``launch/`` and the tests' conftest) runs two small modules
of its own with ``KFAC_HPC_TEST_DEVICE=cpu``, serially and on 2 MPI ranks: tests that
pass, one that fails, one that fails on 2 ranks (which aborts the MPI run, so the harness
runs the module again without it). One module at a time and two at a time (``JOBS``,
``make gpu-test GPU_TEST_JOBS``) must report the same counts and failing tests.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from fresh_env import fresh_env

ROOT = Path(__file__).resolve().parents[1]

MODULES = {
    "test_one_gpu.py": '''
import pytest

pytestmark = pytest.mark.gpu


def test_passes():
    assert True


def test_fails():
    assert 1 == 2


@pytest.mark.mpi(min_size=2)
def test_fails_on_two_ranks(comm):
    assert comm.size == 1
''',
    "test_two_gpu.py": '''
import pytest

pytestmark = pytest.mark.gpu


def test_passes_too():
    assert True


@pytest.mark.mpi(min_size=2)
def test_two_ranks_agree():
    from mpi4py import MPI

    assert MPI.COMM_WORLD.allreduce(1) == MPI.COMM_WORLD.Get_size()
''',
}


def harness(tmp_path: Path, jobs: int) -> tuple[int, list[str]]:
    """Run the copied harness with ``JOBS=jobs``; its exit status and summary lines."""
    work = tmp_path / f"jobs{jobs}"
    shutil.copytree(ROOT / "launch", work / "launch")
    (work / "tests" / "gpu").mkdir(parents=True)
    for name in ("run_gpu.sh", "conftest.py"):
        shutil.copy2(ROOT / "tests" / name, work / "tests" / name)
    shutil.copy2(ROOT / "setup.cfg", work / "setup.cfg")
    for name, text in MODULES.items():
        (work / "tests" / "gpu" / name).write_text(text)
    env = fresh_env(PYTHON=sys.executable, RANKS="2", MPI_TIMEOUT="100", JOBS=str(jobs),
                    KFAC_HPC_TEST_DEVICE="cpu",
                    PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    for name in ("GPU_TEST_MODULES", "MAX_RERUNS", "SERIAL_TIMEOUT", "PYTEST_ADDOPTS",
                 "KFAC_HPC_TEST_NO_ABORT", "KFAC_HPC_TEST_RECORD"):
        env.pop(name, None)
    # a session of its own, so a run that outlasts its time is ended whole
    p = subprocess.Popen([str(work / "tests" / "run_gpu.sh")], cwd=work, env=env, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        stdout, stderr = p.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        stdout, stderr = p.communicate()
        pytest.fail(f"the harness took over 120 s:\n{stdout[-3000:]}\n{stderr[-3000:]}")
    assert "=== gpu-test summary" in stdout, stdout[-3000:] + stderr[-3000:]
    summary = stdout[stdout.index("=== gpu-test summary"):].splitlines()[1:]
    # times vary, and which ranks record a failure before the abort takes them down
    return p.returncode, [re.sub(r"failed on rank [\d,]+", "failed on rank R",
                                 re.sub(r" in \d+ s", "", line)) for line in summary]


MPIEXEC = os.environ.get("MPIEXEC", "mpiexec")


@pytest.mark.skipif(shutil.which(MPIEXEC, path=str(Path(sys.executable).parent))
                    is None and shutil.which(MPIEXEC) is None, reason="needs mpiexec")
@pytest.mark.timeout(280)
def test_one_and_two_modules_at_a_time_report_alike(tmp_path: Path) -> None:
    one = harness(tmp_path, 1)
    two = harness(tmp_path, 2)
    assert one == two
    status, lines = two
    assert status == 1
    assert lines[0] == "=== gpu-serial: 2 passed, 1 failed, 2 skipped (exit 1)"
    assert lines[1] == "=== gpu-mpi-2: 1 passed, 1 failed, 0 skipped (exit 1)"
    assert lines[2] == "FAILED (gpu-serial) tests/gpu/test_one_gpu.py::test_fails (rank 0)"
    assert lines[3] == ("FAILED (gpu-mpi-2) tests/gpu/test_one_gpu.py::test_fails_on_two_ranks:"
                        " failed on rank R (call), which took the run down")
    assert len(lines) == 4
