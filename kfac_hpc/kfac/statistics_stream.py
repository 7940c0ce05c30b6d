"""Which CUDA stream the hooks' statistics run on.

The hooks compute ``A`` after a layer's forward and ``G`` after its output gradient,
on the stream of the pass by default: each layer's unfold copy and GEMM then waits for
the layer before it and delays the layer after it. On a device type of
:data:`SIDE_STREAM_DEVICES` they run on one side stream instead (:class:`SideStream`),
which waits for the tensors it reads and is joined before the factor update reads the
sums, so the statistics may overlap the forward and backward kernels that follow.
The same kernels on the same values either way: the sums are bitwise those of
:class:`SameStream`.

Not with ``overlap`` (its pipeline posts factor reductions from the hooks, which would
have to join the side stream in every hook).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

import torch
from torch import Tensor

__all__ = ["SIDE_STREAM_DEVICES", "SameStream", "SideStream", "StatisticsStream",
           "statistics_stream"]

SIDE_STREAM_DEVICES: frozenset[str] = frozenset()
"""Device types whose statistics run on a side stream; empty (the pass's own stream
everywhere) until a GPU run has timed both (``benchmarks/gpu_profile.py``'s kinds row
"statistics on a side stream")."""


class StatisticsStream(Protocol):
    """Where the hooks' statistics run, and how their results come back."""

    def run(self, inputs: Sequence[Tensor], work: Callable[[], None]) -> None:
        """Run ``work`` (statistics of ``inputs``, added to the sums)."""

    def join(self) -> None:
        """Make the current stream wait for all statistics run so far."""

    def release(self, sums: Iterable[Tensor]) -> None:
        """Mark ``sums`` as used by the current stream before they are dropped."""


class SameStream:
    """The statistics run on the stream of the pass that produced their inputs."""

    def run(self, inputs: Sequence[Tensor], work: Callable[[], None]) -> None:
        """Run ``work`` now, on the current stream."""
        work()

    def join(self) -> None:
        """Nothing to wait for."""

    def release(self, sums: Iterable[Tensor]) -> None:
        """Nothing to mark."""


class SideStream:
    """The statistics run on one CUDA side stream of ``device``."""

    def __init__(self, device: torch.device) -> None:
        """Create the side stream.

        Args:
            device: A CUDA device.
        """
        self.device = device
        self.stream = torch.cuda.Stream(device)

    def run(self, inputs: Sequence[Tensor], work: Callable[[], None]) -> None:
        """Run ``work`` on the side stream after what the current stream has queued.

        ``inputs`` (made on the current stream) are marked as used on the side stream,
        so the caching allocator does not hand their memory out before it is done.
        """
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            work()
        for t in inputs:
            t.record_stream(self.stream)

    def join(self) -> None:
        """Make the current stream wait for the side stream."""
        torch.cuda.current_stream(self.device).wait_stream(self.stream)

    def release(self, sums: Iterable[Tensor]) -> None:
        """Mark ``sums`` (made on the side stream) as used by the current stream."""
        current = torch.cuda.current_stream(self.device)
        for t in sums:
            t.record_stream(current)


def statistics_stream(device: torch.device, *, pipelined: bool) -> StatisticsStream:
    """Return where the statistics of tensors on ``device`` run.

    Args:
        device: The model's device.
        pipelined: Whether ``overlap``'s pipeline posts reductions from the hooks.

    Returns:
        A :class:`SideStream` on the device types of :data:`SIDE_STREAM_DEVICES`
        (without a pipeline), else :class:`SameStream`.
    """
    if device.type in SIDE_STREAM_DEVICES and not pipelined:
        return SideStream(device)
    return SameStream()
