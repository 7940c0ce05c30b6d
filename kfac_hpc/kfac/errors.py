"""Numerical failures of K-FAC, raised identically on every rank.

A rank never raises before a collective that the other ranks are about to join. A
rank that finds non-finite statistics, or whose decomposition fails, says so in the
step's agreement (a flag summed over ranks), joins every collective it owes, and then
every rank raises the same :class:`KFACNumericalError`. Nothing of that step is applied:
factors, decompositions and gradients are left as they were.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["KFACNumericalError"]


class KFACNumericalError(FloatingPointError):
    """Statistics or a decomposition became unusable (NaN/Inf, failed decomposition).

    ``step`` is the K-FAC step, ``ranks`` how many ranks saw the problem, ``local`` the
    factors at fault on this rank (empty on ranks that only learnt of it).
    """

    def __init__(self, message: str, *, step: int, ranks: int, local: Sequence[str]) -> None:
        """Record where the problem was seen.

        Args:
            message: The error message (the same on every rank).
            step: The K-FAC step.
            ranks: How many ranks saw the problem.
            local: The factors at fault on this rank.
        """
        super().__init__(message)
        self.step = step
        self.ranks = ranks
        self.local = list(local)
