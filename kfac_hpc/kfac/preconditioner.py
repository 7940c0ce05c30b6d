"""The K-FAC preconditioner: ``step()`` replaces gradients by preconditioned gradients.

One step, as the algorithm reads (docs/design.md, "Data flow of one step"):

1. factor update  — batch factors from the hooks are summed onto their owners
                     (:class:`~kfac_hpc.kfac.exchanges.FactorExchange`; DP-KFAC: owners
                     use their own batch), owners fold them into the running averages
                     (:class:`~kfac_hpc.kfac.factor_store.FactorStore`);
2. inverse update — owners decompose their factors
                     (:class:`~kfac_hpc.kfac.decomposer.Decomposer`) and broadcast them
                     inside the layer's gradient-worker group
                     (:class:`~kfac_hpc.kfac.decompositions.Decompositions`; now, or in
                     the background with ``decomposition_lag``);
3. precondition   — gradient workers precondition their layers (on CUDA the layers
                     of one gradient shape as one stack, :mod:`kfac_hpc.kfac.stacked`);
                     the results are broadcast inside receiver groups
                     (:class:`~kfac_hpc.kfac.exchanges.GradientExchange`);
4. KL clipping    — every rank scales all preconditioned gradients by the same ν.

:class:`KFACPreconditioner` is the facade: it turns its keyword arguments into a
validated :class:`~kfac_hpc.kfac.config.KFACConfig`, registers the layers, places the
factors, builds the parts once and runs them in that order.

Device rule: every tensor K-FAC creates lives on ``self.device``, the device of the
registered layers (a CUDA model keeps all K-FAC state on its GPU); messages are packed
on it (:mod:`kfac_hpc.kfac.exchange`) and their scalars (counts, valid flags) are read
back in one transfer per phase. Faults are agreed (:mod:`kfac_hpc.kfac.agree`): a rank
that sees non-finite statistics or a failed decomposition joins the step's collectives
and then every rank raises the same :class:`~kfac_hpc.kfac.errors.KFACNumericalError`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, Literal, cast

import torch
from torch import Tensor, nn

from kfac_hpc import step_graph
from kfac_hpc.comm import Communicator, replicas, world
from kfac_hpc.kfac import linalg, stacked
from kfac_hpc.kfac.config import KFACConfig, batch_shape, dtype_name
from kfac_hpc.kfac.decomposer import Decomposer, make_decomposer
from kfac_hpc.kfac.decompositions import Decompositions, Renewal, make_renewal
from kfac_hpc.kfac.exchanges import (
    DecompositionExchange,
    FactorExchange,
    GradientExchange,
    ReplicaExchange,
)
from kfac_hpc.kfac.factor_store import FactorState, FactorStore
from kfac_hpc.kfac.factor_sync import LocalAverage
from kfac_hpc.kfac.factor_update import FactorUpdate
from kfac_hpc.kfac.hyperparams import Scalar, Schedule
from kfac_hpc.kfac.layers import TIED, ApproxOption, LayerCurvature, register_layers
from kfac_hpc.kfac.layouts import factor_dim, factor_keys, factor_wire_numel, readiness_order
from kfac_hpc.kfac.options import (
    AUTO,
    DEFAULT_BUCKET_CAP_MB,
    DEFAULT_LOCAL_THRESHOLD,
    DEFAULT_LOW_RANK_MIN_DIM,
    STRATEGIES,
    ComputeMethod,
    EigenRefresh,
    FactorSync,
    KFACApprox,
    LowRankRemainder,
    PrecisionOption,
    Strategy,
    default_factor_dtype,
    resolve_precision,
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
from kfac_hpc.kfac.stacked import Stack, stack_grads, stack_groups, write_grads
from kfac_hpc.kfac.state import KFACStateDict
from kfac_hpc.phases import Phase, PhaseTimer, timed
from kfac_hpc.solves import DEFAULT_HOST_MAX_DIM
from kfac_hpc.step_graph import StepGraph

if TYPE_CHECKING:
    from kfac_hpc.plan.profile import Profile

__all__ = ["FactorState", "KFACPreconditioner"]

log = logging.getLogger("kfac_hpc")


@dataclass(frozen=True)
class GraphKey:
    """What K-FAC's captured step depends on besides the gradients, the lr and the KL bound.

    Attributes:
        generation: The decompositions' generation.
        damping: The damping.
        grads: Per candidate parameter, in a fixed order, its gradient's dtype (``None``:
            no gradient this step).
        clips: Whether the KL clip is on.
    """

    generation: int
    damping: float
    grads: tuple[torch.dtype | None, ...]
    clips: bool


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
        host_decomposition_max_dim: int = DEFAULT_HOST_MAX_DIM,
        decomposition_streams: int | None = None,
        cuda_graphs: bool | None = None,
    ) -> None:
        """Register ``model``'s layers, place their factors and build the parts.

        Collective: every rank builds its preconditioner with the same options.

        Args:
            model: The model (a ``DistributedDataParallel`` is unwrapped).
            comm: The ranks that train together (default: the world).
            strategy: ``"comm-opt"``, ``"mem-opt"``, ``"hybrid-opt"``, ``"dp-kfac"``, or
                ``"auto"`` (the planner's fastest exact strategy).
            grad_worker_fraction: Gradient workers per layer as a share of the ranks
                (``hybrid-opt`` only).
            compute_method: ``"eigen"`` (eigendecompositions) or ``"inverse"``.
            damping: Tikhonov damping γ (constant or callable of the step).
            factor_decay: Running-average decay of the factors, in [0, 1).
            kl_clip: KL-clipping bound, or ``None`` for none.
            lr: The learning rate the KL clip assumes.
            factor_update_steps: Steps between factor updates.
            inv_update_steps: Steps between inverse (decomposition) updates.
            skip_layers: Layers not to precondition: module or class names, exact or a
                regular expression of the whole name.
            factor_dtype: Dtype of the factors (default: from the weights, >= float32).
            inv_dtype: Dtype of decompositions and preconditioned gradients.
            accumulation_steps: Micro-batches per step (backward passes per ``step()``).
            grad_scaler: The AMP scaler (non-finite statistics skip the update).
            symmetric_packing: Send factors as upper triangles.
            overlap: Post factor reductions from the hooks in buckets (SPD-KFAC).
            bucket_cap_mb: The size of one such bucket.
            factor_sync: ``"step"`` (reduce at factor steps) or ``"inverse"`` (local
                averages, reduced at inverse steps).
            local_decomposition_threshold: Factors below this dimension are decomposed
                by every gradient worker of their layer.
            check_replicas: Check that every rank holds the same model first.
            plan_profile: The planner's profile for ``strategy="auto"``.
            input_shape: One rank's input batch shape (DP-KFAC balances statistics).
            kfac_approx: ``"expand"`` or ``"reduce"`` for layers with positions, or a
                mapping by module or class name.
            low_rank: The most eigenpairs kept of a large factor, or ``None``.
            low_rank_energy: Keep the fewest pairs holding this share of the trace.
            low_rank_min_dim: Factors at least this large get the low-rank form.
            low_rank_remainder: ``"mean"`` (keeps the trace) or ``"zero"``.
            decomposition_lag: Steps between starting decompositions in the background
                and using them (0: in the inverse step).
            eigen_refresh: ``"eigh"`` or ``"subspace"`` (one subspace-iteration step).
            stats_precision: Operand precision of the statistics GEMMs.
            precondition_precision: Operand precision of preconditioning.
            host_decomposition_max_dim: Eigendecompositions of factors up to this size
                on a CUDA device run on the host while the device solves the larger
                ones (0, the default: all on the device, faster on an H200;
                ``kfac_hpc.solves``; the CPU is unaffected).
            decomposition_streams: On CUDA, the device's decompositions of more than 32
                rows are spread over this many streams and worker threads (None, the
                default: 8, measured fastest on an H200, or the cores this process may
                run on when fewer; 1: the calling thread's stream; the same results
                either way; ``kfac_hpc.solves``).
            cuda_graphs: On CUDA, capture the preconditioning, KL clip and writes to
                ``.grad`` as a CUDA graph between inverse updates and replay it (the same
                results; :mod:`kfac_hpc.step_graph`). Where preconditioned gradients
                are exchanged between ranks the step runs without one (with a warning
                when asked for by True). None (default): on the device types of
                ``kfac_hpc.step_graph.DEFAULT_DEVICES`` (CUDA), unless the gradient
                buffers would take more than its ``DEFAULT_BUFFER_SHARE`` of the device's
                memory.

        Raises:
            ValueError: An option, or a combination of options, is invalid (the message
                names it and the fix), or the model has no layer K-FAC can precondition.
        """
        shape = batch_shape(input_shape)
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
                factor_dtype=factor_dtype, inv_dtype=inv_dtype, input_shape=shape,
                kfac_approx=kfac_approx if isinstance(kfac_approx, str) else "expand",
                low_rank=low_rank, low_rank_energy=low_rank_energy,
                low_rank_min_dim=low_rank_min_dim, low_rank_remainder=low_rank_remainder)
        elif plan_profile is not None:
            raise ValueError("plan_profile applies to strategy='auto' only")
        self.options = KFACConfig(
            strategy=cast(Strategy, strategy), grad_worker_fraction=grad_worker_fraction,
            compute_method=compute_method, damping=damping, factor_decay=factor_decay,
            kl_clip=kl_clip, lr=lr, factor_update_steps=factor_update_steps,
            inv_update_steps=inv_update_steps, skip_layers=tuple(
                (skip_layers,) if isinstance(skip_layers, str) else skip_layers),
            factor_dtype=factor_dtype, inv_dtype=inv_dtype,
            accumulation_steps=accumulation_steps, symmetric_packing=symmetric_packing,
            overlap=overlap, bucket_cap_mb=bucket_cap_mb, factor_sync=factor_sync,
            local_decomposition_threshold=local_decomposition_threshold,
            check_replicas=check_replicas, input_shape=shape, kfac_approx=kfac_approx,
            low_rank=low_rank, low_rank_energy=low_rank_energy,
            low_rank_min_dim=low_rank_min_dim, low_rank_remainder=low_rank_remainder,
            decomposition_lag=decomposition_lag, eigen_refresh=eigen_refresh,
            stats_precision=stats_precision, precondition_precision=precondition_precision,
            host_decomposition_max_dim=host_decomposition_max_dim,
            decomposition_streams=decomposition_streams, cuda_graphs=cuda_graphs)
        cfg = self.options
        self.comm = comm if comm is not None else world()
        self.schedules = cfg.schedules
        self.grad_scaler = grad_scaler
        self.steps = 0
        self._closed = False
        self._unhooked = False  # remove_hooks() (close() too): no statistics any more
        self._renewed_without_factors = False  # the last renewal came before any update
        self._phase_timer: PhaseTimer | None = None

        model = getattr(model, "module", model) if _is_wrapper(model) else model
        self.layers = _register_layers(model, cfg.skip_layers, self.comm.rank, cfg.kfac_approx)
        if not self.layers:
            raise ValueError("the model has no layer K-FAC can precondition "
                             "(nn.Linear / nn.Conv2d / nn.Embedding with trainable weights)")
        self.dims = {n: (c.a_dim, c.g_dim) for n, c in self.layers.items()}
        self.device = _layers_device(self.layers)
        self.factor_dtype = factor_dtype or _default_factor_dtype(self.layers)
        self.stats_precision = resolve_precision(
            cfg.stats_precision, device_type=self.device.type,
            dtype=dtype_name(self.factor_dtype) or "")
        self.precondition_precision = resolve_precision(
            cfg.precondition_precision, device_type=self.device.type,
            dtype=dtype_name(inv_dtype) or "")
        self._agree_on_layout(model)

        cost = decomposition_cost(low_rank, low_rank_min_dim)
        self.placement: Placement = place(
            self._layer_shapes(model), self.comm.size,
            grad_workers_for(cfg.strategy, self.comm.size, cfg.grad_worker_fraction),
            cost=cost, local_threshold=cfg.local_decomposition_threshold,
            layer_cost=partial(self._owner_work, cost=cost)
            if cfg.strategy == "dp-kfac" and shape else None)
        self.worker_comm, self.receiver_comm = self._group_communicators()

        # the parts, each built once (docs/design.md, "kfac — the parts")
        self.store, self.pipeline, self.factor_update = self._factor_parts()
        self.capture = self.factor_update.capture
        self.decomposer, self.decomps, self.renewal = self._decomposition_parts()
        self.gradient_exchange = GradientExchange(self.receiver_comm, self.placement, self.dims,
                                                  dtype=cfg.inv_dtype, device=self.device)
        self.replica_exchange = ReplicaExchange(self.worker_comm, self.placement, self.dims,
                                                self.comm.rank)
        self.stack_groups = self._stack_groups()
        self.step_graph = self._step_graph()
        # the learning rate and KL bound a captured step reads (made at its first use)
        self._graph_scalars: Tensor | None = None
        # each layer's weight and own parameters (in model order), for the graph's key: fixed
        # at construction, as an optimizer's parameters are
        # (the parameters step() writes: a frozen bias is not among them)
        self._graph_layers = [(curv.module.weight, tuple(p for p, _ in curv.grad_targets(
            torch.empty(curv.g_dim, curv.a_dim, device="meta")))) for curv in self.layers.values()]

    def _factor_parts(self) -> tuple[FactorStore, FactorPipeline | None, FactorUpdate]:
        """Build the factor side: the store, ``overlap``'s pipeline, the factor update."""
        cfg, p, rank, keys = self.options, self.placement, self.comm.rank, factor_keys(self.dims)
        captured = {n: c for n, c in self.layers.items()
                    if cfg.sends_factors or p.factor_owner[FactorKey(n, "A")] == rank}
        store = FactorStore(  # owned factors, and replicas of local ones of my layers
            {key: factor_dim(self.dims, key) for key in keys if p.factor_owner[key] == rank
             or (key in p.local_factors and p.is_grad_worker(key.layer, rank))},
            [key for key in keys if p.factor_owner[key] == rank],
            [FactorKey(n, f) for n in captured for f in FACTORS],
            deferred=cfg.deferred, rank=rank, dtype=self.factor_dtype, device=self.device)
        pipeline = self._pipeline() if cfg.overlap else None
        update = FactorUpdate(
            self.comm, captured, store, FactorExchange(
                self.comm, p, self.dims, symmetric_packing=cfg.symmetric_packing,
                dtype=self.factor_dtype, device=self.device, pipeline=pipeline),
            self.dims, reduce=cfg.sends_factors and (self.comm.size > 1 or cfg.overlap),
            deferred=cfg.deferred, accumulation_steps=cfg.accumulation_steps,
            grad_scaler=self.grad_scaler, precision=self.stats_precision,
            active=lambda: self._is_factor_step(self.steps),
            warn_unfired=rank == 0 or not cfg.sends_factors,
            own_layers_only=not cfg.sends_factors and self.comm.size > 1)
        return store, pipeline, update

    def _decomposition_parts(self) -> tuple[Decomposer, Decompositions, Renewal]:
        """Build the decomposition side: compute method, decompositions, their renewal."""
        cfg = self.options
        decomposer = make_decomposer(
            compute_method=cfg.compute_method, low_rank=cfg.low_rank,
            low_rank_min_dim=cfg.low_rank_min_dim, low_rank_energy=cfg.low_rank_energy,
            low_rank_remainder=cfg.low_rank_remainder, eigen_refresh=cfg.eigen_refresh,
            damping=self.schedules.damping, dtype=cfg.inv_dtype, device=self.device,
            precision=self.precondition_precision,
            placement=cfg.solve_placement)
        decompositions = Decompositions(
            self.comm, DecompositionExchange(self.worker_comm, self.placement, self.dims,
                                             decomposer, self.comm.rank, dtype=cfg.inv_dtype,
                                             device=self.device),
            decomposer, self.store, self.placement.local_factors)
        return decomposer, decompositions, make_renewal(cfg.decomposition_lag, self.device)

    def _stack_groups(self) -> list[tuple[str, ...]]:
        """This rank's layers preconditioned as stacks, by gradient layout.

        Only on the device types of :data:`~kfac_hpc.kfac.stacked.STACKED_DEVICES`; a
        group whose decompositions the decomposer does not stack (low rank, inverse)
        is preconditioned layer by layer at each step.
        """
        if self.device.type not in stacked.STACKED_DEVICES:
            return []
        return stack_groups({n: c for n, c in self.layers.items()
                             if self.placement.is_grad_worker(n, self.comm.rank)})

    def _pipeline(self) -> FactorPipeline:
        """``overlap``'s buckets of non-local factors in the order the hooks fill them."""
        p, sent = self.placement, [k for k in readiness_order(self.dims)
                                   if k not in self.placement.local_factors]
        return FactorPipeline(
            self.comm, sent, {k: p.factor_owner[k] for k in sent},
            {k: factor_wire_numel(factor_dim(self.dims, k), self.options.symmetric_packing)
             for k in sent},
            cap_bytes=int(self.options.bucket_cap_mb * 2**20), dtype=self.factor_dtype,
            device=self.device)

    def _agree_on_layout(self, model: nn.Module) -> None:
        """Agree on the layers and message options before any message.

        What shapes the messages is agreed before any of them (with the replica check, or one
        16-byte allreduce).
        """
        layout = {**self.options.message_settings(self.factor_dtype),
                  "kfac layers": tuple((n, c.a_dim, c.g_dim) for n, c in self.layers.items())}
        if self.options.check_replicas:
            replicas.check_replicas(model.named_parameters(), self.comm, settings=layout)
        else:
            self.comm.agree(sorted(layout.items()), "K-FAC's layers and message options",
                            hint="register the same layers (skip_layers, requires_grad) and "
                                 "pass the same options on every rank")

    def _layer_shapes(self, model: nn.Module) -> list[LayerShape]:
        """Return the layers' factor dimensions and statistics rows per update.

        Factor dimensions, and statistics rows per update when ``input_shape`` is known
        (DP-KFAC balances them: each owner computes its layers' statistics).
        """
        rows: dict[int, int] = {}
        shape = self.options.input_shape
        if shape is not None and self.options.strategy == "dp-kfac":
            batch, *sample = shape
            rows = {key: batch * r for key, r in rows_per_sample(
                model, [c.module for c in self.layers.values()], sample).items()}
        return [LayerShape(n, c.a_dim, c.g_dim, rows.get(id(c.module), 0))
                for n, c in self.layers.items()]

    def _owner_work(self, layer: LayerShape, cost: Callable[[int], float]) -> float:
        s = self.schedules
        return work_per_step(layer, compute_method=self.options.compute_method,
                             factor_update_steps=max(1, int(s.factor_update_steps(0))),
                             inv_update_steps=max(1, int(s.inv_update_steps(0))), cost=cost)

    # ------------------------------------------------------------------ the step
    @torch.no_grad()
    def step(self) -> None:
        """Precondition the gradients of every registered layer (call after backward)."""
        k = self.steps
        if self._closed:
            raise RuntimeError("KFACPreconditioner.step() after close(); build a new one")
        if self._unhooked:
            raise RuntimeError("KFACPreconditioner.step() after remove_hooks(): it captures "
                               "no statistics any more; build a new one")
        self._check_device()
        folds = self._is_factor_step(k)
        folds_last = folds and self._folds_after_preconditioning(k)
        if folds and not folds_last:
            self._update_factors(k)
        self._renew_decompositions(k)
        try:
            write = self._precondition(k)
        except BaseException:
            if folds_last:  # the step is not applied
                self.factor_update.discard()
            raise
        if folds_last:
            self._update_factors(k)
        write()
        self.steps += 1

    def _precondition(self, k: int) -> Callable[[], None]:
        """Precondition, share and clip the gradients; return what writes them to ``.grad``.

        From the step's graph where it replays (the results wait in its buffers), else
        eagerly.
        """
        lr = self.schedules.lr(k)
        kl_clip = None if self.schedules.kl_clip is None else self.schedules.kl_clip(k)
        write = None if self.step_graph is None else self._replayed(k, lr, kl_clip)
        if write is not None:
            return write
        mine, stacks = self._precondition_my_layers(k)
        updates = self.gradient_exchange.share(mine)
        # the stacks are this step's updates themselves unless the exchange copied them
        return partial(self._apply, updates, () if self.gradient_exchange.needed else stacks,
                       lr, kl_clip)

    # ------------------------------------------------------------- step graph
    def _step_graph(self) -> StepGraph | None:
        """The step's graph with ``cuda_graphs`` (none where gradients are exchanged)."""
        if not step_graph.wanted(self.options.cuda_graphs, self.device):
            return None
        graph = StepGraph(self.device,  # raises off CUDA
                          max_buffer_bytes=step_graph.buffer_budget(self.options.cuda_graphs,
                                                                    self.device))
        if self.gradient_exchange.needed:
            if self.options.cuda_graphs is None:  # the default: no graph, silently
                return None
            log.warning("cuda_graphs: preconditioned gradients are exchanged between ranks "
                        "(%s with %d gradient workers per layer), so K-FAC's steps run without "
                        "a graph", self.options.strategy, self.placement.grad_workers)
            return None
        return graph

    @timed(Phase.KFAC_PRECONDITION)
    def _replayed(self, k: int, lr: float, kl_clip: float | None
                  ) -> Callable[[], None] | None:
        """Run the step's preconditioning from its graph if it may; what writes the results.

        The results wait in the graph's buffers; None: the step runs eagerly.

        The key (:class:`GraphKey`): the decompositions'
        generation, the damping, which layer parameters have a gradient (in model
        order) and whether the KL clip is on. A layer with a weight gradient but none
        for its bias runs eagerly (the step creates the bias's ``.grad``), and the graph
        held is released: the eager step may rebuild the solves it captured (another
        damping), which the generation would not show.
        """
        graph = self.step_graph
        assert graph is not None
        if graph.disabled is not None:
            return None
        candidates: list[Tensor] = []
        for weight, own in self._graph_layers:
            if weight.grad is not None and any(p.grad is None for p in own):
                graph.release()
                return None
            candidates += own
        key = GraphKey(self.decomps.generation, float(self.schedules.damping(k)),
                       tuple(None if p.grad is None else p.grad.dtype for p in candidates),
                       kl_clip is not None)
        scalars = self._graph_scalars
        if scalars is None:
            scalars = self._graph_scalars = torch.zeros(2, dtype=torch.float64,
                                                        device=self.device)
        values = torch.tensor([lr, 0.0 if kl_clip is None else kl_clip], dtype=torch.float64)
        params = [p for p in candidates if p.grad is not None]
        if not graph.run(key, params, partial(self._graph_body, k, scalars[0],
                                              None if kl_clip is None else scalars[1]),
                         partial(scalars.copy_, values, non_blocking=True)):
            return None
        return partial(graph.write_out, params)

    def _graph_body(self, k: int, lr: Tensor, kl_clip: Tensor | None) -> None:
        """The captured work: precondition, clip and write to ``.grad`` (untimed)."""
        timer = self._phase_timer
        enabled = timer is not None and timer.enabled
        if timer is not None:
            timer.enabled = False  # its device synchronisations cannot be captured
        try:
            mine, stacks = self._precondition_my_layers(k)
            self._apply(mine, stacks, lr, kl_clip)
        finally:
            if timer is not None:
                timer.enabled = enabled

    def _update_factors(self, k: int) -> None:
        self.factor_update.update(k, self.schedules.factor_decay(k))

    def _folds_after_preconditioning(self, k: int) -> bool:
        """Whether factor step ``k`` folds its statistics after preconditioning.

        When nothing in the step reads the new factors (no decomposition renewed,
        installed or restored) and no factor travels, the fold waits until the gradients
        are preconditioned and shared: its finiteness read (a device synchronisation on
        a GPU) then waits while the precondition kernels run, instead of stalling the
        host before they are queued. The numbers are the same, and so is a failure:
        ``.grad`` and the factors are untouched when it raises.
        """
        return (not self.factor_update.sends_factors and not self._is_inverse_step(k)
                and self.decomps.decomposed_at is not None  # None: first step, or a load
                and not self.renewal.due(k, False)
                and not self._renewed_without_factors)  # renews after this step's fold

    # ----------------------------------------------------------- decompositions
    def _renew_decompositions(self, k: int) -> None:
        """Renew the decompositions when due (inverse steps, after a load).

        Install a background renewal whose step has come, restore loaded
        decompositions, and renew at inverse steps (now, or started in the background).
        """
        inverse, renewal = self._is_inverse_step(k), self.renewal
        if renewal.due(k, inverse):
            renewal.install(self.decomps, k)
        # after a load, the stored (stale) decompositions are what an uninterrupted run
        # uses now: restored instead of recomputed (with a lag, until the background
        # update started at this inverse step is installed; with a subspace refresh, as
        # the bases this inverse step refreshes)
        self.decomps.restore_loaded(k, use=not inverse or renewal.lagged
                                    or self.decomps.decomposer.reads_previous)
        # the decompositions in place were made before any factor update (every update so
        # far an AMP overflow): renewed at the first step that updates the factors, not at
        # the next inverse step (all ranks alike: the updates are agreed)
        first_statistics = self._renewed_without_factors and self.factor_update.folds > 0
        if inverse or self.decomps.decomposed_at is None or first_statistics:
            self.factor_update.at_inverse_step()
            renewal.renew(self.decomps, k)
            self._renewed_without_factors = self.factor_update.folds == 0

    # ------------------------------------------------------------ preconditioning
    @timed(Phase.KFAC_PRECONDITION)
    def _precondition_my_layers(self, k: int) -> tuple[dict[str, Tensor], list[Stack]]:
        """The preconditioned gradients of the layers this rank is a gradient worker of.

        Layers without a weight gradient this step are skipped. The layers of a stack
        group (:attr:`stack_groups`) are preconditioned together where the decomposer
        stacks their decompositions; the others, and every layer elsewhere, one by one.

        Returns:
            The gradients by layer in model order (a stacked layer's is a view of its
            stack), and the stacks.
        """
        damping = self.schedules.damping(k)
        dtype = self.options.inv_dtype
        out: dict[str, Tensor] = {}
        stacks: list[Stack] = []
        done: set[str] = set()
        for group in self.stack_groups:
            present = [self.layers[n].module.weight.grad is not None for n in group]
            joint = self.decomps.stacked_solve(group, damping) if any(present) else None
            if joint is None:  # layer by layer below
                continue
            grads = stack_grads([self.layers[n] for n in group], dtype)
            stack = Stack(group, joint(grads), grads)
            stacks.append(stack)
            rows = stack.values.unbind(0)  # one operator for the stack's views
            out.update((n, rows[i]) for i, n in enumerate(group) if present[i])
            done.update(group)
        for name, curv in self.layers.items():
            if name in done or not self.placement.is_grad_worker(name, self.comm.rank) \
                    or curv.module.weight.grad is None:
                continue
            solve = self.decomps.solve(name, damping)  # kept between inverse updates
            if solve is not None:
                out[name] = solve(curv.grad_matrix(dtype))
        return ({name: out[name] for name in self.layers if name in out} if stacks else out,
                stacks)

    def _apply(self, updates: Mapping[str, Tensor], stacks: Iterable[Stack],
               lr: float | Tensor, kl_clip: float | Tensor | None) -> None:
        """Clip by KL and write the preconditioned gradients to ``.grad``.

        Every rank scales all preconditioned gradients by the same ν
        (:func:`~kfac_hpc.kfac.linalg.kl_clip_factor`: on a GPU computed and applied on
        the device, no host sync; one multi-tensor multiply) and writes them to ``.grad``
        (one multi-tensor copy). ``Σ ⟨V, ∇W̄⟩`` is one float64 product and sum per
        stack (``stacks``: of this step's ``updates``), one per layer elsewhere.

        Args:
            updates: The preconditioned gradients by layer.
            stacks: The stacks ``updates`` are views of.
            lr: The step's learning rate (a device tensor in a captured step).
            kl_clip: The step's KL bound (likewise), or ``None``: no clipping.
        """
        stacks = list(stacks)
        of_stack = {name: i for i, stack in enumerate(stacks) for name in stack.layers}
        inner: Tensor | None = None  # Σ ⟨V, ∇W̄⟩ in float64, read from .grad directly
        if kl_clip is not None:
            counted: set[int] = set()  # the stacks summed (at their first layer)
            for name, v in updates.items():
                i = of_stack.get(name)
                if i in counted:
                    continue
                if i is not None:
                    counted.add(i)
                term = stacks[i].inner64() if i is not None else self.layers[name].grad_dot(v)
                if term is not None:
                    inner = term if inner is None else inner + term
        if inner is not None and kl_clip is not None:
            nu = linalg.kl_clip_factor(inner, lr, kl_clip)
            if isinstance(nu, Tensor) or nu != 1.0:
                linalg.scale_in_place([s.values for s in stacks] + [
                    v for name, v in updates.items() if name not in of_stack], nu)
        write_grads(pair for name, v in updates.items()
                    for pair in self.layers[name].grad_targets(v))

    # ------------------------------------------------------------------ helpers
    def _check_device(self) -> None:
        """The model must stay where it was when the preconditioner was built."""
        weight = next(iter(self.layers.values())).module.weight
        if weight.device != self.device:
            raise RuntimeError(
                f"the model moved to {weight.device} after the KFACPreconditioner was built on "
                f"{self.device}; build it after model.to(device)")

    def _is_factor_step(self, k: int) -> bool:
        return k % int(self.schedules.factor_update_steps(k)) == 0

    def _is_inverse_step(self, k: int) -> bool:
        return k % int(self.schedules.inv_update_steps(k)) == 0

    def _group_communicators(self) -> tuple[Communicator, Communicator]:
        """Sub-communicators of KAISA's grid (the world itself where a group spans it)."""
        p, rank = self.placement, self.comm.rank
        worker = self.comm if p.n_groups == 1 else self.comm.split(
            p.worker_group_of_rank(rank), name="grad-workers")
        receiver = self.comm if p.grad_workers == 1 else self.comm.split(
            p.receiver_group_of_rank(rank), name="receivers")
        return worker, receiver

    # ---------------------------------------------------------------- settings
    @property
    def phase_timer(self) -> PhaseTimer | None:
        """The timer of the phases the parts declare (:mod:`kfac_hpc.phases`), or None."""
        return self._phase_timer

    @phase_timer.setter
    def phase_timer(self, timer: PhaseTimer | None) -> None:
        self._phase_timer = timer
        for part in (self.factor_update, self.store, self.decomps, self.gradient_exchange):
            part.phase_timer = timer

    @property
    def strategy(self) -> Strategy:
        """The strategy in use (``"auto"`` resolved)."""
        return self.options.strategy

    @property
    def compute_method(self) -> ComputeMethod:
        """``"eigen"`` or ``"inverse"``."""
        return self.options.compute_method

    @property
    def kl_clip(self) -> Schedule | None:
        """The KL-clip schedule (``None``: no clipping)."""
        return self.schedules.kl_clip

    @property
    def local_averages(self) -> dict[FactorKey, LocalAverage]:
        """``factor_sync="inverse"``: this rank's local averages by factor."""
        return self.store.local_averages

    def config(self) -> dict[str, Any]:
        """The settings, JSON-able (schedules are shown as ``"<schedule>"``)."""
        return self.options.to_json(
            grad_workers=self.placement.grad_workers, world_size=self.comm.size,
            factor_dtype=self.factor_dtype, stats_precision=self.stats_precision,
            precondition_precision=self.precondition_precision)

    # ---------------------------------------------------------------- state
    # The checkpoint boundary: factors by name ("<layer>/A"), as in state_dict() and HDF5.
    def factor_keys(self) -> list[str]:
        """Every factor's name in model order (``"<layer>/A"``, ``"<layer>/G"``)."""
        return [key.name for key in factor_keys(self.dims)]

    def factor_owner(self, key: str | FactorKey) -> int:
        """The rank that holds factor ``key`` under the current world size and strategy."""
        return self.placement.factor_owner[_as_key(key)]

    def factor_shape(self, key: str | FactorKey) -> tuple[int, int]:
        """The shape ``(n, n)`` of factor ``key``."""
        n = factor_dim(self.dims, _as_key(key))
        return (n, n)

    @property
    def factors(self) -> dict[str, FactorState]:
        """The factors this rank holds (owned, plus replicas of local ones), by name."""
        return {key.name: state for key, state in self.store.states.items()}

    @property
    def decompositions(self) -> dict[str, dict[str, Tensor]]:
        """Return the decompositions this rank holds, by factor name.

        The current decompositions this rank holds (``{"Q", "lambda"}`` or
        ``{"inv"}``), by factor name.
        """
        return {key.name: parts for key, parts in self.decomps.held.items()}

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

        With ``decomposition_lag`` it is collective too: a renewal still running in the
        background is installed first (its broadcast and agreement run here), in the
        saving run as in the resumed one. So a run that saves between a renewal's start
        and its step ``k + L`` uses it earlier than a run that does not save: the
        resumed run equals the saving run, not one that never saved.
        """
        self.factor_update.flush()
        # a pending background update is installed now, in the saving run as in the resumed
        self.renewal.install(self.decomps, self.steps)
        store = self.store.state_dict()
        state: KFACStateDict = {"step": self.steps, "factors": store["factors"],
                                 "factor_updates": store["factor_updates"],
                                 "config": self.config()}
        if "history" in store:  # every rank's: which factors were updated before
            state["history"] = store["history"]
        if eigenbases:
            state["eigenbases"] = self.decomps.stored(self.store.owned_keys)
        return state

    def load_state_dict(self, state: KFACStateDict) -> None:
        """Take the factors this rank owns from ``state`` (which may hold more).

        Collective (every rank calls it): ranks agree on errors before anything changes
        (the same failure on every rank, nothing half-loaded), and owners of local (small)
        factors send them to the layer's other gradient workers.
        """
        problem = self.store.load_problem(state)
        # every rank decides together before anything collective or anything is changed
        if self.comm.any(problem is not None):
            raise problem if problem is not None else RuntimeError(
                "load_state_dict failed on another rank (see its message); nothing loaded")
        self.renewal.cancel()  # superseded by the loaded state (a refused load keeps it)
        self.store.load_state_dict(state)
        if int(state["step"]) > 0:  # the factors come with the state
            self.factor_update.folds = max(self.factor_update.folds, 1)
        self._renewed_without_factors = False
        self.replica_exchange.share(self.store)
        self.steps = int(state["step"])
        unfit = self.decomps.load(state.get("eigenbases") or {}, self.store.owned())
        if unfit:
            log.info("K-FAC: the stored decompositions of %s do not fit this preconditioner's "
                     "settings (compute_method / low_rank); recomputed at the next step",
                     ", ".join(unfit))

    # ----------------------------------------------------------- introspection
    def memory_bytes(self) -> dict[str, int]:
        """Bytes of K-FAC state held by this rank.

        Factors, decompositions, and what the layers' kept solves hold beyond them
        (``"solves"``: low-rank layers' scaled bases and cores, built at their first step
        after an inverse update), and with ``cuda_graphs`` the step graph's gradient
        buffers (``"graph buffers"``; its pool's intermediates are not counted).
        """
        mem = {"factors": self.store.memory_bytes(),
               "decompositions": self.decomps.memory_bytes(),
               "solves": self.decomps.solve_bytes()}
        if self.step_graph is not None:
            mem["graph buffers"] = self.step_graph.buffer_bytes()
        return mem

    def describe(self) -> str:
        """Registered layers, factor sizes, owners and this rank's memory."""
        p, o = self.placement, self.options
        low = "" if o.low_rank is None else (
            f", low_rank={o.low_rank} for factors >= {o.low_rank_min_dim}"
            + ("" if o.low_rank_energy is None else f", energy {o.low_rank_energy}"))
        head = (f"KFACPreconditioner(strategy={o.strategy}, ranks={self.comm.size}, "
                f"grad_workers={p.grad_workers}, method={o.compute_method}{low})")
        rows = [f"  {'layer':<28} {'A':>6} {'G':>6}  owners(A,G)  group"]
        for name, c in self.layers.items():
            a, g = (f"{d}{'~' if self.decomposer.is_approximate(d) else ''}"
                    for d in (c.a_dim, c.g_dim))
            rows.append(f"  {name:<28} {a:>6} {g:>6}  "
                        f"{p.factor_owner[FactorKey(name, 'A')]:>4},"
                        f"{p.factor_owner[FactorKey(name, 'G')]:<6}  "
                        f"{p.layer_group[name]:>5}")
        mem = self.memory_bytes()
        rows.append(f"  rank {self.comm.rank}: factors {mem['factors'] / 2**20:.2f} MiB, "
                    f"decompositions {mem['decompositions'] / 2**20:.2f} MiB")
        return "\n".join([head, *rows])

    def __repr__(self) -> str:
        """:meth:`describe`."""
        return self.describe()

    def remove_hooks(self) -> None:
        """Detach from the model (the preconditioner can no longer step)."""
        self.capture.remove()
        self._unhooked = True

    def close(self) -> None:
        """Detach from the model and free the sub-communicators this preconditioner made.

        Collective (every rank calls it; MPI frees communicators together); idempotent.
        The preconditioner can no longer step.
        """
        self.remove_hooks()
        self.renewal.cancel()
        if self.step_graph is not None:
            self.step_graph.release()
        for sub in {id(c): c for c in (self.worker_comm, self.receiver_comm)}.values():
            if sub is not self.comm:
                sub.free()
        self.worker_comm = self.receiver_comm = self.comm
        self._closed = True


def _resolve_auto(model: nn.Module, comm: Communicator,
                  profile: Profile | str | os.PathLike[str] | None,
                  **options: Any) -> tuple[Strategy, float | None]:
    """strategy='auto': the planner's fastest exact strategy (collective).

    Rank 0 plans (its profile, its model) and sends the choice to the others, or the
    reason it could not plan, which every rank then raises alike (a profile that one
    rank cannot read never leaves the others waiting in the next collective).

    Raises:
        ValueError: Rank 0 could not plan (the message names its error).
    """
    from kfac_hpc.plan.auto import resolve_auto

    model = getattr(model, "module", model) if _is_wrapper(model) else model
    outcome: tuple[Strategy, float | None] | str | None = None
    error: Exception | None = None
    if comm.rank == 0:
        try:
            strategy, fraction, best, _ = resolve_auto(model, comm.size, profile=profile,
                                                       **options)
        except Exception as exc:  # sent on, raised by every rank
            error, outcome = exc, f"{type(exc).__name__}: {exc}"
        else:
            outcome = (cast(Strategy, strategy), fraction)
            if best is None:
                log.info("K-FAC strategy='auto': one rank, using comm-opt")
            else:
                log.info("K-FAC strategy='auto' chose %s on %d ranks (profile %s): predicted "
                         "%.4f s/iteration, %.1f MiB K-FAC traffic per rank per step",
                         best.options.label(), comm.size, best.profile, best.total_s,
                         best.kfac_bytes / 2**20)
    if comm.size > 1:
        outcome = comm.broadcast_object(outcome)
    if isinstance(outcome, str) or outcome is None:
        raise ValueError(f"K-FAC strategy='auto': rank 0 could not plan: {outcome}; give "
                         "a concrete strategy, or fix the plan profile") from error
    assert outcome[0] in STRATEGIES
    return outcome


def _as_key(key: str | FactorKey) -> FactorKey:
    return key if isinstance(key, FactorKey) else FactorKey.parse(key)


def _is_wrapper(model: nn.Module) -> bool:
    from torch.nn.parallel import DistributedDataParallel

    return isinstance(model, DistributedDataParallel)


def _register_layers(model: nn.Module, skip: tuple[str, ...], rank: int,
                     approx: ApproxOption) -> dict[str, LayerCurvature]:
    layers, skipped = register_layers(model, skip, approx=approx)
    if skipped and rank == 0:
        log.info("K-FAC skips %d layer(s): %s", len(skipped), "; ".join(skipped))
        tied = [s for s in skipped if TIED in s]
        if tied:
            log.warning("K-FAC leaves layers with tied weights to the base optimizer: %s "
                        "(skip_layers names them to silence this)", "; ".join(tied))
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


def _default_factor_dtype(layers: Mapping[str, LayerCurvature]) -> torch.dtype:
    names = (str(c.module.weight.dtype).removeprefix("torch.") for c in layers.values())
    return cast(torch.dtype, getattr(torch, default_factor_dtype(names)))
