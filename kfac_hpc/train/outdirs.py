"""The run's output directories (``--out``, ``--checkpoint-dir``), checked at setup.

A directory the run cannot write (read-only, full, a file in the way, no permission)
used to be found by the first write: a traceback and ``MPI_ABORT`` for ``--out``, and
for ``--checkpoint-dir`` only after the first epoch had trained. :func:`check_output_dirs`
creates each directory and writes, syncs and removes a small probe file in it on
rank 0; the training loop runs it through its agreement (every rank raises the same
:class:`~kfac_hpc.train.config.ConfigError`: one message, exit status 2).
"""

from __future__ import annotations

import contextlib
import errno
import os
from pathlib import Path

from kfac_hpc.train.config import ConfigError

__all__ = ["PROBE_BYTES", "check_output_dirs", "check_writable"]

#: Bytes the probe file writes (one page: a full file system refuses them).
PROBE_BYTES = 4096


def check_writable(directory: str | os.PathLike[str], flag: str) -> None:
    """Create ``directory`` (and its parents) and write a probe file in it.

    Args:
        directory: The directory the run will write to.
        flag: The option that named it, for the message (e.g. ``--out``).

    Raises:
        ConfigError: The directory cannot be created or written; the message names
            the option, the path and the reason.
    """
    path = Path(directory)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise ConfigError(f"{flag} {path}: exists and is not a directory") from None
    except OSError as exc:
        raise ConfigError(f"{flag} {path}: cannot create the directory: "
                          f"{_reason(exc)}") from None
    if not path.is_dir():
        raise ConfigError(f"{flag} {path}: exists and is not a directory")
    probe = path / f".kfac_hpc_write_probe.{os.getpid()}"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, b"\0" * PROBE_BYTES)
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as exc:
        raise ConfigError(f"{flag} {path}: cannot write in the directory: "
                          f"{_reason(exc)}") from None
    finally:
        with contextlib.suppress(OSError):
            probe.unlink()


def check_output_dirs(rank: int, out: str | os.PathLike[str] | None,
                      checkpoint_dir: str | os.PathLike[str] | None) -> None:
    """Check on rank 0 that the run and checkpoint directories can be written.

    :func:`check_writable` for each; the other ranks return at once (run it through an
    agreement).

    Args:
        rank: This process's rank.
        out: The run directory (metrics, summary), or None.
        checkpoint_dir: ``--checkpoint-dir``, or None.

    Raises:
        ConfigError: On rank 0, a directory that cannot be written.
    """
    if rank != 0:
        return
    if out is not None:
        check_writable(out, "--out")
    if checkpoint_dir is not None and (out is None or Path(checkpoint_dir) != Path(out)):
        check_writable(checkpoint_dir, "--checkpoint-dir")


def _reason(exc: OSError) -> str:
    text = exc.strerror or str(exc)
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"{text} (the file system is full)"
    if exc.errno == errno.EROFS:
        return f"{text} (mounted read-only)"
    return text
