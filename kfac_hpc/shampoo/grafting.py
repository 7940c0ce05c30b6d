"""Grafting: the diagonal method whose per-block step size Shampoo's direction borrows.

Per block, the Shampoo direction is rescaled to the norm of the grafting method's
direction (``"sgd"``, ``"adagrad"``, ``"rmsprop"``, ``"adam"``); before
``start_preconditioning_step`` the grafting direction is used as it is. The second
moment is accumulated from the raw gradient; the direction is computed from the
β1-filtered (bias-corrected) gradient, so ``"adam"`` grafting alone is exactly Adam.

* ``adagrad``: ``v += g²``; direction ``m / (sqrt(v) + eps)``.
* ``rmsprop``: ``v = β·v + (1-β)·g²``; direction ``m / (sqrt(v) + eps)``.
* ``adam``: as rmsprop with ``sqrt(v / (1 - β^t))`` when bias correction is on.
* ``sgd`` (and no grafting): direction ``m``.

Every function works on lists of batches (one tensor per run of same-shape blocks,
see :mod:`.stacks`) with ``torch._foreach_*`` calls: one kernel (a few on a GPU, by
multi-tensor apply) per operation, whatever the number of blocks.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "GRAFTING_KINDS",
    "directions",
    "rescale_to",
    "second_moment_corrections",
    "update_second_moments",
    "uses_second_moment",
]

GRAFTING_KINDS = ("sgd", "adagrad", "rmsprop", "adam")


def uses_second_moment(kind: str | None) -> bool:
    """Say whether the grafting method ``kind`` keeps a per-element second moment."""
    return kind in ("adagrad", "rmsprop", "adam")


def update_second_moments(kind: str | None, moments: list[Tensor], grads: list[Tensor],
                          beta2: float) -> None:
    """Accumulate ``grad²`` into each of ``moments`` in place (one ``_foreach`` call each).

    Args:
        kind: The grafting method.
        moments: The second moments, updated in place.
        grads: The gradients, shaped like ``moments``.
        beta2: The second-moment β (1: a plain sum, AdaGrad).
    """
    if kind == "adagrad":
        torch._foreach_addcmul_(moments, grads, grads)
    elif kind in ("rmsprop", "adam"):
        torch._foreach_mul_(moments, beta2)
        torch._foreach_addcmul_(moments, grads, grads, value=1.0 - beta2)


def second_moment_corrections(kind: str | None, beta2: float, steps: list[int],
                              bias_correction: bool) -> list[float] | None:
    """Adam's ``√(1 − β2^t)`` per tensor, or None where no correction applies.

    Args:
        kind: The grafting method.
        beta2: Its second-moment β.
        steps: Per tensor, its step count.
        bias_correction: Whether Adam's bias correction applies.

    Returns:
        The divisors of the second moments' square roots, or None.
    """
    if kind == "adam" and bias_correction:
        return [math.sqrt(1.0 - beta2**t) for t in steps]
    return None


def directions(kind: str | None, filtered: list[Tensor], moments: list[Tensor],
               epsilon: float, corrections: Sequence[float] | Sequence[Tensor] | None
               ) -> list[Tensor]:
    """Compute the grafting method's directions (new tensors for adaptive kinds).

    Args:
        kind: The grafting method.
        filtered: The β1-filtered gradients.
        moments: Their second moments (ignored unless the kind uses them).
        epsilon: The method's ε.
        corrections: :func:`second_moment_corrections`, as numbers or as 0-dim tensors
            holding them (a captured step reads them there: the same divisions).

    Returns:
        One direction per filtered gradient.
    """
    if not uses_second_moment(kind):
        return list(filtered)
    denom = torch._foreach_sqrt(moments)
    if corrections is not None:
        divisors: Any = list(corrections)  # numbers or 0-dim tensors: both overloads divide
        torch._foreach_div_(denom, divisors)
    torch._foreach_add_(denom, epsilon)
    return list(torch._foreach_div(filtered, denom))


def _row_norms(batches: list[Tensor]) -> Tensor:
    """The norm of every row (block) of every batch, concatenated: one ``_foreach_norm``."""
    rows = [row for batch in batches for row in batch.unbind(0)]
    return torch.stack(list(torch._foreach_norm(rows)))


def rescale_to(directions: list[Tensor], targets: list[Tensor]) -> None:
    """Scale each block (row) of ``directions`` in place to the norm of the same row of ``targets``.

    ``d ← d·‖t‖/‖d‖`` (0 where ``d`` is zero); no host sync.

    Args:
        directions: Batches ``(n, …)``, scaled in place.
        targets: Batches of the same shapes.
    """
    target, source = _row_norms(targets), _row_norms(directions)
    ratio = torch.where(source > 0, target / source, 0.0)
    for d, r in zip(directions, ratio.split([d.shape[0] for d in directions])):
        d.mul_(r.view((-1,) + (1,) * (d.dim() - 1)))
