"""Test harness shared by serial and MPI runs.

Serial: ``pytest``. MPI: ``mpiexec -n N python -m mpi4py -m pytest --with-mpi --only-mpi``;
tests marked ``@pytest.mark.mpi(min_size=N)`` run there. Under MPI, the first failing
test on any rank aborts every rank (no rank can wait forever in a collective that a
failed rank never joins); ``python -m mpi4py`` and ``MPIEXEC_TIMEOUT`` are backstops.

``KFAC_HPC_TEST_RECORD=DIR`` (set by tests/run_gpu.sh) records, per rank, the test in
progress (``DIR/running-rank<R>``, empty between tests) and every failed test
(``DIR/failed-rank<R>``: node id, phase), each written before any abort: a run that dies
(an abort after a failure, a crash, a timeout) still says in which test, and the runner
reruns the module without it to report the others.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

torch.set_num_threads(1)


def _world_size() -> int:
    from mpi4py import MPI

    return MPI.COMM_WORLD.Get_size()


@pytest.hookimpl(trylast=True)
def pytest_configure(config: pytest.Config) -> None:
    # Under MPI only rank 0 prints pytest's report; failures on any rank still print
    # (see pytest_runtest_logreport).
    if config.getoption("--with-mpi", default=False) and _world_size() > 1 and _world_rank() > 0:
        reporter = config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            config.pluginmanager.unregister(reporter)


def _world_rank() -> int:
    from mpi4py import MPI

    return MPI.COMM_WORLD.Get_rank()


def _record(kind: str, text: str, mode: str = "a") -> None:
    """Write ``text`` to ``$KFAC_HPC_TEST_RECORD/<kind>-rank<R>`` (nothing when unset)."""
    folder = os.environ.get("KFAC_HPC_TEST_RECORD")
    if not folder:
        return
    rank = next((os.environ[k] for k in ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK")
                 if os.environ.get(k)), "0")
    with open(os.path.join(folder, f"{kind}-rank{rank}"), mode, encoding="utf-8") as f:
        f.write(text)


def pytest_runtest_logstart(nodeid: str) -> None:
    _record("running", nodeid + "\n", "w")


def pytest_runtest_logfinish(nodeid: str) -> None:
    _record("running", "", "w")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.failed:
        _record("failed", f"{report.nodeid}\t{report.when}\n")
    if report.failed and os.environ.get("KFAC_HPC_TEST_NO_ABORT") != "1":
        from mpi4py import MPI

        if MPI.COMM_WORLD.Get_size() > 1:
            rank = MPI.COMM_WORLD.Get_rank()
            sys.stderr.write(f"\n[rank {rank}] FAILED {report.nodeid} ({report.when}); "
                             f"aborting all ranks\n{report.longreprtext}\n")
            sys.stderr.flush()
            MPI.COMM_WORLD.Abort(1)


@pytest.fixture(autouse=True)
def _no_user_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    """Settings from the user's shell that would change what tests see."""
    for name in ("KFAC_HPC_PLAN_PROFILE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def comm():
    """A fresh Communicator over COMM_WORLD (its own traffic counters)."""
    from kfac_hpc.comm import Communicator

    return Communicator()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--only-mpi", default=False):
        # pytest-mpi 0.6 keeps unmarked tests under --only-mpi: deselect them here, so MPI
        # launches run MPI tests only (the serial stage runs the rest once).
        serial = [item for item in items if item.get_closest_marker("mpi") is None]
        if serial:
            config.hook.pytest_deselected(items=serial)
            items[:] = [item for item in items if item.get_closest_marker("mpi") is not None]
    # KFAC_HPC_TEST_DEVICE=cpu runs the GPU tests' logic on the CPU (a check of the tests
    # themselves on a machine without a GPU; CUDA-only tests still skip)
    has_cuda = torch.cuda.is_available() or os.environ.get("KFAC_HPC_TEST_DEVICE") == "cpu"
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device"))


@pytest.fixture
def meta_default_device():
    """The CPU stand-in for a GPU run: the model and data live on the CPU, but every
    tensor created without ``device=`` lands on ``meta``. Library code that creates a
    tensor without naming the device of the data it belongs to then fails with
    "Tensor on device meta is not on the expected device cpu" (on a GPU it would
    silently run on, or crash on, the wrong device). Create the model and data
    *before* requesting this fixture's effect: call ``meta_default_device()``."""
    def enable() -> None:
        torch.set_default_device("meta")

    yield enable
    torch.set_default_device(None)
