"""Crash-safe files: tmp + flush + fsync + ``os.replace`` + directory fsync.

A checkpoint directory holds ``ckpt_<step>.h5`` files and a ``latest`` pointer (a
one-line text file naming the newest complete checkpoint). The order of a save is:

1. write ``ckpt_<step>.h5.tmp``, flush, fsync it;
2. ``os.replace`` it to ``ckpt_<step>.h5`` and fsync the directory;
3. write ``latest.tmp``, fsync, ``os.replace`` to ``latest``, fsync the directory;
4. delete checkpoints beyond the last ``keep_last`` (never the one ``latest`` names).

A crash (kill -9, node failure) at any instant therefore leaves ``latest`` naming a
complete checkpoint (the new one or the previous one), and a complete file under
every ``ckpt_*.h5`` name: an incomplete file only ever exists under a ``.tmp`` name.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable
from pathlib import Path

from kfac_hpc.checkpoint.layout import LATEST, TMP_SUFFIX, checkpoint_name, step_of_name

__all__ = [
    "checkpoint_name",
    "commit",
    "fsync_dir",
    "fsync_file",
    "latest",
    "list_checkpoints",
    "prune",
    "read_pointer",
    "remove_stale_tmp",
    "tmp_path",
    "write_pointer",
]


def tmp_path(final: Path) -> Path:
    """Return where ``final`` is written before it is committed.

    Args:
        final: The file's final path.

    Returns:
        ``final`` with the ``.tmp`` suffix added.
    """
    return final.with_name(final.name + TMP_SUFFIX)


def fsync_file(path: Path) -> None:
    """Flush ``path``'s data and metadata to stable storage.

    Args:
        path: The file.
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(directory: Path) -> None:
    """Make renames and deletions in ``directory`` durable (no-op where unsupported).

    Args:
        directory: The directory.
    """
    try:
        fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some file systems refuse fsync on directories
        pass
    finally:
        os.close(fd)


def commit(tmp: Path, final: Path) -> None:
    """Fsync ``tmp``, atomically rename it to ``final``, fsync the directory.

    Args:
        tmp: The complete file, under its temporary name.
        final: Its name once committed (replaced if it exists).
    """
    fsync_file(tmp)
    os.replace(tmp, final)
    fsync_dir(final.parent)


def write_pointer(directory: Path, target: str) -> None:
    """Atomically make ``directory/latest`` name ``target``.

    Args:
        directory: The checkpoint directory.
        target: A file name in ``directory``.

    Raises:
        OSError: The pointer could not be written (the previous one is kept).
    """
    final = directory / LATEST
    tmp = tmp_path(final)
    try:
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(target + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, final)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    fsync_dir(directory)


def read_pointer(directory: Path) -> str | None:
    """Return the file name ``directory/latest`` names.

    Args:
        directory: The checkpoint directory.

    Returns:
        The name, or None when there is no usable pointer.
    """
    try:
        text = (Path(directory) / LATEST).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        return None
    if not text or "/" in text or text in (".", ".."):
        return None
    return text


def list_checkpoints(directory: str | os.PathLike[str]) -> list[Path]:
    """List the complete checkpoints in ``directory`` (``ckpt_<step>.h5``).

    Args:
        directory: The checkpoint directory.

    Returns:
        Their paths, oldest step first (empty when the directory cannot be read).
    """
    directory = Path(directory)
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    found = [(s, n) for n in names if (s := step_of_name(n)) is not None]
    return [directory / n for _, n in sorted(found)]


def candidates(directory: str | os.PathLike[str]) -> list[Path]:
    """List the checkpoints of ``directory`` in the order a resume tries them.

    Args:
        directory: The checkpoint directory.

    Returns:
        The one ``latest`` names, then the others newest step first.
    """
    directory = Path(directory)
    pointed = read_pointer(directory)
    order = list(reversed(list_checkpoints(directory)))
    if pointed is not None and (directory / pointed).is_file():
        order = [directory / pointed] + [p for p in order if p.name != pointed]
    return order


def latest(directory: str | os.PathLike[str], *, valid: bool = False) -> Path | None:
    """Return the checkpoint ``directory/latest`` names.

    Without a usable pointer (never written, or naming a deleted file) the newest
    ``ckpt_<step>.h5`` is returned: such a file is always complete (see the module
    docstring).

    Args:
        directory: The checkpoint directory.
        valid: Return the newest checkpoint that passes
            :func:`kfac_hpc.checkpoint.verify_file` instead (reads every checkpoint it
            tries).

    Returns:
        The checkpoint's path, or None when there is none.
    """
    order = candidates(directory)
    if not valid:
        return order[0] if order else None
    from kfac_hpc.checkpoint.verify import verify_file

    for path in order:
        if verify_file(path).ok:
            return path
    return None


def milestones(paths: list[Path], every_steps: int | None) -> set[str]:
    """Name the milestone checkpoints among ``paths``.

    A milestone is, for every ``k >= 1``, the checkpoint of the smallest step in
    ``[k * every_steps, (k + 1) * every_steps)`` (the first checkpoint at or after every
    ``every_steps``-th step).

    Args:
        paths: Checkpoint files.
        every_steps: The milestone spacing in steps; None or 0: no milestones.

    Returns:
        The milestones' file names.
    """
    if not every_steps or every_steps <= 0:
        return set()
    first: dict[int, tuple[int, str]] = {}
    for path in paths:
        step = step_of_name(path.name)
        if step is None or step < every_steps:
            continue
        k = step // every_steps
        if k not in first or step < first[k][0]:
            first[k] = (step, path.name)
    return {name for _, name in first.values()}


def prune(directory: Path, keep_last: int | None, protect: str | None = None,
          keep_every_steps: int | None = None, keep: Iterable[str] = ()) -> list[Path]:
    """Keep the last ``keep_last`` checkpoints of ``directory`` and delete the others.

    The kept ones are ``protect`` (the one just written) and the newest others by step.
    The milestones of ``keep_every_steps`` (:func:`milestones`) and the names in
    ``keep`` are kept besides them and never count against ``keep_last``.

    Args:
        directory: The checkpoint directory.
        keep_last: How many to keep; None or 0 keeps all.
        protect: The name of the checkpoint just written.
        keep_every_steps: Milestone spacing in steps (None: no milestones).
        keep: Names never deleted (e.g. the best checkpoint by a monitored metric).

    Returns:
        The deleted files.
    """
    if keep_last is None or keep_last <= 0:
        return []
    found = list_checkpoints(directory)
    kept = milestones(found, keep_every_steps) | set(keep)
    others = [p for p in found if p.name != protect and p.name not in kept]
    found = [p for p in found if p.name not in kept]
    keep_others = keep_last - (len(others) < len(found))
    removed = []
    for path in others[:len(others) - keep_others] if keep_others > 0 else others:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
            removed.append(path)
    if removed:
        fsync_dir(directory)
    return removed


#: The folder of ``directory`` where :func:`set_aside_later` moves an abandoned run's files.
ABANDONED = "abandoned"


def set_aside_later(directory: Path, step: int, *, now: str) -> list[Path]:
    """Move the checkpoints of steps after ``step`` into ``directory/abandoned/<now>/``.

    A save at ``step`` below the newest step on disk is a run resumed from an older
    checkpoint (after a divergence, or a fresh run in an old directory): the later
    files belong to the run it abandoned. Left in place they would take the rotation's
    places (``prune`` keeps the newest steps) and be what a resume falls back to when
    ``latest``'s file is damaged. Moved, not deleted: they stay loadable by path.

    Args:
        directory: The checkpoint directory.
        step: The step just written.
        now: The folder's name under ``abandoned/`` (a UTC timestamp: one per event).

    Returns:
        The new paths of the moved files.
    """
    later = [p for p in list_checkpoints(directory)
             if (s := step_of_name(p.name)) is not None and s > step]
    if not later:
        return []
    target = directory / ABANDONED / now
    target.mkdir(parents=True, exist_ok=True)
    fsync_dir(directory / ABANDONED)
    moved = []
    for path in later:
        os.replace(path, target / path.name)
        moved.append(target / path.name)
    fsync_dir(target)
    fsync_dir(directory)
    return moved


def remove_stale_tmp(directory: Path, keep: Path | None = None) -> None:
    """Delete leftovers of interrupted saves (``ckpt_*.h5.tmp``, ``latest.tmp``).

    Args:
        directory: The checkpoint directory.
        keep: A temporary file to leave (one being written).
    """
    try:
        names = os.listdir(directory)
    except OSError:
        return
    for name in names:
        if not name.endswith(TMP_SUFFIX):
            continue
        base = name[:-len(TMP_SUFFIX)]
        if step_of_name(base) is None and base != LATEST:
            continue
        if keep is not None and name == keep.name:
            continue
        with contextlib.suppress(OSError):
            (directory / name).unlink()

