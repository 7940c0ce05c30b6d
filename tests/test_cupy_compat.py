"""CuPy's view of torch's CUDA stream on CuPy 14 (``Stream.from_external``) and before
(``ExternalStream``), with stand-in ``cupy`` modules (runs without CuPy or a GPU).

The stand-ins follow CuPy's own code: CuPy 14's ``ExternalStream`` warns
``ExternalStream is deprecated`` (a ``DeprecationWarning``) on every construction, and
``Stream.from_external`` reads ``obj.__cuda_stream__()`` (a ``(0, ptr)`` tuple), keeps a
reference to ``obj`` and sets ``device_id`` to ``-1`` (the current device).
"""

from __future__ import annotations

import types
import warnings
from pathlib import Path
from typing import Any

import pytest

from kfac_hpc.comm import buffers
from kfac_hpc.comm.cupy_compat import StreamHandle, external_stream

PTR = 0x7F00_1234_5678


class FakeTorchStream:
    """What the helper reads from a ``torch.cuda.Stream``."""

    cuda_stream = PTR


class FakeExternalStream:
    """CuPy's ``ExternalStream(ptr, device_id=-1)``; deprecated from CuPy 14 on."""

    def __init__(self, ptr: int, device_id: int = -1, *, deprecated: bool = False) -> None:
        if deprecated:
            warnings.warn("ExternalStream is deprecated. Use Stream.from_external() instead",
                          DeprecationWarning, stacklevel=2)
        self.ptr = ptr
        self.device_id = device_id


class FakeStream14:
    """CuPy 14's ``Stream`` with its ``from_external`` class method."""

    def __init__(self, ptr: int, device_id: int, foreign: Any) -> None:
        self.ptr = ptr
        self.device_id = device_id
        self._foreign_stream_ref = foreign

    @classmethod
    def from_external(cls, obj: Any) -> FakeStream14:
        version, ptr = obj.__cuda_stream__()
        if not isinstance(version, int) or not isinstance(ptr, int):
            raise TypeError("__cuda_stream__() must return (int, int)")
        if version != 0:
            raise TypeError(f"__cuda_stream__() returned unsupported version {version}")
        return cls(ptr, -1, obj)


class FakeStream13:
    """CuPy 13's ``Stream``: no ``from_external``."""


def fake_cupy(new_api: bool) -> Any:
    """A ``cupy`` stand-in: CuPy 14 (both APIs, the old one warning) or CuPy 13."""
    if new_api:
        cuda = types.SimpleNamespace(
            Stream=FakeStream14,
            ExternalStream=lambda ptr, device_id=-1: FakeExternalStream(ptr, device_id,
                                                                        deprecated=True))
    else:
        cuda = types.SimpleNamespace(Stream=FakeStream13, ExternalStream=FakeExternalStream)
    return types.SimpleNamespace(cuda=cuda)


def test_cupy14_wraps_through_from_external_without_a_deprecation_warning() -> None:
    torch_stream = FakeTorchStream()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # ExternalStream's DeprecationWarning would raise
        stream = external_stream(fake_cupy(new_api=True), torch_stream)
    assert isinstance(stream, FakeStream14)
    assert stream.ptr == PTR and stream.device_id == -1
    # CuPy keeps the protocol object, which keeps the torch stream alive
    assert isinstance(stream._foreign_stream_ref, StreamHandle)
    assert stream._foreign_stream_ref.owner is torch_stream


def test_older_cupy_wraps_through_external_stream() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        stream = external_stream(fake_cupy(new_api=False), FakeTorchStream())
    assert isinstance(stream, FakeExternalStream)
    assert stream.ptr == PTR and stream.device_id == -1


def test_stream_handle_speaks_the_cuda_stream_protocol() -> None:
    handle = StreamHandle(FakeTorchStream())
    assert handle.__cuda_stream__() == (0, PTR)
    assert all(type(x) is int for x in handle.__cuda_stream__())


def test_the_deprecated_constructor_is_called_only_by_the_helper() -> None:
    """CuPy arrays through the Communicator (``comm/buffers.py``) use the helper only."""
    package = Path(buffers.__file__).parent
    callers = [p.name for p in package.glob("*.py")
               if "cuda.ExternalStream(" in p.read_text(encoding="utf-8")]
    assert callers == ["cupy_compat.py"]
    assert "external_stream(cupy" in Path(buffers.__file__).read_text(encoding="utf-8")


def test_the_stand_in_cupy14_does_warn() -> None:
    """The check above would be empty if the stand-in's old API did not warn."""
    with pytest.warns(DeprecationWarning, match="ExternalStream is deprecated"):
        fake_cupy(new_api=True).cuda.ExternalStream(PTR)
