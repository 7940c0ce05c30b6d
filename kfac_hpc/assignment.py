"""Who computes what: deterministic load balancing of work items over ranks.

Every rank calls the same pure function on the same inputs (names, shapes, world size)
and gets the same map, so no communication is needed to agree on ownership.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Mapping, Sequence
from typing import TypeVar

K = TypeVar("K", bound=Hashable)


def cubic_cost(dim: int) -> float:
    """Return the cost of an eigendecomposition or inverse of a ``dim x dim`` matrix (∝ n³)."""
    return float(dim) ** 3


def lpt_assign(
    costs: Mapping[K, float] | Sequence[tuple[K, float]],
    n_workers: int,
    *,
    initial_load: Sequence[float] | None = None,
) -> dict[K, int]:
    """Assign items to ``n_workers`` workers, longest processing time first.

    Items are taken in order of decreasing cost (ties broken by their position in
    ``costs``, so the result depends only on the input order, never on hashing); each goes
    to the least-loaded worker (ties: the lowest worker index). Deterministic.

    Args:
        costs: Each item's cost, as a mapping or ``(item, cost)`` pairs.
        n_workers: The number of workers (>= 1).
        initial_load: Each worker's load before the assignment (default zeros).

    Returns:
        The worker index of every item.

    Raises:
        ValueError: ``n_workers`` is below 1, a cost is negative or not a number, or
            ``initial_load`` has the wrong length.
    """
    if n_workers < 1:
        raise ValueError(f"n_workers must be >= 1, got {n_workers}")
    items = list(costs.items()) if isinstance(costs, Mapping) else list(costs)
    for key, cost in items:
        if not cost >= 0:
            raise ValueError(f"cost of {key!r} must be a non-negative number, got {cost!r}")
    loads = list(initial_load) if initial_load is not None else [0.0] * n_workers
    if len(loads) != n_workers:
        raise ValueError(f"initial_load has {len(loads)} entries for {n_workers} workers")
    order = sorted(range(len(items)), key=lambda i: (-items[i][1], i))
    heap = [(load, w) for w, load in enumerate(loads)]
    heapq.heapify(heap)
    owners: dict[K, int] = {}
    for i in order:
        key, cost = items[i]
        load, worker = heapq.heappop(heap)
        owners[key] = worker
        heapq.heappush(heap, (load + cost, worker))
    return owners

