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

__all__ = [
    "eigh_flops",
    "lowrank_precondition_flops",
    "randomized_eigh_flops",
    "rows_per_sample",
    "statistics_flops",
]


def rows_per_sample(model: nn.Module, modules: Iterable[nn.Module],
                    sample_shape: Sequence[int]) -> dict[int, int]:
    """Return the rows per sample of each of ``modules``.

    Rows per sample of each of ``modules`` (keys: ``id(module)``) for inputs of one
    sample's shape ``sample_shape`` (e.g. ``(3, 32, 32)``). A module the forward pass
    does not reach is missing from the result.
    """
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
            elif isinstance(mod, nn.Embedding):  # every index is a row
                rows[key] = int(torch.Size(inputs[0].shape[1:]).numel())
            else:
                x = inputs[0]
                rows[key] = int(torch.Size(x.shape[1:-1]).numel()) if x.dim() > 1 else 1

        handles.append(clone.register_forward_hook(hook))
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()),
                 torch.get_default_dtype())
    try:
        with torch.no_grad():
            try:
                probe(torch.empty((1, *sample_shape), dtype=dtype, device="meta"))
            except (RuntimeError, IndexError):
                if not any(isinstance(m, nn.Embedding) for m in probe.modules()):
                    raise
                rows.clear()  # a language model: token indices, not features
                probe(torch.zeros((1, *sample_shape), dtype=torch.long, device="meta"))
    finally:
        for h in handles:
            h.remove()
    return rows


# ----- flop counts of the per-layer math (pure; the planner's cost model and the
# benchmarks use them; one multiply-add = 2 flops) ------------------------------------


def statistics_flops(a_dim: int, g_dim: int, batch: int, rows_per_sample: int,
                     approx: str = "expand", symmetric: bool = False) -> int:
    """Flops of one factor-statistics update (``A`` and ``G``) of a layer.

    Expand: a Gram matrix over ``batch·rows_per_sample`` rows for each factor
    (``2·rows·d²``; ``symmetric`` counts only the upper triangle, ``rows·d·(d+1)``, as
    :func:`kfac_hpc.kfac.patches.symmetric_gram_` does in the limit of many blocks).
    Reduce: the per-example sums over positions (``rows·d`` adds per factor) and a Gram
    matrix over ``batch`` rows. ``rows_per_sample`` as :func:`rows_per_sample` gives.
    """
    if approx not in ("expand", "reduce"):
        raise ValueError(f"approx must be 'expand' or 'reduce', got {approx!r}")
    rows = batch * rows_per_sample

    def gram(n: int, d: int) -> int:
        return n * d * (d + 1) if symmetric else 2 * n * d * d

    if approx == "expand":
        return gram(rows, a_dim) + gram(rows, g_dim)
    return rows * (a_dim + g_dim) + gram(batch, a_dim) + gram(batch, g_dim)


def eigh_flops(d: int) -> int:
    """Return the nominal flops of a symmetric eigendecomposition with vectors (``syevd``).

    ``4d³`` = tridiagonalisation ``4/3·d³`` + back-transformation ``2d³`` + about ``2/3·d³`` in
    divide-and-conquer (less with deflation). A convention for flops/s figures, not a measurement.
    """
    return 4 * d ** 3


def randomized_eigh_flops(d: int, rank: int, oversample: int = 10, power_iters: int = 2) -> int:
    """Return the flops of :func:`kfac_hpc.kfac.lowrank.randomized_eigh` (sketched path).

    ``2 + q`` products ``F·Q`` (``2d²l`` each, ``l = rank + oversample``), ``q + 1`` QRs (``4dl²``),
    the small ``eigh`` (``9l³``) and ``Q·U`` (``2dl²``).
    """
    sketch = min(d, rank + oversample)
    return ((2 + power_iters) * 2 * d * d * sketch + (power_iters + 1) * 4 * d * sketch ** 2
            + 9 * sketch ** 3 + 2 * d * sketch ** 2)


def lowrank_precondition_flops(g_dim: int, a_dim: int, g_rank: int, a_rank: int) -> int:
    """Return the flops of :func:`kfac_hpc.kfac.lowrank.precondition_lowrank`.

    ``Q_Gᵀ X``, ``X Q_A``, ``C``, ``K Q_Aᵀ``, ``Q_G [·]`` and ``[·] Q_Aᵀ``. The dense eigen
    preconditioner costs ``4·g·a·(g + a)``.
    """
    ga = g_dim * a_dim
    return 2 * (2 * ga * g_rank + 2 * ga * a_rank + g_rank * a_dim * a_rank
                + g_rank * a_rank * a_dim)
