"""Collect the per-block state of every owner on every rank (for ``state_dict()``).

Two collectives: an ``allgather_object`` of small metadata (block keys, entry names,
dtypes, shapes, Python scalars, byte counts), then one ``allgatherv`` of the raw
bytes of every tensor. Tensors come back on the CPU, as fresh tensors, in their
own dtypes (bytes travel as ``uint8``, so any dtype round-trips exactly).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from kfac_hpc.comm import Communicator

__all__ = ["gather_block_states"]

Key = tuple[str, int]


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} in gathered optimizer state")
    return dtype


def gather_block_states(comm: Communicator,
                        local: Iterable[tuple[Key, dict[str, Any]]]) -> dict[Key, dict[str, Any]]:
    """Every rank's block states, on every rank (collective: all ranks must call it)."""
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
