"""The K-FAC ``state_dict()`` layout, as a type.

:meth:`KFACPreconditioner.state_dict <kfac_hpc.kfac.preconditioner.KFACPreconditioner.state_dict>`
returns a :class:`KFACStateDict` and ``load_state_dict`` takes one; the checkpoint code
(:mod:`kfac_hpc.checkpoint`) reads and rebuilds it. Factors and decompositions are
keyed by factor name (``"<layer>/A"``, ``"<layer>/G"``), never by rank or position, so
the state of one world size loads on another.

A preconditioner may add entries of its own beyond these keys (tensors, numbers,
strings, nested dicts and lists): a checkpoint stores them per rank and hands them back
to the rank that saved them (see ``docs/checkpoints.md``).
"""

from __future__ import annotations

from typing import Any, TypedDict

from torch import Tensor

__all__ = ["Decomposition", "KFACStateDict"]

#: A stored decomposition by part name: ``{"Q", "lambda"}`` (eigen), ``{"inv"}``
#: (inverse) or, low rank, ``{"Q" (d x k), "lambda" (k), "rho" (1), "rank" (1)}``.
Decomposition = dict[str, Tensor]


class _KFACStateRequired(TypedDict):
    """The entries every K-FAC ``state_dict()`` holds."""

    step: int
    factors: dict[str, Tensor]
    factor_updates: dict[str, int]
    config: dict[str, Any]


class KFACStateDict(_KFACStateRequired, total=False):
    """A K-FAC preconditioner's ``state_dict()`` (this rank's part of it).

    Attributes:
        step: Preconditioner steps taken.
        factors: The running average of every factor this rank owns that has had an
            update, by factor name.
        factor_updates: Updates of every factor this rank owns, by factor name (0: no
            update yet, and no entry in ``factors``).
        config: The preconditioner's settings (JSON-able: strategy, damping, ...).
        history: Only with ``factor_sync="inverse"``: the names of the factors updated
            before, on this rank (each rank has its own).
        eigenbases: Only with ``state_dict(eigenbases=True)``: the current
            decomposition of every owned factor that has one, by factor name.
    """

    history: list[str]
    eigenbases: dict[str, Decomposition]
