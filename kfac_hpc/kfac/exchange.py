"""What travels in distributed K-FAC: fused messages laid out by a pure layout.

A :class:`Layout` says, for every sender (or receiver) slot, which named pieces go into
its part of one flat message and how many elements each has. Every rank builds the
same layout from the placement, so a message needs no headers.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from kfac_hpc.comm import Communicator, Handle


@dataclass(frozen=True)
class Layout:
    """Per slot, the ordered ``(key, numel)`` pieces of its part of a message."""

    parts: tuple[tuple[tuple[str, int], ...], ...]

    @staticmethod
    def of(parts: Sequence[Sequence[tuple[str, int]]]) -> Layout:
        return Layout(tuple(tuple(p) for p in parts))

    def counts(self) -> list[int]:
        return [sum(n for _, n in part) for part in self.parts]

    def pack(self, values: Mapping[str, Tensor], slots: Sequence[int] | None = None,
             dtype: torch.dtype | None = None) -> Tensor:
        """Concatenate the pieces of ``slots`` (default: all, in order) into one flat tensor."""
        chosen = range(len(self.parts)) if slots is None else slots
        pieces = [values[key].reshape(-1) for s in chosen for key, _ in self.parts[s]]
        if not pieces:
            return torch.empty(0, dtype=dtype or torch.float32)
        flat = torch.cat(pieces)
        return flat if dtype is None else flat.to(dtype)

    def unpack(self, flat: Tensor, slot: int) -> dict[str, Tensor]:
        """Views of ``flat`` (one slot's part) keyed by piece name."""
        out, offset = {}, 0
        for key, n in self.parts[slot]:
            out[key] = flat[offset:offset + n]
            offset += n
        if offset != flat.numel():
            raise RuntimeError(f"message of {flat.numel()} elements for a slot of {offset}")
        return out


def reduce_scatter_parts(comm: Communicator, layout: Layout, values: Mapping[str, Tensor],
                         dtype: torch.dtype) -> dict[str, Tensor]:
    """Sum every piece over ranks; rank r receives the pieces of slot r (one fused call)."""
    flat = layout.pack(values, dtype=dtype)
    mine = comm.reduce_scatter(flat, layout.counts(), "sum")
    return layout.unpack(mine, comm.rank)


def broadcast_parts(comm: Communicator, layout: Layout, produce: Callable[[], Mapping[str, Tensor]],
                    dtype: torch.dtype, like: Tensor) -> dict[str, Tensor]:
    """Every slot broadcasts its pieces to the whole communicator (one fused message each).

    Broadcasts are posted in slot order (the same on every rank); the receives for
    slots before this rank's are posted *before* ``produce()`` runs, so they progress
    while this rank computes its own pieces (e.g. decompositions).
    Returns the pieces of every slot, including this rank's own.
    """
    counts = layout.counts()
    handles: list[tuple[int, Handle[Tensor] | None]] = []

    def post(slot: int, buffer: Tensor) -> None:
        if counts[slot] == 0:
            handles.append((slot, None))
            return
        handles.append((slot, comm.ibroadcast(buffer, root=slot)))

    buffers = {s: torch.empty(counts[s], dtype=dtype, device=like.device)
               for s in range(comm.size) if s != comm.rank}
    for slot in range(comm.rank):
        post(slot, buffers[slot])
    own = produce()
    own_flat = layout.pack(own, [comm.rank], dtype=dtype)
    post(comm.rank, own_flat)
    for slot in range(comm.rank + 1, comm.size):
        post(slot, buffers[slot])
    result: dict[str, Tensor] = {}
    for slot, handle in handles:
        flat = handle.wait() if handle is not None else (
            own_flat if slot == comm.rank else buffers[slot])
        result.update(layout.unpack(flat, slot))
    return result
