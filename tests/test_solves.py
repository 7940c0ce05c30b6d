"""Small eigendecompositions on the host beside the device's (``kfac_hpc.solves``).

On CUDA, batches of matrices up to ``host_max_dim`` rows are decomposed by a host
worker thread while the device decomposes the larger ones. Here that choice is forced on
CPU tensors (fixture ``host_solves``), so the plumbing is checked without a GPU: which
batches go to the worker, that each result lands in its batch's place (K-FAC's factors,
Shampoo's roots, with and without the background decomposition lag), and that a
failure there stays in its place.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import torch
from mpi4py import MPI
from shared_cases import small_cnn, small_cnn_batches, train_kfac
from torch import Tensor

from kfac_hpc import KFACPreconditioner, solves
from kfac_hpc.comm import Communicator
from kfac_hpc.kfac import layers, linalg
from kfac_hpc.shampoo import DistributedShampoo
from kfac_hpc.solves import SolvePlacement
from kfac_hpc.train.config import TrainConfig


@pytest.fixture
def solved_on(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[int, str]]]:
    """Record ``(n, thread name)`` for every batch decomposed on the host."""
    seen: list[tuple[int, str]] = []
    solve = solves._solve_on_host

    def recording(host: Tensor, ready: torch.cuda.Event | None,
                  solver: solves.Solver, device: torch.device) -> tuple[Tensor, ...]:
        seen.append((host.shape[-1], threading.current_thread().name))
        return solve(host, ready, solver, device)

    monkeypatch.setattr(solves, "_solve_on_host", recording)
    yield seen


@pytest.fixture
def host_solves(monkeypatch: pytest.MonkeyPatch, solved_on: list[tuple[int, str]]
                ) -> Iterator[list[tuple[int, str]]]:
    """CPU batches up to ``host_max_dim`` rows go to the host worker, as CUDA ones do."""
    monkeypatch.setattr(solves, "solves_on_host",
                        lambda batch, host_max_dim: 0 < batch.shape[-1] <= host_max_dim)
    yield solved_on


def _spd(n: int, batch: int = 2, seed: int = 0) -> Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, 3 * n, n, generator=g, dtype=torch.float64)
    return x.mT @ x / (3 * n)


def batch(device: str, n: int, dtype: torch.dtype = torch.float32) -> Tensor:
    """A stand-in of a stack of 3 ``n x n`` matrices: its device, dtype and shape."""
    return SimpleNamespace(device=torch.device(device), dtype=dtype,  # type: ignore[return-value]
                           shape=(3, n, n))


def test_only_cuda_batches_up_to_the_size_go_to_the_host() -> None:
    assert solves.solves_on_host(batch("cuda", 512), 512)
    assert not solves.solves_on_host(batch("cuda", 513), 512)
    assert not solves.solves_on_host(batch("cuda", 8), 0)
    assert not solves.solves_on_host(batch("cpu", 8), 512)
    assert not solves.solves_on_host(batch("meta", 8), 512)


@pytest.mark.parametrize("device, dtype, n, want", [
    ("cuda", torch.float32, 31, torch.float32),
    ("cuda", torch.float32, 32, torch.float64),
    ("cuda", torch.float32, 512, torch.float64),
    ("cuda", torch.float32, 513, torch.float32),
    ("cuda", torch.float64, 256, torch.float64),
    ("cpu", torch.float32, 256, torch.float32),
    ("meta", torch.float32, 256, torch.float32),
])
def test_float32_cuda_batches_of_jacobis_range_are_decomposed_in_float64(
        device: str, dtype: torch.dtype, n: int, want: torch.dtype) -> None:
    assert solves.eigh_dtype(batch(device, n, dtype)) == want


def test_a_widened_eigh_returns_the_float64_results_in_the_batch_dtype(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """CPU batches forced through the widening: float64 ``eigh``, cast back."""
    monkeypatch.setattr(solves, "eigh_dtype", lambda batch: torch.float64)
    batch = _spd(40).float()
    values, vectors = solves.symmetric_eigh(batch)
    want_values, want_vectors = torch.linalg.eigh(batch.double())
    assert values.dtype == vectors.dtype == torch.float32
    assert torch.equal(values, want_values.float())
    assert torch.equal(vectors, want_vectors.float())


def test_on_the_cpu_nothing_goes_to_the_worker(solved_on: list[tuple[int, str]]) -> None:
    solves.eigh_batches([_spd(4), _spd(9)], SolvePlacement(512))
    assert solved_on == []


def test_host_batches_run_on_the_worker_and_equal_eigh(host_solves: list[tuple[int, str]]
                                                       ) -> None:
    batches = [_spd(6, seed=1), _spd(20, seed=2), _spd(3, batch=1, seed=3)]
    results = solves.eigh_batches(batches, SolvePlacement(8))
    assert sorted(n for n, _ in host_solves) == [3, 6]
    assert all(name.startswith("kfac-hpc-host-solves") for _, name in host_solves)
    for batch, result in zip(batches, results):
        assert not isinstance(result, Exception)
        evals, evecs = torch.linalg.eigh(batch)
        assert torch.equal(result[0], evals) and torch.equal(result[1], evecs)


def test_a_failing_host_batch_keeps_its_place(monkeypatch: pytest.MonkeyPatch,
                                              host_solves: list[tuple[int, str]]) -> None:
    eigh = torch.linalg.eigh

    def failing(a: Tensor) -> tuple[Tensor, Tensor]:
        if a.shape[-1] == 5:
            raise torch.linalg.LinAlgError("no convergence")
        return eigh(a)

    monkeypatch.setattr(torch.linalg, "eigh", failing)
    results = solves.eigh_batches([_spd(4), _spd(5), _spd(12)], SolvePlacement(8))
    assert isinstance(results[1], torch.linalg.LinAlgError)
    assert not isinstance(results[0], Exception) and not isinstance(results[2], Exception)
    assert len(host_solves) == 2


def test_negative_size_is_refused() -> None:
    with pytest.raises(ValueError, match="host_decomposition_max_dim must be an integer >= 0"):
        SolvePlacement(host_max_dim=-1)


def _kfac_run(lag: int, host_max_dim: int, method: str = "eigen", streams: int = 1
              ) -> list[Tensor]:
    model = small_cnn()
    pre = KFACPreconditioner(model, comm=Communicator(MPI.COMM_SELF), damping=0.01,
                             inv_update_steps=2, inv_dtype=torch.float64,
                             compute_method=method, decomposition_lag=lag,
                             host_decomposition_max_dim=host_max_dim,
                             decomposition_streams=streams)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    train_kfac(model, opt, pre, small_cnn_batches(6))
    pre.close()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("lag, method", [(0, "eigen"), (1, "eigen"), (0, "inverse"),
                                         (1, "inverse")])
def test_kfac_on_the_gpu_path_with_host_decompositions_is_unchanged(
        monkeypatch: pytest.MonkeyPatch, host_solves: list[tuple[int, str]], lag: int,
        method: str) -> None:
    """Every factor's decomposition lands in its own place: the run is bitwise the same.

    The host's batches get the same solver call on the same values as the device's.
    """
    for module in (linalg, layers):
        monkeypatch.setattr(module, "uses_gpu_path", lambda device: True)
    on_device = _kfac_run(lag, host_max_dim=0, method=method)
    assert host_solves == []
    with_host = _kfac_run(lag, host_max_dim=16, method=method)
    sizes = {n for n, _ in host_solves}
    assert sizes and max(sizes) <= 16
    for a, b in zip(with_host, on_device):
        assert torch.equal(a, b)


def _shampoo_run(host_max_dim: int, streams: int = 1) -> list[Tensor]:
    torch.manual_seed(0)
    model = small_cnn()
    opt = DistributedShampoo(model.named_parameters(), lr=0.01, max_preconditioner_dim=16,
                             precondition_frequency=2, epsilon=1e-6,
                             comm=Communicator(MPI.COMM_SELF), factor_dtype=torch.float64,
                             host_decomposition_max_dim=host_max_dim,
                             decomposition_streams=streams)
    for x, y in small_cnn_batches(5):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x.double()), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def test_shampoo_roots_with_host_decompositions_are_unchanged(
        host_solves: list[tuple[int, str]]) -> None:
    on_device = _shampoo_run(host_max_dim=0)
    assert host_solves == []
    with_host = _shampoo_run(host_max_dim=8)
    assert host_solves and max(n for n, _ in host_solves) <= 8
    for a, b in zip(with_host, on_device):
        assert torch.equal(a, b)


def test_shampoo_refuses_a_negative_size() -> None:
    with pytest.raises(ValueError, match="host_decomposition_max_dim"):
        DistributedShampoo(small_cnn().parameters(), comm=Communicator(MPI.COMM_SELF),
                           host_decomposition_max_dim=-1)


def test_kfac_refuses_a_negative_size() -> None:
    with pytest.raises(ValueError, match="host_decomposition_max_dim must be an integer >= 0"):
        KFACPreconditioner(small_cnn(), comm=Communicator(MPI.COMM_SELF),
                           host_decomposition_max_dim=-1)


def test_the_driver_refuses_a_negative_size() -> None:
    with pytest.raises(ValueError, match="--host-decomposition-max-dim: must be >= 0"):
        TrainConfig(host_decomposition_max_dim=-1).validate()


def test_batched_damped_inverses_equal_one_by_one_and_survive_a_bad_factor(
        monkeypatch: pytest.MonkeyPatch, host_solves: list[tuple[int, str]]) -> None:
    """A batch whose Cholesky fails is redone factor by factor: the others are unharmed."""
    monkeypatch.setattr(linalg, "uses_gpu_path", lambda device: True)
    factors = [*_spd(5, batch=3, seed=4).unbind(), *_spd(9, batch=2, seed=5).unbind()]
    bad = -torch.eye(5, dtype=torch.float64)  # negative definite: Cholesky fails
    factors.insert(1, bad)
    got = linalg.damped_inverse_many(factors, 1e-4, placement=SolvePlacement(6))
    assert sorted(n for n, _ in host_solves) == [5]
    for f, inv in zip(factors, got):
        assert not isinstance(inv, Exception)
        torch.testing.assert_close(inv, linalg.damped_inverse(f, 1e-4), rtol=1e-12, atol=1e-12)


# --------------------------------------------------- the device's batches over streams
def test_only_cuda_batches_of_more_than_32_rows_spread_over_streams() -> None:
    assert solves.spreads_over_streams(batch("cuda", 33), 2)
    assert not solves.spreads_over_streams(batch("cuda", 32), 2)
    assert not solves.spreads_over_streams(batch("cuda", 600), 1)
    assert not solves.spreads_over_streams(batch("cpu", 600), 4)


def test_nothing_spreads_over_streams_under_deterministic_algorithms() -> None:
    """cuSOLVER on concurrent streams was not reproducible under deterministic algorithms
    (tests/gpu/test_solves_gpu.py checks the bits on a GPU)."""
    before = (torch.are_deterministic_algorithms_enabled(),
              torch.is_deterministic_algorithms_warn_only_enabled())
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        assert not solves.spreads_over_streams(batch("cuda", 600), 8)
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
    assert solves.spreads_over_streams(batch("cuda", 600), 8)


@pytest.fixture
def lanes(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[str, list[tuple[int, int]]]]]:
    """CPU batches of more than 2 rows spread over the lanes, as CUDA ones of more than
    32 do; records each lane's thread and the (batch, chunk) pieces it solved.

    The CPU's ``torch.linalg.eigh`` stands in for cuSOLVER's, whose result for a matrix
    does not depend on where the matrix lies in its batch
    (``tests/gpu/test_solves_gpu.py``). MKL's does on some CPUs (AMD EPYC: a matrix at an
    address that is not a multiple of 64 bytes is rounded otherwise), and a chunk moves
    its matrices to other offsets. So here each matrix is decomposed alone from a fresh,
    aligned copy, and the results are returned in the layout of torch's (column-major
    eigenvectors).
    """
    seen: list[tuple[str, list[tuple[int, int]]]] = []
    solve_lane = solves._solve_lane
    eigh = torch.linalg.eigh

    def aligned_eigh(a: Tensor) -> tuple[Tensor, Tensor]:
        pairs = [eigh(m.clone()) for m in a.reshape(-1, *a.shape[-2:])]
        values = torch.stack([w for w, _ in pairs]).reshape(a.shape[:-1])
        vectors = torch.stack([v.mT for _, v in pairs]).mT.reshape(a.shape)
        return values, vectors

    def recording(pieces: list[tuple[int, int, Tensor]], *args: object) -> object:
        seen.append((threading.current_thread().name, [(i, j) for i, j, _ in pieces]))
        return solve_lane(pieces, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(solves, "_solve_lane", recording)
    monkeypatch.setattr(torch.linalg, "eigh", aligned_eigh)
    monkeypatch.setattr(solves, "spreads_over_streams",
                        lambda batch, k: k > 1 and batch.shape[-1] > 2)
    yield seen


def test_spread_batches_are_split_by_cost_and_equal_one_stream(
        lanes: list[tuple[str, list[tuple[int, int]]]]) -> None:
    batches = [_spd(12, batch=5, seed=1), _spd(2, batch=3, seed=2), _spd(30, batch=2, seed=3)]
    spread = solves.eigh_batches(batches, SolvePlacement(0, 3))
    alone = [torch.linalg.eigh(b) for b in batches]
    for got, want in zip(spread, alone):
        assert not isinstance(got, Exception)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        # eigh's layout: column-major vectors, contiguous values
        assert got[0].stride() == want[0].stride() and got[1].stride() == want[1].stride()
    assert all(name.startswith("kfac-hpc-stream-solves") for name, _ in lanes)
    pieces = sorted(p for _, lane in lanes for p in lane)
    # 5 matrices of 12 rows in 3 chunks, 2 of 30 rows in 2; the 2-row batch stays whole
    assert pieces == [(0, 0), (0, 1), (0, 2), (2, 0), (2, 1)]
    first = {lane[0] for _, lane in lanes}
    assert first == {(2, 0), (2, 1), (0, 0)}  # the largest pieces first, one per lane


def test_more_lanes_replace_the_pool_and_end_the_old_threads(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Asking for more lanes than the pool has builds a larger pool; the old one is shut
    down (its threads exit) and the work queued on it still completes."""
    monkeypatch.setattr(solves, "_lanes", None)
    monkeypatch.setattr(solves, "_lane_threads", 0)
    release = threading.Event()

    def lane_threads() -> set[threading.Thread]:
        return {t for t in threading.enumerate()
                if t.name.startswith("kfac-hpc-stream-solves") and t.is_alive()}

    def held(value: int) -> int:
        release.wait(30)
        return value

    before = lane_threads()
    first = solves._submit_to_lanes(2, [(held, (1,)), (held, (2,))])
    old_threads = lane_threads() - before
    assert len(old_threads) == 2
    second = solves._submit_to_lanes(3, [(held, (3,))])
    assert solves._lane_threads == 3
    release.set()
    assert [f.result(timeout=30) for f in first + second] == [1, 2, 3]
    for t in old_threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in old_threads)
    # a request for no more lanes than the pool has keeps it
    pool = solves._lanes
    assert solves._submit_to_lanes(2, [(held, (4,))])[0].result(timeout=30) == 4
    assert solves._lanes is pool
    assert pool is not None
    pool.shutdown(wait=True)


def test_a_failing_chunk_fails_its_batch_only(lanes: list[tuple[str, list[tuple[int, int]]]]
                                              ) -> None:
    def solve(batch: Tensor) -> tuple[Tensor, ...]:
        if batch.shape[-1] == 12 and bool((batch[0] == batches[0][3]).all()):
            raise torch.linalg.LinAlgError("the chunk with matrix 3")
        return solves.symmetric_eigh(batch)

    batches = [_spd(12, batch=5, seed=1), _spd(30, batch=2, seed=3)]
    results = solves.solve_batches(batches, solve, SolvePlacement(0, 2))
    assert isinstance(results[0], torch.linalg.LinAlgError)
    assert not isinstance(results[1], Exception)
    assert torch.equal(results[1][1], torch.linalg.eigh(batches[1])[1])


@pytest.mark.parametrize(("cores", "streams"), [(1, 1), (2, 2), (7, 7), (8, 8), (64, 8)])
def test_default_streams_are_eight_or_the_cores_this_process_may_run_on(
        monkeypatch: pytest.MonkeyPatch, cores: int, streams: int) -> None:
    """Unset, ``decomposition_streams`` is 8, or the cores of this process's affinity mask
    (a batch system's binding) when fewer, resolved once at construction: K-FAC's
    decompositions get that placement and its config records it, though the mask changes
    afterwards; Shampoo and the placement agree."""
    from kfac_hpc.kfac import preconditioner

    monkeypatch.setattr(solves.os, "sched_getaffinity", lambda pid: set(range(cores)))
    assert solves.default_device_streams() == streams
    assert SolvePlacement().device_streams == streams
    assert SolvePlacement.of(0, None) == SolvePlacement(0, streams)
    assert SolvePlacement.of(3, 5) == SolvePlacement(3, 5)
    placements: list[SolvePlacement] = []
    make = preconditioner.make_decomposer

    def spy(**kw: object) -> object:
        placements.append(kw["placement"])  # type: ignore[arg-type]
        return make(**kw)  # type: ignore[arg-type]

    monkeypatch.setattr(preconditioner, "make_decomposer", spy)
    pre = KFACPreconditioner(small_cnn(), comm=Communicator(MPI.COMM_SELF))
    monkeypatch.setattr(solves.os, "sched_getaffinity", lambda pid: {0, 1, 2})
    assert placements == [SolvePlacement(0, streams)]
    assert pre.config()["decomposition_streams"] == streams
    pre.close()
    monkeypatch.setattr(solves.os, "sched_getaffinity", lambda pid: set(range(cores)))
    opt = DistributedShampoo(small_cnn().named_parameters(), comm=Communicator(MPI.COMM_SELF))
    assert opt.solve_placement.device_streams == streams


def test_without_affinity_masks_the_machine_s_cores_count(monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    monkeypatch.delattr(solves.os, "sched_getaffinity")
    monkeypatch.setattr(solves.os, "cpu_count", lambda: 3)
    assert solves.usable_cores() == 3 and solves.default_device_streams() == 3
    monkeypatch.setattr(solves.os, "cpu_count", lambda: None)
    assert solves.default_device_streams() == 1


def test_device_streams_must_be_positive() -> None:
    with pytest.raises(ValueError, match="decomposition_streams must be an integer >= 1"):
        SolvePlacement(device_streams=0)
    with pytest.raises(ValueError, match="decomposition_streams must be an integer >= 1"):
        KFACPreconditioner(small_cnn(), decomposition_streams=0)
    with pytest.raises(ValueError, match="decomposition_streams"):
        DistributedShampoo(small_cnn().named_parameters(), decomposition_streams=0)
    with pytest.raises(ValueError, match="--decomposition-streams: must be >= 1"):
        TrainConfig(decomposition_streams=0).validate()


@pytest.mark.parametrize("lag, method", [(0, "eigen"), (1, "eigen"), (0, "inverse")])
def test_kfac_with_decompositions_spread_over_streams_is_unchanged(
        monkeypatch: pytest.MonkeyPatch, lanes: list[tuple[str, list[tuple[int, int]]]],
        lag: int, method: str) -> None:
    """``decomposition_streams=3`` (the spread forced on CPU tensors): bitwise the run on
    the calling thread, the lanes used."""
    for module in (linalg, layers):
        monkeypatch.setattr(module, "uses_gpu_path", lambda device: True)
    alone = _kfac_run(lag, host_max_dim=0, method=method)
    assert lanes == []
    spread = _kfac_run(lag, host_max_dim=0, method=method, streams=3)
    assert len(lanes) >= 2  # lane calls with pieces
    for a, b in zip(spread, alone):
        assert torch.equal(a, b)


def test_shampoo_roots_spread_over_streams_are_unchanged(
        lanes: list[tuple[str, list[tuple[int, int]]]]) -> None:
    alone = _shampoo_run(host_max_dim=0)
    assert lanes == []
    spread = _shampoo_run(host_max_dim=0, streams=3)
    assert lanes
    for a, b in zip(spread, alone):
        assert torch.equal(a, b)
