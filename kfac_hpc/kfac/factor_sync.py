"""Deferred factor synchronisation: local running averages reduced only when needed.

The running average is linear in the batch factors, so after a synchronisation at which
the global factor was ``F_s``, every later value is ``F = c·F_s + mean_r(D_r)`` where each
rank ``r`` folds its own batch factors ``B`` into ``D_r ← ρ·D_r + (1−ρ)·B`` and
``c ← ρ·c``, starting from ``c = 1, D_r = 0``. Reducing ``D`` at inverse-update steps
gives exactly the factor that synchronising at every factor update would give. (The very
first update of a factor sets ``F = B``: ``c = 0, D_r = B_r``.)

Assumes every rank updates a layer's statistics at the same steps (SPMD training).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor


@dataclass
class LocalAverage:
    """This rank's share of a factor's running average since the last synchronisation."""

    coefficient: float = 1.0  # c: weight of the factor at the last synchronisation
    delta: Tensor | None = None  # D_r
    updates: int = 0  # factor updates folded in since the last synchronisation

    def fold(self, batch: Tensor, decay: float, first_ever: bool) -> None:
        """Fold one batch factor in, as ``update_running_average`` would on the owner."""
        if first_ever:
            self.coefficient, self.delta = 0.0, batch.clone()
        elif self.delta is None:
            self.coefficient *= decay
            self.delta = batch * (1.0 - decay)
        else:
            self.coefficient *= decay
            self.delta.mul_(decay).add_(batch, alpha=1.0 - decay)
        self.updates += 1

    def reset(self) -> None:
        """Start afresh after a synchronisation: ``c = 1``, ``D_r = 0``."""
        self.coefficient, self.delta, self.updates = 1.0, None, 0
