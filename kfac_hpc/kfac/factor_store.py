"""The Kronecker factors a rank holds: running averages, local averages, history.

A :class:`FactorStore` keeps, per :class:`~kfac_hpc.kfac.placement.FactorKey`, the
running average ``F`` and its update count (:class:`FactorState`) of the factors this
rank owns, plus replicas of the local (small) factors of the layers it preconditions.
It folds reduced batch factors into the averages (two multi-tensor kernels for all),
and, with ``factor_sync="inverse"``, this rank's local averages ``D_r`` between
synchronisations (:class:`~kfac_hpc.kfac.factor_sync.LocalAverage`) together with the
history (which factors were ever updated, so a first update is recognised on every
rank). It owns its part of ``state_dict()``: the owned factors and their counts, and
the history. It sends nothing itself: the exchanges move its contents.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from kfac_hpc.kfac import linalg
from kfac_hpc.kfac.factor_sync import LocalAverage
from kfac_hpc.kfac.placement import FactorKey
from kfac_hpc.kfac.state import KFACStateDict
from kfac_hpc.phases import Phase, PhaseTimer, timed

__all__ = ["FactorState", "FactorStore", "mean"]


@dataclass
class FactorState:
    """A factor's running average (on its owner only) and its update count."""

    dim: int
    average: Tensor | None = None
    updates: int = 0


def mean(total: Tensor, count: int) -> Tensor:
    """``total / count`` without the pass when ``count`` is 1 (``x / 1 == x`` exactly).

    Read-only: the running-average updates copy or combine it, never modify it.

    Args:
        total: A sum of ``count`` batch factors.
        count: How many were summed.

    Returns:
        Their mean.
    """
    return total if count == 1 else total / count


class FactorStore:
    """Factor states of one rank (see the module docstring)."""

    def __init__(self, held: Mapping[FactorKey, int], owned: Iterable[FactorKey],
                 captured: Iterable[FactorKey], *, deferred: bool, rank: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        """Hold no factor yet: every state starts empty.

        Args:
            held: The factors this rank holds and their dimensions (owned and replicas), in
                model order.
            owned: Those of ``held`` it owns (saves in checkpoints).
            captured: The factors this rank's hooks capture (``factor_sync="inverse"``:
                each gets a local average).
            deferred: Whether factors are synchronised at inverse steps only.
            rank: This rank (named in errors).
            dtype: The factor dtype.
            device: Where the factors live.
        """
        self.states: dict[FactorKey, FactorState] = {key: FactorState(n)
                                                     for key, n in held.items()}
        mine = set(owned)
        self.owned_keys = [key for key in self.states if key in mine]
        self.local_averages: dict[FactorKey, LocalAverage] = {
            key: LocalAverage() for key in captured} if deferred else {}
        self.history: set[FactorKey] = set()  # factors updated before (deferred only)
        self.deferred, self.rank = deferred, rank
        self.phase_timer: PhaseTimer | None = None  # times the folds (kfac_hpc.phases)
        self.dtype, self.device = dtype, device

    # ---------------------------------------------------------------- reading
    def owned(self) -> dict[FactorKey, FactorState]:
        """The states of the factors this rank owns."""
        return {key: self.states[key] for key in self.owned_keys}

    def zeros(self, n: int) -> Tensor:
        """An ``n x n`` zero factor (a factor nobody updated)."""
        return torch.zeros(n, n, dtype=self.dtype, device=self.device)

    def snapshot(self) -> dict[FactorKey, FactorState]:
        """A copy of every state (what a background decomposition reads)."""
        return {key: FactorState(s.dim, None if s.average is None else s.average.clone(),
                                 s.updates) for key, s in self.states.items()}

    def memory_bytes(self) -> int:
        """Bytes of the running averages held."""
        return sum(s.average.nbytes for s in self.states.values() if s.average is not None)

    # ---------------------------------------------------------------- updating
    @timed(Phase.KFAC_AVERAGES)
    def fold(self, received: Mapping[FactorKey, tuple[Tensor, int]], decay: float) -> None:
        """Fold summed batch factors into the running averages.

        Running averages ``F ← decay·F + (1-decay)·mean`` of every factor with
        statistics this step (two multi-tensor kernels for all); a first update copies.

        Args:
            received: Per held factor, the sum of batch factors and how many were summed
                (0: the layer was not used on any rank this step).
            decay: The factor decay of the step.
        """
        currents: list[Tensor] = []
        batches: list[Tensor] = []
        for key, (total, count) in received.items():
            if count == 0:
                continue
            state = self.states[key]
            if state.average is None:
                state.average = linalg.update_running_average(None, mean(total, count), decay)
            else:
                currents.append(state.average)
                batches.append(mean(total, count))
            state.updates += 1
        linalg.update_running_averages(currents, batches, decay)

    @timed(Phase.KFAC_AVERAGES)
    def fold_local(self, sums: Mapping[FactorKey, tuple[Tensor, int]], decay: float) -> None:
        """Fold this rank's batch factors into its local averages.

        Fold this rank's batch factors into its local averages (a factor never updated before starts
        from its first batch).

        Args:
            sums: Per captured factor, the sum of batch factors and their count.
            decay: The factor decay of the step.
        """
        for key, (total, count) in sums.items():
            local = self.local_averages[key]
            first = key not in self.history and local.updates == 0
            local.fold(mean(total, count), decay, first)

    @property
    def has_pending(self) -> bool:
        """Whether a local average holds updates not yet synchronised."""
        return any(local.updates for local in self.local_averages.values())

    def delta(self, key: FactorKey, n: int) -> tuple[Tensor, bool]:
        """Return this rank's local average of ``key`` and whether it holds updates.

        This rank's local average ``D_r`` of ``key`` (zeros if none) and whether it
        holds updates.
        """
        local = self.local_averages[key]
        return (local.delta if local.delta is not None else self.zeros(n)), bool(local.updates)

    @timed(Phase.KFAC_AVERAGES)
    def fold_synchronised(self, received: Mapping[FactorKey, tuple[Tensor, int]]) -> None:
        """Fold the summed local averages into the owners' factors.

        ``F ← c·F + mean_r D_r`` from the summed local averages, then every local average restarts
        (and the history notes the factors updated).

        Args:
            received: Per held factor, ``Σ_r D_r`` and how many ranks folded updates.
        """
        for key, (total, ranks) in received.items():
            if ranks == 0:
                continue
            state, local = self.states[key], self.local_averages[key]
            mean_delta = total / ranks
            if state.average is None or local.coefficient == 0.0:
                state.average = mean_delta.clone()
            else:
                state.average.mul_(local.coefficient).add_(mean_delta)
            state.updates += local.updates
        for key, local in self.local_averages.items():
            if local.updates:
                self.history.add(key)
            local.reset()

    def set_replica(self, key: FactorKey, average: Tensor | None, updates: int) -> None:
        """A local factor's replica as its owner sent it."""
        state = self.states[key]
        state.updates = updates
        state.average = average

    # ---------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """Return this store's part of ``state_dict()``.

        Owned factors (by name), their update counts and, with ``factor_sync="inverse"``, the
        history (every rank's).
        """
        owned = self.owned()
        state: dict[str, Any] = {
            "factors": {k.name: s.average for k, s in owned.items() if s.average is not None},
            "factor_updates": {k.name: s.updates for k, s in owned.items()}}
        if self.deferred:
            state["history"] = sorted(k.name for k in self.history)
        return state

    def load_problem(self, state: KFACStateDict) -> Exception | None:
        """What keeps ``state`` from loading here (``None``: it fits), without changes.

        Args:
            state: A ``state_dict()``, possibly with more factors than this rank owns.

        Returns:
            The error to raise (agreed by the caller before anything changes), or None.
        """
        factors = state["factors"]
        updates = state.get("factor_updates", {})
        owned = {key.name: s for key, s in self.owned().items()}
        missing = [k for k in owned if k not in factors and updates.get(k, 0) > 0]
        missing += [k for k in owned if k not in updates]
        if missing:
            return KeyError(f"factor state missing for {sorted(set(missing))} (owned by "
                            f"rank {self.rank}); was the checkpoint written for this model?")
        for name, s in owned.items():
            value = factors.get(name)
            if value is not None and tuple(value.shape) != (s.dim, s.dim):
                return ValueError(f"factor {name} has shape {tuple(value.shape)}, "
                                  f"expected {(s.dim, s.dim)}")
        return None

    def load_state_dict(self, state: KFACStateDict) -> None:
        """Take the owned factors and counts (checked by :meth:`load_problem` first).

        Local averages restart empty (the saved factors include every fold); a factor
        updated before is not "first" again (the saved history, or its count).

        Args:
            state: A ``state_dict()``.
        """
        factors, updates = state["factors"], state.get("factor_updates", {})
        for key, s in self.owned().items():
            value = factors.get(key.name)
            s.average = None if value is None else value.detach().to(
                device=self.device, dtype=self.dtype, copy=True)
            s.updates = int(updates[key.name])
        for local in self.local_averages.values():
            local.reset()
        history = state.get("history")
        self.history = {k for k in self.local_averages if k.name in set(history)} \
            if history is not None \
            else {k for k in self.local_averages if int(updates.get(k.name, 0)) > 0}
