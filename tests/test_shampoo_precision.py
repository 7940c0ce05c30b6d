"""Shampoo's product precisions (``stats_precision``, ``precondition_precision``).

Off CUDA, ``"tf32"`` rounds every float32 operand to TF32 explicitly
(``kfac_hpc.kfac.precision.round_operand``) and multiplies in float32, so the products
are those of the rounded operands bit for bit; ``"full"`` (the default) is the code path
of before; float64 is never rounded. The factors of a TF32 run stay within TF32's
rounding of the full ones.
"""

from __future__ import annotations

import pytest
import torch
from mpi4py import MPI
from torch import nn

from kfac_hpc.comm import Communicator
from kfac_hpc.kfac.precision import round_operand
from kfac_hpc.shampoo import DistributedShampoo
from kfac_hpc.shampoo.kronecker import accumulate_factors, mode_matrices, precondition


def _tf32(t: torch.Tensor) -> torch.Tensor:
    return round_operand(t, "tf32")


@pytest.mark.parametrize("shape", [(3, 5, 7), (2, 4, 3, 6)], ids=["matrices", "order-3"])
def test_tf32_factor_products_are_those_of_rounded_blocks(shape):
    g = torch.Generator().manual_seed(0)
    blocks = torch.randn(*shape, generator=g)
    factors = [torch.eye(d).expand(shape[0], d, d).clone() for d in shape[1:]]
    expected = [f.clone() for f in factors]
    accumulate_factors(factors, blocks, 0.9, "tf32")
    rounded = _tf32(blocks)
    for i, f in enumerate(expected):
        x = mode_matrices(rounded, i)
        f.baddbmm_(x, x.mT, beta=0.9, alpha=0.1)
    for got, want in zip(factors, expected):
        assert torch.equal(got, want)
    assert not torch.equal(factors[0], _full_factors(blocks, shape)[0])  # TF32 rounded


def _full_factors(blocks: torch.Tensor, shape: tuple[int, ...]) -> list[torch.Tensor]:
    factors = [torch.eye(d).expand(shape[0], d, d).clone() for d in shape[1:]]
    accumulate_factors(factors, blocks, 0.9)
    return factors


@pytest.mark.parametrize("shape", [(3, 5, 7), (2, 4, 3, 6)], ids=["matrices", "order-3"])
def test_tf32_preconditioning_rounds_every_operand(shape):
    g = torch.Generator().manual_seed(1)
    blocks = torch.randn(*shape, generator=g)
    roots = [torch.randn(shape[0], d, d, generator=g) for d in shape[1:]]
    got = precondition(blocks, roots, "tf32")
    out, n = blocks, shape[0]
    for root in roots:  # the reference contraction, every operand rounded
        moved = _tf32(out).movedim(1, -1)
        out = (moved.reshape(n, -1, moved.shape[-1]) @ _tf32(root).mT).reshape(moved.shape)
    if len(roots) == 2:
        out = _tf32(_tf32(roots[0]) @ _tf32(blocks)) @ _tf32(roots[1]).mT
    assert torch.equal(got, out)
    full = precondition(blocks, roots, "full")
    if len(roots) == 2:  # the expression of before the option, bit for bit
        before = roots[0] @ blocks @ roots[1].mT
    else:
        before = blocks
        for root in roots:
            moved = before.movedim(1, -1)
            before = (moved.reshape(n, -1, moved.shape[-1]) @ root.mT).reshape(moved.shape)
    assert torch.equal(full, before)
    torch.testing.assert_close(got, full, rtol=0, atol=4 * 2.0**-11 * full.abs().max().item()
                               * shape[-1])


def test_float64_is_never_rounded():
    g = torch.Generator().manual_seed(2)
    blocks = torch.randn(3, 5, 7, generator=g, dtype=torch.float64)
    roots = [torch.randn(3, d, d, generator=g, dtype=torch.float64) for d in (5, 7)]
    assert torch.equal(precondition(blocks, roots, "tf32"), precondition(blocks, roots))
    a = [torch.zeros(3, d, d, dtype=torch.float64) for d in (5, 7)]
    b = [t.clone() for t in a]
    accumulate_factors(a, blocks, 0.5, "tf32")
    accumulate_factors(b, blocks, 0.5)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.Tanh(), nn.Flatten(), nn.Linear(8 * 36, 10))


def _train(steps: int = 4, **options: object) -> tuple[nn.Module, DistributedShampoo]:
    model = _model()
    opt = DistributedShampoo(model.named_parameters(), lr=0.01, betas=(0.9, 0.999),
                             epsilon=1e-8, precondition_frequency=2,
                             comm=Communicator(MPI.COMM_SELF), **options)  # type: ignore[arg-type]
    g = torch.Generator().manual_seed(3)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(4, 3, 8, 8, generator=g)).square().mean().backward()
        opt.step()
    return model, opt


def test_the_default_is_full_and_tf32_factors_stay_within_its_rounding():
    """The default is "full" (the same run bit for bit); TF32's first-step factors are
    within TF32's rounding of the full ones; the state dict carries the options."""
    default_model, _ = _train()
    full_model, _ = _train(stats_precision="full", precondition_precision="full")
    for p, q in zip(default_model.parameters(), full_model.parameters()):
        assert torch.equal(p, q)
    # the factors of the first step: the same weights and gradient (later steps follow
    # trajectories that the preconditioning's rounding has moved apart)
    _, tf32 = _train(steps=1, stats_precision="tf32", precondition_precision="tf32")
    reference = _train(steps=1)[1].state_dict()["state"]
    checked = 0
    for param, blocks in tf32.state_dict()["state"].items():
        for index, state in blocks.items():
            for name, value in state.items():
                if not name.startswith("factor_"):
                    continue
                # operands within 2⁻¹¹ relative each, the products of the same rows and
                # sums of squares on the diagonal: within a few 2⁻¹¹ of the factor's norm
                want = reference[param][index][name]
                err = ((value - want).norm() / want.norm()).item()
                assert 0 < err < 4 * 2.0**-11, f"{param}[{index}] {name}: {err}"
                checked += 1
    assert checked >= 4
    saved = tf32.state_dict()["param_groups"][0]
    assert saved["stats_precision"] == "tf32" and saved["precondition_precision"] == "tf32"
    _, fresh = _train(steps=0)
    fresh.load_state_dict(tf32.state_dict())
    assert fresh.param_groups[0]["stats_precision"] == "tf32"


def _first_step(**options: object) -> tuple[list[torch.Tensor], dict]:
    model, opt = _train(steps=1, **options)
    return [p.detach().clone() for p in model.parameters()], opt.state_dict()["state"]


def _factors(state: dict) -> list[torch.Tensor]:
    return [value for blocks in state.values() for block in blocks.values()
            for name, value in block.items() if name.startswith("factor_")]


def test_each_option_reaches_its_own_products():
    """``stats_precision`` alone changes the factors (and so the step); alone,
    ``precondition_precision`` leaves the factors bit for bit and changes the step."""
    params, state = _first_step()
    stats_params, stats_state = _first_step(stats_precision="tf32")
    pre_params, pre_state = _first_step(precondition_precision="tf32")
    assert any(not torch.equal(a, b) for a, b in zip(_factors(stats_state), _factors(state)))
    assert all(torch.equal(a, b) for a, b in zip(_factors(pre_state), _factors(state)))
    for changed in (stats_params, pre_params):
        assert any(not torch.equal(a, b) for a, b in zip(changed, params))


@pytest.mark.parametrize("option", ["stats_precision", "precondition_precision"])
@pytest.mark.parametrize("value", ["bf16", "TF32", None])
def test_other_precisions_are_refused_by_name(option, value):
    with pytest.raises(ValueError, match=option):
        DistributedShampoo(_model().named_parameters(), comm=Communicator(MPI.COMM_SELF),
                           **{option: value})  # type: ignore[arg-type]
