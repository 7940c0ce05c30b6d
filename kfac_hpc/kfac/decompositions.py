"""The decompositions a rank holds and how they are renewed.

:class:`Decompositions` holds the current decomposition of every factor of the layers
this rank preconditions and renews them at inverse steps: the owners decompose their
factors (:class:`~kfac_hpc.kfac.decomposer.Decomposer`), broadcast them in the worker
group (:class:`~kfac_hpc.kfac.exchanges.DecompositionExchange`), every rank agrees on
failures (:func:`~kfac_hpc.kfac.agree.agree`) and keeps the valid ones. Local (small)
factors are decomposed by every worker of their layer. After a load, the stored
decompositions are restored in place of the first renewal.

What preconditions a layer given its decompositions and the damping
(:class:`~kfac_hpc.kfac.decomposer.LayerSolve`: for low-rank factors their coefficients,
scaled bases and core) is built at the layer's first step after an installation and
kept (:meth:`Decompositions.solve`) until the decompositions are replaced (an inverse
update, a restore, a load) or the damping changes: steps between inverse updates do
only the gradient's GEMMs and products. It is derived state, never stored. Layers of
one shape preconditioned together keep one stacked solve
(:meth:`Decompositions.stacked_solve`, :class:`~kfac_hpc.kfac.decomposer.StackedSolve`:
their eigenbases stacked once per installation, and then held only there: the layers'
decompositions become views of the stacks; the denominators once per damping) under
the same rules.

When a renewal is computed is a plug-in (:class:`Renewal`), chosen once from
``decomposition_lag``: :class:`InStep` decomposes in the inverse step;
:class:`Lagged` decomposes a snapshot in a
:class:`~kfac_hpc.kfac.background.BackgroundJob` and installs it ``lag`` steps later.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

import torch
from torch import Tensor

from kfac_hpc.comm import Communicator
from kfac_hpc.kfac.agree import agree, decomposition_failure
from kfac_hpc.kfac.background import BackgroundJob, Decomposed
from kfac_hpc.kfac.decomposer import Decomposer, Failures, Held, LayerSolve, StackedSolve
from kfac_hpc.kfac.exchange import Part, Piece, PieceKey
from kfac_hpc.kfac.exchanges import DecompositionExchange
from kfac_hpc.kfac.factor_store import FactorState, FactorStore
from kfac_hpc.kfac.placement import FactorKey
from kfac_hpc.phases import Phase, PhaseTimer, timed

__all__ = ["Decompositions", "InStep", "Lagged", "Renewal", "make_renewal"]


class Decompositions:
    """This rank's decompositions (see the module docstring)."""

    def __init__(self, comm: Communicator, exchange: DecompositionExchange,
                 decomposer: Decomposer, store: FactorStore,
                 local: frozenset[FactorKey]) -> None:
        """Hold no decomposition yet.

        Args:
            comm: The world communicator (failures are agreed on it).
            exchange: The worker-group broadcast.
            decomposer: The compute method.
            store: This rank's factors.
            local: The local (small) factors.
        """
        self.comm, self.exchange, self.decomposer = comm, exchange, decomposer
        self.store, self.local = store, local
        self._held: dict[FactorKey, Held] = {}
        self._solves: dict[str, tuple[float, LayerSolve]] = {}  # by layer: (damping, solve)
        # by stack of layers: the stacked solve, or None where they are not stacked
        self._stacks: dict[tuple[str, ...], StackedSolve | None] = {}
        self.decomposed_at: int | None = None  # the step of the last installation
        # counts the replacements of the decompositions held (and of the solves built
        # from them): a captured step (kfac_hpc.step_graph) is valid while it stays
        self.generation = 0
        self.restored: dict[PieceKey, Tensor] | None = None  # loaded (owned), to restore
        # the stored forms of a load, by factor name, until restored: what a state_dict()
        # taken before the next step holds
        self._loaded: dict[str, Mapping[str, Tensor]] = {}
        self.phase_timer: PhaseTimer | None = None  # times the decomposition phases

    @property
    def held(self) -> dict[FactorKey, Held]:
        """The decompositions held now, by factor."""
        return self._held

    @held.setter
    def held(self, held: dict[FactorKey, Held]) -> None:
        """Replace the decompositions held; the solves built from the old ones go."""
        self._held = held
        self._forget_solves()

    def _forget_solves(self) -> None:
        """Drop what was built from the decompositions held before (a new generation)."""
        self._solves.clear()
        self._stacks.clear()
        self.generation += 1

    def solve(self, layer: str, damping: float) -> LayerSolve | None:
        """Return what preconditions ``layer`` with the held decompositions and ``damping``.

        Built by the decomposer on first use and kept until the decompositions are
        replaced or the damping differs.

        Args:
            layer: The layer's name.
            damping: This step's damping.

        Returns:
            The solve, or ``None`` when a factor of the layer has no decomposition.
        """
        kept = self._solves.get(layer)
        if kept is not None and kept[0] == damping:
            return kept[1]
        a, g = self._held.get(FactorKey(layer, "A")), self._held.get(FactorKey(layer, "G"))
        if a is None or g is None:
            return None
        solve = self.decomposer.solve(a, g, damping)
        self._solves[layer] = (damping, solve)
        return solve

    def stacked_solve(self, layers: Sequence[str], damping: float) -> StackedSolve | None:
        """Return what preconditions ``layers`` (one shape) together with ``damping``.

        Built by the decomposer on first use (the decompositions stacked) and kept until
        the decompositions are replaced; a different damping rebuilds only what depends
        on it (:meth:`~kfac_hpc.kfac.decomposer.StackedSolve.redamped`).

        Args:
            layers: The layers' names (two or more, one gradient shape).
            damping: This step's damping.

        Returns:
            The stacked solve, or ``None`` when a factor of the layers has no
            decomposition or the decomposer does not stack them (low rank, inverse):
            the caller preconditions them one by one (:meth:`solve`).
        """
        key = tuple(layers)
        if key in self._stacks:
            kept = self._stacks[key]
            if kept is None or kept.damping == damping:
                return kept
            solve: StackedSolve | None = kept.redamped(damping)
        else:
            pairs = [(self._held.get(FactorKey(name, "A")), self._held.get(FactorKey(name, "G")))
                     for name in key]
            solve = None if any(a is None or g is None for a, g in pairs) else \
                self.decomposer.solve_stack([(a, g) for a, g in pairs
                                             if a is not None and g is not None], damping)
        self._stacks[key] = solve
        return solve

    def states(self, local: bool, states: Mapping[FactorKey, FactorState] | None = None
               ) -> dict[FactorKey, FactorState]:
        """Return the factors this rank decomposes (owned, or local).

        Those it owns (``local=False``) or the local ones of its layers.

        Args:
            local: Which of the two.
            states: Take them from these (default: the store's running ones).

        Returns:
            Their states.
        """
        source = self.store.states if states is None else states
        return {key: s for key, s in source.items() if (key in self.local) == local}

    def compute(self, step: int, states: Mapping[FactorKey, FactorState] | None = None,
                previous: Mapping[FactorKey, Held] | None = None) -> Decomposed:
        """Decompose this rank's factors, owned then local ones (a background renewal).

        Not timed: it runs beside the steps (:class:`Lagged`).

        Args:
            step: The inverse step.
            states: The factors (default: the store's running ones).
            previous: The decompositions to refresh from (default: those held).

        Returns:
            The pieces to broadcast, the local ones, and the failures.
        """
        done = Decomposed()
        prior = self.held if previous is None else previous
        done.owned = self.decomposer.decompose(self.states(False, states), step, prior,
                                               done.failures)
        done.local = self.decomposer.decompose(self.states(True, states), step, prior,
                                               done.failures)
        return done

    @timed(Phase.KFAC_DECOMPOSITIONS)
    def update(self, step: int) -> None:
        """Decompose now, broadcast and install (the in-step renewal).

        Args:
            step: The current step.
        """
        failures: Failures = {}
        self.install(step, lambda: self.decompose(self.states(False), step, failures),
                     lambda: self.decompose(self.states(True), step, failures), failures)

    @timed(Phase.KFAC_DECOMPOSE)
    def decompose(self, states: Mapping[FactorKey, FactorState], step: int,
                  failures: Failures, previous: Mapping[FactorKey, Held] | None = None
                  ) -> dict[PieceKey, Piece]:
        """Decompose ``states`` in the step (timed; background renewals use :meth:`compute`).

        Args:
            states: The factors.
            step: The inverse step.
            failures: Where failed factors are recorded.
            previous: The decompositions to refresh from (default: those held).

        Returns:
            Their message pieces.
        """
        return self.decomposer.decompose(states, step,
                                         self.held if previous is None else previous, failures)

    @timed(Phase.KFAC_DECOMPOSITIONS)
    def install_job(self, step: int, job: BackgroundJob) -> None:
        """Wait for a background renewal and install it (broadcast and agreement here).

        Args:
            step: The current step.
            job: The renewal started earlier.
        """
        done = job.result()
        self.install(step, lambda: done.owned, lambda: done.local, done.failures)

    def install(self, step: int, produce: Callable[[], Mapping[PieceKey, Piece]],
                local: Callable[[], Mapping[PieceKey, Piece]], failures: Failures, *,
                restore: bool = False) -> None:
        """Broadcast decompositions, agree on failures and keep the valid ones.

        Broadcast ``produce()``'s pieces, add ``local()``'s, agree on ``failures`` and
        keep the valid decompositions of this rank's layers.

        Args:
            step: The current step (named in errors).
            produce: The pieces of the factors this rank owns (with ``restore``, its
                local ones too).
            local: The pieces of the local factors this rank decomposed itself.
            failures: This rank's failed decompositions (filled by ``produce``).
            restore: Broadcast by the restore layout (local factors included).
        """
        pieces = self.exchange.broadcast(produce, local, restore=restore)
        ranks = agree(self.comm, bool(failures))
        if ranks:
            raise decomposition_failure(step, ranks, failures) from (
                next(iter(failures.values())) if failures else None)
        self.held = self.exchange.keep(pieces)
        self.decomposed_at = step

    def restore_loaded(self, step: int, use: bool) -> None:
        """Restore the decompositions of a load, if any and ``use``; then forget them.

        Args:
            step: The current step.
            use: Whether this step uses them (not at an inverse step that decomposes
                anew in the step).
        """
        if self.restored is not None and use:
            self.restore(step)
        self.restored = None
        self._loaded = {}

    @timed(Phase.KFAC_DECOMPOSITIONS)
    def restore(self, step: int) -> None:
        """Install the loaded decompositions.

        Install the loaded decompositions (owners send them, local ones included);
        a factor without a fitting stored one is decomposed afresh.

        Args:
            step: The current step.
        """
        failures: Failures = {}

        def produce() -> dict[PieceKey, Piece]:
            out: dict[PieceKey, Piece] = {}
            loaded = self.restored or {}
            for key, state in self.store.owned().items():
                names = [PieceKey(key, part) for part, _ in self.decomposer.parts(state.dim)]
                if all(p in loaded for p in names):
                    out.update({p: loaded[p] for p in names})
                    out[PieceKey(key, Part.VALID)] = 1.0
                else:  # alone, from scratch (no refresh): as decomposed at the save
                    out.update(self.decompose({key: state}, step, failures, previous={}))
            return out

        self.install(step, produce, dict, failures, restore=True)

    def stored(self, keys: list[FactorKey]) -> dict[str, dict[str, Tensor]]:
        """The held decompositions of ``keys`` as ``state_dict()`` stores them.

        Between a load and the next step, those the load brought (restored at that step):
        a state saved then is the one loaded.

        Args:
            keys: The factors (those this rank owns).

        Returns:
            By factor name, the stored form.
        """
        if self._loaded:
            return {k.name: dict(self._loaded[k.name]) for k in keys if k.name in self._loaded}
        return {k.name: self.decomposer.stored(self.held[k]) for k in keys if k in self.held}

    def load(self, eigenbases: Mapping[str, Mapping[str, Tensor]],
             owned: Mapping[FactorKey, FactorState]) -> list[str]:
        """Take the stored decompositions that fit; restored at the next step.

        Args:
            eigenbases: ``state_dict()["eigenbases"]`` (may hold more factors).
            owned: The factors this rank owns.

        Returns:
            The owned factors whose stored decomposition does not fit (recomputed).
        """
        restored: dict[PieceKey, Tensor] = {}
        unfit = []
        loaded: dict[str, Mapping[str, Tensor]] = {}
        for key, state in owned.items():
            if eigenbases.get(key.name):
                pieces = self.decomposer.restorable(key, state.dim, eigenbases[key.name])
                if pieces is None:
                    unfit.append(key.name)
                else:
                    restored.update(pieces)
                    loaded[key.name] = eigenbases[key.name]
        self.decomposed_at = None  # restored or recomputed at the next step
        self.held = {}  # those of before the load are not this state's (solves go too)
        # restoring is a collective path: decided together (a rank that owns nothing
        # has no decompositions of its own to restore)
        self.restored = restored if self.comm.any(bool(restored)) else None
        self._loaded = loaded if self.restored is not None else {}
        return unfit

    def memory_bytes(self) -> int:
        """Bytes of the decompositions held."""
        return sum(t.numel() * t.element_size()
                   for parts in self.held.values() for t in parts.values())

    def solve_bytes(self) -> int:
        """Bytes the kept solves hold beyond the decompositions.

        Low rank: scaled bases and cores; stacks: their denominators (the held
        decompositions are views of the stacked bases).
        """
        return sum(solve.nbytes for _, solve in self._solves.values()) + sum(
            stack.nbytes for stack in self._stacks.values() if stack is not None)


class Renewal(Protocol):
    """When decompositions are renewed (chosen once from ``decomposition_lag``)."""

    def renew(self, decompositions: Decompositions, step: int) -> None:
        """Renew at an inverse step (or the first step): now, or start it."""
        ...

    def due(self, step: int, inverse: bool) -> bool:
        """Whether a renewal started earlier must be installed at this step."""
        ...

    def install(self, decompositions: Decompositions, step: int) -> None:
        """Install the renewal started earlier (broadcast and agreement happen here)."""
        ...

    def cancel(self) -> None:
        """Drop a renewal in progress (a checkpoint was loaded, or closing)."""
        ...

    lagged: bool  # whether renewals are installed steps after they start


class InStep:
    """Decompose in the inverse step itself (``decomposition_lag=0``)."""

    lagged = False

    def renew(self, decompositions: Decompositions, step: int) -> None:
        """Decompose, broadcast and install now."""
        decompositions.update(step)

    def due(self, step: int, inverse: bool) -> bool:
        """Never: nothing is pending."""
        return False

    def install(self, decompositions: Decompositions, step: int) -> None:
        """Nothing is pending."""

    def cancel(self) -> None:
        """Nothing is pending."""


class Lagged:
    """Renew decompositions in the background, installed ``lag`` steps later.

    Decompose a snapshot of the factors of step ``k`` in a
    :class:`~kfac_hpc.kfac.background.BackgroundJob`, installed at step ``k + L`` (or at the next
    inverse step, if sooner); the very first decompositions are computed in the step (there are none
    to use meanwhile).
    """

    lagged = True

    def __init__(self, lag: int, device: torch.device) -> None:
        """Renew ``lag`` steps after the start.

        Args:
            lag: The steps between start and installation.
            device: Where the factors live (on CUDA the job runs on a side stream).
        """
        self.lag, self.device = lag, device
        self.pending: BackgroundJob | None = None
        self._stream: torch.cuda.Stream | None = None

    def renew(self, decompositions: Decompositions, step: int) -> None:
        """Start the background job (or decompose now if none were ever installed)."""
        if decompositions.decomposed_at is None:
            decompositions.update(step)
            return
        snapshot = decompositions.store.snapshot()
        # the job's own view of the held decompositions it refreshes from: stacking them
        # for preconditioning (Decompositions.stacked_solve) replaces their parts in the
        # held dicts meanwhile, which would drop the job's tensors' last references on
        # the main stream while the side stream still reads them
        previous = {key: dict(held) for key, held in decompositions.held.items()}
        if self.device.type == "cuda" and self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        self.pending = BackgroundJob(
            lambda: decompositions.compute(step, snapshot, previous), self.device,
            swap_at=step + self.lag,
            stream=self._stream if self.device.type == "cuda" else None,
            inputs=[*(s.average for s in snapshot.values() if s.average is not None),
                    *(t for held in previous.values() for t in held.values())])

    def due(self, step: int, inverse: bool) -> bool:
        """A job is pending and its step (or an inverse step) has come."""
        return self.pending is not None and (step >= self.pending.swap_at or inverse)

    def install(self, decompositions: Decompositions, step: int) -> None:
        """Wait for the pending job and install its decompositions."""
        job, self.pending = self.pending, None
        if job is not None:
            decompositions.install_job(step, job)

    def cancel(self) -> None:
        """Wait for a pending job, if any, and drop its result."""
        if self.pending is not None:
            self.pending.cancel()
            self.pending = None


def make_renewal(lag: int, device: torch.device) -> Renewal:
    """The renewal of ``decomposition_lag`` (the one place that chooses it).

    Args:
        lag: ``decomposition_lag`` (0: in the step).
        device: Where the factors live.

    Returns:
        :class:`InStep` or :class:`Lagged`.
    """
    match lag:
        case 0:
            return InStep()
        case _:
            return Lagged(lag, device)
