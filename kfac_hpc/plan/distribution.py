"""Who owns, decomposes and sends what: exact bytes per rank, on the wire and in memory.

Everything here is a pure function of the layer shapes (:class:`ModelSpec`), the
preconditioner's settings (:class:`KFACOptions`) and the world size. Placement is the
library's own (:func:`kfac_hpc.kfac.placement.place`), so the owners here are the owners
there.

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
  finite; DP-KFAC one more: statistics were captured on some rank) and one at every
  inverse step (every decomposition succeeded).
* construction: the replica check (:func:`kfac_hpc.comm.replicas.replica_check_bytes`).

**Memory** is the K-FAC state a rank holds (:meth:`Distribution.memory`), as
``KFACPreconditioner.memory_bytes()`` reports it, plus its transient buffers.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from fractions import Fraction
from functools import cached_property

import torch

from kfac_hpc.comm.buffers import REDUCTION_WIDENED_DTYPES
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
from kfac_hpc.kfac.options import low_rank_cap, reduces_factors, sends_factors
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
from kfac_hpc.phases import TRAFFIC_TAGS, Traffic
from kfac_hpc.plan.model_shapes import LayerSpec, ModelSpec
from kfac_hpc.plan.options import KFACOptions

__all__ = ["BYTE_PHASES", "Distribution", "StepTraffic", "construction_traffic", "itemsize",
           "wire_itemsize"]

AGREEMENT_BYTES = 4  # one int32: how many ranks report a fault
BYTE_PHASES = TRAFFIC_TAGS  # the library's byte tags (kfac_hpc.phases.Traffic)


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
    if reduction and dt in REDUCTION_WIDENED_DTYPES:
        return 4
    return int(dt.itemsize)


def itemsize(dtype: str) -> int:
    """Return the bytes per element of the torch dtype named ``dtype`` (``"float32"``)."""
    return int(getattr(torch, dtype).itemsize)


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
    def _bucket_plan(self) -> tuple[list[list[FactorKey]], dict[FactorKey, int]]:
        """The pipeline's overlap buckets and each factor's wire elements.

        The buckets of :func:`~kfac_hpc.kfac.layouts.bucket_plan`; the elements without
        the ``#count``.
        """
        order = [k for k in readiness_order(self.dims)
                 if k not in self.placement.local_factors]
        numel = {k: self.wire_numel(factor_dim(self.dims, k)) for k in order}
        plan = bucket_plan(order, numel, int(self.options.bucket_cap_mb * 2**20),
                           itemsize(self.options.factor_dtype))
        return [list(bucket) for bucket in plan], numel

    @cached_property
    def buckets(self) -> list[int]:
        """Count the elements of each overlap bucket (readiness order: A fwd, G bwd)."""
        plan, numel = self._bucket_plan
        return [sum(numel[k] + 1 for k in bucket) for bucket in plan]

    @cached_property
    def reduce_segments(self) -> list[int]:
        """The largest rank's segment (elements) of each factor reduce-scatter call.

        One call, or one per overlap bucket. The owners' segments are uneven (a rank
        owns whole factors), and a ring or pairwise reduce-scatter takes ``P - 1`` rounds
        of the largest segment: its time is that of an even call of ``P`` times it.
        """
        owner = self.placement.factor_owner
        if not self.options.overlap:
            counts = factor_layout(self.placement, self.dims,
                                   self.options.symmetric_packing).counts()
            return [max(counts, default=0)]
        plan, numel = self._bucket_plan
        out = []
        for bucket in plan:
            per_rank: dict[int, int] = {}
            for k in bucket:
                per_rank[owner[k]] = per_rank.get(owner[k], 0) + numel[k] + 1
            out.append(max(per_rank.values(), default=0))
        return out

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

    def step_kinds(self) -> list[tuple[tuple[bool, bool], float]]:
        """The kinds of steady-state steps, (factor step, inverse step), with their shares.

        In closed form over one period of ``L = lcm(f, i)`` steps: one step of both, ``L/f
        - 1`` factor-only, ``L/i - 1`` inverse-only steps, the rest plain (kinds that never
        occur are left out), so any schedule costs four kinds, whatever its period.
        """
        f, i = self.options.factor_update_steps, self.options.inv_update_steps
        length = math.lcm(f, i)
        both = Fraction(1, length)
        shares = {(True, True): both, (True, False): Fraction(1, f) - both,
                  (False, True): Fraction(1, i) - both}
        shares[(False, False)] = 1 - sum(shares.values(), Fraction(0))
        return [(kind, float(share)) for kind, share in shares.items() if share > 0]

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
        # kfac_hpc.kfac.agree.agree: finite statistics (factor steps), decompositions
        # (inverse steps), and under DP-KFAC whether any rank captured statistics
        for agreed in (factor, inverse, factor and not sends_factors(o.strategy)):
            if agreed:
                out.add(Traffic.AGREEMENT, AGREEMENT_BYTES, 1)
        return out

    def mean_traffic(self, rank: int) -> dict[str, float]:
        """Return the bytes per step on ``rank`` by phase, averaged over the update schedule."""
        total = dict.fromkeys(BYTE_PHASES, 0.0)
        for (factor, inverse), share in self.step_kinds():
            for k, v in self.kind_traffic(factor, inverse, rank).bytes.items():
                total[k] += v * share
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
        fb, ib = itemsize(o.factor_dtype), itemsize(o.inv_dtype)
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
