"""α–β (Hockney) cost of MPI collectives: the standard algorithm formulas.

``p`` ranks, ``n`` bytes of the message the collective operates on (the convention of
:class:`kfac_hpc.comm.TrafficStats`: the whole vector for allreduce, broadcast and
reduce-scatter, the whole result for allgather), ``α`` seconds per message (latency),
``β`` seconds per byte (inverse bandwidth). Formulas (Thakur, Rabenseifner & Gropp 2005;
Chan et al. 2007):

=================  =================================  ======================================
collective         ring / pipelined                    tree / recursive
=================  =================================  ======================================
allreduce          2(p-1)α + 2(p-1)/p·nβ  (ring)       2⌈log₂p⌉(α + nβ)  (binomial reduce+bcast)
                   2⌈log₂p⌉α + 2(p-1)/p·nβ (Rabenseifner: reduce-scatter + allgather)
reduce-scatter     (p-1)α + (p-1)/p·nβ    (ring)       ⌈log₂p⌉α + (p-1)/p·nβ (recursive halving)
broadcast          (⌈log₂p⌉+p-1)α + 2(p-1)/p·nβ        ⌈log₂p⌉(α + nβ)  (binomial tree)
                   (scatter + ring allgather)
allgather          (p-1)α + (p-1)/p·nβ    (ring)       ⌈log₂p⌉α + (p-1)/p·nβ (recursive doubling)
=================  =================================  ======================================

``algorithm="auto"`` takes the cheapest formula, as MPI libraries' tuned selection
roughly does. One rank (``p = 1``) costs nothing. Reduction arithmetic (γ) is folded
into β. :func:`wire_bytes` gives the bytes a rank sends under the same algorithm.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["ALGORITHMS", "COLLECTIVES", "Coefficients", "LinkCost", "coefficients",
           "collective_time", "wire_bytes"]

COLLECTIVES = ("allreduce", "reduce_scatter", "broadcast", "allgather")


@dataclass(frozen=True)
class Coefficients:
    """``t = a·α + b·n·β``: latency terms ``a`` and bandwidth factor ``b`` of one algorithm."""

    latency: float
    bandwidth: float


def _log2(p: int) -> int:
    return math.ceil(math.log2(p)) if p > 1 else 0


def _formulas(kind: str, p: int) -> dict[str, Coefficients]:
    lg, frac = _log2(p), (p - 1) / p
    table: dict[str, dict[str, Callable[[], Coefficients]]] = {
        "allreduce": {
            "ring": lambda: Coefficients(2 * (p - 1), 2 * frac),
            "tree": lambda: Coefficients(2 * lg, 2 * lg),
            "rabenseifner": lambda: Coefficients(2 * lg, 2 * frac),
        },
        "reduce_scatter": {
            "ring": lambda: Coefficients(p - 1, frac),
            "tree": lambda: Coefficients(lg, frac),  # recursive halving
        },
        "broadcast": {
            "ring": lambda: Coefficients(lg + p - 1, 2 * frac),  # scatter + ring allgather
            "tree": lambda: Coefficients(lg, lg),  # binomial
        },
        "allgather": {
            "ring": lambda: Coefficients(p - 1, frac),
            "tree": lambda: Coefficients(lg, frac),  # recursive doubling
        },
    }
    if kind not in table:
        raise ValueError(f"unknown collective {kind!r}; use one of {COLLECTIVES}")
    return {name: make() for name, make in table[kind].items()}


ALGORITHMS = ("auto", "ring", "tree", "rabenseifner")


def coefficients(kind: str, p: int, algorithm: str = "auto", nbytes: float = 0.0,
                 alpha: float = 0.0, beta: float = 0.0) -> tuple[str, Coefficients]:
    """Return the algorithm used for ``kind`` on ``p`` ranks and its coefficients.

    Args:
        kind: The collective, one of :data:`COLLECTIVES`.
        p: The number of ranks (>= 1).
        algorithm: A name of :data:`ALGORITHMS`; ``"auto"`` picks the cheapest for the
            given message and link; a named algorithm a collective lacks
            (``rabenseifner`` outside allreduce) falls back to ring.
        nbytes: The message size, for ``"auto"``.
        alpha: Seconds per message, for ``"auto"``.
        beta: Seconds per byte, for ``"auto"``.

    Returns:
        The algorithm's name and its latency and bandwidth coefficients.

    Raises:
        ValueError: ``kind`` or ``algorithm`` is unknown, or ``p`` is below 1.
    """
    if p < 1:
        raise ValueError(f"p must be >= 1, got {p}")
    options = _formulas(kind, p)
    if algorithm == "auto":
        name = min(options, key=lambda k: (options[k].latency * alpha
                                           + options[k].bandwidth * nbytes * beta, k))
        return name, options[name]
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {algorithm!r}; use one of {ALGORITHMS}")
    name = algorithm if algorithm in options else "ring"
    return name, options[name]


@dataclass(frozen=True)
class LinkCost:
    """α (s/message) and β (s/byte) of one collective, and the algorithm choice."""

    alpha: float
    beta: float
    algorithm: str = "auto"

    def time(self, kind: str, nbytes: float, p: int) -> float:
        """Return the seconds for one ``kind`` call of ``nbytes`` on ``p`` ranks (0 on one rank)."""
        if p <= 1:
            return 0.0
        _, c = coefficients(kind, p, self.algorithm, nbytes, self.alpha, self.beta)
        return c.latency * self.alpha + c.bandwidth * nbytes * self.beta


def collective_time(kind: str, nbytes: float, p: int, alpha: float, beta: float,
                    algorithm: str = "auto") -> float:
    """Return the seconds for one collective call (see the module table).

    Args:
        kind: The collective.
        nbytes: The message size in the counters' convention.
        p: The number of ranks.
        alpha: Seconds per message.
        beta: Seconds per byte.
        algorithm: The algorithm's name, or ``"auto"``.

    Returns:
        Seconds (0 on one rank).
    """
    return LinkCost(alpha, beta, algorithm).time(kind, nbytes, p)


def wire_bytes(kind: str, nbytes: float, p: int, algorithm: str = "ring") -> float:
    """Return the bytes one rank sends for a call under ``algorithm`` (the β term's volume).

    Args:
        kind: The collective.
        nbytes: The message size in the counters' convention.
        p: The number of ranks.
        algorithm: The algorithm's name.

    Returns:
        Bytes (0 on one rank).
    """
    if p <= 1:
        return 0.0
    _, c = coefficients(kind, p, algorithm)
    return c.bandwidth * nbytes
