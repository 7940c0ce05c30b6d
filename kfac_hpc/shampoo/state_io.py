"""Collect the per-block state of every owner on every rank (for ``state_dict()``).

:func:`describe_block_states` is the streaming variant used by checkpoint writers: one
``allgather_object`` of small metadata only; every rank gets every block's entries, with
its own tensors in place and :class:`RemoteTensor` placeholders (owner, shape, dtype)
for the others, so no rank ever holds the whole state (the owners send their blocks to
the writer one at a time, see ``kfac_hpc.checkpoint.writer``).

:func:`gather_block_states` (``state_dict()``): two collectives: an
``allgather_object`` of small metadata (block keys, entry names, dtypes, shapes,
Python scalars, byte counts), then one ``allgatherv`` of the raw bytes of every tensor.
Tensors come back on the CPU, as fresh tensors, in their own dtypes (bytes travel
as ``uint8``, so any dtype round-trips exactly).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from kfac_hpc.comm import Communicator

__all__ = ["RemoteTensor", "describe_block_states", "gather_block_states"]

Key = tuple[str, int]


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} in gathered optimizer state")
    return dtype


@dataclass(frozen=True)
class RemoteTensor:
    """Stands for a tensor of block state held by rank ``remote_owner``."""

    remote_owner: int
    shape: tuple[int, ...]
    dtype: str  # torch dtype name, e.g. "float32"

    @property
    def nbytes(self) -> int:
        """Bytes of the tensor it stands for."""
        n = 1
        for d in self.shape:
            n *= int(d)
        return n * _dtype(self.dtype).itemsize


def describe_block_states(comm: Communicator, local: Iterable[tuple[Key, dict[str, Any]]]
                          ) -> dict[Key, dict[str, Any]]:
    """Describe every block's state on every rank, other ranks' tensors as :class:`RemoteTensor`.

    Collective; metadata only. This rank's tensors are its live ones (not copies). Blocks
    come in the order of :func:`gather_block_states`.

    Args:
        comm: The ranks that hold the blocks.
        local: This rank's ``(key, state)`` pairs.

    Returns:
        Every block's state, by key, the same keys on every rank.
    """
    mine: dict[Key, dict[str, Any]] = {}
    meta: list[tuple[Key, list[tuple[Any, ...]]]] = []
    for key, state in local:
        mine[key] = state
        entries: list[tuple[Any, ...]] = []
        for name, value in state.items():
            if isinstance(value, Tensor):
                entries.append((name, "tensor", str(value.dtype).removeprefix("torch."),
                                tuple(value.shape)))
            else:
                entries.append((name, "value", value))
        meta.append((key, entries))
    metas = comm.allgather_object(meta)
    out: dict[Key, dict[str, Any]] = {}
    for rank, rank_meta in enumerate(metas):
        for key, entries in rank_meta:
            block: dict[str, Any] = {}
            for entry in entries:
                if entry[1] == "tensor":
                    name, _, dtype, shape = entry
                    block[name] = (mine[key][name] if rank == comm.rank
                                   else RemoteTensor(rank, tuple(shape), dtype))
                else:
                    block[entry[0]] = entry[2]
            out[(str(key[0]), int(key[1]))] = block
    return out


def gather_block_states(comm: Communicator,
                        local: Iterable[tuple[Key, dict[str, Any]]]) -> dict[Key, dict[str, Any]]:
    """Gather every rank's block states onto every rank (collective: all ranks must call it).

    Args:
        comm: The ranks that hold the blocks.
        local: This rank's ``(key, state)`` pairs.

    Returns:
        Every block's state, by key, with tensors on the CPU.
    """
    meta: list[tuple[Key, list[tuple[Any, ...]]]] = []
    chunks: list[Tensor] = []
    for key, state in local:
        entries: list[tuple[Any, ...]] = []
        for name, value in state.items():
            if isinstance(value, Tensor):
                t = value.detach().to("cpu").contiguous()
                raw = t.reshape(-1).view(torch.uint8)
                entries.append((name, "tensor", str(t.dtype).removeprefix("torch."),
                                tuple(t.shape), raw.numel()))
                chunks.append(raw)
            else:
                entries.append((name, "value", value))
        meta.append((key, entries))
    payload = torch.cat(chunks) if chunks else torch.empty(0, dtype=torch.uint8, device="cpu")
    metas = comm.allgather_object((meta, payload.numel()))
    gathered = comm.allgatherv(payload, [n for _, n in metas])
    out: dict[Key, dict[str, Any]] = {}
    offset = 0
    for rank_meta, _ in metas:
        for key, entries in rank_meta:
            block: dict[str, Any] = {}
            for entry in entries:
                if entry[1] == "tensor":
                    name, _, dtype, shape, nbytes = entry
                    raw = gathered[offset:offset + nbytes].clone()
                    block[name] = raw.view(_dtype(dtype)).reshape(shape)
                    offset += nbytes
                else:
                    block[entry[0]] = entry[2]
            out[(str(key[0]), int(key[1]))] = block
    return out
