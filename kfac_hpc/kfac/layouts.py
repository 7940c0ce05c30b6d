"""The message layouts of distributed K-FAC, from the placement alone.

Each function lays out one kind of message as a
:class:`~kfac_hpc.kfac.exchange.MessageLayout` from the placement, the layers'
dimensions and (for decompositions) the :class:`~kfac_hpc.kfac.decomposer.Decomposer`.
The exchanges (:mod:`kfac_hpc.kfac.exchanges`) send by these layouts and the planner
(:mod:`kfac_hpc.plan.distribution`) counts their bytes from the same functions, so a change of
what travels changes both. Pure: no communication, no tensors.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from kfac_hpc.comm.fusion import buckets_by_size, triu_count
from kfac_hpc.kfac.decomposer import Decomposer
from kfac_hpc.kfac.exchange import MessageLayout, Part, PieceKey
from kfac_hpc.kfac.placement import FACTORS, FactorKey, Placement

__all__ = [
    "LayerDims",
    "bucket_plan",
    "decomposition_layout",
    "factor_dim",
    "factor_keys",
    "factor_layout",
    "factor_pieces",
    "factor_wire_numel",
    "gradient_layout",
    "group_factor_keys",
    "local_factor_keys",
    "local_factor_layout",
    "readiness_order",
    "replica_layout",
]

LayerDims = Mapping[str, tuple[int, int]]  # layer -> (a_dim, g_dim), in model order
Pieces = list[tuple[PieceKey, int]]


def factor_keys(dims: LayerDims) -> list[FactorKey]:
    """Every factor in model order (A, G of each layer).

    Args:
        dims: The layers' factor dimensions.

    Returns:
        The factor keys.
    """
    return [FactorKey(n, f) for n in dims for f in FACTORS]


def factor_dim(dims: LayerDims, key: FactorKey) -> int:
    """The dimension ``n`` of the ``n x n`` factor ``key``.

    Args:
        dims: The layers' factor dimensions.
        key: A factor.

    Returns:
        Its dimension.
    """
    a, g = dims[key.layer]
    return a if key.factor == "A" else g


def local_factor_keys(placement: Placement, dims: LayerDims) -> list[FactorKey]:
    """The local (small) factors, which every gradient worker of their layer keeps.

    Args:
        placement: Owners and groups.
        dims: The layers' factor dimensions.

    Returns:
        Their keys in model order.
    """
    return [k for k in factor_keys(dims) if k in placement.local_factors]


def readiness_order(dims: LayerDims) -> list[FactorKey]:
    """Factor keys in the order the hooks complete them: A forward, then G backward.

    Args:
        dims: The layers' factor dimensions.

    Returns:
        The keys in that order.
    """
    names = list(dims)
    return [FactorKey(n, "A") for n in names] + [FactorKey(n, "G") for n in names[::-1]]


def factor_wire_numel(n: int, symmetric_packing: bool) -> int:
    """Elements of an ``n x n`` factor on the wire (its upper triangle when packed).

    Args:
        n: The factor's dimension.
        symmetric_packing: Whether factors travel as upper triangles.

    Returns:
        ``n(n+1)/2`` or ``n²``.
    """
    return triu_count(n) if symmetric_packing else n * n


def factor_pieces(key: FactorKey, n: int, symmetric_packing: bool) -> Pieces:
    """A factor in a factor message: its (packed) matrix and its count.

    Args:
        key: The factor.
        n: Its dimension.
        symmetric_packing: Whether factors travel as upper triangles.

    Returns:
        Its pieces and their sizes.
    """
    return [(PieceKey(key, Part.FACTOR), factor_wire_numel(n, symmetric_packing)),
            (PieceKey(key, Part.COUNT), 1)]


def factor_layout(placement: Placement, dims: LayerDims, symmetric_packing: bool
                  ) -> MessageLayout:
    """The factor reduce-scatter: per rank, the non-local factors it owns.

    Args:
        placement: Owners and groups.
        dims: The layers' factor dimensions.
        symmetric_packing: Whether factors travel as upper triangles.

    Returns:
        One slot per rank of the world.
    """
    parts: list[Pieces] = [[] for _ in range(placement.world_size)]
    for key in factor_keys(dims):
        if key not in placement.local_factors:
            parts[placement.factor_owner[key]] += factor_pieces(
                key, factor_dim(dims, key), symmetric_packing)
    return MessageLayout.of(parts)


def local_factor_layout(placement: Placement, dims: LayerDims, symmetric_packing: bool
                        ) -> MessageLayout:
    """The local factors' allreduce: one slot with every local factor.

    Args:
        placement: Owners and groups.
        dims: The layers' factor dimensions.
        symmetric_packing: Whether factors travel as upper triangles.

    Returns:
        A one-slot layout (empty without local factors).
    """
    return MessageLayout.of([[p for k in local_factor_keys(placement, dims)
                              for p in factor_pieces(k, factor_dim(dims, k),
                                                     symmetric_packing)]])


def bucket_plan(order: Sequence[FactorKey], numel: Mapping[FactorKey, int], cap_bytes: int,
                itemsize: int) -> list[list[FactorKey]]:
    """``overlap``'s buckets: factors in readiness order cut at ``cap_bytes``.

    Args:
        order: The non-local factors in the order the hooks complete them.
        numel: Their elements on the wire (without the count).
        cap_bytes: The most bytes of one bucket.
        itemsize: Bytes per element of the factor dtype.

    Returns:
        The factors of each bucket.
    """
    sizes = [(numel[k] + 1) * itemsize for k in order]
    return [[order[i] for i in idx] for idx in buckets_by_size(sizes, cap_bytes)]


def decomposition_layout(placement: Placement, dims: LayerDims, decomposer: Decomposer,
                         group: int, *, restore: bool = False) -> MessageLayout:
    """Lay out the decomposition broadcasts inside worker group ``group``.

    Per slot (a worker), the decompositions of the factors it owns, each followed by its valid flag.

    Args:
        placement: Owners and groups.
        dims: The layers' factor dimensions.
        decomposer: What a decomposition is made of.
        group: The worker group.
        restore: Include the local factors (a restore after a load sends them too).

    Returns:
        One slot per gradient worker of the group.
    """
    g = placement.grad_workers
    parts: list[Pieces] = [[] for _ in range(g)]
    for key in group_factor_keys(placement, dims, group):
        if restore or key not in placement.local_factors:
            n = factor_dim(dims, key)
            parts[placement.factor_owner[key] - group * g] += [
                *((PieceKey(key, part), size) for part, size in decomposer.parts(n)),
                (PieceKey(key, Part.VALID), 1)]
    return MessageLayout.of(parts)


def group_factor_keys(placement: Placement, dims: LayerDims, group: int) -> list[FactorKey]:
    """The factors of the layers of worker group ``group``, in model order.

    Args:
        placement: Owners and groups.
        dims: The layers' factor dimensions.
        group: The worker group.

    Returns:
        Their keys.
    """
    return [FactorKey(n, f) for n in dims if placement.layer_group[n] == group
            for f in FACTORS]


def gradient_layout(placement: Placement, dims: LayerDims) -> MessageLayout:
    """Lay out the preconditioned-gradient broadcasts.

    Per worker group, each layer's ``g x a`` gradient and its valid flag.

    Args:
        placement: Owners and groups.
        dims: The layers' factor dimensions.

    Returns:
        One slot per worker group.
    """
    parts: list[Pieces] = [[] for _ in range(placement.n_groups)]
    for name, (a, g) in dims.items():
        parts[placement.layer_group[name]] += [(PieceKey(name, Part.GRADIENT), g * a),
                                               (PieceKey(name, Part.VALID), 1)]
    return MessageLayout.of(parts)


def replica_layout(placement: Placement, dims: LayerDims, group: int) -> MessageLayout:
    """Lay out the local factors' replicas sent after a load.

    Per slot of worker group ``group``, the local factors it owns (full matrices) and their update
    counts.

    Args:
        placement: Owners and groups.
        dims: The layers' factor dimensions.
        group: The worker group.

    Returns:
        One slot per gradient worker of the group.
    """
    g = placement.grad_workers
    parts: list[Pieces] = [[] for _ in range(g)]
    for key in local_factor_keys(placement, dims):
        if placement.layer_group[key.layer] == group:
            n = factor_dim(dims, key)
            parts[placement.factor_owner[key] - group * g] += [
                (PieceKey(key, Part.FACTOR), n * n), (PieceKey(key, Part.UPDATES), 1)]
    return MessageLayout.of(parts)
