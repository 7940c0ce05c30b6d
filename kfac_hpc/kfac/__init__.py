"""K-FAC: per-layer curvature, linear algebra, placement, communication and the preconditioner.

The preconditioner is imported on first use, so the pure parts (``kfac_hpc.kfac.options``,
``kfac_hpc.kfac.placement``) import neither torch's MPI side nor mpi4py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kfac_hpc.kfac.options import STRATEGIES

if TYPE_CHECKING:
    from kfac_hpc.kfac.preconditioner import KFACPreconditioner

__all__ = ["STRATEGIES", "KFACPreconditioner"]


def __getattr__(name: str) -> Any:
    if name == "KFACPreconditioner":
        from kfac_hpc.kfac.preconditioner import KFACPreconditioner

        globals()[name] = KFACPreconditioner
        return KFACPreconditioner
    raise AttributeError(f"module 'kfac_hpc.kfac' has no attribute {name!r}")
