"""Agreed failures: every rank learns how many ranks saw a fault, then all act alike.

A rank that sees non-finite statistics or a failed decomposition still joins the step's
collectives (its message carries zeros and ``valid = 0``); then one 4-byte allreduce
(:func:`agree`, tagged :attr:`~kfac_hpc.phases.Traffic.AGREEMENT`) tells every rank how
many ranks reported, and every rank raises the same
:class:`~kfac_hpc.kfac.errors.KFACNumericalError` (or, for statistics under a
GradScaler, skips the same update). No rank is left waiting in a collective.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from kfac_hpc.comm import Communicator
from kfac_hpc.kfac.errors import KFACNumericalError
from kfac_hpc.kfac.placement import FactorKey
from kfac_hpc.phases import Traffic

__all__ = ["agree", "decomposition_failure", "post_agree", "statistics_failure"]


def post_agree(comm: Communicator, fault: bool) -> Callable[[], int]:
    """:func:`agree` posted now (non-blocking); call the result for the count.

    Args:
        comm: The ranks that agree.
        fault: Whether this rank saw a fault.

    Returns:
        A function that waits and returns how many ranks reported a fault.
    """
    if comm.size == 1:
        return lambda: int(fault)
    count = torch.tensor([int(fault)], dtype=torch.int32, device="cpu")
    with comm.stats.tagged(Traffic.AGREEMENT):
        handle = comm.iallreduce(count, "sum")
    return lambda: int(handle.wait()[0])


def agree(comm: Communicator, fault: bool) -> int:
    """How many ranks of ``comm`` report a fault (a host-side allreduce of one integer).

    Args:
        comm: The ranks that agree (every one calls this).
        fault: Whether this rank saw a fault.

    Returns:
        The number of ranks with ``fault`` true, the same on every rank.
    """
    return post_agree(comm, fault)()


def statistics_failure(step: int, ranks: int, local: list[str]) -> KFACNumericalError:
    """The error every rank raises for non-finite factor statistics.

    Args:
        step: The K-FAC step.
        ranks: How many ranks saw non-finite statistics (agreed).
        local: The factors with non-finite statistics on this rank, by name.

    Returns:
        The error (raised by the caller).
    """
    here = f"; on this rank: {', '.join(local)}" if local else ""
    return KFACNumericalError(
        f"K-FAC step {step}: non-finite (NaN/Inf) factor statistics on {ranks} rank(s)"
        f"{here}. The inputs or gradients of these layers overflowed or hold NaN; factors "
        "were not updated. Lower the learning rate, check the data, or use a GradScaler "
        "under AMP; restore the last checkpoint to continue.",
        step=step, ranks=ranks, local=local)


def decomposition_failure(step: int, ranks: int,
                          failures: Mapping[FactorKey, BaseException]) -> KFACNumericalError:
    """The error every rank raises when a decomposition failed on any rank.

    Args:
        step: The K-FAC step.
        ranks: How many ranks had a failed decomposition (agreed).
        failures: This rank's failed factors and their exceptions.

    Returns:
        The error (raised by the caller ``from`` the first local exception).
    """
    message = (f"K-FAC step {step}: the decomposition of {len(failures) or 'a'} factor(s) "
               f"failed on {ranks} rank(s)")
    if failures:
        first = next(iter(failures.values()))
        message += (f"; on this rank: {', '.join(key.name for key in failures)} "
                    f"({type(first).__name__}: {first})")
    return KFACNumericalError(
        message + ". Decompositions were not updated (the factors hold this step's "
        "statistics already); restore the last checkpoint, with more damping or after "
        "checking for diverging training.",
        step=step, ranks=ranks, local=[key.name for key in failures])
