"""``kfac-hpc selfcheck`` at the current world size, and a smoke run of the benchmark.

The self-check must pass on a healthy Communicator and must fail, on every rank and
without hanging, when one rank's results are wrong.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from fresh_env import fresh_env

from kfac_hpc.comm import Communicator, ReduceOp
from kfac_hpc.comm.selfcheck import (
    CHECK_DTYPES,
    check_allreduce,
    check_broadcast,
    check_nonblocking,
    checks,
    run,
    run_checks,
    run_one,
    time_calls,
    uneven_counts,
)
from kfac_hpc.units import parse_bytes

ROOT = Path(__file__).resolve().parents[1]


def world_size() -> int:
    from mpi4py import MPI

    return MPI.COMM_WORLD.Get_size()


@pytest.mark.mpi(min_size=1)
def test_every_check_passes(comm: Communicator) -> None:
    results = run_checks(comm)
    assert [r.line() for r in results if not r.ok] == []
    assert len(results) == len(list(checks(CHECK_DTYPES, comm.size))) + 1
    if comm.size > 1:  # every collective was counted, the same on every rank
        kinds = comm.traffic().snapshot()
        for kind in ("allreduce", "reduce_scatter", "reduce", "broadcast", "allgather",
                     "allgatherv"):
            assert kinds[kind]["calls"] > 0, kind


@pytest.mark.mpi(min_size=1)
def test_wrong_result_on_one_rank_fails_everywhere(comm: Communicator,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A corrupt allreduce on the last rank only: all ranks agree the check failed."""
    bad = comm.size - 1
    original = comm.allreduce

    def corrupt(tensor: torch.Tensor, op: ReduceOp = "sum") -> torch.Tensor:
        out = original(tensor, op)
        if comm.rank == bad and out.numel():
            out[(0,) * out.dim()] += 1
        return out

    monkeypatch.setattr(comm, "allreduce", corrupt)
    result = run_one(comm, "allreduce sum", torch.float32, check_allreduce)
    assert not result.ok and result.failed_ranks == [bad]
    assert "wrong" in result.detail and "FAIL" in result.line()
    # the other collectives are unaffected, and nothing hangs afterwards
    assert run_one(comm, "broadcast", torch.float32, check_broadcast).ok


@pytest.mark.mpi(min_size=1)
def test_exception_is_a_failure(comm: Communicator) -> None:
    def boom(c: Communicator, dtype: torch.dtype) -> str | None:
        raise RuntimeError("no MPI today")

    result = run_one(comm, "boom", torch.float64, boom)
    assert result.failed_ranks == list(range(comm.size))
    assert "RuntimeError: no MPI today" in result.detail


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("dtype", CHECK_DTYPES)
def test_nonblocking_out_of_order(comm: Communicator, dtype: torch.dtype) -> None:
    assert check_nonblocking(comm, dtype) is None


@pytest.mark.mpi(min_size=1)
def test_time_calls_agrees_over_ranks(comm: Communicator) -> None:
    t = torch.zeros(4)
    samples = time_calls({"allreduce": lambda: comm.allreduce(t)}, comm.mpi, repeat=3,
                         max_inner=4)
    s = samples["allreduce"]
    assert s.seconds.shape == (3,) and np.all(s.seconds > 0) and 1 <= s.inner <= 4
    gathered = comm.mpi.allgather(s.seconds.tolist())
    assert all(g == gathered[0] for g in gathered)  # the slowest rank's, everywhere


@pytest.mark.mpi(min_size=1)
def test_cli_run(comm: Communicator, capsys: pytest.CaptureFixture[str]) -> None:
    args = argparse.Namespace(sizes=[8, 1024], repeat=2, no_timing=False)
    assert run(args) == 0
    out = capsys.readouterr().out
    if comm.rank == 0:
        assert "FAIL" not in out and "checks passed" in out and "allgather" in out


def test_parse_size_and_counts() -> None:
    assert [parse_bytes(s) for s in ("8", "8B", "4K", "64KiB", "1M", "2 MiB")] == \
        [8, 8, 4096, 65536, 1 << 20, 2 << 20]
    with pytest.raises(argparse.ArgumentTypeError):
        parse_bytes("lots")
    assert uneven_counts(4, 5) == [5, 0, 7, 8]
    assert uneven_counts(1, 0) == [0]


def _load_benchmark() -> types.ModuleType:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        spec = importlib.util.spec_from_file_location("bench_comm", ROOT / "benchmarks/comm.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


def test_alpha_beta_fit_recovers_a_model() -> None:
    bench = _load_benchmark()
    sizes = bench.block_sizes(64 << 20)
    assert sizes[0] == 8 and sizes[-1] == 64 << 20 and 1 << 20 in sizes
    alpha, beta = bench.fit_alpha_beta(sizes, [3e-6 + 2e-10 * s for s in sizes])
    assert alpha == pytest.approx(3e-6, rel=1e-6) and beta == pytest.approx(2e-10, rel=1e-6)


@pytest.mark.skipif(world_size() > 1, reason="runs the benchmark as a serial subprocess")
def test_benchmark_quick(tmp_path: Path) -> None:
    """The benchmark script end to end, tiny: tables, JSON and PNG (gloo included)."""
    env = fresh_env()
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks/comm.py"), "--quick", "--max-bytes", "1K",
         "--repeat", "2", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=280, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "alpha-beta fits" in proc.stdout and "goals" in proc.stdout
    data = json.loads((tmp_path / "comm_n1.json").read_text())
    assert set(data["impls"]) == {"kfac_hpc", "mpi4py", "mpi4py_tensor", "gloo"}
    assert {r["collective"] for r in data["results"]} == {
        "allreduce", "reduce_scatter", "broadcast", "allgather"}
    assert (tmp_path / "comm_n1.png").stat().st_size > 1000


@pytest.mark.mpi(min_size=1)
def test_cuda_selfcheck_runs_or_skips_clearly(comm: Communicator,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    args = argparse.Namespace(sizes=[8], repeat=0, no_timing=True, device="cuda")
    assert run(args) == 0
    out = capsys.readouterr().out
    if comm.rank == 0:
        if torch.cuda.is_available():
            assert "[staged]" in out and "checks passed" in out and "FAIL" not in out
        else:
            assert "selfcheck --device cuda: SKIPPED: no CUDA device" in out
            assert "PASS" not in out


@pytest.mark.mpi(min_size=2)
def test_cuda_selfcheck_fails_where_some_ranks_see_no_gpu(
        comm: Communicator, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A node whose GPUs are missing (a fault, a wrong GPU request) fails the check,
    naming the ranks; it was reported as SKIPPED with status 0, as if no rank had one."""
    if torch.cuda.is_available():
        pytest.skip("the ranks' view of CUDA is simulated on CPU-only ranks")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: comm.rank == comm.size - 1)
    args = argparse.Namespace(sizes=[8], repeat=0, no_timing=True, device="cuda")
    assert run(args) == 1
    out = capsys.readouterr().out
    if comm.rank == 0:
        assert (f"FAILED: rank(s) {', '.join(map(str, range(min(comm.size - 1, 8))))}"
                in out), out
        assert f"while rank(s) {comm.size - 1} do" in out and "SKIPPED" not in out


@pytest.mark.mpi(min_size=1)
def test_checks_take_a_device(comm: Communicator) -> None:
    """The checks bind the device they run on (CPU here; CUDA under --device cuda)."""
    names = [name for name, _, _ in checks((torch.float32,), comm.size, torch.device("cpu"))]
    assert names == [name for name, _, _ in checks((torch.float32,), comm.size)]
    results = run_checks(comm, (torch.float32,), device=torch.device("cpu"), label=" [x]")
    assert all(r.ok and r.name.endswith(" [x]") for r in results[:-1]), \
        [r.line() for r in results if not r.ok]
