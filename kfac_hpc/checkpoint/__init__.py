"""HDF5 checkpoints: atomic, verifiable, exact resume, restart on another number of ranks.

::

    from kfac_hpc import checkpoint
    checkpoint.save(directory_or_path, model=..., optimizer=..., preconditioner=None,
                    step=..., comm=None, extra=None, keep_last=3)       # -> path
    info = checkpoint.load(directory_or_path, model=..., optimizer=...,
                           preconditioner=None, comm=None, strict=True)  # dir -> latest
    checkpoint.latest(directory)                                         # -> path | None
    checkpoint.verify_file(path).ok
    saver = checkpoint.BackgroundSaver(comm); saver.save(dir, ...); saver.wait()

``save`` and ``load`` are collective (every rank calls them) and raise
:class:`CheckpointError` on every rank alike (``save`` raises its subclass
:class:`NonFiniteStateError` for state holding NaN/Inf); ``verify_file``,
``latest`` and the ``kfac-hpc ckpt`` command run on one process without ``mpiexec``.
See ``docs/checkpoints.md``.
"""

from kfac_hpc.checkpoint.atomic import latest, list_checkpoints
from kfac_hpc.checkpoint.background import BackgroundSaver
from kfac_hpc.checkpoint.errors import CheckpointError, NonFiniteStateError
from kfac_hpc.checkpoint.layout import FORMAT, FORMAT_VERSION
from kfac_hpc.checkpoint.reader import LoadInfo, load
from kfac_hpc.checkpoint.verify import VerifyReport, verify_file
from kfac_hpc.checkpoint.writer import save

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "BackgroundSaver",
    "CheckpointError",
    "LoadInfo",
    "NonFiniteStateError",
    "VerifyReport",
    "latest",
    "list_checkpoints",
    "load",
    "save",
    "verify_file",
]
