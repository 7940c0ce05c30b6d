"""Kronecker-factor statistics of batches of blocks and the application of their roots.

Every function takes a *batch*: ``n`` blocks of the same shape stacked along a new
leading dimension, so one batched matrix product serves them all (one kernel on a
GPU, whatever ``n``). For a block ``X`` of order k, factor i is the mode-i
contraction ``X_(i) X_(i)ᵀ`` (``X_(i)``: ``X`` with dimension i moved first and the
rest flattened), e.g. ``G Gᵀ`` and ``Gᵀ G`` for a matrix. Preconditioning multiplies
every mode by its root: ``X ×_1 R_1 ×_2 R_2 … ×_k R_k``, which is ``R_1 G R_2ᵀ`` for
a matrix and ``(R_1 ⊗ … ⊗ R_k) vec(X)`` for row-major ``vec``. The caller disables
autocast (``DistributedShampoo.step`` does, once per step), so the arithmetic runs in
the dtype of the tensors passed in. ``precision`` (``"full"`` or ``"tf32"``) is the
operand precision of the products, as K-FAC's (:mod:`kfac_hpc.kfac.precision`): on CUDA
cuBLAS's TF32 mode for these products only, elsewhere float32 operands rounded to TF32
explicitly (the same numbers up to summation order); float64 in full either way.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Literal

import torch
from torch import Tensor

from kfac_hpc.kfac.precision import round_operand, tf32_products
from kfac_hpc.shampoo.errors import nonfinite_marks

__all__ = ["ROW_MAJOR_GRAM_DEVICES", "SPLIT_GRAM_DEVICES", "ProductPrecision", "accumulate_factors",
           "diagonal_marks", "gram_operand", "mode_matrices", "precondition", "splits_gram",
           "splits_gram_shape"]


#: The operand precisions of Shampoo's products (module docstring).
ProductPrecision = Literal["full", "tf32"]

#: Device types whose Gram products get row-major ``X_(i)`` (a copy where it is a
#: transposed view). On CUDA, ``X Xᵀ`` of a row-major ``X`` reaches cuBLAS as a "tn"
#: GEMM; of a transposed view (the last mode of a block of order 2 or more) as "nt",
#: for which cuBLAS picked a 32x32-tile kernel on an H200 (ResNet-50's plain Shampoo
#: step: 11 such factor products took 14.0 ms, the other 36 and the 47 preconditioning
#: products of about the same flops 4.3 ms together). The copy moves each block once (~0.1 ms for
#: ResNet-50 on that card). On the CPU the view is used as it is.
ROW_MAJOR_GRAM_DEVICES = frozenset({"cuda"})

#: Device types whose Gram products of few rows and a long contraction are cut into
#: chunks of :data:`SPLIT_COLUMNS` columns (:func:`splits_gram`): one batched product per
#: chunk and a sum, instead of one product whose tiny output leaves most of a GPU idle.
#: On an H200 (``benchmarks/gram_layouts.py``, ResNet-50's Shampoo factors; the layout
#: then copied the last mode row-major first): three 9-row factors of 262,144 columns 1.19
#: → 0.22 ms, six of 65,536 0.35 → 0.11 ms; four of 16,384 did not gain (0.12 against
#: 0.14), nor did K-FAC's 64-row factors of 100,352 and 401,408 columns.
SPLIT_GRAM_DEVICES = frozenset({"cuda"})
SPLIT_MAX_ROWS = 16  # Gram dimensions split (measured at 9 rows)
SPLIT_COLUMNS = 4096  # columns per chunk
SPLIT_MIN_CHUNKS = 16  # at least this many chunks (65,536 columns)


def mode_matrices(blocks: Tensor, i: int) -> Tensor:
    """Return ``X_(i)`` of every block of a batch ``(n, d_1, …, d_k)``: shape ``(n, d_i, -1)``."""
    if blocks.dim() == 3:  # matrices: the batch itself, or its transposes (one view)
        return blocks if i == 0 else blocks.mT
    n, d = blocks.shape[0], blocks.shape[i + 1]
    return blocks.movedim(i + 1, 1).reshape(n, d, -1)


def gram_operand(blocks: Tensor, i: int, device_type: str) -> Tensor:
    """``X_(i)`` as the Gram product ``X_(i) X_(i)ᵀ`` takes it on ``device_type``.

    Row-major (contiguous) on the devices of :data:`ROW_MAJOR_GRAM_DEVICES`, else
    whatever layout :func:`mode_matrices` gives (a view where it can).

    Args:
        blocks: the batch ``(n, d_1, …, d_k)``.
        i: the mode.
        device_type: the device type the product runs on.

    Returns:
        ``X_(i)``, shape ``(n, d_i, -1)``.
    """
    x = mode_matrices(blocks, i)
    return x.contiguous() if device_type in ROW_MAJOR_GRAM_DEVICES else x


def splits_gram(x: Tensor) -> bool:
    """Whether :func:`accumulate_factors` cuts the Gram product of ``X_(i)`` into chunks.

    On the devices of :data:`SPLIT_GRAM_DEVICES`, for at most :data:`SPLIT_MAX_ROWS`
    rows and at least :data:`SPLIT_MIN_CHUNKS` chunks of :data:`SPLIT_COLUMNS` columns,
    where ``X_(i)`` is the transposed view of a row-major ``(n, K, d)`` (a block's last
    mode) whose chunks are views: ``K`` a multiple of the chunk, or one block (with a
    remainder and several blocks the chunks of all blocks are no batch of views).

    Args:
        x: ``X_(i)`` of a batch, ``(n, d, K)`` (:func:`mode_matrices`).
    """
    n, d, k = x.shape
    return x.mT.is_contiguous() and splits_gram_shape(n, d, k, x.device.type)


def splits_gram_shape(n: int, d: int, k: int, device_type: str) -> bool:
    """:func:`splits_gram` for a last mode's ``X_(i)`` of shape ``(n, d, k)`` on ``device_type``."""
    return (device_type in SPLIT_GRAM_DEVICES and d <= SPLIT_MAX_ROWS
            and k >= SPLIT_MIN_CHUNKS * SPLIT_COLUMNS and (k % SPLIT_COLUMNS == 0 or n == 1))


def _split_gram(x: Tensor) -> Tensor:
    """``X Xᵀ`` of a batch ``(n, d, K)`` whose transpose is row-major, by chunks of columns."""
    y = x.mT  # (n, K, d), row-major
    n, k, d = y.shape
    chunks = k // SPLIT_COLUMNS
    whole = chunks * SPLIT_COLUMNS
    head = y[:, :whole].reshape(n * chunks, SPLIT_COLUMNS, d)
    gram = torch.bmm(head.mT, head).view(n, chunks, d, d).sum(1)
    if whole < k:
        tail = y[:, whole:]
        gram.baddbmm_(tail.mT, tail)
    return gram


def _tf32_on_cuda(t: Tensor, precision: ProductPrecision) -> bool:
    """Whether products of ``t`` run in cuBLAS's TF32 mode (else: as the operands are)."""
    return precision == "tf32" and t.dtype == torch.float32 and t.device.type == "cuda"


def _operand(t: Tensor, precision: ProductPrecision) -> Tensor:
    """``t`` as a product's operand in ``precision``: rounded to TF32 off CUDA (a copy)."""
    if precision == "full" or t.dtype != torch.float32 or t.device.type == "cuda":
        return t
    return round_operand(t, precision)


def _block(t: Tensor, precision: ProductPrecision) -> contextlib.AbstractContextManager[None]:
    """Where products of ``t`` run: :func:`~kfac_hpc.kfac.precision.tf32_products` or plain."""
    return tf32_products() if _tf32_on_cuda(t, precision) else contextlib.nullcontext()


def accumulate_factors(factors: Sequence[Tensor], blocks: Tensor, beta2: float,
                       precision: ProductPrecision = "full") -> None:
    """Update ``F_i ← β2·F_i + (1-β2)·X_(i) X_(i)ᵀ`` in place, one batched GEMM per factor.

    ``β2 = 1`` is the plain sum ``F_i ← F_i + X_(i) X_(i)ᵀ``. The scaling is fused into
    the GEMM (``baddbmm``), so ``F_i`` is read and written once; compared with a
    product followed by ``mul_``/``add_`` only the rounding of the last bit differs.
    ``X_(i)`` is laid out for the device's GEMM library (:func:`gram_operand`); a factor
    of few rows and a long contraction on a GPU is summed over chunks of columns instead
    (:func:`splits_gram`: the same sum in another order).

    Args:
        factors: per dimension i, the stacked factors ``(n, d_i, d_i)``.
        blocks: the batch ``(n, d_1, …, d_k)`` in the factors' dtype.
        beta2: the running-average coefficient.
        precision: the operand precision of the products (module docstring).
    """
    alpha = 1.0 - beta2 if beta2 < 1.0 else 1.0
    with _block(blocks, precision):
        blocks = _operand(blocks, precision)
        for i, factor in enumerate(factors):
            view = mode_matrices(blocks, i)
            if splits_gram(view):
                gram = _split_gram(view)
                if beta2 == 0.0:  # as baddbmm_(beta=0): the old values (NaN too) not read
                    factor.copy_(gram)
                    continue
                if beta2 != 1.0:
                    factor.mul_(beta2)
                factor.add_(gram, alpha=alpha)
                continue
            x = gram_operand(blocks, i, blocks.device.type)
            factor.baddbmm_(x, x.mT, beta=beta2, alpha=alpha)


def diagonal_marks(factors: Sequence[Tensor]) -> Tensor:
    """Mark each block: 0 where every diagonal entry of its factors is finite, else NaN; ``(n,)``.

    See :func:`~kfac_hpc.shampoo.errors.nonfinite_marks`. A NaN/Inf anywhere in a
    gradient reaches the diagonals (sums of squares), so checking them is exact and costs
    O(d) instead of O(d²); the result stays on the device (no host synchronisation).
    """
    diagonals = [f.diagonal(dim1=1, dim2=2) for f in factors]
    return nonfinite_marks(diagonals[0] if len(diagonals) == 1 else torch.cat(diagonals, dim=1))


def precondition(blocks: Tensor, roots: Sequence[Tensor],
                 precision: ProductPrecision = "full") -> Tensor:
    """Compute ``X ×_1 R_1 ×_2 R_2 …`` for every block ``X`` of a batch ``(n, d_1, …, d_k)``.

    Args:
        blocks: the batch.
        roots: per dimension i, the stacked roots ``(n, d_i, d_i)``.
        precision: the operand precision of the products (module docstring; off CUDA
            every intermediate is rounded again, as the next product's operand).

    Returns:
        A new tensor shaped like ``blocks``.
    """
    if len(roots) != blocks.dim() - 1:
        raise ValueError(f"{len(roots)} roots for blocks of order {blocks.dim() - 1}")
    with _block(blocks, precision):
        rounded = [_operand(root, precision) for root in roots]
        if len(roots) == 2:
            first = _operand(rounded[0] @ _operand(blocks, precision), precision)
            return first @ rounded[1].mT
        out = blocks
        n = blocks.shape[0]
        for root in rounded:
            # Contract the leading block dimension with the root's columns; the new
            # dimension goes last, so after k steps the order is restored.
            moved = _operand(out, precision).movedim(1, -1)
            out = (moved.reshape(n, -1, moved.shape[-1]) @ root.mT).reshape(moved.shape)
        return out
