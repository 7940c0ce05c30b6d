"""Numerical failures of Shampoo, reported identically on every rank.

An owner never raises before the step's collective (that would leave the other
ranks waiting in it). It sets bits in its status word, fills the failing blocks'
updates with NaN, and joins the ``allgatherv``; then every rank sees the same status
words and the same NaN blocks and raises the same :class:`ShampooNumericalError`
naming the parameters and blocks. Parameters are not updated by that step. Any other
exception on an owner is handled alike: the owner reports :data:`STATUS_EXCEPTION`,
joins the collective, then re-raises its exception; the other ranks raise
:class:`ShampooNumericalError` naming that rank.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

__all__ = ["STATUS_EXCEPTION", "STATUS_NONFINITE_STATISTICS", "STATUS_NONFINITE_UPDATE",
           "STATUS_ROOT_FAILURES", "ShampooNumericalError", "describe_status", "nonfinite_marks"]

STATUS_NONFINITE_STATISTICS = 1
STATUS_ROOT_FAILURES = 2
STATUS_NONFINITE_UPDATE = 4
STATUS_EXCEPTION = 8

_MEANINGS = {
    STATUS_NONFINITE_STATISTICS: "non-finite values (NaN/Inf) in the factor statistics",
    STATUS_ROOT_FAILURES: "too many consecutive failed eigendecompositions (float32 and float64)",
    STATUS_NONFINITE_UPDATE: ("a non-finite update (NaN/Inf gradient or parameter, or overflow "
                              "in communication_dtype)"),
    STATUS_EXCEPTION: "an exception while updating a rank's blocks (raised on that rank)",
}


class ShampooNumericalError(FloatingPointError):
    """A block's statistics, root or update became unusable.

    The optimizer state should be considered lost (restore a checkpoint).

    Attributes:
        blocks: ``(parameter name, block index)`` of the affected blocks.
        status: The status bit mask (see :func:`describe_status`).
    """

    def __init__(self, message: str, blocks: Sequence[tuple[str, int]], status: int) -> None:
        """Record the affected blocks and the status.

        Args:
            message: What happened and what to do.
            blocks: ``(parameter name, block index)`` of the affected blocks.
            status: The status bit mask.
        """
        super().__init__(message)
        self.blocks = list(blocks)
        self.status = status


def describe_status(status: int) -> str:
    """Describe a status bit mask in words."""
    parts = [text for bit, text in _MEANINGS.items() if status & bit]
    return "; ".join(parts) if parts else "no failure"


def nonfinite_marks(x: Tensor) -> Tensor:
    """Mark each row of ``x`` ``(n, m)``: 0 where it is finite, else NaN; ``(n,)`` on its device.

    ``x·0`` is exactly 0 where ``x`` is finite and NaN where it is ±Inf or NaN, so a row
    of ``x·0`` sums to exactly 0 iff the row is finite: two kernels (``isfinite`` alone is
    four), no host synchronisation. Marks add up: a sum of marks is 0 iff all are.
    """
    return x.mul(0).sum(dim=1)
