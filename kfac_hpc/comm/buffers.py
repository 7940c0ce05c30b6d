"""How a torch tensor becomes an MPI buffer, and how results come back.

Rules (documented in the README):

* Contiguous CPU tensors of float16/float32/float64/int32/int64/uint8 go to MPI
  zero-copy (the buffer is the tensor's own memory).
* Tensors that require grad are used through ``.detach()`` (same memory, no copy).
* Non-contiguous tensors travel through a contiguous copy; results are copied back.
* bfloat16 has no MPI datatype: reductions run in float32 and are cast back;
  data movement (broadcast, gather) sends the raw 16-bit words, exactly. float16 is
  treated the same where the MPI library has no 16-bit float type, and in reductions
  on CUDA memory handed to MPI directly (widened on the device first).
* CUDA tensors: every conversion (contiguous copy, widening) is queued on the current
  stream first; then either MPI gets the device memory once an event recorded after
  those conversions has completed (a call the library takes device memory for, see
  :mod:`kfac_hpc.comm.cuda`), or the data is staged through a pooled pinned host
  buffer (:mod:`kfac_hpc.comm.staging`). Results land back on the current stream of
  the thread that completes the call, and every CUDA tensor that landing touches is
  marked as used by that stream (it may differ from the stream the call was made on).
* CuPy arrays (zero-copy through DLPack, stream-ordered) and NumPy arrays are accepted
  by :func:`as_torch`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from mpi4py import MPI

from kfac_hpc.comm import cuda as _cuda
from kfac_hpc.comm import staging
from kfac_hpc.comm.cupy_compat import external_stream


def _half_type() -> Any | None:
    """The MPI library's 16-bit float type, if it has one (an extension before MPI 4.1)."""
    try:
        datatype = MPI.Datatype.fromcode("e")  # predefined: reductions work on it
    except (ValueError, KeyError, TypeError, AttributeError, NotImplementedError):
        return None
    return None if datatype == MPI.DATATYPE_NULL else datatype


_HALF = _half_type()
# dtypes without an MPI datatype here: data movement sends their raw 16-bit words.
WIDENED_DTYPES = (torch.bfloat16,) if _HALF is not None else (torch.bfloat16, torch.float16)
# Reductions widen every 16-bit float to float32, MPI half type or not, on every path: a
# sum in float16 overflows at 65504 and rounds every partial sum (three ranks' average of
# 30000 was inf), and the result would depend on the route (device-direct reductions
# widen: no CUDA-aware MPI documents arithmetic on 16-bit floats in device memory).
REDUCTION_WIDENED_DTYPES = (torch.bfloat16, torch.float16)

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

CUDA_AWARE_ENV = _cuda.CUDA_AWARE_ENV


def mpi_datatype(dtype: torch.dtype) -> Any:
    """Return the MPI datatype of a torch dtype (bfloat16 has none: :func:`to_wire` widens it).

    Args:
        dtype: A torch dtype.

    Returns:
        The mpi4py datatype.

    Raises:
        TypeError: ``dtype`` cannot travel over MPI; names the dtypes that can.
    """
    try:
        return _MPI_TYPES[dtype]
    except KeyError:
        raise TypeError(
            f"dtype {dtype} cannot travel over MPI; use one of "
            f"{', '.join(str(d) for d in SUPPORTED_DTYPES)}"
        ) from None


def mpi_library_cuda_support() -> bool:
    """Ask the loaded MPI library whether it supports CUDA (``MPIX_Query_cuda_support() == 1``).

    Returns:
        True when the library says so at run time.
    """
    return _cuda.query_cuda_support() == 1


def detect_cuda_aware(override: bool | None = None) -> bool:
    """Say whether CUDA buffers may be handed to MPI directly in at least some calls.

    Order: the explicit ``override``; the environment variable ``KFAC_HPC_CUDA_AWARE``
    (``0``, ``1`` or ``all``); the evidence (:func:`kfac_hpc.comm.cuda.detect`, which also
    says *which* calls).

    Args:
        override: True or False decides; None detects.

    Returns:
        Whether at least one call takes device memory.
    """
    return _cuda.detect(override).aware


def mpi_vendor() -> str:
    """Name the running MPI implementation, e.g. ``"Open MPI"``, ``"Cray MPICH"``.

    From the library's own version string (the library loaded at run time), else the
    vendor mpi4py was built against.

    Returns:
        The vendor's name.
    """
    vendor = _cuda.vendor_of(MPI.Get_library_version())
    return vendor if vendor != _cuda.UNKNOWN else str(MPI.get_vendor()[0])


def as_torch(obj: Any) -> tuple[torch.Tensor, Callable[[torch.Tensor], Any]]:
    """Accept a torch tensor or a CuPy/NumPy array; return a tensor and a converter back.

    Arrays are wrapped zero-copy. A CuPy array comes through DLPack, which orders the
    array's stream before torch's current stream on its device (so work queued on the
    array is complete before MPI reads it); results go back the same way.

    Args:
        obj: A torch tensor, a CuPy array (``__cuda_array_interface__``) or a NumPy array.

    Returns:
        The tensor sharing ``obj``'s memory, and a converter that returns ``obj`` itself
        for that tensor (in-place results) and a new array of ``obj``'s kind for any other
        tensor (e.g. a reduce-scatter's result).

    Raises:
        TypeError: ``obj`` is none of these.
    """
    if isinstance(obj, torch.Tensor):
        return obj, lambda t: t
    if hasattr(obj, "__cuda_array_interface__"):
        return _from_cupy(obj)
    if hasattr(obj, "__array_interface__"):
        import numpy as np

        tensor = torch.from_numpy(obj)
        return tensor, lambda t: obj if t is tensor else np.asarray(t.detach().cpu())
    raise TypeError(f"expected a torch tensor or CuPy/NumPy array, got {type(obj).__name__}")


def _from_cupy(obj: Any) -> tuple[torch.Tensor, Callable[[torch.Tensor], Any]]:
    import cupy  # optional dependency: the "gpu" extra

    device = torch.device("cuda", obj.device.id)
    with cupy.cuda.Device(obj.device.id):
        # torch's current stream waits for the array's (CuPy's current) stream: work
        # queued on the array is ordered before everything the collective queues.
        torch_stream = torch.cuda.current_stream(device)
        external_stream(cupy, torch_stream).wait_event(cupy.cuda.get_current_stream().record())
        tensor = torch.from_dlpack(obj)
    if tensor.device != device:
        raise TypeError(f"CuPy array on device {obj.device.id} came through as {tensor.device}")

    def back(t: torch.Tensor) -> Any:
        with cupy.cuda.Device(t.device.index):
            # CuPy's current stream waits for torch's, where the result was landed
            landed = external_stream(cupy, torch.cuda.current_stream(t.device))
            cupy.cuda.get_current_stream().wait_event(landed.record())
            return obj if t is tensor else cupy.from_dlpack(t.detach())

    return tensor, back


#: The most elements one MPI call may send: a C ``int`` count below MPI 4 (mpi4py uses
#: MPI 4's large counts where the library has them).
MAX_COUNT = 2**31 - 1 if MPI.Get_version() < (4, 0) else None


def check_count(elements: int) -> None:
    """Refuse a message MPI's ``int`` counts cannot describe (below MPI 4).

    Args:
        elements: The message's elements (as it travels: widened or raw words).

    Raises:
        ValueError: More than :data:`MAX_COUNT` elements.
    """
    if MAX_COUNT is not None and elements > MAX_COUNT:
        raise ValueError(
            f"a message of {elements} elements is more than this MPI library can send in "
            f"one call ({MAX_COUNT}: it implements MPI {'.'.join(map(str, MPI.Get_version()))}, "
            "whose counts are C ints); split it: smaller buckets (bucket_cap_mb), a lower "
            "message dtype, or an MPI 4 library")


def check_device(tensor: torch.Tensor) -> None:
    """Refuse tensors MPI cannot read: no memory (meta) or an unsupported device.

    Args:
        tensor: The tensor about to be handed to MPI.

    Raises:
        ValueError: The tensor is on the meta device.
        TypeError: The tensor is on a device other than the CPU or CUDA.
    """
    kind = tensor.device.type
    if kind == "meta":
        raise ValueError(
            "tensor on device 'meta' has no memory MPI could read: create it on the CPU or a "
            "CUDA device (a tensor made without device= while torch.set_default_device('meta') "
            "is in effect lands there)")
    if kind not in ("cpu", "cuda"):
        raise TypeError(f"tensors on {kind} cannot travel over MPI: move them to the CPU or "
                        "a CUDA device")


@dataclass
class Wire:
    """The memory MPI touches for one user tensor, and how to bring results back.

    Attributes:
        user: The caller's tensor (returned as the result).
        data: The memory MPI reads and writes.
        copy_back: Whether results must be copied from ``data`` into ``user``.
        ready: A CUDA event; MPI may touch ``data`` only once it has completed (None: at
            once).
        pinned: The pooled host buffer ``data`` lives in when a CUDA tensor is staged; it
            goes back to the pool on :meth:`land` or :meth:`release`.
    """

    user: torch.Tensor  # the caller's tensor (returned as the result)
    data: torch.Tensor  # the memory MPI reads and writes
    copy_back: bool
    ready: Any | None = None
    pinned: staging.PinnedBuffer | None = None

    def spec(self) -> list[Any]:
        """Return an explicit mpi4py buffer spec: ``[buffer, count, datatype]``."""
        t = self.data
        address = t.data_ptr() if t.numel() else 0
        buf = MPI.buffer.fromaddress(address, t.numel() * t.element_size())
        return [buf, t.numel(), mpi_datatype(t.dtype)]

    @property
    def staged(self) -> bool:
        """Whether ``data`` is a pinned host copy of a CUDA tensor."""
        return self.pinned is not None

    def land(self, divide_by: int = 1) -> torch.Tensor:
        """Bring the result into the user's tensor.

        Staged results go host→device without blocking, on the current stream; every
        conversion after that is queued on the same stream.

        Args:
            divide_by: When > 1, divide the result first (an average), in the wire's dtype.

        Returns:
            The user's tensor, holding the result.
        """
        result = self.data
        if self.pinned is not None:
            result, event = staging.land_in(result, self.user.device)
            self.pinned.release(event)
        if divide_by > 1:
            result.div_(divide_by)
        if self.copy_back:
            if result.dtype != self.user.dtype:
                same_width = result.element_size() == self.user.element_size()
                result = (result.view(self.user.dtype) if same_width
                          else result.to(self.user.dtype))
            with torch.no_grad():
                self.user.copy_(result.view(self.user.shape))
        # The work above is queued on this thread's current stream; the call may have been
        # made on another (a hook's): the caching allocator must not hand out the memory
        # of the wire's device buffer or of the user's tensor to the stream they were
        # allocated on before this stream is done with them.
        staging.used_on_current_stream(self.data, self.user)
        return self.user

    def release(self) -> None:
        """Return a staging buffer that carries no result (a send-only wire)."""
        if self.pinned is not None:
            self.pinned.release()


def to_wire(
    tensor: torch.Tensor,
    *,
    reduction: bool,
    device_ok: bool,
    need_input: bool = True,
    pool: staging.PinnedPool | None = None,
) -> Wire:
    """Prepare ``tensor`` for MPI.

    Order on CUDA: every conversion is queued on the current stream; then an event is
    recorded (device-direct) or the pinned copy is queued behind them (staged).

    Args:
        tensor: The caller's tensor.
        reduction: The collective does arithmetic (bf16 and fp16 are widened to fp32).
        device_ok: CUDA memory may be handed to MPI directly (else it is staged).
        need_input: The tensor's current values are sent (False for pure receive
            buffers).
        pool: Where staging buffers come from (default: the process-wide pool).

    Returns:
        The wire; its ``ready`` event must complete before MPI touches ``data``.

    Raises:
        TypeError: Not a tensor, a dtype or device MPI cannot take, or a bool tensor in a
            reduction (MPI sums and compares no ``C_BOOL``).
        ValueError: A tensor on the meta device.
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(tensor).__name__}")
    if reduction and tensor.dtype == torch.bool:
        raise TypeError("a bool tensor cannot be reduced over MPI (no sum, max or min of "
                        "C_BOOL); reduce tensor.to(torch.uint8) or .to(torch.int32) instead")
    if tensor.dtype not in SUPPORTED_DTYPES:
        mpi_datatype(tensor.dtype)  # raises the clear error
    check_device(tensor)
    check_count(tensor.numel())  # widened or raw words: as many elements
    user = tensor
    data = tensor.detach()
    copy_back = False
    staged = data.is_cuda and not device_ok
    if staged:
        pool = pool if pool is not None else staging.pinned_pool()
    if staged and not need_input:  # a pure receive: nothing to convert on the device
        dtype = (torch.float32 if reduction and data.dtype in REDUCTION_WIDENED_DTYPES
                 else torch.int16 if not reduction and data.dtype in WIDENED_DTYPES
                 else data.dtype)
        assert pool is not None
        pinned = pool.acquire(data.shape, dtype)
        return Wire(user=user, data=pinned.tensor, copy_back=True, pinned=pinned)
    if not data.is_contiguous():
        data = data.contiguous() if need_input else torch.empty(
            data.shape, dtype=data.dtype, device=data.device)
        copy_back = True
    if reduction and data.dtype in REDUCTION_WIDENED_DTYPES:
        data = data.float() if need_input else torch.empty(
            data.shape, dtype=torch.float32, device=data.device)
        copy_back = True
    elif data.dtype in WIDENED_DTYPES:  # data movement: the raw 16-bit words
        data = data.view(torch.int16)
    if not data.is_cuda:
        return Wire(user=user, data=data, copy_back=copy_back)
    if device_ok:
        # conversions above are queued on the current stream: MPI waits for them (and for
        # earlier work on memory it will write) through this event.
        ready = staging.record_event(torch.cuda.current_stream(data.device))
        return Wire(user=user, data=data, copy_back=copy_back, ready=ready)
    assert pool is not None
    pinned, ready = staging.stage_out(data, pool, need_input)
    return Wire(user=user, data=pinned.tensor, copy_back=True, ready=ready, pinned=pinned)
