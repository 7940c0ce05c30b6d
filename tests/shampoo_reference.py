"""The block-by-block Shampoo step as it was before batching (one rank, finite runs).

A frozen oracle for ``tests/test_shampoo_batched.py``: every block is updated on its
own with the operations, in the order, of the former ``kfac_hpc.shampoo.block_update``
(factor products then ``mul_``/``add_``, one ``mm``/``mv``/``tensordot`` per root, one
``eigh`` per factor, grafting and momentum per block), then applied through
``communication_dtype`` as the former gather did. Failure handling is left out: the
runs compared are finite.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from kfac_hpc.shampoo.blocking import block_param


def _factor_statistics(block: Tensor) -> list[Tensor]:
    out = []
    for i, d in enumerate(block.shape):
        x = block.movedim(i, 0).reshape(d, -1)
        out.append(x @ x.mT)
    return out


def _precondition(block: Tensor, roots: list[Tensor]) -> Tensor:
    if block.dim() == 1:
        return roots[0] @ block
    if block.dim() == 2:
        return roots[0] @ block @ roots[1].mT
    out = block
    for root in roots:
        out = torch.tensordot(out, root, dims=([0], [1]))
    return out


def _inverse_root(matrix: Tensor, p: float, epsilon: float) -> Tensor:
    eigenvalues, eigenvectors = torch.linalg.eigh(matrix)
    scale = (eigenvalues.clamp(min=0) + epsilon).pow(-1.0 / p)
    return (eigenvectors * scale.unsqueeze(0)) @ eigenvectors.mT


def _graft_direction(kind: str | None, filtered: Tensor, moment: Tensor | None,
                     hp: dict[str, Any], t: int) -> Tensor:
    if kind not in ("adagrad", "rmsprop", "adam"):
        return filtered
    assert moment is not None
    denom = moment.sqrt()
    if kind == "adam" and hp["use_bias_correction"]:
        denom.div_(math.sqrt(1.0 - hp["grafting_beta2"]**t))
    return filtered / denom.add_(hp["grafting_epsilon"])


def _norm_ratio(target: Tensor, source: Tensor) -> Tensor:
    target_norm = torch.linalg.vector_norm(target)
    source_norm = torch.linalg.vector_norm(source)
    safe = torch.where(source_norm > 0, source_norm, torch.ones_like(source_norm))
    return torch.where(source_norm > 0, target_norm / safe, torch.zeros_like(source_norm))


def _buffer(state: dict[str, Any], key: str, like: Tensor) -> Tensor:
    if key not in state:
        state[key] = torch.zeros_like(like, memory_format=torch.contiguous_format)
    buf: Tensor = state[key]
    return buf


def _factors(state: dict[str, Any], grad: Tensor, hp: dict[str, Any],
             factor_dtype: torch.dtype) -> None:
    beta2 = hp["betas"][1]
    for i, stat in enumerate(_factor_statistics(grad.to(factor_dtype))):
        factor = state.setdefault(f"factor_{i}", torch.zeros_like(stat))
        if beta2 == 1.0:
            factor.add_(stat)
        else:
            factor.mul_(beta2).add_(stat, alpha=1.0 - beta2)


def _roots(state: dict[str, Any], order: int, hp: dict[str, Any]) -> None:
    t, beta2 = state["step"], hp["betas"][1]
    correction = 1.0 - beta2**t if hp["use_bias_correction"] and beta2 < 1.0 else 1.0
    for i in range(order):
        factor = state[f"factor_{i}"]
        matrix = factor / correction if correction != 1.0 else factor
        matrix = torch.nan_to_num(matrix, nan=0.0, posinf=0.0, neginf=0.0)
        state[f"root_{i}"] = _inverse_root(matrix, 2.0 * order, hp["epsilon"])


def update_block(state: dict[str, Any], grad: Tensor, param: Tensor, hp: dict[str, Any],
                 factor_dtype: torch.dtype) -> Tensor:
    """The former one-block step: the block's direction (parameter dtype)."""
    order, (beta1, _) = grad.dim(), hp["betas"]
    wd, kind = hp["weight_decay"], hp["grafting"]
    if wd != 0.0 and not hp["decoupled_weight_decay"]:
        grad = grad.add(param, alpha=wd)
    state["step"] = t = state.get("step", 0) + 1
    _factors(state, grad, hp, factor_dtype)
    moment = None
    if kind in ("adagrad", "rmsprop", "adam"):
        moment = _buffer(state, "second_moment", grad)
        if kind == "adagrad":
            moment.addcmul_(grad, grad)
        else:
            moment.mul_(hp["grafting_beta2"]).addcmul_(grad, grad, value=1.0 - hp["grafting_beta2"])
    filtered = grad
    if beta1 > 0.0:
        filtered = _buffer(state, "filtered_grad", grad).lerp_(grad, 1.0 - beta1)
        if hp["use_bias_correction"]:
            filtered = filtered / (1.0 - beta1**t)
    start, freq = hp["start_preconditioning_step"], hp["precondition_frequency"]
    if t >= start and ((t - start) % freq == 0 or "root_0" not in state):
        _roots(state, order, hp)
    if t >= start:
        roots = [state[f"root_{i}"] for i in range(order)]
        direction = _precondition(filtered.to(factor_dtype), roots).to(grad.dtype)
        if kind is not None:
            direction = direction * _norm_ratio(_graft_direction(kind, filtered, moment, hp, t),
                                                direction)
    else:
        direction = _graft_direction(kind, filtered, moment, hp, t)
    if wd != 0.0 and hp["decoupled_weight_decay"]:
        direction = direction.add(param, alpha=wd)
    if hp["momentum"] != 0.0:
        buf = _buffer(state, "momentum_buffer", grad)
        buf.mul_(hp["momentum"]).add_(direction)
        direction = direction.add(buf, alpha=hp["momentum"]) if hp["nesterov"] else buf
    return direction


class ReferenceShampoo:
    """One parameter group, one rank, block by block (the pre-batching algorithm)."""

    def __init__(self, params: list[torch.nn.Parameter], hp: dict[str, Any],
                 factor_dtype: torch.dtype, communication_dtype: torch.dtype) -> None:
        self.params = params
        self.hp = hp
        self.factor_dtype = factor_dtype
        self.communication_dtype = communication_dtype
        self.state: dict[tuple[int, int], dict[str, Any]] = {}

    @torch.no_grad()
    def step(self) -> None:
        """Every block's direction first, then every parameter's update (as the gather)."""
        updates = []
        for k, p in enumerate(self.params):
            if p.grad is None:
                continue
            for spec in block_param(str(k), tuple(p.shape), self.hp["max_preconditioner_dim"]):
                grad = p.grad.reshape(spec.merged_shape)[spec.slices]
                param = p.detach().reshape(spec.merged_shape)[spec.slices]
                state = self.state.setdefault((k, spec.index), {})
                direction = update_block(state, grad, param, self.hp, self.factor_dtype)
                updates.append((p, spec, direction.to(self.communication_dtype)))
        for p, spec, update in updates:
            target = p.view(spec.merged_shape)[spec.slices]
            target.add_(update.to(p.dtype), alpha=-self.hp["lr"])
