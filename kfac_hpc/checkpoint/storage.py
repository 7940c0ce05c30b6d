"""The file HDF5 writes through: a full disk never reaches HDF5.

HDF5 does not survive a failed write. After ``ENOSPC`` its caches are inconsistent,
h5py reports the error (or drops it inside a destructor), and closing the file or
the interpreter's exit then crashes the process (HDF5 2.0: a segmentation fault in
``H5D_flush_all``). So the writer hands HDF5 a :class:`GuardedFile` (h5py's
``fileobj`` driver): every write goes through :func:`os.pwrite`; the first
``OSError`` is recorded and every later write is discarded while reporting success,
so HDF5 finishes and closes normally, and the writer raises one clear error and
deletes the file. A background thread writes the file back to disk as it grows
(``fdatasync`` every :data:`FLUSH_BYTES`), and its errors are recorded too (an
error that write-back reports once must not be lost before the final ``fsync``).
"""

from __future__ import annotations

import errno
import io
import os
import queue
import threading
from pathlib import Path
from typing import Any

from kfac_hpc.units import format_bytes

__all__ = ["FLUSH_BYTES", "GuardedFile", "free_bytes", "space_problem"]

FLUSH_BYTES = 64 << 20  # start writing back to disk every this many bytes

_pwrite = os.pwrite  # the lowest level of every write (the tests replace it)
_fdatasync = os.fdatasync


class GuardedFile(io.RawIOBase):
    """A new file (truncated) for h5py's ``fileobj`` driver that never fails a write.

    ``error`` is the first ``OSError`` of any write, truncation or write-back;
    ``written`` counts the bytes that reached the file system before it.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        """Create (or truncate) the file and start its write-back thread.

        Args:
            path: The file to write.
        """
        super().__init__()
        self.path = Path(path)
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        self.error: OSError | None = None
        self.written = 0
        self._pos = 0
        self._size = 0
        self._since = 0
        self._todo: queue.Queue[bool] = queue.Queue()
        self._thread = threading.Thread(target=self._write_back, name="ckpt-flush", daemon=True)
        self._thread.start()

    # ---- what h5py's fileobj driver calls
    def readable(self) -> bool:
        """Return True: h5py reads back what it wrote."""
        return True

    def writable(self) -> bool:
        """Return True."""
        return True

    def seekable(self) -> bool:
        """Return True."""
        return True

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        """Move the position (beyond the end is allowed, as for a file).

        Args:
            offset: Bytes from ``whence``.
            whence: ``os.SEEK_SET``, ``os.SEEK_CUR`` or ``os.SEEK_END``.

        Returns:
            The new position.
        """
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._pos, os.SEEK_END: self._size}[whence]
        self._pos = base + offset
        return self._pos

    def tell(self) -> int:
        """Return the position."""
        return self._pos

    def readinto(self, buffer: Any) -> int:
        """Read at the position into ``buffer`` (nothing after a failed write).

        Args:
            buffer: A writable buffer.

        Returns:
            The bytes read.
        """
        view = memoryview(buffer).cast("B")
        data = os.pread(self.fd, view.nbytes, self._pos) if self.error is None else b""
        view[:len(data)] = data
        self._pos += len(data)
        return len(data)

    def write(self, buffer: Any) -> int:
        """Write ``buffer`` at the position; never raises (see :attr:`error`).

        Args:
            buffer: The bytes to write.

        Returns:
            Their count, also after a failure (so that HDF5 goes on and closes cleanly).
        """
        view = memoryview(buffer).cast("B")
        n = view.nbytes
        if self.error is None:
            try:
                done = 0
                while done < n:
                    k = _pwrite(self.fd, view[done:], self._pos + done)
                    if k <= 0:
                        raise OSError(errno.EIO, "write made no progress")
                    done += k
                    self.written += k
            except OSError as exc:
                self._fail(exc)
        self._pos += n
        self._size = max(self._size, self._pos)
        self._since += n
        if self._since >= FLUSH_BYTES:
            self._since = 0
            self._todo.put(True)
        return n

    def truncate(self, size: int | None = None) -> int:
        """Set the file's size; never raises (see :attr:`error`).

        Args:
            size: The new size (default: the position).

        Returns:
            The new size.
        """
        size = self._pos if size is None else int(size)
        if self.error is None:
            try:
                os.ftruncate(self.fd, size)
            except OSError as exc:
                self._fail(exc)
        self._size = size
        return size

    def flush(self) -> None:
        """Nothing: data reaches the disk by write-back and :meth:`sync`."""

    # ---- the writer's side
    def sync(self) -> None:
        """``fsync`` the file (the error, if any, goes to :attr:`error`)."""
        if self.error is None:
            try:
                os.fsync(self.fd)
            except OSError as exc:
                self._fail(exc)

    def close(self) -> None:
        """Stop the write-back thread and close the file (idempotent)."""
        if self.closed:
            return
        self._todo.put(False)
        self._thread.join()
        os.close(self.fd)
        super().close()

    def _fail(self, exc: OSError) -> None:
        if self.error is None:
            self.error = exc

    def _write_back(self) -> None:
        while self._todo.get():
            if self.error is None:
                try:
                    _fdatasync(self.fd)
                except OSError as exc:
                    self._fail(exc)


def free_bytes(directory: str | os.PathLike[str]) -> int | None:
    """Return the bytes an unprivileged user may still write in ``directory``.

    Args:
        directory: A directory.

    Returns:
        The free bytes, or None when the file system does not say.
    """
    try:
        st = os.statvfs(directory)
    except (OSError, AttributeError):
        return None
    return int(st.f_bavail) * int(st.f_frsize)


_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def space_problem(directory: Path, needed: int, exc: OSError | None = None,
                  written: int | None = None, name: str | None = None) -> str:
    """Word one message for a checkpoint that does not fit (or failed to write).

    Args:
        directory: Where the checkpoint goes.
        needed: Bytes of its data.
        exc: The write's error; None: the pre-check found less free space than needed.
        written: Bytes written before the error, if known.
        name: The file being written, if any.

    Returns:
        The message: what happened, the free space, and what to do about it.
    """
    free = free_bytes(directory)
    have = "unknown free space" if free is None else f"{format_bytes(free)} free"
    need = f"the checkpoint needs at least {format_bytes(needed)}"
    if exc is None:
        return (f"not enough space in {directory}: {have}, {need}; free space there "
                "(or keep fewer checkpoints: keep_last / --checkpoint-keep)")
    what = exc.strerror or str(exc)
    where = f" writing {name}" if name else ""
    after = f" after {format_bytes(written)}" if written is not None else ""
    if exc.errno in _SPACE_ERRNOS:
        return (f"{what}{where}{after} in {directory} ({have}; {need}); free space there "
                "(or keep fewer checkpoints: keep_last / --checkpoint-keep)")
    return f"{what}{where}{after} in {directory} ({have}; {need})"
