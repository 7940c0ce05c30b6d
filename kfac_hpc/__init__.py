"""kfac_hpc: distributed K-FAC and Shampoo preconditioners for PyTorch over MPI."""

__version__ = "0.1.0"
