"""The K-FAC preconditioner: ``step()`` replaces gradients by preconditioned gradients.

One step, as the algorithm reads (docs/design.md, "Data flow of one step"):

1. factor update  — batch factors from the hooks are summed onto their owners
                     (one fused reduce-scatter; DP-KFAC: owners use their own batch),
                     owners update the running averages;
2. inverse update — owners decompose their factors; decompositions are broadcast
                     inside the layer's gradient-worker group;
3. precondition   — gradient workers precondition their layers; the results are
                     broadcast inside receiver groups (fused per sender);
4. KL clipping    — every rank scales all preconditioned gradients by the same ν.

Device rule: every tensor K-FAC creates lives on ``self.device``, the device of the
registered layers (a CUDA model keeps all K-FAC state on its GPU); messages are packed
on it (:mod:`kfac_hpc.kfac.exchange`) and their scalars (counts, valid flags) are read
back in one transfer per phase. Faults are agreed: a rank that sees non-finite
statistics or a failed decomposition joins the step's collectives and then every rank
raises the same :class:`~kfac_hpc.kfac.errors.KFACNumericalError`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, cast

import torch
from torch import Tensor, nn

from kfac_hpc.comm import Communicator, pack_upper, replicas, triu_count, unpack_upper, world
from kfac_hpc.kfac import linalg
from kfac_hpc.kfac.background import BackgroundJob, Decomposed
from kfac_hpc.kfac.capture import LayerStatistics, StatisticsCapture
from kfac_hpc.kfac.errors import KFACNumericalError
from kfac_hpc.kfac.exchange import (
    MessageLayout,
    Part,
    Piece,
    PieceKey,
    broadcast_parts,
    own_copy,
    read_scalars,
    reduce_scatter_parts,
)
from kfac_hpc.kfac.factor_sync import LocalAverage
from kfac_hpc.kfac.hyperparams import (
    Scalar,
    non_negative,
    positive,
    unit_interval,
    whole_positive,
)
from kfac_hpc.kfac.layers import ApproxOption, LayerCurvature, register_layers
from kfac_hpc.kfac.lowrank import (
    LowRankFactor,
    precondition_lowrank,
    randomized_eigh,
    sketch_generator,
)
from kfac_hpc.kfac.options import (
    AUTO,
    COMPUTE_METHODS,
    DEFAULT_BUCKET_CAP_MB,
    DEFAULT_LOCAL_THRESHOLD,
    DEFAULT_LOW_RANK_MIN_DIM,
    FACTOR_SYNCS,
    STRATEGIES,
    ComputeMethod,
    EigenRefresh,
    FactorSync,
    KFACApprox,
    LowRankRemainder,
    PrecisionOption,
    Strategy,
    conflicts,
    default_factor_dtype,
    low_rank_cap,
    resolve_precision,
    sends_factors,
)
from kfac_hpc.kfac.pipeline import FactorPipeline
from kfac_hpc.kfac.placement import (
    FACTORS,
    FactorKey,
    LayerShape,
    Placement,
    decomposition_cost,
    grad_workers_for,
    place,
    work_per_step,
)
from kfac_hpc.kfac.shapes import rows_per_sample
from kfac_hpc.kfac.state import KFACStateDict
from kfac_hpc.phases import Phase, PhaseTimer, Traffic, timed

if TYPE_CHECKING:
    from kfac_hpc.plan.profile import Profile

log = logging.getLogger("kfac_hpc")


@dataclass
class FactorState:
    """A factor's running average (on its owner only) and its update count."""

    dim: int
    average: Tensor | None = None
    updates: int = 0


class KFACPreconditioner:
    """Distributed K-FAC over MPI for ``nn.Linear``, ``nn.Conv2d``, ``nn.Embedding`` layers.

    ``skip_layers``: module names or class names, each exact or a regular expression
    matching the whole name (``"blocks[.][0-9]+[.]mlp[.].*"``); see
    :func:`~kfac_hpc.kfac.layers.register_layers`. Other parameters (LayerNorm, bare
    ``nn.Parameter`` s) are not preconditioned (the rule in :mod:`kfac_hpc.kfac.layers`).

    Use between ``loss.backward()`` (gradients already averaged over ranks) and
    ``optimizer.step()``: ``step()`` replaces the ``.grad`` of every registered layer
    by its preconditioned gradient. Hyper-parameters accept a constant or a callable
    of the K-FAC step. See the README for the strategies.

    ``low_rank=K`` (``compute_method="eigen"``): factors with dimension ``d >=
    low_rank_min_dim`` and ``d > K`` keep their ``K`` leading eigenpairs from a
    randomized decomposition plus one remainder eigenvalue for the rest
    (:mod:`kfac_hpc.kfac.lowrank`; ``low_rank_remainder="mean"`` keeps the trace,
    ``"zero"`` leaves the rest to the damping); ``low_rank_energy=E`` keeps the fewest
    pairs holding ``E`` of the trace, at most ``K``. Smaller factors keep the full
    eigendecomposition; a layer with a low-rank factor is preconditioned exactly for
    the approximated factors (:func:`~kfac_hpc.kfac.lowrank.precondition_lowrank`).
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        comm: Communicator | None = None,
        strategy: Strategy | Literal["auto"] = "comm-opt",
        grad_worker_fraction: float | None = None,
        compute_method: ComputeMethod = "eigen",
        damping: Scalar = 0.001,
        factor_decay: Scalar = 0.95,
        kl_clip: Scalar | None = 0.001,
        lr: Scalar = 0.1,
        factor_update_steps: Scalar = 1,
        inv_update_steps: Scalar = 1,
        skip_layers: Iterable[str] = (),
        factor_dtype: torch.dtype | None = None,
        inv_dtype: torch.dtype = torch.float32,
        accumulation_steps: int = 1,
        grad_scaler: torch.amp.GradScaler | None = None,
        symmetric_packing: bool = False,
        overlap: bool = False,
        bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB,
        factor_sync: FactorSync = "step",
        local_decomposition_threshold: int = DEFAULT_LOCAL_THRESHOLD,
        check_replicas: bool = True,
        plan_profile: Profile | str | os.PathLike[str] | None = None,
        input_shape: Iterable[int] | None = None,
        kfac_approx: KFACApprox | Mapping[str, KFACApprox] = "expand",
        low_rank: int | None = None,
        low_rank_energy: float | None = None,
        low_rank_min_dim: int = DEFAULT_LOW_RANK_MIN_DIM,
        low_rank_remainder: LowRankRemainder = "mean",
        decomposition_lag: int = 0,
        eigen_refresh: EigenRefresh = "eigh",
        stats_precision: PrecisionOption = "auto",
        precondition_precision: PrecisionOption = "auto",
    ) -> None:
        batch_shape = _batch_shape(input_shape)
        if strategy == AUTO:
            if grad_worker_fraction is not None:
                raise ValueError("strategy='auto' chooses grad_worker_fraction itself; "
                                 "give a concrete strategy to set it")
            strategy, grad_worker_fraction = _resolve_auto(
                model, comm if comm is not None else world(), plan_profile,
                skip_layers=skip_layers, compute_method=compute_method,
                symmetric_packing=symmetric_packing, overlap=overlap,
                bucket_cap_mb=bucket_cap_mb, factor_sync=factor_sync,
                local_decomposition_threshold=local_decomposition_threshold,
                factor_update_steps=factor_update_steps, inv_update_steps=inv_update_steps,
                factor_dtype=factor_dtype, inv_dtype=inv_dtype, input_shape=batch_shape,
                kfac_approx=kfac_approx if isinstance(kfac_approx, str) else "expand",
                low_rank=low_rank, low_rank_energy=low_rank_energy,
                low_rank_min_dim=low_rank_min_dim, low_rank_remainder=low_rank_remainder)
        elif plan_profile is not None:
            raise ValueError("plan_profile applies to strategy='auto' only")
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {(*STRATEGIES, AUTO)}, got {strategy!r}")
        if compute_method not in COMPUTE_METHODS:
            raise ValueError(f"compute_method must be one of {COMPUTE_METHODS}, "
                             f"got {compute_method!r}")
        if not isinstance(accumulation_steps, int) or accumulation_steps < 1:
            raise ValueError(f"accumulation_steps must be an integer >= 1, "
                             f"got {accumulation_steps!r}")
        if factor_sync not in FACTOR_SYNCS:
            raise ValueError(f"factor_sync must be one of {FACTOR_SYNCS}, got {factor_sync!r}")
        problems = conflicts(strategy=strategy, grad_worker_fraction=grad_worker_fraction,
                             overlap=overlap, symmetric_packing=symmetric_packing,
                             factor_sync=factor_sync, compute_method=compute_method,
                             low_rank=low_rank, low_rank_energy=low_rank_energy,
                             low_rank_min_dim=low_rank_min_dim,
                             low_rank_remainder=low_rank_remainder,
                             stats_precision=stats_precision,
                             precondition_precision=precondition_precision,
                             factor_dtype=_dtype_name(factor_dtype),
                             inv_dtype=_dtype_name(inv_dtype) or "float32",
                             eigen_refresh=eigen_refresh,
                             decomposition_lag=decomposition_lag)
        if problems:
            raise ValueError(f"{problems[0].option} {problems[0].text()}")
        _check_rank_fits(low_rank, low_rank_energy, inv_dtype)
        if not bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb must be > 0, got {bucket_cap_mb!r}")
        if isinstance(skip_layers, str):
            skip_layers = (skip_layers,)
        self.comm = comm if comm is not None else world()
        self.strategy: Strategy = cast(Strategy, strategy)
        self.compute_method = compute_method
        self.damping = positive("damping", damping)
        self.factor_decay = unit_interval("factor_decay", factor_decay)
        self.kl_clip = None if kl_clip is None else positive("kl_clip", kl_clip)
        self.lr = non_negative("lr", lr)
        self.factor_update_steps = whole_positive("factor_update_steps", factor_update_steps)
        self.inv_update_steps = whole_positive("inv_update_steps", inv_update_steps)
        self.inv_dtype = inv_dtype
        self.accumulation_steps = accumulation_steps
        self.grad_scaler = grad_scaler
        self.symmetric_packing = symmetric_packing
        self.overlap = overlap
        self.bucket_cap_mb = bucket_cap_mb
        self.factor_sync = factor_sync
        self.low_rank = low_rank
        self.low_rank_energy = low_rank_energy
        self.low_rank_min_dim = low_rank_min_dim
        self.low_rank_remainder: LowRankRemainder = low_rank_remainder
        self.steps = 0
        self._closed = False
        self._checked_hooks = False  # the never-fired warning is given once
        #: times the phases its methods declare (kfac_hpc.phases), when given one
        self.phase_timer: PhaseTimer | None = None

        model = getattr(model, "module", model) if _is_wrapper(model) else model
        self.kfac_approx = kfac_approx if isinstance(kfac_approx, str) else dict(kfac_approx)
        self.layers = _register_layers(model, tuple(skip_layers), self.comm.rank,
                                       self.kfac_approx)
        if not self.layers:
            raise ValueError("the model has no layer K-FAC can precondition "
                             "(nn.Linear / nn.Conv2d / nn.Embedding with trainable weights)")
        self.device = _layers_device(self.layers)
        self.factor_dtype = factor_dtype or _default_factor_dtype(self.layers)
        self.stats_precision = resolve_precision(
            stats_precision, device_type=self.device.type,
            dtype=_dtype_name(self.factor_dtype) or "")
        self.precondition_precision = resolve_precision(
            precondition_precision, device_type=self.device.type,
            dtype=_dtype_name(inv_dtype) or "", auto="full")
        self.input_shape = batch_shape
        # what shapes the messages must agree before any of them: the layers K-FAC
        # registered (skip_layers, frozen weights), their dimensions, and the options that
        # decide placement and buckets (the placement depends on input_shape too)
        layout = {
            "input_shape": batch_shape,
            "kfac layers": tuple((n, c.a_dim, c.g_dim) for n, c in self.layers.items()),
            "strategy": strategy, "grad_worker_fraction": grad_worker_fraction,
            "factor_dtype": str(self.factor_dtype), "overlap": overlap,
            "bucket_cap_mb": bucket_cap_mb, "factor_sync": factor_sync,
            "symmetric_packing": symmetric_packing,
            "local_decomposition_threshold": local_decomposition_threshold,
            "compute_method": compute_method, "low_rank": low_rank,
            "low_rank_min_dim": low_rank_min_dim}
        if check_replicas:
            replicas.check_replicas(model.named_parameters(), self.comm, settings=layout)
        else:  # no replica check: still agree on the message layout (one 16-byte allreduce)
            self.comm.agree(sorted(layout.items()), "K-FAC's layers and message options",
                            hint="register the same layers (skip_layers, requires_grad) and "
                                 "pass the same options on every rank")

        grad_workers = grad_workers_for(strategy, self.comm.size, grad_worker_fraction)
        self._decomposition_cost = decomposition_cost(low_rank, low_rank_min_dim)
        self.placement: Placement = place(
            self._layer_shapes(model), self.comm.size, grad_workers,
            cost=self._decomposition_cost, local_threshold=local_decomposition_threshold,
            layer_cost=self._owner_work if strategy == "dp-kfac" and batch_shape else None)
        self.local_decomposition_threshold = local_decomposition_threshold
        self.worker_comm, self.receiver_comm = self._group_communicators()

        rank = self.comm.rank
        # owned factors, plus replicas of the local (small) factors of this rank's layers
        self._factors: dict[FactorKey, FactorState] = {
            key: FactorState(self._dim(key)) for key in self._keys()
            if self._owner(key) == rank or (
                self._is_local(key) and self.placement.is_grad_worker(key.layer, rank))}
        self._decompositions: dict[FactorKey, dict[str, Tensor]] = {}
        self._decomposed_at: int | None = None
        self.decomposition_lag = decomposition_lag
        self.eigen_refresh: EigenRefresh = eigen_refresh
        self._pending: BackgroundJob | None = None  # decompositions being computed
        self._side_stream: torch.cuda.Stream | None = None
        self._restored: dict[PieceKey, Tensor] | None = None  # loaded decompositions (owned)
        captured = {n: c for n, c in self.layers.items()
                    if sends_factors(strategy)
                    or self.placement.factor_owner[FactorKey(n, "A")] == rank}
        deferred = factor_sync == "inverse"
        self.local_averages: dict[FactorKey, LocalAverage] = {
            FactorKey(n, f): LocalAverage() for n in captured for f in FACTORS} if deferred else {}
        self._has_history: set[FactorKey] = set()
        keys = [k for k in self._keys() if not self._is_local(k)]
        self.pipeline = FactorPipeline(
            self.comm, [k for k in self._readiness_order() if not self._is_local(k)],
            {k: self._owner(k) for k in keys},
            {k: self._wire_numel(k) for k in keys},
            cap_bytes=int(bucket_cap_mb * 2**20), dtype=self.factor_dtype,
            device=self.device) if overlap else None
        self.capture = StatisticsCapture(
            captured, dtype_of=lambda _: self.factor_dtype, precision=self.stats_precision,
            active=self._capturing,
            grad_scale=self._grad_scale, on_ready=self._on_factor_ready if overlap else None)

    def _layer_shapes(self, model: nn.Module) -> list[LayerShape]:
        """Factor dimensions, and statistics rows per update when ``input_shape`` is known
        (DP-KFAC balances them: each owner computes its layers' statistics)."""
        rows: dict[int, int] = {}
        if self.input_shape is not None and self.strategy == "dp-kfac":
            batch, *sample = self.input_shape
            rows = {key: batch * r for key, r in rows_per_sample(
                model, [c.module for c in self.layers.values()], sample).items()}
        return [LayerShape(n, c.a_dim, c.g_dim, rows.get(id(c.module), 0))
                for n, c in self.layers.items()]

    def _owner_work(self, layer: LayerShape) -> float:
        return work_per_step(layer, compute_method=self.compute_method,
                             factor_update_steps=max(1, int(self.factor_update_steps(0))),
                             inv_update_steps=max(1, int(self.inv_update_steps(0))),
                             cost=self._decomposition_cost)

    # ------------------------------------------------------------------ the step
    @torch.no_grad()
    def step(self) -> None:
        """Precondition the gradients of every registered layer (call after backward)."""
        k = self.steps
        if self._closed:
            raise RuntimeError("KFACPreconditioner.step() after close(); build a new one")
        self._check_device()
        if self._is_factor_step(k):
            self._update_factors(k)
        inverse, lagged = self._is_inverse_step(k), self.decomposition_lag > 0
        if self._pending is not None and (k >= self._pending.swap_at or inverse):
            self._install_background_decompositions()
        if self._restored is not None and (not inverse or lagged):
            # after a load, the stored (stale) decompositions are what an uninterrupted
            # run uses now: restore them instead of recomputing (with a lag, until the
            # background update started at this inverse step is installed)
            self._update_decompositions(restore=True)
        self._restored = None
        if inverse or self._decomposed_at is None:
            if self.factor_sync == "inverse":
                self._synchronise_local_averages()
            if lagged and self._decomposed_at is not None:
                self._start_background_decompositions(k)
            else:
                self._update_decompositions()
        updates = self._precondition_my_layers(k)
        updates = self._share_preconditioned(updates)
        lr, kl_clip = self.lr(k), None if self.kl_clip is None else self.kl_clip(k)
        inner: Tensor | None = None  # Σ ⟨V, ∇W̄⟩ in float64, read from .grad directly
        if kl_clip is not None:
            for name, v in updates.items():
                term = self.layers[name].grad_dot(v)
                if term is not None:
                    inner = term if inner is None else inner + term
        nu = linalg.kl_clip_from_inner(inner, lr, kl_clip)
        for name, v in updates.items():
            self.layers[name].set_grad(v.mul_(nu) if nu != 1.0 else v)
        self.steps += 1

    # ------------------------------------------------------------ factor update
    @timed(Phase.KFAC_FACTORS)
    def _update_factors(self, k: int) -> None:
        stats = self.capture.stats
        if stats and not any(s.captured for s in stats.values()):
            raise RuntimeError(
                "KFACPreconditioner.step(): no statistics were captured since the last step; "
                "run forward and backward in train mode (not under torch.no_grad()) before "
                "step(), once per step() call")
        if not self._checked_hooks:
            self._checked_hooks = True
            self._warn_unfired()
        decay = self.factor_decay(k)
        local_sums = self._captured_sums()
        if self.factor_sync == "inverse":  # fold into local averages; reduced at inverse steps
            if self._statistics_usable(k, local_sums):
                for key, total in local_sums.items():
                    local = self.local_averages[key]
                    first = key not in self._has_history and local.updates == 0
                    local.fold(_mean(total, self._captured_count(key)), decay, first)
            self.capture.clear()
            return
        agreed: int | None = None  # ranks with non-finite statistics, if already agreed
        if not sends_factors(self.strategy) or (self.comm.size == 1 and self.pipeline is None):
            # DP-KFAC: owners use their own batch. One rank: the reduction would only copy
            # the sums into a message and back (counted bytes are 0 at one rank either way)
            received = {key: self._local_sum(key) for key in self._factors}
        else:
            # The agreement on finiteness and the local factors' allreduce are posted
            # before the factors' reduce-scatter and complete while it runs: one wait for
            # three collectives (the same calls and bytes as one after the other)
            agreement = self._post_ranks_reporting(bool(_nonfinite(local_sums)))
            with self.comm.stats.tagged(Traffic.FACTORS):
                local_factors = self._post_local_factors(
                    _merge(map(self._wire_pieces, self._local_keys())))
                if self.pipeline is not None:
                    mine = self.pipeline.finish(self._wire_pieces)
                else:
                    mine = reduce_scatter_parts(self.comm, self._factor_layout(),
                                                _merge(map(self._wire_pieces, self._keys())),
                                                self.factor_dtype, self.device)
                mine.update(local_factors())
            agreed = agreement()
            counts = read_scalars(mine, [PieceKey(key, Part.COUNT) for key in self._factors])
            received = {key: (self._from_wire(key, mine[PieceKey(key, Part.FACTOR)]), round(count))
                        for key, count in zip(self._factors, counts)}
        if self._statistics_usable(k, local_sums, agreed):
            self._fold_into_averages(received, decay)
        self.capture.clear()

    def _fold_into_averages(self, received: Mapping[FactorKey, tuple[Tensor, int]],
                            decay: float) -> None:
        """Running averages ``F ← decay·F + (1-decay)·mean`` of every factor with
        statistics this step (two multi-tensor kernels for all); a first update copies."""
        currents: list[Tensor] = []
        batches: list[Tensor] = []
        for key, (total, count) in received.items():
            if count == 0:
                continue  # the layer was not used on any rank this step
            state = self._factors[key]
            if state.average is None:
                state.average = linalg.update_running_average(None, _mean(total, count), decay)
            else:
                currents.append(state.average)
                batches.append(_mean(total, count))
            state.updates += 1
        linalg.update_running_averages(currents, batches, decay)

    def _warn_unfired(self) -> None:
        """Warn (once, at the first factor step) naming registered layers whose hooks have
        not fired: their forward is never called (e.g. ``nn.MultiheadAttention.out_proj``,
        whose weight the attention uses directly), so they are not preconditioned.

        Rank 0 warns for every layer; under DP-KFAC (each rank captures only the layers
        it owns) every rank warns for its own layers."""
        if self.comm.rank != 0 and sends_factors(self.strategy):
            return
        unfired = [s.name for s in self.capture.stats.values()
                   if s.counts["A"] == 0 or s.counts["G"] == 0]
        if unfired:
            log.warning(
                "K-FAC: the hooks of %d registered layer(s) never fired in the first factor "
                "step: %s. Their forward is not called in training (e.g. a parent module "
                "uses the weight directly, as nn.MultiheadAttention does with out_proj), so "
                "they are not preconditioned; list them in skip_layers to silence this",
                len(unfired), ", ".join(unfired))

    def _statistics_usable(self, k: int, sums: Mapping[FactorKey, Tensor],
                           ranks: int | None = None) -> bool:
        """Whether every rank's statistics of this step are finite (agreed on all ranks).

        ``ranks``: how many ranks reported non-finite statistics, when already agreed
        (:meth:`_post_ranks_reporting`); else agreed here. Non-finite statistics with a
        GradScaler are an AMP overflow: every rank skips this factor update. Without
        one, every rank raises :class:`KFACNumericalError`.
        """
        bad = [key.name for key in _nonfinite(sums)] if ranks is None or ranks else []
        if ranks is None:
            ranks = self._ranks_reporting(bool(bad))
        if ranks == 0:
            return True
        if self.grad_scaler is not None:
            if self.comm.rank == 0:
                log.warning("K-FAC skips the factor update of step %d: non-finite statistics "
                            "on %d rank(s) (AMP overflow)", k, ranks)
            return False
        here = f"; on this rank: {', '.join(bad)}" if bad else ""
        self.capture.clear()  # the step is not applied: its statistics are dropped
        raise KFACNumericalError(
            f"K-FAC step {k}: non-finite (NaN/Inf) factor statistics on {ranks} rank(s){here}. "
            "The inputs or gradients of these layers overflowed or hold NaN; factors were not "
            "updated. Lower the learning rate, check the data, or use a GradScaler under "
            "AMP; restore the last checkpoint to continue.", step=k, ranks=ranks, local=bad)

    def _post_ranks_reporting(self, flag: bool) -> Callable[[], int]:
        """:meth:`_ranks_reporting` posted now (non-blocking); call the result for it."""
        if self.comm.size == 1:
            return lambda: int(flag)
        count = torch.tensor([int(flag)], dtype=torch.int32, device="cpu")
        with self.comm.stats.tagged(Traffic.AGREEMENT):
            handle = self.comm.iallreduce(count, "sum")
        return lambda: int(handle.wait()[0])

    def _post_local_factors(self, values: Mapping[PieceKey, Piece]
                            ) -> Callable[[], dict[PieceKey, Tensor]]:
        """Local (small) factors: one fused allreduce, posted now (non-blocking); every
        gradient worker keeps the sum. Call the result for the summed pieces."""
        keys = self._local_keys()
        if not keys:
            return dict
        layout = MessageLayout.of([[p for k in keys for p in self._factor_pieces(k)]])
        flat = layout.pack(values, dtype=self.factor_dtype, device=self.device)
        handle = self.comm.iallreduce(flat, "sum")
        return lambda: layout.unpack(handle.wait(), 0)

    def _ranks_reporting(self, flag: bool) -> int:
        """How many ranks pass a true ``flag`` (a host-side allreduce of one integer)."""
        return self._post_ranks_reporting(flag)()

    @timed(Phase.KFAC_FACTORS)
    def _synchronise_local_averages(self) -> None:
        """factor_sync='inverse': owners get ``c·F + mean_r D_r`` (one fused reduce-scatter)."""
        values: dict[PieceKey, Piece] = {}
        for key in self._keys():
            local = self.local_averages[key]
            n = self._dim(key)
            delta = local.delta if local.delta is not None else torch.zeros(
                n, n, dtype=self.factor_dtype, device=self.device)
            values[PieceKey(key, Part.FACTOR)] = pack_upper(delta) if self.symmetric_packing \
                else delta
            values[PieceKey(key, Part.COUNT)] = 1.0 if local.updates else 0.0
        with self.comm.stats.tagged(Traffic.FACTORS):
            mine = reduce_scatter_parts(self.comm, self._factor_layout(), values,
                                        self.factor_dtype, self.device)
            mine.update(self._post_local_factors(values)())
        counts = read_scalars(mine, [PieceKey(key, Part.COUNT) for key in self._factors])
        for (key, state), count in zip(self._factors.items(), counts):
            local = self.local_averages[key]
            ranks = round(count)
            if ranks == 0:
                continue
            mean_delta = self._from_wire(key, mine[PieceKey(key, Part.FACTOR)]) / ranks
            if state.average is None or local.coefficient == 0.0:
                state.average = mean_delta.clone()
            else:
                state.average.mul_(local.coefficient).add_(mean_delta)
            state.updates += local.updates
        for key, local in self.local_averages.items():
            if local.updates:
                self._has_history.add(key)
            local.reset()

    def _captured_sums(self) -> dict[FactorKey, Tensor]:
        """This rank's micro-batch factor sums of this step (layers its hooks saw)."""
        return {FactorKey(name, f): total for name, stats in self.capture.stats.items()
                for f in FACTORS if (total := stats.sums[f]) is not None}

    def _captured_count(self, key: FactorKey) -> int:
        return self.capture.stats[key.layer].counts[key.factor]

    def _local_sum(self, key: FactorKey) -> tuple[Tensor, int]:
        """This rank's sum of micro-batch factors of ``key`` and how many were added."""
        stats = self.capture.stats.get(key.layer)
        total = None if stats is None else stats.sums[key.factor]
        if total is None:
            n = self._dim(key)
            return torch.zeros(n, n, dtype=self.factor_dtype, device=self.device), 0
        assert stats is not None
        return total, stats.counts[key.factor]

    def _wire_numel(self, key: FactorKey) -> int:
        n = self._dim(key)
        return triu_count(n) if self.symmetric_packing else n * n

    def _factor_pieces(self, key: FactorKey) -> list[tuple[PieceKey, int]]:
        """A factor in a factor message: its (packed) matrix and its count."""
        return [(PieceKey(key, Part.FACTOR), self._wire_numel(key)), (PieceKey(key, Part.COUNT), 1)]

    def _wire_pieces(self, key: FactorKey) -> dict[PieceKey, Piece]:
        """What a rank sends for factor ``key``: its (packed) sum and its count."""
        total, count = self._local_sum(key)
        return {PieceKey(key, Part.FACTOR): pack_upper(total) if self.symmetric_packing else total,
                PieceKey(key, Part.COUNT): float(count)}

    def _from_wire(self, key: FactorKey, flat: Tensor) -> Tensor:
        n = self._dim(key)
        return unpack_upper(flat, n) if self.symmetric_packing else flat.view(n, n)

    def _factor_layout(self) -> MessageLayout:
        parts: list[list[tuple[PieceKey, int]]] = [[] for _ in range(self.comm.size)]
        for key in self._keys():
            if not self._is_local(key):
                parts[self._owner(key)] += self._factor_pieces(key)
        return MessageLayout.of(parts)

    def _is_local(self, key: FactorKey) -> bool:
        return key in self.placement.local_factors

    def _local_keys(self) -> list[FactorKey]:
        return [k for k in self._keys() if self._is_local(k)]

    def _readiness_order(self) -> list[FactorKey]:
        """Factor keys in the order the hooks complete them: A forward, then G backward."""
        names = list(self.layers)
        return [FactorKey(n, "A") for n in names] + [FactorKey(n, "G") for n in names[::-1]]

    def _on_factor_ready(self, stats: LayerStatistics, factor: str) -> None:
        assert self.pipeline is not None
        if stats.counts[factor] == self.accumulation_steps:
            self.pipeline.mark_ready(FactorKey(stats.name, factor), self._wire_pieces)
        else:
            self.pipeline.progress()

    # ----------------------------------------------------------- decompositions
    @timed(Phase.KFAC_DECOMPOSITIONS)
    def _update_decompositions(self, restore: bool = False) -> None:
        """Owners decompose their factors and broadcast them in the worker group; local
        factors are decomposed by every worker. ``restore``: owners send the loaded
        decompositions instead, local ones included."""
        failures: dict[FactorKey, BaseException] = {}
        if restore:
            self._install_decompositions(lambda: self._restored_pieces(failures), dict,
                                         failures, restore=True)
            return
        step = self.steps
        self._install_decompositions(
            lambda: self._decompose_all(self._factor_states(local=False), step, failures),
            lambda: self._decompose_all(self._factor_states(local=True), step, failures),
            failures)

    def _factor_states(self, local: bool, states: Mapping[FactorKey, FactorState] | None = None
                       ) -> dict[FactorKey, FactorState]:
        """The factors this rank decomposes (of ``states``, default its running ones):
        those it owns (``local=False``) or the local (small) ones of its layers."""
        source = self._factors if states is None else states
        return {key: state for key, state in source.items() if self._is_local(key) == local}

    def _decompose_safely(self, key: FactorKey, state: FactorState, step: int,
                          failures: dict[FactorKey, BaseException],
                          eigen: tuple[Tensor, Tensor] | Exception | None = None,
                          ) -> dict[PieceKey, Piece]:
        """:meth:`_decompose`, a failure recorded in ``failures`` and sent as invalid: it
        must not leave the other ranks waiting in the broadcast; every rank raises after
        the agreement (:meth:`_agree_on_decompositions`)."""
        try:
            if isinstance(eigen, Exception):
                raise eigen
            return self._decompose(key, state, step, eigen)
        except Exception as exc:
            failures[key] = exc
            return self._decompose(key, FactorState(state.dim), step)

    def _decompose_all(self, states: Mapping[FactorKey, FactorState], step: int,
                       failures: dict[FactorKey, BaseException]) -> dict[PieceKey, Piece]:
        """Every factor of ``states`` decomposed as message pieces (eigh batched by size)."""
        eigen = self._eigendecompositions(states)
        out: dict[PieceKey, Piece] = {}
        for key, state in states.items():
            out.update(self._decompose_safely(key, state, step, failures, eigen.get(key)))
        return out

    def _restored_pieces(self, failures: dict[FactorKey, BaseException]
                         ) -> dict[PieceKey, Piece]:
        """The loaded decompositions of the factors this rank owns (recomputed where the
        checkpoint had none that fit)."""
        out: dict[PieceKey, Piece] = {}
        for key, state in self._owned_states().items():
            names = [PieceKey(key, part) for part in self._decomposition_parts(key)]
            loaded = self._restored or {}
            if all(p in loaded for p in names):
                out.update({p: loaded[p] for p in names})
                out[PieceKey(key, Part.VALID)] = 1.0
            else:
                out.update(self._decompose_safely(key, state, self.steps, failures))
        return out

    def _start_background_decompositions(self, k: int) -> None:
        """``decomposition_lag > 0``: decompose a snapshot of the factors of step ``k`` in
        a :class:`~kfac_hpc.kfac.background.BackgroundJob`, installed at step ``k + lag``
        (:meth:`_install_background_decompositions`)."""
        snapshot = {key: FactorState(state.dim, None if state.average is None
                                     else state.average.clone(), state.updates)
                    for key, state in self._factors.items()}

        def compute() -> Decomposed:
            done = Decomposed()
            done.owned = self._decompose_all(self._factor_states(False, snapshot), k,
                                             done.failures)
            done.local = self._decompose_all(self._factor_states(True, snapshot), k,
                                             done.failures)
            return done

        if self.device.type == "cuda" and self._side_stream is None:
            self._side_stream = torch.cuda.Stream(self.device)
        self._pending = BackgroundJob(
            compute, self.device, swap_at=k + self.decomposition_lag,
            stream=self._side_stream if self.device.type == "cuda" else None,
            inputs=[s.average for s in snapshot.values() if s.average is not None])

    @timed(Phase.KFAC_DECOMPOSITIONS)
    def _install_background_decompositions(self) -> None:
        """Wait for the pending background job and install its decompositions (the
        broadcast in the worker group and the failure agreement happen here)."""
        job, self._pending = self._pending, None
        assert job is not None
        done = job.result()
        self._install_decompositions(lambda: done.owned, lambda: done.local, done.failures)

    def _cancel_background_decompositions(self) -> None:
        """Wait for a pending background job, if any, and drop its result."""
        if self._pending is not None:
            self._pending.cancel()
            self._pending = None

    def _install_decompositions(self, produce: Callable[[], Mapping[PieceKey, Piece]],
                                local: Callable[[], Mapping[PieceKey, Piece]],
                                failures: Mapping[FactorKey, BaseException],
                                restore: bool = False) -> None:
        """Broadcast the pieces ``produce()`` gives (the factors this rank owns; with
        ``restore`` the local ones too) in the worker group, add ``local()``'s, agree on
        ``failures`` and keep the valid decompositions of this rank's layers."""
        group, g = self.placement.worker_group_of_rank(self.comm.rank), self.placement.grad_workers
        my_layers = [n for n in self.layers if self.placement.layer_group[n] == group]
        keys = [FactorKey(layer, f) for layer in my_layers for f in FACTORS]
        parts: list[list[tuple[PieceKey, int]]] = [[] for _ in range(g)]
        for key in keys:
            if restore or not self._is_local(key):
                parts[self._owner(key) - group * g] += self._decomposition_pieces(key)

        with self.comm.stats.tagged(Traffic.DECOMPOSITIONS):
            pieces = broadcast_parts(self.worker_comm, MessageLayout.of(parts), produce,
                                     self.inv_dtype, self.device)
        all_pieces: dict[PieceKey, Piece] = {**pieces, **local()}
        self._agree_on_decompositions(failures)
        low = [key for key in keys if self._is_low_rank(key)]
        # valid flags and the ranks the energy rule chose: one device-to-host transfer
        # (without it every low-rank factor keeps its cap, known in advance)
        chosen = low if self.low_rank_energy is not None else []
        scalars = read_scalars(all_pieces, [PieceKey(key, Part.VALID) for key in keys]
                               + [PieceKey(key, Part.RANK) for key in chosen])
        ranks = {key: cast(int, self._cap(key)) for key in low}
        ranks.update({key: round(k) for key, k in zip(chosen, scalars[len(keys):])})
        self._decompositions = {}
        received = cast(dict[PieceKey, Tensor], all_pieces)
        for key, ok in zip(keys, scalars[:len(keys)]):
            if not ok:
                continue
            n = self._dim(key)
            if key in ranks:
                self._decompositions[key] = self._low_rank_parts(key, received, ranks[key])
                continue
            # matrices (Q, inv) as n x n, eigenvalues flat; named by Part.value in state_dict();
            # each in its own row-major copy: laid out alike computed, received or restored
            self._decompositions[key] = {
                part.value: own_copy(received[PieceKey(key, part)].view(
                    (n,) if part is Part.LAMBDA else (n, n)))
                for part in self._decomposition_parts(key)}
        self._decomposed_at = self.steps

    def _low_rank_parts(self, key: FactorKey, received: Mapping[PieceKey, Tensor],
                        k: int) -> dict[str, Tensor]:
        """A received low-rank decomposition cut to its rank ``k``: ``Q`` (``d x k``,
        column-major: the transpose of a copy of the message's first ``k`` rows),
        ``lambda`` (``k``), ``rho`` (``1``), each in its own allocation (own_copy)."""
        n, cap = self._dim(key), self._cap(key)
        assert cap is not None
        return {Part.Q.value: own_copy(received[PieceKey(key, Part.Q)].view(cap, n)[:k]).t(),
                Part.LAMBDA.value: own_copy(received[PieceKey(key, Part.LAMBDA)][:k]),
                Part.RHO.value: own_copy(received[PieceKey(key, Part.RHO)])}

    def _agree_on_decompositions(self, failures: Mapping[FactorKey, BaseException]) -> None:
        """Every rank raises when a decomposition failed on any rank (the old ones stay)."""
        ranks = self._ranks_reporting(bool(failures))
        if ranks == 0:
            return
        k = self.steps
        message = (f"K-FAC step {k}: the decomposition of {len(failures) or 'a'} factor(s) "
                   f"failed on {ranks} rank(s)")
        if failures:
            first = next(iter(failures.values()))
            message += (f"; on this rank: {', '.join(key.name for key in failures)} "
                        f"({type(first).__name__}: {first})")
        error = KFACNumericalError(
            message + ". Decompositions were not updated; increase damping, check for "
            "diverging training, or restore the last checkpoint.",
            step=k, ranks=ranks, local=[key.name for key in failures])
        raise error from (next(iter(failures.values())) if failures else None)

    def _cap(self, key: FactorKey) -> int | None:
        """The most eigenpairs a low-rank factor keeps (``None``: full decomposition)."""
        return low_rank_cap(self._dim(key), self.low_rank, self.low_rank_min_dim)

    def _is_low_rank(self, key: FactorKey) -> bool:
        return self.compute_method == "eigen" and self._cap(key) is not None

    def _decomposition_parts(self, key: FactorKey) -> tuple[Part, ...]:
        """What a decomposition is made of: eigen ``(Q, λ)``, low rank ``(Q, λ, ρ,
        rank)``, inverse ``(inv,)``."""
        if self.compute_method != "eigen":
            return (Part.INV,)
        if self._is_low_rank(key):
            return (Part.Q, Part.LAMBDA, Part.RHO, Part.RANK)
        return (Part.Q, Part.LAMBDA)

    def _decomposition_pieces(self, key: FactorKey) -> list[tuple[PieceKey, int]]:
        """A factor's decomposition in a message: its parts, then its valid flag.

        Low rank (cap ``c``): ``Q`` as ``c x d`` (its columns one after another, so the
        first ``k`` are a prefix), ``λ`` (``c``, zero-padded), ``ρ``, the rank ``k``."""
        n, cap = self._dim(key), self._cap(key)
        size = {Part.Q: n * n, Part.LAMBDA: n, Part.INV: n * n, Part.RHO: 1, Part.RANK: 1}
        if cap is not None:
            size.update({Part.Q: cap * n, Part.LAMBDA: cap})
        return [*((PieceKey(key, part), size[part]) for part in self._decomposition_parts(key)),
                (PieceKey(key, Part.VALID), 1)]

    def _decompose_low_rank(self, key: FactorKey, average: Tensor,
                            step: int) -> dict[PieceKey, Piece]:
        """Randomized decomposition (sketch seeded by factor and ``step``, so the same on
        any rank), laid out as :meth:`_decomposition_pieces` says; float64 retry on
        failure."""
        cap = self._cap(key)
        assert cap is not None

        def attempt(factor: Tensor) -> LowRankFactor:
            return randomized_eigh(factor, rank=cap, energy=self.low_rank_energy,
                                   remainder=self.low_rank_remainder,
                                   generator=sketch_generator(key.name, step, self.device))

        try:
            low = attempt(average)
        except torch.linalg.LinAlgError:
            low = attempt(average.to(torch.float64))
        k, n = low.rank, low.dim
        q = torch.zeros(cap, n, dtype=self.inv_dtype, device=self.device)
        q[:k] = low.q.t()
        lam = torch.zeros(cap, dtype=self.inv_dtype, device=self.device)
        lam[:k] = low.lam
        return {PieceKey(key, Part.Q): q, PieceKey(key, Part.LAMBDA): lam,
                PieceKey(key, Part.RHO): low.rho.to(self.inv_dtype).reshape(1),
                PieceKey(key, Part.RANK): float(k), PieceKey(key, Part.VALID): 1.0}

    def _eigendecompositions(self, states: Mapping[FactorKey, FactorState]
                             ) -> dict[FactorKey, tuple[Tensor, Tensor] | Exception]:
        """Full eigendecompositions of the factors among ``states`` that get one, batched
        by size (:func:`~kfac_hpc.kfac.linalg.eigh_clamped_many`: one solver call, and
        one host sync, per distinct size). With ``eigen_refresh="subspace"`` a factor
        whose previous eigenbasis this rank holds is refreshed from it instead
        (:func:`~kfac_hpc.kfac.linalg.refresh_eigenbases`: two GEMMs and a QR)."""
        if self.compute_method != "eigen":
            return {}
        keys = [key for key, state in states.items()
                if state.average is not None and not self._is_low_rank(key)]
        previous = {key: self._decompositions[key]["Q"] for key in keys
                    if self.eigen_refresh == "subspace" and key in self._decompositions}
        fresh = [key for key in keys if key not in previous]
        out: dict[FactorKey, tuple[Tensor, Tensor] | Exception] = dict(zip(
            fresh, linalg.eigh_clamped_many(
                [cast(Tensor, states[key].average) for key in fresh], dtype=self.inv_dtype)))
        refreshed = list(previous)
        out.update(zip(refreshed, linalg.refresh_eigenbases(
            [cast(Tensor, states[key].average) for key in refreshed],
            [previous[key] for key in refreshed], dtype=self.inv_dtype)))
        return out

    def _decompose(self, key: FactorKey, state: FactorState, step: int,
                   eigen: tuple[Tensor, Tensor] | None = None) -> dict[PieceKey, Piece]:
        """One factor's decomposition as message pieces (``step``: the inverse step it
        belongs to, which seeds low-rank sketches and picks the damping of inverses;
        ``eigen``: its ``(Q, λ)`` when already computed)."""
        if state.average is None:  # never saw statistics: marked invalid, not preconditioned
            return {p: torch.zeros(m, dtype=self.inv_dtype, device=self.device)
                    for p, m in self._decomposition_pieces(key)}
        valid: dict[PieceKey, Piece] = {PieceKey(key, Part.VALID): 1.0}
        if self._is_low_rank(key):
            return self._decompose_low_rank(key, state.average, step)
        if self.compute_method == "eigen":
            q, lam = eigen if eigen is not None else linalg.eigh_clamped(
                state.average, dtype=self.inv_dtype)
            return {PieceKey(key, Part.Q): q, PieceKey(key, Part.LAMBDA): lam, **valid}
        damping = self.damping(step)
        inv = linalg.damped_inverse(state.average, damping, dtype=self.inv_dtype)
        return {PieceKey(key, Part.INV): inv, **valid}

    # ------------------------------------------------------------ preconditioning
    @timed(Phase.KFAC_PRECONDITION)
    def _precondition_my_layers(self, k: int) -> dict[str, Tensor]:
        damping = self.damping(k)
        out: dict[str, Tensor] = {}
        for name, curv in self.layers.items():
            if not self.placement.is_grad_worker(name, self.comm.rank):
                continue
            a = self._decompositions.get(FactorKey(name, "A"))
            g = self._decompositions.get(FactorKey(name, "G"))
            if a is None or g is None or curv.module.weight.grad is None:
                continue
            out[name] = self._precondition_layer(name, curv.grad_matrix(self.inv_dtype), a, g,
                                                 damping)
        return out

    def _precondition_layer(self, name: str, grad: Tensor, a: Mapping[str, Tensor],
                            g: Mapping[str, Tensor], damping: float) -> Tensor:
        """One layer's preconditioned gradient from its factors' decompositions."""
        if "rho" in a or "rho" in g:  # a low-rank factor: exact for the approximation
            return precondition_lowrank(grad, _low_rank_factor(a), _low_rank_factor(g), damping)
        if self.compute_method == "eigen":
            return linalg.precondition_eigen(grad, a["Q"], a["lambda"], g["Q"], g["lambda"],
                                             damping, self.precondition_precision)
        return linalg.precondition_inverse(grad, a["inv"], g["inv"], self.precondition_precision)

    @timed(Phase.KFAC_GRADIENTS)
    def _share_preconditioned(self, mine: dict[str, Tensor]) -> dict[str, Tensor]:
        """Gradient workers send preconditioned gradients to their receiver groups."""
        if self.placement.n_groups == 1:
            return mine
        parts: list[list[tuple[PieceKey, int]]] = [[] for _ in range(self.placement.n_groups)]
        for name, curv in self.layers.items():
            parts[self.placement.layer_group[name]] += [
                (PieceKey(name, Part.GRADIENT), curv.g_dim * curv.a_dim),
                (PieceKey(name, Part.VALID), 1)]
        values: dict[PieceKey, Piece] = {}
        for name, curv in self.layers.items():
            v = mine.get(name)
            values[PieceKey(name, Part.GRADIENT)] = v if v is not None else torch.zeros(
                curv.g_dim, curv.a_dim, dtype=self.inv_dtype, device=self.device)
            values[PieceKey(name, Part.VALID)] = 1.0 if v is not None else 0.0
        with self.comm.stats.tagged(Traffic.GRADIENTS):
            pieces = broadcast_parts(self.receiver_comm, MessageLayout.of(parts), lambda: values,
                                     self.inv_dtype, self.device)
        valid = read_scalars(pieces, [PieceKey(name, Part.VALID) for name in self.layers])
        return {name: pieces[PieceKey(name, Part.GRADIENT)].view(curv.g_dim, curv.a_dim).clone()
                for (name, curv), ok in zip(self.layers.items(), valid) if ok}

    # ------------------------------------------------------------------ helpers
    def _check_device(self) -> None:
        """The model must stay where it was when the preconditioner was built."""
        weight = next(iter(self.layers.values())).module.weight
        if weight.device != self.device:
            raise RuntimeError(
                f"the model moved to {weight.device} after the KFACPreconditioner was built on "
                f"{self.device}; build it after model.to(device)")

    def _capturing(self) -> bool:
        return self._is_factor_step(self.steps)

    def _grad_scale(self) -> float | Tensor:
        """What the loss was multiplied by: ``loss scale / accumulation_steps``. The AMP
        scale stays a device tensor (reading it would sync the host in every hook)."""
        scale = 1.0 / self.accumulation_steps
        scaler = self.grad_scaler
        if scaler is not None and scaler.is_enabled():
            on_device = getattr(scaler, "_get_scale_async", lambda: None)()
            return on_device * scale if isinstance(on_device, Tensor) \
                else float(scaler.get_scale()) * scale
        return scale

    def _is_factor_step(self, k: int) -> bool:
        return k % int(self.factor_update_steps(k)) == 0

    def _is_inverse_step(self, k: int) -> bool:
        return k % int(self.inv_update_steps(k)) == 0

    def _keys(self) -> list[FactorKey]:
        """Every factor in model order (A, G of each layer)."""
        return [FactorKey(n, f) for n in self.layers for f in FACTORS]

    def _owner(self, key: FactorKey) -> int:
        return self.placement.factor_owner[key]

    def _dim(self, key: FactorKey) -> int:
        curv = self.layers[key.layer]
        return curv.a_dim if key.factor == "A" else curv.g_dim

    def _group_communicators(self) -> tuple[Communicator, Communicator]:
        """Sub-communicators of KAISA's grid (the world itself where a group spans it)."""
        p, rank = self.placement, self.comm.rank
        worker = self.comm if p.n_groups == 1 else self.comm.split(
            p.worker_group_of_rank(rank), name="grad-workers")
        receiver = self.comm if p.grad_workers == 1 else self.comm.split(
            p.receiver_group_of_rank(rank), name="receivers")
        return worker, receiver

    # ---------------------------------------------------------------- state
    # The checkpoint boundary: factors by name ("<layer>/A"), as in state_dict() and HDF5.
    def factor_keys(self) -> list[str]:
        """Every factor's name in model order (``"<layer>/A"``, ``"<layer>/G"``)."""
        return [key.name for key in self._keys()]

    def factor_owner(self, key: str | FactorKey) -> int:
        """The rank that holds factor ``key`` under the current world size and strategy."""
        return self._owner(_as_key(key))

    def factor_shape(self, key: str | FactorKey) -> tuple[int, int]:
        n = self._dim(_as_key(key))
        return (n, n)

    @property
    def factors(self) -> dict[str, FactorState]:
        """The factors this rank holds (owned, plus replicas of local ones), by name."""
        return {key.name: state for key, state in self._factors.items()}

    @property
    def decompositions(self) -> dict[str, dict[str, Tensor]]:
        """The current decompositions this rank holds (``{"Q", "lambda"}`` or
        ``{"inv"}``), by factor name."""
        return {key.name: parts for key, parts in self._decompositions.items()}

    def state_dict(self, eigenbases: bool = True) -> KFACStateDict:
        """Step counter, config and the factors this rank owns (keyed by name).

        ``eigenbases`` (default) adds the owned factors' current decompositions
        (``{"Q", "lambda"}`` or ``{"inv"}``): a run resumed between two inverse updates
        then uses the same stale decompositions as the run that saved (exact resume).
        ``eigenbases=False`` halves the state; the decompositions are then recomputed from
        the factors at the first step after a load (not bitwise between inverse updates).

        With ``factor_sync="inverse"`` this is collective (every rank calls it): the
        ranks' pending local averages are first folded into the owners' factors, as at an
        inverse-update step (without decomposing), so the state is complete on any number
        of ranks, and the saving run continues from exactly the state it saved.
        """
        if self.factor_sync == "inverse" and any(
                local.updates for local in self.local_averages.values()):
            self._synchronise_local_averages()
        if self._pending is not None:  # installed now, in the saving run as in the resumed
            self._install_background_decompositions()
        state: KFACStateDict = {
            "step": self.steps,
            "factors": {k.name: s.average for k, s in self._owned_states().items()
                        if s.average is not None},
            "factor_updates": {k.name: s.updates for k, s in self._owned_states().items()},
            "config": self.config(),
        }
        if self.factor_sync == "inverse":  # every rank's: which factors were updated before
            state["history"] = sorted(k.name for k in self._has_history)
        if eigenbases:
            state["eigenbases"] = {k.name: self._stored_decomposition(k)
                                   for k in self._owned_states() if k in self._decompositions}
        return state

    def _stored_decomposition(self, key: FactorKey) -> dict[str, Tensor]:
        """A decomposition as ``state_dict()`` stores it: ``{"Q", "lambda"}``,
        ``{"inv"}``, or low rank ``{"Q" (d x k), "lambda" (k), "rho" (1), "rank" (1)}``."""
        parts = dict(self._decompositions[key])
        if Part.RHO.value in parts:
            q = parts[Part.Q.value]
            parts[Part.Q.value] = q.contiguous()
            parts[Part.RANK.value] = torch.tensor([q.shape[1]], dtype=torch.int64,
                                                  device=self.device)
        return parts

    def _restorable(self, key: FactorKey, parts: Mapping[str, Tensor]
                    ) -> dict[PieceKey, Tensor] | None:
        """Stored decomposition ``parts`` as this preconditioner's message pieces, or
        ``None`` when they do not fit its settings (e.g. saved with another ``low_rank``;
        the decomposition is then recomputed at the next step)."""
        n, cap = self._dim(key), self._cap(key) if self._is_low_rank(key) else None
        wanted = [part.value for part in self._decomposition_parts(key)]
        if any(name not in parts for name in wanted if name != Part.RANK.value):
            return None

        def piece(name: str) -> Tensor:
            return parts[name].detach().to(device=self.device, dtype=self.inv_dtype, copy=True)

        if cap is None:
            if tuple(parts[Part.LAMBDA.value].shape if Part.LAMBDA.value in parts
                     else (n,)) != (n,) or parts[wanted[0]].shape != (n, n):
                return None
            return {PieceKey(key, Part(name)): piece(name).reshape(-1) for name in wanted}
        q = parts[Part.Q.value]
        k = int(q.shape[1]) if q.dim() == 2 else -1
        stored_rank = parts.get(Part.RANK.value)
        if (q.dim() != 2 or q.shape[0] != n or not 1 <= k <= cap
                or tuple(parts[Part.LAMBDA.value].shape) != (k,)
                or parts[Part.RHO.value].numel() != 1
                or (stored_rank is not None and int(stored_rank.reshape(-1)[0]) != k)):
            return None
        wire_q = torch.zeros(cap, n, dtype=self.inv_dtype, device=self.device)
        wire_q[:k] = piece(Part.Q.value).t()
        lam = torch.zeros(cap, dtype=self.inv_dtype, device=self.device)
        lam[:k] = piece(Part.LAMBDA.value)
        return {PieceKey(key, Part.Q): wire_q.reshape(-1), PieceKey(key, Part.LAMBDA): lam,
                PieceKey(key, Part.RHO): piece(Part.RHO.value).reshape(1),
                PieceKey(key, Part.RANK): torch.full((1,), float(k), dtype=self.inv_dtype,
                                                     device=self.device)}

    def _owned_states(self) -> dict[FactorKey, FactorState]:
        return {k: s for k, s in self._factors.items() if self._owner(k) == self.comm.rank}

    def load_state_dict(self, state: KFACStateDict) -> None:
        """Take the factors this rank owns from ``state`` (which may hold more).

        Collective (every rank calls it): ranks agree on errors before anything changes
        (the same failure on every rank, nothing half-loaded), and owners of local (small)
        factors send them to the layer's other gradient workers.
        """
        self._cancel_background_decompositions()  # superseded by the loaded state
        factors = state["factors"]
        updates = state.get("factor_updates", {})
        owned = {key.name: s for key, s in self._owned_states().items()}  # by stored name
        problem: Exception | None = None
        missing = [k for k in owned if k not in factors and updates.get(k, 0) > 0]
        missing += [k for k in owned if k not in updates]
        if missing:
            problem = KeyError(f"factor state missing for {sorted(set(missing))} (owned by "
                               f"rank {self.comm.rank}); was the checkpoint written for this "
                               "model?")
        for name, s in owned.items():
            value = factors.get(name)
            if problem is None and value is not None and tuple(value.shape) != (s.dim, s.dim):
                problem = ValueError(f"factor {name} has shape {tuple(value.shape)}, "
                                     f"expected {(s.dim, s.dim)}")
        # every rank decides together before anything collective or anything is changed
        if self.comm.any(problem is not None):
            raise problem if problem is not None else RuntimeError(
                "load_state_dict failed on another rank (see its message); nothing loaded")
        for name, s in owned.items():
            value = factors.get(name)
            s.average = None if value is None else value.detach().to(
                device=self.device, dtype=self.factor_dtype, copy=True)
            s.updates = int(updates[name])
        self._share_local_replicas()
        self.steps = int(state["step"])
        self._decomposed_at = None  # restored or recomputed at the next step
        eig = state.get("eigenbases") or {}
        restored: dict[PieceKey, Tensor] = {}
        unfit = []
        for name in owned:
            if eig.get(name):
                pieces = self._restorable(FactorKey.parse(name), eig[name])
                if pieces is None:
                    unfit.append(name)
                else:
                    restored.update(pieces)
        if unfit:
            log.info("K-FAC: the stored decompositions of %s do not fit this preconditioner's "
                     "settings (compute_method / low_rank); recomputed at the next step",
                     ", ".join(unfit))
        # restoring is a collective path: decided together (a rank that owns nothing
        # has no decompositions of its own to restore)
        self._restored = restored if self.comm.any(bool(restored)) else None
        # factor_sync="inverse": the saved factors include every fold (state_dict()
        # synchronised them); local averages restart empty, and a factor that has been
        # updated before is not "first" again
        for local in self.local_averages.values():
            local.reset()
        history = state.get("history")
        self._has_history = {k for k in self.local_averages if k.name in set(history)} \
            if history is not None \
            else {k for k in self.local_averages if int(updates.get(k.name, 0)) > 0}

    def _share_local_replicas(self) -> None:
        """Owners of local factors broadcast them (and their counts) in the worker group."""
        if not self.placement.local_factors:
            return
        group, g = self.placement.worker_group_of_rank(self.comm.rank), self.placement.grad_workers
        parts: list[list[tuple[PieceKey, int]]] = [[] for _ in range(g)]
        for key in self._local_keys():
            if self.placement.layer_group[key.layer] == group:
                n = self._dim(key)
                parts[self._owner(key) - group * g] += [(PieceKey(key, Part.FACTOR), n * n),
                                                        (PieceKey(key, Part.UPDATES), 1)]

        def own() -> dict[PieceKey, Piece]:
            out: dict[PieceKey, Piece] = {}
            for key, s in self._owned_states().items():
                if self._is_local(key):
                    out[PieceKey(key, Part.FACTOR)] = s.average if s.average is not None \
                        else torch.zeros(s.dim, s.dim, dtype=self.factor_dtype, device=self.device)
                    out[PieceKey(key, Part.UPDATES)] = float(s.updates)
            return out

        pieces = broadcast_parts(self.worker_comm, MessageLayout.of(parts), own, self.factor_dtype,
                                 self.device)
        replicas = [key for key in self._factors
                    if self._is_local(key) and self._owner(key) != self.comm.rank]
        updates = read_scalars(pieces, [PieceKey(key, Part.UPDATES) for key in replicas])
        for key, count in zip(replicas, updates):
            s = self._factors[key]
            s.updates = round(count)
            s.average = pieces[PieceKey(key, Part.FACTOR)].view(s.dim, s.dim).clone() \
                if s.updates else None

    def config(self) -> dict[str, Any]:
        """The settings, JSON-able (schedules are shown as ``"<schedule>"``)."""
        sched = {s.name: s.describe() for s in (self.damping, self.factor_decay, self.lr,
                                                self.factor_update_steps, self.inv_update_steps)}
        return {"strategy": self.strategy, "grad_workers": self.placement.grad_workers,
                "compute_method": self.compute_method,
                "kl_clip": None if self.kl_clip is None else self.kl_clip.describe(),
                "factor_dtype": str(self.factor_dtype), "inv_dtype": str(self.inv_dtype),
                "symmetric_packing": self.symmetric_packing, "overlap": self.overlap,
                "bucket_cap_mb": self.bucket_cap_mb, "factor_sync": self.factor_sync,
                "local_decomposition_threshold": self.local_decomposition_threshold,
                "kfac_approx": self.kfac_approx, "low_rank": self.low_rank,
                "low_rank_energy": self.low_rank_energy,
                "low_rank_min_dim": self.low_rank_min_dim,
                "low_rank_remainder": self.low_rank_remainder,
                "decomposition_lag": self.decomposition_lag,
                "eigen_refresh": self.eigen_refresh,
                "stats_precision": self.stats_precision,
                "precondition_precision": self.precondition_precision,
                "accumulation_steps": self.accumulation_steps, "world_size": self.comm.size,
                **sched}

    # ----------------------------------------------------------- introspection
    def memory_bytes(self) -> dict[str, int]:
        """Bytes of K-FAC state held by this rank: factors and decompositions."""
        factors = sum(s.average.nbytes for s in self._factors.values() if s.average is not None)
        decomp = sum(t.numel() * t.element_size()
                     for pieces in self._decompositions.values() for t in pieces.values())
        return {"factors": factors, "decompositions": decomp}

    def describe(self) -> str:
        """Registered layers, factor sizes, owners and this rank's memory."""
        p = self.placement
        low = "" if self.low_rank is None else (
            f", low_rank={self.low_rank} for factors >= {self.low_rank_min_dim}"
            + ("" if self.low_rank_energy is None else f", energy {self.low_rank_energy}"))
        head = (f"KFACPreconditioner(strategy={self.strategy}, ranks={self.comm.size}, "
                f"grad_workers={p.grad_workers}, method={self.compute_method}{low})")
        rows = [f"  {'layer':<28} {'A':>6} {'G':>6}  owners(A,G)  group"]
        for name, c in self.layers.items():
            a, g = (f"{d}{'~' if self._is_low_rank(FactorKey(name, f)) else ''}"
                    for d, f in ((c.a_dim, "A"), (c.g_dim, "G")))
            rows.append(f"  {name:<28} {a:>6} {g:>6}  "
                        f"{p.factor_owner[FactorKey(name, 'A')]:>4},"
                        f"{p.factor_owner[FactorKey(name, 'G')]:<6}  "
                        f"{p.layer_group[name]:>5}")
        mem = self.memory_bytes()
        rows.append(f"  rank {self.comm.rank}: factors {mem['factors'] / 2**20:.2f} MiB, "
                    f"decompositions {mem['decompositions'] / 2**20:.2f} MiB")
        return "\n".join([head, *rows])

    def __repr__(self) -> str:
        return self.describe()

    def remove_hooks(self) -> None:
        """Detach from the model (the preconditioner can no longer step)."""
        self.capture.remove()

    def close(self) -> None:
        """Detach from the model and free the sub-communicators this preconditioner made.

        Collective (every rank calls it; MPI frees communicators together); idempotent.
        The preconditioner can no longer step.
        """
        self.remove_hooks()
        self._cancel_background_decompositions()
        for sub in {id(c): c for c in (self.worker_comm, self.receiver_comm)}.values():
            if sub is not self.comm:
                sub.free()
        self.worker_comm = self.receiver_comm = self.comm
        self._closed = True


def _resolve_auto(model: nn.Module, comm: Communicator,
                  profile: Profile | str | os.PathLike[str] | None,
                  **options: Any) -> tuple[Strategy, float | None]:
    """strategy='auto': the planner's fastest exact strategy (same on every rank)."""
    from kfac_hpc.plan.auto import resolve_auto

    model = getattr(model, "module", model) if _is_wrapper(model) else model
    strategy, fraction, best, _ = resolve_auto(model, comm.size, profile=profile, **options)
    if comm.rank == 0:
        if best is None:
            log.info("K-FAC strategy='auto': one rank, using comm-opt")
        else:
            log.info("K-FAC strategy='auto' chose %s on %d ranks (profile %s): predicted "
                     "%.4f s/iteration, %.1f MiB K-FAC traffic per rank per step",
                     best.options.label(), comm.size, best.profile, best.total_s,
                     best.kfac_bytes / 2**20)
    assert strategy in STRATEGIES
    return strategy, fraction


def _as_key(key: str | FactorKey) -> FactorKey:
    return key if isinstance(key, FactorKey) else FactorKey.parse(key)


def _low_rank_factor(parts: Mapping[str, Tensor]) -> LowRankFactor:
    """A layer's decomposition for :func:`precondition_lowrank`: a full one is the
    low-rank form with ``k = d`` and ``ρ = 0``."""
    q, lam = parts[Part.Q.value], parts[Part.LAMBDA.value]
    rho = parts.get(Part.RHO.value)
    return LowRankFactor(q=q, lam=lam, rho=(rho if rho is not None else lam.new_zeros(1)
                                            ).reshape(()), exact=rho is None)


def _check_rank_fits(low_rank: int | None, energy: float | None, inv_dtype: torch.dtype) -> None:
    """With the energy rule the rank travels as a number in ``inv_dtype``: it must be
    exact there (16-bit floats hold whole numbers up to 256 or 2048 only)."""
    if low_rank is None or energy is None or not inv_dtype.is_floating_point:
        return
    exact_up_to = round(2 / torch.finfo(inv_dtype).eps)
    if low_rank > exact_up_to:
        raise ValueError(f"low_rank={low_rank} with low_rank_energy: the rank travels in "
                         f"inv_dtype={inv_dtype}, exact only up to {exact_up_to}; use a "
                         "smaller low_rank or inv_dtype=torch.float32")


def _merge(dicts: Iterable[Mapping[PieceKey, Piece]]) -> dict[PieceKey, Piece]:
    out: dict[PieceKey, Piece] = {}
    for d in dicts:
        out.update(d)
    return out


def _is_wrapper(model: nn.Module) -> bool:
    from torch.nn.parallel import DistributedDataParallel

    return isinstance(model, DistributedDataParallel)


def _register_layers(model: nn.Module, skip: tuple[str, ...], rank: int,
                     approx: ApproxOption) -> dict[str, LayerCurvature]:
    layers, skipped = register_layers(model, skip, approx=approx)
    if skipped and rank == 0:
        log.info("K-FAC skips %d layer(s): %s", len(skipped), "; ".join(skipped))
    return layers


def _layers_device(layers: Mapping[str, LayerCurvature]) -> torch.device:
    """The one device of the registered layers (where all K-FAC state lives)."""
    devices = {cast(Tensor, c.module.weight).device for c in layers.values()}
    if len(devices) > 1:
        where = {str(d): [n for n, c in layers.items()
                          if cast(Tensor, c.module.weight).device == d][:3]
                 for d in devices}
        raise ValueError(f"K-FAC layers live on several devices ({where}); move the model to "
                         "one device (model.to(device)) before building the preconditioner, "
                         "or list the others in skip_layers")
    return devices.pop()


def _mean(total: Tensor, count: int) -> Tensor:
    """``total / count`` without the pass when ``count`` is 1 (``x / 1 == x`` exactly);
    read-only: the running-average updates copy or combine it, never modify it."""
    return total if count == 1 else total / count


def _nonfinite(tensors: Mapping[FactorKey, Tensor]) -> list[FactorKey]:
    """Keys of the tensors holding NaN or Inf (one host sync when all are finite).

    Screened by a statistic that is non-finite whenever an entry is (the sum on the CPU,
    one multi-tensor 2-norm on other devices; the CPU's inf-norm kernel is 20-50x slower
    than a sum); only a tensor whose statistic is not finite (a NaN/Inf entry, or an
    overflow of the statistic itself) is checked entry by entry.
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


def _dtype_name(dtype: torch.dtype | None) -> str | None:
    """``torch.float32`` as ``"float32"`` (``None`` stays ``None``)."""
    return None if dtype is None else str(dtype).removeprefix("torch.")


def _default_factor_dtype(layers: Mapping[str, LayerCurvature]) -> torch.dtype:
    names = (str(c.module.weight.dtype).removeprefix("torch.") for c in layers.values())
    return cast(torch.dtype, getattr(torch, default_factor_dtype(names)))


def _batch_shape(input_shape: Iterable[int] | None) -> tuple[int, ...] | None:
    """``input_shape`` validated: one rank's input batch, e.g. ``(32, 3, 32, 32)``."""
    if input_shape is None:
        return None
    shape = tuple(input_shape)
    if len(shape) < 2 or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 1
                                 for d in shape):
        raise ValueError(f"input_shape must be one rank's input batch shape, (batch, *sample) "
                         f"with positive integers, e.g. (32, 3, 32, 32); got {input_shape!r}")
    return shape
