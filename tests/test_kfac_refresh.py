"""Eigenbasis refresh by one subspace-iteration step (``eigen_refresh="subspace"``)."""

from __future__ import annotations

import copy

import pytest
import torch
from mpi4py import MPI
from shared_cases import small_cnn, small_cnn_batches
from torch import nn

from kfac_hpc import KFACPreconditioner
from kfac_hpc.comm import Communicator
from kfac_hpc.kfac import linalg


def factor(d: int, seed: int, spread: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    p = torch.randn(d, 3 * d, generator=g, dtype=torch.float64)
    p *= torch.logspace(0, spread, d, dtype=torch.float64).unsqueeze(1)
    return p @ p.t() / (3 * d)


def reconstruction_error(f: torch.Tensor, q: torch.Tensor, lam: torch.Tensor) -> float:
    return float(torch.linalg.norm(q @ torch.diag(lam) @ q.t() - f) / torch.linalg.norm(f))


def test_refresh_from_the_eigenbasis_is_the_eigendecomposition():
    f = factor(40, 0)
    lam, q = torch.linalg.eigh(f)
    (q2, lam2), = linalg.refresh_eigenbases([f], [q], torch.float64)
    assert reconstruction_error(f, q2, lam2) < 1e-13
    torch.testing.assert_close(lam2, lam, rtol=1e-12, atol=1e-14)


def test_refreshes_converge_to_the_factor():
    """From a random orthonormal basis, each refresh is one power step: the error of the
    reconstructed factor falls steadily (slowest for the closest eigenvalues)."""
    f = factor(30, 1, spread=2.0)
    q = torch.linalg.qr(torch.randn(30, 30, dtype=torch.float64,
                                    generator=torch.Generator().manual_seed(2)))[0]
    errors = []
    for _ in range(200):
        (q, lam), = linalg.refresh_eigenbases([f], [q], torch.float64)
        errors.append(reconstruction_error(f, q, lam))
    assert errors[0] > 1e-2
    assert errors[-1] < 1e-6
    assert all(later < earlier for earlier, later in zip(errors[::20], errors[20::20]))


def test_refresh_batches_by_size_and_keeps_order():
    fs = [factor(12, 3), factor(7, 4), factor(12, 5)]
    qs = [torch.linalg.eigh(f)[1] for f in fs]
    out = linalg.refresh_eigenbases(fs, qs, torch.float32)
    for f, (q, lam) in zip(fs, out):
        assert q.dtype == torch.float32 and q.shape == f.shape
        assert reconstruction_error(f, q.double(), lam.double()) < 1e-6
    with pytest.raises(ValueError, match="basis of shape"):
        linalg.refresh_eigenbases([fs[0]], [qs[1]])


def _train(comm: Communicator, refresh: str, steps: int = 7) -> tuple[nn.Module,
                                                                      KFACPreconditioner]:
    model = small_cnn()
    pre = KFACPreconditioner(model, comm=comm, damping=0.01, inv_update_steps=2,
                             inv_dtype=torch.float64, eigen_refresh=refresh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for x, y in small_cnn_batches(steps):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        previous = {k: d["Q"].clone() for k, d in pre.decompositions.items()}
        pre.step()
        opt.step()
        if pre.steps - 1 == 2:  # the second inverse update: refreshed from the first
            for key, parts in pre.decompositions.items():
                f = pre.factors[key].average if key in pre.factors else None
                if f is None or refresh != "subspace":
                    continue
                (q, lam), = linalg.refresh_eigenbases([f], [previous[key]], torch.float64)
                assert torch.equal(parts["Q"], q) and torch.equal(parts["lambda"], lam), key
    return model, pre


def test_subspace_refresh_in_the_preconditioner():
    comm = Communicator(MPI.COMM_SELF)
    _, eigh_pre = _train(comm, "eigh", steps=1)
    _, sub_pre = _train(comm, "subspace", steps=1)
    for key, parts in eigh_pre.decompositions.items():  # the first update is an eigh
        assert torch.equal(parts["Q"], sub_pre.decompositions[key]["Q"])
    _, pre = _train(comm, "subspace")
    assert pre.config()["eigen_refresh"] == "subspace"
    for p in (eigh_pre, sub_pre, pre):
        p.close()


@pytest.mark.mpi(min_size=2)
def test_subspace_refresh_is_the_same_on_any_number_of_ranks(comm):
    alone, pre1 = _train(Communicator(MPI.COMM_SELF), "subspace")
    together, pre2 = _train(comm, "subspace")
    for (name, p), q in zip(together.named_parameters(), alone.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-14, msg=name)
    pre1.close()
    pre2.close()


def test_refresh_needs_eigenbases():
    with pytest.raises(ValueError, match="eigen_refresh needs compute_method='eigen'"):
        KFACPreconditioner(nn.Linear(3, 2), compute_method="inverse", eigen_refresh="subspace")
    with pytest.raises(ValueError, match="eigen_refresh must be one of"):
        KFACPreconditioner(nn.Linear(3, 2), eigen_refresh="qr")  # type: ignore[arg-type]


def test_refresh_beats_the_stale_basis_on_a_changed_factor():
    """A factor that moved since its eigenbasis (a running average 23 % new): the refresh
    reconstructs it better than the old basis with the new diagonal does, because the
    QR takes the dominant directions first (ascending order gave an error of 0.63)."""
    old = factor(144, 6, spread=4.0)
    new = 0.77 * old + 0.23 * factor(144, 7, spread=4.0)
    _, q = torch.linalg.eigh(old)
    (q2, lam2), = linalg.refresh_eigenbases([new], [q], torch.float64)
    stale = (q * (new @ q)).sum(dim=0)
    assert reconstruction_error(new, q2, lam2) < 0.6 * reconstruction_error(new, q, stale)
    assert bool((lam2[1:] >= lam2[:-1]).all()), "eigenvalues come back ascending"


@pytest.mark.parametrize("options", [{}, {"low_rank": 4, "low_rank_min_dim": 8}],
                         ids=["full", "low-rank"])
@pytest.mark.parametrize("saved_at", [3, 4], ids=["before-plain-step", "before-inverse-step"])
def test_a_resumed_subspace_run_is_bitwise_the_uninterrupted_one(saved_at: int,
                                                                  options: dict) -> None:
    """State saved after ``saved_at`` steps (4: the next step is an inverse step, which
    refreshes the bases the load restores; a fresh ``eigh`` there gave 5e-3 before)."""
    comm = Communicator(MPI.COMM_SELF)
    batches = list(small_cnn_batches(7))

    def build() -> tuple[nn.Module, torch.optim.Optimizer, KFACPreconditioner]:
        model = small_cnn()
        pre = KFACPreconditioner(model, comm=comm, damping=0.01, inv_update_steps=2,
                                 inv_dtype=torch.float64, eigen_refresh="subspace", **options)
        return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), pre

    def run(model: nn.Module, opt: torch.optim.Optimizer, pre: KFACPreconditioner,
            steps: list) -> None:
        for x, y in steps:
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            pre.step()
            opt.step()

    model, opt, pre = build()
    run(model, opt, pre, batches[:saved_at])
    states = copy.deepcopy((model.state_dict(), opt.state_dict(), pre.state_dict()))
    run(model, opt, pre, batches[saved_at:])
    model2, opt2, pre2 = build()
    model2.load_state_dict(states[0])
    opt2.load_state_dict(states[1])
    pre2.load_state_dict(states[2])
    run(model2, opt2, pre2, batches[saved_at:])
    for (name, p), q in zip(model.named_parameters(), model2.parameters()):
        assert torch.equal(p, q), f"{name}: {float((p - q).abs().max()):.3e}"
    pre.close()
    pre2.close()
