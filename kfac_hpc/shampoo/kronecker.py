"""Kronecker-factor statistics of a block and the application of its roots.

For a block ``X`` of order k, factor i is the mode-i contraction ``X_(i) X_(i)ᵀ``
(``X_(i)``: ``X`` with dimension i moved first and the rest flattened), e.g.
``G Gᵀ`` and ``Gᵀ G`` for a matrix. Preconditioning multiplies every mode by its
root: ``X ×_1 R_1 ×_2 R_2 … ×_k R_k``, which is ``R_1 G R_2ᵀ`` for a matrix and
``(R_1 ⊗ … ⊗ R_k) vec(X)`` for row-major ``vec``. Autocast is disabled, so the
arithmetic runs in the dtype of the tensors passed in.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["factor_statistics", "precondition"]


def factor_statistics(block: Tensor) -> list[Tensor]:
    """The k mode contractions ``X_(i) X_(i)ᵀ`` of an order-k block."""
    with torch.autocast(device_type=block.device.type, enabled=False):
        out = []
        for i, d in enumerate(block.shape):
            x = block.movedim(i, 0).reshape(d, -1)
            out.append(x @ x.mT)
        return out


def precondition(block: Tensor, roots: Sequence[Tensor]) -> Tensor:
    """``block ×_1 roots[0] ×_2 roots[1] …`` (one root per dimension, in order)."""
    if len(roots) != block.dim():
        raise ValueError(f"{len(roots)} roots for a block of order {block.dim()}")
    with torch.autocast(device_type=block.device.type, enabled=False):
        if block.dim() == 1:
            return roots[0] @ block
        if block.dim() == 2:
            return roots[0] @ block @ roots[1].mT
        out = block
        for root in roots:
            # Contract the leading dimension with the root's columns; the new
            # dimension goes last, so after k steps the order is restored.
            out = torch.tensordot(out, root, dims=([0], [1]))
        return out
