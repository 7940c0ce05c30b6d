"""The one exception type of :mod:`kfac_hpc.checkpoint`."""

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


def _format(message: str, problems: Sequence[str]) -> str:
    if not problems:
        return message
    lines = [f"  - {p}" for p in problems[:MAX_LISTED]]
    if len(problems) > MAX_LISTED:
        lines.append(f"  ... and {len(problems) - MAX_LISTED} more")
    return "\n".join([message, *lines])
