"""Signal names and the exit status that asks for a requeue: no torch, no MPI.

Shared by the start-up handlers of the driver's entry point (installed before torch or
mpi4py are imported: :class:`kfac_hpc.train.cli.StartupSignals`) and the training loop's
:class:`kfac_hpc.runtime.preemption.PreemptionGuard`, so both read ``--preempt-signals``
alike and exit with the same status.
"""

from __future__ import annotations

import signal

__all__ = ["REQUEUE_EXIT_CODE", "parse_signal"]

REQUEUE_EXIT_CODE = 75  # EX_TEMPFAIL: "checkpointed (or nothing to save yet), run me again"


def parse_signal(name: str | int) -> signal.Signals:
    """Read a signal given as ``"USR1"``, ``"SIGUSR1"``, ``"10"`` or ``10``.

    Args:
        name: A signal name (with or without ``SIG``, any case) or number.

    Returns:
        The signal, e.g. ``signal.SIGUSR1``.

    Raises:
        ValueError: The name is not a signal; names the value.
    """
    if isinstance(name, int) or name.isdigit():
        return signal.Signals(int(name))
    text = name.upper()
    text = text if text.startswith("SIG") else "SIG" + text
    try:
        return signal.Signals[text]
    except KeyError:
        raise ValueError(f"unknown signal {name!r}; use e.g. USR1, USR2 or TERM") from None
