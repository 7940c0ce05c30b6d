"""What the checkpoint code needs of the objects it saves and loads.

:func:`~kfac_hpc.checkpoint.save`, :func:`~kfac_hpc.checkpoint.load` and
:meth:`BackgroundSaver.save <kfac_hpc.checkpoint.BackgroundSaver.save>` take

* a ``preconditioner`` following :class:`CheckpointPreconditioner`
  (:class:`~kfac_hpc.kfac.preconditioner.KFACPreconditioner` does), and
* an ``optimizer`` following :class:`CheckpointOptimizer` (every
  ``torch.optim.Optimizer`` does, :class:`~kfac_hpc.shampoo.DistributedShampoo` too).

An optimizer may offer more, each a protocol asked with ``isinstance``:
:class:`ShardedState` (its state is spread over the ranks: a load reads each part on
the rank that owns it now) and :class:`StreamingState` (a save streams each rank's part
to the writer instead of gathering it; its placeholders for other ranks' tensors are
:class:`RemoteLeaf`). Nothing is detected by calling a method and catching the error.

Objects are checked when they are handed over (:func:`problems`, :func:`agree`): one
that lacks a member is refused on every rank alike with a ``TypeError`` naming what is
missing, before any state is taken or any file is touched.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from torch.optim.optimizer import StateDict

from kfac_hpc.kfac.state import KFACStateDict

if TYPE_CHECKING:
    from kfac_hpc.comm import Communicator

__all__ = [
    "OPTIMIZER_MEMBERS",
    "PRECONDITIONER_MEMBERS",
    "CheckpointOptimizer",
    "CheckpointPreconditioner",
    "KeyPath",
    "RemoteLeaf",
    "ShardedState",
    "StreamingState",
    "agree",
    "problems",
]

#: Dict keys from the root of a ``state_dict()`` to one of its entries.
KeyPath = tuple[object, ...]


@runtime_checkable
class CheckpointPreconditioner(Protocol):
    """A K-FAC preconditioner, as the checkpoint code uses it.

    Factors are named ``"<layer>/A"`` and ``"<layer>/G"``; each has one owner rank,
    which holds its state (:class:`~kfac_hpc.kfac.state.KFACStateDict`).
    """

    @property
    def comm(self) -> Communicator:
        """The communicator of the preconditioner's ranks (used when none is given)."""
        ...

    def factor_keys(self) -> Sequence[str]:
        """List the factors.

        Returns:
            Every factor's name, in the same order on every rank.
        """
        ...

    def factor_owner(self, key: str, /) -> int:
        """Say which rank holds a factor.

        Args:
            key: A factor name.

        Returns:
            The rank that holds factor ``key`` under the current world size (a load
            sends it there).
        """
        ...

    def factor_shape(self, key: str, /) -> tuple[int, ...]:
        """Give a factor's shape.

        Args:
            key: A factor name.

        Returns:
            Its shape (a load refuses a file whose factor differs).
        """
        ...

    def state_dict(self, *, eigenbases: bool) -> KFACStateDict:
        """Return this rank's state (may be collective: every rank calls it).

        Args:
            eigenbases: Include the owned factors' current decompositions (False: none).

        Returns:
            The factors this rank owns and the rest of its state.
        """
        ...

    def load_state_dict(self, state: KFACStateDict, /) -> None:
        """Take this rank's part of ``state`` (collective: every rank calls it).

        Args:
            state: A state of this rank, as :meth:`state_dict` returned it here or on
                another number of ranks, with every factor this rank owns.
        """
        ...


class CheckpointOptimizer(Protocol):
    """An optimizer, as the checkpoint code uses it (torch's ``state_dict`` pair).

    One that keeps ``torch.optim.Optimizer``'s own ``state_dict`` is stored by
    parameter name; any other state dict is stored as it is
    (:func:`kfac_hpc.checkpoint.state.optimizer_layout`).
    """

    def state_dict(self) -> Mapping[str, object]:
        """Return the optimizer's state (may be collective: every rank calls it).

        Returns:
            Nested dicts, lists and tuples of tensors, arrays and scalars.
        """
        ...

    def load_state_dict(self, state_dict: StateDict, /) -> None:
        """Restore a state.

        Args:
            state_dict: A state :meth:`state_dict` returned (read back from a file).
        """
        ...


@runtime_checkable
class ShardedState(Protocol):
    """An optimizer whose ranks each hold part of its ``state_dict()``."""

    def checkpoint_load_rank(self, key_path: KeyPath, /) -> int | None:
        """Say which rank loads a saved entry.

        Args:
            key_path: The dict keys from the root of ``state_dict()`` to the entry,
                e.g. ``("state", name, block)``.

        Returns:
            The rank that loads the entry and everything under it; None: not decided at
            this entry (deeper entries are asked; every rank loads it if none says).
        """
        ...

    def local_state_dict(self) -> Mapping[str, object]:
        """Return this rank's part of ``state_dict()`` (no collective).

        Returns:
            A state whose ``load_state_dict`` on the same ranks restores this rank (a
            load keeps it to roll back).
        """
        ...


@runtime_checkable
class StreamingState(Protocol):
    """An optimizer that describes its sharded state for a streaming save."""

    def checkpoint_state_dict(self) -> Mapping[str, object]:
        """Describe ``state_dict()`` without gathering it (collective, metadata only).

        Returns:
            The same dict on every rank, except that each rank holds its own tensors in
            place and :class:`RemoteLeaf` placeholders for the others' (their owners
            send them to the writer).
        """
        ...


@runtime_checkable
class RemoteLeaf(Protocol):
    """A tensor of a :class:`StreamingState` held by another rank (a placeholder)."""

    @property
    def remote_owner(self) -> int:
        """The rank that holds the tensor and sends it."""
        ...

    @property
    def shape(self) -> tuple[int, ...]:
        """The tensor's shape."""
        ...


#: Members of :class:`CheckpointPreconditioner` (name, how an error shows it).
PRECONDITIONER_MEMBERS = {
    "comm": "comm", "factor_keys": "factor_keys()", "factor_owner": "factor_owner(key)",
    "factor_shape": "factor_shape(key)", "state_dict": "state_dict(*, eigenbases)",
    "load_state_dict": "load_state_dict(state)",
}
#: Members of :class:`CheckpointOptimizer` (name, how an error shows it).
OPTIMIZER_MEMBERS = {"state_dict": "state_dict()",
                     "load_state_dict": "load_state_dict(state_dict)"}


def _lacking(obj: object, members: Mapping[str, str]) -> list[str]:
    """The members ``obj`` lacks (methods must be callable)."""
    out = []
    for name, shown in members.items():
        value = getattr(obj, name, None)
        if value is None or (shown.endswith(")") and not callable(value)):
            out.append(shown)
    return out


def _takes_keyword(method: Callable[..., object], name: str) -> bool:
    """Whether ``method`` can be called with keyword argument ``name``."""
    try:
        params = inspect.signature(method).parameters
    except ValueError:  # no signature to read (a builtin): the call will tell
        return True
    p = params.get(name)
    return any(q.kind is inspect.Parameter.VAR_KEYWORD for q in params.values()) or (
        p is not None and p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                     inspect.Parameter.KEYWORD_ONLY))


def problems(*, optimizer: object, preconditioner: object) -> list[str]:
    """Say what ``optimizer`` and ``preconditioner`` lack of their contracts (local).

    Args:
        optimizer: The optimizer handed to ``save``/``load``, or None.
        preconditioner: The preconditioner handed to ``save``/``load``, or None.

    Returns:
        One line per object that does not follow its protocol (empty: both do).
    """
    found = []
    if preconditioner is not None:
        lacks = _lacking(preconditioner, PRECONDITIONER_MEMBERS)
        method = getattr(preconditioner, "state_dict", None)
        if callable(method) and not _takes_keyword(method, "eigenbases"):
            lacks.append("the keyword argument eigenbases of state_dict()")
        if lacks:
            found.append(
                f"the preconditioner ({type(preconditioner).__name__}) lacks "
                f"{', '.join(lacks)}: pass an object following "
                "kfac_hpc.checkpoint.contracts.CheckpointPreconditioner ("
                f"{', '.join(PRECONDITIONER_MEMBERS.values())}), e.g. a KFACPreconditioner")
    if optimizer is not None:
        lacks = _lacking(optimizer, OPTIMIZER_MEMBERS)
        if lacks:
            found.append(
                f"the optimizer ({type(optimizer).__name__}) lacks {', '.join(lacks)}: pass "
                "an object following kfac_hpc.checkpoint.contracts.CheckpointOptimizer "
                f"({', '.join(OPTIMIZER_MEMBERS.values())}), e.g. a torch.optim.Optimizer")
    return found


def agree(comm: Communicator, found: list[str], what: str) -> None:
    """Raise the same ``TypeError`` on every rank when any rank found a problem.

    Collective (every rank calls it, before anything else collective), so a rank
    handed an object that does not follow its contract never leaves the others waiting.

    Args:
        comm: The ranks of the save or load.
        found: This rank's :func:`problems`.
        what: The operation, for the message (e.g. ``"checkpoint save"``).

    Raises:
        TypeError: On every rank, when ``found`` is not empty on some rank.
    """
    everyone = comm.allgather_object(found)
    if not any(everyone):
        return
    lines: dict[str, list[int]] = {}
    for rank, rank_found in enumerate(everyone):
        for line in rank_found:
            lines.setdefault(line, []).append(rank)
    where = {line: "" if len(ranks) == comm.size else
             f" (rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))})"
             for line, ranks in lines.items()}
    raise TypeError(f"{what}: nothing was done: " +
                    "; ".join(f"{line}{where[line]}" for line in lines))
