"""SPD-KFAC pipelining: factor reductions start from the hooks, fused into buckets.

The bucket plan is fixed and identical on every rank: factor keys in the order the
hooks produce them (A in forward order, then G in backward order), cut into buckets
of at most ``bucket_cap_mb``. A bucket's non-blocking reduce-scatter is posted as soon
as all its factors hold their last micro-batch, and never before the buckets ahead of
it (non-blocking collectives must be posted in the same order on every rank). Every
hook also tests the requests in flight, which is what makes MPI progress while
backward runs. ``finish()`` at ``step()`` posts what is left and waits.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
from torch import Tensor

from kfac_hpc.comm import Communicator, Handle
from kfac_hpc.kfac.exchange import MessageLayout, Part, Piece, PieceKey
from kfac_hpc.kfac.layouts import bucket_plan
from kfac_hpc.kfac.placement import FactorKey
from kfac_hpc.phases import Traffic

PieceFn = Callable[[FactorKey], dict[PieceKey, Piece]]


class FactorPipeline:
    """Buckets of factor reductions posted from hooks and completed at ``finish()``."""

    def __init__(self, comm: Communicator, keys: Sequence[FactorKey],
                 owner: Mapping[FactorKey, int], numel: Mapping[FactorKey, int], *,
                 cap_bytes: int, dtype: torch.dtype, device: torch.device) -> None:
        """Cut ``keys`` into buckets and lay out their messages.

        Args:
            comm: The world communicator.
            keys: The non-local factors in readiness order.
            owner: Each factor's owner.
            numel: Each factor's elements on the wire.
            cap_bytes: The most bytes of one bucket.
            dtype: The factor dtype.
            device: Where messages live.
        """
        self.comm, self.dtype, self.device = comm, dtype, device
        self.buckets = bucket_plan(keys, numel, cap_bytes, dtype.itemsize)
        self.layouts: list[MessageLayout] = []
        for bucket in self.buckets:
            parts: list[list[tuple[PieceKey, int]]] = [[] for _ in range(comm.size)]
            for key in bucket:
                parts[owner[key]] += [(PieceKey(key, Part.FACTOR), numel[key]),
                                      (PieceKey(key, Part.COUNT), 1)]
            self.layouts.append(MessageLayout.of(parts))
        self._ready: set[FactorKey] = set()
        self._next = 0
        self._inflight: list[tuple[int, Handle[Tensor]]] = []

    def mark_ready(self, key: FactorKey, pieces: PieceFn) -> None:
        """``key`` holds its final statistics: post every bucket that is now complete."""
        self._ready.add(key)
        while self._next < len(self.buckets) and all(k in self._ready
                                                       for k in self.buckets[self._next]):
            self._post(self._next, pieces)
        self.progress()

    def progress(self) -> None:
        """Let MPI advance the reductions in flight (cheap; call from hooks)."""
        for _, handle in self._inflight:
            handle.test()

    def _post(self, b: int, pieces: PieceFn) -> None:
        values: dict[PieceKey, Piece] = {}
        for key in self.buckets[b]:
            values.update(pieces(key))
        layout = self.layouts[b]
        flat = layout.pack(values, dtype=self.dtype, device=self.device)
        with self.comm.stats.tagged(Traffic.FACTORS):  # posted from hooks, outside step()
            self._inflight.append((b, self.comm.ireduce_scatter(flat, layout.counts(), "sum")))
        self._next = b + 1

    def post_remaining(self, pieces: PieceFn) -> None:
        """Post the buckets the hooks did not (a layer that did not run on this rank).

        Before any other collective of the step: every rank then posts the buckets in
        their order ahead of it, whichever it posted from its hooks.
        """
        while self._next < len(self.buckets):
            self._post(self._next, pieces)

    def finish(self, pieces: PieceFn) -> dict[PieceKey, Tensor]:
        """Post the remaining buckets, wait for all; this rank's pieces."""
        self.post_remaining(pieces)
        out: dict[PieceKey, Tensor] = {}
        for b, handle in self._inflight:
            out.update(self.layouts[b].unpack(handle.wait(), self.comm.rank))
        self._inflight.clear()
        self._ready.clear()
        self._next = 0
        return out

    @property
    def posted_early(self) -> int:
        """Buckets posted before ``finish()`` in the current step (for tests/benchmarks)."""
        return self._next
