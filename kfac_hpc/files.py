"""Files written whole or not at all.

The text goes to a temporary file in the same folder, is fsynced, then renamed over
the target (``os.replace`` is atomic on POSIX file systems). The file gets the mode a
plain ``open`` would give it (``0666`` less the umask), or keeps the mode of the file it
replaces: a profile or plan shared with a group stays readable by it.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

__all__ = ["write_text_atomic"]


def _umask() -> int:
    """This process's umask, read without changing it where Linux tells it."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    mask = os.umask(0o022)  # elsewhere: set and restore at once
    os.umask(mask)
    return mask


def _mode_for(final: Path) -> int:
    """The permission bits of a new ``final``: those of the file replaced, else 0666 & ~umask."""
    try:
        return final.stat().st_mode & 0o7777
    except OSError:
        return 0o666 & ~_umask()


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
            os.fchmod(fh.fileno(), _mode_for(final))  # mkstemp's 0600 hides it from others
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
