"""When a run has diverged, and the one message every rank raises for it.

A run diverges when the global loss of a step (already reduced for the metrics, so
checking it costs nothing; checked at the read point that reads it:
:mod:`kfac_hpc.train.pending`) or an evaluation is NaN/Inf, when K-FAC or Shampoo raise
their numerical errors (alike on every rank), or when a checkpoint is refused for
NaN/Inf state. Every rank then raises the same :class:`TrainingDiverged`, naming the
step, the epoch, the last finite checkpoint and the newest checkpoint taken before the
loss left its running range (:class:`LossRange`).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Iterable

from kfac_hpc.train.extra import LeftRange

__all__ = ["DIVERGED_EXIT_CODE", "RANGE_FACTOR", "RANGE_MIN", "RANGE_WINDOW", "LossRange",
           "TrainingDiverged", "diverged", "numerical_errors"]

#: Exit status of ``kfac-hpc train`` after :class:`TrainingDiverged` (0 done, 2 bad input,
#: 75 checkpointed and asks for a requeue).
DIVERGED_EXIT_CODE = 3

#: The loss's running range (named in the divergence message): a step's loss is out of
#: range when it is NaN/Inf, or above ``RANGE_FACTOR`` x the median (when > 0) of the
#: losses of the previous ``RANGE_WINDOW`` steps, once ``RANGE_MIN`` of them are known.
#: The loss left its range at the first step of the out-of-range steps that lead up to
#: the divergence (an in-range step ends such a run).
RANGE_FACTOR = 10.0
RANGE_WINDOW = 50
RANGE_MIN = 10


class TrainingDiverged(FloatingPointError):
    """The loss, the parameters or the K-FAC/Shampoo statistics became NaN or Inf.

    Raised on every rank with the same message, at the same step; nothing was
    checkpointed after the last finite state.

    Attributes:
        step: The step that diverged.
        epoch: Its epoch (1-based).
        checkpoint: The last finite checkpoint (written or resumed from by this run;
            None if there is none).
        before_range: The newest checkpoint on disk taken before the loss left its
            running range (:data:`RANGE_FACTOR`; None when it did not, or none is kept).
        exit_status: What ``kfac-hpc train`` exits with.
    """

    exit_status = DIVERGED_EXIT_CODE

    def __init__(self, message: str, *, step: int, epoch: int,
                 checkpoint: str | None, before_range: str | None = None) -> None:
        """Make the error.

        Args:
            message: The message (the same on every rank).
            step: The step that diverged.
            epoch: Its epoch (1-based).
            checkpoint: The last finite checkpoint, if any.
            before_range: The newest checkpoint before the loss left its range, if any.
        """
        super().__init__(message)
        self.step = step
        self.epoch = epoch
        self.checkpoint = checkpoint
        self.before_range = before_range


def numerical_errors() -> tuple[type[BaseException], ...]:
    """K-FAC's and Shampoo's numerical errors: raised alike on every rank (agreed).

    Imported here, not at the top: ``kfac_hpc.shampoo`` starts MPI on import.

    Returns:
        The exception types.
    """
    from kfac_hpc.kfac.errors import KFACNumericalError
    from kfac_hpc.shampoo.errors import ShampooNumericalError

    return (KFACNumericalError, ShampooNumericalError)


class LossRange:
    """The running range of the global loss (definition: :data:`RANGE_FACTOR`).

    Attributes:
        window: The last finite global losses (at most :data:`RANGE_WINDOW`).
        left: Where the loss left its range, while it is out of it; else None.
    """

    def __init__(self, window: Iterable[float] = (), left: LeftRange | None = None) -> None:
        """Start from a window of losses (a resumed run: its checkpoint's).

        Args:
            window: The last finite global losses, oldest first.
            left: Where the loss left its range, if it is out of it.
        """
        self.window: deque[float] = deque(window, maxlen=RANGE_WINDOW)
        self.left = left

    def track(self, step: int, loss: float) -> None:
        """Follow the global loss of ``step`` (the same on every rank).

        Args:
            step: The step.
            loss: Its global loss.
        """
        window = self.window
        median = statistics.median(window) if len(window) >= RANGE_MIN else math.nan
        out = not math.isfinite(loss) or (median > 0 and loss > RANGE_FACTOR * median)
        if not out:
            self.left = None
        elif self.left is None:
            self.left = LeftRange(step=step, loss=loss, median=median, n=len(window))
        if math.isfinite(loss):
            window.append(loss)


def diverged(what: str, *, step: int, epoch: int, last_checkpoint: str | None,
             checkpoint_dir: str | None, left: LeftRange | None = None,
             before_range: str | None = None,
             cause: BaseException | None = None) -> TrainingDiverged:
    """Build the one error of a diverged run (every rank builds the same one).

    Args:
        what: What became NaN/Inf (``"loss became NaN/Inf"``, ...).
        step: The step that diverged.
        epoch: Its epoch (1-based).
        last_checkpoint: The last finite checkpoint, if any.
        checkpoint_dir: ``--checkpoint-dir`` (None: not given).
        left: Where the loss left its running range; None when it did not, or when
            no checkpoint directory is listed (then the message does not name one).
        before_range: The newest checkpoint taken before ``left`` (None: none kept).
        cause: The numerical error of K-FAC or Shampoo, if that was it.

    Returns:
        The error to raise.
    """
    if last_checkpoint is not None:
        where = last_checkpoint
    elif checkpoint_dir is None:
        where = "none (no --checkpoint-dir)"
    else:
        where = f"none yet in {checkpoint_dir}"
    detail = f" ({type(cause).__name__}: {cause})" if cause is not None else ""
    message = (f"{what} at step {step} (epoch {epoch}){detail}; "
               f"last finite checkpoint: {where}")
    if left is not None:
        how = ("NaN/Inf" if not math.isfinite(left.loss) else
               f"{left.loss:.4g} > {RANGE_FACTOR:g}x the median {left.median:.4g} of the "
               f"previous {left.n} steps")
        name = before_range or "none kept (--checkpoint-keep-every-epochs keeps milestones)"
        message += (f"; the loss left its running range at step {left.step} ({how}); "
                    f"newest checkpoint before that: {name}")
    else:
        before_range = None
    return TrainingDiverged(message, step=step, epoch=epoch, checkpoint=last_checkpoint,
                            before_range=before_range)
