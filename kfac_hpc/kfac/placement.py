"""Who computes what in distributed K-FAC: a pure function of layer shapes and world size.

Ranks form KAISA's grid of ``P`` ranks with ``g = fraction·P`` gradient workers per layer:

* *gradient-worker groups* are the ``P/g`` blocks of ``g`` consecutive ranks
  (rank ``r`` is in group ``r // g``); a layer is placed in one such group, its A and G
  are owned (reduced to and decomposed) by ranks of that group, and the eigenbases
  are broadcast inside the group, whose members all precondition the layer;
* *receiver groups* are the ``g`` sets ``{j, j+g, j+2g, …}`` (rank ``r`` is in group
  ``r % g``); each holds exactly one gradient worker of every layer, which broadcasts
  the preconditioned gradient to it.

``fraction = 1`` is COMM-OPT (one worker group: everyone holds every eigenbasis, no
gradient broadcast); ``fraction = 1/P`` is MEM-OPT (a layer's factors live on one rank,
which broadcasts the preconditioned gradient to all). DP-KFAC places like MEM-OPT.

Layers go to worker groups by LPT on the summed decomposition cost; inside a group,
each factor goes to a rank by LPT (SPD-KFAC's load balancing). Under DP-KFAC the owner
of a layer also computes its statistics, which for convolutions cost far more than the
decompositions; given the statistics rows (:attr:`LayerShape.rows`), layers are balanced
on :func:`work_per_step` instead. Deterministic: the input order (model order) breaks
ties, never hashing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from kfac_hpc.assignment import cubic_cost, lpt_assign

FACTORS = ("A", "G")


class FactorKey(NamedTuple):
    """A Kronecker factor: ``factor`` (``"A"`` or ``"G"``) of layer ``layer``.

    The typed key K-FAC uses everywhere inside; :attr:`name` (``"<layer>/A"``) is the
    spelling at the boundary (``state_dict()``, HDF5 checkpoints, logs). A tuple, so
    ``(layer, factor)`` finds it in :attr:`Placement.factor_owner` too.
    """

    layer: str
    factor: str

    @property
    def name(self) -> str:
        """Return the spelling at the boundary, ``"<layer>/A"``."""
        return f"{self.layer}/{self.factor}"

    @staticmethod
    def parse(name: str) -> FactorKey:
        """The key of ``"<layer>/A"`` (a layer name may itself contain ``/``)."""
        layer, factor = name.rsplit("/", 1)
        if factor not in FACTORS:
            raise KeyError(f"not a factor name: {name!r} (expected '<layer>/A' or '<layer>/G')")
        return FactorKey(layer, factor)


# Cost of one decomposition of an n x n factor in GEMM flops, as a multiple of n³
# (torch 2.13 CPU, one thread, n >= 577: eigh 12.8-13.1, Cholesky inverse 2.7-2.9).
DECOMPOSITION_FLOPS_PER_N3 = {"eigen": 13.0, "inverse": 3.0}


@dataclass(frozen=True)
class LayerShape:
    """What placement needs of a layer.

    Its name, factor dimensions and, when known, ``rows``: rows of its statistics per update on one
    rank (batch x rows per sample).
    """

    name: str
    a_dim: int
    g_dim: int
    rows: int = 0

    def dim(self, factor: str) -> int:
        """Return the dimension of ``factor`` (``"A"`` or ``"G"``)."""
        return self.a_dim if factor == "A" else self.g_dim


@dataclass(frozen=True)
class Placement:
    """Owners and groups for every layer (identical on every rank)."""

    world_size: int
    grad_workers: int  # g: gradient workers per layer (= size of a worker group)
    layer_group: dict[str, int]  # layer -> worker-group index
    factor_owner: dict[FactorKey, int]  # factor -> world rank
    local_factors: frozenset[FactorKey] = field(default_factory=frozenset)

    @property
    def n_groups(self) -> int:
        """Return the number of gradient-worker groups."""
        return self.world_size // self.grad_workers

    def worker_group_of_rank(self, rank: int) -> int:
        """Return the gradient-worker group of ``rank``."""
        return rank // self.grad_workers

    def receiver_group_of_rank(self, rank: int) -> int:
        """Return the receiver group of ``rank``."""
        return rank % self.grad_workers

    def is_grad_worker(self, layer: str, rank: int) -> bool:
        """Say whether ``rank`` preconditions ``layer``."""
        return self.layer_group[layer] == self.worker_group_of_rank(rank)

    def describe(self) -> str:
        """Return the placement as text, a line per layer."""
        lines = [f"placement: {self.world_size} ranks, {self.grad_workers} gradient "
                 f"worker(s) per layer, {self.n_groups} worker group(s)"]
        for layer, group in self.layer_group.items():
            a = self.factor_owner[FactorKey(layer, "A")]
            g = self.factor_owner[FactorKey(layer, "G")]
            lines.append(f"  {layer}: group {group}, A on rank {a}, G on rank {g}")
        return "\n".join(lines)


def grad_workers_for(strategy: str, world_size: int, fraction: float | None) -> int:
    """Number of gradient workers per layer for a strategy; clear errors on bad fractions."""
    if strategy == "comm-opt":
        return world_size
    if strategy in ("mem-opt", "dp-kfac"):
        return 1
    if strategy != "hybrid-opt":
        raise ValueError(f"unknown strategy {strategy!r}")
    if fraction is None:
        raise ValueError("strategy='hybrid-opt' needs grad_worker_fraction, e.g. 0.5")
    if not 0 < fraction <= 1:
        raise ValueError(f"grad_worker_fraction must be in (0, 1], got {fraction}")
    workers = fraction * world_size
    if abs(workers - round(workers)) > 1e-9 or round(workers) < 1:
        raise ValueError(
            f"grad_worker_fraction={fraction} gives {workers:g} gradient workers on "
            f"{world_size} ranks; it must give a whole number (use k/{world_size})")
    g = round(workers)
    if world_size % g:
        raise ValueError(
            f"grad_worker_fraction={fraction} gives {g} gradient workers, which does not "
            f"divide the world of {world_size} ranks; choose a divisor of {world_size}")
    return g


def decomposition_cost(low_rank: int | None = None, low_rank_min_dim: int = 0
                       ) -> Callable[[int], float]:
    """Return the cost of decomposing a ``dim x dim`` factor in units of ``dim³``.

    Without ``low_rank`` it is :func:`cubic_cost`. A factor that gets a randomized
    low-rank decomposition costs its flops
    (:func:`~kfac_hpc.kfac.shapes.randomized_eigh_flops`) over the ``eigh`` constant of
    :data:`DECOMPOSITION_FLOPS_PER_N3`, so LPT balances what ranks really do.
    """
    if low_rank is None:
        return cubic_cost
    from kfac_hpc.kfac.lowrank import sketches
    from kfac_hpc.kfac.options import low_rank_cap
    from kfac_hpc.kfac.shapes import randomized_eigh_flops

    def cost(dim: int) -> float:
        cap = low_rank_cap(dim, low_rank, low_rank_min_dim)
        if cap is None or not sketches(dim, cap):
            return cubic_cost(dim)
        return randomized_eigh_flops(dim, cap) / DECOMPOSITION_FLOPS_PER_N3["eigen"]

    return cost


def work_per_step(layer: LayerShape, *, compute_method: str = "eigen",
                  factor_update_steps: int = 1, inv_update_steps: int = 1,
                  cost: Callable[[int], float] = cubic_cost) -> float:
    """Return the GEMM flops per step of all of a layer's K-FAC work on one rank.

    Statistics ``2·rows·(a² + g²)`` every ``factor_update_steps``, decompositions ``c·(cost(a) +
    cost(g))`` every ``inv_update_steps`` (``c``: :data:`DECOMPOSITION_FLOPS_PER_N3`; ``cost``:
    :func:`decomposition_cost`).
    """
    statistics = 2.0 * layer.rows * (layer.a_dim ** 2 + layer.g_dim ** 2)
    decompositions = DECOMPOSITION_FLOPS_PER_N3[compute_method] * (
        cost(layer.a_dim) + cost(layer.g_dim))
    return statistics / factor_update_steps + decompositions / inv_update_steps


def place(
    layers: Sequence[LayerShape],
    world_size: int,
    grad_workers: int,
    *,
    cost: Callable[[int], float] = cubic_cost,
    local_threshold: int = 0,
    layer_cost: Callable[[LayerShape], float] | None = None,
) -> Placement:
    """Place layers on worker groups and factors on ranks (LPT by ``cost(dim)``).

    ``layer_cost`` replaces ``cost(a_dim) + cost(g_dim)`` for placing whole layers on
    worker groups (e.g. :func:`work_per_step` for DP-KFAC).

    Factors of dimension below ``local_threshold`` are *local* (SPD-KFAC's rule) when a
    layer has several gradient workers: each of them keeps the factor and decomposes it
    itself instead of receiving a broadcast. A local factor still has an owner (the rank
    that saves it in checkpoints) but adds no load to the balancing.
    """
    if world_size % grad_workers:
        raise ValueError(f"{grad_workers} gradient workers do not divide {world_size} ranks")
    if local_threshold < 0:
        raise ValueError(f"local_decomposition_threshold must be >= 0, got {local_threshold}")
    n_groups = world_size // grad_workers
    def whole(layer: LayerShape) -> float:
        return cost(layer.a_dim) + cost(layer.g_dim)

    layer_group = lpt_assign([(layer.name, (layer_cost or whole)(layer)) for layer in layers],
                             n_groups)
    group_load = [[0.0] * grad_workers for _ in range(n_groups)]
    factor_owner: dict[FactorKey, int] = {}
    local: set[FactorKey] = set()
    order = sorted(((-cost(layer.dim(f)), i, j, layer, f)
                    for i, layer in enumerate(layers) for j, f in enumerate(FACTORS)),
                   key=lambda t: (t[0], t[1], t[2]))
    for neg_cost, _, _, layer, f in order:
        group = layer_group[layer.name]
        loads = group_load[group]
        slot = min(range(grad_workers), key=lambda k: (loads[k], k))
        if grad_workers > 1 and layer.dim(f) < local_threshold:
            local.add(FactorKey(layer.name, f))
        else:
            loads[slot] -= neg_cost
        factor_owner[FactorKey(layer.name, f)] = group * grad_workers + slot
    ordered_owner = {FactorKey(layer.name, f): factor_owner[FactorKey(layer.name, f)]
                     for layer in layers for f in FACTORS}
    return Placement(world_size, grad_workers, dict(layer_group), ordered_owner, frozenset(local))
