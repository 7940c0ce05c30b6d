"""The environment for a test's child process or job: a new one, never part of this one.

pytest may itself run under ``mpiexec`` (the MPI stages), or have initialised MPI as a
singleton; the MPI runtime then set variables telling this process its place in that
job, which a child would take as its own.
"""

from __future__ import annotations

import os

#: The prefixes of the MPI runtimes' variables (Open MPI, PMIx, PRRTE, Hydra/Slurm PMI).
MPI_RUNTIME_PREFIXES = ("OMPI_", "PMIX_", "PRTE_", "PMI_")


def fresh_env(**extra: str) -> dict[str, str]:
    """This process's environment without the MPI runtime's variables, plus ``extra``.

    Args:
        **extra: Variables to set in the child's environment.

    Returns:
        The child's environment.
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith(MPI_RUNTIME_PREFIXES)}
    env.update(extra)
    return env
