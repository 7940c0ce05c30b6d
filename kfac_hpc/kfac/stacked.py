"""Layers of one gradient shape preconditioned together: stacks, KL inner products, writes.

A step between inverse updates does the same few products for every layer; on a GPU
each is a kernel launch of ~10-20 µs of host time, so ResNet-50's 54 layers (about 13
operators each) make the step host-bound. The layers a rank preconditions that share
their gradient layout (``g_dim``, ``a_dim``, the ``.grad`` blocks and dtype:
:meth:`~kfac_hpc.kfac.layers.LayerCurvature.grad_layout`) and hold full
eigendecompositions are preconditioned as one stack
(:class:`~kfac_hpc.kfac.decomposer.StackedEigenSolve`: four batched GEMMs and one
division, its stacked bases and denominators kept by
:meth:`~kfac_hpc.kfac.decompositions.Decompositions.stacked_solve`); their gradients
are gathered once per step (:func:`stack_grads`), their KL-clip inner product is one
float64 product and sum per stack (:meth:`Stack.inner64`), and every layer's ``.grad``
write is one multi-tensor copy (:func:`write_grads`).

Where it applies is chosen by device type (:data:`STACKED_DEVICES`): on CUDA; on the
CPU each layer keeps its own products (a few cores gain nothing from fewer, larger
calls). Layer ``i`` of a stack equals its per-layer result up to the batched GEMMs'
summation order.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from kfac_hpc.kfac.layers import LayerCurvature

__all__ = ["STACKED_DEVICES", "Stack", "stack_grads", "stack_groups", "write_grads"]

#: Device types whose layers of one gradient shape are preconditioned as stacks. On
#: CUDA the per-layer step is launch-bound (ResNet-50: 710 operators for 54 layers); on
#: the CPU the per-layer products are kept.
STACKED_DEVICES = frozenset({"cuda"})


def stack_groups(layers: Mapping[str, LayerCurvature]) -> list[tuple[str, ...]]:
    """The layers of each gradient layout with two or more layers, in model order.

    Args:
        layers: The layers a rank preconditions, by name.

    Returns:
        The groups (a layout with one layer keeps the per-layer path).
    """
    groups: dict[tuple[object, ...], list[str]] = {}
    for name, curv in layers.items():
        groups.setdefault(curv.grad_layout(), []).append(name)
    return [tuple(names) for names in groups.values() if len(names) > 1]


def stack_grads(layers: Sequence[LayerCurvature], dtype: torch.dtype) -> Tensor:
    """The layers' ``∇W̄`` stacked: ``(n, g_dim, a_dim)`` in ``dtype``.

    One stack per column block (weight, bias), one concatenation with a bias, one cast
    where ``dtype`` differs from the gradients'. A missing ``.grad`` reads as zeros, as
    in :meth:`~kfac_hpc.kfac.layers.LayerCurvature.grad_matrix`; a layer without a
    weight gradient (not preconditioned this step) is zeros entirely.

    Args:
        layers: Layers of one :meth:`~kfac_hpc.kfac.layers.LayerCurvature.grad_layout`.
        dtype: The dtype of the result (``inv_dtype``).

    Returns:
        Layer ``i``'s ``grad_matrix(dtype)`` at index ``i``.
    """
    blocks: list[list[Tensor | None]] = [
        curv.grad_blocks() if curv.module.weight.grad is not None
        else [None] * len(curv.block_widths) for curv in layers]
    weight: Tensor = layers[0].module.weight  # type: ignore[assignment]
    columns = []
    for j, width in enumerate(layers[0].block_widths):
        given = [block for b in blocks if (block := b[j]) is not None]
        like = given[0] if given else weight
        columns.append(torch.stack([
            block if (block := b[j]) is not None else like.new_zeros(layers[0].g_dim, width)
            for b in blocks]))
    out = columns[0] if len(columns) == 1 else torch.cat(columns, dim=2)
    return out if out.dtype == dtype else out.to(dtype)


@dataclass(frozen=True)
class Stack:
    """A stack's preconditioned gradients beside the gradients they were made from.

    ``layers``: every layer of the stack, in stack order; ``values`` and ``grads``
    ``(n, g_dim, a_dim)``, row ``i`` layer ``i``'s (zeros for a layer without
    ``.grad`` this step: its row is neither written nor counted).
    """

    layers: tuple[str, ...]
    values: Tensor
    grads: Tensor

    def inner64(self) -> Tensor:
        """``Σ_i ⟨V_i, ∇W̄_i⟩`` over the stack in float64 (0-dim).

        Products of the operands' values are exact in float64, so only the summation
        rounds (one reduction over the stack instead of one per layer and block).
        """
        return torch.mul(self.values.to(torch.float64), self.grads).sum()


def write_grads(targets: Iterable[tuple[Tensor, Tensor]]) -> None:
    """``param.grad.copy_(value)`` of every pair, as few multi-tensor copies as can be.

    The pairs whose gradient and value are both contiguous and of one dtype are one
    multi-tensor copy (on CUDA one launch); the others (a bias, a strided column of its
    layer's matrix; a channels-last gradient; another dtype) are a second one, which CUDA
    runs pair by pair, as it would the whole list if they were in it. A parameter without
    ``.grad`` gets a new one in its dtype, as
    :meth:`~kfac_hpc.kfac.layers.LayerCurvature.set_grad` does.

    Args:
        targets: ``(param, value)`` pairs (:meth:`~kfac_hpc.kfac.layers.LayerCurvature.
            grad_targets`), each value shaped as its parameter.
    """
    groups: dict[bool, tuple[list[Tensor], list[Tensor]]] = {True: ([], []), False: ([], [])}
    for param, value in targets:
        grad = param.grad
        if grad is None:
            param.grad = value.to(param.dtype, copy=True)
            continue
        dense = grad.is_contiguous() and value.is_contiguous() and grad.dtype == value.dtype
        into, values = groups[dense]
        into.append(grad)
        values.append(value)
    for into, values in groups.values():
        if into:
            torch._foreach_copy_(into, values)
