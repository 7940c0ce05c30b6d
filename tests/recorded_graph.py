"""A CUDA graph's semantics on the CPU: record the operators once, replay them on the same tensors.

A CUDA graph replays the kernels of its capture with the same pointers and the same
scalar arguments; no Python runs. :class:`RecordedGraph` does the same with ATen
operators, so a test on the CPU sees what a replay on a GPU would compute:

* capturing runs the work once (with ``warm_up``, as ``CudaGraph`` does), then once more
  under a dispatch mode that records every operator with its arguments (the very tensor
  objects, and Python scalars as they were) and its outputs, and afterwards puts back
  every tensor an operator wrote in place as it was before the recording: a capture
  runs no kernel, so it changes no value (an optimizer's state is updated once, by the
  replay);
* replaying runs the recorded operators again on those tensors: in-place and ``out=``
  operators write where they wrote, an operator that made a new tensor has its result
  copied into the tensor it made at capture (a graph's fixed address), views are
  skipped (they alias what they aliased);
* a host read of a tensor's value while recording raises, as it would break a capture;
* tensors that existed before the recording are held weakly (by the memory they view),
  as a graph holds raw addresses: a replay that reads memory freed since raises.

So a value a step takes from Python at each step (not from a tensor the graph reads) is
replayed as it was at capture: the test sees it differ from the eager step.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

#: Operators that read a tensor's value on the host, or whose output's shape depends on
#: values (a device sync either way: not capturable).
HOST_READS = ("aten._local_scalar_dense", "aten.is_nonzero", "aten.equal", "aten.allclose",
              "aten.nonzero", "aten.masked_select", "aten._unique", "aten._unique2",
              "aten.unique_dim", "aten.unique_consecutive")

#: Tensor methods that read values on the host without dispatching on the CPU.
_HOST_METHODS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__,
                 torch.Tensor.__float__, torch.Tensor.__int__, torch.Tensor.__index__,
                 torch.Tensor.cpu, torch.Tensor.numpy}


class _NoHostReads(TorchFunctionMode):
    def __torch_function__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        if func in _HOST_METHODS:
            raise RuntimeError(f"{func.__name__}: a host read of a tensor's value while "
                               "capturing")
        return func(*args, **(kwargs or {}))


class _Recorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[Any, Any, Any, Any]] = []
        self.made: set[int] = set()  # tensors the recorded work made (the graph's own)
        self.before: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # written in place

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if str(func.overloadpacket) in HOST_READS:
            raise RuntimeError(f"{func}: a host read of a tensor's value while capturing")
        schema = func._schema
        if schema.is_mutable:
            values = list(args) + [kwargs.get(a.name) for a in schema.arguments[len(args):]]
            written, _ = tree_flatten([v for v, a in zip(values, schema.arguments)
                                       if a.alias_info is not None and a.alias_info.is_write])
            for t in written:
                if isinstance(t, torch.Tensor) and id(t) not in self.before:
                    self.before[id(t)] = (t, t.clone())
        out = func(*args, **kwargs)
        made, _ = tree_flatten(out)
        self.made.update(id(t) for t in made if isinstance(t, torch.Tensor))
        self.ops.append((func, *self._weak((args, kwargs)), out))
        return out

    def _weak(self, inputs: Any) -> tuple[Any, Any]:
        """The arguments, tensors that existed before the recording held weakly: a graph
        keeps raw addresses, not the tensors alive (a view by its base and geometry: the
        view object may go while its memory stays)."""
        flat, spec = tree_flatten(inputs)
        held = [_Weak(t) if isinstance(t, torch.Tensor) and id(t) not in self.made else t
                for t in flat]
        args, kwargs = tree_unflatten(held, spec)
        return args, kwargs


class _Weak:
    """A tensor held by the memory it reads: its base, weakly, and its geometry."""

    def __init__(self, t: torch.Tensor) -> None:
        base = t if t._base is None else t._base
        self.base = weakref.ref(base)
        self.view = None if t._base is None else (t.shape, t.stride(), t.storage_offset())

    def get(self) -> torch.Tensor:
        base = self.base()
        if base is None:
            raise RuntimeError("a replay reads memory that was freed after the capture")
        return base if self.view is None else base.as_strided(*self.view)


def _strong(value: Any) -> Any:
    return value.get() if isinstance(value, _Weak) else value


class RecordedGraph:
    """The recorder of :class:`~kfac_hpc.step_graph.StepGraph` for CPU tests."""

    def __init__(self, device: torch.device, pool: object = None, stream: object = None) -> None:
        self.ops: list[tuple[Any, Any, Any, Any]] = []

    def capture(self, work: Callable[[], None], warm_up: bool) -> None:
        if warm_up:
            work()
        recorder = _Recorder()
        with _NoHostReads(), recorder:
            work()
        self.ops = recorder.ops
        # a capture changes no value; the latest saved first, where views overlap
        for t, value in reversed(list(recorder.before.values())):
            t.copy_(value)

    def replay(self) -> None:
        for func, args, kwargs, out in self.ops:
            if func.is_view:
                continue
            args, kwargs = tree_map(_strong, (args, kwargs),
                                    is_leaf=lambda v: isinstance(v, _Weak))
            result = func(*args, **kwargs)
            if func._schema.is_mutable:  # in place, or into out=: written where it was
                continue
            made, _ = tree_flatten(out)
            fresh, _ = tree_flatten(result)
            for old, new in zip(made, fresh):
                if isinstance(old, torch.Tensor):
                    old.copy_(new)
