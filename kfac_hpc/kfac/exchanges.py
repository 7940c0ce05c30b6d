"""The exchanges of one K-FAC step: each sends one kind of message by its layout.

* :class:`FactorExchange` — batch factor sums (or local averages) to their owners: one
  fused reduce-scatter of the non-local factors (or ``overlap``'s buckets, posted from
  the hooks by a :class:`~kfac_hpc.kfac.pipeline.FactorPipeline`) and one allreduce of
  the local ones; tagged :attr:`~kfac_hpc.phases.Traffic.FACTORS`.
* :class:`DecompositionExchange` — owners broadcast decompositions in their worker
  group (one fused message per owner); tagged ``Traffic.DECOMPOSITIONS``.
* :class:`GradientExchange` — gradient workers broadcast preconditioned gradients in
  their receiver group; tagged ``Traffic.GRADIENTS`` (timed as ``Phase.KFAC_GRADIENTS``).
* :class:`ReplicaExchange` — after a load, owners of local factors send them to the
  layer's other gradient workers.

Layouts come from :mod:`kfac_hpc.kfac.layouts` (the planner counts bytes with the same
functions). Every rank builds the same layouts, so a message needs no header.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import torch
from torch import Tensor

from kfac_hpc.comm import Communicator, pack_upper, unpack_upper
from kfac_hpc.kfac.decomposer import Decomposer, Held
from kfac_hpc.kfac.exchange import (
    Part,
    Piece,
    PieceKey,
    broadcast_parts,
    read_scalars,
    reduce_scatter_parts,
)
from kfac_hpc.kfac.factor_store import FactorStore
from kfac_hpc.kfac.layouts import (
    LayerDims,
    decomposition_layout,
    factor_dim,
    factor_keys,
    factor_layout,
    gradient_layout,
    group_factor_keys,
    local_factor_keys,
    local_factor_layout,
    replica_layout,
)
from kfac_hpc.kfac.pipeline import FactorPipeline
from kfac_hpc.kfac.placement import FactorKey, Placement
from kfac_hpc.phases import Phase, PhaseTimer, Traffic, timed

__all__ = ["DecompositionExchange", "FactorExchange", "GradientExchange", "ReplicaExchange"]

PieceFn = Callable[[FactorKey], dict[PieceKey, Piece]]


def _merge(dicts: Iterable[Mapping[PieceKey, Piece]]) -> dict[PieceKey, Piece]:
    out: dict[PieceKey, Piece] = {}
    for d in dicts:
        out.update(d)
    return out


class FactorExchange:
    """Factor sums to their owners (see the module docstring)."""

    def __init__(self, comm: Communicator, placement: Placement, dims: LayerDims, *,
                 symmetric_packing: bool, dtype: torch.dtype, device: torch.device,
                 pipeline: FactorPipeline | None = None) -> None:
        """Lay out the factor messages.

        Args:
            comm: The world communicator.
            placement: Owners and groups.
            dims: The layers' factor dimensions.
            symmetric_packing: Whether factors travel as upper triangles.
            dtype: The factor dtype (of the messages).
            device: Where messages live.
            pipeline: ``overlap``'s buckets, or ``None``.
        """
        self.comm, self.dims, self.pipeline = comm, dims, pipeline
        self.symmetric_packing, self.dtype, self.device = symmetric_packing, dtype, device
        self.layout = factor_layout(placement, dims, symmetric_packing)
        self.local_layout = local_factor_layout(placement, dims, symmetric_packing)
        self.local_keys = local_factor_keys(placement, dims)
        self.keys = [k for k in factor_keys(dims) if k not in placement.local_factors]

    def pieces(self, key: FactorKey, total: Tensor, count: float) -> dict[PieceKey, Piece]:
        """What a rank sends for factor ``key``: its (packed) matrix and its count.

        Args:
            key: The factor.
            total: Its sum (or local average).
            count: Its count (micro-batches summed, or 1.0 when a local average holds
                updates).

        Returns:
            Its message pieces.
        """
        return {PieceKey(key, Part.FACTOR): pack_upper(total) if self.symmetric_packing
                else total, PieceKey(key, Part.COUNT): count}

    def reduce(self, values: PieceFn) -> dict[PieceKey, Tensor]:
        """Sum every rank's pieces onto the owners (local factors onto every rank).

        The local factors' allreduce is posted first and completes while the
        reduce-scatter (or the pipeline's last buckets) runs.

        Args:
            values: A factor's pieces on this rank (:meth:`pieces`).

        Returns:
            The summed pieces this rank receives.
        """
        with self.comm.stats.tagged(Traffic.FACTORS):
            local = self._post_local(_merge(map(values, self.local_keys)))
            if self.pipeline is not None:
                mine = self.pipeline.finish(values)
            else:
                mine = reduce_scatter_parts(self.comm, self.layout,
                                            _merge(map(values, self.keys)), self.dtype,
                                            self.device)
            mine.update(local())
        return mine

    def _post_local(self, values: Mapping[PieceKey, Piece]
                    ) -> Callable[[], dict[PieceKey, Tensor]]:
        """Local (small) factors: one fused allreduce, posted now (non-blocking)."""
        if not self.local_keys:
            return dict
        flat = self.local_layout.pack(values, dtype=self.dtype, device=self.device)
        handle = self.comm.iallreduce(flat, "sum")
        return lambda: self.local_layout.unpack(handle.wait(), 0)

    def received(self, mine: Mapping[PieceKey, Tensor], keys: Iterable[FactorKey]
                 ) -> dict[FactorKey, tuple[Tensor, int]]:
        """The summed factors ``keys`` as matrices with their counts (one host read).

        Args:
            mine: What :meth:`reduce` returned.
            keys: The factors this rank holds.

        Returns:
            Per factor, its summed ``n x n`` matrix and count.
        """
        keys = list(keys)
        counts = read_scalars(mine, [PieceKey(key, Part.COUNT) for key in keys])
        return {key: (self._from_wire(key, mine[PieceKey(key, Part.FACTOR)]), round(count))
                for key, count in zip(keys, counts)}

    def _from_wire(self, key: FactorKey, flat: Tensor) -> Tensor:
        n = factor_dim(self.dims, key)
        return unpack_upper(flat, n) if self.symmetric_packing else flat.view(n, n)


class DecompositionExchange:
    """Decompositions broadcast inside this rank's worker group."""

    def __init__(self, comm: Communicator, placement: Placement, dims: LayerDims,
                 decomposer: Decomposer, rank: int, *, dtype: torch.dtype,
                 device: torch.device) -> None:
        """Lay out this rank's worker-group broadcasts.

        Args:
            comm: The worker-group communicator.
            placement: Owners and groups.
            dims: The layers' factor dimensions.
            decomposer: What a decomposition is made of.
            rank: This rank in the world.
            dtype: The dtype of decompositions (``inv_dtype``).
            device: Where messages live.
        """
        self.comm, self.dims, self.decomposer = comm, dims, decomposer
        self.dtype, self.device = dtype, device
        group = placement.worker_group_of_rank(rank)
        self.keys = group_factor_keys(placement, dims, group)
        self.layout = decomposition_layout(placement, dims, decomposer, group)
        self.restore_layout = decomposition_layout(placement, dims, decomposer, group,
                                                   restore=True)

    def broadcast(self, produce: Callable[[], Mapping[PieceKey, Piece]],
                  local: Callable[[], Mapping[PieceKey, Piece]], *,
                  restore: bool = False) -> dict[PieceKey, Piece]:
        """Broadcast what ``produce()`` gives and add ``local()``'s pieces.

        Args:
            produce: The decompositions of the factors this rank owns (with
                ``restore``, its local ones too); called after the receives of the
                slots before this rank's are posted.
            local: The decompositions of local factors this rank computes itself.
            restore: Use the layout with local factors (a restore after a load).

        Returns:
            Every piece of the group's decompositions.
        """
        layout = self.restore_layout if restore else self.layout
        with self.comm.stats.tagged(Traffic.DECOMPOSITIONS):
            pieces = broadcast_parts(self.comm, layout, produce, self.dtype, self.device)
        return {**pieces, **local()}

    def keep(self, pieces: Mapping[PieceKey, Piece]) -> dict[FactorKey, Held]:
        """Return the valid decompositions of this group's factors, as kept.

        The valid decompositions of this group's factors, as the decomposer keeps
        them (valid flags and chosen ranks read back in one transfer).

        Args:
            pieces: What :meth:`broadcast` returned.

        Returns:
            Per factor with a valid decomposition, its kept form.
        """
        extra = [p for key in self.keys
                 for p in self.decomposer.readback(key, factor_dim(self.dims, key))]
        scalars = read_scalars(pieces, [PieceKey(key, Part.VALID) for key in self.keys] + extra)
        chosen = dict(zip(extra, scalars[len(self.keys):]))
        received: Mapping[PieceKey, Tensor] = pieces  # type: ignore[assignment]
        return {key: self.decomposer.keep(key, factor_dim(self.dims, key), received, chosen)
                for key, ok in zip(self.keys, scalars[:len(self.keys)]) if ok}


class GradientExchange:
    """Preconditioned gradients broadcast in the receiver groups (fused per sender)."""

    def __init__(self, comm: Communicator, placement: Placement, dims: LayerDims, *,
                 dtype: torch.dtype, device: torch.device) -> None:
        """Lay out the receiver-group broadcasts.

        Args:
            comm: The receiver-group communicator.
            placement: Owners and groups.
            dims: The layers' factor dimensions.
            dtype: The dtype of preconditioned gradients (``inv_dtype``).
            device: Where messages live.
        """
        self.comm, self.dims, self.dtype, self.device = comm, dims, dtype, device
        self.layout = gradient_layout(placement, dims)
        self.needed = placement.n_groups > 1
        # the layers of this rank's slot: the only pieces it packs (and zero-fills)
        self._slot_layers = ([str(key.subject) for key, _ in self.layout.parts[comm.rank]
                              if key.part == Part.GRADIENT] if self.needed else [])
        self.phase_timer: PhaseTimer | None = None  # times share() (kfac_hpc.phases)

    @timed(Phase.KFAC_GRADIENTS)
    def share(self, mine: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """Every layer's preconditioned gradient, from its gradient worker.

        Args:
            mine: The layers this rank preconditioned.

        Returns:
            Every layer that some worker preconditioned (``mine`` itself with one
            worker group).
        """
        if not self.needed:
            return dict(mine)
        values: dict[PieceKey, Piece] = {}
        for name in self._slot_layers:
            a, g = self.dims[name]
            v = mine.get(name)
            values[PieceKey(name, Part.GRADIENT)] = v if v is not None else torch.zeros(
                g, a, dtype=self.dtype, device=self.device)
            values[PieceKey(name, Part.VALID)] = 1.0 if v is not None else 0.0
        with self.comm.stats.tagged(Traffic.GRADIENTS):
            pieces = broadcast_parts(self.comm, self.layout, lambda: values, self.dtype,
                                     self.device)
        valid = read_scalars(pieces, [PieceKey(name, Part.VALID) for name in self.dims])
        return {name: pieces[PieceKey(name, Part.GRADIENT)].view(g, a).clone()
                for (name, (a, g)), ok in zip(self.dims.items(), valid) if ok}


class ReplicaExchange:
    """Send local factors to the layer's other gradient workers (after a load).

    Owners of local factors send them (and their counts) to the other gradient workers of the layer.
    """

    def __init__(self, comm: Communicator, placement: Placement, dims: LayerDims,
                 rank: int) -> None:
        """Lay out the replica broadcasts of this rank's worker group.

        Args:
            comm: The worker-group communicator.
            placement: Owners and groups.
            dims: The layers' factor dimensions.
            rank: This rank in the world.
        """
        self.comm, self.dims, self.rank = comm, dims, rank
        self.placement = placement
        self.layout = replica_layout(placement, dims, placement.worker_group_of_rank(rank))

    def share(self, store: FactorStore) -> None:
        """Fill ``store``'s replicas of local factors from their owners.

        Args:
            store: This rank's factors (the owned ones are sent).
        """
        if not self.placement.local_factors:
            return
        local = self.placement.local_factors

        def own() -> dict[PieceKey, Piece]:
            out: dict[PieceKey, Piece] = {}
            for key, s in store.owned().items():
                if key in local:
                    out[PieceKey(key, Part.FACTOR)] = s.average if s.average is not None \
                        else store.zeros(s.dim)
                    out[PieceKey(key, Part.UPDATES)] = float(s.updates)
            return out

        pieces = broadcast_parts(self.comm, self.layout, own, store.dtype, store.device)
        replicas = [key for key in store.states
                    if key in local and self.placement.factor_owner[key] != self.rank]
        updates = read_scalars(pieces, [PieceKey(key, Part.UPDATES) for key in replicas])
        for key, count in zip(replicas, updates):
            n = factor_dim(self.dims, key)
            store.set_replica(key, pieces[PieceKey(key, Part.FACTOR)].view(n, n).clone()
                              if round(count) else None, round(count))
