"""K-FAC: per-layer curvature, linear algebra, work assignment, strategies, preconditioner."""
