"""Cost model of one training iteration with distributed K-FAC: bytes, time and memory.

Everything here is a pure function of the layer shapes (:class:`ModelSpec`), the
preconditioner's settings (:class:`KFACOptions`), the world size and, for times, a
:class:`~kfac_hpc.plan.profile.Profile`. Placement is the library's own
(:func:`kfac_hpc.kfac.placement.place`), so the owners here are the owners there.

**Bytes** follow :class:`kfac_hpc.comm.TrafficStats` exactly (the size of each message
in the datatype that travels, on every rank, nothing at world size 1):

* factors (at factor steps; with ``factor_sync="inverse"`` at inverse steps): one
  reduce-scatter of ``Σ (w(n) + 1)`` over non-local factors (``w(n) = n²``, or
  ``n(n+1)/2`` with ``symmetric_packing``; the ``+1`` is the ``#count`` element), split
  into buckets with ``overlap``; plus one allreduce of the same over the local (small)
  factors if there are any. DP-KFAC sends none.
* decompositions (at inverse steps, when a layer has more than one gradient worker):
  per non-empty slot of the rank's worker group one broadcast of
  ``Σ (n² + n + 1)`` (eigen: Q, λ, ``#valid``) or ``Σ (n² + 1)`` (inverse); a low-rank
  factor (``low_rank`` cap ``c``) sends ``c·n + c + 3`` (Q, λ, ρ, rank, ``#valid``).
* gradients (every step, when there is more than one worker group): per non-empty
  group one broadcast of ``Σ (g·a + 1)`` inside the receiver group.
* agreement: a 4-byte allreduce at every factor step (every rank's statistics are
  finite) and one at every inverse step (every decomposition succeeded).
* construction: the replica check (:func:`kfac_hpc.comm.replicas.replica_check_bytes`).

**Times** are seconds per iteration, averaged over the factor/inverse update schedule;
per phase, computation is the slowest rank's and communication follows
:mod:`kfac_hpc.plan.collectives`. See :func:`estimate` for the terms.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from functools import cached_property
from typing import Any

import torch

from kfac_hpc.comm.buffers import WIDENED_DTYPES
from kfac_hpc.comm.communicator import AGREE_BYTES
from kfac_hpc.comm.replicas import replica_check_bytes
from kfac_hpc.kfac.decomposer import Decomposer, make_decomposer, message_numel
from kfac_hpc.kfac.layouts import (
    LayerDims,
    bucket_plan,
    decomposition_layout,
    factor_dim,
    factor_layout,
    factor_wire_numel,
    gradient_layout,
    local_factor_layout,
    readiness_order,
)
from kfac_hpc.kfac.lowrank import sketches
from kfac_hpc.kfac.options import (
    APPROXIMATIONS,
    DEFAULT_BUCKET_CAP_MB,
    DEFAULT_LOCAL_THRESHOLD,
    DEFAULT_LOW_RANK_MIN_DIM,
    STRATEGIES,
    conflicts,
    low_rank_cap,
    reduces_factors,
    sends_factors,
)
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
from kfac_hpc.kfac.shapes import lowrank_precondition_flops, randomized_eigh_flops
from kfac_hpc.phases import TRAFFIC_TAGS, Traffic
from kfac_hpc.plan.model_shapes import LayerSpec, ModelSpec
from kfac_hpc.plan.profile import ComputeRates, Profile

__all__ = ["PHASES", "STRATEGIES", "Distribution", "Estimate", "KFACOptions", "StepTraffic",
           "construction_traffic", "estimate", "estimate_sgd", "wire_itemsize"]

PHASES = ("forward", "backward", "grad avg", "factor stats", "factor comm", "decomposition",
          "decomp bcast", "precondition", "grad bcast", "other")
AGREEMENT_BYTES = 4  # one int32: how many ranks report a fault
BYTE_PHASES = TRAFFIC_TAGS  # the library's byte tags (kfac_hpc.phases.Traffic)

# Tensor operations per unit of work (framework overhead = count × op_overhead_s).
# Counted by reading the library's code paths (not measured); they matter only where
# layers are tiny, where calibration (kfac_hpc.plan.calibrate) fits op_overhead_s.
_OPS = {"module_fwd": 1, "module_bwd": 2, "stats_factor": 8, "fold": 3, "wire_factor": 4,
        "decompose": 4, "precondition": 10, "share": 3, "other_layer": 10,
        "collective": 6}

# Memory passes (whole reads or writes of an array) of the code paths :func:`estimate`
# prices at the profile's ``mem_bandwidth``. Counted from the code (torch 2.13, CPU),
# not fitted: the rates are what the profiles measure (kfac_hpc.plan.calibrate).
FP32_BYTES = 4  # parameters, gradients, activations: fp32 in the reference driver
FACTOR_SUM_PASSES = 3  # statistics: write the batch factor, read it, accumulate the sum
RUNNING_AVERAGE_PASSES = 3  # F ← ρF + (1−ρ)B: read F, read B, write F (also local folds)
PACK_PASSES_SYMMETRIC = 3  # symmetric_packing: triangle index gather + copy, vs 1 copy
PRECONDITION_GEMMS = {"eigen": 4, "inverse": 2}  # GEMMs of g x a by g x g / a x a
PRECONDITION_PASSES = 4  # gradient matrix in, bias split, result, write .grad
SHARE_PASSES = 3  # gradient broadcast: pack, unpack, clone
KL_CLIP_PASSES = 8  # ⟨V, ∇W⟩ reads, ν scaling, .grad writes (weight and bias)
OPTIMIZER_PASSES = 3  # SGD with momentum: read grad, update buffer, update weight
MODEL_STATE_COPIES = 3  # weights + gradients + momentum (memory budget)


def wire_itemsize(dtype: str | torch.dtype, reduction: bool) -> int:
    """Return the bytes per element on the wire.

    bf16 (and fp16 without an MPI type) is reduced in fp32 and moved as raw 16-bit words
    (:mod:`kfac_hpc.comm.buffers`).

    Args:
        dtype: A torch dtype or its name (``"bfloat16"``).
        reduction: The collective does arithmetic.

    Returns:
        Bytes per element.
    """
    dt = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    if dt in WIDENED_DTYPES:
        return 4 if reduction else 2
    return int(dt.itemsize)


def _itemsize(dtype: str) -> int:
    return int(getattr(torch, dtype).itemsize)


@dataclass(frozen=True)
class KFACOptions:
    """The preconditioner settings that change cost (names as in ``KFACPreconditioner``).

    Planner-only fields (baselines of published systems; the preconditioner always
    reduce-scatters and posts its decomposition broadcasts before computing):
    ``factor_reduction="allreduce"`` (every rank receives every factor, as D-KFAC and
    SPD-KFAC do) and ``pipelined_broadcasts=False`` (decompositions are broadcast after
    all of them are computed).
    """

    strategy: str = "comm-opt"
    grad_worker_fraction: float | None = None
    compute_method: str = "eigen"
    symmetric_packing: bool = False
    overlap: bool = False
    bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB
    factor_sync: str = "step"
    local_decomposition_threshold: int = DEFAULT_LOCAL_THRESHOLD
    kfac_approx: str = "expand"
    low_rank: int | None = None
    low_rank_energy: float | None = None
    low_rank_min_dim: int = DEFAULT_LOW_RANK_MIN_DIM
    low_rank_remainder: str = "mean"
    factor_update_steps: int = 1
    inv_update_steps: int = 1
    factor_dtype: str = "float32"
    inv_dtype: str = "float32"
    factor_reduction: str = "reduce_scatter"
    check_replicas: bool = True
    pipelined_broadcasts: bool = True

    def problem(self) -> str | None:
        """Say why the preconditioner would reject these options, or return ``None``."""
        if self.strategy not in STRATEGIES:
            return f"unknown strategy {self.strategy!r}"
        if self.kfac_approx not in APPROXIMATIONS:
            return f"kfac_approx must be one of {APPROXIMATIONS}, got {self.kfac_approx!r}"
        if self.factor_reduction not in ("reduce_scatter", "allreduce"):
            return f"unknown factor_reduction {self.factor_reduction!r}"
        problems = conflicts(strategy=self.strategy,
                             grad_worker_fraction=self.grad_worker_fraction,
                             overlap=self.overlap, symmetric_packing=self.symmetric_packing,
                             factor_sync=self.factor_sync, compute_method=self.compute_method,
                             low_rank=self.low_rank, low_rank_energy=self.low_rank_energy,
                             low_rank_min_dim=self.low_rank_min_dim,
                             low_rank_remainder=self.low_rank_remainder)
        return f"{problems[0].option} {problems[0].text()}" if problems else None

    def label(self) -> str:
        """Return a short name, e.g. ``hybrid-opt(1/2)+pack+overlap``."""
        name = self.strategy
        if self.strategy == "hybrid-opt" and self.grad_worker_fraction is not None:
            name += f"({_fraction_text(self.grad_worker_fraction)})"
        extras = [("allreduce" if self.factor_reduction == "allreduce" else ""),
                  ("pack" if self.symmetric_packing else ""),
                  ("overlap" if self.overlap else ""),
                  ("sync@inv" if self.factor_sync == "inverse" else ""),
                  ("inverse" if self.compute_method == "inverse" else ""),
                  ("reduce" if self.kfac_approx == "reduce" else ""),
                  (f"rank{self.low_rank}" if self.low_rank is not None else ""),
                  (f"energy{self.low_rank_energy:g}" if self.low_rank_energy is not None
                   else "")]
        return "+".join([name, *[e for e in extras if e]])

    def preconditioner_kwargs(self) -> dict[str, Any]:
        """Return the keyword arguments of ``KFACPreconditioner`` for these options."""
        if self.factor_reduction != "reduce_scatter" or not self.pipelined_broadcasts:
            raise ValueError("factor_reduction='allreduce' and pipelined_broadcasts=False "
                             "are planner-only baselines")
        kw: dict[str, Any] = {
            "strategy": self.strategy, "compute_method": self.compute_method,
            "symmetric_packing": self.symmetric_packing, "overlap": self.overlap,
            "bucket_cap_mb": self.bucket_cap_mb, "factor_sync": self.factor_sync,
            "local_decomposition_threshold": self.local_decomposition_threshold,
            "kfac_approx": self.kfac_approx, "low_rank": self.low_rank,
            "low_rank_energy": self.low_rank_energy, "low_rank_min_dim": self.low_rank_min_dim,
            "low_rank_remainder": self.low_rank_remainder,
            "factor_update_steps": self.factor_update_steps,
            "inv_update_steps": self.inv_update_steps,
            "factor_dtype": getattr(torch, self.factor_dtype),
            "inv_dtype": getattr(torch, self.inv_dtype), "check_replicas": self.check_replicas}
        if self.grad_worker_fraction is not None:
            kw["grad_worker_fraction"] = self.grad_worker_fraction
        return kw

    def to_json(self) -> dict[str, Any]:
        """Return the options as a JSON-ready dict (field names as keys)."""
        return asdict(self)


def _fraction_text(f: float) -> str:
    inv = 1 / f
    return f"1/{round(inv)}" if abs(inv - round(inv)) < 1e-9 else f"{f:g}"


@dataclass
class StepTraffic:
    """Bytes and calls one rank puts on the counters in one step, by phase."""

    bytes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(BYTE_PHASES, 0))
    calls: dict[str, int] = field(default_factory=lambda: dict.fromkeys(BYTE_PHASES, 0))

    @property
    def total(self) -> int:
        """Bytes of every phase together."""
        return sum(self.bytes.values())

    def add(self, phase: str, nbytes: int, calls: int = 1) -> None:
        """Add ``calls`` calls carrying ``nbytes`` bytes in all to ``phase``."""
        self.bytes[phase] += nbytes
        self.calls[phase] += calls


class Distribution:
    """Who owns, decomposes and sends what, for one model, options and world size.

    ``batch`` (per rank), with a model probed at an input shape, places DP-KFAC layers
    by statistics + decomposition work, as the preconditioner does when it is given
    ``input_shape=(batch, *model.input_shape)`` (the training driver always gives it).
    """

    def __init__(self, model: ModelSpec, options: KFACOptions, world: int,
                 batch: int | None = None) -> None:
        """Place the model's factors and layers as the preconditioner would.

        Args:
            model: The model's K-FAC layers and parameters.
            options: The preconditioner settings.
            world: The number of ranks (>= 1).
            batch: Samples per rank; with a model probed at an input shape, DP-KFAC layers
                are placed by statistics + decomposition work.

        Raises:
            ValueError: The preconditioner would reject ``options``, or ``world`` is below 1.
        """
        problem = options.problem()
        if problem is not None:
            raise ValueError(problem)
        if world < 1:
            raise ValueError(f"world size must be >= 1, got {world}")
        if not model.layers:
            raise ValueError(f"model {model.name!r} has no K-FAC layer")
        self.model, self.options, self.world = model, options, world
        self.grad_workers = grad_workers_for(options.strategy, world,
                                             options.grad_worker_fraction)
        balance = (options.strategy == "dp-kfac" and batch is not None
                   and model.input_shape is not None)
        shapes = [LayerShape(s.name, s.a_dim, s.g_dim,
                             batch * s.rows_per_sample if balance and batch else 0)
                  for s in model.layers]

        cost = decomposition_cost(options.low_rank, options.low_rank_min_dim)

        def owner_work(layer: LayerShape) -> float:
            return work_per_step(layer, compute_method=options.compute_method,
                                 factor_update_steps=options.factor_update_steps,
                                 inv_update_steps=options.inv_update_steps, cost=cost)

        self.placement: Placement = place(shapes, world, self.grad_workers, cost=cost,
                                          local_threshold=options.local_decomposition_threshold,
                                          layer_cost=owner_work if balance else None)
        self.layers: dict[str, LayerSpec] = {s.name: s for s in model.layers}

    # -------------------------------------------------------------- structure
    @property
    def n_groups(self) -> int:
        """The number of gradient-worker groups."""
        return self.placement.n_groups

    def factors(self) -> Iterator[tuple[LayerSpec, str]]:
        """Yield every factor as ``(layer, "A" | "G")``, in model order."""
        for layer in self.model.layers:
            for f in FACTORS:
                yield layer, f

    def is_local(self, layer: LayerSpec, f: str) -> bool:
        """Say whether factor ``f`` of ``layer`` is decomposed on every rank (no owner)."""
        return FactorKey(layer.name, f) in self.placement.local_factors

    def wire_numel(self, n: int) -> int:
        """Return the elements an ``n x n`` factor puts on the wire (:func:`factor_wire_numel`)."""
        return factor_wire_numel(n, self.options.symmetric_packing)

    @cached_property
    def dims(self) -> LayerDims:
        """Return the layers' factor dimensions, as the message layouts take them."""
        return {s.name: (s.a_dim, s.g_dim) for s in self.model.layers}

    @cached_property
    def decomposer(self) -> Decomposer:
        """Return the preconditioner's decomposer for these options (message, state sizes)."""
        o = self.options
        return make_decomposer(compute_method=o.compute_method, low_rank=o.low_rank,
                               low_rank_min_dim=o.low_rank_min_dim,
                               low_rank_energy=o.low_rank_energy)

    @cached_property
    def reduce_numel(self) -> tuple[int, int]:
        """Count the elements of the factor reduce-scatter (non-local) and allreduce (local).

        From the exchange's layouts (:func:`~kfac_hpc.kfac.layouts.factor_layout`).
        """
        sym = self.options.symmetric_packing
        return (sum(factor_layout(self.placement, self.dims, sym).counts()),
                sum(local_factor_layout(self.placement, self.dims, sym).counts()))

    @cached_property
    def buckets(self) -> list[int]:
        """Count the elements of each overlap bucket (readiness order: A fwd, G bwd).

        The buckets are the pipeline's (:func:`~kfac_hpc.kfac.layouts.bucket_plan`).
        """
        order = [k for k in readiness_order(self.dims)
                 if k not in self.placement.local_factors]
        numel = {k: self.wire_numel(factor_dim(self.dims, k)) for k in order}
        plan = bucket_plan(order, numel, int(self.options.bucket_cap_mb * 2**20),
                           _itemsize(self.options.factor_dtype))
        return [sum(numel[k] + 1 for k in bucket) for bucket in plan]

    def low_rank_cap(self, n: int) -> int | None:
        """Return the most eigenpairs an ``n x n`` factor keeps (``None``: all of them)."""
        o = self.options
        return low_rank_cap(n, o.low_rank, o.low_rank_min_dim) if o.compute_method == "eigen" \
            else None

    def decomposition_numel(self, n: int) -> int:
        """Count the elements of one factor's decomposition message piece, ``#valid`` included."""
        return message_numel(self.decomposer, n)

    def decomposition_state_numel(self, n: int) -> int:
        """Count the elements of one held decomposition (``memory_bytes()``; low rank: the cap)."""
        return self.decomposer.held_numel(n)

    @cached_property
    def slot_numel(self) -> list[list[int]]:
        """Count, per worker group and slot, the elements of the decomposition broadcast.

        The exchange's layout (:func:`~kfac_hpc.kfac.layouts.decomposition_layout`).
        """
        return [decomposition_layout(self.placement, self.dims, self.decomposer, group).counts()
                for group in range(self.n_groups)]

    @cached_property
    def group_grad_numel(self) -> list[int]:
        """Count, per worker group, the elements of its preconditioned-gradient broadcast.

        The exchange's layout (:func:`~kfac_hpc.kfac.layouts.gradient_layout`).
        """
        return gradient_layout(self.placement, self.dims).counts()

    def group_of(self, rank: int) -> int:
        """Return the gradient-worker group of ``rank``."""
        return self.placement.worker_group_of_rank(rank)

    # -------------------------------------------------------------- schedule
    def is_factor_step(self, step: int) -> bool:
        """Say whether factors are updated at ``step`` (0-based)."""
        return step % self.options.factor_update_steps == 0

    def is_inverse_step(self, step: int) -> bool:
        """Say whether decompositions are recomputed at ``step`` (0-based; always at step 0)."""
        return step == 0 or step % self.options.inv_update_steps == 0

    def reduces_factors(self, step: int) -> bool:
        """Say whether factors travel at ``step`` (depends on the strategy and ``factor_sync``)."""
        return reduces_factors(self.options.strategy, self.options.factor_sync,
                               factor_step=self.is_factor_step(step),
                               inverse_step=self.is_inverse_step(step))

    def period(self) -> list[tuple[bool, bool]]:
        """List (factor step, inverse step) of every step of one steady-state period."""
        f, i = self.options.factor_update_steps, self.options.inv_update_steps
        length = math.lcm(f, i)
        if length > 100_000:
            raise ValueError(f"update steps {f}, {i}: period {length} is too long to average")
        return [(k % f == 0, k % i == 0) for k in range(length, 2 * length)]

    # -------------------------------------------------------------- bytes
    def step_traffic(self, step: int, rank: int) -> StepTraffic:
        """Return exactly what rank ``rank``'s counters gain in step ``step`` (0-based).

        Args:
            step: The step, counted from 0.
            rank: The rank.

        Returns:
            Bytes and calls by phase.
        """
        return self.kind_traffic(self.is_factor_step(step), self.is_inverse_step(step),
                                 rank, reduce=self.reduces_factors(step))

    def kind_traffic(self, factor: bool, inverse: bool, rank: int,
                     reduce: bool | None = None) -> StepTraffic:
        """Return the traffic of a step that does (or not) factor and inverse updates.

        Args:
            factor: A factor step.
            inverse: An inverse step.
            rank: The rank whose counters are predicted.
            reduce: Whether factors travel (default: whenever ``factor``).

        Returns:
            Bytes and calls by phase.
        """
        out = StepTraffic()
        o, p = self.options, self.world
        if p == 1:
            return out
        if reduce is None:
            reduce = reduces_factors(o.strategy, o.factor_sync, factor_step=factor,
                                     inverse_step=inverse)
        if reduce:
            fsize = wire_itemsize(o.factor_dtype, reduction=True)
            rs, ar = self.reduce_numel
            if o.factor_reduction == "allreduce":
                out.add(Traffic.FACTORS, (rs + ar) * fsize,
                        len(self.buckets) + bool(ar) if o.overlap else 1)
            else:
                if o.overlap:
                    out.add(Traffic.FACTORS, rs * fsize, len(self.buckets))
                else:
                    out.add(Traffic.FACTORS, rs * fsize, 1)
                if ar:
                    out.add(Traffic.FACTORS, ar * fsize, 1)
        isize = wire_itemsize(o.inv_dtype, reduction=False)
        if inverse and self.grad_workers > 1:
            slots = self.slot_numel[self.group_of(rank)]
            out.add(Traffic.DECOMPOSITIONS, sum(slots) * isize, sum(1 for s in slots if s))
        if self.n_groups > 1:
            groups = self.group_grad_numel
            out.add(Traffic.GRADIENTS, sum(groups) * isize, sum(1 for s in groups if s))
        for agreed in (factor, inverse):  # kfac_hpc.kfac.agree.agree
            if agreed:
                out.add(Traffic.AGREEMENT, AGREEMENT_BYTES, 1)
        return out

    def mean_traffic(self, rank: int) -> dict[str, float]:
        """Return the bytes per step on ``rank`` by phase, averaged over the update schedule."""
        period = self.period()
        total = dict.fromkeys(BYTE_PHASES, 0.0)
        for factor, inverse in period:
            for k, v in self.kind_traffic(factor, inverse, rank).bytes.items():
                total[k] += v / len(period)
        return total

    # -------------------------------------------------------------- memory
    def memory(self, rank: int) -> dict[str, int]:
        """Return the K-FAC state bytes on ``rank`` once every factor has been updated.

        ``factors`` and ``decompositions`` are what ``KFACPreconditioner.memory_bytes()``
        reports; ``local averages`` (``factor_sync="inverse"``, between synchronisations) and
        ``transient`` (batch-factor sums and message buffers at their peak) come on top.

        Args:
            rank: The rank.

        Returns:
            Bytes by kind.
        """
        o, pl = self.options, self.placement
        fb, ib = _itemsize(o.factor_dtype), _itemsize(o.inv_dtype)
        group = self.group_of(rank)
        factors = decomps = local_avg = sums = 0
        captured_all = o.strategy != "dp-kfac"
        for layer, f in self.factors():
            n = layer.dim(f)
            owned = pl.factor_owner[FactorKey(layer.name, f)] == rank
            in_group = pl.layer_group[layer.name] == group
            if (owned or (self.is_local(layer, f) and in_group)
                    or o.factor_reduction == "allreduce"):
                factors += n * n * fb
            if in_group:
                decomps += self.decomposition_state_numel(n) * ib
            captured = captured_all or pl.factor_owner[FactorKey(layer.name, "A")] == rank
            if captured:
                sums += n * n * fb
                if o.factor_sync == "inverse":
                    local_avg += n * n * fb
        rs, ar = self.reduce_numel
        message = (rs + ar) * fb if captured_all else 0
        grads = sum(self.group_grad_numel) * ib if self.n_groups > 1 else 0
        return {"factors": factors, "decompositions": decomps, "local averages": local_avg,
                "transient": sums + max(message, grads)}


def construction_traffic(model: ModelSpec, options: KFACOptions, world: int) -> StepTraffic:
    """Predict the traffic of the preconditioner's constructor.

    The replica check (:func:`kfac_hpc.comm.replicas.check_replicas`): a structure
    digest, the parameter checksums and the outcome; with ``check_replicas=False`` the
    layout agreement only (:meth:`kfac_hpc.comm.Communicator.agree`, 16 bytes); nothing
    at world size 1.

    Args:
        model: The model's parameters.
        options: The preconditioner settings (``check_replicas``).
        world: The number of ranks.

    Returns:
        Bytes and calls under ``"construction"``.
    """
    out = StepTraffic(bytes={"construction": 0}, calls={"construction": 0})
    if world > 1:
        for nbytes in replica_check_bytes(model.param_tensors) if options.check_replicas \
                else [AGREE_BYTES]:
            out.add("construction", nbytes, 1)
    return out


# ====================================================================== time
@dataclass
class Estimate:
    """Predicted cost of one configuration: per-iteration time, bytes and memory per rank."""

    model: str
    options: KFACOptions
    world: int
    batch: int
    profile: str
    time: dict[str, float]  # seconds per iteration by phase (schedule average)
    bytes_per_step: dict[str, float]  # K-FAC bytes per rank per step (max over ranks)
    grad_avg_bytes: int  # gradient averaging per rank per step (DDP/GradientAverager)
    construction_bytes: int
    memory: dict[str, int]  # per rank (max over ranks) by kind, bytes
    model_bytes: int  # weights + gradients + momentum (fp32), for the memory budget

    @property
    def total_s(self) -> float:
        """Seconds per iteration, every phase together."""
        return sum(self.time.values())

    @property
    def kfac_bytes(self) -> float:
        """K-FAC bytes per rank per step, every phase together."""
        return sum(self.bytes_per_step.values())

    @property
    def memory_state(self) -> int:
        """Bytes of K-FAC state per rank: factors, decompositions and local averages."""
        return self.memory["factors"] + self.memory["decompositions"] + self.memory[
            "local averages"]

    @property
    def memory_peak(self) -> int:
        """Peak bytes per rank: K-FAC state, transient buffers, weights, gradients and momentum."""
        return self.memory_state + self.memory["transient"] + self.model_bytes

    def to_json(self) -> dict[str, Any]:
        """Return the estimate as a JSON-ready dict, the derived totals included."""
        return {"model": self.model, "options": self.options.to_json(),
                "label": self.options.label(), "world": self.world, "batch": self.batch,
                "profile": self.profile, "time_s": self.time, "total_s": self.total_s,
                "bytes_per_step": self.bytes_per_step, "kfac_bytes": self.kfac_bytes,
                "grad_avg_bytes": self.grad_avg_bytes,
                "construction_bytes": self.construction_bytes, "memory": self.memory,
                "memory_state": self.memory_state, "memory_peak": self.memory_peak,
                "model_bytes": self.model_bytes}


def _layer_fwd_flops(layer: LayerSpec, batch: int) -> float:
    return 2.0 * batch * layer.rows_per_sample * layer.weight_cols * layer.g_dim


def _training_terms(model: ModelSpec, batch: int, world: int,
                    profile: Profile, leaf_modules: int) -> dict[str, float]:
    """Forward, backward and exposed gradient averaging (shared with S-SGD)."""
    c = profile.compute
    per_module = c.module_overhead_s or 3 * c.op_overhead_s
    fwd = sum(_layer_fwd_flops(s, batch) for s in model.layers) / c.train_flops
    fwd += leaf_modules * per_module / 3
    bwd = 2 * sum(_layer_fwd_flops(s, batch) for s in model.layers) / c.train_flops
    bwd += leaf_modules * per_module * 2 / 3
    avg = 0.0
    if world > 1:
        link = profile.link("allreduce")
        sizes = _grad_buckets(model)
        times = [link.time("allreduce", b, world) for b in sizes]
        copies = 4 * model.param_numel * 4 / c.mem_bandwidth  # flatten + write back
        total = sum(times) + copies + len(sizes) * (_OPS["collective"] * c.op_overhead_s
                                                    + c.sync_overhead_s)
        avg = max(times[-1] if times else 0.0, total - c.overlap_efficiency * bwd)
    return {"forward": fwd, "backward": bwd, "grad avg": avg}


def _grad_buckets(model: ModelSpec, cap_mb: float = 25.0) -> list[int]:
    """Bytes per gradient-averaging bucket (one bucket per 25 MB of fp32 parameters)."""
    total = model.param_numel * 4
    cap = int(cap_mb * 2**20)
    full, rest = divmod(total, cap)
    return [cap] * full + ([rest] if rest else [])


def estimate_sgd(model: ModelSpec, world: int, batch: int, profile: Profile,
                 leaf_modules: int | None = None) -> dict[str, float]:
    """Estimate the seconds per iteration of plain data-parallel SGD (S-SGD), by phase.

    Args:
        model: The model's layers and parameters.
        world: The number of ranks.
        batch: Samples per rank.
        profile: The machine's network and compute parameters.
        leaf_modules: The number of leaf modules, each charged its framework overhead
            (default: the model's own count).

    Returns:
        Seconds by phase.
    """
    prof = profile.at(world)
    leaves = leaf_modules if leaf_modules is not None else model.leaf_modules
    t = _training_terms(model, batch, world, prof, leaves)
    c = prof.compute
    t["other"] = (3 * model.param_numel * 4 / c.mem_bandwidth
                  + model.param_tensors * (c.param_overhead_s or 3 * c.op_overhead_s))
    return t


def estimate(model: ModelSpec, options: KFACOptions, world: int, batch: int,
             profile: Profile, leaf_modules: int | None = None) -> Estimate:
    """Predict an iteration of K-FAC with ``options`` on ``world`` ranks, ``batch`` per rank.

    Terms (``b`` batch, ``R = b·rows`` rows of a layer, ``n`` factor dimension, ``P``
    ranks, compute rates from the profile; phase = slowest rank unless said otherwise):

    * forward ``Σ 2R·w·g / train_flops``, backward twice that (+ op overhead per module);
      gradient averaging: allreduce of every fp32 parameter in 25 MB buckets, minus what
      ``overlap_efficiency`` hides behind backward (never less than the last bucket);
    * factor statistics (factor steps, captured layers): ``2R(a² + g²) / gemm_flops``
      plus row copies ``R(a + 2g)·4 B / mem_bandwidth`` and, for Conv2d, the patch matrix
      ``R·w·4 B / im2col_bandwidth``;
    * factor communication: the reduce-scatter/allreduce of :meth:`Distribution.kind_traffic`,
      each bucket ``α–β`` priced; with ``overlap`` the part ``overlap_efficiency ·
      (backward + statistics)`` is hidden (never less than the last bucket);
    * decomposition (inverse steps): per rank the sum of its decompositions
      (eigh/inverse table of the profile); broadcasts: each worker group's network serves
      the roots in the order they finish (pipelined) with weight ``overlap_efficiency``,
      else after the slowest rank, one after the other (serial);
    * preconditioning: eigen ``4(g²a + ga²)``, inverse ``2(g²a + ga²)`` flops per layer
      the rank is a gradient worker of; gradient broadcasts summed over groups;
    * other: running averages ``3n²`` elements per owned factor, KL clipping and
      ``.grad`` writes ``≈ 8·g·a·4 B`` per layer, the SGD update ``3·params·4 B``.

    Every term adds ``op_overhead_s`` per tensor operation and every collective call
    ``sync_overhead_s``.

    Args:
        model: The model's K-FAC layers and parameters.
        options: The preconditioner settings.
        world: The number of ranks.
        batch: Samples per rank.
        profile: The machine's network and compute parameters.
        leaf_modules: The number of leaf modules, each charged its framework overhead
            (default: the model's own count).

    Returns:
        Seconds per iteration by phase, bytes per step, construction bytes and memory
        per rank.

    Raises:
        ValueError: The preconditioner would reject ``options``.
    """
    ctx = _Context.of(model, options, world, batch, profile, leaf_modules)
    # one step of the preconditioner, phase by phase (KFACPreconditioner.step())
    stats = _factor_statistics_s(ctx)  # 1. factor update: hooks capture statistics
    folds = _local_folds_s(ctx)  # 1'. factor_sync="inverse": fold into local averages
    reduction = _factor_reduction_s(ctx, hidden_behind=ctx.base["backward"] + stats)
    averages = _running_averages_s(ctx)  # 1. owners update the running averages
    decompose = _decompositions_s(ctx)  # 2. inverse update: owners decompose ...
    decomp_bcast = _decomposition_broadcasts_s(ctx, decompose)  # ... and broadcast
    precondition = _precondition_s(ctx)  # 3. gradient workers precondition ...
    grad_bcast = _gradient_broadcasts_s(ctx)  # ... and send to their receiver groups
    other = _other_s(ctx)  # 4. KL clipping, .grad writes, the optimizer's update

    t = _schedule_average(ctx, stats=stats, folds=folds, reduction=reduction,
                          averages=averages, decompose=max(decompose),
                          decomp_bcast=decomp_bcast)
    t["precondition"] = precondition
    t["grad bcast"] = grad_bcast
    t["other"] += other

    d, o = ctx.dist, options
    ranks = range(world)  # per-rank quantities: every rank (cheap enough), the worst one
    traffic = [d.mean_traffic(r) for r in ranks]
    per_step = {k: max(tr[k] for tr in traffic) for k in BYTE_PHASES}
    memories = [d.memory(r) for r in ranks]
    memory = {k: max(m[k] for m in memories) for k in memories[0]}
    return Estimate(
        model=model.name, options=o, world=world, batch=batch, profile=ctx.prof.name, time=t,
        bytes_per_step=per_step,
        grad_avg_bytes=model.param_numel * FP32_BYTES if world > 1 else 0,
        construction_bytes=construction_traffic(model, o, world).total,
        memory=memory, model_bytes=MODEL_STATE_COPIES * model.param_numel * FP32_BYTES)


# ------------------------------------------------------------ estimate: the steps
@dataclass(frozen=True)
class _Context:
    """What every step of :func:`estimate` reads.

    The model, the options, who owns what (:class:`Distribution`), the profile at this
    world size and the shared training terms.
    """

    model: ModelSpec
    options: KFACOptions
    world: int
    batch: int
    prof: Profile
    dist: Distribution
    base: dict[str, float]  # forward, backward, grad avg (shared with S-SGD)
    fb: int  # factor dtype bytes
    ib: int  # decomposition (inv_dtype) bytes

    @staticmethod
    def of(model: ModelSpec, options: KFACOptions, world: int, batch: int,
           profile: Profile, leaf_modules: int | None) -> _Context:
        prof = profile.at(world)
        leaves = leaf_modules if leaf_modules is not None else model.leaf_modules
        return _Context(model, options, world, batch, prof,
                        Distribution(model, options, world, batch),
                        _training_terms(model, batch, world, prof, leaves),
                        _itemsize(options.factor_dtype), _itemsize(options.inv_dtype))

    @property
    def c(self) -> ComputeRates:
        return self.prof.compute

    def captured_by(self, rank: int) -> list[LayerSpec]:
        """List the layers whose statistics ``rank`` computes (all; DP-KFAC: the owner's)."""
        if sends_factors(self.options.strategy):
            return list(self.model.layers)
        pl = self.dist.placement
        return [s for s in self.model.layers if pl.factor_owner[FactorKey(s.name, "A")] == rank]


def _factor_statistics_s(ctx: _Context) -> float:
    """Price the hooks: ``2R(a² + g²)`` GEMM flops, row copies, patches, micro-batch sums.

    The slowest rank's (ranks differ only under DP-KFAC).
    """
    c, fb, batch = ctx.c, ctx.fb, ctx.batch

    reduce = ctx.options.kfac_approx == "reduce"

    def stats_s(layers: Sequence[LayerSpec]) -> float:
        t = 0.0
        for s in layers:
            rows = batch * s.rows_per_sample
            # reduce: one (averaged) row per example for the products, after one pass
            # over the positions to average ā and sum δ
            gemm_rows = batch if reduce else rows
            t += 2.0 * gemm_rows * (s.a_dim ** 2 + s.g_dim ** 2) / c.gemm_flops
            t += rows * (2 * s.g_dim + s.a_dim) * FP32_BYTES / c.mem_bandwidth  # δ, scale, ā
            if s.kind == "Conv2d":
                t += rows * s.weight_cols * FP32_BYTES / c.unfold_bandwidth  # patches (unfold)
            t += FACTOR_SUM_PASSES * (s.a_dim ** 2 + s.g_dim ** 2) * fb / c.mem_bandwidth
            t += len(FACTORS) * _OPS["stats_factor"] * c.op_overhead_s
        return t

    distinct = range(ctx.world) if not sends_factors(ctx.options.strategy) else range(1)
    return max(stats_s(ctx.captured_by(r)) for r in distinct)


def _local_folds_s(ctx: _Context) -> float:
    """Price ``factor_sync="inverse"``: fold each batch factor into the local average.

    See :class:`kfac_hpc.kfac.factor_sync.LocalAverage`.
    """
    c, layers = ctx.c, ctx.model.layers
    return (sum(RUNNING_AVERAGE_PASSES * (s.a_dim ** 2 + s.g_dim ** 2) * ctx.fb for s in layers)
            / c.mem_bandwidth + len(FACTORS) * len(layers) * _OPS["fold"] * c.op_overhead_s)


def _factor_reduction_s(ctx: _Context, hidden_behind: float) -> float:
    """Price the factor messages of :meth:`Distribution.kind_traffic`.

    The reduce-scatter, or buckets with ``overlap``; local factors: one allreduce; each
    ``α–β`` priced, plus packing them. With ``overlap`` ``overlap_efficiency ·
    hidden_behind`` is hidden (never less than the last bucket).
    """
    o, d, c, world, prof = ctx.options, ctx.dist, ctx.c, ctx.world, ctx.prof
    if world == 1 or not sends_factors(o.strategy):
        return 0.0
    ov = c.op_overhead_s
    fsize = wire_itemsize(o.factor_dtype, reduction=True)
    rs, ar = d.reduce_numel
    kind = "allreduce" if o.factor_reduction == "allreduce" else "reduce_scatter"
    link = prof.link(kind)
    if o.overlap:
        sizes = d.buckets if o.factor_reduction != "allreduce" or not ar else [*d.buckets, ar]
    else:
        sizes = [rs + ar] if o.factor_reduction == "allreduce" else [rs]
    times = [link.time(kind, e * fsize, world) for e in sizes]
    if ar and o.factor_reduction != "allreduce":
        times.append(prof.link("allreduce").time("allreduce", ar * fsize, world))
    keys = len(FACTORS) * len(ctx.model.layers)
    passes = PACK_PASSES_SYMMETRIC if o.symmetric_packing else 1
    pack = (2 * (rs + ar) * ctx.fb * passes) / c.mem_bandwidth  # pack and unpack
    t = sum(times) + pack + (keys * _OPS["wire_factor"] + len(times) * _OPS[
        "collective"]) * ov + len(times) * c.sync_overhead_s
    if o.overlap:
        hidden = c.overlap_efficiency * hidden_behind
        t = max(times[-1] if times else 0.0, t - hidden)
    return t


def _running_averages_s(ctx: _Context) -> float:
    """Price ``F ← ρF + (1−ρ)B`` on the slowest rank.

    Owners update it, and holders of local replicas (every rank with ``allreduce``).
    """
    o, d, c = ctx.options, ctx.dist, ctx.c
    pl = d.placement

    def average_s(rank: int) -> float:
        t = 0.0
        for layer, f in d.factors():
            owner = pl.factor_owner[FactorKey(layer.name, f)] == rank
            if owner or o.factor_reduction == "allreduce" or (
                    d.is_local(layer, f) and pl.is_grad_worker(layer.name, rank)):
                n = layer.dim(f)
                t += (RUNNING_AVERAGE_PASSES * n * n * ctx.fb / c.mem_bandwidth
                      + 2 * c.op_overhead_s)
        return t

    return max(average_s(r) for r in range(ctx.world))


def _decompositions_s(ctx: _Context) -> list[float]:
    """Price each rank's decompositions and return the per-rank seconds.

    Owned non-local factors, and the local factors of its worker group, each priced by
    the profile's eigh/inverse table.
    """
    o, d, c = ctx.options, ctx.dist, ctx.c
    pl = d.placement

    def decompose_s(rank: int) -> float:
        t = 0.0
        group = d.group_of(rank)
        for layer, f in d.factors():
            n = layer.dim(f)
            mine = pl.factor_owner[FactorKey(layer.name, f)] == rank
            local = d.is_local(layer, f) and pl.layer_group[layer.name] == group
            if (mine and not d.is_local(layer, f)) or local:
                t += _decomposition_s(c, n, o.compute_method, d.low_rank_cap(n))
                t += _OPS["decompose"] * c.op_overhead_s
        return t

    return [decompose_s(r) for r in range(ctx.world)]


def _decomposition_s(c: ComputeRates, n: int, method: str, cap: int | None) -> float:
    """Price one decomposition by the profile's eigh/inverse table.

    A low-rank factor's sketch is priced by
    :func:`~kfac_hpc.kfac.shapes.randomized_eigh_flops` at the GEMM rate (an optimistic
    bound: its QRs run slower; the energy rule priced at its cap) unless
    ``randomized_eigh`` falls back to the exact ``eigh`` there.
    """
    if cap is not None and sketches(n, cap):
        return randomized_eigh_flops(n, cap) / c.gemm_flops
    return c.decomposition_s(n, method)


def _decomposition_broadcasts_s(ctx: _Context, compute: Sequence[float]) -> float:
    """Time the decomposition broadcasts add after the slowest decomposition.

    Each worker group's network serves its roots in the order they finish (pipelined,
    weight ``overlap_efficiency``; the preconditioner posts the receives before
    computing), else after the slowest rank, one after the other (serial).
    """
    o, d, c, ib = ctx.options, ctx.dist, ctx.c, ctx.ib
    if ctx.world == 1 or d.grad_workers == 1:
        return 0.0
    ov, link = c.op_overhead_s, ctx.prof.link("broadcast")
    decomp_max = max(compute)
    serial = pipelined = 0.0
    g = d.grad_workers
    for group, slots in enumerate(d.slot_numel):
        roots = [(compute[group * g + k], link.time("broadcast", n * ib, g)
                  + _OPS["collective"] * ov + c.sync_overhead_s
                  + 2 * n * ib / c.mem_bandwidth)  # pack and unpack
                 for k, n in enumerate(slots) if n]
        serial = max(serial, decomp_max + sum(b for _, b in roots))
        clock = 0.0
        for ready, b in sorted(roots):  # the network serves roots as they finish
            clock = max(clock, ready) + b
        pipelined = max(pipelined, clock, max(compute[group * g:(group + 1) * g]))
    eta = c.overlap_efficiency if o.pipelined_broadcasts else 0.0
    return eta * pipelined + (1 - eta) * serial - decomp_max


def _precondition_s(ctx: _Context) -> float:
    """Price preconditioning on the slowest gradient-worker group.

    Eigen ``4(g²a + ga²)``, inverse ``2(g²a + ga²)`` GEMM flops per layer, a layer with
    a low-rank factor :func:`~kfac_hpc.kfac.shapes.lowrank_precondition_flops`.
    """
    o, c, ib = ctx.options, ctx.c, ctx.ib
    pl = ctx.dist.placement

    def precondition_s(group: int) -> float:
        t = 0.0
        for s in ctx.model.layers:
            if pl.layer_group[s.name] != group:
                continue
            ga = s.g_dim * s.a_dim
            a_cap, g_cap = ctx.dist.low_rank_cap(s.a_dim), ctx.dist.low_rank_cap(s.g_dim)
            if a_cap is not None or g_cap is not None:  # kfac.lowrank.precondition_lowrank
                t += lowrank_precondition_flops(s.g_dim, s.a_dim, g_cap or s.g_dim,
                                                a_cap or s.a_dim) / c.gemm_flops
            else:
                mult = PRECONDITION_GEMMS[o.compute_method]
                t += mult * (s.g_dim * ga + ga * s.a_dim) / c.gemm_flops
            t += PRECONDITION_PASSES * ga * ib / c.mem_bandwidth + _OPS["precondition"] * (
                c.op_overhead_s)
        return t

    return max(precondition_s(g) for g in range(ctx.dist.n_groups))


def _gradient_broadcasts_s(ctx: _Context) -> float:
    """Price the preconditioned gradients' broadcasts to the receiver groups.

    One broadcast per non-empty group, summed, plus packing and unpacking them.
    """
    d, c, ib = ctx.dist, ctx.c, ctx.ib
    if ctx.world == 1 or d.n_groups == 1:
        return 0.0
    ov, link = c.op_overhead_s, ctx.prof.link("broadcast")
    t = sum(link.time("broadcast", n * ib, d.n_groups) + _OPS["collective"] * ov
            + c.sync_overhead_s for n in d.group_grad_numel if n)
    t += (SHARE_PASSES * sum(d.group_grad_numel) * ib / c.mem_bandwidth
          + len(ctx.model.layers) * _OPS["share"] * ov)
    return t


def _other_s(ctx: _Context) -> float:
    """Price KL clipping, ``.grad`` writes and the optimizer's update.

    ``KL_CLIP_PASSES`` fp32 passes over the K-FAC weights, and ``OPTIMIZER_PASSES`` over
    every parameter.
    """
    c, model = ctx.c, ctx.model
    return (KL_CLIP_PASSES * model.kfac_param_numel * FP32_BYTES / c.mem_bandwidth
            + len(model.layers) * _OPS["other_layer"] * c.op_overhead_s
            + OPTIMIZER_PASSES * model.param_numel * FP32_BYTES / c.mem_bandwidth
            + model.param_tensors * (c.param_overhead_s or 3 * c.op_overhead_s))


def _schedule_average(ctx: _Context, *, stats: float, folds: float, reduction: float,
                      averages: float, decompose: float, decomp_bcast: float
                      ) -> dict[str, float]:
    """Average the seconds per iteration by phase over one period of the schedule.

    The factor/inverse terms are weighted by how often they run
    (:meth:`Distribution.period`).
    """
    o = ctx.options
    period = ctx.dist.period()
    t = dict.fromkeys(PHASES, 0.0)
    t.update(ctx.base)
    for factor, inverse in period:
        w = 1 / len(period)
        reduce = reduces_factors(o.strategy, o.factor_sync, factor_step=factor,
                                 inverse_step=inverse)
        if factor:
            t["factor stats"] += w * stats
            if o.factor_sync == "inverse":
                t["other"] += w * folds
        if reduce:
            t["factor comm"] += w * reduction
        if factor or (reduce and o.factor_sync == "inverse"):
            t["other"] += w * averages
        if inverse:
            t["decomposition"] += w * decompose
            t["decomp bcast"] += w * decomp_bcast
    return t
