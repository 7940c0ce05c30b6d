"""Count the operators torch dispatches while a function runs (no GPU needed).

Each dispatched ATen operator is (about) one kernel launch on a GPU, so the count is a
device-independent stand-in for launch overhead: a per-sample, per-block or per-offset
Python loop shows up as a count that grows with the batch, the blocks or the layers.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

# Bookkeeping operators that launch no kernel (views, metadata, detach, allocations
# without a fill: the caching allocator hands out memory without touching the device).
_FREE = ("aten.view", "aten._unsafe_view", "aten.detach", "aten.t.", "aten.transpose",
         "aten.permute", "aten.expand", "aten.as_strided", "aten.slice", "aten.select",
         "aten.unsqueeze", "aten.squeeze", "aten.reshape", "aten.alias", "aten.lift_fresh",
         "aten._reshape_alias", "aten.split", "aten.unbind", "aten.diagonal", "aten.sym_",
         "aten.is_", "aten.numel", "aten.dim", "aten.size", "aten.stride", "aten.empty.",
         "aten.empty_like.", "aten.empty_strided.", "aten.new_empty.",
         "aten.new_empty_strided.")


#: The GEMM operators (2-D and batched, with and without an added input).
GEMMS = ("aten.mm.", "aten.addmm.", "aten.bmm.", "aten.baddbmm.")


class OpCounter(TorchDispatchMode):
    """A dispatch mode that counts every operator call by name (``counts``)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        self.counts[str(func)] += 1
        return func(*args, **(kwargs or {}))

    def calls(self, prefixes: str | tuple[str, ...]) -> int:
        """Calls of the operators whose names start with ``prefixes`` (e.g. ``"aten.bmm."``)."""
        return sum(n for name, n in self.counts.items() if name.startswith(prefixes))

    @property
    def kernels(self) -> int:
        """Calls of operators that launch work (views and metadata queries excluded)."""
        return sum(n for name, n in self.counts.items() if not name.startswith(_FREE))


def count_ops(fn: Callable[[], object]) -> OpCounter:
    """Run ``fn`` under an :class:`OpCounter` and return it."""
    counter = OpCounter()
    with counter:
        fn()
    return counter


# Tensor methods that read device memory on the host: a device sync each on a GPU.
_HOST_READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__,
               torch.Tensor.__float__, torch.Tensor.__int__, torch.Tensor.__index__,
               torch.Tensor.cpu, torch.Tensor.numpy}


class HostReads(TorchFunctionMode):
    """A function mode that counts host reads of tensor values (``calls`` by name).

    ``events``: a list each read is also appended to, as ``"read <method>"`` (the one
    :func:`timeline` shares with its operators).
    """

    def __init__(self, events: list[str] | None = None) -> None:
        super().__init__()
        self.calls: Counter[str] = Counter()
        self.events = events

    def __torch_function__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        if func in _HOST_READS:
            self.calls[func.__name__] += 1
            if self.events is not None:
                self.events.append(f"read {func.__name__}")
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.calls.values())


def count_host_reads(fn: Callable[[], object]) -> HostReads:
    """Run ``fn`` under a :class:`HostReads` and return it."""
    reads = HostReads()
    with reads:
        fn()
    return reads


class Timeline(TorchDispatchMode):
    """The operators dispatched and the host reads, in the order they happen (``events``).

    Operators appear by name (``"aten.mm.default"``), host reads as ``"read <method>"``.
    Use :func:`timeline`, which enters a :class:`HostReads` that sees the reads as well.
    """

    def __init__(self) -> None:
        super().__init__()
        self.events: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        self.events.append(str(func))
        return func(*args, **(kwargs or {}))

    def positions(self, prefixes: str | tuple[str, ...]) -> list[int]:
        """Where the events starting with ``prefixes`` happened."""
        return [i for i, name in enumerate(self.events) if name.startswith(prefixes)]


def timeline(fn: Callable[[], object]) -> Timeline:
    """Run ``fn`` recording its operators and host reads in order."""
    line = Timeline()
    with HostReads(line.events), line:
        fn()
    return line
