"""Matrix products in a chosen precision: full, TF32 or bf16 inputs, fp32 accumulation.

K-FAC's statistics (``A = rowsᵀ rows / n``) and its preconditioning (``Q_Gᵀ ∇W̄ Q_A``,
…) are GEMMs. On a GPU with tensor cores they run several times faster when their
inputs are rounded to TF32 (10 mantissa bits) or bf16 (7 bits) and the products are
accumulated in fp32; the factors then carry a relative error of about ``2⁻¹¹`` (TF32)
or ``2⁻⁸`` (bf16) of their largest entries (``benchmarks/precision_accuracy.py`` and
docs/design.md, "GPU paths", give the measured errors).

:data:`PRECISIONS`:

* ``"full"``: the operands' own dtype (fp32 or fp64), no rounding (the reference).
* ``"tf32"``: float32 operands rounded to TF32 by the tensor cores. On CUDA cuBLAS's
  TF32 mode is switched on **for these products only** (:func:`tf32_products`: the
  user's global setting is restored afterwards). Elsewhere the operands are rounded to
  TF32 explicitly (round to nearest even), then multiplied in fp32: the same numbers
  up to summation order, no speed-up.
* ``"bf16"``: float32 operands cast to bf16, products accumulated and returned in fp32
  (``torch.mm(..., out_dtype=torch.float32)`` on CUDA; elsewhere bf16-rounded operands
  multiplied in fp32).

float64 operands are always multiplied in full (the options exist for float32 only;
the preconditioner refuses them with float64 factors).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch
from torch import Tensor

from kfac_hpc.kfac.options import PRECISIONS, MatmulPrecision

__all__ = ["PRECISIONS", "MatmulPrecision", "full_precision_products", "matmul", "round_operand",
           "tf32_products", "user_setting_matmul", "user_setting_products", "user_setting_qr"]

_TF32_DROPPED_BITS = 13  # float32 has 23 mantissa bits, TF32 keeps 10

# Held while this module's blocks have torch's process-wide product flags changed, and by
# another thread's products that must see the user's own setting (user_setting_products).
_FLAGS = threading.RLock()


@contextlib.contextmanager
def _cuda_fp32_products(mode: str) -> Iterator[None]:
    """CuBLAS float32 products in ``mode`` (``"tf32"`` or ``"ieee"``) inside the block.

    Uses ``torch.backends.cuda.matmul.fp32_precision`` where torch has it (2.9+), else
    the legacy ``allow_tf32`` flag, and restores the user's setting afterwards, so it is
    never changed outside the block. Setting ``fp32_precision`` makes torch refuse to
    read ``allow_tf32`` (a "mix of the legacy and new APIs"); where the user's code could
    read it before the block, it is set back too, so it stays readable.

    The flags are process-wide: the block holds a lock for its whole length, so two
    threads' blocks run one after the other (each restores what it found) and a thread
    inside :func:`user_setting_products` never launches a product meanwhile.
    """
    with _FLAGS:
        matmul_flags = torch.backends.cuda.matmul
        try:
            legacy: bool | None = bool(matmul_flags.allow_tf32)
        except RuntimeError:  # the new API was used after the legacy one
            legacy = None
        if not hasattr(matmul_flags, "fp32_precision"):
            matmul_flags.allow_tf32 = mode == "tf32"
            try:
                yield
            finally:
                matmul_flags.allow_tf32 = bool(legacy)
            return
        before = matmul_flags.fp32_precision
        matmul_flags.fp32_precision = mode
        try:
            yield
        finally:
            matmul_flags.fp32_precision = before
            if legacy is not None:
                try:
                    matmul_flags.allow_tf32  # noqa: B018 (readable again?)
                except RuntimeError:
                    matmul_flags.allow_tf32 = legacy


@contextlib.contextmanager
def tf32_products() -> Iterator[None]:
    """CuBLAS float32 products in TF32 inside the block; the previous setting after it.

    The user's global setting (``fp32_precision`` or the legacy ``allow_tf32``) is read
    back and restored, so it is never changed outside the block.
    """
    with _cuda_fp32_products("tf32"):
        yield


@contextlib.contextmanager
def full_precision_products() -> Iterator[None]:
    """Float32 products at full float32 precision inside the block, whatever the user set.

    A user's ``torch.set_float32_matmul_precision("high")`` (or ``allow_tf32``) makes
    cuBLAS round float32 operands to TF32, and oneDNN's ``fp32_precision`` may make the
    CPU's products use TF32 or bf16; iterations that need float32's 24 bits (Shampoo's
    Newton roots) run inside this block. Both settings are read back and restored
    afterwards, so the user's choice is never changed outside the block. float64
    products are unaffected either way.
    """
    with _FLAGS:
        onednn = getattr(torch.backends.mkldnn, "matmul", None)
        before = getattr(onednn, "fp32_precision", None)
        try:
            if before is not None and before != "ieee":
                onednn.fp32_precision = "ieee"  # type: ignore[union-attr]
        except RuntimeError:  # the legacy API was used in this process: leave it
            before = None
        try:
            with _cuda_fp32_products("ieee"):
                yield
        finally:
            if before is not None and before != "ieee":
                onednn.fp32_precision = before  # type: ignore[union-attr]


@contextlib.contextmanager
def user_setting_products() -> Iterator[None]:
    """Products launched inside the block run at the user's own precision setting.

    For products on a thread other than the one running the optimizer's step (K-FAC's
    background decompositions, ``decomposition_lag``): torch's precision flags are
    process-wide, and while the step runs a :func:`tf32_products` or
    :func:`full_precision_products` block another thread's float32 GEMM would take that
    block's setting, so a result would depend on the threads' timing. The block waits
    until no such block is running, and keeps new ones from starting until it ends.
    Hold it around product launches only (on a GPU they return at once), never around
    a host sync: the step's own blocks wait for it.
    """
    with _FLAGS:
        yield


def user_setting_matmul(a: Tensor, b: Tensor) -> Tensor:
    """``a @ b`` at the user's own precision setting, from any thread.

    See :func:`user_setting_products`.
    """
    with user_setting_products():
        return a @ b


def user_setting_qr(a: Tensor) -> Tensor:
    """``torch.linalg.qr(a).Q`` at the user's own precision setting, from any thread.

    On CUDA a batched QR of small matrices runs in cuBLAS, whose handle takes its math
    mode (TF32 or not) from the process-wide flag when the call starts; launched while
    another thread's precision block is open it would take that block's. See
    :func:`user_setting_products` (a QR launches without reading anything back).
    """
    with user_setting_products():
        q: Tensor = torch.linalg.qr(a)[0]
        return q


def round_operand(t: Tensor, precision: MatmulPrecision) -> Tensor:
    """``t`` (float32) rounded to the precision's operand format, kept in float32.

    TF32: round to nearest even on the 13 dropped mantissa bits (Inf/NaN kept); bf16:
    through a bf16 cast. ``"full"`` and non-float32 tensors are returned as they are.
    """
    if precision == "full" or t.dtype != torch.float32:
        return t
    if precision == "bf16":
        return t.to(torch.bfloat16).to(torch.float32)
    bits = t.contiguous().view(torch.int32)
    lsb = (bits >> _TF32_DROPPED_BITS) & 1
    half = 1 << (_TF32_DROPPED_BITS - 1)
    rounded = (bits + (half - 1) + lsb) & ~((1 << _TF32_DROPPED_BITS) - 1)
    finite = torch.isfinite(t)
    return torch.where(finite, rounded.view(torch.float32), t)


def matmul(a: Tensor, b: Tensor, precision: MatmulPrecision = "full") -> Tensor:
    """``a @ b`` (2-D or batched 3-D) in ``precision``; the result in ``a``'s dtype."""
    if precision == "full" or a.dtype != torch.float32:
        return a @ b
    if a.device.type == "cuda":
        if precision == "tf32":
            with tf32_products():
                return a @ b
        a16, b16 = a.to(torch.bfloat16), b.to(torch.bfloat16)
        if a.dim() == 2 and b.dim() == 2:
            return torch.mm(a16, b16, out_dtype=torch.float32)
        return torch.bmm(a16, b16, out_dtype=torch.float32)
    return round_operand(a, precision) @ round_operand(b, precision)
