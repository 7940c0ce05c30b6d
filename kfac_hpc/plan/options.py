"""The preconditioner settings the planner prices (:class:`KFACOptions`).

The names are ``KFACPreconditioner``'s and the rules that reject a combination are the
library's (:func:`kfac_hpc.kfac.options.conflicts`); two fields are planner-only
baselines of published systems.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch

from kfac_hpc.kfac.options import (
    APPROXIMATIONS,
    DEFAULT_BUCKET_CAP_MB,
    DEFAULT_LOCAL_THRESHOLD,
    DEFAULT_LOW_RANK_MIN_DIM,
    STRATEGIES,
    conflicts,
)

__all__ = ["KFACOptions"]


@dataclass(frozen=True)
class KFACOptions:
    """The preconditioner settings that change cost (names as in ``KFACPreconditioner``).

    Planner-only fields (baselines of published systems; the preconditioner always
    reduce-scatters and posts its decomposition broadcasts before computing):
    ``factor_reduction="allreduce"`` (every rank receives every factor, as D-KFAC and
    SPD-KFAC do) and ``pipelined_broadcasts=False`` (decompositions are broadcast after
    all of them are computed).
    """

    strategy: str = "comm-opt"
    grad_worker_fraction: float | None = None
    compute_method: str = "eigen"
    symmetric_packing: bool = False
    overlap: bool = False
    bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB
    factor_sync: str = "step"
    local_decomposition_threshold: int = DEFAULT_LOCAL_THRESHOLD
    kfac_approx: str = "expand"
    low_rank: int | None = None
    low_rank_energy: float | None = None
    low_rank_min_dim: int = DEFAULT_LOW_RANK_MIN_DIM
    low_rank_remainder: str = "mean"
    factor_update_steps: int = 1
    inv_update_steps: int = 1
    factor_dtype: str = "float32"
    inv_dtype: str = "float32"
    factor_reduction: str = "reduce_scatter"
    check_replicas: bool = True
    pipelined_broadcasts: bool = True

    def problem(self) -> str | None:
        """Say why the preconditioner would reject these options, or return ``None``."""
        if self.strategy not in STRATEGIES:
            return f"unknown strategy {self.strategy!r}"
        if self.kfac_approx not in APPROXIMATIONS:
            return f"kfac_approx must be one of {APPROXIMATIONS}, got {self.kfac_approx!r}"
        if self.factor_reduction not in ("reduce_scatter", "allreduce"):
            return f"unknown factor_reduction {self.factor_reduction!r}"
        problems = conflicts(strategy=self.strategy,
                             grad_worker_fraction=self.grad_worker_fraction,
                             overlap=self.overlap, symmetric_packing=self.symmetric_packing,
                             factor_sync=self.factor_sync, compute_method=self.compute_method,
                             low_rank=self.low_rank, low_rank_energy=self.low_rank_energy,
                             low_rank_min_dim=self.low_rank_min_dim,
                             low_rank_remainder=self.low_rank_remainder)
        return f"{problems[0].option} {problems[0].text()}" if problems else None

    def label(self) -> str:
        """Return a short name, e.g. ``hybrid-opt(1/2)+pack+overlap``."""
        name = self.strategy
        if self.strategy == "hybrid-opt" and self.grad_worker_fraction is not None:
            name += f"({_fraction_text(self.grad_worker_fraction)})"
        extras = [("allreduce" if self.factor_reduction == "allreduce" else ""),
                  ("pack" if self.symmetric_packing else ""),
                  ("overlap" if self.overlap else ""),
                  ("sync@inv" if self.factor_sync == "inverse" else ""),
                  ("inverse" if self.compute_method == "inverse" else ""),
                  ("reduce" if self.kfac_approx == "reduce" else ""),
                  (f"rank{self.low_rank}" if self.low_rank is not None else ""),
                  (f"energy{self.low_rank_energy:g}" if self.low_rank_energy is not None
                   else "")]
        return "+".join([name, *[e for e in extras if e]])

    def preconditioner_kwargs(self) -> dict[str, Any]:
        """Return the keyword arguments of ``KFACPreconditioner`` for these options."""
        if self.factor_reduction != "reduce_scatter" or not self.pipelined_broadcasts:
            raise ValueError("factor_reduction='allreduce' and pipelined_broadcasts=False "
                             "are planner-only baselines")
        kw: dict[str, Any] = {
            "strategy": self.strategy, "compute_method": self.compute_method,
            "symmetric_packing": self.symmetric_packing, "overlap": self.overlap,
            "bucket_cap_mb": self.bucket_cap_mb, "factor_sync": self.factor_sync,
            "local_decomposition_threshold": self.local_decomposition_threshold,
            "kfac_approx": self.kfac_approx, "low_rank": self.low_rank,
            "low_rank_energy": self.low_rank_energy, "low_rank_min_dim": self.low_rank_min_dim,
            "low_rank_remainder": self.low_rank_remainder,
            "factor_update_steps": self.factor_update_steps,
            "inv_update_steps": self.inv_update_steps,
            "factor_dtype": getattr(torch, self.factor_dtype),
            "inv_dtype": getattr(torch, self.inv_dtype), "check_replicas": self.check_replicas}
        if self.grad_worker_fraction is not None:
            kw["grad_worker_fraction"] = self.grad_worker_fraction
        return kw

    def to_json(self) -> dict[str, Any]:
        """Return the options as a JSON-ready dict (field names as keys)."""
        return asdict(self)


def _fraction_text(f: float) -> str:
    inv = 1 / f
    return f"1/{round(inv)}" if abs(inv - round(inv)) < 1e-9 else f"{f:g}"
