"""K-FAC: per-layer curvature, linear algebra, placement, communication and the preconditioner."""

from kfac_hpc.kfac.preconditioner import STRATEGIES, KFACPreconditioner

__all__ = ["STRATEGIES", "KFACPreconditioner"]
