"""What ``load`` decided after checking a file: where each dataset goes, what to apply."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kfac_hpc.checkpoint.layout import storage_to_tensor

__all__ = ["EVERY_RANK", "Plan", "Route", "fetcher"]

EVERY_RANK = -1


@dataclass
class Route:
    """One dataset and the rank that needs it (or :data:`EVERY_RANK`)."""

    path: str
    dest: int
    shape: tuple[int, ...]
    dtype: str
    digest: str

    @property
    def nbytes(self) -> int:
        """Bytes of the dataset's data."""
        return int(np.dtype(self.dtype).itemsize * int(np.prod(self.shape, dtype=np.int64)))


@dataclass
class Plan:
    """Built by rank 0 from the file and the live objects, then broadcast."""

    path: str
    routes: list[Route]
    torch_dtypes: dict[str, str]
    root: dict[str, Any]
    groups: dict[str, dict[str, Any]]
    mismatches: list[str]
    sections: list[str]  # to apply: "kfac", "optimizer", "model", "rng"
    model_names: list[str]  # model entries to load
    skip_optimizer_state: list[str]
    rng_source: dict[int, int]  # dest rank (or EVERY_RANK) -> saved rank
    rng_note: str
    notes: list[str]
    kfac_source: dict[int, int] = field(default_factory=dict)  # the same for /kfac/@rank_<r>


def fetcher(plan: Plan, staged: dict[str, np.ndarray], prefix: str) -> Callable[[str], Any]:
    """Make the ``fetch`` of :func:`~kfac_hpc.checkpoint.tree.decode` for staged data.

    Args:
        plan: The load's plan (it knows which datasets hold torch dtypes).
        staged: The datasets this rank staged, by path.
        prefix: The group the structure's relative paths start from.

    Returns:
        ``fetch(rel)``: the tensor (an array for datasets stored from NumPy) at
        ``prefix/rel``, as a new object.
    """
    def fetch(rel: str) -> Any:
        p = f"{prefix}/{rel}"
        name = plan.torch_dtypes.get(p)
        arr = staged[p]
        return storage_to_tensor(arr, name) if name else arr.copy()
    return fetch
