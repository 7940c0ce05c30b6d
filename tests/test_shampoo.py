"""DistributedShampoo on one rank: dense reference, equivalences with torch optimizers,
state dict, failure handling, validation.

References are independent of the code under test: factors from ``torch.tensordot``
over explicit dimension lists, inverse roots from a coupled Newton iteration in float64
(no eigendecomposition), preconditioning from explicit ``torch.kron`` products.

Tolerances: the reference tests run in float64 on blocks of side ≤ 4 with
ε = 1e-4, so the regularised factors have condition numbers ≲ 1e5 and both sides are
accurate to ~1e-11 relative; 1e-8 leaves room while a wrong exponent, factor, order
or scaling gives O(1) errors. Equivalences with torch optimizers run in float64
(1e-10: only the order of a few floating-point operations differs) and once in
float32 with the defaults (1e-6 relative over 8 steps).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence

import numpy as np
import pytest
import torch
from torch import Tensor, nn

from kfac_hpc.shampoo import DistributedShampoo, ShampooNumericalError, block_param

F64 = dict(factor_dtype=torch.float64, communication_dtype=torch.float64)


# ----------------------------------------------------------------- reference
def newton_inverse_root(a: Tensor, p: int, tol: float = 1e-15, max_iter: int = 500) -> Tensor:
    """``a^(-1/p)`` of an SPD matrix by the coupled Newton iteration (float64)."""
    a = a.double()
    eye = torch.eye(a.shape[0], dtype=torch.float64)
    z = (1 + p) / (2 * torch.linalg.matrix_norm(a))  # Frobenius ≥ spectral norm
    x = eye * z ** (1.0 / p)
    m = a * z
    for _ in range(max_iter):
        t = ((p + 1) * eye - m) / p
        x = x @ t
        m = torch.linalg.matrix_power(t, p) @ m
        if (m - eye).abs().max() < tol:
            return x
    raise AssertionError("Newton iteration did not converge")


def mode_factor(x: Tensor, i: int) -> Tensor:
    """``X_(i) X_(i)ᵀ`` written as a tensordot over every other dimension."""
    others = [d for d in range(x.dim()) if d != i]
    return torch.tensordot(x, x, dims=(others, others))


def kron_apply(roots: Sequence[Tensor], x: Tensor) -> Tensor:
    """``(R_1 ⊗ … ⊗ R_k) vec(X)`` with row-major vec, reshaped like ``x``."""
    k = roots[0]
    for r in roots[1:]:
        k = torch.kron(k, r)
    return (k @ x.reshape(-1)).reshape(x.shape)


def reference_direction(factors: Sequence[Tensor], x: Tensor, eps: float) -> Tensor:
    order = x.dim()
    eye = [torch.eye(f.shape[0], dtype=torch.float64) for f in factors]
    roots = [newton_inverse_root(f + eps * e, 2 * order) for f, e in zip(factors, eye)]
    return kron_apply(roots, x.double())


def block_views(t: Tensor, max_dim: int) -> list[Tensor]:
    """The blocks of ``t`` (copies), via blocking's public description."""
    specs = block_param("x", tuple(t.shape), max_dim)
    return [t.reshape(s.merged_shape)[s.slices].clone() for s in specs]


def run_steps(opt: torch.optim.Optimizer, params: Sequence[Tensor],
              grads: Sequence[Sequence[Tensor]]) -> list[list[Tensor]]:
    """Apply given gradients step by step; return each step's parameter change."""
    deltas = []
    for step_grads in grads:
        before = [p.detach().clone() for p in params]
        for p, g in zip(params, step_grads):
            p.grad = g.clone()
        opt.step()
        deltas.append([p.detach() - b for p, b in zip(params, before)])
    return deltas


def make_params(shapes: Sequence[tuple[int, ...]], dtype: torch.dtype = torch.float64,
                seed: int = 0) -> list[nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(s, generator=g, dtype=dtype)) for s in shapes]


def random_grads(shapes: Sequence[tuple[int, ...]], steps: int, seed: int = 1,
                 dtype: torch.dtype = torch.float64) -> list[list[Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(s, generator=g, dtype=dtype) for s in shapes] for _ in range(steps)]


# 2-D (6x10 → 2x3 blocks), 1-D (10 → 4+4+2), 3-D (4x5x6 → 4 blocks, one with a size-1 side)
SHAPES = [(6, 10), (10,), (4, 5, 6)]
MAX_DIM = 4


def test_blocks_of_reference_shapes() -> None:
    """The reference tests really exercise several blocks of orders 1, 2 and 3."""
    counts = [len(block_param("x", s, MAX_DIM)) for s in SHAPES]
    assert counts == [6, 3, 4]
    orders = {b.order for s in SHAPES for b in block_param("x", s, MAX_DIM)}
    assert orders == {1, 2, 3}


def test_one_step_equals_dense_reference() -> None:
    eps, lr = 1e-4, 0.1
    params = make_params(SHAPES)
    opt = DistributedShampoo(params, lr=lr, betas=(0.0, 1.0), epsilon=eps, grafting=None,
                             max_preconditioner_dim=MAX_DIM, **F64)
    grads = random_grads(SHAPES, 1)
    (deltas,) = run_steps(opt, params, grads)
    for g, delta in zip(grads[0], deltas):
        for gb, db in zip(block_views(g, MAX_DIM), block_views(delta, MAX_DIM)):
            factors = [mode_factor(gb, i) for i in range(gb.dim())]
            expected = -lr * reference_direction(factors, gb, eps)
            torch.testing.assert_close(db, expected, rtol=1e-8, atol=1e-12)


def test_matrix_and_vector_formulas() -> None:
    """The issue's closed forms: −lr·(GGᵀ+εI)^(−1/4) G (GᵀG+εI)^(−1/4) and (ggᵀ+εI)^(−1/2) g.

    ``max_preconditioner_dim=4`` keeps the 3x4 matrix 2-D (3·4 > 4: no merging)."""
    eps, lr = 1e-3, 0.5
    w, b = make_params([(3, 4), (4,)], seed=3)
    opt = DistributedShampoo([w, b], lr=lr, betas=(0.0, 1.0), epsilon=eps, grafting=None,
                             max_preconditioner_dim=4, **F64)
    gen = torch.Generator().manual_seed(4)
    gw, gb = torch.randn(3, 4, generator=gen, dtype=torch.float64), torch.randn(4, generator=gen,
                                                                               dtype=torch.float64)
    (dw, db), = run_steps(opt, [w, b], [[gw, gb]])
    left = newton_inverse_root(gw @ gw.T + eps * torch.eye(3, dtype=torch.float64), 4)
    right = newton_inverse_root(gw.T @ gw + eps * torch.eye(4, dtype=torch.float64), 4)
    torch.testing.assert_close(dw, -lr * left @ gw @ right, rtol=1e-9, atol=1e-13)
    vec = newton_inverse_root(torch.outer(gb, gb) + eps * torch.eye(4, dtype=torch.float64), 2)
    torch.testing.assert_close(db, -lr * vec @ gb, rtol=1e-9, atol=1e-13)


def test_running_averages_and_bias_correction() -> None:
    """Three steps with β1, β2 < 1 and bias correction against the closed-form sums."""
    eps, lr, b1, b2 = 1e-4, 0.05, 0.8, 0.9
    params = make_params(SHAPES)
    opt = DistributedShampoo(params, lr=lr, betas=(b1, b2), epsilon=eps, grafting=None,
                             max_preconditioner_dim=MAX_DIM, **F64)
    grads = random_grads(SHAPES, 3, seed=7)
    deltas = run_steps(opt, params, grads)
    for step in range(1, 4):
        for k in range(len(SHAPES)):
            history = [block_views(grads[t][k], MAX_DIM) for t in range(step)]
            got = block_views(deltas[step - 1][k], MAX_DIM)
            for j, db in enumerate(got):
                blocks = [h[j] for h in history]
                factors = [
                    sum((1 - b2) * b2 ** (step - 1 - t) * mode_factor(blocks[t], i)
                        for t in range(step)) / (1 - b2**step)
                    for i in range(blocks[0].dim())
                ]
                m_hat = sum((1 - b1) * b1 ** (step - 1 - t) * blocks[t]
                            for t in range(step)) / (1 - b1**step)
                expected = -lr * reference_direction(factors, m_hat, eps)
                torch.testing.assert_close(db, expected, rtol=1e-8, atol=1e-12)


def test_precondition_frequency_reuses_roots() -> None:
    """Roots computed at steps 2 and 5 (start 2, every 3); steps 3-4 reuse step 2's roots."""
    eps, lr = 1e-4, 0.1
    params = make_params([(3, 4)])
    opt = DistributedShampoo(params, lr=lr, betas=(0.0, 1.0), epsilon=eps, grafting="sgd",
                             start_preconditioning_step=2, precondition_frequency=3,
                             max_preconditioner_dim=4, **F64)
    grads = random_grads([(3, 4)], 5, seed=11)
    deltas = run_steps(opt, params, grads)
    gs = [g[0] for g in grads]
    torch.testing.assert_close(deltas[0][0], -lr * gs[0])  # before start: SGD grafting alone

    def shampoo(step_of_roots: int, g: Tensor) -> Tensor:
        factors = [sum(mode_factor(x, i) for x in gs[:step_of_roots]) for i in range(2)]
        direction = reference_direction(factors, g, eps)
        return -lr * direction * (g.norm() / direction.norm())  # SGD grafting: ‖g‖

    for step, root_step in [(2, 2), (3, 2), (4, 2), (5, 5)]:
        torch.testing.assert_close(deltas[step - 1][0], shampoo(root_step, gs[step - 1]),
                                   rtol=1e-8, atol=1e-12)


def test_grafting_rescales_each_block() -> None:
    """After start: each block's step has the Adam direction's norm, Shampoo's direction."""
    eps, lr, geps = 1e-4, 0.1, 1e-8
    params = make_params([(6, 10)])
    opt = DistributedShampoo(params, lr=lr, betas=(0.0, 1.0), epsilon=eps, grafting="adam",
                             grafting_epsilon=geps, max_preconditioner_dim=MAX_DIM, **F64)
    grads = random_grads([(6, 10)], 1, seed=5)
    (deltas,) = run_steps(opt, params, grads)
    block_norms = []
    for gb, db in zip(block_views(grads[0][0], MAX_DIM), block_views(deltas[0], MAX_DIM)):
        shampoo = reference_direction([mode_factor(gb, i) for i in range(2)], gb, eps)
        adam = gb / (gb.abs() + geps)  # v̂ = g² after one step with bias correction
        expected = -lr * shampoo * (adam.norm() / shampoo.norm())
        torch.testing.assert_close(db, expected, rtol=1e-8, atol=1e-12)
        block_norms.append(db.norm().item())
    # Per-block (not per-parameter) grafting: the norms follow each block's size.
    assert len(set(round(n, 9) for n in block_norms)) > 1


# -------------------------------------------------- equivalence with torch optimizers
def mlp(dtype: torch.dtype = torch.float64) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).to(dtype)


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: int = 8) -> None:
    gen = torch.Generator().manual_seed(42)
    dtype = next(model.parameters()).dtype
    for _ in range(steps):
        x = torch.randn(16, 5, generator=gen, dtype=dtype)
        y = torch.randn(16, 3, generator=gen, dtype=dtype)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def assert_same_training(make_ours: Callable[[nn.Module], torch.optim.Optimizer],
                         make_torch: Callable[[nn.Module], torch.optim.Optimizer],
                         dtype: torch.dtype = torch.float64, rtol: float = 1e-10,
                         atol: float = 1e-12) -> None:
    ours, theirs = mlp(dtype), mlp(dtype)
    train(ours, make_ours(ours))
    train(theirs, make_torch(theirs))
    for (name, a), b in zip(ours.named_parameters(), theirs.parameters()):
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol, msg=name)
    assert any(not torch.equal(a, b) for a, b in zip(ours.parameters(), mlp(dtype).parameters()))


NEVER = 10**9  # start_preconditioning_step beyond the run


@pytest.mark.parametrize("weight_decay", [0.0, 0.05])
def test_adam_grafting_alone_is_adam(weight_decay: float) -> None:
    assert_same_training(
        lambda m: DistributedShampoo(m.named_parameters(), lr=0.01, betas=(0.9, 0.999),
                                     grafting="adam", grafting_beta2=0.999,
                                     grafting_epsilon=1e-8, weight_decay=weight_decay,
                                     decoupled_weight_decay=False, max_preconditioner_dim=4,
                                     start_preconditioning_step=NEVER, **F64),
        lambda m: torch.optim.Adam(m.parameters(), lr=0.01, betas=(0.9, 0.999), eps=1e-8,
                                   weight_decay=weight_decay, foreach=False))


def test_adam_grafting_with_decoupled_decay_is_adamw() -> None:
    assert_same_training(
        lambda m: DistributedShampoo(m.parameters(), lr=0.01, betas=(0.8, 0.99),
                                     grafting="adam", grafting_beta2=0.99, weight_decay=0.1,
                                     decoupled_weight_decay=True,
                                     start_preconditioning_step=NEVER, **F64),
        lambda m: torch.optim.AdamW(m.parameters(), lr=0.01, betas=(0.8, 0.99), eps=1e-8,
                                    weight_decay=0.1, foreach=False))


def test_defaults_in_float32_match_adam() -> None:
    assert_same_training(
        lambda m: DistributedShampoo(m.parameters(), lr=0.01, start_preconditioning_step=NEVER),
        lambda m: torch.optim.Adam(m.parameters(), lr=0.01, foreach=False),
        dtype=torch.float32, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("momentum,nesterov", [(0.0, False), (0.9, False), (0.9, True)])
@pytest.mark.parametrize("decoupled", [True, False])
def test_sgd_grafting_alone_is_sgd(momentum: float, nesterov: bool, decoupled: bool) -> None:
    assert_same_training(
        lambda m: DistributedShampoo(m.parameters(), lr=0.05, betas=(0.0, 1.0), grafting="sgd",
                                     momentum=momentum, nesterov=nesterov, weight_decay=0.01,
                                     decoupled_weight_decay=decoupled,
                                     start_preconditioning_step=NEVER, **F64),
        lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=momentum, nesterov=nesterov,
                                  weight_decay=0.01, foreach=False))


def test_adagrad_and_rmsprop_grafting() -> None:
    assert_same_training(
        lambda m: DistributedShampoo(m.parameters(), lr=0.05, betas=(0.0, 1.0),
                                     grafting="adagrad", grafting_epsilon=1e-10,
                                     start_preconditioning_step=NEVER, **F64),
        lambda m: torch.optim.Adagrad(m.parameters(), lr=0.05, eps=1e-10, foreach=False))
    assert_same_training(
        lambda m: DistributedShampoo(m.parameters(), lr=0.01, betas=(0.0, 1.0),
                                     grafting="rmsprop", grafting_beta2=0.9,
                                     grafting_epsilon=1e-8, start_preconditioning_step=NEVER,
                                     **F64),
        lambda m: torch.optim.RMSprop(m.parameters(), lr=0.01, alpha=0.9, eps=1e-8,
                                      foreach=False))


# ------------------------------------------------------------------ API
def test_names_from_named_parameters_and_positions() -> None:
    model = mlp()
    named = DistributedShampoo(model.named_parameters(), max_preconditioner_dim=4)
    assert {n for n, _ in named.block_owners()} == {"0.weight", "0.bias", "2.weight", "2.bias"}
    groups = [{"params": [model[0].weight, model[0].bias]},
              {"params": [model[2].weight, model[2].bias], "lr": 0.5}]
    plain = DistributedShampoo(groups)
    assert sorted({n for n, _ in plain.block_owners()}) == [f"param_{i}" for i in range(4)]
    assert [g["lr"] for g in plain.param_groups] == [1e-3, 0.5]
    assert plain.state_dict()["param_groups"][1]["params"] == ["param_2", "param_3"]


def test_param_groups_use_their_own_hyperparameters() -> None:
    model = mlp()
    opt = DistributedShampoo([{"params": model[0].parameters(), "lr": 0.0},
                              {"params": model[2].parameters()}], lr=0.1)
    before = copy.deepcopy(model)
    train(model, opt, steps=1)
    assert all(torch.equal(a, b) for a, b in zip(model[0].parameters(), before[0].parameters()))
    assert not torch.equal(model[2].weight, before[2].weight)


def test_closure_and_missing_gradients() -> None:
    params = make_params([(3, 4), (4,)])
    opt = DistributedShampoo(params, lr=0.1)
    before = [p.detach().clone() for p in params]
    assert opt.step() is None  # no gradients at all: nothing changes
    assert all(torch.equal(p, b) for p, b in zip(params, before))
    assert opt.memory_bytes()["factors"] == 0

    def closure() -> float:
        opt.zero_grad()
        loss = (params[0] ** 2).sum()  # params[1] gets no gradient
        loss.backward()
        return float(loss.detach())

    assert opt.step(closure) == pytest.approx(float((before[0] ** 2).sum()))
    assert params[1].grad is None and torch.equal(params[1], before[1])
    assert not torch.equal(params[0], before[0])
    assert set(opt.state_dict()["state"]) == {"param_0"}


def test_non_contiguous_parameter_gets_the_same_update() -> None:
    torch.manual_seed(0)
    conv = nn.Conv2d(3, 5, 3).double()
    twin = copy.deepcopy(conv)
    conv = conv.to(memory_format=torch.channels_last)
    assert not conv.weight.is_contiguous()
    grads = random_grads([tuple(conv.weight.shape)], 3)
    for module in (conv, twin):
        opt = DistributedShampoo([module.weight], lr=0.1, max_preconditioner_dim=4, **F64)
        run_steps(opt, [module.weight], grads)
    torch.testing.assert_close(conv.weight, twin.weight, rtol=0, atol=0)


def test_add_param_group_keeps_state() -> None:
    model = mlp()
    opt = DistributedShampoo(model[0].named_parameters(prefix="0"), lr=0.01)
    train(model, opt, steps=2)
    before = opt.state_dict()["state"]
    opt.add_param_group({"params": list(model[2].named_parameters(prefix="2"))})
    after = opt.state_dict()["state"]
    assert set(after) == set(before)
    for name, blocks in before.items():
        for index, state in blocks.items():
            assert torch.equal(after[name][index]["factor_0"], state["factor_0"])
    train(model, opt, steps=1)
    assert "2.weight" in opt.state_dict()["state"]


def test_blocking_set_on_a_group_later_keeps_its_blocks() -> None:
    """``max_preconditioner_dim`` and ``merge_dims_from`` are read as a group is added:
    set on it later, a rebuild (another group added) keeps its blocks and their state,
    and the next step runs (it re-blocked the group and installed 16x16 state into
    40-row blocks before)."""
    model = mlp()
    opt = DistributedShampoo(model[0].named_parameters(prefix="0"), lr=0.01,
                             max_preconditioner_dim=64)
    train(model, opt, steps=2)
    blocks = list(opt.layout.blocks)
    opt.param_groups[0]["max_preconditioner_dim"] = 4
    opt.param_groups[0]["merge_dims_from"] = "first"
    opt.add_param_group({"params": list(model[2].named_parameters(prefix="2"))})
    assert [b for b in opt.layout.blocks if b.param_name.startswith("0.")] == blocks
    train(model, opt, steps=1)
    assert "2.weight" in opt.state_dict()["state"]


def test_a_refused_state_dict_changes_no_group() -> None:
    """Group 1 of the saved dict holds an invalid beta: the load raises, and group 0's
    learning rate (valid, saved as 0.5) is not changed either."""
    model = mlp()
    opt = DistributedShampoo(model[0].named_parameters(prefix="0"), lr=0.01)
    opt.add_param_group({"params": list(model[2].named_parameters(prefix="2"))})
    train(model, opt, steps=1)
    sd = opt.state_dict()
    sd["param_groups"][0]["lr"] = 0.5
    sd["param_groups"][1]["betas"] = (0.9, 1.5)
    with pytest.raises(ValueError, match="betas"):
        opt.load_state_dict(sd)
    assert opt.param_groups[0]["lr"] == 0.01


def test_bfloat16_communication_rounds_the_update() -> None:
    """One step: the bf16 update is the fp32 update rounded to bf16 (relative error ≤ 2⁻⁹)."""
    a, b = mlp(torch.float32), mlp(torch.float32)
    start = [p.detach().clone() for p in a.parameters()]
    train(a, DistributedShampoo(a.parameters(), lr=0.01, communication_dtype=torch.bfloat16), 1)
    train(b, DistributedShampoo(b.parameters(), lr=0.01), 1)
    for x, y, s in zip(a.parameters(), b.parameters(), start):
        torch.testing.assert_close(x - s, y - s, rtol=2**-8, atol=1e-6)
        assert not torch.equal(x, y)


# ------------------------------------------------------------- state dict
def test_state_dict_round_trip_continues_identically() -> None:
    kwargs = dict(lr=0.01, momentum=0.9, precondition_frequency=3, max_preconditioner_dim=4,
                  weight_decay=0.01)
    model = mlp(torch.float32)
    opt = DistributedShampoo(model.named_parameters(), **kwargs)  # type: ignore[arg-type]
    train(model, opt, steps=4)
    sd = opt.state_dict()
    assert sd["format"] == "kfac_hpc.shampoo"
    some_block = sd["state"]["0.weight"][0]
    assert {"step", "factor_0", "factor_1", "root_0", "root_1", "second_moment",
            "filtered_grad", "momentum_buffer", "root_failures"} <= set(some_block)
    assert some_block["step"] == 4

    twin = copy.deepcopy(model)
    opt2 = DistributedShampoo(twin.named_parameters(), lr=1.0,  # lr is restored from sd
                              max_preconditioner_dim=4)
    opt2.load_state_dict(sd)
    assert opt2.param_groups[0]["lr"] == 0.01
    sd["state"]["0.weight"][0]["factor_0"].fill_(1e9)  # loaded state is a copy
    train(model, opt, steps=3)
    train(twin, opt2, steps=3)
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.equal(a, b)


def test_load_accepts_a_file_round_trip_form() -> None:
    """String ``block_<i>`` keys, numpy arrays and numpy scalars (what HDF5 gives back)."""
    model = mlp(torch.float32)
    opt = DistributedShampoo(model.named_parameters(), lr=0.01, max_preconditioner_dim=4)
    train(model, opt, steps=2)
    sd = opt.state_dict()
    sd["state"] = {name: {f"block_{i}": {k: (v.numpy() if isinstance(v, Tensor) else np.int64(v))
                                         for k, v in block.items()}
                          for i, block in blocks.items()}
                   for name, blocks in sd["state"].items()}
    twin = copy.deepcopy(model)
    opt2 = DistributedShampoo(twin.named_parameters(), lr=0.01, max_preconditioner_dim=4)
    opt2.load_state_dict(sd)
    train(model, opt, steps=2)
    train(twin, opt2, steps=2)
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.equal(a, b)


def test_load_state_dict_rejects_mismatches() -> None:
    model = mlp()
    opt = DistributedShampoo(model.named_parameters(), max_preconditioner_dim=4)
    train(model, opt, steps=1)
    sd = opt.state_dict()
    other = DistributedShampoo(mlp().named_parameters(), max_preconditioner_dim=5)
    with pytest.raises(ValueError, match="split into blocks"):
        other.load_state_dict(sd)
    renamed = DistributedShampoo(mlp().parameters(), max_preconditioner_dim=4)
    with pytest.raises(ValueError, match=r"missing .*param_0"):
        renamed.load_state_dict(sd)
    with pytest.raises(ValueError, match="not a DistributedShampoo state dict"):
        opt.load_state_dict(torch.optim.Adam(model.parameters()).state_dict())


def conv_model() -> nn.Module:
    """Two convolutions whose weights merge differently from the last and the first dim."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.Tanh(), nn.Conv2d(4, 4, 3), nn.Flatten())


def train_conv(model: nn.Module, opt: DistributedShampoo, steps: int) -> None:
    g = torch.Generator().manual_seed(5)
    for _ in range(steps):
        x = torch.randn(6, 3, 7, 7, generator=g)
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()


def test_blocks_merge_from_the_last_dimension_unless_told() -> None:
    model = conv_model()
    last = DistributedShampoo(model.named_parameters(), max_preconditioner_dim=36)
    first = DistributedShampoo(model.named_parameters(), max_preconditioner_dim=36,
                               merge_dims_from="first")
    assert last.state_dict()["blocks"]["2.weight"]["merged_shape"] == [4, 36]
    assert first.state_dict()["blocks"]["2.weight"]["merged_shape"] == [16, 9]
    with pytest.raises(ValueError, match="invalid merge_dims_from='middle'; allowed: 'last' "
                                         "or 'first'"):
        DistributedShampoo(model.parameters(), merge_dims_from="middle")  # type: ignore[arg-type]


@pytest.mark.parametrize("without_the_key", [False, True], ids=["saved", "older-dict"])
def test_a_state_saved_with_the_other_merge_order_names_the_setting(without_the_key: bool
                                                                      ) -> None:
    """A state dict merged from the first dimension (every dict saved before the option
    had no key for it) does not load into the default; the error names the setting that
    does, and with it the run continues as the saving one."""
    model = conv_model()
    opt = DistributedShampoo(model.named_parameters(), lr=0.01, max_preconditioner_dim=36,
                             precondition_frequency=2, merge_dims_from="first")
    train_conv(model, opt, 3)
    sd = opt.state_dict()
    if without_the_key:
        for group in sd["param_groups"]:
            del group["merge_dims_from"]
    twin = copy.deepcopy(model)
    default = DistributedShampoo(twin.named_parameters(), lr=0.01, max_preconditioner_dim=36)
    with pytest.raises(ValueError, match=r"'0\.weight' was split into blocks \[\[36, 3\]\] "
                                         r"\(merged shape \[36, 3\]\) but is split into "
                                         r"\[\[4, 27\]\] here \(merged shape \[4, 27\]\); "
                                         r"it was saved with max_preconditioner_dim=36, "
                                         r"merge_dims_from='first': build DistributedShampoo "
                                         r"with those to load it \(kfac-hpc train: "
                                         r"--shampoo-options max_preconditioner_dim=36,"
                                         r"merge_dims_from=first\)"):
        default.load_state_dict(sd)
    resumed = DistributedShampoo(twin.named_parameters(), lr=0.01, max_preconditioner_dim=36,
                                 merge_dims_from="first")
    resumed.load_state_dict(sd)
    assert resumed.param_groups[0]["merge_dims_from"] == "first"
    train_conv(model, opt, 3)
    train_conv(twin, resumed, 3)
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.equal(a, b)


def test_the_message_names_the_saved_merge_order_where_both_would_fit() -> None:
    """A 2-D weight is blocked alike from either end; the message then names the order
    the state was saved with, which fits the other parameters too."""
    torch.manual_seed(0)
    model = nn.Linear(40, 50)
    opt = DistributedShampoo(model.named_parameters(), max_preconditioner_dim=36,
                             merge_dims_from="first")
    model(torch.randn(8, 40)).square().mean().backward()
    opt.step()
    sd = opt.state_dict()
    other = DistributedShampoo(copy.deepcopy(model).named_parameters(),
                               max_preconditioner_dim=64)
    with pytest.raises(ValueError, match=r"'weight' .* saved with max_preconditioner_dim=36, "
                                         r"merge_dims_from='first'"):
        other.load_state_dict(sd)


# ------------------------------------------------------------- failures
def test_nan_gradient_names_parameter_and_block() -> None:
    model = mlp(torch.float32)
    opt = DistributedShampoo(model.named_parameters(), max_preconditioner_dim=4)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    model[2].weight.grad[1, 5] = math.nan  # merged (3, 7): block grid 1x2 → block 1
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ShampooNumericalError, match=r"'2\.weight' block 1") as info:
        opt.step()
    assert info.value.blocks == [("2.weight", 1)]
    assert "statistics" in str(info.value)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


def test_overflowing_statistics_are_an_error() -> None:
    (p,) = make_params([(4, 4)], dtype=torch.float32)
    opt = DistributedShampoo([p], start_preconditioning_step=NEVER)
    p.grad = torch.full_like(p, 1e30)  # finite gradient, (1e30)² overflows float32
    with pytest.raises(ShampooNumericalError, match="param_0' block 0"):
        opt.step()


def _failing_eigh(real: Callable[..., tuple[Tensor, Tensor]],
                  fail_dtypes: tuple[torch.dtype, ...]) -> Callable[..., tuple[Tensor, Tensor]]:
    def eigh(a: Tensor, *args: object, **kwargs: object) -> tuple[Tensor, Tensor]:
        if a.dtype in fail_dtypes:
            raise torch.linalg.LinAlgError("injected failure")
        return real(a, *args, **kwargs)
    return eigh


def test_root_failure_retries_in_float64(monkeypatch: pytest.MonkeyPatch) -> None:
    grads = random_grads([(3, 4)], 2, dtype=torch.float32)
    results = []
    for fail in [(), (torch.float32,)]:
        (p,) = make_params([(3, 4)], dtype=torch.float32)
        opt = DistributedShampoo([p], lr=0.1, betas=(0.0, 1.0), epsilon=1e-3, grafting=None)
        with monkeypatch.context() as m:
            m.setattr(torch.linalg, "eigh", _failing_eigh(torch.linalg.eigh, fail))
            run_steps(opt, [p], grads)
        results.append(p.detach().clone())
    torch.testing.assert_close(results[0], results[1], rtol=1e-5, atol=1e-6)  # fp32 vs fp64 roots


def test_root_failures_keep_previous_root_then_raise(monkeypatch: pytest.MonkeyPatch) -> None:
    (p,) = make_params([(3, 4)], dtype=torch.float32)
    opt = DistributedShampoo([p], lr=0.1, max_consecutive_root_failures=3)
    grads = random_grads([(3, 4)], 5, dtype=torch.float32)
    run_steps(opt, [p], grads[:1])
    root = opt.state_dict()["state"]["param_0"][0]["root_0"]
    with monkeypatch.context() as m:
        m.setattr(torch.linalg, "eigh", _failing_eigh(torch.linalg.eigh,
                                                      (torch.float32, torch.float64)))
        run_steps(opt, [p], grads[1:3])  # failures 1 and 2: tolerated
        block = opt.state_dict()["state"]["param_0"][0]
        assert block["root_failures"] == 2 and torch.equal(block["root_0"], root)
        with pytest.raises(ShampooNumericalError, match="eigendecompositions"):
            run_steps(opt, [p], grads[3:4])
    run_steps(opt, [p], grads[4:5])  # decompositions work again: counter resets
    assert opt.state_dict()["state"]["param_0"][0]["root_failures"] == 0


def test_first_root_failure_falls_back_to_identity(monkeypatch: pytest.MonkeyPatch) -> None:
    """No previous root: the identity, so the step is the grafting-norm-scaled gradient."""
    (p,) = make_params([(3, 4)])
    opt = DistributedShampoo([p], lr=0.1, betas=(0.0, 1.0), grafting="sgd",
                             max_preconditioner_dim=4, **F64)
    grads = random_grads([(3, 4)], 1)
    with monkeypatch.context() as m:
        m.setattr(torch.linalg, "eigh", _failing_eigh(torch.linalg.eigh, (torch.float64,)))
        (delta,), = run_steps(opt, [p], grads)
    torch.testing.assert_close(delta, -0.1 * grads[0][0])


# ------------------------------------------------------------- validation
@pytest.mark.parametrize("kwargs,name", [
    (dict(lr=-1.0), "lr"), (dict(lr="big"), "lr"), (dict(betas=(1.0, 0.9)), "betas[0]"),
    (dict(betas=(0.9, 1.5)), "betas[1]"), (dict(betas=0.9), "betas"),
    (dict(epsilon=0.0), "epsilon"),
    (dict(momentum=1.0), "momentum"), (dict(nesterov=True), "nesterov"),
    (dict(nesterov=1, momentum=0.9), "nesterov"), (dict(weight_decay=-0.1), "weight_decay"),
    (dict(decoupled_weight_decay="yes"), "decoupled_weight_decay"),
    (dict(max_preconditioner_dim=0), "max_preconditioner_dim"),
    (dict(max_preconditioner_dim=2.5), "max_preconditioner_dim"),
    (dict(precondition_frequency=0), "precondition_frequency"),
    (dict(start_preconditioning_step=0), "start_preconditioning_step"),
    (dict(start_preconditioning_step=True), "start_preconditioning_step"),
    (dict(grafting="lamb"), "grafting"), (dict(grafting_epsilon=-1.0), "grafting_epsilon"),
    (dict(grafting_beta2=1.0), "grafting_beta2"), (dict(use_bias_correction=None),
                                                   "use_bias_correction"),
    (dict(comm="world"), "comm"), (dict(factor_dtype=torch.float16), "factor_dtype"),
    (dict(communication_dtype=torch.int32), "communication_dtype"),
    (dict(max_consecutive_root_failures=0), "max_consecutive_root_failures"),
])
def test_invalid_options_are_named(kwargs: dict[str, object], name: str) -> None:
    with pytest.raises(ValueError, match=rf"invalid {name.replace('[', '.').replace(']', '.')}="):
        DistributedShampoo(make_params([(2, 2)]), **kwargs)  # type: ignore[arg-type]


def test_invalid_group_option_and_duplicate_names() -> None:
    a, b = make_params([(2, 2), (2,)])
    with pytest.raises(ValueError, match="invalid momentum=2"):
        DistributedShampoo([{"params": [a]}, {"params": [b], "momentum": 2}])
    with pytest.raises(ValueError, match="'w' appears twice"):
        DistributedShampoo([{"params": [("w", a)]}, {"params": [("w", b)]}])
    with pytest.raises(ValueError, match="floating-point"):
        DistributedShampoo([torch.zeros(3, dtype=torch.int64)])


@pytest.mark.gpu
def test_cuda_matches_cpu() -> None:
    """The same float64 run on CUDA and on the CPU (single rank): equal to 1e-10."""
    results = []
    for device in ("cpu", "cuda"):
        model = mlp().to(device)
        opt = DistributedShampoo(model.named_parameters(), lr=0.01, max_preconditioner_dim=4,
                                 momentum=0.9, **F64)
        gen = torch.Generator().manual_seed(42)
        for _ in range(4):
            x = torch.randn(16, 5, generator=gen, dtype=torch.float64).to(device)
            y = torch.randn(16, 3, generator=gen, dtype=torch.float64).to(device)
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        sd = opt.state_dict()
        assert sd["state"]["0.weight"][0]["factor_0"].device.type == "cpu"
        results.append([p.detach().cpu() for p in model.parameters()])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
