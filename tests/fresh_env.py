"""The environment for a test's child process or job: a new one, never part of this one.

pytest may itself run under ``mpiexec`` (the MPI stages), or have initialised MPI as a
singleton; the MPI runtime then set variables telling this process its place in that
job, which a child would take as its own. Which variables those are is written once,
in ``launch/mpi-runtime-vars.txt`` (``launch/local`` drops the same); settings a user
makes (``OMPI_MCA_btl...``, ``PMIX_MCA_*``) reach the child.
"""

from __future__ import annotations

import os
from fnmatch import fnmatchcase
from functools import cache
from pathlib import Path

RUNTIME_VARS = Path(__file__).resolve().parent.parent / "launch" / "mpi-runtime-vars.txt"


@cache
def _patterns() -> tuple[tuple[str, bool], ...]:
    """``launch/mpi-runtime-vars.txt`` as (glob, drop) pairs, in order."""
    lines = (line.strip() for line in RUNTIME_VARS.read_text().splitlines())
    return tuple((line.removeprefix("!"), not line.startswith("!"))
                 for line in lines if line and not line.startswith("#"))


def mpi_runtime_var(name: str) -> bool:
    """Whether ``name`` is set by an MPI runtime for its process (the first match decides).

    Args:
        name: An environment variable's name.

    Returns:
        True for the runtime's variables, False for everything else.
    """
    return next((drop for glob, drop in _patterns() if fnmatchcase(name, glob)), False)


def fresh_env(**extra: str) -> dict[str, str]:
    """This process's environment without the MPI runtime's variables, plus ``extra``.

    Args:
        **extra: Variables to set in the child's environment.

    Returns:
        The child's environment.
    """
    env = {k: v for k, v in os.environ.items() if not mpi_runtime_var(k)}
    env.update(extra)
    return env
