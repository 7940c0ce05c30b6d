"""Rows per sample of K-FAC layers, from one forward pass on a shape-only copy.

A layer's factor statistics cost ``rows · (a² + g²)`` per update, where ``rows`` is the
batch times the layer's rows per sample: its output positions (Conv2d) or the leading
positions of its input (Linear on N-D input). Only a forward pass tells them; this one
runs on a ``meta`` copy of the model (no memory, no arithmetic). Used by the
preconditioner (DP-KFAC placement, ``strategy="auto"``) and the planner.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Sequence

import torch
from torch import nn

__all__ = ["rows_per_sample"]


def rows_per_sample(model: nn.Module, modules: Iterable[nn.Module],
                    sample_shape: Sequence[int]) -> dict[int, int]:
    """Rows per sample of each of ``modules`` (keys: ``id(module)``) for inputs of one
    sample's shape ``sample_shape`` (e.g. ``(3, 32, 32)``). A module the forward pass
    does not reach is missing from the result."""
    wanted = list(modules)
    index = {id(m): i for i, m in enumerate(model.modules())}
    # the copy never holds real data: parameters and buffers map to meta tensors up front
    memo: dict[int, object] = {}
    for p in model.parameters():
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    probe = copy.deepcopy(model, memo)
    by_index = dict(enumerate(probe.modules()))
    rows: dict[int, int] = {}
    handles = []
    for original in wanted:
        clone = by_index[index[id(original)]]

        def hook(mod: nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor,
                 key: int = id(original)) -> None:
            if isinstance(mod, nn.Conv2d):
                rows[key] = int(output.shape[-1] * output.shape[-2])
            else:
                x = inputs[0]
                rows[key] = int(torch.Size(x.shape[1:-1]).numel()) if x.dim() > 1 else 1

        handles.append(clone.register_forward_hook(hook))
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()),
                 torch.get_default_dtype())
    try:
        with torch.no_grad():
            probe(torch.empty((1, *sample_shape), dtype=dtype, device="meta"))
    finally:
        for h in handles:
            h.remove()
    return rows
