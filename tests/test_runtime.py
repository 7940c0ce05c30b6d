"""Runtime discovery from launcher variables, and preemption agreement."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from kfac_hpc.runtime.discovery import banner, from_environment, from_mpi, select_device, time_left
from kfac_hpc.runtime.preemption import REQUEUE_EXIT_CODE, PreemptionGuard, parse_signal

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


def test_select_device_cpu_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("CPU-only check")
    assert select_device(3) == torch.device("cpu")


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
