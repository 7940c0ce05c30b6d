"""Files written whole or not at all.

The text goes to a temporary file in the same folder, is fsynced, then renamed over
the target (``os.replace`` is atomic on POSIX file systems).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

__all__ = ["write_text_atomic"]


def write_text_atomic(path: str | os.PathLike[str], text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` so that a crash leaves the old file or the new.

    Missing folders are made. The text goes to a uniquely named temporary file beside
    ``path``, is flushed and fsynced, renamed over ``path``, and the folder is fsynced
    (where the file system allows), so a reader never sees a half-written file.

    Args:
        path: The file to write (replaced if it exists).
        text: Its new content.

    Returns:
        ``path`` as a :class:`~pathlib.Path`.

    Raises:
        OSError: The file could not be written; ``path`` is then unchanged and the
            temporary file removed.
    """
    final = Path(path)
    final.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, final)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    with contextlib.suppress(OSError):
        folder = os.open(final.parent, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        try:
            os.fsync(folder)
        finally:
            os.close(folder)
    return final
