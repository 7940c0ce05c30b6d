"""Shampoo step: per-iteration time of DistributedShampoo against Adam(W) and Meta's, bytes, memory.

    launch/local -n 4 python benchmarks/shampoo_step.py [--model all|mlp|resnet20|resnet50]
        [--device cpu|cuda] [--configs adam adamw shampoo meta] [--steps N] [--warmup W]
        [--batch B] [--image-size S] [--max-dim D] [--frequency F] [--max-seconds S]
        [--root-method eigen|newton] [--decomposition-streams S] [--precision full|tf32]
        [--cuda-graphs]
        [--meta-src DIR] [--quick]
        [--markdown] [--out benchmarks/out]
    launch/local -n 1 python benchmarks/shampoo_step.py --device cuda --model resnet50  # GPU

Models: an MLP on 64-feature inputs (hidden 256, 128; 10 classes), the CIFAR ResNet-20
on a synthetic 32x32x3 batch (``all`` = these two), and ResNet-50 (only when named:
ImageNet shapes 3x``S``x``S``, ``--image-size`` S default 224, 1000 classes;
torchvision's ``resnet50()`` when torchvision imports, else ``kfac_hpc.models``
``resnet50``, the same network; ``--resnet50`` picks one); per-rank batch ``--batch``
(32), one fixed synthetic batch per rank (data loading is not measured). Gradients are
averaged with :class:`kfac_hpc.GradientAverager` (its own communicator; nothing is sent
at 1 rank), then the optimizer steps. ``--device cuda`` puts everything on
``cuda:<local rank mod GPUs>`` (exits with the reason when torch sees no GPU).

Configurations (``--configs``), each with its own copy of the model (same initial
weights) and its own communicators (``Dup`` s of the world):

* ``adam``: ``torch.optim.Adam`` (lr 1e-3; the diagonal adaptive baseline).
* ``adamw``: ``torch.optim.AdamW`` (lr 1e-3, betas (0.9, 0.999), eps 1e-8, decoupled
  weight decay ``--weight-decay``).
* ``shampoo``: kfac_hpc's ``DistributedShampoo`` (float32 factors and communication,
  Adam grafting: ``grafting="adam"``, ``grafting_beta2`` 0.999, ``grafting_epsilon``
  1e-8; betas (0.9, 0.999), epsilon 1e-12, ``max_preconditioner_dim`` D, decoupled
  weight decay ``--weight-decay``: AdamW grafting), its roots by ``--root-method``:
  ``eigen`` (``EigenRoots()``, the default: batched ``eigh``) or ``newton``
  (``NewtonRoots()``: the coupled Newton iteration, GEMMs only; Meta's keeps its default,
  eigendecomposition, either way), its eigen-path solves spread over
  ``--decomposition-streams`` CUDA streams (``decomposition_streams``, default the library's, 8).
* ``meta``: Meta's ``DistributedShampoo`` (facebookresearch/optimizers, package
  ``distributed_shampoo``) with the same settings in its terms:
  ``grafting_config=AdamPreconditionerConfig(beta2=0.999, epsilon=1e-8)``, betas
  (0.9, 0.999), ``epsilon=1e-12``, ``max_preconditioner_dim=D``, ``weight_decay`` with
  ``weight_decay_type=WeightDecayType.DECOUPLED`` (its default: AdamW grafting), and its
  defaults otherwise (``DefaultShampooConfig``: root inverse by eigendecomposition,
  float32 factors; ``DefaultSingleDeviceDistributedConfig``: no distribution, every
  rank computes every block). It needs only torch (Python >= 3.12 is what it states;
  it imports on 3.11 here). It is imported from an installed copy or from
  ``--meta-src`` (default ``$META_SRC``, else ``<repo>/.peers/meta`` when it exists,
  else ``/tmp/meta_src``), a folder holding the ``distributed_shampoo/`` package folder,
  extracted (never committed: ``/.peers/`` is in ``.git/info/exclude``) with
  ``git -C <optimizers clone> archive HEAD distributed_shampoo | tar -x -C .peers/meta``.

Default configurations: ``adam shampoo`` on the CPU, ``adamw shampoo meta`` on CUDA.
The first of ``adam``/``adamw`` selected is the baseline of the overhead column.
``--weight-decay`` defaults to 0.01 (AdamW's default) when ``adamw`` is selected, else 0.

Two kinds of Shampoo steps are timed: ``root`` (every block recomputes its roots) and
``plain`` (factor update + preconditioning with stale roots), by setting each
parameter group's ``precondition_frequency`` before the step: 1 for ``root``, 10⁹ for
``plain`` (both libraries read it at every step; both are built with
``precondition_frequency=1`` and ``start_preconditioning_step=1``, so Shampoo's
direction is used from the first step: Meta's default start, -1, would mean
``precondition_frequency`` steps of grafting alone). An iteration with
``precondition_frequency`` F costs ``plain + (root - plain)/F`` (amortised); the table
composes F = 1, 10, ``--frequency`` (default 50) and 100.

How it is measured:

* Set-up: the configurations are built one after the other; each takes its first
  step (roots of every block, lazy state) and, for Shampoo, one ``plain`` step, right
  after it is built (untimed). On CUDA the peak memory counter is reset before each is
  built, and its peak is ``torch.cuda.max_memory_allocated`` minus what was allocated
  before (its own model, gradients, optimizer state, activations and workspaces; the
  configurations built earlier and the shared batch are not counted; max over ranks).
* Configurations/kinds run round-robin, one iteration each per round, with a
  barrier before each, so drifts of a shared, oversubscribed machine hit all alike. A
  ``plain`` iteration is the last of :data:`PLAIN_RUN` plain steps in a row (the others
  untimed), as a schedule's plain steps follow each other: with ``cuda_graphs`` the
  step after a root step waits for its key to repeat, the next captures, and the steady
  plain steps replay (one plain step after each root step, as this script timed before,
  never replayed: its "graphed" plain steps were eager). Every configuration runs the
  same steps. A run with the graphs on whose plain steps never replayed says so.
* Per iteration, per rank: *fwd+bwd* (forward, loss, backward, gradient averaging)
  and *step* (``optimizer.step()``); on CUDA the device is synchronised before,
  between and after them (``torch.cuda.synchronize()``), so each part is charged its
  own kernels. The iteration's time is the slowest rank's (MAX over ranks of each part);
  reported numbers are medians over ``--steps`` rounds after ``--warmup`` rounds.
* Bytes per step: the library's counters (``Communicator.traffic()``) of the
  optimizer's communicator (kfac_hpc's Shampoo: one ``allgatherv``; Meta's sends
  nothing) and of the averager's, divided by the steps; the counters are deterministic.
* State memory per rank: kfac_hpc's ``DistributedShampoo.memory_bytes()`` (block state
  this rank owns, plus the two gather buffers, or on one rank the directions the step
  keeps), max over ranks; "all blocks" is the sum
  over ranks of the state, i.e. what every rank would hold if every block's state were
  replicated. Adam(W) and Meta: the distinct tensor storages in ``optimizer.state``
  (Meta: factor matrices, roots, grafting and filtered-gradient state; it stores
  factors packed as triangles by default).

Wall time and defaults on CUDA: ``--steps 8 --warmup 0 --max-seconds 100`` (the set-up
steps are the warm-up: every configuration and kind has run once). On an H200,
ResNet-50 at batch 32 (nominal, :data:`NOMINAL_H200_S`): fwd+bwd about 0.02 s; a
``plain`` Shampoo step about 0.3 s, a ``root`` step about 3 s (hundreds of
eigendecompositions of blocks up to 1024); so a round of AdamW + 2 libraries x (root +
plain) is about 6.7 s; start-up (imports, CUDA context, model) about 25 s, the set-up
steps about one round, then 8 rounds: about 85 s in all, printed at the start. Should a
root step take 10 s, ``--max-seconds`` stops after 3 timed rounds, at about 110 s.
rank 0 prints another estimate after the set-up steps (from their times: an upper bound,
they include one-time costs). ``--max-seconds S`` (0: never) ends the timed rounds early,
after at least ``--min-steps`` of them, once the time since the process started plus
the last round's time would pass S (rank 0 decides, every rank follows); the number of
timed rounds is printed and recorded.

Writes ``shampoo_step_<model>_n<ranks>[_cuda][_newton][_streams<S>][_merge_first].json``
under ``--out`` (``_streams<S>``: not the library's default count); prints the
tables on rank 0 (Markdown with ``--markdown``). Compare runs at 1, 2 and 4 ranks by
running it three times.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from mpi4py import MPI
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (
    OUT_DIR,
    NoGPUError,
    cuda_memory,
    describe,
    format_table,
    imagenet_resnet50,
    import_peer,
    machine,
    peer_source,
    peer_version,
    process_seconds,
    reset_cuda_peak,
    select_device,
    synchronize,
    tensor_bytes,
    write_json,
)

from kfac_hpc import GradientAverager, step_graph
from kfac_hpc.comm import Communicator
from kfac_hpc.models import build_model
from kfac_hpc.shampoo import DistributedShampoo, root_method_from
from kfac_hpc.shampoo.blocking import MERGE_ORDERS
from kfac_hpc.shampoo.root_methods import ROOT_METHOD_NAMES
from kfac_hpc.solves import default_device_streams

FREQUENCIES = (1, 10, 100)  # composed in the table, with --frequency
NEVER = 10**9
CONFIGS = ("adam", "adamw", "shampoo", "meta")
SHAMPOOS = ("shampoo", "meta")
BASELINES = ("adam", "adamw")
ROOT, PLAIN, STEP = "root", "plain", "step"
#: Plain steps in a row per timed plain iteration (the last is timed): a schedule's steady
#: plain step (with cuda_graphs: after the eager one and the capture, a replay).
PLAIN_RUN = 3
FWD_BWD = "fwd+bwd"  # a profiled forward and backward, not a kind of step
CUDA_DEFAULTS = {"steps": 8, "warmup": 0, "max_seconds": 100.0}  # the set-up steps warm up
#: seconds on an H200, ResNet-50, batch 32, fp32 (the nominal wall-time estimate): fwd+bwd,
#: an Adam(W) step, a Shampoo step with stale roots, one recomputing every root
NOMINAL_H200_S = {"fwd_bwd": 0.02, "adam": 0.005, PLAIN: 0.3, ROOT: 3.0}
STARTUP_S = 25.0  # imports, MPI and CUDA start, model construction (nominal)
CPU_DEFAULTS = {"steps": 10, "warmup": 2, "max_seconds": 0.0}
META_HELP = """\
Meta's Distributed Shampoo (facebookresearch/optimizers, package `distributed_shampoo`)
is not importable. Extract its package folder (it needs only torch) and point --meta-src
at the folder holding it, e.g.
    git clone https://github.com/facebookresearch/optimizers /tmp/meta_src
    python benchmarks/shampoo_step.py --meta-src /tmp/meta_src ...
(default: $META_SRC, else <repo>/.peers/meta, else /tmp/meta_src), or leave `meta` out
of --configs."""


def import_meta(src: str) -> Any:
    """Meta's ``distributed_shampoo`` module, from an install or from ``src``.

    Args:
        src: a folder holding the ``distributed_shampoo/`` package folder (may be empty).

    Returns:
        The module, or None (with the reason on stderr) when it does not import.
    """
    return import_peer("distributed_shampoo", src, "DistributedShampoo")


def make_model(name: str, image_size: int | None = None, resnet50: str = "auto") -> tuple[
        nn.Module, Callable[[int], tuple[torch.Tensor, torch.Tensor]], str]:
    """The model (CPU) and a batch maker ``n -> (x, y)`` (CPU) for ``name``.

    Args:
        name: ``mlp``, ``resnet20`` or ``resnet50``.
        image_size: ResNet-50's input height/width (default 224).
        resnet50: ``auto``, ``torchvision`` or ``kfac_hpc`` (see
            :func:`common.imagenet_resnet50`).

    Returns:
        ``(model, batch, description)``.
    """
    torch.manual_seed(0)
    if name == "mlp":
        model = build_model("mlp", num_classes=10, input_dim=64, hidden=(256, 128))

        def batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
            return torch.randn(n, 64), torch.randint(0, 10, (n,))
        return model, batch, "kfac_hpc.models mlp, 64 features"
    if name == "resnet50":
        size = image_size or 224
        model, what = imagenet_resnet50(1000, size, resnet50)

        def batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
            return torch.randn(n, 3, size, size), torch.randint(0, 1000, (n,))
        return model, batch, f"{what}, 3x{size}x{size}, 1000 classes"
    model = build_model(name, num_classes=10, in_channels=3, image_size=32)

    def cifar(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(n, 3, 32, 32), torch.randint(0, 10, (n,))
    return model, cifar, f"kfac_hpc.models {name}, 3x32x32"


class Runner:
    """One configuration: model copy, optimizer, gradient averager, communicators.

    Args:
        base: the model to copy (CPU).
        make_opt: builds the optimizer from the copy and the optimizer's communicator.
        device: where the copy and its state live.
        kinds: the kinds of step this configuration times.
    """

    def __init__(self, base: nn.Module, make_opt: Callable[[nn.Module, Communicator], Any],
                 device: torch.device, kinds: tuple[str, ...]) -> None:
        self.device = device
        self.kinds = kinds
        self.model = copy.deepcopy(base).to(device)
        self.opt_comm = Communicator(MPI.COMM_WORLD.Dup(), name="optimizer")
        self.grad_comm = Communicator(MPI.COMM_WORLD.Dup(), name="gradients")
        self.averager = GradientAverager(self.model, self.grad_comm)
        self.opt = make_opt(self.model, self.opt_comm)
        self.cuda_peak = 0
        self.first_s: dict[str, float] = {}

    def set_kind(self, kind: str) -> None:
        """``root``: recompute every root at the next step; ``plain``: none."""
        if kind in (ROOT, PLAIN):
            for group in self.opt.param_groups:
                group["precondition_frequency"] = 1 if kind == ROOT else NEVER

    def iteration(self, x: torch.Tensor, y: torch.Tensor, kind: str) -> tuple[float, float]:
        """One iteration of ``kind``; returns (fwd+bwd, step) seconds on this rank."""
        self.set_kind(kind)
        synchronize(self.device)
        t0 = time.perf_counter()
        self.opt.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(self.model(x), y)
        loss.backward()
        self.averager.synchronize()
        synchronize(self.device)
        t1 = time.perf_counter()
        self.opt.step()
        synchronize(self.device)
        t2 = time.perf_counter()
        return t1 - t0, t2 - t1


def state_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes of the distinct tensor storages in ``opt.state``."""
    return tensor_bytes(list(opt.state.values()))


def profile_steps(runner: Runner, x: torch.Tensor, y: torch.Tensor,
                  top: int = 12) -> dict[str, Any]:
    """One forward+backward and one optimizer step of each kind of ``runner`` under
    ``torch.profiler``.

    Per kind: host (CPU) and device milliseconds summed over the step's operators,
    kernel launches, and the operators with the most device time (self), so a run on a
    GPU says where a step's time goes (GEMMs, the eigensolver, element-wise kernels).
    The forward+backward (:data:`FWD_BWD`, the same for every optimizer but for what
    each leaves behind: memory, parameter layouts) shows whether one optimizer makes
    the model's own kernels slower.
    """
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if runner.device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    out: dict[str, Any] = {}

    def forward_backward() -> None:
        runner.opt.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(runner.model(x), y).backward()
        runner.averager.synchronize()
        synchronize(runner.device)

    for kind in (FWD_BWD, *runner.kinds):
        if kind != FWD_BWD:
            runner.set_kind(kind)
            forward_backward()
        synchronize(runner.device)
        with profile(activities=activities) as prof:
            if kind == FWD_BWD:  # after the timed rounds' steps: what the optimizer left
                forward_backward()
            else:
                runner.opt.step()
            synchronize(runner.device)
        events = prof.key_averages()
        launches = sum(e.count for e in events if e.key in (
            "cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC"))
        ranked = sorted(events, key=lambda e: e.self_device_time_total or e.self_cpu_time_total,
                        reverse=True)[:top]
        out[kind] = {
            "host ms": sum(e.self_cpu_time_total for e in events) / 1e3,
            "device ms": sum(e.self_device_time_total for e in events) / 1e3,
            "kernel launches": launches,
            "top": [(e.key, e.count, e.self_device_time_total / 1e3,
                     e.self_cpu_time_total / 1e3) for e in ranked],
        }
    return out


def optimizers(args: argparse.Namespace, meta: Any) -> dict[
        str, Callable[[nn.Module, Communicator], Any]]:
    """Constructors of the selected configurations (model copy, communicator) -> optimizer."""
    wd = args.weight_decay
    made: dict[str, Callable[[nn.Module, Communicator], Any]] = {
        "adam": lambda m, c: torch.optim.Adam(m.parameters(), lr=1e-3),
        "adamw": lambda m, c: torch.optim.AdamW(m.parameters(), lr=1e-3, betas=(0.9, 0.999),
                                                eps=1e-8, weight_decay=wd),
        "shampoo": lambda m, c: DistributedShampoo(
            m.named_parameters(), lr=1e-3, betas=(0.9, 0.999), epsilon=1e-12,
            weight_decay=wd, decoupled_weight_decay=True, max_preconditioner_dim=args.max_dim,
            merge_dims_from=args.merge_dims_from, precondition_frequency=1,
            start_preconditioning_step=1, grafting="adam",
            grafting_beta2=0.999, grafting_epsilon=1e-8, comm=c,
            root_method=root_method_from(args.root_method),
            decomposition_streams=args.decomposition_streams,
            precondition_vectors=not args.vectors_to_grafting,
            statistics_frequency=args.statistics_frequency,
            stats_precision=args.precision, precondition_precision=args.precision,
            cuda_graphs=args.cuda_graphs),
    }
    if meta is not None:
        made["meta"] = lambda m, c: meta.DistributedShampoo(
            m.parameters(), lr=1e-3, betas=(0.9, 0.999), epsilon=1e-12, weight_decay=wd,
            weight_decay_type=meta.WeightDecayType.DECOUPLED,
            max_preconditioner_dim=args.max_dim, precondition_frequency=1,
            start_preconditioning_step=1,
            grafting_config=meta.AdamPreconditionerConfig(beta2=0.999, epsilon=1e-8))
    return {c: made[c] for c in args.configs}


def run_model(name: str, args: argparse.Namespace, comm: Communicator, device: torch.device,
              meta: Any, say: Callable[[str], None]) -> dict[str, Any]:
    """Set up, run the rounds and summarise one model (collective)."""
    base, batch, what = make_model(name, args.image_size, args.resnet50)
    torch.manual_seed(1 + comm.rank)
    x, y = (t.to(device) for t in batch(args.batch))
    n_params = sum(p.numel() for p in base.parameters())
    say(f"## {name}: {what}, {n_params:,} parameters, batch {args.batch}/rank")
    runners: dict[str, Runner] = {}
    for config, make_opt in optimizers(args, meta).items():
        reset_cuda_peak(device)
        before, _ = cuda_memory(device)
        kinds = (ROOT, PLAIN) if config in SHAMPOOS else (STEP,)
        runner = Runner(base, make_opt, device, kinds)
        for kind in kinds:  # first step: roots of every block, lazy state
            runner.first_s[kind] = sum(runner.iteration(x, y, kind))
        _, peak = cuda_memory(device)
        runner.cuda_peak = int(MPI.COMM_WORLD.allreduce(peak - before, op=MPI.MAX))
        runner.opt_comm.reset_traffic()
        runner.grad_comm.reset_traffic()
        runners[config] = runner
    round_s = float(MPI.COMM_WORLD.allreduce(
        sum(s * (PLAIN_RUN if kind == PLAIN else 1) for r in runners.values()
            for kind, s in r.first_s.items()), op=MPI.MAX))
    total = process_seconds() + (args.warmup + args.steps) * round_s
    say(f"# estimated wall time: {process_seconds():.0f} s so far + {args.warmup + args.steps} "
        f"rounds x {round_s:.2f} s (set-up steps) = {total:.0f} s"
        + (f"; --max-seconds ends the timed rounds at about {args.max_seconds:g} s (at least "
           f"{args.warmup + args.min_steps} rounds run)"
           if 0 < args.max_seconds < total else ""))
    items = [(config, kind) for config, r in runners.items() for kind in r.kinds]
    samples: dict[str, list[tuple[float, float]]] = defaultdict(list)
    counted: dict[str, int] = defaultdict(int)
    timed = 0
    for round_ in range(args.warmup + args.steps):
        this_round = 0.0
        for config, kind in items:
            runner = runners[config]
            for _ in range(PLAIN_RUN - 1 if kind == PLAIN else 0):  # the run's lead, untimed
                comm.barrier()
                runner.iteration(x, y, kind)
            comm.barrier()
            parts = runner.iteration(x, y, kind)
            counted[config] += 1
            worst = torch.tensor(parts, dtype=torch.float64)
            comm.allreduce(worst, "max")
            this_round += float(worst.sum())
            if round_ >= args.warmup:
                samples[f"{config} {kind}"].append((float(worst[0]), float(worst[1])))
        timed += int(round_ >= args.warmup)
        left = args.warmup + args.steps - round_ - 1
        if args.max_seconds > 0 and left and timed >= args.min_steps:
            stop = process_seconds() + this_round > args.max_seconds
            if MPI.COMM_WORLD.bcast(stop, root=0):
                say(f"# --max-seconds {args.max_seconds:g}: stopping after {timed} timed "
                    f"rounds ({left} left)")
                break

    def med(label: str, part: int) -> float:
        return statistics.median(s[part] for s in samples[label])

    fwd_bwd = {label: med(label, 0) for label in samples}
    step = {label: med(label, 1) for label in samples}
    baseline = next((c for c in BASELINES if c in runners), None)
    base_iter = (fwd_bwd[f"{baseline} {STEP}"] + step[f"{baseline} {STEP}"]
                 if baseline else None)
    frequencies = sorted({*FREQUENCIES, args.frequency})
    rows: list[list[Any]] = []
    iteration: dict[str, dict[int, float]] = defaultdict(dict)
    for config in runners:
        if config in BASELINES:
            fb, st = fwd_bwd[f"{config} {STEP}"], step[f"{config} {STEP}"]
            it = fb + st
            rows.append([config, fb, st, it,
                         100.0 * (it / base_iter - 1.0) if base_iter else "–", "–"])
            continue
        plain, root = step[f"{config} {PLAIN}"], step[f"{config} {ROOT}"]
        fb = fwd_bwd[f"{config} {PLAIN}"]
        for f in frequencies:
            amortised = plain + (root - plain) / f
            iteration[config][f] = it = fb + amortised
            rows.append([f"{config} F={f}", fb, amortised, it,
                         100.0 * (it / base_iter - 1.0) if base_iter else "–", "–"])
    if "shampoo" in iteration and "meta" in iteration:  # the last column: ours / Meta
        for row in rows:
            label = str(row[0])
            if label.startswith("shampoo F="):
                f = int(label.split("=")[1])
                row[5] = iteration["shampoo"][f] / iteration["meta"][f]
    kinds_rows = [[config, fwd_bwd[f"{config} {PLAIN}"], step[f"{config} {ROOT}"],
                   step[f"{config} {PLAIN}"], runner.first_s.get(ROOT, 0.0),
                   runner.cuda_peak / 2**30 if device.type == "cuda" else "–"]
                  for config, runner in runners.items() if config in SHAMPOOS]
    kinds_rows += [[config, fwd_bwd[f"{config} {STEP}"], "–", step[f"{config} {STEP}"],
                    runner.first_s.get(STEP, 0.0),
                    runner.cuda_peak / 2**30 if device.type == "cuda" else "–"]
                   for config, runner in runners.items() if config in BASELINES]
    memory: dict[str, Any] = {}
    ours = runners["shampoo"].opt if "shampoo" in runners else None
    if ours is not None:
        own = ours.memory_bytes()
        moved = own["buffers"] + own.get("directions", 0)  # what the exchange holds
        state = sum(v for k, v in own.items() if k not in ("buffers", "directions"))
        gathered = comm.allgather_object((state, moved))
        memory.update({"shampoo_state_max_rank": max(s for s, _ in gathered),
                       "shampoo_state_all_blocks": sum(s for s, _ in gathered),
                       "shampoo_buffers": gathered[0][1],
                       "shampoo_detail_rank0": own if comm.rank == 0 else None})
    for config in runners:
        if config != "shampoo":
            memory[f"{config}_state"] = state_bytes(runners[config].opt)
    if device.type == "cuda":
        memory["cuda_peak_bytes"] = {c: r.cuda_peak for c, r in runners.items()}
    traffic = {c: {"optimizer": r.opt_comm.traffic().snapshot(),
                   "gradients": r.grad_comm.traffic().snapshot()} for c, r in runners.items()}
    bytes_per_step = {
        c: {"optimizer": r.opt_comm.traffic().total_bytes / max(counted[c], 1),
            "gradients": r.grad_comm.traffic().total_bytes / max(counted[c], 1),
            "optimizer_calls": r.opt_comm.traffic().total_calls / max(counted[c], 1)}
        for c, r in runners.items()}
    layout = getattr(ours, "layout", None)
    blocks = list(getattr(layout, "blocks", []))
    graph = getattr(ours, "step_graph", None)  # whether the plain steps replayed
    if graph is not None and graph.replays == 0:
        say("# WARNING: the graphs were on but no plain step replayed one: the plain "
            f"steps were eager ({graph.report()})")
    profiles = {c: profile_steps(r, x, y) for c, r in runners.items() if args.profile}
    return {
        "profiles": profiles,
        "model": name, "model_description": what, "params": n_params,
        "world_size": comm.size, "device": str(device), "configs": list(runners),
        "baseline": baseline, "blocks": len(blocks), "max_dim": args.max_dim,
        "merge_dims_from": args.merge_dims_from,
        "root_method": repr(root_method_from(args.root_method)),
        "decomposition_streams": args.decomposition_streams,
        "precondition_vectors": not args.vectors_to_grafting,
        "statistics_frequency": args.statistics_frequency,
        "precision": args.precision,
        "block_dims": sorted({d for b in blocks for d in b.shape}),
        "frequency": args.frequency, "weight_decay": args.weight_decay,
        "meta_source": peer_version(args.meta_src) if meta is not None else None,
        "median_seconds": {"fwd_bwd": fwd_bwd, "step": step}, "table": rows,
        "kinds_table": kinds_rows,
        "step_graph": None if graph is None else graph.report(),
        "first_step_seconds": {c: r.first_s for c, r in runners.items()},
        "bytes_per_step": bytes_per_step, "traffic": traffic, "memory": memory,
        "steps": args.steps, "timed_rounds": timed, "warmup": args.warmup,
        "batch_per_rank": args.batch,
    }


def _plain(rows: list[list[Any]]) -> list[list[Any]]:
    """Floats of 1000 or more as integers (format_table would write 1.63e+03)."""
    return [[f"{v:.0f}" if isinstance(v, float) and abs(v) >= 1000 else v for v in row]
            for row in rows]


def report(result: dict[str, Any], markdown: bool) -> str:
    """The tables of one model's result."""
    mib = 2**20
    mem = result["memory"]
    bps = result["bytes_per_step"]
    cuda = "cuda_peak_bytes" in mem
    lines = [
        f"## {result['model']} ({result['params']:,} parameters, {result['blocks']} blocks "
        f"of kfac_hpc's Shampoo, max dim {result['max_dim']}, merged from the "
        f"{result.get('merge_dims_from', 'first')} dimension, roots "
        f"{result.get('root_method', 'EigenRoots()')}, "
        f"{result.get('decomposition_streams', 1)} decomposition stream(s), "
        f"{result.get('precision', 'full')} products), "
        f"{result['world_size']} ranks, "
        f"{result['device']}; medians of {result['timed_rounds']} rounds "
        f"(\"shampoo\": kfac_hpc's; \"meta\": Meta's; overhead vs {result['baseline']})",
        "",
        format_table(["config", "fwd+bwd s", "step s", "iteration s", "overhead %",
                      "shampoo / meta"], _plain(result["table"]), markdown=markdown),
        "",
        format_table(["config", "fwd+bwd s", "root step s", "plain step s", "first step s",
                      "peak GPU GiB" if cuda else "peak GPU"], result["kinds_table"],
                     markdown=markdown),
        "",
    ]
    graph = result.get("step_graph")
    if graph is not None:
        lines += [f"shampoo's step graph: {step_graph.describe(graph)}", ""]
    rows = []
    for config in result["configs"]:
        b = bps[config]
        if config == "shampoo":
            per_rank = (mem["shampoo_state_max_rank"] + mem["shampoo_buffers"]) / mib
            every = mem["shampoo_state_all_blocks"] / mib
        else:
            per_rank = every = mem[f"{config}_state"] / mib
        rows.append([config, b["optimizer"], b["optimizer_calls"], b["gradients"], per_rank,
                     every])
    lines.append(format_table(
        ["", "optimizer bytes/step", "optimizer calls/step", "gradient bytes/step",
         "state MiB/rank (max)", "state MiB, all blocks"], _plain(rows), markdown=markdown))
    for config, kinds in result.get("profiles", {}).items():
        for kind, prof in kinds.items():
            what = "forward+backward" if kind == FWD_BWD else f"{kind} step"
            lines.append(f"\n{config} {what} under torch.profiler: host "
                         f"{prof['host ms']:.1f} ms, device {prof['device ms']:.1f} ms, "
                         f"{prof['kernel launches']} kernel launches")
            lines.append(format_table(
                ["operator", "calls", "device ms (self)", "host ms (self)"],
                [[k[:60], c, f"{d:.2f}", f"{h:.2f}"] for k, c, d, h in prof["top"]],
                markdown=markdown))
    return "\n".join(lines)


def nominal_estimate(args: argparse.Namespace) -> float:
    """Seconds for ResNet-50 at batch 32 on an H200 from :data:`NOMINAL_H200_S`."""
    nominal = NOMINAL_H200_S
    round_s = sum(nominal["fwd_bwd"] + nominal["adam"] if c in BASELINES
                  else (1 + PLAIN_RUN) * nominal["fwd_bwd"] + nominal[ROOT]
                  + PLAIN_RUN * nominal[PLAIN]
                  for c in args.configs)
    total = STARTUP_S + (1 + args.warmup + args.steps) * round_s  # + the set-up steps
    return float(min(total, args.max_seconds)) if args.max_seconds > 0 else float(total)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command line; device-dependent defaults filled in (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, choices=["all", "mlp", "resnet20", "resnet50"],
                        help="default: all (mlp, resnet20) on the CPU, resnet50 on CUDA")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--configs", nargs="+", choices=CONFIGS, default=None,
                        help="default: adam shampoo on the CPU, adamw shampoo meta on CUDA")
    parser.add_argument("--steps", type=int, default=None,
                        help="timed rounds (default 10; 8 on CUDA)")
    parser.add_argument("--warmup", type=int, default=None,
                        help="untimed rounds after the set-up steps (default 2; 0 on CUDA)")
    parser.add_argument("--min-steps", type=int, default=3,
                        help="timed rounds before --max-seconds may stop them (default 3)")
    parser.add_argument("--max-seconds", type=float, default=None,
                        help="end the timed rounds early when the run would pass this many "
                             "seconds (0: never; default 100 on CUDA, 0 on the CPU)")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--image-size", type=int, default=None,
                        help="ResNet-50's input height/width (default 224)")
    parser.add_argument("--resnet50", choices=["auto", "torchvision", "kfac_hpc"],
                        default="auto", help="ResNet-50 implementation (auto: torchvision "
                                             "when it imports)")
    parser.add_argument("--max-dim", type=int, default=1024)
    parser.add_argument("--frequency", type=int, default=50,
                        help="precondition_frequency composed in the table besides 1, 10, "
                             "100 (default 50)")
    parser.add_argument("--root-method", choices=sorted(ROOT_METHOD_NAMES), default="eigen",
                        help="kfac_hpc's Shampoo roots: eigen (batched eigh, the default), "
                             "subspace (kept eigenbases refreshed by one subspace-iteration "
                             "step, SubspaceRoots(): a root step measured here is a refresh "
                             "9 times in 10) or newton (coupled Newton iteration, "
                             "NewtonRoots())")
    parser.add_argument("--merge-dims-from", choices=MERGE_ORDERS, default="last",
                        help="kfac_hpc's Shampoo: where a parameter's small dimensions start "
                             "to merge into blocks (merge_dims_from; Meta's merges from the "
                             "last)")
    parser.add_argument("--vectors-to-grafting", action="store_true",
                        help="kfac_hpc's Shampoo with precondition_vectors=False: blocks of "
                             "order 1 take the grafting direction alone (Meta's runs as "
                             "always)")
    parser.add_argument("--statistics-frequency", type=int, default=1,
                        help="kfac_hpc's Shampoo: steps between factor updates (its "
                             "statistics_frequency; Meta's runs as always)")
    parser.add_argument("--precision", choices=("full", "tf32"), default="full",
                        help="kfac_hpc's Shampoo: operand precision of its factor and "
                             "preconditioning products (stats_precision and "
                             "precondition_precision; Meta's runs as always)")
    parser.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=None,
                        help="kfac_hpc's Shampoo: its plain steps' block work captured as a "
                             "CUDA graph and replayed (cuda_graphs=True; CUDA only), or not "
                             "(--no-cuda-graphs); neither: the library's default (Meta's "
                             "runs as always)")
    parser.add_argument("--decomposition-streams", type=int, default=default_device_streams(),
                        help="kfac_hpc's Shampoo: CUDA streams its root step's eigh batches "
                             "are spread over (decomposition_streams, default "
                             f"{default_device_streams()}, the library's)")
    parser.add_argument("--weight-decay", type=float, default=None,
                        help="decoupled weight decay of adamw, shampoo and meta (default "
                             "0.01 when adamw is selected, else 0)")
    parser.add_argument("--meta-src", default=peer_source("META_SRC", "meta", "/tmp/meta_src"),
                        help="folder holding distributed_shampoo/ (default $META_SRC, else "
                             "<repo>/.peers/meta when present, else /tmp/meta_src)")
    parser.add_argument("--quick", action="store_true", help="3 steps, 1 warmup (smoke test)")
    parser.add_argument("--profile", action="store_true",
                        help="after the timing, per configuration one forward+backward and "
                             "one step of each kind (root and plain for a Shampoo) under "
                             "torch.profiler: host/device ms, kernel launches, top "
                             "operators by device time")
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--out", type=Path, default=OUT_DIR)
    args = parser.parse_args(argv)
    cuda = args.device == "cuda"
    for key, value in (CUDA_DEFAULTS if cuda else CPU_DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.quick:
        args.steps, args.warmup = 3, 1
    if args.model is None:
        args.model = "resnet50" if cuda else "all"
    if args.configs is None:
        args.configs = ["adamw", "shampoo", "meta"] if cuda else ["adam", "shampoo"]
    args.configs = [c for c in CONFIGS if c in args.configs]
    if args.weight_decay is None:
        args.weight_decay = 0.01 if "adamw" in args.configs else 0.0
    if args.cuda_graphs and args.device != "cuda":  # a dry run on the CPU times the rest
        print("--cuda-graphs: CUDA graphs need --device cuda; ignored", file=sys.stderr)
        args.cuda_graphs = None
    if args.steps < 1 or args.warmup < 0 or args.frequency < 1:
        parser.error("--steps and --frequency must be >= 1, --warmup >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; returns the exit status (2: Meta's package missing)."""
    args = parse_args(argv)
    rank = MPI.COMM_WORLD.Get_rank()
    try:
        device = select_device(args.device)
    except NoGPUError as e:
        if rank == 0:
            print(e, file=sys.stderr)
        return 1
    meta = None
    if "meta" in args.configs:
        meta = import_meta(args.meta_src)
        if not MPI.COMM_WORLD.allreduce(int(meta is not None), op=MPI.MIN):
            if rank == 0:
                print(META_HELP, file=sys.stderr)
            return 2
    torch.set_num_threads(1 if device.type == "cpu" else max(1, (os.cpu_count() or 1) // max(
        1, MPI.COMM_WORLD.Get_size())))
    comm = Communicator(MPI.COMM_WORLD.Dup(), name="bench")
    info = machine()

    def say(msg: str) -> None:
        if comm.rank == 0:
            print(msg, flush=True)

    say(f"# shampoo_step: {describe(info)}; device {device}; configs "
        f"{' '.join(args.configs)}; weight decay {args.weight_decay:g}"
        + (f"; Meta's distributed_shampoo from {os.path.dirname(os.path.dirname(meta.__file__))}"
           f" ({peer_version(args.meta_src) or 'installed'})" if meta is not None else ""))
    models = ["mlp", "resnet20"] if args.model == "all" else [args.model]
    if device.type == "cuda" and models == ["resnet50"]:
        say(f"# nominal wall time on an H200 (ResNet-50, batch 32: fwd+bwd "
            f"{NOMINAL_H200_S['fwd_bwd']} s, Adam step {NOMINAL_H200_S['adam']} s, Shampoo "
            f"plain {NOMINAL_H200_S[PLAIN]} s, root {NOMINAL_H200_S[ROOT]} s): about "
            f"{nominal_estimate(args):.0f} s")
    suffix = ("_cuda" if device.type == "cuda" else "") + (
        "_newton" if args.root_method == "newton" else "") + (
        f"_streams{args.decomposition_streams}"
        if args.decomposition_streams != default_device_streams() else "") + (
        "_merge_first" if args.merge_dims_from == "first" else "") + (
        "_graphs" if args.cuda_graphs else "")
    for name in models:
        result = run_model(name, args, comm, device, meta, say)
        result["machine"] = info
        result["wall_seconds"] = process_seconds()
        if comm.rank == 0:
            path = write_json(args.out / f"shampoo_step_{name}_n{comm.size}{suffix}.json",
                              result)
            print(report(result, args.markdown))
            print(f"\n{describe(info)}\nwall time {result['wall_seconds']:.0f} s (since the "
                  f"process started)\nwrote {path}\n", flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
