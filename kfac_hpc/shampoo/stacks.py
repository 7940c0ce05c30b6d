"""Block state stacked by kind, so that one kernel updates many blocks.

The blocks a rank owns are grouped into *stacks*: blocks of the same parameter group,
shape and parameter dtype, in the layout's order. Every tensor of their state
(``factor_<i>``, ``root_<i>``, ``second_moment``, ``filtered_grad``,
``momentum_buffer``) lives in one stacked tensor per key, of shape ``(n, ...)``, and
each block's state dict holds its row, a view: the state dict layout (one tensor per
block and key) is unchanged, while a step updates ``n`` blocks with one batched
matrix product or one ``torch._foreach_*`` call.

A block's entry that is not the stack's view (a tensor installed by
``load_state_dict``, or a key the block did not have yet) is *bound* when a step
needs it: its value is copied into the stack (zeros for a new key) and the entry is
replaced by the view. That costs one copy per block, once after a load; steps in
between find every entry bound and launch nothing per block.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

__all__ = ["BlockStack", "Run", "runs_of"]

BlockState = dict[str, Any]


@dataclass
class BlockStack:
    """The owned blocks of one kind and their stacked state tensors.

    Attributes:
        group: index of the blocks' parameter group.
        shape: the blocks' common shape.
        dtype: their parameters' dtype.
        members: layout indices of the blocks, in the layout's (and the stack's) order.
    """

    group: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    members: list[int]
    _tensors: dict[str, Tensor] = field(default_factory=dict)
    _views: dict[str, list[Tensor]] = field(default_factory=dict)
    _used: dict[str, list[bool]] = field(default_factory=dict)

    @property
    def size(self) -> int:
        """Number of blocks."""
        return len(self.members)

    def rows(self, key: str, states: Sequence[BlockState], start: int,
             item_shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
        """Return rows ``start:start + len(states)`` of the stacked ``key``, bound to ``states``.

        Args:
            key: the state key.
            states: the state dicts of members ``start, start + 1, ...``.
            start: position of ``states[0]`` in the stack.
            item_shape: shape of one block's tensor.
            dtype: dtype of the stacked tensor.
            device: its device.

        Returns:
            A view of shape ``(len(states), *item_shape)``.
        """
        if key not in self._tensors:
            self._tensors[key] = torch.zeros((self.size, *item_shape), dtype=dtype, device=device)
            self._views[key] = list(self._tensors[key].unbind(0))
            self._used[key] = [False] * self.size
        views, used = self._views[key], self._used[key]
        for j, state in enumerate(states, start):
            if state.get(key) is not views[j]:
                self._bind(key, state, j)
            used[j] = True
        stacked = self._tensors[key]
        return stacked if start == 0 and len(states) == self.size else \
            stacked[start:start + len(states)]

    def _bind(self, key: str, state: BlockState, j: int) -> None:
        """Make ``state[key]`` row ``j`` of the stack, keeping its value (zeros if new)."""
        row = self._views[key][j]
        value = state.get(key)
        if value is not None:
            row.copy_(value)
        elif self._used[key][j]:  # a dropped state's old values: start again from zeros
            row.zero_()
        state[key] = row

    def forget(self, keys: Sequence[str]) -> None:
        """Free the stacked ``keys``, which no member holds; a later use starts from zeros.

        Args:
            keys: State keys no member holds any more.
        """
        for key in keys:
            self._tensors.pop(key, None)
            self._views.pop(key, None)
            self._used.pop(key, None)

    def tensors(self) -> dict[str, Tensor]:
        """Return the stacked tensors, by key (for inspection)."""
        return dict(self._tensors)


@dataclass(frozen=True)
class Run:
    """Consecutive members of a stack that take the same kind of step together.

    Attributes:
        stack: the stack.
        start: position of the first member in the stack.
        states: the members' state dicts, in stack order.
        step: their step count after this step (the same for all).
        roots: whether they recompute their roots in this step.
    """

    stack: BlockStack
    start: int
    states: tuple[BlockState, ...]
    step: int
    roots: bool

    @property
    def size(self) -> int:
        """Number of blocks."""
        return len(self.states)

    @property
    def members(self) -> list[int]:
        """Layout indices of the run's blocks."""
        return self.stack.members[self.start:self.start + self.size]

    def rows(self, key: str, item_shape: tuple[int, ...], dtype: torch.dtype,
             device: torch.device) -> Tensor:
        """Return the run's rows of the stacked ``key`` (see :meth:`BlockStack.rows`)."""
        return self.stack.rows(key, self.states, self.start, item_shape, dtype, device)


RunKey = tuple[int, bool]


def runs_of(stack: BlockStack, states: Sequence[BlockState | None],
            keys: Sequence[RunKey | None]) -> list[Run]:
    """Split a stack into maximal runs of consecutive members with equal keys.

    Args:
        stack: the stack.
        states: per member, its state dict (None for a member that takes no step).
        keys: per member, ``(step, recompute roots)`` for this step, or None (no step).

    Returns:
        The runs, in stack order; members with a None key belong to none.
    """
    runs: list[Run] = []
    j = 0
    while j < stack.size:
        key = keys[j]
        if key is None:
            j += 1
            continue
        end = j + 1
        while end < stack.size and keys[end] == key:
            end += 1
        members = tuple(s for s in states[j:end] if s is not None)
        runs.append(Run(stack, j, members, key[0], key[1]))
        j = end
    return runs
