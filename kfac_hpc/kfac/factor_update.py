"""The factor update: statistics from the hooks into the running averages.

A :class:`FactorUpdate` owns the hooks (:class:`~kfac_hpc.kfac.capture.StatisticsCapture`)
and turns what they captured into factor updates at factor steps: this rank's batch
factor sums go to their owners (:class:`~kfac_hpc.kfac.exchanges.FactorExchange`;
with ``overlap`` the :class:`~kfac_hpc.kfac.pipeline.FactorPipeline` posts buckets from
the hooks), every rank agrees that the statistics are finite
(:mod:`kfac_hpc.kfac.agree`), and the owners fold them into the
:class:`~kfac_hpc.kfac.factor_store.FactorStore`. How factors travel is a plug-in chosen
once from the strategy and ``factor_sync``:

* reduced at every factor step (the default);
* not reduced: DP-KFAC's owners use their own batch (and one rank without a pipeline
  has nothing to send);
* deferred (``factor_sync="inverse"``): folded into local averages at factor steps and
  synchronised at inverse steps (:meth:`FactorUpdate.synchronise`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

import torch
from torch import Tensor

from kfac_hpc.comm import Communicator
from kfac_hpc.kfac.agree import agree, post_agree, statistics_failure
from kfac_hpc.kfac.capture import LayerStatistics, StatisticsCapture
from kfac_hpc.kfac.exchange import Piece, PieceKey
from kfac_hpc.kfac.exchanges import FactorExchange
from kfac_hpc.kfac.factor_store import FactorStore
from kfac_hpc.kfac.layers import LayerCurvature
from kfac_hpc.kfac.layouts import LayerDims, factor_dim
from kfac_hpc.kfac.options import MatmulPrecision
from kfac_hpc.kfac.placement import FACTORS, FactorKey
from kfac_hpc.kfac.statistics_stream import statistics_stream
from kfac_hpc.phases import Phase, PhaseTimer, timed

__all__ = ["FactorUpdate", "nonfinite"]

log = logging.getLogger("kfac_hpc")


class FactorUpdate:
    """Statistics into factors (see the module docstring)."""

    def __init__(self, comm: Communicator, layers: dict[str, LayerCurvature],
                 store: FactorStore, exchange: FactorExchange, dims: LayerDims, *,
                 reduce: bool, deferred: bool, accumulation_steps: int,
                 grad_scaler: torch.amp.GradScaler | None, precision: MatmulPrecision,
                 active: Callable[[], bool], warn_unfired: bool,
                 own_layers_only: bool = False) -> None:
        """Build the hooks and the factor update.

        Args:
            comm: The world communicator.
            layers: The layers this rank's hooks capture.
            store: This rank's factors.
            exchange: The factor reduction (its pipeline, if any, is fed from the hooks).
            dims: Every layer's factor dimensions.
            reduce: Whether factor steps reduce factors (not under DP-KFAC, nor on one rank
                without a pipeline).
            deferred: ``factor_sync="inverse"``: fold locally, synchronise at inverse steps.
            accumulation_steps: Micro-batches per step.
            grad_scaler: The AMP scaler (non-finite statistics are then skipped, not raised).
            precision: The operand precision of the statistics GEMMs.
            active: Whether the current step captures statistics.
            warn_unfired: Whether this rank warns about hooks that never fired (rank 0,
                or every rank under DP-KFAC).
            own_layers_only: This rank's hooks capture the layers it owns only (DP-KFAC on
                several ranks): a step whose statistics are missing is an error only when
                they are missing on every rank (decided together; a rank whose layers did
                not run, e.g. ``nn.MultiheadAttention.out_proj``, goes on).
        """
        self.comm, self.store, self.exchange, self.dims = comm, store, exchange, dims
        self._warned_partial: set[FactorKey] = set()  # factor_sync="inverse" (synchronise)
        self.reduce, self.deferred = reduce, deferred
        self.accumulation_steps, self.grad_scaler = accumulation_steps, grad_scaler
        self.pipeline = exchange.pipeline
        self.warn_unfired = warn_unfired  # given once, at the first factor step
        #: factor updates applied in this process (agreed: every rank skips an overflow
        #: alike), or 1 after a load of a state with factors (see KFACPreconditioner)
        self.folds = 0
        self.own_layers_only = own_layers_only
        self.phase_timer: PhaseTimer | None = None  # times the factor phase
        self.capture = StatisticsCapture(
            layers, dtype_of=lambda _: store.dtype, precision=precision, active=active,
            grad_scale=self._grad_scale,
            on_ready=self._on_factor_ready if self.pipeline is not None else None,
            stream=statistics_stream(store.device, pipelined=self.pipeline is not None))

    @property
    def sends_factors(self) -> bool:
        """Whether factor steps send factors (reduced at every factor step)."""
        return self.reduce and not self.deferred

    def discard(self) -> None:
        """Drop the statistics captured since the last update (a step not applied)."""
        self.capture.clear()

    @timed(Phase.KFAC_FACTORS)
    def update(self, k: int, decay: float) -> None:
        """Fold step ``k``'s statistics into the factors (or the local averages).

        Args:
            k: The K-FAC step.
            decay: Its factor decay.
        """
        self.capture.join()  # computes what the capture still holds: the counts are read
        stats = self.capture.stats
        nothing = bool(stats) and not any(s.captured for s in stats.values())
        if self.own_layers_only:  # a rank whose layers did not run waits for the others'
            nothing = agree(self.comm, nothing) == self.comm.size
        if nothing:
            raise RuntimeError(
                "KFACPreconditioner.step(): no statistics were captured since the last step; "
                "run forward and backward in train mode (not under torch.no_grad()) before "
                "step(), once per step() call")
        if self.warn_unfired:
            self.warn_unfired = False
            self._warn_unfired()
        sums = self._captured_sums()
        if self.deferred:  # folded into local averages; reduced at inverse steps
            if self._usable(k, sums):
                self.store.fold_local({key: (total, stats[key.layer].counts[key.factor])
                                       for key, total in sums.items()}, decay)
                self.folds += 1
            self.capture.clear()
            return
        agreed: int | None = None  # ranks with non-finite statistics, if already agreed
        if not self.reduce:
            received = {key: self._local_sum(key) for key in self.store.states}
        else:
            if self.pipeline is not None:  # buckets first, as on ranks whose hooks sent all
                self.pipeline.post_remaining(self._wire_pieces)
            # the agreement on finiteness is posted before the factor reduction and
            # completes while it runs: one wait for three collectives
            agreement = post_agree(self.comm, bool(nonfinite(sums)))
            mine = self.exchange.reduce(self._wire_pieces)
            agreed = agreement()
            received = self.exchange.received(mine, self.store.states)
        if self._usable(k, sums, agreed):
            self.store.fold(received, decay)
            self.folds += 1
        self.capture.clear()

    def at_inverse_step(self) -> None:
        """Bring the owners' factors up to date before decomposing them.

        Only ``factor_sync="inverse"`` has anything to do: :meth:`synchronise`.
        """
        if self.deferred:
            self.synchronise()

    def flush(self) -> None:
        """Fold pending local averages into the owners' factors (before a save)."""
        if self.deferred and self.store.has_pending:
            self.synchronise()

    @timed(Phase.KFAC_FACTORS)
    def synchronise(self) -> None:
        """Synchronise the local averages onto the owners (``factor_sync="inverse"``).

        ``factor_sync="inverse"``: owners get ``c·F + mean_r D_r`` (one fused
        reduce-scatter of the local averages).
        """
        def pieces(key: FactorKey) -> dict[PieceKey, Piece]:
            delta, updated = self.store.delta(key, factor_dim(self.dims, key))
            return self.exchange.pieces(key, delta, 1.0 if updated else 0.0)

        mine = self.exchange.reduce(pieces)
        received = self.exchange.received(mine, self.store.states)
        partial = [key for key, (_, ranks) in received.items()
                   if 0 < ranks < self.comm.size and key not in self._warned_partial]
        if partial:  # the owner sees it: c·F + mean_r D_r assumes the same steps everywhere
            self._warned_partial.update(partial)
            log.warning("K-FAC factor_sync='inverse': %s got statistics on some ranks only "
                        "since the last synchronisation (a layer that is not used on every "
                        "rank); the deferred average then differs from the per-step one "
                        "(the factor's weight is this rank's), so use factor_sync='step' for "
                        "models whose layers run on some ranks only",
                        ", ".join(k.name for k in partial))
        self.store.fold_synchronised(received)

    def _usable(self, k: int, sums: Mapping[FactorKey, Tensor],
                ranks: int | None = None) -> bool:
        """Whether every rank's statistics of this step are finite (agreed on all ranks).

        ``ranks``: how many ranks reported non-finite statistics, when already agreed;
        else agreed here. Non-finite statistics with a GradScaler are an AMP overflow:
        every rank skips this factor update. Without one, every rank raises
        :class:`~kfac_hpc.kfac.errors.KFACNumericalError`.
        """
        bad = [key.name for key in nonfinite(sums)] if ranks is None or ranks else []
        if ranks is None:
            ranks = agree(self.comm, bool(bad))
        if ranks == 0:
            return True
        if self.grad_scaler is not None:
            if self.comm.rank == 0:
                log.warning("K-FAC skips the factor update of step %d: non-finite statistics "
                            "on %d rank(s) (AMP overflow)", k, ranks)
            return False
        self.discard()  # the step is not applied
        raise statistics_failure(k, ranks, bad)

    def _warn_unfired(self) -> None:
        """Warn naming registered layers whose hooks have not fired.

        Their forward is never called (e.g. ``nn.MultiheadAttention.out_proj``, whose
        weight the attention uses directly), so they are not preconditioned.
        """
        unfired = [s.name for s in self.capture.stats.values()
                   if s.counts["A"] == 0 or s.counts["G"] == 0]
        if unfired:
            log.warning(
                "K-FAC: %d registered layer(s) got no statistics in the first factor step "
                "(no forward, or no output gradient): %s. Either their forward is not "
                "called in training (e.g. a parent module uses the weight directly, as "
                "nn.MultiheadAttention does with out_proj) or their output does not reach "
                "the loss; they are not preconditioned until the first inverse update "
                "after both statistics came; list "
                "them in skip_layers to silence this",
                len(unfired), ", ".join(unfired))

    def _captured_sums(self) -> dict[FactorKey, Tensor]:
        """This rank's micro-batch factor sums of this step (layers its hooks saw)."""
        return {FactorKey(name, f): total for name, stats in self.capture.stats.items()
                for f in FACTORS if (total := stats.sums[f]) is not None}

    def _local_sum(self, key: FactorKey) -> tuple[Tensor, int]:
        """This rank's sum of micro-batch factors of ``key`` and how many were added."""
        stats = self.capture.stats.get(key.layer)
        total = None if stats is None else stats.sums[key.factor]
        if total is None:
            return self.store.zeros(factor_dim(self.dims, key)), 0
        assert stats is not None
        return total, stats.counts[key.factor]

    def _wire_pieces(self, key: FactorKey) -> dict[PieceKey, Piece]:
        """What this rank sends for factor ``key``: its (packed) sum and its count."""
        total, count = self._local_sum(key)
        return self.exchange.pieces(key, total, float(count))

    def _on_factor_ready(self, stats: LayerStatistics, factor: str) -> None:
        """Hook callback (``overlap``): a factor's last micro-batch posts its bucket."""
        assert self.pipeline is not None
        if stats.counts[factor] > self.accumulation_steps:  # alike on every rank
            raise RuntimeError(
                f"K-FAC overlap: layer {stats.name!r} ran {stats.counts[factor]} times in a "
                f"step of {self.accumulation_steps} micro-batch(es), and its statistics were "
                "sent after the first: a module called more than once per forward (shared "
                "or reused) needs overlap=False, or list it in skip_layers")
        if stats.counts[factor] == self.accumulation_steps:
            self.pipeline.mark_ready(FactorKey(stats.name, factor), self._wire_pieces)
        else:
            self.pipeline.progress()

    def _grad_scale(self) -> float | Tensor:
        """What the loss was multiplied by: ``loss scale / accumulation_steps``.

        The AMP scale stays a device tensor (reading it would sync the host in every
        hook).
        """
        scale = 1.0 / self.accumulation_steps
        scaler = self.grad_scaler
        if scaler is not None and scaler.is_enabled():
            on_device = getattr(scaler, "_get_scale_async", lambda: None)()
            return on_device * scale if isinstance(on_device, Tensor) \
                else float(scaler.get_scale()) * scale
        return scale


def nonfinite(tensors: Mapping[FactorKey, Tensor]) -> list[FactorKey]:
    """Keys of the tensors holding NaN or Inf (one host sync when all are finite).

    Screened by a statistic that is non-finite whenever an entry is (the sum on the CPU,
    one multi-tensor 2-norm on other devices; the CPU's inf-norm kernel is 20-50x slower
    than a sum); only a tensor whose statistic is not finite (a NaN/Inf entry, or an
    overflow of the statistic itself) is checked entry by entry.

    Args:
        tensors: Tensors by factor.

    Returns:
        The keys of those that hold NaN or Inf.
    """
    if not tensors:
        return []
    values = list(tensors.values())
    device = values[0].device
    if device.type == "cpu":
        screens = [t.sum() for t in values]
    else:
        screens = list(torch._foreach_norm(values, 2))
    finite = torch.stack([p.to(device) for p in screens]).isfinite().tolist()
    return [key for key, ok, t in zip(tensors, finite, values)
            if not ok and not bool(torch.isfinite(t).all())]
