"""kfac_hpc: distributed K-FAC and Shampoo preconditioners for PyTorch over MPI."""

__version__ = "0.1.0"

from kfac_hpc.comm.gradients import GradientAverager
from kfac_hpc.kfac.preconditioner import KFACPreconditioner

__all__ = ["GradientAverager", "KFACPreconditioner", "__version__"]
