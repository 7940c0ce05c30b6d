"""The exceptions of :mod:`kfac_hpc.checkpoint`: :class:`CheckpointError` and its
:class:`NonFiniteStateError` (a diverged run's state, refused by ``save``)."""

from __future__ import annotations

from collections.abc import Sequence

MAX_LISTED = 20


class CheckpointError(RuntimeError):
    """A checkpoint could not be written, verified or loaded.

    Raised on every rank with the same message. ``problems`` lists every problem
    found (the message shows the first :data:`MAX_LISTED`); ``path`` is the file.
    """

    def __init__(self, message: str, problems: Sequence[str] = (), path: str | None = None) -> None:
        self.problems = list(problems)
        self.path = path
        super().__init__(_format(message, self.problems))


class NonFiniteStateError(CheckpointError):
    """``save`` refused state holding NaN or Inf (a diverged run); nothing was written.

    ``tensor`` is the first such dataset (e.g. ``/model/fc1.weight``), ``rank`` the rank
    that holds it. Raised on every rank with the same message.
    """

    def __init__(self, message: str, tensor: str, rank: int, path: str | None = None) -> None:
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
