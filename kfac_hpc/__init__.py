"""kfac_hpc: distributed K-FAC and Shampoo preconditioners for PyTorch over MPI.

The top-level names are imported on first use, so ``import kfac_hpc`` (or a
subcommand that needs no MPI, such as ``kfac-hpc ckpt inspect`` on a login node)
neither imports torch nor initialises MPI. ``kfac_hpc.runtime.select_device()``
chooses the GPU without starting MPI: call it before the first MPI import.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from kfac_hpc import runtime
    from kfac_hpc.comm.gradients import GradientAverager
    from kfac_hpc.kfac.preconditioner import KFACPreconditioner
    from kfac_hpc.shampoo.optimizer import DistributedShampoo

__all__ = ["DistributedShampoo", "GradientAverager", "KFACPreconditioner", "__version__",
           "runtime"]

_LAZY = {
    "DistributedShampoo": "kfac_hpc.shampoo.optimizer",
    "GradientAverager": "kfac_hpc.comm.gradients",
    "KFACPreconditioner": "kfac_hpc.kfac.preconditioner",
}
_SUBPACKAGES = ("runtime",)  # importable without starting MPI


def __getattr__(name: str) -> Any:
    """Import a top-level name on first use (PEP 562).

    Args:
        name: The attribute asked for.

    Returns:
        The class or subpackage, now cached in the module.

    Raises:
        AttributeError: ``kfac_hpc`` has no such name.
    """
    import importlib

    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
    elif name in _SUBPACKAGES:
        value = importlib.import_module(f"kfac_hpc.{name}")
    else:
        raise AttributeError(f"module 'kfac_hpc' has no attribute {name!r}")
    globals()[name] = value
    return value
