"""How a torch tensor becomes an MPI buffer, and how results come back.

Rules (documented in the README):

* Contiguous CPU tensors of float16/float32/float64/int32/int64/uint8 go to MPI
  zero-copy (the buffer is the tensor's own memory).
* Tensors that require grad are used through ``.detach()`` (same memory, no copy).
* Non-contiguous tensors travel through a contiguous copy; results are copied back.
* bfloat16 has no MPI datatype: reductions run in float32 and are cast back;
  data movement (broadcast, gather) sends the raw 16-bit words, exactly.
* CUDA tensors go to MPI directly when the MPI library is CUDA-aware (the current
  stream is synchronised first); otherwise through pinned host buffers.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from mpi4py import MPI


def _half_type() -> Any | None:
    """The MPI library's 16-bit float type, if it has one (an extension before MPI 4.1)."""
    try:
        datatype = MPI.Datatype.fromcode("e")  # predefined: reductions work on it
    except (ValueError, KeyError, TypeError, AttributeError, NotImplementedError):
        return None
    return None if datatype == MPI.DATATYPE_NULL else datatype


_HALF = _half_type()
# dtypes without an MPI datatype here: reductions widen them to float32, data
# movement sends their raw 16-bit words.
WIDENED_DTYPES = (torch.bfloat16,) if _HALF is not None else (torch.bfloat16, torch.float16)

_MPI_TYPES: dict[torch.dtype, Any] = {
    torch.float32: MPI.FLOAT,
    torch.float64: MPI.DOUBLE,
    torch.int16: MPI.INT16_T,
    torch.int32: MPI.INT32_T,
    torch.int64: MPI.INT64_T,
    torch.uint8: MPI.UINT8_T,
    torch.bool: MPI.C_BOOL,
}
if _HALF is not None:
    _MPI_TYPES[torch.float16] = _HALF

SUPPORTED_DTYPES = (
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.int32,
    torch.int64,
    torch.uint8,
)

CUDA_AWARE_ENV = "KFAC_HPC_CUDA_AWARE"


def mpi_datatype(dtype: torch.dtype) -> Any:
    """The MPI datatype of a torch dtype (bfloat16 has none: :func:`to_wire` widens it)."""
    try:
        return _MPI_TYPES[dtype]
    except KeyError:
        raise TypeError(
            f"dtype {dtype} cannot travel over MPI; use one of "
            f"{', '.join(str(d) for d in SUPPORTED_DTYPES)}"
        ) from None


def mpi_library_cuda_support() -> bool:
    """What the loaded MPI library says of itself (``MPIX_Query_cuda_support``)."""
    for name in ("libmpi.so.40", "libmpi.so.12", "libmpi.so", "libmpich.so.12", "libmpich.so"):
        try:
            lib = ctypes.CDLL(name, mode=os.RTLD_NOLOAD | ctypes.RTLD_GLOBAL)
        except OSError:
            continue
        query = getattr(lib, "MPIX_Query_cuda_support", None)
        if query is not None:
            return bool(query())
    return False


def detect_cuda_aware(override: bool | None = None) -> bool:
    """Whether CUDA buffers may be handed to MPI directly.

    Order: the explicit ``override``; the environment variable ``KFAC_HPC_CUDA_AWARE``
    (``1/true/yes`` or ``0/false/no``); the MPI library's own answer.
    """
    if override is not None:
        return override
    env = os.environ.get(CUDA_AWARE_ENV)
    if env is not None:
        value = env.strip().lower()
        if value in ("1", "true", "yes", "on"):
            return True
        if value in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"{CUDA_AWARE_ENV}={env!r}: use 1 or 0")
    return mpi_library_cuda_support()


def mpi_vendor() -> str:
    """Name of the MPI implementation, e.g. ``"Open MPI"`` or ``"MPICH"``."""
    return str(MPI.get_vendor()[0])


def as_torch(obj: Any) -> tuple[torch.Tensor, Callable[[torch.Tensor], Any]]:
    """Accept a torch tensor or a CuPy/NumPy array; return a tensor and a converter back."""
    if isinstance(obj, torch.Tensor):
        return obj, lambda t: t
    if hasattr(obj, "__cuda_array_interface__"):
        import cupy  # a CuPy array: optional dependency

        return torch.as_tensor(obj, device="cuda"), lambda t: cupy.asarray(t)
    if hasattr(obj, "__array_interface__"):
        import numpy as np

        return torch.from_numpy(obj), lambda t: np.asarray(t)
    raise TypeError(f"expected a torch tensor or CuPy/NumPy array, got {type(obj).__name__}")


@dataclass
class Wire:
    """The memory MPI touches for one user tensor, and how to bring results back."""

    user: torch.Tensor  # the caller's tensor (returned as the result)
    data: torch.Tensor  # the memory MPI reads and writes
    copy_back: bool

    def spec(self) -> list[Any]:
        """An explicit mpi4py buffer spec: ``[buffer, count, datatype]``."""
        t = self.data
        address = t.data_ptr() if t.numel() else 0
        buf = MPI.buffer.fromaddress(address, t.numel() * t.element_size())
        return [buf, t.numel(), mpi_datatype(t.dtype)]

    def land(self) -> torch.Tensor:
        """Copy the result into the user's tensor where the wire was a separate buffer."""
        if self.copy_back:
            result = self.data
            if result.dtype != self.user.dtype:
                same_width = result.element_size() == self.user.element_size()
                result = result.view(self.user.dtype) if same_width else result.to(self.user.dtype)
            with torch.no_grad():
                self.user.copy_(result.view(self.user.shape))
        return self.user


def to_wire(
    tensor: torch.Tensor,
    *,
    reduction: bool,
    device_ok: bool,
    need_input: bool = True,
) -> Wire:
    """Prepare ``tensor`` for MPI.

    ``reduction``: the collective does arithmetic (bf16 is widened to fp32).
    ``device_ok``: CUDA memory may be handed to MPI directly.
    ``need_input``: the tensor's current values are sent (False for pure receive buffers).
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype not in SUPPORTED_DTYPES:
        mpi_datatype(tensor.dtype)  # raises the clear error
    user = tensor
    data = tensor.detach()
    copy_back = False
    if data.is_cuda:
        if device_ok:
            torch.cuda.current_stream(data.device).synchronize()
        else:
            staged = torch.empty(data.shape, dtype=data.dtype, pin_memory=True)
            if need_input:
                staged.copy_(data)
            data, copy_back = staged, True
    if not data.is_contiguous():
        data, copy_back = data.contiguous(), True
    if data.dtype in WIDENED_DTYPES:
        if reduction:
            data = data.float() if need_input else torch.empty(
                data.shape, dtype=torch.float32, device=data.device)
            copy_back = True
        else:
            data = data.view(torch.int16)
    return Wire(user=user, data=data, copy_back=copy_back)
