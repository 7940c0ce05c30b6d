"""What travels in distributed K-FAC: fused messages laid out by a pure layout.

A :class:`MessageLayout` says, for every sender (or receiver) slot, which pieces go into
its part of one flat message and how many elements each has. A piece is named by a typed
:class:`PieceKey`: *what* it belongs to (a :class:`~kfac_hpc.kfac.placement.FactorKey`
or a layer name) and *which part* it is (:class:`Part`: the factor, its count, a
decomposition's Q, λ or inverse, a valid flag, ...). Every rank builds the same layout
from the placement, so a message needs no headers and no strings are parsed.

Device rule: a message lives on the device of the data it carries (the model's). Every
tensor made here names that device; scalar pieces (counts, valid flags) are given as
Python numbers and written on the message's device, and :func:`read_scalars` brings a
message's scalars back to the host in one transfer (one synchronisation, not one per
piece).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import NamedTuple

import torch
from torch import Tensor

from kfac_hpc.comm import Communicator, Handle
from kfac_hpc.kfac.placement import FactorKey

Piece = Tensor | float


class Part(Enum):
    """Which part of a factor's or a layer's data a message piece is."""

    FACTOR = "factor"  # a factor's statistics sum or running average (packed on the wire)
    COUNT = "count"  # how many micro-batch factors were summed (or ranks that folded)
    UPDATES = "updates"  # factor updates so far (local-factor replicas at load)
    Q = "Q"  # eigenbasis of a factor (compute_method="eigen"); low rank: k_cap columns
    LAMBDA = "lambda"  # eigenvalues (clamped at 0); low rank: the k_cap largest, 0-padded
    RHO = "rho"  # low rank: the one eigenvalue of the orthogonal complement
    RANK = "rank"  # low rank: how many of the k_cap columns are used (the energy rule)
    INV = "inv"  # damped inverse (compute_method="inverse")
    VALID = "valid"  # 1.0 when the decomposition or gradient next to it is usable
    GRADIENT = "gradient"  # a layer's preconditioned gradient (g x a)


class PieceKey(NamedTuple):
    """One piece of a message: ``part`` of ``subject`` (a factor, or a layer by name)."""

    subject: FactorKey | str
    part: Part


def _flat(value: Piece, dtype: torch.dtype, device: torch.device) -> Tensor:
    if isinstance(value, Tensor):
        if value.device != device:
            raise RuntimeError(f"message piece on {value.device}, message on {device}: every "
                               "piece must live on the model's device")
        return value.reshape(-1).to(dtype)
    return torch.full((1,), float(value), dtype=dtype, device=device)


def own_copy(piece: Tensor) -> Tensor:
    """``piece`` copied into an allocation of its own, contiguous (row-major).

    What a preconditioner keeps between steps (its decompositions) is kept this way,
    whatever it came from: a view into a message buffer (at an offset that depends on
    the pieces before it), a solver's column-major eigenvectors, one matrix of a batched
    solve, or a tensor restored from a checkpoint. Every tensor then starts where the
    allocator starts one (64-byte aligned on the CPU) with the same strides in the run
    that saved and in a run resumed from its checkpoint, so a BLAS that picks its
    kernel by alignment or strides (MKL does, unless ``MKL_CBWR`` pins one) computes
    the same bits in both. One copy per piece, made when the decomposition is taken.
    """
    return piece.clone(memory_format=torch.contiguous_format)


def read_scalars(pieces: Mapping[PieceKey, Piece], keys: Iterable[PieceKey]) -> list[float]:
    """The one-element pieces ``keys`` as numbers, in one device-to-host transfer."""
    chosen = [pieces[k] for k in keys]
    tensors = [p.reshape(-1) for p in chosen if isinstance(p, Tensor)]
    values = iter(torch.cat(tensors).tolist() if tensors else [])
    return [next(values) if isinstance(p, Tensor) else float(p) for p in chosen]


@dataclass(frozen=True)
class MessageLayout:
    """Per slot, the ordered ``(key, numel)`` pieces of its part of a message."""

    parts: tuple[tuple[tuple[PieceKey, int], ...], ...]

    @staticmethod
    def of(parts: Sequence[Sequence[tuple[PieceKey, int]]]) -> MessageLayout:
        """Build a layout from per-slot lists of ``(key, numel)`` pieces."""
        return MessageLayout(tuple(tuple(p) for p in parts))

    def counts(self) -> list[int]:
        """Return the elements of each slot."""
        return [sum(n for _, n in part) for part in self.parts]

    def pack(self, values: Mapping[PieceKey, Piece], *, dtype: torch.dtype, device: torch.device,
             slots: Sequence[int] | None = None) -> Tensor:
        """Concatenate the pieces of ``slots`` into one flat tensor.

        Concatenate the pieces of ``slots`` (default: all, in order) into one flat
        ``dtype`` tensor on ``device``; a number is a one-element piece.
        """
        chosen = range(len(self.parts)) if slots is None else slots
        pieces = [_flat(values[key], dtype, device) for s in chosen for key, _ in self.parts[s]]
        if not pieces:
            return torch.empty(0, dtype=dtype, device=device)
        return torch.cat(pieces)

    def unpack(self, flat: Tensor, slot: int) -> dict[PieceKey, Tensor]:
        """Views of ``flat`` (one slot's part) keyed by piece."""
        out: dict[PieceKey, Tensor] = {}
        offset = 0
        for key, n in self.parts[slot]:
            out[key] = flat[offset:offset + n]
            offset += n
        if offset != flat.numel():
            raise RuntimeError(f"message of {flat.numel()} elements for a slot of {offset}")
        return out


def reduce_scatter_parts(comm: Communicator, layout: MessageLayout,
                         values: Mapping[PieceKey, Piece], dtype: torch.dtype,
                         device: torch.device) -> dict[PieceKey, Tensor]:
    """Sum every piece over ranks; rank r receives the pieces of slot r (one fused call)."""
    flat = layout.pack(values, dtype=dtype, device=device)
    mine = comm.reduce_scatter(flat, layout.counts(), "sum")
    return layout.unpack(mine, comm.rank)


def broadcast_parts(comm: Communicator, layout: MessageLayout,
                    produce: Callable[[], Mapping[PieceKey, Piece]],
                    dtype: torch.dtype, device: torch.device) -> dict[PieceKey, Tensor]:
    """Every slot broadcasts its pieces to the whole communicator (one fused message each).

    Broadcasts are posted in slot order (the same on every rank); the receives for
    slots before this rank's are posted *before* ``produce()`` runs, so they progress
    while this rank computes its own pieces (e.g. decompositions).
    Returns the pieces of every slot, including this rank's own. On one rank nothing
    travels: the produced pieces come back flat, without a packed copy.
    """
    if comm.size == 1:
        own = produce()
        out = {key: _flat(own[key], dtype, device) for key, _ in layout.parts[0]}
        wrong = [key for key, n in layout.parts[0] if out[key].numel() != n]
        if wrong:
            raise RuntimeError(f"message pieces {wrong} do not have their layout's sizes")
        return out
    counts = layout.counts()
    handles: list[tuple[int, Handle[Tensor] | None]] = []

    def post(slot: int, buffer: Tensor) -> None:
        if counts[slot] == 0:
            handles.append((slot, None))
            return
        handles.append((slot, comm.ibroadcast(buffer, root=slot)))

    buffers = {s: torch.empty(counts[s], dtype=dtype, device=device)
               for s in range(comm.size) if s != comm.rank}
    for slot in range(comm.rank):
        post(slot, buffers[slot])
    own = produce()
    own_flat = layout.pack(own, slots=[comm.rank], dtype=dtype, device=device)
    post(comm.rank, own_flat)
    for slot in range(comm.rank + 1, comm.size):
        post(slot, buffers[slot])
    result: dict[PieceKey, Tensor] = {}
    for slot, handle in handles:
        flat = handle.wait() if handle is not None else (
            own_flat if slot == comm.rank else buffers[slot])
        result.update(layout.unpack(flat, slot))
    return result
