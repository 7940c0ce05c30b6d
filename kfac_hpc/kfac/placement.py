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
each factor goes to a rank by LPT (SPD-KFAC's load balancing). Deterministic: the input
order (model order) breaks ties, never hashing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kfac_hpc.assignment import cubic_cost, lpt_assign

FACTORS = ("A", "G")


@dataclass(frozen=True)
class LayerShape:
    """What placement needs of a layer: its name and factor dimensions."""

    name: str
    a_dim: int
    g_dim: int

    def dim(self, factor: str) -> int:
        return self.a_dim if factor == "A" else self.g_dim


@dataclass(frozen=True)
class Placement:
    """Owners and groups for every layer (identical on every rank)."""

    world_size: int
    grad_workers: int  # g: gradient workers per layer (= size of a worker group)
    layer_group: dict[str, int]  # layer -> worker-group index
    factor_owner: dict[tuple[str, str], int]  # (layer, "A"|"G") -> world rank
    local_factors: frozenset[tuple[str, str]] = field(default_factory=frozenset)

    @property
    def n_groups(self) -> int:
        return self.world_size // self.grad_workers

    def worker_group_of_rank(self, rank: int) -> int:
        return rank // self.grad_workers

    def receiver_group_of_rank(self, rank: int) -> int:
        return rank % self.grad_workers

    def grad_workers_of(self, layer: str) -> list[int]:
        """World ranks that hold the layer's eigenbases and precondition it."""
        start = self.layer_group[layer] * self.grad_workers
        return list(range(start, start + self.grad_workers))

    def is_grad_worker(self, layer: str, rank: int) -> bool:
        return self.layer_group[layer] == self.worker_group_of_rank(rank)

    def gradient_root(self, layer: str, rank: int) -> int:
        """The world rank that sends the layer's preconditioned gradient to ``rank``."""
        return self.layer_group[layer] * self.grad_workers + self.receiver_group_of_rank(rank)

    def owned_factors(self, rank: int) -> list[tuple[str, str]]:
        return [key for key, owner in self.factor_owner.items() if owner == rank]

    def describe(self) -> str:
        lines = [f"placement: {self.world_size} ranks, {self.grad_workers} gradient "
                 f"worker(s) per layer, {self.n_groups} worker group(s)"]
        for layer, group in self.layer_group.items():
            a, g = self.factor_owner[(layer, "A")], self.factor_owner[(layer, "G")]
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


def place(
    layers: Sequence[LayerShape],
    world_size: int,
    grad_workers: int,
    *,
    cost: Callable[[int], float] = cubic_cost,
    local_threshold: int = 0,
) -> Placement:
    """Place layers on worker groups and factors on ranks (LPT by ``cost(dim)``).

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
    layer_cost = [(layer.name, cost(layer.a_dim) + cost(layer.g_dim)) for layer in layers]
    layer_group = lpt_assign(layer_cost, n_groups)
    group_load = [[0.0] * grad_workers for _ in range(n_groups)]
    factor_owner: dict[tuple[str, str], int] = {}
    local: set[tuple[str, str]] = set()
    order = sorted(((-cost(layer.dim(f)), i, j, layer, f)
                    for i, layer in enumerate(layers) for j, f in enumerate(FACTORS)),
                   key=lambda t: (t[0], t[1], t[2]))
    for neg_cost, _, _, layer, f in order:
        group = layer_group[layer.name]
        loads = group_load[group]
        slot = min(range(grad_workers), key=lambda k: (loads[k], k))
        if grad_workers > 1 and layer.dim(f) < local_threshold:
            local.add((layer.name, f))
        else:
            loads[slot] -= neg_cost
        factor_owner[(layer.name, f)] = group * grad_workers + slot
    ordered_owner = {(layer.name, f): factor_owner[(layer.name, f)]
                     for layer in layers for f in FACTORS}
    return Placement(world_size, grad_workers, dict(layer_group), ordered_owner, frozenset(local))
