"""kfac_hpc: distributed K-FAC and Shampoo preconditioners for PyTorch over MPI.

The top-level names are imported on first use, so ``import kfac_hpc`` (or a
subcommand that needs no MPI, such as ``kfac-hpc ckpt inspect`` on a login node)
neither imports torch nor initialises MPI.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from kfac_hpc.comm.gradients import GradientAverager
    from kfac_hpc.kfac.preconditioner import KFACPreconditioner

__all__ = ["GradientAverager", "KFACPreconditioner", "__version__"]

_LAZY = {
    "GradientAverager": "kfac_hpc.comm.gradients",
    "KFACPreconditioner": "kfac_hpc.kfac.preconditioner",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'kfac_hpc' has no attribute {name!r}")
