"""Predicted time of one training iteration with distributed K-FAC, and its :class:`Estimate`.

**Times** are seconds per iteration, averaged over the factor/inverse update schedule;
per phase, computation is the slowest rank's and communication follows
:mod:`kfac_hpc.plan.collectives`. See :func:`estimate` for the terms.

Rates come from a :class:`~kfac_hpc.plan.profile.Profile`; who computes and sends what,
and the bytes and memory an :class:`Estimate` reports, from
:class:`~kfac_hpc.plan.distribution.Distribution`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kfac_hpc.kfac.lowrank import sketches
from kfac_hpc.kfac.options import reduces_factors, sends_factors
from kfac_hpc.kfac.placement import FACTORS, FactorKey
from kfac_hpc.kfac.shapes import lowrank_precondition_flops, randomized_eigh_flops
from kfac_hpc.plan.distribution import (
    BYTE_PHASES,
    Distribution,
    construction_traffic,
    itemsize,
    wire_itemsize,
)
from kfac_hpc.plan.model_shapes import LayerSpec, ModelSpec
from kfac_hpc.plan.options import KFACOptions
from kfac_hpc.plan.profile import ComputeRates, Profile

__all__ = ["PHASES", "Estimate", "estimate", "estimate_sgd"]

PHASES = ("forward", "backward", "grad avg", "factor stats", "factor comm", "decomposition",
          "decomp bcast", "precondition", "grad bcast", "other")

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
    model_bytes: int  # weights + the trainable ones' gradients and momentum (memory budget)

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
        copies = 4 * model.gradient_average_bytes / c.mem_bandwidth  # flatten + write back
        total = sum(times) + copies + len(sizes) * (_OPS["collective"] * c.op_overhead_s
                                                    + c.sync_overhead_s)
        avg = max(times[-1] if times else 0.0, total - c.overlap_efficiency * bwd)
    return {"forward": fwd, "backward": bwd, "grad avg": avg}


def _grad_buckets(model: ModelSpec, cap_mb: float = 25.0) -> list[int]:
    """Bytes per gradient-averaging bucket (one per 25 MB of trainable gradients)."""
    total = model.gradient_average_bytes
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
    t["other"] = (3 * model.trained_bytes / c.mem_bandwidth
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
      (eigh/inverse table of the profile) over the profile's
      ``decomposition_concurrency``; broadcasts: each worker group's network serves
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
        grad_avg_bytes=model.gradient_average_bytes if world > 1 else 0,
        construction_bytes=construction_traffic(model, o, world).total,
        memory=memory,
        model_bytes=model.weight_bytes + (MODEL_STATE_COPIES - 1) * model.trained_bytes)


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
                        itemsize(options.factor_dtype), itemsize(options.inv_dtype))

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
    ``α–β`` priced (a reduce-scatter as an even one of ``P`` times its largest segment,
    :attr:`Distribution.reduce_segments`, or as an allreduce of the whole where that is
    cheaper), plus packing them. With ``overlap`` ``overlap_efficiency ·
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
    if kind == "reduce_scatter":
        # uneven segments: a ring sets its pace by the largest; an MPI may instead reduce
        # the whole and scatter it, no slower than an allreduce of the whole
        whole = prof.link("allreduce")
        times = [min(link.time(kind, max(e, world * s) * fsize, world),
                     whole.time("allreduce", e * fsize, world))
                 for e, s in zip(sizes, d.reduce_segments, strict=True)]
    else:
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
    the profile's eigh/inverse table; their sum divided by the profile's
    ``decomposition_concurrency`` (decompositions run together on a GPU's streams).
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
        return t / c.decomposition_concurrency

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
    the trainable parameters.
    """
    c, model = ctx.c, ctx.model
    return (KL_CLIP_PASSES * model.kfac_param_numel * FP32_BYTES / c.mem_bandwidth
            + len(model.layers) * _OPS["other_layer"] * c.op_overhead_s
            + OPTIMIZER_PASSES * model.trained_bytes / c.mem_bandwidth
            + model.param_tensors * (c.param_overhead_s or 3 * c.op_overhead_s))


def _schedule_average(ctx: _Context, *, stats: float, folds: float, reduction: float,
                      averages: float, decompose: float, decomp_bcast: float
                      ) -> dict[str, float]:
    """Average the seconds per iteration by phase over one period of the schedule.

    The factor/inverse terms are weighted by how often they run
    (:meth:`Distribution.step_kinds`).
    """
    o = ctx.options
    t = dict.fromkeys(PHASES, 0.0)
    t.update(ctx.base)
    for (factor, inverse), w in ctx.dist.step_kinds():
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
