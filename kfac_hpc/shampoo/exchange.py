"""How the owners' block directions reach the ranks that apply them.

:class:`GatherExchange` (world size > 1): every owner writes each batch of directions
(one run of same-kind blocks, see :mod:`.stacks`) into its contiguous slice of the
send buffer, in ``communication_dtype``, with its status word in front; one
``allgatherv`` gives every rank every direction. A failed block is filled with NaN,
so every rank can name it.

:class:`LocalExchange` (world size 1): nothing travels. The batches are applied where
they are: no gather, no staging through host memory, no packing copy. (Only where
``communication_dtype`` differs from the parameters' is a batch rounded to it and
back, so one rank applies the values that several would.) Failed blocks are known
from the per-block flags, read on the host only when the status reports a failure.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import cast

import torch
from torch import Tensor

from kfac_hpc.comm import Communicator
from kfac_hpc.shampoo.ownership import Layout
from kfac_hpc.shampoo.stacks import Run

__all__ = ["DirectionExchange", "GatherExchange", "LocalExchange", "make_exchange"]


class DirectionExchange(ABC):
    """What one step does with the directions this rank computed."""

    def __init__(self, layout: Layout, dtype: torch.dtype) -> None:
        """Make the exchange of ``layout``'s blocks.

        Args:
            layout: Blocks, owners and gather offsets.
            dtype: The ``communication_dtype`` directions travel in.
        """
        self.layout = layout
        self.dtype = dtype

    @abstractmethod
    def begin(self) -> None:
        """Start a step: forget the previous one's directions and flags."""

    @abstractmethod
    def put(self, run: Run, direction: Tensor) -> Tensor:
        """Hand over a run's directions ``(n, *shape)``.

        Args:
            run: The run the directions belong to.
            direction: One direction per block of the run.

        Returns:
            The directions as every rank will apply them, ``(n, numel)`` in
            ``communication_dtype``.
        """

    @abstractmethod
    def fail_rows(self, run: Run, stat_marks: Tensor, update_marks: Tensor) -> None:
        """Mark the run's blocks whose statistics or direction are not finite as failed.

        Args:
            run: The run.
            stat_marks: ``(n,)`` on the device: 0 where the statistics are finite, else NaN.
            update_marks: ``(n,)`` on the device: 0 where the direction is finite, else NaN;
                no host read.
        """

    @abstractmethod
    def fail_block(self, index: int) -> None:
        """Mark the block ``index`` as failed (a failure known on the host)."""

    @abstractmethod
    def exchange(self, status: Tensor | int) -> Tensor | None:
        """Finish the step (collective where directions travel).

        Args:
            status: This rank's status word (a device tensor, or an int when nothing ran on
                the device).

        Returns:
            Every rank's status word, in rank order, on the device; None when there is
            nothing to read.
        """

    @abstractmethod
    def failed_blocks(self, ranks: list[int], stepped: set[int]) -> list[int]:
        """List, after a failure, the failed blocks owned by ``ranks`` among the ``stepped`` ones.

        Reads device memory on the host.

        Args:
            ranks: The ranks whose status word reported a failure.
            stepped: Indices of the blocks that took this step.

        Returns:
            Block indices, in global order.
        """

    @abstractmethod
    def update(self, index: int, dtype: torch.dtype) -> Tensor:
        """Return block ``index``'s direction, shaped like the block, in ``dtype``."""

    def tensors(self) -> dict[str, Tensor]:
        """Return the buffers it holds, by name."""
        return {}

    def held_directions_bytes(self) -> int:
        """Bytes of the last step's directions it holds until the next step.

        Besides :meth:`tensors`.
        """
        return 0

    def kept(self) -> object:
        """What the step's :meth:`put` and flag calls left on the host (None: nothing).

        A captured step (``cuda_graphs``) runs no Python when replayed: it gives this back
        to :meth:`restore` after each replay (its tensors hold the replay's values).
        """
        return None

    def restore(self, kept: object) -> None:
        """Take back what :meth:`kept` returned (after :meth:`begin`); nothing by default."""
        del kept  # the buffers hold everything: nothing is kept on the host


class LocalExchange(DirectionExchange):
    """World size 1: the directions stay where they were computed."""

    def __init__(self, layout: Layout, dtype: torch.dtype) -> None:
        """Make the exchange of one rank; see :class:`DirectionExchange`."""
        super().__init__(layout, dtype)
        self._rows: dict[int, Tensor] = {}
        self._flags: list[tuple[list[int], Tensor, Tensor]] = []
        self._failed: set[int] = set()

    def begin(self) -> None:
        """Forget the previous step's directions and flags."""
        self._rows.clear()
        self._flags.clear()
        self._failed.clear()

    def held_directions_bytes(self) -> int:
        """Bytes of the storages of the directions kept (each storage once)."""
        storages = {row.untyped_storage().data_ptr(): row.untyped_storage().nbytes()
                    for row in self._rows.values()}
        return sum(storages.values())

    def put(self, run: Run, direction: Tensor) -> Tensor:
        """Keep the directions, rounded through ``communication_dtype`` as they would travel."""
        sent = direction.to(self.dtype)  # no copy unless communication_dtype differs
        applied = sent.to(direction.dtype)
        for index, row in zip(run.members, applied.unbind(0)):
            self._rows[index] = row
        return sent.flatten(1)

    def fail_rows(self, run: Run, stat_marks: Tensor, update_marks: Tensor) -> None:
        """Keep the marks; they are read on the host only after a failure."""
        self._flags.append((run.members, stat_marks, update_marks))  # read on failure only

    def fail_block(self, index: int) -> None:
        """Remember block ``index`` as failed."""
        self._failed.add(index)

    def exchange(self, status: Tensor | int) -> Tensor | None:
        """Return this rank's status word as a one-element tensor (None for an int: nothing ran)."""
        return status.reshape(1) if isinstance(status, Tensor) else None

    def failed_blocks(self, ranks: list[int], stepped: set[int]) -> list[int]:
        """List the stepped blocks marked failed, reading the kept marks on the host."""
        failed = set(self._failed)
        for members, stats, update in self._flags:
            failed.update(i for i, mark in zip(members, (stats + update).tolist()) if mark != 0)
        return sorted(failed & stepped)

    def update(self, index: int, dtype: torch.dtype) -> Tensor:
        """Return the kept direction of block ``index`` in ``dtype``."""
        row = self._rows[index]  # block-shaped, in its parameter's dtype already
        return row if row.dtype == dtype else row.to(dtype)

    def kept(self) -> object:
        """The directions and flags kept this step (copies of the containers)."""
        return dict(self._rows), list(self._flags), set(self._failed)

    def restore(self, kept: object) -> None:
        """Keep again what :meth:`kept` returned."""
        rows, flags, failed = cast(tuple[dict[int, Tensor], list[tuple[list[int], Tensor,
                                                                        Tensor]], set[int]], kept)
        self._rows, self._flags, self._failed = dict(rows), list(flags), set(failed)


class GatherExchange(DirectionExchange):
    """World size > 1: one ``allgatherv`` of every owner's directions and status word."""

    def __init__(self, layout: Layout, dtype: torch.dtype, comm: Communicator,
                 device: torch.device) -> None:
        """Allocate the send and receive buffers of the gather.

        Args:
            layout: Blocks, owners and gather offsets.
            dtype: The ``communication_dtype`` directions travel in.
            comm: The ranks that gather.
            device: Where the buffers live.
        """
        super().__init__(layout, dtype)
        self.comm = comm
        self.send = torch.zeros(layout.counts[comm.rank], dtype=dtype, device=device)
        self.recv = torch.zeros(layout.total, dtype=dtype, device=device)
        self.status_at = torch.tensor(layout.status_offsets, device=device)
        self._as: dict[torch.dtype, Tensor] = {}

    def begin(self) -> None:
        """Forget the previous step's converted copies of the receive buffer."""
        self._as.clear()

    def _slot(self, run: Run) -> Tensor:
        first = self.layout.local_span(run.members[0]).start
        numel = math.prod(run.stack.shape)
        return self.send[first:first + run.size * numel].view(run.size, numel)

    def put(self, run: Run, direction: Tensor) -> Tensor:
        """Copy the directions into this rank's send buffer; return that slot."""
        slot = self._slot(run)
        slot.view(direction.shape).copy_(direction)
        return slot

    def fail_rows(self, run: Run, stat_marks: Tensor, update_marks: Tensor) -> None:
        """Fill the failed blocks' slots with NaN: every rank sees the failure after the gather."""
        failed = (stat_marks + update_marks).ne(0)  # NaN ≠ 0
        self._slot(run).masked_fill_(failed.unsqueeze(1), math.nan)

    def fail_block(self, index: int) -> None:
        """Fill block ``index``'s slot with NaN."""
        self.send[self.layout.local_span(index)].fill_(math.nan)

    def exchange(self, status: Tensor | int) -> Tensor:
        """Gather every rank's directions and status word (collective: one ``allgatherv``)."""
        self.send[0] = status  # a device-to-device copy for a tensor: no host sync
        self.comm.allgatherv(self.send, self.layout.counts, out=self.recv)
        return self.recv[self.status_at]

    def failed_blocks(self, ranks: list[int], stepped: set[int]) -> list[int]:
        """List the stepped blocks of ``ranks`` whose gathered direction is not finite (host)."""
        layout = self.layout
        return [i for rank in ranks for i in layout.owned(rank)
                if i in stepped and not bool(self.recv[layout.span(i)].isfinite().all())]

    def update(self, index: int, dtype: torch.dtype) -> Tensor:
        """Return block ``index``'s gathered direction in ``dtype`` (one conversion per dtype)."""
        received = self._as.get(dtype)
        if received is None:  # one conversion of the whole buffer per parameter dtype
            received = self._as[dtype] = self.recv.to(dtype)
        return received[self.layout.span(index)].view(self.layout.blocks[index].shape)

    def tensors(self) -> dict[str, Tensor]:
        """Return the send and receive buffers and the status offsets."""
        return {"send buffer": self.send, "receive buffer": self.recv,
                "status offsets": self.status_at}


def make_exchange(layout: Layout, dtype: torch.dtype, comm: Communicator,
                  device: torch.device) -> DirectionExchange:
    """Make a :class:`LocalExchange` on one rank, else a :class:`GatherExchange`.

    Args:
        layout: Blocks, owners and gather offsets.
        dtype: The ``communication_dtype`` directions travel in.
        comm: The ranks that gather.
        device: Where the buffers live.

    Returns:
        The exchange.
    """
    if comm.size == 1:
        return LocalExchange(layout, dtype)
    return GatherExchange(layout, dtype, comm, device)
