"""Randomized low-rank factors and low-rank preconditioning against dense references."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from kfac_hpc.kfac.linalg import eigh_clamped, precondition_eigen
from kfac_hpc.kfac.lowrank import LowRankFactor, precondition_lowrank, randomized_eigh

DT = torch.float64


def rel_err(x: Tensor, ref: Tensor) -> float:
    return float((x - ref).norm() / ref.norm())


def decaying_factor(d: int, gen: torch.Generator, decay: float = 0.7,
                    exact_rank: int | None = None) -> Tensor:
    """Q diag(decay^i) Qᵀ with a random orthogonal Q (exactly rank ``exact_rank`` if set)."""
    q, _ = torch.linalg.qr(torch.randn(d, d, dtype=DT, generator=gen))
    lam = decay ** torch.arange(d, dtype=DT)
    if exact_rank is not None:
        lam[exact_rank:] = 0
    return (q * lam) @ q.t()


def vec(x: Tensor) -> Tensor:
    return x.t().reshape(-1)


def unvec(v: Tensor, rows: int, cols: int) -> Tensor:
    return v.reshape(cols, rows).t()


def test_randomized_recovers_exact_low_rank() -> None:
    gen = torch.Generator().manual_seed(0)
    f = decaying_factor(120, gen, exact_rank=8)
    lr = randomized_eigh(f, rank=8, oversample=6, power_iters=1, generator=gen)
    assert not lr.exact and lr.rank == 8 and lr.dim == 120
    ref = torch.linalg.eigvalsh(f).flip(0)[:8]
    assert rel_err(lr.lam, ref) < 1e-10
    assert float(lr.rho) < 1e-12  # nothing left in the complement
    assert rel_err(lr.dense(), f) < 1e-10
    assert torch.allclose(lr.q.t() @ lr.q, torch.eye(8, dtype=DT), atol=1e-12)


def test_randomized_close_to_exact_on_decaying_spectrum() -> None:
    gen = torch.Generator().manual_seed(1)
    f = decaying_factor(200, gen, decay=0.9)
    lr = randomized_eigh(f, rank=20, power_iters=2, generator=gen)
    assert not lr.exact
    ref = torch.linalg.eigvalsh(f).flip(0)
    assert rel_err(lr.lam, ref[:20]) < 1e-3  # slow decay (0.9): a few 1e-4 expected
    assert rel_err(lr.lam[:10], ref[:10]) < 1e-5
    # ρ is the mean of the discarded eigenvalues: the trace is kept
    assert abs(float(lr.rho) - float((f.trace() - lr.lam.sum()) / 180)) < 1e-14
    assert abs(float(lr.rho) / float(ref[20:].mean()) - 1) < 1e-3
    assert abs(float(lr.dense().trace()) - float(f.trace())) < 1e-10
    zero = randomized_eigh(f, rank=20, remainder="zero", generator=gen)
    assert float(zero.rho) == 0.0


def test_energy_rank_and_fallbacks() -> None:
    gen = torch.Generator().manual_seed(2)
    d = 100
    f = decaying_factor(d, gen, decay=0.5)
    lam = torch.linalg.eigvalsh(f).flip(0)
    want = int((torch.cumsum(lam, 0) >= 0.99 * lam.sum()).nonzero()[0, 0]) + 1
    lr = randomized_eigh(f, energy=0.99, generator=gen)
    assert lr.rank == want and not lr.exact
    # the cap too small for the energy: the cap binds (the layout of a message relies on it)
    capped = randomized_eigh(f, rank=2, energy=0.999, oversample=2, generator=gen)
    assert not capped.exact and capped.rank == 2
    assert randomized_eigh(f, rank=60, energy=0.9999999).rank <= 60  # exact path: capped too
    # a rank not much smaller than d: exact eigh
    big = randomized_eigh(f, rank=60)
    assert big.exact and big.rank == 60
    assert rel_err(big.lam, lam[:60]) < 1e-12
    full = randomized_eigh(f, rank=d)
    assert full.exact and float(full.rho) == 0.0 and rel_err(full.dense(), f) < 1e-12
    for bad in (dict(), dict(rank=0), dict(rank=d + 1), dict(energy=0.0), dict(energy=1.5),
                dict(rank=3, remainder="tail")):
        with pytest.raises(ValueError):
            randomized_eigh(f, **bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        randomized_eigh(torch.zeros(3, 4), rank=1)
    # float32 in, float32 out; half in, float32 out
    assert randomized_eigh(f.float(), rank=5).q.dtype == torch.float32
    assert randomized_eigh(f.half(), rank=5).lam.dtype == torch.float32


@pytest.mark.parametrize(("a_dim", "g_dim", "ka", "kg", "damping", "remainder"), [
    (30, 12, 5, 3, 1e-3, "mean"),
    (30, 12, 5, 3, 1e-2, "zero"),
    (17, 9, 17, 9, 0.1, "mean"),   # full rank: the exact eigen preconditioner
    (25, 8, 1, 8, 1e-4, "mean"),   # one low-rank side, one exact side
])
def test_precondition_lowrank_matches_dense_solve(a_dim: int, g_dim: int, ka: int, kg: int,
                                                  damping: float, remainder: str) -> None:
    gen = torch.Generator().manual_seed(3)
    a_f, g_f = decaying_factor(a_dim, gen, 0.8), decaying_factor(g_dim, gen, 0.6)
    a = randomized_eigh(a_f, rank=ka, remainder=remainder, generator=gen)
    g = randomized_eigh(g_f, rank=kg, remainder=remainder, generator=gen)
    grad = torch.randn(g_dim, a_dim, dtype=DT, generator=gen)
    # dense reference: (Ã ⊗ G̃ + γI)⁻¹ vec(∇W̄) with the low-rank-plus-remainder factors
    m = torch.kron(a.dense(), g.dense()) + damping * torch.eye(a_dim * g_dim, dtype=DT)
    ref = unvec(torch.linalg.solve(m, vec(grad)), g_dim, a_dim)
    got = precondition_lowrank(grad, a, g, damping)
    assert got.dtype == DT and rel_err(got, ref) < 1e-10
    if ka == a_dim and kg == g_dim:
        qa, la = eigh_clamped(a_f, DT)
        qg, lg = eigh_clamped(g_f, DT)
        assert rel_err(got, precondition_eigen(grad, qa, la, qg, lg, damping)) < 1e-10


def test_precondition_lowrank_checks_and_dtype() -> None:
    gen = torch.Generator().manual_seed(4)
    a = randomized_eigh(decaying_factor(20, gen).float(), rank=4)
    g = randomized_eigh(decaying_factor(6, gen).float(), rank=6)
    grad = torch.randn(6, 20, generator=gen, dtype=DT).bfloat16()
    out = precondition_lowrank(grad, a, g, 1e-3)
    assert out.dtype == torch.bfloat16 and out.shape == (6, 20)
    with pytest.raises(ValueError):
        precondition_lowrank(grad.t(), a, g, 1e-3)
    with pytest.raises(ValueError):
        precondition_lowrank(grad, a, g, -1.0)
    assert isinstance(a, LowRankFactor)
    # damping 0: fine where every complement has a remainder, refused where one has none
    finite = precondition_lowrank(grad.float(), a, g, 0.0)
    assert bool(torch.isfinite(finite).all())
    zero = randomized_eigh(decaying_factor(20, gen).float(), rank=4, remainder="zero")
    with pytest.raises(ValueError, match="damping 0 with a remainder rho of 0"):
        precondition_lowrank(grad, zero, g, 0.0)
