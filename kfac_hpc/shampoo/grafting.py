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
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = [
    "GRAFTING_KINDS",
    "direction",
    "norm_ratio",
    "update_second_moment",
    "uses_second_moment",
]

GRAFTING_KINDS = ("sgd", "adagrad", "rmsprop", "adam")


def uses_second_moment(kind: str | None) -> bool:
    """Whether the method keeps a per-element second moment."""
    return kind in ("adagrad", "rmsprop", "adam")


def update_second_moment(kind: str | None, second_moment: Tensor, grad: Tensor,
                         beta2: float) -> None:
    """Accumulate ``grad²`` into ``second_moment`` in place."""
    if kind == "adagrad":
        second_moment.addcmul_(grad, grad)
    elif kind in ("rmsprop", "adam"):
        second_moment.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)


def direction(kind: str | None, filtered_grad: Tensor, second_moment: Tensor | None,
              epsilon: float, beta2: float, step: int, bias_correction: bool) -> Tensor:
    """The grafting method's direction for ``filtered_grad`` (a new tensor for adaptive kinds)."""
    if not uses_second_moment(kind):
        return filtered_grad
    assert second_moment is not None
    denom = second_moment.sqrt()
    if kind == "adam" and bias_correction:
        denom.div_(math.sqrt(1.0 - beta2**step))
    return filtered_grad / denom.add_(epsilon)


def norm_ratio(target: Tensor, source: Tensor) -> Tensor:
    """``‖target‖ / ‖source‖`` as a 0-d tensor (0 where ``source`` is zero); no host sync."""
    target_norm = torch.linalg.vector_norm(target)
    source_norm = torch.linalg.vector_norm(source)
    safe = torch.where(source_norm > 0, source_norm, torch.ones_like(source_norm))
    return torch.where(source_norm > 0, target_norm / safe, torch.zeros_like(source_norm))
