"""Which rank owns which block, and where each block's update travels in the gather.

Owners come from :func:`kfac_hpc.assignment.lpt_assign` over the blocks in their
global order (parameter order, then block index) with cost ``sum(d_i**3)`` (a vector
block left to grafting, ``precondition_vectors=False``, costs its elements): a pure
function of parameter names, shapes, the groups' ``max_preconditioner_dim`` and
``precondition_vectors`` and the world size, computed identically on every rank, so no
communication is needed to agree on it.

Wire layout of the one ``allgatherv`` per step (world size > 1): rank r sends
``1 + sum(numel of its blocks)`` elements: a status word (0 = fine, else a bit mask,
see :mod:`kfac_hpc.shampoo.errors`) followed by the updates of its blocks, grouped by
*kind* (blocks of one kind are batched together: same parameter group, shape and
dtype, see :mod:`.stacks`; kinds in order of first appearance, blocks of a kind in
global order), so that a batch's updates are one contiguous slice of the send
buffer. The layout never changes after construction, so the counts are known on
every rank and a rank owning no block still sends its status word.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from kfac_hpc.assignment import lpt_assign
from kfac_hpc.shampoo.blocking import BlockSpec

__all__ = ["Layout", "assign_owners"]


def assign_owners(blocks: Sequence[BlockSpec], world_size: int,
                  costs: Sequence[float] | None = None) -> dict[tuple[str, int], int]:
    """Assign every block an owner rank (LPT by cost, deterministic; ties by position).

    Args:
        blocks: Every block, in global order.
        world_size: The number of ranks.
        costs: Per block, its cost; None: :attr:`BlockSpec.cost` (``sum(d_i**3)``).

    Returns:
        The owner of every block, keyed ``(parameter name, block index)``.
    """
    weights = costs if costs is not None else [b.cost for b in blocks]
    return lpt_assign([(b.key, c) for b, c in zip(blocks, weights, strict=True)], world_size)


@dataclass(frozen=True)
class Layout:
    """Blocks, their owners, and their offsets in the gathered buffer."""

    blocks: tuple[BlockSpec, ...]  # global order
    owners: tuple[int, ...]  # owners[i] owns blocks[i]
    offsets: tuple[int, ...]  # offsets[i]: start of blocks[i]'s update in the gathered buffer
    counts: tuple[int, ...]  # elements sent by each rank (status word included)
    status_offsets: tuple[int, ...]  # where each rank's status word lands in the gathered buffer
    world_size: int
    costs: tuple[float, ...]  # costs[i]: the cost blocks[i] was assigned by

    @staticmethod
    def build(blocks: Sequence[BlockSpec], world_size: int,
              kinds: Sequence[Hashable] | None = None,
              costs: Sequence[float] | None = None) -> Layout:
        """Lay out ``blocks`` (global order) over ``world_size`` ranks.

        Args:
            blocks: every block, in global order.
            world_size: number of ranks.
            kinds: per block, its kind (equal kinds are contiguous in their owner's
                send buffer); None: every block its own kind (global order).
            costs: per block, the cost owners are balanced by; None:
                :attr:`BlockSpec.cost`.
        """
        costs = tuple(costs) if costs is not None else tuple(b.cost for b in blocks)
        owner_of = assign_owners(blocks, world_size, costs)
        owners = tuple(owner_of[b.key] for b in blocks)
        counts = [1] * world_size
        for b, r in zip(blocks, owners):
            counts[r] += b.numel
        starts = [0] * world_size
        for r in range(1, world_size):
            starts[r] = starts[r - 1] + counts[r - 1]
        first: dict[Hashable, int] = {}
        rank_of_kind = [first.setdefault(k, len(first))
                        for k in (kinds if kinds is not None else range(len(blocks)))]
        cursor = [s + 1 for s in starts]  # after each rank's status word
        offsets = [0] * len(blocks)
        for i in sorted(range(len(blocks)), key=lambda i: (rank_of_kind[i], i)):
            offsets[i] = cursor[owners[i]]
            cursor[owners[i]] += blocks[i].numel
        return Layout(tuple(blocks), owners, tuple(offsets), tuple(counts), tuple(starts),
                      world_size, costs)

    @property
    def total(self) -> int:
        """Elements of the gathered buffer."""
        return sum(self.counts)

    def owned(self, rank: int) -> list[int]:
        """List the indices (into :attr:`blocks`) of the blocks ``rank`` owns, in global order."""
        return [i for i, r in enumerate(self.owners) if r == rank]

    def span(self, i: int) -> slice:
        """Return where block ``i``'s update lies in the gathered buffer."""
        return slice(self.offsets[i], self.offsets[i] + self.blocks[i].numel)

    def local_span(self, i: int) -> slice:
        """Return where block ``i``'s update lies in its owner's send buffer."""
        start = self.offsets[i] - self.status_offsets[self.owners[i]]
        return slice(start, start + self.blocks[i].numel)

    def load(self) -> list[float]:
        """Return the total cost per rank (for inspection)."""
        loads = [0.0] * self.world_size
        for c, r in zip(self.costs, self.owners):
            loads[r] += c
        return loads
