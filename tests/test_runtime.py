"""Runtime discovery from launcher variables, device selection before MPI starts, and
preemption agreement.

Device selection runs here without a GPU: ``torch.cuda`` is faked (availability,
device count, ``set_device``); tests/gpu/test_train_gpu.py checks the real thing.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from kfac_hpc.runtime import (
    LOCAL_RANK_VARIABLES,
    LocalRank,
    NoCudaDeviceError,
    local_rank_from_environment,
    select_device,
    selected_device,
)
from kfac_hpc.runtime import device as device_module
from kfac_hpc.runtime.discovery import (
    banner,
    from_environment,
    from_mpi,
    singleton_under_srun,
    time_left,
)
from kfac_hpc.runtime.discovery import select_device as select_device_by_local_rank
from kfac_hpc.runtime.preemption import REQUEUE_EXIT_CODE, PreemptionGuard, parse_signal

ROOT = Path(__file__).resolve().parent.parent

SLURM = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1",
         "SLURM_NTASKS_PER_NODE": "4(x2)", "SLURM_NNODES": "2", "SLURM_JOB_ID": "4242",
         "SLURMD_NODENAME": "node07", "SLURM_RESTART_COUNT": "2"}


def test_slurm_variables():
    job = from_environment(SLURM)
    assert (job.rank, job.size, job.local_rank, job.local_size, job.nodes) == (5, 8, 1, 4, 2)
    assert (job.source, job.job_id, job.host, job.restart_count) == ("slurm", "4242", "node07", 2)


def test_openmpi_and_pmi_variables():
    job = from_environment({"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4",
                            "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"})
    assert (job.rank, job.size, job.local_rank, job.nodes, job.source) == (3, 4, 1, 2, "openmpi")
    job = from_environment({"PMI_RANK": "0", "PMI_SIZE": "2", "MPI_LOCALRANKID": "0"})
    assert (job.rank, job.size, job.source) == (0, 2, "pmi")


def test_no_launcher_is_a_single_process():
    job = from_environment({})
    assert (job.rank, job.size, job.local_rank, job.source, job.restart_count) == (
        0, 1, 0, "single", 0)


def test_bad_variables_are_reported():
    with pytest.raises(ValueError, match="SLURM_PROCID='x' is not an integer"):
        from_environment({**SLURM, "SLURM_PROCID": "x"})
    with pytest.raises(ValueError, match="inconsistent launcher variables"):
        from_environment({**SLURM, "SLURM_PROCID": "9"})


def test_time_left_and_banner():
    assert time_left({"SLURM_JOB_END_TIME": "1000"}, now=400.0) == 600.0
    assert time_left({}) is None
    text = banner(from_environment(SLURM), device=torch.device("cpu"), mpi_library="Open MPI",
                  cuda_aware=False)
    assert "job 4242" in text and "8 rank(s) on 2 node(s)" in text and "restart 2" in text


def test_a_task_alone_in_its_world_under_srun_is_named():
    """srun started 4 tasks, MPI sees one rank (no PMIx plugin): said, with the fix;
    not when MPI sees them all, when srun started one task, when mpirun started the
    ranks inside the job (its variables), or outside srun."""
    srun = {"SLURM_STEP_NUM_TASKS": "4", "SLURM_PROCID": "2", "SLURM_NTASKS": "4"}
    message = singleton_under_srun(1, srun)
    assert message is not None and "--mpi=pmix" in message and "4 tasks" in message
    assert singleton_under_srun(4, srun) is None
    assert singleton_under_srun(1, {**srun, "SLURM_STEP_NUM_TASKS": "1"}) is None
    assert singleton_under_srun(1, {**srun, "OMPI_COMM_WORLD_SIZE": "1"}) is None
    assert singleton_under_srun(1, {"SLURM_NTASKS": "4"}) is None


def test_train_refuses_tasks_that_srun_started_alone(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch):
    """``kfac-hpc train`` on the world of a task srun started without the MPI plugin:
    a ConfigError (exit 2), before anything is built or written."""
    from kfac_hpc.train.config import ConfigError, TrainConfig
    from kfac_hpc.train.loop import Trainer

    for name in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE", "FLUX_JOB_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "8")
    monkeypatch.setenv("SLURM_PROCID", "0")
    from mpi4py import MPI

    if MPI.COMM_WORLD.Get_size() != 1:
        pytest.skip("a world of one rank")
    with pytest.raises(ConfigError, match="srun started 8 tasks"):
        Trainer(TrainConfig(out=str(tmp_path / "run"), progress=False, epochs=1))
    assert not (tmp_path / "run").exists()
    # the command line passes the world communicator: refused there too (it was not)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_", "PMIX_", "PRTE_", "PMI_", "MV2_", "FLUX_"))}
    env.update(SLURM_STEP_NUM_TASKS="8", SLURM_NTASKS="8", SLURM_PROCID="3")
    done = subprocess.run([sys.executable, "-m", "kfac_hpc", "train", "--max-steps", "2",
                           "--no-progress", "--checkpoint-dir", str(tmp_path / "ck")],
                          env=env, cwd=tmp_path, capture_output=True, text=True, timeout=240,
                          check=False)
    assert done.returncode == 2 and "srun started 8 tasks" in done.stderr, done.stderr
    assert not (tmp_path / "ck").exists()


def test_mpi_launcher_variables_win_over_inherited_slurm_ones():
    """mpirun inside a batch job: the ranks inherit the batch shell's SLURM_PROCID=0."""
    stale = {**SLURM, "SLURM_PROCID": "0", "SLURM_LOCALID": "0"}
    job = from_environment({**stale, "OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "8",
                            "OMPI_COMM_WORLD_LOCAL_RANK": "3",
                            "OMPI_COMM_WORLD_LOCAL_SIZE": "4"})
    assert (job.rank, job.local_rank, job.source, job.job_id) == (3, 3, "openmpi", "4242")
    job = from_environment({**stale, "MV2_COMM_WORLD_RANK": "6", "MV2_COMM_WORLD_SIZE": "8",
                            "MV2_COMM_WORLD_LOCAL_RANK": "2"})
    assert (job.rank, job.local_rank, job.source) == (6, 2, "mvapich")
    job = from_environment({**stale, "PMI_RANK": "5", "PMI_SIZE": "8", "PMI_LOCAL_RANK": "1",
                            "PMI_LOCAL_SIZE": "4"})
    assert (job.rank, job.local_rank, job.local_size, job.source) == (5, 1, 4, "pmi")
    job = from_environment({**stale, "FLUX_TASK_RANK": "7", "FLUX_JOB_SIZE": "8",
                            "FLUX_TASK_LOCAL_ID": "3"})
    assert (job.rank, job.local_rank, job.source) == (7, 3, "flux")


# ------------------------------------------------------- device before MPI starts
@pytest.mark.parametrize("variable", [name for name, _ in LOCAL_RANK_VARIABLES])
def test_local_rank_from_each_launcher(variable: str):
    assert local_rank_from_environment({variable: "3"}) == LocalRank(3, variable)
    if variable != "SLURM_LOCALID":  # the launcher that started us beats inherited SLURM
        env = {"SLURM_LOCALID": "0", variable: "2"}
        assert local_rank_from_environment(env) == LocalRank(2, variable)


def test_local_rank_without_launcher_and_bad_values():
    assert local_rank_from_environment({}) == LocalRank(0, None)
    assert local_rank_from_environment({"MPI_LOCALRANKID": "", "SLURM_LOCALID": "1"}).rank == 1
    with pytest.raises(ValueError, match="SLURM_LOCALID='x' is not an integer"):
        local_rank_from_environment({"SLURM_LOCALID": "x"})
    with pytest.raises(ValueError, match="PALS_LOCAL_RANKID=-1 is negative"):
        local_rank_from_environment({"PALS_LOCAL_RANKID": "-1"})


@dataclass
class FakeCuda:
    count: int = 4  # visible GPUs
    current: list[torch.device] = field(default_factory=list)  # set_device calls


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
    fake = FakeCuda()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: fake.count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: fake.count)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: fake.current.append(torch.device(d)))
    monkeypatch.setattr(device_module, "_selected", None)
    return fake


@pytest.mark.parametrize("variable", [name for name, _ in LOCAL_RANK_VARIABLES])
def test_select_device_from_each_launcher(variable: str, fake_cuda: FakeCuda):
    """4 GPUs per node shared by the node's ranks: cuda:<local rank mod 4>."""
    assert selected_device() is None
    env = {variable: "5"} if variable == "SLURM_LOCALID" else {variable: "5", "SLURM_LOCALID": "0"}
    device = select_device(env=env)
    assert device == torch.device("cuda", 1)
    assert fake_cuda.current == [device] and selected_device() == device


def test_select_device_respects_per_task_visible_devices(fake_cuda: FakeCuda):
    """srun --gpus-per-task=1: every rank sees one GPU (its own) as cuda:0."""
    fake_cuda.count = 1
    env = {"SLURM_LOCALID": "3", "CUDA_VISIBLE_DEVICES": "3"}
    assert select_device("cuda", env=env) == torch.device("cuda", 0)
    assert fake_cuda.current == [torch.device("cuda", 0)]


def test_select_device_explicit_local_rank_and_cpu(fake_cuda: FakeCuda):
    assert select_device(local_rank=6, env={"SLURM_LOCALID": "1"}) == torch.device("cuda", 2)
    assert select_device_by_local_rank(3) == torch.device("cuda", 3)  # the older form
    assert select_device_by_local_rank(3, prefer_cuda=False) == torch.device("cpu")
    assert select_device("cpu", env={"SLURM_LOCALID": "1"}) == torch.device("cpu")
    assert fake_cuda.current == [torch.device("cuda", 2), torch.device("cuda", 3)]
    assert selected_device() == torch.device("cpu")


def test_select_device_without_cuda(fake_cuda: FakeCuda, monkeypatch: pytest.MonkeyPatch):
    fake_cuda.count = 0
    assert select_device() == torch.device("cpu")  # auto
    monkeypatch.setattr(torch.version, "cuda", "12.4")
    with pytest.raises(NoCudaDeviceError, match=r"no GPU is visible to this process "
                       r"\(CUDA_VISIBLE_DEVICES=''\).*or select 'auto' or 'cpu'"):
        select_device("cuda", env={"CUDA_VISIBLE_DEVICES": ""})
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    with pytest.raises(NoCudaDeviceError, match="CPU-only build: install a CUDA build"):
        select_device("cuda")
    assert fake_cuda.current == []


def test_select_device_rejects_bad_arguments():
    with pytest.raises(ValueError, match=r"invalid device='gpu'; allowed: 'auto', 'cuda', 'cpu'"):
        select_device("gpu")
    with pytest.raises(ValueError, match="invalid local_rank=-1"):
        select_device(local_rank=-1)


def _python(code: str, env: dict[str, str] | None = None,
            timeout: float = 120) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith(("OMPI_", "PMIX_", "PRTE_", "PMI_", "SLURM_", "MV2_",
                                  "MPI_LOCAL", "PALS_", "FLUX_"))}
    clean["OMPI_MCA_btl_tcp_if_include"] = "lo"
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT,
                          env={**clean, **(env or {})}, capture_output=True, text=True,
                          timeout=timeout, check=False)


def test_select_device_does_not_import_mpi4py():
    p = _python("""
        import sys
        import kfac_hpc
        device = kfac_hpc.runtime.select_device()
        print(device, kfac_hpc.runtime.local_rank_from_environment().rank,
              sorted(m for m in sys.modules if m.startswith(("mpi4py", "kfac_hpc.comm"))))
        """, env={"OMPI_COMM_WORLD_LOCAL_RANK": "1"})
    assert p.returncode == 0, p.stderr
    expected = "cuda:" if torch.cuda.is_available() else "cpu"
    assert p.stdout.startswith(expected) and p.stdout.rstrip().endswith(" 1 []"), p.stdout


def test_train_selects_the_device_before_mpi_starts(tmp_path: Path):
    """``kfac-hpc train``: select_device runs before anything imports mpi4py, which
    then does get imported (the run uses MPI); the run itself succeeds."""
    p = _python(f"""
        import sys
        import kfac_hpc.runtime.device as device

        events = []

        class WatchMpi4py:
            def find_spec(self, name, path=None, target=None):
                if name == "mpi4py" and "mpi4py" not in events:
                    events.append("mpi4py")
                return None

        sys.meta_path.insert(0, WatchMpi4py())
        real = device.select_device

        def spy(*args, **kwargs):
            events.append("select_device" + repr(args))
            return real(*args, **kwargs)

        device.select_device = spy
        from kfac_hpc.cli import main

        rc = main(["train", "--device", "cpu", "--epochs", "1", "--max-steps", "2",
                   "--no-progress", "--out", {str(tmp_path / "run")!r}])
        print("EVENTS", events, rc)
        """, timeout=240)
    assert p.returncode == 0, p.stdout + p.stderr
    events = p.stdout.split("EVENTS ")[-1].strip()
    # (the training loop may select again later, from MPI's view of the node)
    assert events.startswith("[\"select_device('cpu',)\", 'mpi4py'"), p.stdout
    assert events.endswith(" 0"), p.stdout


@pytest.mark.mpi(min_size=1)
def test_from_mpi_matches_world(comm):
    job = from_mpi()
    assert (job.rank, job.size) == (comm.rank, comm.size)
    assert 0 <= job.local_rank < job.local_size and job.nodes >= 1


def test_parse_signal():
    assert parse_signal("usr1") is signal.SIGUSR1
    assert parse_signal("SIGTERM") is signal.SIGTERM
    with pytest.raises(ValueError, match="unknown signal 'USR9'"):
        parse_signal("USR9")


@pytest.mark.mpi(min_size=1)
def test_signal_sets_flag_and_all_ranks_agree(comm):
    with PreemptionGuard(comm, signals=["USR2"]) as guard:
        assert guard.should_stop() is False
        if comm.rank == comm.size - 1:
            os.kill(os.getpid(), signal.SIGUSR2)  # only the last rank is signalled
        assert guard.should_stop() is True  # every rank stops at the same step
        assert guard.reason == ("signal SIGUSR2" if comm.rank == comm.size - 1
                                else "another rank was signalled")
        # a second signal (e.g. during the checkpoint) only records itself
        if comm.rank == comm.size - 1:
            os.kill(os.getpid(), signal.SIGUSR2)
            assert guard.received == ["SIGUSR2", "SIGUSR2"]
    assert signal.getsignal(signal.SIGUSR2) is signal.SIG_DFL
    assert REQUEUE_EXIT_CODE == 75


@pytest.mark.mpi(min_size=1)
def test_time_limit_guard(comm):
    now = [1000.0]
    guard = PreemptionGuard(comm, signals=[], time_margin_s=120, deadline=1300.0,
                            clock=lambda: now[0], check_every=2)
    assert guard.should_stop() is False  # not checked (every 2nd call)
    assert guard.should_stop() is False  # 300 s left
    now[0] = 1200.0
    guard.should_stop()
    assert guard.should_stop() is True and "100 s of wall time left" in guard.reason
