"""K-FAC step: where an iteration's time goes, bytes and memory per strategy.

    launch/local -n 4 python benchmarks/kfac_step.py [--model all|mlp|resnet20|resnet50]
        [--device cpu|cuda] [--steps N] [--warmup W] [--quick] [--markdown]
        [--sections ratio matrix eigh] [--kfac-approx expand|reduce] [--peak-dim 2048]
        [--out benchmarks/out]
    launch/local -n 1 python benchmarks/kfac_step.py --device cuda --model resnet50  # GPU

Models: an MLP on 64-feature inputs (hidden 256, 128; 10 classes), the CIFAR ResNet-20
on a synthetic 32x32x3 batch, and (only when asked for: ``--model resnet50``) the
ImageNet ResNet-50 on a synthetic 224x224x3 batch with 1000 classes; per-rank batch
``--batch`` (32; 32-64 for ResNet-50 on a GPU), a fixed synthetic batch per rank (data
loading is not measured). Every rank averages gradients with
:class:`kfac_hpc.GradientAverager` (its own communicator) and takes a plain SGD step;
K-FAC runs ``KFACPreconditioner.step()`` in between.

``--device cuda`` runs model, data and preconditioners on ``cuda:<local rank mod GPUs>``
(made current with ``torch.cuda.set_device``; ranks of a node share its GPUs); it exits
with the reason when torch sees no GPU. MPI is started when this script is imported,
before the device is chosen: right for Open MPI/UCX and MPICH, not for MPI libraries
that bind a GPU at ``MPI_Init`` (set ``CUDA_VISIBLE_DEVICES`` per rank there).

``--kfac-approx`` passes ``kfac_approx=`` ("expand", the default, or "reduce") to every
K-FAC configuration; reduce runs write ``..._reduce.json`` / ``.png``.

How far from the machine: at the start, the fp32 throughput of a ``--peak-dim``² matmul
(``2·n³`` flops; median of ``--peak-runs`` or more calls, at least 0.5 s, after one
untimed call) is measured at the
ranks' torch thread count, on rank 0 alone while the others wait without spinning (the
reference: what one rank's threads reach with the cores to themselves; the machine's
limit is that per thread times the cores the ranks can use), and, as a reading of the
momentary load, on every rank at once. The ``ratio`` section then reports, per
composed configuration and phase, the flops of the mean rank's iteration and the GFLOP/s
they reach in the phase's time, as a percentage of the reference; and for the whole
iteration, every rank's flops over the slowest rank's iteration time as a percentage of
the machine's throughput. With more ranks than cores, ranks computing at once share a
core, so a phase stays well below 100 % (about cores / ranks at best when every rank
computes in it); above 100 % means fewer flops were done than counted (the symmetric
statistics update). On a shared machine the reference moves with other users' load, so
it is measured again (rank 0 alone) at the end as a check. Flops (one multiply-add =
2): forward/backward by ``torch.utils.flop_counter.FlopCounterMode`` (matmuls and
convolutions of the model, counted once on a copy); factor statistics per
``a_factor``/``g_factor`` call by ``kfac_hpc.kfac.shapes.statistics_flops`` (the layer's
approximation and rows per sample from ``shapes.rows_per_sample``; the dense Gram count,
also where the library's symmetric update computes half); decomposition per factor a
rank decomposes, ``shapes.eigh_flops`` (``4d³``, nominal) or ``d³`` (Cholesky inverse);
precondition, the GEMMs per gradient a rank preconditions (eigen ``4ga(g+a)``, inverse
``2ga(g+a)``); other, the running averages (3 per element) and the KL clip's inner
products (``2ga`` per layer). Communication phases have no flops. Backward includes the
gradient allreduce, so its rate is a lower bound on the backward kernels'. The counts
are deterministic per iteration kind and composed with the same weights as the times
(the inverse and factor_sync rows borrow their untimed kinds' flops from the eigen run,
as they borrow the times).

Sections (at the current world size):

* ``ratio``: SGD against K-FAC (comm-opt, eigen; also inverse, dp-kfac at more than
  one rank, and ``factor_sync="inverse"`` when the constructor has it). Three kinds of K-FAC
  iteration are timed: ``fi`` (factor and inverse update), ``f`` (factor update
  only), ``p`` (neither: stale eigenbases). An iteration of the schedule with
  ``(factor, inverse)`` update steps ``(F, I)`` is composed as
  ``fi/I + f·(1/F - 1/I) + p·(1 - 1/F)``, giving (1,1), (1,10), (10,100). The kind is
  chosen per iteration by passing schedules (callables of the step) as
  ``factor_update_steps`` / ``inv_update_steps``. The inverse and factor_sync variants
  time only the kinds in which they differ (inverse: ``fi``; factor_sync: ``f``) and
  borrow the others from the eigen run. Outside ``--quick``, (1,10) is also timed
  directly over one period with constant settings, as a check of the composition.
* ``matrix`` (world size > 1): comm-opt, mem-opt, hybrid-opt(0.5), dp-kfac, each with
  and without ``symmetric_packing`` (and ``overlap`` when the constructor has it), all
  at (1,1) — every iteration is a second-order update. Combinations the constructor
  rejects are listed as such. Ratios are against comm-opt without options.
* ``eigh``: ``torch.linalg.eigh`` of a random SPD matrix the size of the model's largest
  K-FAC factor (4608 for ResNet-50: 512·3·3, its convolutions have no bias; or
  ``--eigh-dims``) on the device, fp32 (what the library decomposes in) and fp64 for
  reference: median of ``--eigh-runs`` synchronised calls after one untimed call (whose
  time, with CUDA's solver set-up, is reported as "first call"), on rank 0 alone while
  the other ranks wait without spinning; the relative residual
  ``||A V - V diag(w)|| / ||A||`` is reported as a check.

On CUDA (``--device cuda``) kernels run asynchronously, so a wall-clock phase would
mostly time the launches. Every phase boundary therefore synchronises the device
(``torch.cuda.synchronize()``) inside the wrappers and in the iteration, so each phase
is charged its own kernels. This serialises work that would otherwise overlap (e.g.
K-FAC statistics kernels with the rest of the backward pass, communication with
computation) and adds a synchronisation per wrapped call: the phased iteration time is
an upper bound. So in the ``ratio`` section every timed iteration is followed by the
same iteration with only two synchronisations, at its start and end (``--whole-iteration``,
default on CUDA only), and its time is reported as "no phase sync" (iteration time and
ratio to SGD, composed the same way). The ``matrix`` section and the direct (1,10) check
report phased times only. On the CPU the synchronisations are no-ops.

How it is measured (from outside the library, which is not modified):

* Each configuration has its own copy of the model (same initial weights), its own
  communicator (a ``Dup`` of the world) and preconditioner. Configurations and kinds are
  run round-robin, one iteration each per round, so slow drifts of a shared,
  oversubscribed machine hit all of them alike. A barrier precedes every iteration.
* The time of an iteration is the slowest rank's; the reported number is the median
  over ``--steps`` rounds after ``--warmup`` rounds. The split is per rank (median per
  phase over rounds), then averaged over ranks; it sums to the mean rank's iteration.
* Phases: *forward* and *backward* are wall time of ``model(x)`` + loss and of
  ``loss.backward()`` + ``GradientAverager.synchronize()`` (so backward includes
  gradient averaging), each minus the time spent inside the K-FAC hooks;
  *factor stats* is the time inside ``LayerCurvature.a_factor`` / ``g_factor`` called
  by the hooks (the per-layer instances are wrapped); the K-FAC phases are those the
  library declares (``kfac_hpc.phases.Phase``, read from a ``PhaseTimer`` handed to the
  preconditioner): *factor comm* is ``kfac_factors`` minus ``kfac_averages`` (the
  running-average arithmetic) plus the pipeline's ``mark_ready`` / ``progress`` in the
  hooks (SPD-KFAC pipelining; the pipeline's instance is wrapped); *decomposition* is
  ``kfac_decompose`` (eigh or inverse of this rank's factors); *decomp bcast* is
  ``kfac_decompositions`` minus ``kfac_decompose`` (broadcasts of eigenbases/inverses,
  including waiting for their owners); *precondition* is ``kfac_precondition``;
  *grad bcast* is ``kfac_gradients`` (mem-opt/hybrid/dp broadcasts of preconditioned
  gradients); *other* is the rest: running averages, KL clipping, writing ``.grad``,
  ``zero_grad`` and ``optimizer.step()``.
* Bytes: the library's counters (``Communicator.traffic()``, merged with the
  sub-communicators), which count per call the size of the message the collective
  operates on (the whole vector of a reduce-scatter or broadcast), on every rank: not
  the bytes a given MPI algorithm puts on a link. They are attributed to phases by the
  library's own tags (``kfac_hpc.phases.Traffic``: factors / decompositions /
  gradients; agreement and untagged bytes are *other*), measured in the last warm-up
  round (the counters are deterministic per kind); gradient averaging is counted on
  its own communicator. The tags' bytes are recorded in the JSON too.
* Memory per rank: ``pre.memory_bytes()`` (factors + decompositions this rank holds)
  plus, with ``factor_sync="inverse"``, the local running averages; max over ranks.

Writes ``kfac_step_<model>_n<ranks>.json`` (``..._cuda.json`` on CUDA) and PNG plots
(stacked time split; bytes, time and memory per strategy) under ``--out``; prints the
tables on rank 0.
"""

from __future__ import annotations

import argparse
import copy
import inspect
import os
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from common import (
    OUT_DIR,
    describe,
    figure_note,
    format_table,
    machine,
    matmul_throughput,
    pyplot,
    save_figure,
    select_device,
    synchronize,
    write_json,
)
from mpi4py import MPI
from torch import nn

from kfac_hpc import GradientAverager, KFACPreconditioner
from kfac_hpc.comm import Communicator
from kfac_hpc.kfac.layers import LayerCurvature, register_layers
from kfac_hpc.kfac.shapes import eigh_flops, rows_per_sample, statistics_flops
from kfac_hpc.models import build_model
from kfac_hpc.phases import Phase, PhaseTimer, Traffic

PHASES = ("forward", "backward", "factor stats", "factor comm", "decomposition",
          "decomp bcast", "precondition", "grad bcast", "other")
COLORS = ("#4e79a7", "#a0cbe8", "#f28e2b", "#e15759", "#59a14f", "#8cd17d", "#b07aa1",
          "#ff9da7", "#bab0ac")
BYTE_TAGS = (Traffic.FACTORS.value, Traffic.DECOMPOSITIONS.value, Traffic.GRADIENTS.value,
             "other")
KINDS = ("fi", "f", "p")
SCHEDULES = ((1, 1), (1, 10), (5, 10), (10, 100))  # (5, 10): the driver's default
DEFAULT_STEPS = {"mlp": (30, 20), "resnet20": (4, 3),  # timed rounds: ratio, matrix
                 "resnet50": (10, 5)}
NEVER = 10**9  # an update interval that no step number below it is a multiple of
WORLD = MPI.COMM_WORLD
ACCEPTED = set(inspect.signature(KFACPreconditioner).parameters)
# phases whose arithmetic is counted (see flop_counts); the rest are communication
FLOP_PHASES = ("forward", "backward", "factor stats", "decomposition", "precondition", "other")
EXTRA_OPTIONS: dict[str, Any] = {}  # added to every K-FAC configuration (--kfac-approx)


@dataclass
class Sync:
    """Device synchronisation at phase boundaries (CUDA kernels are asynchronous).

    ``phases``: synchronise at every phase boundary (the wrappers and the iteration's
    split points); ``cuda``: the device is a GPU, so iteration boundaries synchronise even
    when ``phases`` is off. Both off on the CPU, where every call is a no-op.
    """

    cuda: bool = False
    phases: bool = False

    def phase(self) -> None:
        """A phase boundary."""
        if self.phases:
            torch.cuda.synchronize()

    def boundary(self) -> None:
        """An iteration boundary (start or end of a timed iteration)."""
        if self.cuda:
            torch.cuda.synchronize()


SYNC = Sync()


# --------------------------------------------------------------------------- probes
class Probe:
    """Times and counts one preconditioner's phases from what the library declares.

    The K-FAC phases are the library's (:mod:`kfac_hpc.phases`): the probe hands the
    preconditioner a :class:`PhaseTimer` and reads the seconds per phase back. In the
    hooks, the public ``a_factor`` / ``g_factor`` of each layer's curvature object
    (statistics) and the pipeline's public ``mark_ready`` / ``progress`` (factor
    reductions posted from the hooks, ``overlap``) are timed per instance. Flops follow
    from public state after the step: the factors this rank holds (``pre.factors``: it
    decomposes every one it holds) and the layers it is a gradient worker of.
    """

    def __init__(self, pre: KFACPreconditioner, rows: dict[int, int] | None = None) -> None:
        self.pre = pre
        self.timer = PhaseTimer(pre.device)
        pre.phase_timer = self.timer
        self.t: defaultdict[str, float] = defaultdict(float)  # hook-side times
        self.flops: defaultdict[str, int] = defaultdict(int)
        self.wrapped: list[str] = [  # what is timed, besides the library's phases
            "phases: " + ", ".join(p.value for p in Phase if p.value.startswith("kfac"))]
        rows = rows or {}
        for stats in pre.capture.stats.values():
            curv = stats.curvature
            per_sample = rows.get(id(curv.module), 1)
            curv.a_factor = self._wrap(  # type: ignore[method-assign]
                "stats", curv.a_factor, self._statistics_flops(curv, "A", per_sample))
            curv.g_factor = self._wrap(  # type: ignore[method-assign]
                "stats", curv.g_factor, self._statistics_flops(curv, "G", per_sample))
        self.wrapped.append("LayerCurvature.a_factor/g_factor")
        if pre.pipeline is not None:
            pipe = pre.pipeline
            pipe.mark_ready = self._wrap("on_ready", pipe.mark_ready)  # type: ignore[method-assign]
            pipe.progress = self._wrap("on_ready", pipe.progress)  # type: ignore[method-assign]
            self.wrapped.append("FactorPipeline.mark_ready/progress")
        self._before: dict[str, int] = {}

    def _wrap(self, name: str, fn: Callable[..., Any],
              flops: Callable[[tuple[Any, ...], Any], int] | None = None) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            SYNC.phase()  # work queued before the call belongs to the caller's phase
            t0 = time.perf_counter()
            result = None
            try:
                result = fn(*args, **kwargs)
                return result
            finally:
                SYNC.phase()
                self.t[name] += time.perf_counter() - t0
                if flops is not None and result is not None:
                    self.flops[name] += flops(args, result)

        return timed

    # Flop counts of what a call did (one multiply-add = 2 flops), from the pure
    # functions of kfac_hpc.kfac.shapes; see flop_counts() for the conventions.
    @staticmethod
    def _statistics_flops(curv: LayerCurvature, factor: str, per_sample: int
                          ) -> Callable[[tuple[Any, ...], Any], int]:
        def count(args: tuple[Any, ...], _result: Any) -> int:
            t = args[0]
            batch = int(t.shape[0]) if t.dim() >= 2 else 1
            a, g = (curv.a_dim, 0) if factor == "A" else (0, curv.g_dim)
            return statistics_flops(a, g, batch, per_sample, curv.approx)

        return count

    def start(self, enabled: bool) -> None:
        """Begin an iteration: clear the counts; time the library's phases if ``enabled``."""
        self.t.clear()
        self.flops.clear()
        self.timer.start(enabled)
        self._before = {name: s.updates for name, s in self.pre.factors.items()}
        self._local_before = {k: (v.updates, v.delta is not None)
                              for k, v in self.pre.local_averages.items()}

    def seconds(self, phase: Phase) -> float:
        """The seconds the library spent in ``phase`` this iteration."""
        return self.timer.seconds(phase)

    def finish(self) -> None:
        """After the step: flops of the phases that ran, from public state."""
        pre, method = self.pre, self.pre.compute_method
        if self.seconds(Phase.KFAC_DECOMPOSE) > 0:  # every factor held is decomposed
            self.flops["decomposition"] = sum(
                decomposition_flops(s.dim, method) for s in pre.factors.values()
                if s.average is not None)
        rank, held = pre.comm.rank, pre.decompositions
        self.flops["precondition"] = sum(
            precondition_flops(c.g_dim, c.a_dim, method) for name, c in pre.layers.items()
            if pre.placement.is_grad_worker(name, rank) and c.module.weight.grad is not None
            and f"{name}/A" in held and f"{name}/G" in held)
        # running averages: 3 flops an element of every factor folded into an existing
        # average (a first update is a copy)
        folded = sum(3 * s.dim ** 2 for name, s in pre.factors.items()
                     if s.updates > self._before.get(name, 0) and self._before.get(name, 0))
        folded += sum(3 * int(v.delta.numel()) for k, v in pre.local_averages.items()
                      if v.delta is not None and v.updates > self._local_before[k][0]
                      and self._local_before[k][1])
        self.flops["average"] = folded


def decomposition_flops(d: int, method: str) -> int:
    """Nominal flops of one factor's decomposition: ``eigh_flops`` (``4d³``) for eigen;
    ``d³`` for inverse (Cholesky ``d³/3`` + ``cholesky_inverse`` ``2d³/3``)."""
    return eigh_flops(d) if method == "eigen" else d ** 3


def precondition_flops(g: int, a: int, method: str) -> int:
    """GEMM flops of preconditioning a ``(g, a)`` gradient: eigen ``Q_Gᵀ X Q_A`` and
    ``Q_G V Q_Aᵀ`` = ``2·(g²a + g a²)`` multiply-adds = ``4ga(g + a)`` flops; inverse
    ``G⁻¹ X A⁻¹`` = ``g²a + g a²`` multiply-adds = ``2ga(g + a)`` flops."""
    return (4 if method == "eigen" else 2) * g * a * (g + a)


# ------------------------------------------------------------------------ workloads
@dataclass
class Workload:
    name: str
    model: nn.Module
    x: torch.Tensor
    y: torch.Tensor
    # matmul/convolution flops of this rank's forward and backward (torch's FlopCounterMode)
    forward_flops: int = 0
    backward_flops: int = 0


def count_model_flops(work: Workload) -> None:
    """Forward and backward flops of ``work``'s model on its batch, counted by
    ``torch.utils.flop_counter.FlopCounterMode`` on a copy (matmuls and convolutions,
    2 flops a multiply-add; norms and activations are not counted)."""
    from torch.utils.flop_counter import FlopCounterMode

    model = copy.deepcopy(work.model)
    with FlopCounterMode(display=False) as fwd:
        loss = F.cross_entropy(model(work.x), work.y)
    with FlopCounterMode(display=False) as bwd:
        loss.backward()
    work.forward_flops = int(fwd.get_total_flops())
    work.backward_flops = int(bwd.get_total_flops())


def make_workload(name: str, batch: int, device: torch.device,
                  image_size: int = 32) -> Workload:
    """The model (same weights on every rank) and this rank's fixed synthetic batch, on
    ``device`` (drawn on the CPU, so the same on every device)."""
    torch.manual_seed(0)
    classes = 10
    if name == "mlp":
        model = build_model("mlp", num_classes=classes, input_dim=64, hidden=(256, 128))
        shape: tuple[int, ...] = (batch, 64)
    elif name == "resnet50":
        classes = 1000
        model = build_model(name, num_classes=classes, in_channels=3, image_size=224)
        shape = (batch, 3, 224, 224)
    else:
        # 32: CIFAR; 8: the driver's synthetic 3x8x8 images (time_to_accuracy.py)
        model = build_model(name, num_classes=classes, in_channels=3, image_size=image_size)
        shape = (batch, 3, image_size, image_size)
    g = torch.Generator().manual_seed(1000 + WORLD.Get_rank())
    x = torch.randn(shape, generator=g)
    y = torch.randint(0, classes, (batch,), generator=g)
    work = Workload(name, model.to(device), x.to(device), y.to(device))
    count_model_flops(work)
    return work


@dataclass
class Mode:
    """Which kind of K-FAC iteration the next step is (read by the schedules)."""

    factor: bool = True
    inverse: bool = True


@dataclass
class Runner:
    """One configuration: a model copy, its optimizer, averager and (maybe) preconditioner."""

    label: str
    kinds: tuple[str, ...]
    model: nn.Module
    opt: torch.optim.Optimizer
    averager: GradientAverager
    pre: KFACPreconditioner | None = None
    probe: Probe | None = None
    mode: Mode = field(default_factory=Mode)
    options: dict[str, Any] = field(default_factory=dict)
    # kind -> list over timed rounds of {phase: seconds, "total": seconds}
    samples: dict[str, list[dict[str, float]]] = field(default_factory=dict)
    bytes: dict[str, dict[str, float]] = field(default_factory=dict)
    lib_tags: dict[str, dict[str, int]] = field(default_factory=dict)
    flops: dict[str, dict[str, int]] = field(default_factory=dict)  # kind -> phase -> flops
    model_flops: tuple[int, int] = (0, 0)  # forward, backward


def build_runner(label: str, work: Workload, grad_comm: Communicator, kinds: Sequence[str],
                 options: dict[str, Any] | None, fixed_schedule: bool = False) -> Runner | str:
    """A runner; a string (the reason) when the constructor rejects the options."""
    model = copy.deepcopy(work.model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    averager = GradientAverager(model, grad_comm)
    if options is not None:
        options = {**EXTRA_OPTIONS, **options}
    runner = Runner(label, tuple(kinds), model, opt, averager, options=dict(options or {}),
                    model_flops=(work.forward_flops, work.backward_flops))
    if options is None:
        return runner
    mode = runner.mode
    kwargs = dict(options)
    if not fixed_schedule:
        kwargs["factor_update_steps"] = lambda k: 1 if mode.factor else NEVER
        kwargs["inv_update_steps"] = lambda k: 1 if mode.inverse else NEVER
    comm = Communicator(WORLD.Dup(), name=f"kfac[{label}]")
    try:
        pre = KFACPreconditioner(model, comm=comm, lr=0.01, **kwargs)
    except (ValueError, TypeError) as e:
        averager.remove()
        comm.free()
        return str(e).split(";")[0]
    runner.pre = pre
    rows = rows_per_sample(model, [c.module for c in pre.layers.values()],
                           tuple(work.x.shape[1:]))
    runner.probe = Probe(pre, rows)
    return runner


# ----------------------------------------------------------------------- iterations
def iteration(r: Runner, work: Workload, kind: str, grad_comm: Communicator,
              count_bytes: bool = False, phase_sync: bool = True) -> dict[str, float]:
    """One training iteration of ``kind``; this rank's phase times (seconds).

    ``phase_sync=False`` (CUDA): synchronise only at the start and end, so the total is
    the whole iteration with its natural overlap and the phases are meaningless.
    """
    if not phase_sync:
        phases, SYNC.phases = SYNC.phases, False
        try:
            return iteration(r, work, kind, grad_comm, count_bytes)
        finally:
            SYNC.phases = phases
    probe = r.probe
    if probe is not None:
        r.mode.factor, r.mode.inverse = kind in ("fi", "f"), kind == "fi"
        probe.start(enabled=SYNC.phases or not SYNC.cuda)
    tags_before = _tag_snapshot(r.pre) if count_bytes and r.pre is not None else {}
    grad_before = grad_comm.traffic().total_bytes
    SYNC.boundary()
    WORLD.Barrier()
    t0 = time.perf_counter()
    r.opt.zero_grad()
    loss = F.cross_entropy(r.model(work.x), work.y)
    SYNC.phase()
    t1 = time.perf_counter()
    hooks_fwd = dict(probe.t) if probe is not None else {}
    loss.backward()
    r.averager.synchronize()
    SYNC.phase()
    t2 = time.perf_counter()
    hooks_bwd = dict(probe.t) if probe is not None else {}
    if r.pre is not None:
        r.pre.step()
    SYNC.phase()
    t3 = time.perf_counter()
    r.opt.step()
    SYNC.boundary()
    t4 = time.perf_counter()
    t = dict(probe.t) if probe is not None else {}

    def hooks(d: dict[str, float]) -> float:
        return d.get("stats", 0.0) + d.get("on_ready", 0.0)

    def lib(phase: Phase) -> float:
        return probe.seconds(phase) if probe is not None else 0.0

    in_fwd = hooks(hooks_fwd)
    in_bwd = hooks(hooks_bwd) - in_fwd
    out = dict.fromkeys(PHASES, 0.0)
    out["forward"] = (t1 - t0) - in_fwd
    out["backward"] = (t2 - t1) - in_bwd
    out["factor stats"] = t.get("stats", 0.0)
    out["factor comm"] = (t.get("on_ready", 0.0) + lib(Phase.KFAC_FACTORS)
                          - lib(Phase.KFAC_AVERAGES))
    out["decomposition"] = lib(Phase.KFAC_DECOMPOSE)
    out["decomp bcast"] = lib(Phase.KFAC_DECOMPOSITIONS) - lib(Phase.KFAC_DECOMPOSE)
    out["precondition"] = lib(Phase.KFAC_PRECONDITION)
    out["grad bcast"] = lib(Phase.KFAC_GRADIENTS)
    step_known = sum(out[p] for p in PHASES[3:8]) - t.get("on_ready", 0.0)
    out["other"] = (t3 - t2) - step_known + (t4 - t3)
    out["total"] = t4 - t0
    # deterministic per kind after the very first step (whose running averages are
    # copies): the last iteration of the kind is kept
    if probe is not None:
        probe.finish()
    r.flops[kind] = flop_counts(r)
    if count_bytes:
        kfac_total = 0
        tags: dict[str, int] = {}
        if r.pre is not None:
            kfac_total = r.pre.comm.traffic().total_bytes - tags_before.pop("__total__")
            after = _tag_snapshot(r.pre)
            after.pop("__total__")
            tags = {k: v - tags_before.get(k, 0) for k, v in after.items()}
            r.lib_tags[kind] = tags
        # the library tags its bytes by phase (kfac_hpc.phases.Traffic)
        row = {tag: float(tags.get(tag, 0)) for tag in BYTE_TAGS[:3]}
        row["other"] = float(kfac_total - sum(row.values()))
        row["kfac"] = float(kfac_total)
        row["grad avg"] = float(grad_comm.traffic().total_bytes - grad_before)
        r.bytes[kind] = row
    return out


def flop_counts(r: Runner) -> dict[str, int]:
    """This rank's flops per phase in the iteration just run (one multiply-add = 2).

    * forward / backward: ``FlopCounterMode`` of the model (matmuls, convolutions);
    * factor stats: ``shapes.statistics_flops`` per ``a_factor`` / ``g_factor`` call
      this rank made, with the layer's approximation and rows per sample (the dense
      Gram count ``2·rows·d²``, also where the library's symmetric update does half);
    * decomposition: ``eigh_flops`` (``4d³``) or ``d³`` (inverse) per factor this
      rank decomposed;
    * precondition: the GEMMs of each gradient this rank preconditioned (eigen
      ``4ga(g+a)``, inverse ``2ga(g+a)``);
    * other: running averages (3 flops an element) and the KL clip's inner products
      ``2ga`` per layer (in float64).
    """
    fwd, bwd = r.model_flops
    out = dict.fromkeys(FLOP_PHASES, 0)
    out["forward"], out["backward"] = fwd, bwd
    probe, pre = r.probe, r.pre
    if probe is None or pre is None:
        return out
    f = probe.flops
    out["factor stats"] = f.get("stats", 0)
    out["decomposition"] = f.get("decomposition", 0)
    out["precondition"] = f.get("precondition", 0)
    # every rank clips every layer's update (after the gradient broadcast, if any)
    kl = 0 if pre.kl_clip is None else sum(2 * c.g_dim * c.a_dim for c in pre.layers.values())
    out["other"] = f.get("average", 0) + kl
    return out


def _tag_snapshot(pre: KFACPreconditioner | None) -> dict[str, int]:
    if pre is None:
        return {"__total__": 0}
    traffic = pre.comm.traffic()
    out = {tag: c.bytes for tag, c in traffic.tags.items()}
    out["__total__"] = traffic.total_bytes
    return out


def run_round_robin(runners: Sequence[Runner], work: Workload, grad_comm: Communicator,
                    steps: int, warmup: int, say: Callable[[str], None], what: str,
                    unsynced: bool = False) -> None:
    """Warm up (counting bytes in the last warm-up round), then time ``steps`` rounds.

    A round runs every runner's kinds once. The very first step of a preconditioner
    always updates factors and decompositions, so a runner whose first kind is not
    ``fi`` gets one extra untimed ``fi`` step first. ``unsynced``: each iteration is
    followed by the same kind without phase synchronisations, whose total is kept as
    ``total_unsynced``.
    """
    start = time.perf_counter()
    for r in runners:
        if r.pre is not None and r.pre.steps == 0 and r.kinds[0] != "fi":
            iteration(r, work, "fi", grad_comm)
    for rnd in range(max(1, warmup) + steps):
        counting = rnd == max(1, warmup) - 1
        for r in runners:
            for kind in r.kinds:
                sample = iteration(r, work, kind, grad_comm, count_bytes=counting)
                if unsynced:
                    sample["total_unsynced"] = iteration(r, work, kind, grad_comm,
                                                         phase_sync=False)["total"]
                if rnd >= max(1, warmup):
                    r.samples.setdefault(kind, []).append(sample)
        if rnd == 0:
            say(f"  {what}: first round {time.perf_counter() - start:.1f} s")
    say(f"  {what}: {len(runners)} configs x {max(1, warmup) + steps} rounds in "
        f"{time.perf_counter() - start:.1f} s")


# ------------------------------------------------------------------------- analysis
def summarise(r: Runner) -> dict[str, Any]:
    """Collective: per kind, iteration (median of slowest rank) and mean-rank split."""
    everyone = WORLD.allgather(r.samples)
    everyone_flops = WORLD.allgather(r.flops)
    kinds: dict[str, Any] = {}
    for kind in r.kinds:
        per_rank = [s[kind] for s in everyone]
        rounds = len(per_rank[0])
        slowest = [max(rank[i]["total"] for rank in per_rank) for i in range(rounds)]
        split = {p: statistics.fmean(statistics.median(x[p] for x in rank) for rank in per_rank)
                 for p in PHASES}
        unsynced = {}
        if all("total_unsynced" in x for rank in per_rank for x in rank):
            plain = [max(rank[i]["total_unsynced"] for rank in per_rank) for i in range(rounds)]
            unsynced = {"iteration_unsynced_s": statistics.median(plain),
                        "iteration_unsynced_samples_s": plain}
        kinds[kind] = {
            "iteration_s": statistics.median(slowest),
            "iteration_samples_s": slowest,
            **unsynced,
            "split_s": split,
            "split_max_rank_s": {p: max(statistics.median(x[p] for x in rank)
                                        for rank in per_rank) for p in PHASES},
            "bytes_per_rank": r.bytes.get(kind, {}),
            "library_tags": r.lib_tags.get(kind, {}),
        }
        if all(kind in f for f in everyone_flops):  # mean rank, like the split
            kinds[kind]["flops"] = {p: statistics.fmean(f[kind][p] for f in everyone_flops)
                                    for p in FLOP_PHASES}
            kinds[kind]["flops_max_rank"] = {p: max(f[kind][p] for f in everyone_flops)
                                             for p in FLOP_PHASES}
    memory = {}
    if r.pre is not None:
        mem = dict(r.pre.memory_bytes())
        local = getattr(r.pre, "local_averages", {}) or {}
        mem["local averages"] = sum(a.delta.nbytes for a in local.values()
                                    if getattr(a, "delta", None) is not None)
        everyone_mem = WORLD.allgather(mem)
        totals = [sum(m.values()) for m in everyone_mem]
        memory = {"per_rank": everyone_mem, "max_bytes": max(totals),
                  "mean_bytes": statistics.fmean(totals)}
    return {"label": r.label, "options": _jsonable(r.options), "kinds": kinds,
            "memory": memory, "wrapped": r.probe.wrapped if r.probe else []}


def compose(kinds: dict[str, Any], f: int, i: int) -> dict[str, Any]:
    """Mean iteration of the (f, i) schedule from the fi / f / p kinds."""
    w = {"fi": 1 / i, "f": 1 / f - 1 / i, "p": 1 - 1 / f}
    w = {k: v for k, v in w.items() if v > 1e-12}
    missing = [k for k in w if k not in kinds]
    if missing:
        raise KeyError(missing)
    out: dict[str, Any] = {"iteration_s": sum(v * kinds[k]["iteration_s"] for k, v in w.items())}
    if all("iteration_unsynced_s" in kinds[k] for k in w):
        out["iteration_unsynced_s"] = sum(v * kinds[k]["iteration_unsynced_s"]
                                          for k, v in w.items())
    out["split_s"] = {p: sum(v * kinds[k]["split_s"][p] for k, v in w.items()) for p in PHASES}
    if all("flops" in kinds[k] for k in w):
        out["flops"] = {p: sum(v * kinds[k]["flops"][p] for k, v in w.items())
                        for p in FLOP_PHASES}
    tags = set().union(*(kinds[k]["bytes_per_rank"] for k in w))
    out["bytes_per_rank"] = {t: sum(v * kinds[k]["bytes_per_rank"].get(t, 0.0)
                                    for k, v in w.items()) for t in tags}
    return out


def per_round_ratio(kinds: dict[str, Any], sgd: dict[str, Any], f: int, i: int,
                    key: str = "iteration_samples_s") -> float:
    """Median over rounds of (composed K-FAC iteration / SGD iteration) of the same round.

    Neighbouring iterations share the machine's momentary load, so this ratio is less
    sensitive to other work on a shared machine than the ratio of the medians. ``key``
    picks the samples (``iteration_unsynced_samples_s``: without phase synchronisation).
    """
    w = {"fi": 1 / i, "f": 1 / f - 1 / i, "p": 1 - 1 / f}
    rounds = len(sgd[key])
    return float(statistics.median(
        sum(v * kinds[k][key][n] for k, v in w.items() if v > 1e-12)
        / sgd[key][n] for n in range(rounds)))


def _jsonable(options: dict[str, Any]) -> dict[str, Any]:
    return {k: (v if isinstance(v, int | float | str | bool | None) else repr(v))
            for k, v in options.items()}


def ms(s: float) -> str:
    return f"{s * 1e3:.1f}"


def kib(b: float) -> str:
    return f"{b / 1024:.1f}"


# ------------------------------------------------------------------------ sections
def ratio_section(work: Workload, grad_comm: Communicator, args: argparse.Namespace,
                  say: Callable[[str], None]) -> dict[str, Any]:
    specs: list[tuple[str, tuple[str, ...], dict[str, Any] | None]] = [
        ("SGD", ("p",), None),
        ("K-FAC eigen", KINDS, {"strategy": "comm-opt", "compute_method": "eigen"}),
        ("K-FAC inverse", ("fi",), {"strategy": "comm-opt", "compute_method": "inverse"}),
    ]
    if WORLD.Get_size() > 1:
        specs.append(("K-FAC dp-kfac", KINDS, {"strategy": "dp-kfac"}))
        if "input_shape" in ACCEPTED:  # owners placed on statistics + decomposition work
            specs.append(("K-FAC dp-kfac, input_shape", KINDS,
                          {"strategy": "dp-kfac", "input_shape": tuple(work.x.shape)}))
    if "factor_sync" in ACCEPTED and not args.quick and WORLD.Get_size() > 1:
        specs.append(("K-FAC eigen, factor_sync=inverse", ("f",),
                      {"strategy": "comm-opt", "factor_sync": "inverse"}))
    runners = []
    for label, spec_kinds, opts in specs:
        r = build_runner(label, work, grad_comm, spec_kinds, opts)
        if isinstance(r, str):
            say(f"  {label}: rejected ({r})")
            continue
        runners.append(r)
    run_round_robin(runners, work, grad_comm, args.ratio_steps, args.warmup, say, "ratio",
                    unsynced=args.unsynced)
    results = {r.label: summarise(r) for r in runners}
    sgd = results["SGD"]["kinds"]["p"]
    composed: dict[str, Any] = {"SGD": compose({"fi": sgd}, 1, 1) | {"ratio": 1.0}}
    if "iteration_unsynced_s" in sgd:
        composed["SGD"]["ratio_unsynced"] = 1.0
    for label, res in results.items():
        if label == "SGD":
            continue
        kinds = dict(res["kinds"])
        if label != "K-FAC eigen" and set(kinds) != set(KINDS):  # borrow untimed kinds
            for k in KINDS:
                kinds.setdefault(k, results["K-FAC eigen"]["kinds"][k])
        for f, i in SCHEDULES:
            if label.endswith("factor_sync=inverse") and (f, i) == (1, 1):
                continue  # identical to factor_sync="step" at (1, 1)
            c = compose(kinds, f, i)
            c["ratio_of_medians"] = c["iteration_s"] / sgd["iteration_s"]
            c["ratio"] = per_round_ratio(kinds, sgd, f, i)
            if "iteration_unsynced_s" in c and "iteration_unsynced_s" in sgd:
                c["ratio_unsynced"] = per_round_ratio(kinds, sgd, f, i,
                                                      "iteration_unsynced_samples_s")
            composed[f"{label} ({f},{i})"] = c
    direct = None
    if not args.quick:
        direct = direct_check(work, grad_comm, say)
    for r in runners:
        _dispose(r)
    return {"configs": results, "composed": composed, "direct_1_10": direct}


def direct_check(work: Workload, grad_comm: Communicator,
                 say: Callable[[str], None]) -> dict[str, Any]:
    """(1,10) with constant settings over one full period, interleaved with SGD."""
    sgd = build_runner("SGD", work, grad_comm, ("p",), None)
    kfac = build_runner("K-FAC eigen (1,10) constant", work, grad_comm, ("p",),
                        {"strategy": "comm-opt", "factor_update_steps": 1,
                         "inv_update_steps": 10}, fixed_schedule=True)
    assert isinstance(sgd, Runner) and isinstance(kfac, Runner)
    start = time.perf_counter()
    for r in (sgd, kfac):  # step 0 (factor + inverse) is warm-up
        iteration(r, work, "p", grad_comm)
    t_sgd, t_kfac = [], []
    for _ in range(10):  # steps 1..10: nine factor-only steps and one inverse step
        t_sgd.append(iteration(sgd, work, "p", grad_comm)["total"])
        t_kfac.append(iteration(kfac, work, "p", grad_comm)["total"])
    both = WORLD.allgather((t_sgd, t_kfac))
    sgd_s = statistics.median(max(b[0][i] for b in both) for i in range(10))
    kfac_mean = statistics.fmean(max(b[1][i] for b in both) for i in range(10))
    say(f"  direct (1,10): {time.perf_counter() - start:.1f} s")
    _dispose(sgd)
    _dispose(kfac)
    return {"kfac_mean_iteration_s": kfac_mean, "sgd_median_iteration_s": sgd_s,
            "ratio": kfac_mean / sgd_s}


def matrix_configs() -> list[tuple[str, dict[str, Any]]]:
    strategies: list[tuple[str, dict[str, Any]]] = [("comm-opt", {"strategy": "comm-opt"}),
                  ("mem-opt", {"strategy": "mem-opt"}),
                  ("hybrid-opt(0.5)", {"strategy": "hybrid-opt", "grad_worker_fraction": 0.5}),
                  ("dp-kfac", {"strategy": "dp-kfac"})]
    variants: list[tuple[str, dict[str, Any]]] = [("", {})]
    if "symmetric_packing" in ACCEPTED:
        variants.append(("+pack", {"symmetric_packing": True}))
    if "overlap" in ACCEPTED:
        variants += [("+overlap", {"overlap": True}),
                     ("+pack+overlap", {"symmetric_packing": True, "overlap": True})]
    return [(s + v, {**so, **vo}) for s, so in strategies for v, vo in variants]


def matrix_section(work: Workload, grad_comm: Communicator, args: argparse.Namespace,
                   say: Callable[[str], None]) -> dict[str, Any]:
    runners: list[Runner] = []
    rejected: dict[str, str] = {}
    for label, opts in matrix_configs():
        if opts.get("strategy") == "hybrid-opt" and WORLD.Get_size() * 0.5 % 1:
            rejected[label] = "0.5 x world is not a whole number of workers"
            continue
        r = build_runner(label, work, grad_comm, ("fi",), opts)
        if isinstance(r, str):
            rejected[label] = r
        else:
            runners.append(r)
    sgd = build_runner("SGD", work, grad_comm, ("p",), None)
    assert isinstance(sgd, Runner)
    run_round_robin([sgd, *runners], work, grad_comm, args.matrix_steps, args.warmup, say,
                    "matrix")
    results = {r.label: summarise(r) for r in [sgd, *runners]}
    for r in [sgd, *runners]:
        _dispose(r)
    base = results.get("comm-opt")
    if base is not None:
        b_it = base["kinds"]["fi"]["iteration_s"]
        b_bytes = base["kinds"]["fi"]["bytes_per_rank"].get("kfac", 0.0)
        b_mem = base["memory"]["max_bytes"]
        for label, res in results.items():
            if label == "SGD":
                continue
            k = res["kinds"]["fi"]
            mine, ref = k["iteration_samples_s"], base["kinds"]["fi"]["iteration_samples_s"]
            res["vs_comm_opt"] = {
                "iteration": statistics.median(a / b for a, b in zip(mine, ref)),
                "iteration_ratio_of_medians": k["iteration_s"] / b_it,
                "kfac_bytes": (k["bytes_per_rank"].get("kfac", 0.0) / b_bytes) if b_bytes else None,
                "memory": res["memory"]["max_bytes"] / b_mem if b_mem else None,
            }
    return {"configs": results, "rejected": rejected}


def largest_factors(model: nn.Module, top: int = 3) -> list[dict[str, Any]]:
    """The ``top`` largest K-FAC factors of ``model`` (the preconditioner's layer rule)."""
    layers, _ = register_layers(model)
    factors: list[dict[str, Any]] = [
        {"layer": name, "factor": f, "dim": d} for name, curv in layers.items()
        for f, d in (("A", curv.a_dim), ("G", curv.g_dim))]
    return sorted(factors, key=lambda x: -int(x["dim"]))[:top]


def time_eigh(dim: int, dtype: torch.dtype, device: torch.device, runs: int) -> dict[str, Any]:
    """Seconds of ``torch.linalg.eigh`` of a random ``dim``x``dim`` SPD matrix on ``device``."""
    g = torch.Generator().manual_seed(dim)
    x = torch.randn(dim, dim, generator=g, dtype=dtype).to(device)
    a = x @ x.T / dim + 1e-3 * torch.eye(dim, dtype=dtype, device=device)
    del x
    synchronize(device)
    t0 = time.perf_counter()
    w, v = torch.linalg.eigh(a)
    synchronize(device)
    first = time.perf_counter() - t0
    residual = float(torch.linalg.matrix_norm(a @ v - v * w) / torch.linalg.matrix_norm(a))
    del w, v
    times = []
    for _ in range(runs):
        synchronize(device)
        t0 = time.perf_counter()
        torch.linalg.eigh(a)
        synchronize(device)
        times.append(time.perf_counter() - t0)
    return {"dim": dim, "dtype": str(dtype).removeprefix("torch."), "median_s":
            statistics.median(times), "min_s": min(times), "max_s": max(times),
            "samples_s": times, "first_call_s": first, "relative_residual": residual}


def eigh_section(work: Workload, device: torch.device, args: argparse.Namespace,
                 say: Callable[[str], None]) -> dict[str, Any]:
    """Time eigh on rank 0 alone; the other ranks wait without spinning."""
    largest = largest_factors(work.model)
    dims = args.eigh_dims or [largest[0]["dim"]]
    runs = args.eigh_runs or (2 if args.quick else 5)
    rows: list[dict[str, Any]] = []
    if WORLD.Get_rank() == 0:
        for dim in dims:
            for dtype in (torch.float32, torch.float64):
                rows.append(time_eigh(dim, dtype, device, runs))
                say(f"  eigh {dim}x{dim} {rows[-1]['dtype']}: {rows[-1]['median_s']:.3f} s")
    req = WORLD.Ibarrier()
    while not req.Test():
        time.sleep(0.005)
    rows = WORLD.bcast(rows)
    library: str | None = None
    if device.type == "cuda":
        library = str(torch.backends.cuda.preferred_linalg_library())
    return {"device": str(device), "runs": runs, "largest_factors": largest,
            "linalg_library": library, "threads": torch.get_num_threads(), "results": rows}


def eigh_table(res: dict[str, Any], md: bool) -> str:
    big = res["largest_factors"]
    where = ", ".join(f"{f['layer']}.{f['factor']} {f['dim']}" for f in big)
    lib = f", torch linalg library {res['linalg_library']}" if res["linalg_library"] else ""
    rows = [[f"{r['dim']}x{r['dim']}", r["dtype"], f"{r['median_s'] * 1e3:.1f}",
             f"{r['min_s'] * 1e3:.1f}", f"{r['max_s'] * 1e3:.1f}",
             f"{r['first_call_s'] * 1e3:.1f}", f"{r['relative_residual']:.1e}"]
            for r in res["results"]]
    return "\n".join([
        f"torch.linalg.eigh of a random SPD matrix on {res['device']} (rank 0 alone, "
        f"{res['threads']} torch thread(s){lib}; median of {res['runs']} synchronised "
        f"runs after the first call; largest factors of the model: {where}):",
        format_table(["matrix", "dtype", "median ms", "min ms", "max ms", "first call ms",
                      "rel. residual"], rows, md)])


def _dispose(r: Runner) -> None:
    r.averager.remove()
    if r.pre is not None:
        r.pre.remove_hooks()


def reference_throughput(device: torch.device, dim: int, runs: int, info: dict[str, Any],
                         say: Callable[[str], None]) -> dict[str, Any]:
    """The machine's fp32 matmul throughput at this script's torch thread count.

    Measured on rank 0 alone while the others wait without spinning: the reference of a
    phase (what one rank's threads reach with their cores to themselves). The machine's
    limit, the reference of a whole iteration's flops over all ranks, is that rate per
    thread times the cores the ranks can use (``min(cores, ranks on the node × threads)``
    per node). Also measured on every rank at once and recorded, as a reading of the
    momentary load (on a shared machine it moves with other users' work).
    """
    alone: dict[str, Any] | None = None
    if WORLD.Get_rank() == 0:
        alone = matmul_throughput(dim, runs, device)
    req = WORLD.Ibarrier()
    while not req.Test():
        time.sleep(0.005)
    alone = WORLD.bcast(alone)
    assert alone is not None
    together = alone
    per_rank = [alone["flops_per_s"]]
    if WORLD.Get_size() > 1:
        WORLD.Barrier()
        mine = matmul_throughput(dim, runs, device)
        per_rank = WORLD.allgather(mine["flops_per_s"])
        together = mine
    ref = alone["flops_per_s"]
    threads = torch.get_num_threads()
    per_node = info["ranks_on_node"] or 1
    nodes = max(1, WORLD.Get_size() // per_node)
    if device.type == "cuda":  # units are GPUs: ranks of a node share its GPUs
        usable = min(per_node, info.get("cuda_devices") or 1)
        machine = ref * usable * nodes
    else:
        usable = min(info["cores"] or per_node * threads, per_node * threads)
        machine = ref / threads * usable * nodes
    out = {"machine_flops_per_s": machine, "usable_cores": usable, "nodes": nodes,
           "dim": dim, "dtype": "float32", "runs": runs, "threads": torch.get_num_threads(),
           "device": str(device), "alone_flops_per_s": alone["flops_per_s"],
           "alone_best_flops_per_s": alone["best_flops_per_s"],
           "concurrent_flops_per_s_per_rank": per_rank,
           "concurrent_machine_flops_per_s": sum(per_rank),
           "reference_flops_per_s": ref, "samples_s_rank0_alone": alone["samples_s"],
           "samples_s_concurrent_here": together["samples_s"]}
    say(f"# reference: fp32 {dim}x{dim} matmul, {out['threads']} thread(s)/rank: "
        f"{ref / 1e9:.1f} GFLOP/s on rank 0 alone, so {out['machine_flops_per_s'] / 1e9:.1f} "
        f"for the {usable} usable core(s)/GPU(s) x {nodes} node(s); measured with all "
        f"{WORLD.Get_size()} rank(s) computing at once: "
        f"{statistics.fmean(per_rank) / 1e9:.1f} per rank, {sum(per_rank) / 1e9:.1f} in "
        f"all; load average "
        f"{os.getloadavg()[0] if hasattr(os, 'getloadavg') else '?'}")
    return out


def reference_check(device: torch.device, peak: dict[str, Any],
                    say: Callable[[str], None]) -> dict[str, Any]:
    """The reference matmul again on rank 0 alone (drift of a shared machine's load)."""
    again: dict[str, Any] | None = None
    if WORLD.Get_rank() == 0:
        again = matmul_throughput(peak["dim"], peak["runs"], device)
    req = WORLD.Ibarrier()
    while not req.Test():
        time.sleep(0.005)
    again = WORLD.bcast(again)
    assert again is not None
    say(f"# reference check at the end: {again['flops_per_s'] / 1e9:.1f} GFLOP/s on rank 0 "
        f"alone (start: {peak['reference_flops_per_s'] / 1e9:.1f})")
    return {"alone_flops_per_s": again["flops_per_s"], "samples_s": again["samples_s"]}


# ----------------------------------------------------------------------- reporting
def flops_tables(res: dict[str, Any], peak: dict[str, Any], md: bool) -> str:
    """Per composed configuration and phase: flops per iteration (mean rank), the
    GFLOP/s reached in the phase's time, and its share of the reference throughput."""
    ref = peak["reference_flops_per_s"]
    machine_ref = peak["machine_flops_per_s"]
    ranks = WORLD.Get_size()

    def rate(flops: float, seconds: float) -> str:
        if flops <= 0 or seconds <= 0:
            return "-"
        return f"{flops / seconds / 1e9:.2f} ({100 * flops / seconds / ref:.0f}%)"

    counts, rates = [], []
    for label, c in res["composed"].items():
        fl = c.get("flops")
        if not fl:
            continue
        s = c["split_s"]
        total, seconds = sum(fl.values()), sum(s[p] for p in PHASES)
        counts.append([label] + [f"{fl[p] / 1e6:.1f}" for p in FLOP_PHASES]
                      + [f"{total / 1e6:.1f}"])
        machine_share = total * ranks / c["iteration_s"] / machine_ref
        rates.append([label] + [rate(fl[p], s[p]) for p in FLOP_PHASES]
                     + [rate(total, seconds), f"{100 * machine_share:.1f}%"])
    if not counts:
        return ""
    where = (f"fp32 {peak['dim']}² matmul at {peak['threads']} thread(s) on one rank alone: "
             f"{ref / 1e9:.1f} GFLOP/s; the machine: that per thread (GPU) x "
             f"{peak['usable_cores']} usable core(s) (GPUs) x {peak['nodes']} node(s) = "
             f"{machine_ref / 1e9:.1f} GFLOP/s")
    return "\n".join([
        "\nFlops per iteration (MFLOP, mean rank; one multiply-add = 2 flops; forward/"
        "backward: FlopCounterMode of matmuls and convolutions; factor stats: dense Gram "
        "count of shapes.statistics_flops; decomposition: 4d³ per eigh, d³ per inverse; "
        "precondition: its GEMMs; other: running averages + KL clip):",
        format_table(["config", *FLOP_PHASES, "iteration"], counts, md),
        f"\nGFLOP/s reached in each phase's time (mean rank) and % of the reference ({where}; "
        "backward includes the gradient allreduce; iteration = the mean rank's flops over "
        "its iteration time; machine = every rank's flops over the (slowest rank's) "
        "iteration time, % of the machine's throughput):",
        format_table(["config", *FLOP_PHASES, "iteration", "machine"], rates, md)])


def ratio_tables(res: dict[str, Any], md: bool, peak: dict[str, Any] | None = None) -> str:
    out = []
    rows = []
    plain = all("ratio_unsynced" in c for c in res["composed"].values())
    for label, c in res["composed"].items():
        s = c["split_s"]
        extra = [ms(c["iteration_unsynced_s"]), f"{c['ratio_unsynced']:.2f}"] if plain else []
        rows.append([label, ms(c["iteration_s"]), f"{c['ratio']:.2f}",
                     f"{c.get('ratio_of_medians', 1.0):.2f}", *extra]
                    + [ms(s[p]) for p in PHASES])
    plain_head = ["iter ms, no phase sync", "x SGD, no phase sync"] if plain else []
    out += ["K-FAC / SGD iteration time (ms; split = mean rank; (F,I) = factor, inverse "
            "update steps, composed from timed iteration kinds; x SGD = median over rounds "
            "of the ratio within a round"
            + ("; phases synchronise the device at their boundaries, 'no phase sync' = the "
               "same iterations timed whole, synchronised only at start and end" if plain
               else "") + "):",
            format_table(["config", "iter ms", "x SGD", "x SGD (medians)", *plain_head,
                          *PHASES], rows, md)]
    rows = []
    for label, cfg in res["configs"].items():
        for kind, k in cfg["kinds"].items():
            s = k["split_s"]
            b = k["bytes_per_rank"]
            extra = [ms(k["iteration_unsynced_s"])] if plain else []
            rows.append([f"{label} [{kind}]", ms(k["iteration_s"]), *extra]
                        + [ms(s[p]) for p in PHASES]
                        + [kib(b.get(t, 0.0)) for t in ("factors", "decompositions",
                                                        "gradients", "grad avg")])
    out += ["\nTimed iteration kinds (fi = factor+inverse update, f = factor update only, "
            "p = neither; ms, bytes in KiB per rank per step):",
            format_table(["config [kind]", "iter ms", *plain_head[:1], *PHASES, "KiB factors",
                          "KiB decomp", "KiB grads", "KiB grad avg"], rows, md)]
    d = res.get("direct_1_10")
    if d:
        comp = res["composed"].get("K-FAC eigen (1,10)")
        out.append(f"\nDirect (1,10) over one period: K-FAC {ms(d['kfac_mean_iteration_s'])} ms "
                   f"mean vs SGD {ms(d['sgd_median_iteration_s'])} ms: {d['ratio']:.2f}x "
                   f"(composed: {comp['ratio']:.2f}x)" if comp else "")
    if peak is not None:
        out.append(flops_tables(res, peak, md))
    return "\n".join(out)


def matrix_tables(res: dict[str, Any], md: bool) -> str:
    rows = []
    for label, cfg in res["configs"].items():
        if label == "SGD":
            continue
        k = cfg["kinds"]["fi"]
        b = k["bytes_per_rank"]
        mem = cfg["memory"]
        v = cfg.get("vs_comm_opt", {})

        def x(key: str, v: dict[str, Any] = v) -> str:
            return "-" if v.get(key) is None else f"{v[key]:.2f}"

        kfac_ms = sum(k["split_s"][p] for p in PHASES[3:])
        rows.append([label, ms(k["iteration_s"]), x("iteration"), ms(kfac_ms),
                     kib(b.get("kfac", 0.0)), kib(b.get("factors", 0.0)),
                     kib(b.get("decompositions", 0.0)), kib(b.get("gradients", 0.0)),
                     x("kfac_bytes"), kib(mem.get("max_bytes", 0)), x("memory")])
    sgd = res["configs"]["SGD"]["kinds"]["p"]
    out = [f"Strategy matrix at (1,1) (every iteration a second-order update; x comm-opt of "
           f"time = median over rounds of the ratio within a round; step ms excl. stats = "
           f"mean rank's time in factor comm .. other, the strategy-dependent part); SGD "
           f"{ms(sgd['iteration_s'])} ms, gradient allreduce "
           f"{kib(sgd['bytes_per_rank'].get('grad avg', 0.0))} KiB/rank/step:",
           format_table(["strategy", "iter ms", "x comm-opt", "step ms excl. stats",
                         "K-FAC KiB/rank/step",
                         "factors", "decomp", "grads", "bytes x comm-opt", "mem KiB/rank",
                         "mem x comm-opt"], rows, md)]
    rows = []
    for label, cfg in res["configs"].items():
        s = cfg["kinds"]["fi" if label != "SGD" else "p"]["split_s"]
        rows.append([label] + [ms(s[p]) for p in PHASES])
    out += ["\nTime split per strategy (ms, mean rank):",
            format_table(["strategy", *PHASES], rows, md)]
    if res["rejected"]:
        out.append("\nRejected by the constructor: " + "; ".join(
            f"{k} ({v})" for k, v in res["rejected"].items()))
    return "\n".join(out)


def plot_split(bars: dict[str, dict[str, float]], title: str, path: Path) -> Path:
    plt = pyplot()
    labels = list(bars)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(labels) + 2), 4.8))
    bottom = [0.0] * len(labels)
    for phase, color in zip(PHASES, COLORS):
        vals = [bars[lab][phase] * 1e3 for lab in labels]
        ax.bar(range(len(labels)), vals, bottom=bottom, color=color, label=phase)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("ms per iteration (mean rank)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.grid(True, axis="y", alpha=0.3)
    return save_figure(fig, path)


def plot_matrix(res: dict[str, Any], title: str, path: Path) -> Path:
    plt = pyplot()
    cfgs = {k: v for k, v in res["configs"].items() if k != "SGD"}
    labels = list(cfgs)
    xs = range(len(labels))
    fig, axes = plt.subplots(3, 1, figsize=(max(7.0, 0.7 * len(labels) + 3), 11), sharex=True)
    bottom = [0.0] * len(labels)
    for tag, color in zip(BYTE_TAGS, COLORS[3:]):
        vals = [cfgs[lab]["kinds"]["fi"]["bytes_per_rank"].get(tag, 0.0) / 2**20
                for lab in labels]
        axes[0].bar(xs, vals, bottom=bottom, color=color, label=tag)
        bottom = [b + v for b, v in zip(bottom, vals)]
    axes[0].set_ylabel("K-FAC MiB per rank per step")
    axes[0].legend(fontsize=7)
    bottom = [0.0] * len(labels)
    for phase, color in zip(PHASES, COLORS):
        vals = [cfgs[lab]["kinds"]["fi"]["split_s"][phase] * 1e3 for lab in labels]
        axes[1].bar(xs, vals, bottom=bottom, color=color, label=phase)
        bottom = [b + v for b, v in zip(bottom, vals)]
    sgd = res["configs"]["SGD"]["kinds"]["p"]["iteration_s"] * 1e3
    axes[1].axhline(sgd, color="k", ls=":", lw=1, label="SGD")
    axes[1].set_ylabel("ms per iteration (mean rank)")
    axes[1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    axes[2].bar(xs, [cfgs[lab]["memory"]["max_bytes"] / 2**20 for lab in labels],
                color=COLORS[4])
    axes[2].set_ylabel("K-FAC state MiB (max rank)")
    axes[2].set_xticks(list(xs))
    axes[2].set_xticklabels(labels, rotation=35, ha="right", fontsize=8)
    for ax in axes:
        ax.grid(True, axis="y", alpha=0.3)
    axes[0].set_title(title, fontsize=9)
    return save_figure(fig, path)


# ---------------------------------------------------------------------------- main
def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=("all", "mlp", "resnet20", "resnet50"), default=None,
                   help="default: all = mlp and resnet20 (mlp with --quick); resnet50 only "
                        "when named (ImageNet shapes, 1000 classes)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cuda: cuda:<local rank mod GPUs>, phases synchronised (default cpu)")
    p.add_argument("--whole-iteration", choices=("auto", "yes", "no"), default="auto",
                   help="also time every ratio-section iteration without phase "
                        "synchronisation (default auto: on CUDA only)")
    p.add_argument("--steps", type=int, default=None,
                   help="timed rounds per configuration and kind (default: mlp 30 in the "
                        "ratio section, 20 in the matrix; resnet20 4 and 3; 2 with --quick)")
    p.add_argument("--warmup", type=int, default=1,
                   help="untimed rounds first (default 1; bytes are counted in the last)")
    p.add_argument("--batch", type=int, default=32, help="per-rank batch size (default 32)")
    p.add_argument("--image-size", type=int, default=32,
                   help="resnet20's input height and width (default 32, CIFAR; 8 = the "
                        "synthetic 3x8x8 task of time_to_accuracy.py and the driver)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads per rank (default: cores / ranks on the node, >= 1)")
    p.add_argument("--sections", nargs="+", choices=("ratio", "matrix", "eigh"),
                   default=["ratio", "matrix", "eigh"])
    p.add_argument("--eigh-dims", type=int, nargs="+", default=None,
                   help="matrix sizes for the eigh section (default: the model's largest "
                        "factor)")
    p.add_argument("--eigh-runs", type=int, default=None,
                   help="timed eigh calls per size and dtype (default 5; 2 with --quick)")
    p.add_argument("--kfac-approx", choices=("expand", "reduce"), default="expand",
                   help="K-FAC approximation of every K-FAC configuration (kfac_approx=; "
                        "default expand); reduce writes ..._reduce.json / .png")
    p.add_argument("--peak-dim", type=int, default=2048,
                   help="size of the fp32 matmul whose throughput is the reference of the "
                        "flops tables (default 2048; 0: no reference, no flops tables)")
    p.add_argument("--peak-runs", type=int, default=3,
                   help="timed matmuls for the reference (median; at least this many and "
                        "0.5 s; default 3)")
    p.add_argument("--quick", action="store_true",
                   help="few rounds, MLP unless --model is given: a smoke run")
    p.add_argument("--markdown", action="store_true", help="print the tables as Markdown")
    p.add_argument("--out", type=Path, default=OUT_DIR, help=f"output folder (default {OUT_DIR})")
    return p.parse_args(argv)


def models_of(args: argparse.Namespace) -> Iterator[str]:
    choice = args.model or ("mlp" if args.quick else "all")
    yield from (("mlp", "resnet20") if choice == "all" else (choice,))


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    device = select_device(args.device)
    SYNC.cuda = SYNC.phases = device.type == "cuda"
    args.unsynced = (args.whole_iteration == "yes"
                     or (args.whole_iteration == "auto" and device.type == "cuda"))
    suffix = ("_cuda" if device.type == "cuda" else "") + (
        "_reduce" if args.kfac_approx == "reduce" else "") + (
        f"_img{args.image_size}" if args.image_size != 32 else "")
    if "kfac_approx" in ACCEPTED:
        EXTRA_OPTIONS["kfac_approx"] = args.kfac_approx
    elif args.kfac_approx != "expand":
        raise SystemExit("--kfac-approx reduce: this KFACPreconditioner has no kfac_approx")
    info = machine()
    info["devices"] = WORLD.allgather(str(device))
    threads = args.threads or max(1, (info["cores"] or 1) // max(1, info["ranks_on_node"]))
    torch.set_num_threads(threads)
    info["torch_threads_per_rank"] = threads

    def say(msg: str) -> None:
        if rank == 0:
            print(msg, flush=True)

    present = [o for o in ("symmetric_packing", "overlap", "bucket_cap_mb", "factor_sync",
                           "local_decomposition_threshold") if o in ACCEPTED]
    say(f"# kfac_step: {describe(info)}; {threads} torch thread(s)/rank; device per rank: "
        f"{', '.join(info['devices'])}"
        + ("; phases synchronise the device" if SYNC.phases else ""))
    say(f"# preconditioner options present: {', '.join(present) or '(none)'}; "
        f"kfac_approx={args.kfac_approx}")
    reference = (reference_throughput(device, args.peak_dim, args.peak_runs, info, say)
                 if args.peak_dim > 0 else None)
    grad_comm = Communicator(WORLD.Dup(), name="grad-avg")
    for name in models_of(args):
        ratio_steps, matrix_steps = DEFAULT_STEPS[name]
        if args.quick:
            ratio_steps = matrix_steps = 2
        if args.steps:
            ratio_steps = matrix_steps = args.steps
        run_args = argparse.Namespace(**{**vars(args), "ratio_steps": ratio_steps,
                                         "matrix_steps": matrix_steps,
                                         "warmup": max(1, args.warmup)})
        work = make_workload(name, args.batch, device, args.image_size)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        say(f"\n## {name} at {size} rank(s), per-rank batch {args.batch}, "
            f"{ratio_steps} (ratio) / {matrix_steps} (matrix) timed rounds after "
            f"{run_args.warmup} warm-up")
        record: dict[str, Any] = {"machine": info, "model": name, "world_size": size,
                                  "device": device.type, "phase_sync": SYNC.phases,
                                  "whole_iteration_timed": args.unsynced,
                                  "batch_per_rank": args.batch,
                                  "steps": {"ratio": ratio_steps, "matrix": matrix_steps},
                                  "warmup": run_args.warmup, "options_present": present,
                                  "option_defaults": {
                                      o: repr(inspect.signature(KFACPreconditioner)
                                              .parameters[o].default) for o in present},
                                  "quick": args.quick, "kfac_approx": args.kfac_approx,
                                  "reference_throughput": reference,
                                  "model_flops": {"forward": work.forward_flops,
                                                  "backward": work.backward_flops}}
        if "ratio" in args.sections:
            res = ratio_section(work, grad_comm, run_args, say)
            record["ratio"] = res
            say(ratio_tables(res, args.markdown, reference))
            if rank == 0:
                bars = {k.replace("K-FAC ", ""): c["split_s"] for k, c in res["composed"].items()}
                where = (f"{device.type}" if device.type == "cuda"
                         else f"{threads} thread(s)/rank, {info['cores']} cores")
                say(figure_note(
                    plot_split,
                    bars, f"{name}, {size} rank(s), {where}: time split per iteration",
                    args.out / f"kfac_step_{name}_n{size}{suffix}_split.png"))
        if "matrix" in args.sections and size > 1:
            res = matrix_section(work, grad_comm, run_args, say)
            record["matrix"] = res
            say("\n" + matrix_tables(res, args.markdown))
            if rank == 0:
                say(figure_note(
                    plot_matrix,
                    res, f"{name}, {size} ranks, {device.type}, (1,1): bytes, time split "
                    "and memory per strategy",
                    args.out / f"kfac_step_{name}_n{size}{suffix}_matrix.png"))
        if "eigh" in args.sections:
            res = eigh_section(work, device, args, say)
            record["eigh"] = res
            say("\n" + eigh_table(res, args.markdown))
        if device.type == "cuda":
            peak = WORLD.allgather(torch.cuda.max_memory_allocated(device))
            record["cuda_peak_allocated_bytes_per_rank"] = peak
            say(f"# CUDA peak memory allocated (max over ranks): {max(peak) / 2**30:.2f} GiB")
        if reference is not None:
            record["reference_check_end"] = reference_check(device, reference, say)
        if hasattr(os, "getloadavg"):
            record["load_average_1m_end"] = round(os.getloadavg()[0], 2)
            say(f"# load average (1 min) at the end: {record['load_average_1m_end']}")
        if rank == 0:
            say(f"wrote {write_json(args.out / f'kfac_step_{name}_n{size}{suffix}.json', record)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
