"""``precondition_vectors=False``: blocks of order 1 take the grafting direction alone.

Each block's step depends on its own gradient only, so with gradients fed directly (no
model coupling them), under ``precondition_vectors=False`` the matrix blocks move
exactly as with the default, and the vector blocks exactly as a run that never starts
preconditioning (``start_preconditioning_step`` beyond the run): bit for bit, both.

Run: ``pytest tests/test_shampoo_vectors.py``; the 2-rank test with
``launch/local -n 2 --timeout 300 python -m mpi4py -m pytest -q --with-mpi --only-mpi
tests/test_shampoo_vectors.py``.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from mpi4py import MPI
from torch import Tensor, nn

import kfac_hpc.shampoo.optimizer as optimizer
from kfac_hpc.comm import Communicator
from kfac_hpc.shampoo import DistributedShampoo, ShampooNumericalError, inverse_root
from kfac_hpc.shampoo.roots import RootRequest

SHAPES = [(6, 5), (7,), (3, 4, 2), (5,), ()]  # matrix, vector, 3-D, vector, scalar
KWARGS: dict[str, Any] = dict(lr=0.01, momentum=0.9, weight_decay=1e-3,
                              max_preconditioner_dim=8, precondition_frequency=2,
                              epsilon=1e-6)
NEVER = 10**9


def _params() -> list[nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    return [nn.Parameter(torch.randn(s, generator=g, dtype=torch.float64)) for s in SHAPES]


def _run(steps: int = 6, comm: Communicator | None = None, **options: Any
         ) -> tuple[list[Tensor], DistributedShampoo]:
    params = _params()
    opt = DistributedShampoo(params, comm=comm or Communicator(MPI.COMM_SELF),
                             **{**KWARGS, **options})
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g, dtype=torch.float64)
        opt.step()
    return [p.detach().clone() for p in params], opt


def _vector(i: int) -> bool:
    """Whether parameter ``i`` merges to one dimension (a scalar is ``(1,)``)."""
    return len([d for d in SHAPES[i] if d > 1]) <= 1


def test_matrices_as_by_default_and_vectors_as_grafting_alone() -> None:
    default, _ = _run()
    grafting, _ = _run(start_preconditioning_step=NEVER)
    mixed, opt = _run(precondition_vectors=False)
    for i, (d, gr, m) in enumerate(zip(default, grafting, mixed)):
        assert torch.equal(m, gr if _vector(i) else d), SHAPES[i]
    assert any(not torch.equal(d, gr) for d, gr in zip(default, grafting))  # both matter
    for p, per_block in opt.state.items():
        for state in per_block.values():
            keys = {k for k in state if k.startswith(("factor_", "root_", "basis_"))}
            assert (keys <= {"root_failures"}) == (p.dim() < 2 or
                                                   len([d for d in p.shape if d > 1]) <= 1)


def test_no_root_is_requested_for_a_vector(monkeypatch: pytest.MonkeyPatch) -> None:
    sizes: list[int] = []
    real = optimizer.inverse_roots

    def spy(requests: list[RootRequest], **kwargs: Any) -> Any:
        sizes.extend(r.factors.shape[-1] for r in requests)
        return real(requests, **kwargs)

    monkeypatch.setattr(optimizer, "inverse_roots", spy)
    _, opt = _run(precondition_vectors=False)
    # the matrices' factors only: (6, 5) and (3, 4, 2) merged to (3, 8); not 7, 5 or 1
    assert sorted(set(sizes)) == [3, 5, 6, 8] and sizes.count(5) == sizes.count(6)
    mem_off = opt.memory_bytes()
    _, on = _run()
    assert mem_off["factors"] < on.memory_bytes()["factors"]


def test_a_non_finite_vector_gradient_is_still_an_error() -> None:
    params = _params()
    opt = DistributedShampoo(params, comm=Communicator(MPI.COMM_SELF), **KWARGS,
                             precondition_vectors=False)
    for p in params:
        p.grad = torch.ones_like(p)
    params[1].grad[3] = math.nan
    before = [p.detach().clone() for p in params]
    with pytest.raises(ShampooNumericalError, match=r"'param_1' block 0"):
        opt.step()
    assert all(torch.equal(p, b) for p, b in zip(params, before))


def test_vectors_cost_their_elements_in_the_ownership_balance() -> None:
    _, on = _run(steps=0)
    _, off = _run(steps=0, precondition_vectors=False)
    for spec, cost_on, cost_off in zip(on.layout.blocks, on.layout.costs, off.layout.costs):
        assert cost_on == spec.cost
        assert cost_off == (float(spec.numel) if spec.order == 1 else spec.cost)


def test_a_loaded_setting_keeps_the_owners() -> None:
    """Built with False, loading a state saved with True: the group now says True, and
    the owners stay those of the construction (a checkpoint load hands each rank the
    blocks it owns: new owners would lack their state)."""
    _, saved = _run(steps=2)
    _, loaded = _run(steps=0, precondition_vectors=False)
    built = loaded.layout
    loaded.load_state_dict(saved.state_dict())
    assert loaded.param_groups[0]["precondition_vectors"] is True
    assert loaded.layout == built


@pytest.mark.parametrize("first,then", [(False, True), (True, False)])
def test_resuming_with_the_other_setting(first: bool, then: bool) -> None:
    """False → True: the vectors' factors start from zero at the resume; True → False:
    their factors, roots and bases are dropped at the next step. Either way the
    matrices' blocks continue exactly as an uninterrupted run of the first setting."""
    params = _params()
    opt = DistributedShampoo(params, comm=Communicator(MPI.COMM_SELF), **KWARGS,
                             precondition_vectors=first)
    g = torch.Generator().manual_seed(1)
    grads = [[torch.randn(p.shape, generator=g, dtype=torch.float64) for p in params]
             for _ in range(6)]
    for step, grad in enumerate(grads):
        if step == 3:
            state = opt.state_dict()
            opt = DistributedShampoo(params, comm=Communicator(MPI.COMM_SELF), **KWARGS,
                                     precondition_vectors=then)
            opt.load_state_dict(state)
            assert opt.param_groups[0]["precondition_vectors"] is first  # the saved group's
            opt.param_groups[0]["precondition_vectors"] = then
        for p, gr in zip(params, grad):
            p.grad = gr.clone()
        opt.step()
    straight, _ = _run(precondition_vectors=first)
    for i, (p, s) in enumerate(zip(params, straight)):
        assert torch.isfinite(p).all()
        if not _vector(i):
            assert torch.equal(p.detach(), s), SHAPES[i]
    vector_state = opt.state[params[1]][0]
    assert ("factor_0" in vector_state) is then and ("root_0" in vector_state) is then


def test_turned_off_and_on_again_a_vector_starts_afresh() -> None:
    """In one run: preconditioned, then left to grafting for a step, then preconditioned
    again: its factor is then the one step's ``(1 − β2)·g gᵀ``, not the old history, and
    its root is recomputed at once from it (not the old root)."""
    (w,) = params = [nn.Parameter(torch.zeros(7, dtype=torch.float64))]
    opt = DistributedShampoo(params, comm=Communicator(MPI.COMM_SELF), **KWARGS,
                             factor_dtype=torch.float64)
    g = torch.Generator().manual_seed(3)
    for setting in (True, True, False, True):
        opt.param_groups[0]["precondition_vectors"] = setting
        w.grad = torch.randn(7, generator=g, dtype=torch.float64)
        old_root = opt.state[w][0].get("root_0", torch.empty(0)).clone() if opt.state[w] \
            else torch.empty(0)
        opt.step()
    state = opt.state[w][0]
    beta2 = opt.param_groups[0]["betas"][1]
    torch.testing.assert_close(state["factor_0"], (1 - beta2) * torch.outer(w.grad, w.grad),
                               rtol=1e-14, atol=0.0)
    assert old_root.numel() == 0  # the step before had dropped it
    # recomputed at step 4 (not a root step of frequency 2: it had no root) from it
    want = inverse_root(state["factor_0"] / (1 - beta2**4), 2.0, KWARGS["epsilon"])
    torch.testing.assert_close(state["root_0"], want, rtol=1e-12, atol=0.0)
    assert opt.memory_bytes()["factors"] == 7 * 7 * 8


def test_invalid_value_is_named() -> None:
    with pytest.raises(ValueError, match=r"invalid precondition_vectors='no'"):
        DistributedShampoo(_params(), comm=Communicator(MPI.COMM_SELF),
                           precondition_vectors="no")  # type: ignore[arg-type]


def test_train_config_passes_the_option() -> None:
    from kfac_hpc.train.config import TrainConfig
    from kfac_hpc.train.optim import build_optimizer

    cfg = TrainConfig(optimizer="shampoo", preconditioner="none", model="mlp",  # type: ignore[arg-type]
                      dataset="synthetic", shampoo_options={"precondition_vectors": False})
    assert not cfg.problems()
    opt = build_optimizer(cfg, nn.Linear(3, 2), Communicator(MPI.COMM_SELF))
    assert isinstance(opt, DistributedShampoo)
    assert opt.param_groups[0]["precondition_vectors"] is False


@pytest.mark.mpi(min_size=2)
def test_two_ranks_equal_one_rank_bitwise(comm: Communicator) -> None:
    together, _ = _run(comm=comm, precondition_vectors=False)
    alone, _ = _run(precondition_vectors=False)
    assert all(torch.equal(a, b) for a, b in zip(together, alone))
