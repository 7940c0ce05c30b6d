"""CuPy's view of a CUDA stream it did not create (torch's), on every CuPy version.

CuPy 14 deprecates ``cupy.cuda.ExternalStream(ptr)`` (a ``DeprecationWarning`` on every
construction) in favour of ``cupy.cuda.Stream.from_external(obj)``, which takes an object
speaking the CUDA stream protocol (``obj.__cuda_stream__() -> (0, ptr)``), keeps a
reference to it and never destroys the stream it wraps. Older CuPy has only
``ExternalStream``. :func:`external_stream` picks whichever the installed CuPy has; both
give a stream whose ``device_id`` is ``-1`` (the current device), so callers use it
inside ``cupy.cuda.Device(...)`` of the stream's device.

``cupy`` is passed in (never imported here): CuPy is optional (the ``gpu`` extra), and
tests hand in a stand-in module on machines without it.
"""

from __future__ import annotations

from typing import Any, Protocol


class TorchStream(Protocol):
    """What is read from a ``torch.cuda.Stream``: its ``cudaStream_t`` as an integer."""

    @property
    def cuda_stream(self) -> int:
        """The raw ``cudaStream_t`` handle."""
        ...


class StreamHandle:
    """A raw CUDA stream pointer speaking the CUDA stream protocol (``__cuda_stream__``).

    Holds the torch stream it came from, so the CuPy stream that keeps this handle
    (``Stream.from_external`` keeps a reference) keeps the torch stream alive too.
    """

    def __init__(self, owner: TorchStream) -> None:
        """Read the stream's handle and keep the stream.

        Args:
            owner: The torch stream (anything with an integer ``cuda_stream``).
        """
        self.owner = owner
        self.ptr = int(owner.cuda_stream)

    def __cuda_stream__(self) -> tuple[int, int]:
        """Return ``(version 0, cudaStream_t as int)``: the CUDA stream protocol."""
        return (0, self.ptr)


def external_stream(cupy: Any, stream: TorchStream) -> Any:
    """Make a CuPy stream on the CUDA stream of ``stream`` (a torch stream), not owned by CuPy.

    Uses ``cupy.cuda.Stream.from_external`` where it exists (CuPy >= 14) and
    ``cupy.cuda.ExternalStream`` before (deprecated from CuPy 14 on). Call it with the
    stream's device current (``with cupy.cuda.Device(index):``).

    Args:
        cupy: The ``cupy`` module.
        stream: A ``torch.cuda.Stream`` (or anything with an integer ``cuda_stream``).

    Returns:
        A ``cupy.cuda.Stream`` (or ``ExternalStream``) whose ``ptr`` is ``stream``'s
        handle: record events on it, make it wait for events, or enter it.
    """
    from_external = getattr(cupy.cuda.Stream, "from_external", None)
    if from_external is not None:
        return from_external(StreamHandle(stream))
    return cupy.cuda.ExternalStream(int(stream.cuda_stream))
