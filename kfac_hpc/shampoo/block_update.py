"""One Shampoo step of one block, on its owner: statistics, roots, grafting, momentum.

Order of operations (``t`` = the block's step, counted from 1):

1. coupled weight decay (``decoupled_weight_decay=False``): ``g ← g + wd·p``;
2. factors ``F_i ← β2·F_i + (1-β2)·X_(i)X_(i)ᵀ`` (``β2 = 1``: plain sum), in
   ``factor_dtype``; non-finite ⇒ a device flag that the optimizer turns into
   :data:`STATUS_NONFINITE_STATISTICS` (the step goes on: no host sync per block);
3. grafting second moment from ``g``;
4. β1 filtering ``m ← β1·m + (1-β1)·g``, ``m̂ = m / (1-β1^t)`` with bias correction
   (``β1 = 0``: ``m̂ = g``);
5. at ``t = start, start + freq, …``: roots ``(F̂_i + εI)^(-1/2k)`` with
   ``F̂_i = F_i / (1-β2^t)`` under bias correction (``β2 < 1``); a failure keeps the
   previous roots (identity before the first success) and counts; reaching
   ``max_consecutive_root_failures`` ⇒ :data:`STATUS_ROOT_FAILURES`;
6. direction: ``t >= start``: ``m̂ ×_1 R_1 … ×_k R_k`` rescaled to the grafting
   direction's norm (no rescaling without grafting); before: the grafting direction
   (``m̂`` for ``"sgd"`` or no grafting);
7. decoupled weight decay: ``d ← d + wd·p``;
8. momentum ``b ← μ·b + d``; ``d ← d + μ·b`` (Nesterov) or ``d ← b``.

The parameter update ``p ← p − lr·d`` happens on every rank after the gather.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from kfac_hpc.shampoo import grafting as graft
from kfac_hpc.shampoo.errors import STATUS_ROOT_FAILURES
from kfac_hpc.shampoo.kronecker import factor_statistics, precondition
from kfac_hpc.shampoo.roots import RootComputationError, inverse_root

__all__ = ["BlockHyper", "BlockState", "new_block_state", "update_block"]

BlockState = dict[str, Any]
"""Keys: ``step`` (int), ``factor_<i>``, ``root_<i>`` (after the first root
computation), ``root_failures`` (int, consecutive), and where used
``second_moment``, ``filtered_grad``, ``momentum_buffer``."""


@dataclass(frozen=True)
class BlockHyper:
    """The hyper-parameters of a parameter group that one block step reads."""

    beta1: float
    beta2: float
    epsilon: float
    momentum: float
    nesterov: bool
    weight_decay: float
    decoupled_weight_decay: bool
    precondition_frequency: int
    start_preconditioning_step: int
    grafting: str | None
    grafting_epsilon: float
    grafting_beta2: float
    use_bias_correction: bool
    max_consecutive_root_failures: int

    @staticmethod
    def from_group(group: dict[str, Any], max_consecutive_root_failures: int) -> BlockHyper:
        beta1, beta2 = group["betas"]
        return BlockHyper(
            float(beta1), float(beta2), group["epsilon"], group["momentum"], group["nesterov"],
            group["weight_decay"], group["decoupled_weight_decay"],
            group["precondition_frequency"], group["start_preconditioning_step"],
            group["grafting"], group["grafting_epsilon"], group["grafting_beta2"],
            group["use_bias_correction"], max_consecutive_root_failures)


def new_block_state(shape: tuple[int, ...], factor_dtype: torch.dtype,
                    device: torch.device) -> BlockState:
    """Fresh state: zero factors, no roots yet."""
    state: BlockState = {"step": 0, "root_failures": 0}
    for i, d in enumerate(shape):
        state[f"factor_{i}"] = torch.zeros(d, d, dtype=factor_dtype, device=device)
    return state


def _buffer(state: BlockState, key: str, like: Tensor) -> Tensor:
    buf = state.get(key)
    if buf is None:
        buf = state[key] = torch.zeros_like(like, memory_format=torch.contiguous_format)
    return buf


def _update_roots(state: BlockState, order: int, hp: BlockHyper) -> int:
    """Recompute the block's roots; returns status bits (0 on success or tolerated failure)."""
    t = state["step"]
    correction = 1.0 - hp.beta2**t if hp.use_bias_correction and hp.beta2 < 1.0 else 1.0
    roots = []
    try:
        for i in range(order):
            factor = state[f"factor_{i}"]
            matrix = factor / correction if correction != 1.0 else factor
            # Non-finite statistics fail this step anyway (reported by the caller's
            # flag, not known here without a host sync); the eigensolver must not see
            # them, so they are zeroed (a no-op on a finite factor).
            matrix = torch.nan_to_num(matrix, nan=0.0, posinf=0.0, neginf=0.0)
            roots.append(inverse_root(matrix, 2.0 * order, hp.epsilon))
    except RootComputationError:
        state["root_failures"] += 1
        for i in range(order):  # identity until a root has ever been computed
            if f"root_{i}" not in state:
                factor = state[f"factor_{i}"]
                state[f"root_{i}"] = torch.eye(factor.shape[0], dtype=factor.dtype,
                                               device=factor.device)
        if state["root_failures"] >= hp.max_consecutive_root_failures:
            return STATUS_ROOT_FAILURES
        return 0
    for i, root in enumerate(roots):
        state[f"root_{i}"] = root
    state["root_failures"] = 0
    return 0


def update_block(state: BlockState, grad: Tensor, param: Tensor,
                 hp: BlockHyper) -> tuple[Tensor, Tensor, int]:
    """Advance a block's state by one step: ``(direction, nonfinite_statistics, status)``.

    ``grad`` and ``param`` are the block's views (same shape). ``direction`` has the
    parameter's dtype; ``nonfinite_statistics`` is a 0-d bool tensor on the block's
    device, never read here (no host synchronisation: the caller gathers every
    block's flag into its status word); ``status`` holds the bits known on the host
    (:data:`STATUS_ROOT_FAILURES`). When the flag is set or the status is not 0 the
    direction is meaningless.
    """
    order = grad.dim()
    if hp.weight_decay != 0.0 and not hp.decoupled_weight_decay:
        grad = grad.add(param, alpha=hp.weight_decay)
    state["step"] += 1
    t = state["step"]

    factor_dtype = state["factor_0"].dtype
    for i, stat in enumerate(factor_statistics(grad.to(factor_dtype))):
        factor = state[f"factor_{i}"]
        if hp.beta2 == 1.0:
            factor.add_(stat)
        else:
            factor.mul_(hp.beta2).add_(stat, alpha=1.0 - hp.beta2)
    # A NaN/Inf anywhere in the gradient reaches the diagonal (a sum of squares), so
    # checking the diagonals is exact and costs O(d) instead of O(d²).
    diagonals = [state[f"factor_{i}"].diagonal() for i in range(order)]
    nonfinite = torch.cat(diagonals).isfinite().all().logical_not()

    second_moment = None
    if graft.uses_second_moment(hp.grafting):
        second_moment = _buffer(state, "second_moment", grad)
        graft.update_second_moment(hp.grafting, second_moment, grad, hp.grafting_beta2)

    filtered = grad
    if hp.beta1 > 0.0:
        filtered = _buffer(state, "filtered_grad", grad).lerp_(grad, 1.0 - hp.beta1)
        if hp.use_bias_correction:
            filtered = filtered / (1.0 - hp.beta1**t)

    status = 0
    start, freq = hp.start_preconditioning_step, hp.precondition_frequency
    if t >= start and ((t - start) % freq == 0 or "root_0" not in state):
        status = _update_roots(state, order, hp)

    def grafting_direction() -> Tensor:
        return graft.direction(hp.grafting, filtered, second_moment, hp.grafting_epsilon,
                               hp.grafting_beta2, t, hp.use_bias_correction)

    if t >= start:
        roots = [state[f"root_{i}"] for i in range(order)]
        direction = precondition(filtered.to(factor_dtype), roots).to(grad.dtype)
        if hp.grafting is not None:
            direction = direction * graft.norm_ratio(grafting_direction(), direction)
    else:
        direction = grafting_direction()

    if hp.weight_decay != 0.0 and hp.decoupled_weight_decay:
        direction = direction.add(param, alpha=hp.weight_decay)
    if hp.momentum != 0.0:
        buf = _buffer(state, "momentum_buffer", grad)
        buf.mul_(hp.momentum).add_(direction)
        direction = direction.add(buf, alpha=hp.momentum) if hp.nesterov else buf
    return direction, nonfinite, status
