"""Shampoo's inverse roots from refreshed eigenbases (``SubspaceRoots``).

What holds exactly: a fresh computation is :class:`EigenRoots`' (bit for bit, so
``fresh_every=1`` trains as the eigen method does); a refreshed matrix whose basis drifted
past the tolerance is recomputed by the eigen path from the same prepared matrix (bit
for bit); the bases are state, so a resumed run equals the uninterrupted one bit for bit.

What holds to rounding: refreshed from its own eigenbasis, a factor's root is the eigen
root (``F·Q = Q·diag(λ)``, so the QR returns ``Q`` up to column signs, which the root
does not see): float64, well-conditioned test factors, 1e-10 relative leaves room for the
QR's and GEMMs' rounding (``~n·u·κ`` with ``κ ≤ 1e3``). Refreshed repeatedly, a basis
converges to the eigenvectors at the ratio of neighbouring eigenvalues, and so does the
dropped share ``r``.

Run: ``pytest tests/test_shampoo_subspace.py``; the 2-rank test with
``launch/local -n 2 --timeout 300 python -m mpi4py -m pytest -q --with-mpi --only-mpi
tests/test_shampoo_subspace.py``.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import pytest
import torch
from mpi4py import MPI
from op_count import count_host_reads, count_ops
from shampoo_ranks import distributed_vs_single
from shared_cases import SHAMPOO_KWARGS, ShampooNet, cuda_fp32_settings_seen
from torch import Tensor, nn

from kfac_hpc.comm import Communicator
from kfac_hpc.shampoo import DistributedShampoo, EigenRoots, SubspaceRoots, root_method_from
from kfac_hpc.shampoo.roots import RootRequest, inverse_roots

torch.set_default_dtype(torch.float32)


def psd(n: int, spectrum: Tensor, seed: int = 0) -> Tensor:
    """``Q diag(spectrum) Qᵀ`` with a random orthogonal ``Q`` (float64)."""
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))
    return (q * spectrum) @ q.T


def residual(f: Tensor, basis: Tensor) -> float:
    """The share of ``f`` off the diagonal in ``basis``: ``‖F − Q diag(QᵀFQ) Qᵀ‖ / ‖F‖``."""
    inner = basis.T @ f @ basis
    return float(torch.linalg.norm(inner - torch.diag(inner.diagonal())) / torch.linalg.norm(f))


def one(request: RootRequest, method: Any) -> tuple[Tensor, Tensor, bool]:
    (result,) = inverse_roots([request], method=method)
    assert result.bases is not None
    return result.roots[0], result.bases[0], result.failed[0]


# ------------------------------------------------------------------ the refresh
def test_refreshed_from_its_eigenbasis_a_root_is_the_eigen_root() -> None:
    f = psd(12, torch.logspace(-3, 0, 12, dtype=torch.float64))
    _, q = torch.linalg.eigh(f)
    want, basis, failed = one(RootRequest(f[None], 1.0, 4.0, 1e-6), EigenRoots())
    assert not failed and torch.equal(basis, q)  # the eigen path hands out its eigenvectors
    got, refreshed, failed = one(RootRequest(f[None], 1.0, 4.0, 1e-6, bases=q[None]),
                                 SubspaceRoots(tolerance=1e-6))
    assert not failed
    torch.testing.assert_close(got, want, rtol=1e-10, atol=0.0)
    assert residual(f, refreshed) < 1e-12
    # ascending, as eigh's: the columns' Rayleigh quotients grow
    quotients = (refreshed * (f @ refreshed)).sum(0)
    assert bool((quotients.diff() > 0).all())


def test_repeated_refreshes_converge_to_the_eigen_root() -> None:
    """Eigenvalues 2^-k (ratio 1/2 between neighbours): each step halves the angles."""
    f = psd(10, 2.0 ** -torch.arange(10, dtype=torch.float64).flip(0))
    want, _, _ = one(RootRequest(f[None], 1.0, 2.0, 1e-3), EigenRoots())
    g = torch.Generator().manual_seed(3)
    basis, _ = torch.linalg.qr(torch.eye(10, dtype=torch.float64)
                               + 0.3 * torch.randn(10, 10, generator=g, dtype=torch.float64))
    method = SubspaceRoots(tolerance=1.0)  # never recomputed fresh
    shares, errors = [], []
    for _ in range(40):
        root, basis, _ = one(RootRequest(f[None], 1.0, 2.0, 1e-3, bases=basis[None]), method)
        shares.append(residual(f, basis))
        errors.append(float(torch.linalg.norm(root - want) / torch.linalg.norm(want)))
    assert shares[0] > 1e-3 and errors[0] > 1e-3  # a real perturbation to start from
    assert all(b <= a * 1.01 for a, b in itertools.pairwise(shares))
    assert shares[-1] < 1e-9 and errors[-1] < 1e-9


def test_a_drifted_basis_is_recomputed_by_the_eigen_path_bit_for_bit() -> None:
    """Three factors, the middle one handed a random basis: it alone is redone, from the
    same prepared matrix (correction 4 included), as the eigen method computes it."""
    fs = torch.stack([psd(8, torch.logspace(-2, 0, 8, dtype=torch.float64), seed=s)
                      for s in range(3)])
    bases = torch.linalg.eigh(fs).eigenvectors
    g = torch.Generator().manual_seed(5)
    bases[1] = torch.linalg.qr(torch.randn(8, 8, generator=g, dtype=torch.float64))[0]
    eigen = inverse_roots([RootRequest(fs, 4.0, 2.0, 1e-4)])[0]
    refreshed = inverse_roots([RootRequest(fs, 4.0, 2.0, 1e-4, bases=bases)],
                              method=SubspaceRoots(tolerance=1e-3))[0]
    assert refreshed.bases is not None and eigen.bases is not None
    assert refreshed.refreshed == [True, False, True] and eigen.refreshed is None
    assert torch.equal(refreshed.roots[1], eigen.roots[1])
    assert torch.equal(refreshed.bases[1], eigen.bases[1])
    for j in (0, 2):  # kept their refresh: equal to rounding, not the same bits
        torch.testing.assert_close(refreshed.roots[j], eigen.roots[j], rtol=1e-10, atol=0.0)
    # with tolerance 1 nothing is redone: the drifted root stays far off
    loose = inverse_roots([RootRequest(fs, 4.0, 2.0, 1e-4, bases=bases)],
                          method=SubspaceRoots(tolerance=1.0))[0]
    assert float(torch.linalg.norm(loose.roots[1] - eigen.roots[1])) > 1e-2


def test_non_finite_refresh_takes_the_eigen_path() -> None:
    f = psd(6, torch.linspace(0.1, 1.0, 6, dtype=torch.float64))
    bad = torch.full((1, 6, 6), math.nan, dtype=torch.float64)
    got, basis, failed = one(RootRequest(f[None], 1.0, 2.0, 1e-6, bases=bad),
                             SubspaceRoots(tolerance=1.0))
    want, want_basis, _ = one(RootRequest(f[None], 1.0, 2.0, 1e-6), EigenRoots())
    assert not failed and torch.equal(got, want) and torch.equal(basis, want_basis)


def test_requests_with_and_without_bases_mix_in_order() -> None:
    """Sizes 4 and 6, with and without bases, interleaved: each result is its request's."""
    fs = {n: torch.stack([psd(n, torch.linspace(0.5, 2.0, n, dtype=torch.float64), seed=s)
                          for s in range(2)]) for n in (4, 6)}
    qs = {n: torch.linalg.eigh(f).eigenvectors for n, f in fs.items()}
    requests = [RootRequest(fs[4], 1.0, 2.0, 1e-3, bases=qs[4]), RootRequest(fs[6], 1.0, 4.0, 1e-3),
                RootRequest(fs[6], 1.0, 2.0, 1e-3, bases=qs[6]), RootRequest(fs[4], 1.0, 4.0, 1e-3)]
    got = inverse_roots(requests, method=SubspaceRoots())
    for request, result in zip(requests, got):
        want = inverse_roots([RootRequest(request.factors, 1.0, request.p, 1e-3)])[0]
        torch.testing.assert_close(result.roots, want.roots, rtol=1e-10, atol=0.0)


def test_a_refresh_root_step_reads_the_host_once_and_decomposes_nothing() -> None:
    fs = torch.stack([psd(16, torch.logspace(-2, 0, 16, dtype=torch.float64), seed=s)
                      for s in range(5)])
    requests = [RootRequest(fs, 1.0, 2.0, 1e-4, bases=torch.linalg.eigh(fs).eigenvectors)]
    reads = count_host_reads(lambda: inverse_roots(requests, method=SubspaceRoots()))
    assert reads.total == 1
    ops = count_ops(lambda: inverse_roots(requests, method=SubspaceRoots()))
    assert ops.calls("aten.linalg_qr.") == 1 and ops.calls("aten.bmm.") >= 2
    assert not any("eigh" in name for name in ops.counts), ops.counts


def test_products_run_at_full_precision_whatever_the_user_set(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import kfac_hpc.kfac.linalg as linalg

    f = psd(5, torch.linspace(1.0, 2.0, 5, dtype=torch.float64)).float()
    request = RootRequest(f[None], 1.0, 2.0, 1e-3, bases=torch.eye(5)[None])
    seen = cuda_fp32_settings_seen(
        monkeypatch, linalg, "user_setting_matmul",
        lambda: inverse_roots([request], method=SubspaceRoots(tolerance=1.0)))
    assert len(seen) == 2 and set(seen) == {"ieee"}


# ------------------------------------------------------------------ in the optimizer
def _train(method: Any, steps: int = 9, resume_at: int | None = None,
           then: Any = None, **overrides: Any) -> tuple[list[Tensor], DistributedShampoo]:
    """ShampooNet, float64, roots every 2 steps (``overrides`` change the settings);
    optionally saved at ``resume_at`` and continued by a new optimizer (with ``then``'s
    method, default the same)."""
    model = ShampooNet().double()
    kwargs = {**SHAMPOO_KWARGS, "epsilon": 1e-6, **overrides}
    opt = DistributedShampoo(model.named_parameters(), **kwargs, root_method=method)
    g = torch.Generator().manual_seed(1)
    for step in range(steps):
        if step == resume_at:
            state = opt.state_dict()
            opt = DistributedShampoo(model.named_parameters(), **kwargs,
                                     root_method=method if then is None else then)
            opt.load_state_dict(state)
        x = torch.randn(8, 2, 4, 4, generator=g, dtype=torch.float64)
        y = torch.randn(8, 3, generator=g, dtype=torch.float64)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()], opt


def _bases(opt: DistributedShampoo) -> list[str]:
    return sorted({k for per in opt.state.values() for s in per.values() for k in s
                   if k.startswith("basis_")})


def test_fresh_every_one_trains_as_the_eigen_method_bit_for_bit() -> None:
    eigen, eigen_opt = _train(EigenRoots())
    fresh, fresh_opt = _train(SubspaceRoots(fresh_every=1))
    assert all(torch.equal(a, b) for a, b in zip(eigen, fresh))
    assert not _bases(eigen_opt) and _bases(fresh_opt)
    for per in fresh_opt.state.values():
        for state in per.values():
            roots = sorted(k.removeprefix("root_") for k in state
                           if k.startswith("root_") and k != "root_failures")
            assert roots == sorted(k.removeprefix("basis_") for k in state
                                   if k.startswith("basis_"))
    mem = fresh_opt.memory_bytes()
    assert mem["bases"] == mem["roots"] > 0 and eigen_opt.memory_bytes()["bases"] == 0


def _carried(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Record, per root step of the optimizer, whether its requests carry bases."""
    import kfac_hpc.shampoo.optimizer as optimizer
    seen: list[bool] = []
    real = optimizer.inverse_roots

    def spy(requests: list[RootRequest], **kwargs: Any) -> Any:
        carried = {r.bases is not None for r in requests}
        assert len(carried) == 1  # all blocks of ShampooNet step together
        seen.append(carried.pop())
        return real(requests, **kwargs)

    monkeypatch.setattr(optimizer, "inverse_roots", spy)
    return seen


def test_refreshes_follow_the_schedule(monkeypatch: pytest.MonkeyPatch) -> None:
    """Roots every 2 steps from step 1 (computations 0..4 at steps 1, 3, 5, 7, 9);
    fresh_every=3: computations 0 and 3 fresh, the others refreshed."""
    seen = _carried(monkeypatch)
    _train(SubspaceRoots(fresh_every=3, tolerance=1.0))
    assert seen == [False, True, True, False, True]


def test_the_schedule_counts_from_the_start_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """Preconditioning from step 4, roots every 3 steps: computations 0..4 at steps 4, 7,
    10, 13, 16; fresh_every=2 makes 0, 2 and 4 fresh (counting from step 0 instead would
    make step 7's fresh and step 10's a refresh)."""
    seen = _carried(monkeypatch)
    _train(SubspaceRoots(fresh_every=2, tolerance=1.0), steps=16,
           start_preconditioning_step=4, precondition_frequency=3)
    assert seen == [False, True, False, True, False]


def test_kept_refreshes_leave_at_most_the_tolerance_off_the_diagonal(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """ShampooNet's small blocks change fast between root steps: some refreshed bases
    drift past 0.05 and are recomputed (their eigenvectors leave ~1e-16), the others
    are kept, each leaving at most 0.05 of its factor off the diagonal."""
    import kfac_hpc.shampoo.optimizer as optimizer
    real = optimizer.inverse_roots
    shares: list[float] = []

    def spy(requests: list[RootRequest], **kwargs: Any) -> Any:
        results = real(requests, **kwargs)
        for request, result in zip(requests, results):
            if request.bases is None:
                continue
            for f, q in zip(request.factors / request.correction, result.bases):
                shares.append(residual(f, q))
        return results

    monkeypatch.setattr(optimizer, "inverse_roots", spy)
    _train(SubspaceRoots(fresh_every=100, tolerance=0.05))
    kept = [r for r in shares if r > 1e-10]
    assert kept and len(kept) < len(shares)
    assert max(kept) <= 0.05 * (1 + 1e-9), kept


@pytest.mark.parametrize("resume_at", [4, 6])
def test_resume_equals_the_uninterrupted_run_bit_for_bit(resume_at: int) -> None:
    method = SubspaceRoots(fresh_every=3, tolerance=1.0)
    straight, _ = _train(method)
    resumed, opt = _train(method, resume_at=resume_at)
    assert all(torch.equal(a, b) for a, b in zip(straight, resumed))
    assert _bases(opt)


def test_switching_from_eigen_the_first_computation_is_fresh(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Resumed at step 5 (computation 2, not due by fresh_every=100) from an eigen run's
    state: no bases, so fresh, and bitwise the eigen run's step; refreshes follow."""
    seen = _carried(monkeypatch)
    _, opt = _train(EigenRoots(), resume_at=4, then=SubspaceRoots(fresh_every=100))
    assert seen == [False, False, False, True, True] and _bases(opt)
    seen.clear()
    at_five, _ = _train(EigenRoots(), steps=5, resume_at=4, then=SubspaceRoots(fresh_every=100))
    eigen, _ = _train(EigenRoots(), steps=5)
    assert all(torch.equal(a, b) for a, b in zip(eigen, at_five))


def test_switching_to_eigen_drops_the_bases() -> None:
    _, opt = _train(SubspaceRoots(), steps=4)
    assert _bases(opt)
    _, opt = _train(SubspaceRoots(), steps=5, resume_at=4, then=EigenRoots())
    assert not _bases(opt) and opt.memory_bytes()["bases"] == 0


def test_a_failed_first_root_leaves_identity_roots_and_bases(
        monkeypatch: pytest.MonkeyPatch) -> None:
    def failing(a: Tensor, *args: object, **kwargs: object) -> Any:
        raise torch.linalg.LinAlgError("injected failure")

    monkeypatch.setattr(torch.linalg, "eigh", failing)
    w = nn.Parameter(torch.zeros(3, 4, dtype=torch.float64))
    opt = DistributedShampoo([w], max_preconditioner_dim=4, root_method=SubspaceRoots())
    w.grad = torch.randn(3, 4, dtype=torch.float64)
    opt.step()
    (state,) = opt.state[w].values()
    assert state["root_failures"] == 1
    for i, d in enumerate((3, 4)):
        eye = torch.eye(d, dtype=torch.float64)
        assert torch.equal(state[f"root_{i}"], eye) and torch.equal(state[f"basis_{i}"], eye)


def test_a_later_failure_keeps_the_previous_roots_and_bases(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """After good root steps, a refresh that drifts (tolerance 1e-12) goes to eigh, which
    fails in both dtypes: the block keeps its roots and bases, and counts the failure."""
    w = nn.Parameter(torch.zeros(3, 4, dtype=torch.float64))
    opt = DistributedShampoo([w], max_preconditioner_dim=4, precondition_frequency=1,
                             comm=Communicator(MPI.COMM_SELF), root_method=SubspaceRoots())
    g = torch.Generator().manual_seed(0)
    for _ in range(2):
        w.grad = torch.randn(3, 4, generator=g, dtype=torch.float64)
        opt.step()
    (state,) = opt.state[w].values()
    before = {k: v.clone() for k, v in state.items() if k.startswith(("root_", "basis_"))
              and isinstance(v, Tensor)}

    def failing(a: Tensor, *args: object, **kwargs: object) -> Any:
        raise torch.linalg.LinAlgError("injected failure")

    opt.root_method = SubspaceRoots(tolerance=1e-12)
    monkeypatch.setattr(torch.linalg, "eigh", failing)
    w.grad = torch.randn(3, 4, generator=g, dtype=torch.float64)
    opt.step()
    assert state["root_failures"] == 1 and len(before) == 4
    assert all(torch.equal(state[k], v) for k, v in before.items())


# ------------------------------------------------------------------ configuration
def test_root_method_from_names_subspace() -> None:
    assert root_method_from("subspace") == SubspaceRoots()
    assert root_method_from("subspace(fresh_every=5, tolerance=0.1)") == SubspaceRoots(5, 0.1)
    assert root_method_from(repr(SubspaceRoots(fresh_every=2))) == SubspaceRoots(fresh_every=2)
    assert root_method_from({"name": "subspace", "fresh_every": 4}) == SubspaceRoots(4)
    with pytest.raises(ValueError, match="SubspaceRoots has no check_every"):
        root_method_from("subspace(check_every=3)")


@pytest.mark.parametrize("kwargs,field", [
    (dict(fresh_every=0), "fresh_every"), (dict(fresh_every=1.5), "fresh_every"),
    (dict(fresh_every=True), "fresh_every"), (dict(tolerance=0.0), "tolerance"),
    (dict(tolerance=1.5), "tolerance"), (dict(tolerance=math.inf), "tolerance"),
])
def test_invalid_subspace_settings_are_named(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=rf"SubspaceRoots: invalid {field}="):
        SubspaceRoots(**kwargs)


def test_train_config_maps_the_option() -> None:
    from kfac_hpc.train.config import TrainConfig
    from kfac_hpc.train.optim import build_optimizer

    options = {"root_method": "subspace(fresh_every=4)"}
    cfg = TrainConfig(optimizer="shampoo", preconditioner="none", model="mlp",  # type: ignore[arg-type]
                      dataset="synthetic", shampoo_options=options)
    assert not cfg.problems()
    opt = build_optimizer(cfg, nn.Linear(3, 2), Communicator(MPI.COMM_SELF))
    assert isinstance(opt, DistributedShampoo)
    assert opt.root_method == SubspaceRoots(fresh_every=4)


# ------------------------------------------------------------------ ranks
@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("tolerance,max_dim", [(1.0, 4), (0.05, 8)])
def test_two_ranks_equal_one_rank_bitwise(comm: Communicator, tolerance: float,
                                          max_dim: int) -> None:
    """Each block's bases are its owner's: a run over the world equals one over
    COMM_SELF bit for bit, and so does a state dict gathered from the owners; with
    tolerance 0.05 some refreshes drift and are redone by eigh."""
    _, dist, single = distributed_vs_single(
        comm, steps=7, root_method=SubspaceRoots(fresh_every=2, tolerance=tolerance),
        max_preconditioner_dim=max_dim)
    together, alone = dist.state_dict()["state"], single.state_dict()["state"]
    for name, blocks in alone.items():
        for index, state in blocks.items():
            assert "basis_0" in state
            for key, value in state.items():
                other = together[name][index][key]
                assert torch.equal(value, other) if isinstance(value, Tensor) else value == other
