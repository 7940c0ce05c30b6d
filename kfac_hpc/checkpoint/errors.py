"""The exceptions of :mod:`kfac_hpc.checkpoint`.

:class:`CheckpointError` and its :class:`NonFiniteStateError` (a diverged run's state,
refused by ``save``). An object handed to ``save`` or ``load`` that does not follow its
protocol (:mod:`kfac_hpc.checkpoint.contracts`) is a ``TypeError`` instead: no other
checkpoint can fix that.
"""

from __future__ import annotations

from collections.abc import Sequence

MAX_LISTED = 20


class CheckpointError(RuntimeError):
    """A checkpoint could not be written, verified or loaded.

    Raised on every rank with the same message. ``problems`` lists every problem
    found (the message shows the first :data:`MAX_LISTED`); ``path`` is the file.
    """

    def __init__(self, message: str, problems: Sequence[str] = (), path: str | None = None) -> None:
        """Make the error.

        Args:
            message: What failed.
            problems: Every problem found, one line each.
            path: The checkpoint file, if one is concerned.
        """
        self.problems = list(problems)
        self.path = path
        super().__init__(_format(message, self.problems))


class NonFiniteStateError(CheckpointError):
    """``save`` refused state holding NaN or Inf (a diverged run); nothing was written.

    ``tensor`` is the first such dataset (e.g. ``/model/fc1.weight``), ``rank`` the rank
    that holds it. Raised on every rank with the same message.
    """

    def __init__(self, message: str, tensor: str, rank: int, path: str | None = None) -> None:
        """Make the error.

        Args:
            message: What was refused.
            tensor: The first dataset holding NaN/Inf.
            rank: The rank that holds it.
            path: The checkpoint file, if one is concerned.
        """
        super().__init__(message, path=path)
        self.tensor = tensor
        self.rank = rank


def _format(message: str, problems: Sequence[str]) -> str:
    if not problems:
        return message
    lines = [f"  - {p}" for p in problems[:MAX_LISTED]]
    if len(problems) > MAX_LISTED:
        lines.append(f"  ... and {len(problems) - MAX_LISTED} more")
    return "\n".join([message, *lines])
