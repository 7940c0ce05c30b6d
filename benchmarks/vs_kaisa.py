"""Head-to-head against KAISA (gpauloski/kfac-pytorch): iteration time, bytes, memory.

    launch/local -n P python benchmarks/vs_kaisa.py [--models mlp cnn resnet20 resnet50]
        [--device cpu|cuda] [--configs sgd kfac_hpc kfac_hpc-reduce kaisa]
        [--timing schedule|kinds] [--rounds 20] [--warmup 2] [--batch 32]
        [--image-size S] [--factor-steps 1] [--inv-steps 10] [--damping 0.003] [--lr 0.1]
        [--threads T] [--clock wall|cpu] [--max-seconds S] [--kaisa-src DIR]
        [--out benchmarks/out] [--json FILE] [--markdown]
    launch/local -n 1 python benchmarks/vs_kaisa.py --device cuda --models resnet50  # GPU

KAISA is not a dependency of kfac_hpc. Its package (``kfac``) needs only torch, so this
script imports it from an installed copy or, failing that, from a source tree put on
``sys.path`` (``--kaisa-src``, default ``$KAISA_SRC``, else ``<repo>/.peers/kaisa`` when
it exists, else ``/tmp/kaisa_src``; KAISA's ``__init__`` sets ``__version__`` from the
installed package's metadata, ``importlib.metadata.version("kfac-pytorch")``, which a
bare source tree lacks, so while it is imported that one query is answered with the
first word of ``<src>/VERSION`` when present, else ``"0+source"``). The comparison was
set up against KAISA v0.4.2, extracted (never committed: ``/.peers/`` is in
``.git/info/exclude``) with::

    git -C <kfac-pytorch clone> archive v0.4.2 kfac | tar -x -C .peers/kaisa

or ``git clone https://github.com/gpauloski/kfac-pytorch /tmp/kaisa_src``. When KAISA is
selected (``--configs``) and does not import, rank 0 prints these instructions and
every rank exits with status 2.

Configurations (``--configs``; each has its own copy of the model, same initial weights):

* ``sgd``: no preconditioner (the baseline of the ratios "x SGD").
* ``kfac_hpc``: :class:`kfac_hpc.KFACPreconditioner`, ``strategy="comm-opt"``, eigen,
  ``kfac_approx="expand"``.
* ``kfac_hpc-reduce``: the same with ``kfac_approx="reduce"`` (K-FAC-reduce for layers
  with positions: convolutions).
* ``kaisa``: KAISA's ``KFACPreconditioner``, eigen, COMM-OPT (``grad_worker_fraction=1.0``).

Default: ``kfac_hpc kaisa`` with ``--timing schedule``, all four with ``--timing kinds``.
The same model (same initial weights), the same fixed synthetic batch per rank, the same
hyper-parameters (``damping``, ``factor_decay`` 0.95, ``kl_clip`` 0.001, ``lr``,
eigendecomposition, fp32) and the same ranks go to every library. An iteration is
``zero_grad``, forward, cross-entropy, backward, gradient averaging, the
preconditioner's ``step()``, ``SGD.step()``. Gradient averaging: kfac_hpc's
:class:`kfac_hpc.GradientAverager` over MPI (``sgd`` and the kfac_hpc configurations);
for KAISA (which leaves it to the user, e.g. DDP) one ``torch.distributed.all_reduce``
of the flattened gradients over a gloo process group made from the MPI ranks
(``MASTER_ADDR=127.0.0.1``, a free port chosen by rank 0 and broadcast with mpi4py;
also at 1 rank, where KAISA needs the group but sends nothing). KAISA's own collectives
also run over that gloo group.

Timing (``--timing``; default ``kinds`` with ``--device cuda``, ``schedule`` on the CPU):

* ``schedule``: every K-FAC configuration runs the constant schedule
  (``factor_update_steps``, ``inv_update_steps``) = (``--factor-steps``,
  ``--inv-steps``); reported are the median and the mean over ``--rounds`` rounds after
  ``--warmup`` rounds. With ``inv_update_steps`` > 1 the median is an iteration without
  a decomposition; the mean over a whole number of periods (choose ``--rounds`` a
  multiple of ``--inv-steps``) is the amortised cost, which is what a training run pays.
* ``kinds``: three kinds of K-FAC iteration are timed, chosen per iteration by passing
  callables of the step as ``factor_update_steps`` / ``inv_update_steps`` (both
  libraries accept them): ``fi`` (factor and inverse update: running averages of the
  factors and their eigendecompositions), ``f`` (factor update only), ``p`` (neither:
  precondition with stale eigendecompositions). From the medians over the rounds, an
  iteration of the schedule (F, I) costs ``fi/I + f·(1/F − 1/I) + p·(1 − 1/F)``:
  (1,10) = (fi + 9·f)/10 and (10,100) = (fi + 9·f + 90·p)/100. Printed per
  configuration: ms per kind, the composed (1,10) and (10,100) ms per iteration, their
  ratio to SGD and (kfac_hpc configurations) to KAISA.

Configurations and kinds alternate round-robin, one iteration each per round (the order
reversed every other round), after an MPI barrier; an iteration's time is the slowest
rank's (MPI max; wall time, or with ``--clock cpu`` the process's CPU time, which other
users' load on a shared machine barely moves: meaningful at 1 rank, since MPI waits
spin; CPU only). On CUDA every timed iteration is bracketed by
``torch.cuda.synchronize()`` (kernels run asynchronously), so it is charged its own
kernels.

Memory. K-FAC state per rank: kfac_hpc ``pre.memory_bytes()`` (factors +
decompositions), KAISA ``preconditioner.memory_usage()["total"]`` (its per-layer factors,
eigenvectors/eigenvalues and batch accumulators); max over ranks, after the last round.
Peak GPU memory per configuration (``--timing kinds`` on CUDA): before the rounds, the
configurations are set up one after the other; for each, the peak counter is reset
(``torch.cuda.reset_peak_memory_stats``), the configuration is built (model copy,
optimizer, preconditioner) and runs one iteration of each kind (``fi``, ``f``, ``p``;
SGD one iteration); reported is ``torch.cuda.max_memory_allocated`` minus the memory
allocated before it was built (so the configurations set up earlier, and the shared
input batch, are not counted): its own model, gradients, optimizer and K-FAC state,
activations and workspaces (max over ranks). These set-up iterations also warm up every
kind (first calls: cuDNN/cuSOLVER handles, lazy state) and are not timed.

Bytes per step (per rank, mean over the measured rounds; per kind with ``kinds``):
kfac_hpc, the change of ``Communicator.traffic().total_bytes`` of the preconditioner's
communicator and of the gradient averager's (the size of the message each collective
operates on). KAISA: the module functions of ``torch.distributed`` (``all_reduce``,
``broadcast``, ``reduce``, ``all_gather``, ``all_gather_into_tensor``,
``reduce_scatter_tensor``) are wrapped while this script runs, counting per call the
bytes of the tensor the collective operates on (the whole vector, as kfac_hpc counts);
KAISA calls them as ``dist.<name>`` at call time, so every collective it issues is
counted. Neither is what an MPI/gloo algorithm puts on a link. Nothing is sent at 1 rank.

Models: ``mlp`` (kfac_hpc.models ``mlp``: 64 features, hidden 256, 128, 10 classes),
``cnn`` (conv 1→16 5x5, pool, conv 16→32 5x5, pool, Linear 1568→128, Linear 128→10 on
1x28x28 inputs: the small CNN of ``benchmarks/curvature_math.py``), ``resnet20`` (CIFAR
ResNet-20, 3x``S``x``S``, ``--image-size`` S default 32), ``resnet50`` (ImageNet
ResNet-50, 1000 classes, 3x``S``x``S`` with S default 224: torchvision's ``resnet50()``
when torchvision imports, else ``kfac_hpc.models`` ``resnet50``, the same network;
``--resnet50`` picks one).

Wall time and defaults on CUDA. With ``--device cuda`` the defaults are ``--timing
kinds``, all four configurations, ``--warmup 1``, ``--rounds 12`` and ``--max-seconds
100``. On an H200 an iteration of ResNet-50 at batch 32 (fp32) takes about 1.5 s of
K-FAC ``fi``, 0.15 s of ``f``, 0.05 s of ``p`` and 0.02 s of SGD, so a round of the four
configurations is about 5.1 s; start-up (imports, CUDA context, model) about 20 s, the
set-up pass about one round, 1 + 12 rounds about 67 s: about 90 s in all. rank 0
prints this estimate at the start (``resnet50`` on CUDA only) and, after the set-up
pass, one from the measured first iterations (an upper bound: they include one-time
costs). ``--max-seconds S`` (0: no limit) ends the timed rounds early, after at least
``--min-rounds`` of them, once the elapsed time plus the last round's time would pass S
(time since the process started; the decision is rank 0's, broadcast), so the script
finishes within about S + 20 s even when an iteration is slower than assumed; the
number of timed rounds is printed and recorded.

Prints on rank 0: with ``schedule``, per model a table of ms per iteration (median and
mean) of kfac_hpc and KAISA, the ratio kfac_hpc/KAISA (< 1: kfac_hpc faster), bytes per
step (K-FAC and gradient averaging) and K-FAC state memory per rank (Markdown); with
``kinds``, the table described above (Markdown with ``--markdown``) and, at more than
one rank, bytes per step per kind. Writes ``vs_kaisa_n<ranks>[_cuda].json`` under
``--out`` (and to ``--json FILE`` when given).

Factor scaling (why the same ``damping`` number is not the same damping). kfac_hpc's
curvature is per example of the **mean** loss: ``δ = b·∂L/∂y`` (b = per-rank batch), and
both factors are means over rows: Linear ``A = (1/b) Σ ā āᵀ``, ``G = (1/b) Σ δ δᵀ``;
Conv2d (and Linear over sequences) means over the ``b·T`` rows (T output positions),
``A = (1/(bT)) Σ ā āᵀ``, ``G = (1/(bT)) Σ δ δᵀ``. KAISA (``kfac/layers/modules.py``)
uses the raw output gradient ``g = ∂L/∂y = δ/b`` and ``get_cov`` (mean over rows):
Linear ``A_K = A``, ``G_K = G/b²``; Conv2d divides both the patches and the gradients by
the number of positions ``T = out_h·out_w`` before ``get_cov`` over ``b·T`` rows, so
``A_K = A/T²`` and ``G_K = G/(b²T²)``. Both libraries damp the Kronecker eigenvalues the
same way (eigen method: ``1/(λ_G λ_Aᵀ + damping)``), so the curvature-to-damping ratio
agrees when

* Linear:  ``damping_kfac_hpc = b² · damping_KAISA``,
* Conv2d:  ``damping_kfac_hpc = b² · T⁴ · damping_KAISA``.

One global KAISA value therefore maps to one kfac_hpc value only for a model of Linear
layers (or for one conv resolution); for a CNN port the value for the layers that
dominate (or tune from ``b²·damping_KAISA`` upwards). The preconditioned gradient then
differs by the same factor, which KL clipping (same ``kl_clip`` and ``lr`` in both)
largely absorbs. The timing here does not depend on the damping value.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib.metadata
import os
import socket
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from common import (
    OUT_DIR,
    NoGPUError,
    cuda_memory,
    format_table,
    gpu_info,
    imagenet_resnet50,
    import_peer,
    peer_source,
    peer_version,
    process_seconds,
    reset_cuda_peak,
    select_device,
    synchronize,
    write_json,
)
from mpi4py import MPI

from kfac_hpc import GradientAverager, KFACPreconditioner
from kfac_hpc.comm import Communicator
from kfac_hpc.models import build_model
from kfac_hpc.units import format_bytes

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()

CONFIGS = ("sgd", "kfac_hpc", "kfac_hpc-reduce", "kaisa")
LEGACY_CONFIGS = ("kfac_hpc", "kaisa")  # the default with --timing schedule
#: labels in tables and JSON keys ("kfac_hpc" and "KAISA" as before the configurations)
LABELS = {"sgd": "SGD", "kfac_hpc": "kfac_hpc", "kfac_hpc-reduce": "kfac_hpc-reduce",
          "kaisa": "KAISA"}
KINDS = ("fi", "f", "p")
ITERATION = "it"  # the one kind of SGD, and of every configuration with --timing schedule
SCHEDULES = ((1, 10), (10, 100))
NEVER = 10**9  # an update interval that no step number below it is a multiple of
#: seconds per iteration on an H200, ResNet-50, batch 32, fp32 (the wall-time estimate)
NOMINAL_H200_S = {"sgd": 0.02, "fi": 1.5, "f": 0.15, "p": 0.05}
STARTUP_S = 20.0  # imports, MPI and CUDA start, model construction (nominal)
CUDA_DEFAULTS = {"warmup": 1, "rounds": 12, "max_seconds": 100.0}
CPU_DEFAULTS = {"warmup": 2, "rounds": 20, "max_seconds": 0.0}

INSTRUCTIONS = """\
KAISA (gpauloski/kfac-pytorch, Python package `kfac`) is not importable.
Get its source and point this script at it (it needs only torch):
    git clone https://github.com/gpauloski/kfac-pytorch /tmp/kaisa_src
    launch/local -n 2 python benchmarks/vs_kaisa.py --kaisa-src /tmp/kaisa_src
(or extract tag v0.4.2's kfac/ folder into <repo>/.peers/kaisa/, the default), or
install it into a separate environment (not a dependency of kfac_hpc):
    python3 -m venv /tmp/kaisa_venv
    /tmp/kaisa_venv/bin/pip install torch mpi4py numpy h5py
    /tmp/kaisa_venv/bin/pip install -e . --no-deps
    /tmp/kaisa_venv/bin/pip install --no-deps /tmp/kaisa_src
and run the script with /tmp/kaisa_venv/bin/python.
Without KAISA: --configs sgd kfac_hpc kfac_hpc-reduce."""


def import_kaisa(src: str) -> Any:
    """KAISA's ``kfac`` module, from an install or from the source tree ``src``.

    Args:
        src: a folder holding KAISA's ``kfac/`` package folder (may be empty).

    Returns:
        The ``kfac`` module, or None when neither imports.
    """
    return import_peer("kfac", src, "preconditioner", submodule="preconditioner",
                       context=lambda: _source_version(src), report=RANK == 0)


@contextlib.contextmanager
def _source_version(src: str) -> Iterator[None]:
    """Answer ``importlib.metadata.version("kfac-pytorch")`` for a bare source tree.

    KAISA's ``kfac/__init__.py`` reads its version from the installed package's
    metadata, which a source tree has none of: that one query (and only it) is answered
    from ``<src>/VERSION`` while the package imports.
    """
    real_version = importlib.metadata.version
    tag = (peer_version(src) or "").split(" ")[0].removeprefix("v")

    def version(distribution_name: str) -> str:
        try:
            return real_version(distribution_name)
        except importlib.metadata.PackageNotFoundError:
            if distribution_name == "kfac-pytorch":
                return f"{tag}+source" if tag else "0+source"
            raise

    importlib.metadata.version = version
    try:
        yield
    finally:
        importlib.metadata.version = real_version


# ---------------------------------------------------------------- byte counting

CLOCK = [time.perf_counter]  # --clock cpu: time.process_time

COUNT: dict[str, int] = defaultdict(int)
_PHASE = ["kfac"]
_WRAPPED = ("all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor",
            "reduce_scatter_tensor")


def _nbytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(t) for t in obj)
    return 0


def wrap_torch_distributed() -> None:
    """Count the bytes of every torch.distributed collective under ``_PHASE[0]``."""
    for name in _WRAPPED:
        fn = getattr(dist, name, None)
        if fn is None:
            continue

        def wrapped(*args: Any, _fn: Any = fn, _name: str = name, **kwargs: Any) -> Any:
            # the vector the collective operates on: the input, or the gathered output
            target = args[0] if args else next(iter(kwargs.values()), None)
            if _name in ("all_gather", "all_gather_into_tensor"):
                COUNT[_PHASE[0]] += _nbytes(target)
            else:
                src = args[1] if _name == "reduce_scatter_tensor" and len(args) > 1 else target
                COUNT[_PHASE[0]] += _nbytes(src)
            return _fn(*args, **kwargs)

        setattr(dist, name, wrapped)


def init_gloo() -> None:
    """A gloo process group over the MPI ranks (loopback; rank 0 picks the port)."""
    port = 0
    if RANK == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    port = WORLD.bcast(port, root=0)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=RANK, world_size=SIZE)


# ---------------------------------------------------------------- workloads


def small_cnn() -> nn.Module:
    """The small CNN of ``benchmarks/curvature_math.py`` (1x28x28 inputs, 10 classes)."""
    return nn.Sequential(
        nn.Conv2d(1, 16, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(32 * 7 * 7, 128), nn.ReLU(), nn.Linear(128, 10),
    )


def workload(name: str, batch: int, image_size: int | None = None,
             resnet50: str = "auto") -> tuple[nn.Module, torch.Tensor, torch.Tensor, str]:
    """The model (CPU, same weights on every rank) and this rank's fixed batch (CPU).

    Args:
        name: ``mlp``, ``cnn``, ``resnet20`` or ``resnet50``.
        batch: per-rank batch size.
        image_size: input height/width of ``resnet20`` (default 32) and ``resnet50``
            (default 224).
        resnet50: ``auto``, ``torchvision`` or ``kfac_hpc`` (see
            :func:`common.imagenet_resnet50`).

    Returns:
        ``(model, x, y, description)``.
    """
    torch.manual_seed(0)
    classes = 10
    if name == "mlp":
        model = build_model("mlp", num_classes=10, input_dim=64, hidden=(256, 128))
        shape: tuple[int, ...] = (64,)
        what = "kfac_hpc.models mlp"
    elif name == "cnn":
        model, shape, what = small_cnn(), (1, 28, 28), "small CNN"
    elif name == "resnet20":
        size = image_size or 32
        model = build_model("resnet20", num_classes=10, in_channels=3, image_size=size)
        shape, what = (3, size, size), "kfac_hpc.models resnet20"
    elif name == "resnet50":
        size, classes = image_size or 224, 1000
        model, what = imagenet_resnet50(classes, size, resnet50)
        shape = (3, size, size)
    else:
        raise ValueError(f"unknown model {name!r}")
    g = torch.Generator().manual_seed(1000 + RANK)
    x = torch.randn(batch, *shape, generator=g)
    y = torch.randint(0, classes, (batch,), generator=g)
    params = sum(p.numel() for p in model.parameters())
    return model, x, y, f"{what}, {params:,} parameters, input {batch}x{'x'.join(map(str, shape))}"


# ---------------------------------------------------------------- configurations


@dataclass
class Mode:
    """Which kind of K-FAC iteration comes next (read by the schedules of ``kinds``)."""

    factor: bool = True
    inverse: bool = True

    def set(self, kind: str) -> None:
        """Select ``fi``, ``f`` or ``p`` (anything else: ``fi``)."""
        self.factor = kind != "p"
        self.inverse = kind not in ("f", "p")


def compose(ms: dict[str, float], factor_steps: int, inv_steps: int) -> float:
    """An iteration of the schedule (F, I) from the kinds' times:
    ``fi/I + f·(1/F − 1/I) + p·(1 − 1/F)``."""
    return (ms["fi"] / inv_steps + ms["f"] * (1 / factor_steps - 1 / inv_steps)
            + ms["p"] * (1 - 1 / factor_steps))


class Lib:
    """One configuration's model copy, optimizer, preconditioner and counters.

    Args:
        config: one of :data:`CONFIGS`.
        model: the model to copy (CPU).
        hp: hyper-parameters (``lr``, ``damping``, ``factor_steps``, ``inv_steps``,
            ``low_rank``, ``factor_sync``, ``symmetric_packing``).
        kaisa: KAISA's ``kfac`` module (``kaisa`` configuration only).
        device: where the model copy, its batch and its state live.
        kinds: True: the update steps follow :attr:`mode` (``--timing kinds``); False:
            the constant schedule ``hp["factor_steps"]``, ``hp["inv_steps"]``.
    """

    def __init__(self, config: str, model: nn.Module, hp: dict[str, Any], kaisa: Any,
                 device: torch.device, kinds: bool) -> None:
        self.config = config
        self.label = LABELS[config]
        self.device = device
        self.model = copy.deepcopy(model).to(device)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=hp["lr"])
        self.mode = Mode()
        self.kinds: tuple[str, ...] = KINDS if kinds and config != "sgd" else (ITERATION,)
        self.times: dict[str, list[float]] = defaultdict(list)
        self.kfac_bytes: dict[str, list[int]] = defaultdict(list)
        self.grad_bytes: dict[str, list[int]] = defaultdict(list)
        self.first_s: dict[str, float] = {}
        self.cuda_peak = self.cuda_resident = 0
        self.is_kaisa = config == "kaisa"
        self.pre: Any = None
        self.comm: Communicator | None = None
        self.grad_comm: Communicator | None = None
        factor_steps: int | Callable[[int], int] = hp["factor_steps"]
        inv_steps: int | Callable[[int], int] = hp["inv_steps"]
        if kinds:
            factor_steps = lambda k: 1 if self.mode.factor else NEVER
            inv_steps = lambda k: 1 if self.mode.inverse else NEVER
        common = dict(factor_update_steps=factor_steps, inv_update_steps=inv_steps,
                      damping=hp["damping"], factor_decay=0.95, kl_clip=0.001, lr=hp["lr"])
        if not self.is_kaisa:
            self.grad_comm = Communicator(WORLD.Dup(), name="grad-avg")
            self.averager = GradientAverager(self.model, self.grad_comm)
        if config.startswith("kfac_hpc"):
            self.comm = Communicator(WORLD.Dup(), name="kfac")
            approx: Literal["expand", "reduce"] = (
                "reduce" if config == "kfac_hpc-reduce" else "expand")
            self.pre = KFACPreconditioner(self.model, comm=self.comm, strategy="comm-opt",
                                          compute_method="eigen", low_rank=hp["low_rank"],
                                          factor_sync=hp["factor_sync"],
                                          symmetric_packing=hp["symmetric_packing"],
                                          kfac_approx=approx, **common)
        elif self.is_kaisa:
            self.pre = kaisa.preconditioner.KFACPreconditioner(
                self.model, grad_worker_fraction=1.0, compute_method="eigen", **common)

    def _average_kaisa(self) -> None:
        if SIZE == 1:
            return
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])
        _PHASE[0] = "grad"
        dist.all_reduce(flat)
        _PHASE[0] = "kfac"
        flat /= SIZE
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()

    def _counters(self) -> tuple[int, int]:
        if self.is_kaisa:
            return COUNT["kfac"], COUNT["grad"]
        kfac = self.comm.traffic().total_bytes if self.comm is not None else 0
        grad = self.grad_comm.traffic().total_bytes if self.grad_comm is not None else 0
        return kfac, grad

    def iteration(self, x: torch.Tensor, y: torch.Tensor, kind: str, record: bool) -> float:
        """One timed iteration of ``kind``; returns its time (slowest rank, seconds)."""
        self.mode.set(kind)
        k0, g0 = self._counters()
        WORLD.Barrier()
        synchronize(self.device)
        t0 = CLOCK[0]()
        self.opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(self.model(x), y)
        loss.backward()
        if self.is_kaisa:
            self._average_kaisa()
        else:
            self.averager.synchronize()
        if self.pre is not None:
            self.pre.step()
        self.opt.step()
        synchronize(self.device)
        dt = float(WORLD.allreduce(CLOCK[0]() - t0, op=MPI.MAX))
        if record:
            k1, g1 = self._counters()
            self.times[kind].append(dt)
            self.kfac_bytes[kind].append(k1 - k0)
            self.grad_bytes[kind].append(g1 - g0)
        return dt

    def memory(self) -> int:
        """K-FAC state bytes of this rank (max over ranks; collective)."""
        if self.pre is None:
            mine = 0
        elif self.is_kaisa:
            mine = int(self.pre.memory_usage()["total"])
        else:
            mine = int(sum(self.pre.memory_bytes().values()))
        return int(WORLD.allreduce(mine, op=MPI.MAX))

    def summary(self) -> dict[str, Any]:
        """Times and bytes per kind, composed schedules, memory (collective)."""
        def per_rank_mean(v: list[int]) -> float:
            return float(WORLD.allreduce(statistics.mean(v), op=MPI.SUM)) / SIZE

        kinds = {kind: {"median_ms": 1e3 * statistics.median(self.times[kind]),
                        "mean_ms": 1e3 * statistics.mean(self.times[kind]),
                        "rounds": len(self.times[kind]),
                        "kfac_bytes_per_step": per_rank_mean(self.kfac_bytes[kind]),
                        "grad_bytes_per_step": per_rank_mean(self.grad_bytes[kind])}
                 for kind in self.kinds}
        out: dict[str, Any] = {"kinds": kinds, "kfac_state_bytes": self.memory(),
                               "first_iteration_ms": {k: 1e3 * v for k, v in
                                                      self.first_s.items()}}
        if self.device.type == "cuda" and self.first_s:
            out["cuda_peak_bytes"] = self.cuda_peak
            out["cuda_resident_bytes"] = self.cuda_resident
        if self.kinds == KINDS:
            med = {k: v["median_ms"] for k, v in kinds.items()}
            kb = {k: v["kfac_bytes_per_step"] for k, v in kinds.items()}
            out["composed_ms"] = {f"({f},{i})": compose(med, f, i) for f, i in SCHEDULES}
            out["composed_kfac_bytes_per_step"] = {f"({f},{i})": compose(kb, f, i)
                                                   for f, i in SCHEDULES}
        else:  # the legacy keys: one constant schedule (or SGD)
            out.update({k: v for k, v in kinds[ITERATION].items() if k != "rounds"})
            out["composed_ms"] = {f"({f},{i})": kinds[ITERATION]["median_ms"]
                                  for f, i in SCHEDULES} if self.config == "sgd" else {}
        return out


# ---------------------------------------------------------------- driver


def set_up(configs: list[str], model: nn.Module, x: torch.Tensor, y: torch.Tensor,
           hp: dict[str, Any], kaisa: Any, device: torch.device, kinds: bool) -> list[Lib]:
    """Build the configurations one after the other; with ``kinds``, run each kind once
    per configuration right after building it (untimed warm-up) and record the
    configuration's CUDA peak above what was allocated before it was built."""
    libs = []
    for config in configs:
        reset_cuda_peak(device)
        before, _ = cuda_memory(device)
        lib = Lib(config, model, hp, kaisa, device, kinds)
        if kinds:
            for kind in lib.kinds:
                lib.first_s[kind] = lib.iteration(x, y, kind, record=False)
            synchronize(device)
            now, peak = cuda_memory(device)
            lib.cuda_peak = int(WORLD.allreduce(peak - before, op=MPI.MAX))
            lib.cuda_resident = int(WORLD.allreduce(now - before, op=MPI.MAX))
        libs.append(lib)
    return libs


def run_rounds(libs: list[Lib], x: torch.Tensor, y: torch.Tensor, args: argparse.Namespace,
               say: Callable[[str], None]) -> int:
    """Warm-up and timed rounds, round-robin; returns the number of timed rounds (fewer
    than ``--rounds`` when ``--max-seconds`` ends them)."""
    items = [(lib, kind) for lib in libs for kind in lib.kinds]
    timed = 0
    for r in range(args.warmup + args.rounds):
        order = items if r % 2 == 0 else items[::-1]
        round_s = sum(lib.iteration(x, y, kind, record=r >= args.warmup) for lib, kind in order)
        timed += int(r >= args.warmup)
        left = args.warmup + args.rounds - r - 1
        if args.max_seconds > 0 and left and timed >= args.min_rounds:
            stop = process_seconds() + round_s > args.max_seconds
            if WORLD.bcast(stop, root=0):
                say(f"# --max-seconds {args.max_seconds:g}: stopping after {timed} timed "
                    f"rounds ({left} left)")
                break
    return timed


def estimate(libs: list[Lib], args: argparse.Namespace) -> str:
    """The rest of the run from the first iterations' times (an upper bound)."""
    round_s = sum(sum(lib.first_s.values()) for lib in libs)
    elapsed = process_seconds()
    total = elapsed + (args.warmup + args.rounds) * round_s
    capped = (f"; --max-seconds ends the timed rounds at about {args.max_seconds:g} s "
              f"(at least {args.warmup + args.min_rounds} rounds run)"
              if args.max_seconds > 0 and total > args.max_seconds else "")
    return (f"# estimated wall time: {elapsed:.0f} s so far + {args.warmup + args.rounds} "
            f"rounds x {round_s:.2f} s (first iterations) = {total:.0f} s{capped}")


def nominal_estimate(configs: list[str], args: argparse.Namespace) -> float:
    """Seconds for ResNet-50 at batch 32 on an H200 from :data:`NOMINAL_H200_S`."""
    round_s = sum(NOMINAL_H200_S["sgd"] if c == "sgd"
                  else NOMINAL_H200_S["fi"] + NOMINAL_H200_S["f"] + NOMINAL_H200_S["p"]
                  for c in configs)
    rounds = 1 + args.warmup + args.rounds  # the set-up pass is about one round
    total = STARTUP_S + rounds * round_s
    return min(total, args.max_seconds) if args.max_seconds > 0 else total


def schedule_table(results: dict[str, Any]) -> str:
    """The ``--timing schedule`` table (Markdown): kfac_hpc configurations vs KAISA."""
    def cell(d: dict[str, Any] | None, key: str, fmt: str = ".1f") -> str:
        return "–" if d is None else format(d[key], fmt)

    def size(d: dict[str, Any] | None, key: str) -> str:
        return "–" if d is None else format_bytes(d[key], digits=2)

    lines = ["| model | ranks | kfac_hpc ms (median / mean) | KAISA ms (median / mean) "
             "| ratio median | ratio mean | K-FAC bytes/step ours / KAISA "
             "| grad bytes/step ours / KAISA | K-FAC state/rank ours / KAISA |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, res in results["models"].items():
        k = res.get("KAISA")
        ours: list[str | None] = [c for c in ("kfac_hpc", "kfac_hpc-reduce") if c in res]
        for c in ours or [None]:
            o = res[c] if c is not None else None
            label = name if c in (None, "kfac_hpc") else f"{name} (reduce)"
            ratio_med = ratio_mean = "–"
            if o is not None and k is not None:
                ratio_med = f"{o['median_ms'] / k['median_ms']:.2f}"
                ratio_mean = f"{o['mean_ms'] / k['mean_ms']:.2f}"
            lines.append(
                f"| {label} | {SIZE} | {cell(o, 'median_ms')} / {cell(o, 'mean_ms')} "
                f"| {cell(k, 'median_ms')} / {cell(k, 'mean_ms')} | {ratio_med} | {ratio_mean} "
                f"| {size(o, 'kfac_bytes_per_step')} / {size(k, 'kfac_bytes_per_step')} "
                f"| {size(o, 'grad_bytes_per_step')} / {size(k, 'grad_bytes_per_step')} "
                f"| {size(o, 'kfac_state_bytes')} / {size(k, 'kfac_state_bytes')} |")
        if "SGD" in res:
            s = res["SGD"]
            lines.append(f"| {name} SGD | {SIZE} | {s['median_ms']:.1f} / {s['mean_ms']:.1f} "
                         f"| | | | | {format_bytes(s['grad_bytes_per_step'], digits=2)} | |")
    return "\n".join(lines)


def fmt_ms(value: float) -> str:
    """Milliseconds with 3 significant digits, without an exponent."""
    return f"{value:.0f}" if value >= 100 else f"{value:.3g}"


def kinds_tables(res: dict[str, Any], markdown: bool, cuda: bool) -> str:
    """The ``--timing kinds`` tables of one model."""
    sgd, kaisa = res.get("SGD"), res.get("KAISA")

    def ratio(a: float, b: dict[str, Any] | None, key: str) -> str:
        return "–" if b is None else f"{a / b['composed_ms'][key]:.2f}"

    headers = ["config", "fi ms", "f ms", "p ms"]
    for f, i in SCHEDULES:
        headers += [f"({f},{i}) ms", "x SGD", "x KAISA"]
    headers += ["peak GPU", "K-FAC state"] if cuda else ["K-FAC state"]
    rows = []
    for label, r in res.items():
        kinds = r["kinds"]
        row: list[Any] = ([fmt_ms(kinds[k]["median_ms"]) for k in KINDS] if "fi" in kinds
                          else ["–", "–", "–"])
        for f, i in SCHEDULES:
            key = f"({f},{i})"
            ms = r["composed_ms"][key]
            row += [fmt_ms(ms), ratio(ms, sgd, key) if label != "SGD" else "1",
                    ratio(ms, kaisa, key) if label.startswith("kfac_hpc") else "–"]
        if cuda:
            row.append(format_bytes(r["cuda_peak_bytes"], digits=2)
                       if "cuda_peak_bytes" in r else "–")
        row.append(format_bytes(r["kfac_state_bytes"], digits=2) if label != "SGD" else "–")
        rows.append([label, *row])
    out = format_table(headers, rows, markdown=markdown)
    if SIZE > 1:
        bh = ["config", *[f"K-FAC bytes/step {k}" for k in KINDS],
              *[f"K-FAC bytes/step ({f},{i})" for f, i in SCHEDULES], "grad bytes/step"]
        brows = []
        for label, r in res.items():
            kinds = r["kinds"]
            per = ([format_bytes(kinds[k]["kfac_bytes_per_step"], digits=2) for k in KINDS]
                   if "fi" in kinds else ["0 B"] * len(KINDS))
            comp = [format_bytes(r.get("composed_kfac_bytes_per_step", {}).get(
                f"({f},{i})", 0.0), digits=2) for f, i in SCHEDULES]
            grad = next(iter(kinds.values()))["grad_bytes_per_step"]
            brows.append([label, *per, *comp, format_bytes(grad, digits=2)])
        out += "\n\n" + format_table(bh, brows, markdown=markdown)
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command line; device-dependent defaults are filled in (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["mlp", "cnn", "resnet20"],
                    choices=["mlp", "cnn", "resnet20", "resnet50"])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                    help="cuda: cuda:<local rank mod GPUs>; exits with the reason without one")
    ap.add_argument("--configs", nargs="+", choices=CONFIGS, default=None,
                    help="configurations to run (default: kfac_hpc kaisa with --timing "
                         "schedule, all with --timing kinds)")
    ap.add_argument("--timing", choices=["schedule", "kinds"], default=None,
                    help="schedule: constant (--factor-steps, --inv-steps); kinds: fi/f/p "
                         "composed into (1,10) and (10,100) (default: kinds on CUDA, "
                         "schedule on the CPU)")
    ap.add_argument("--rounds", type=int, default=None,
                    help="timed rounds (default 20; 12 on CUDA)")
    ap.add_argument("--warmup", type=int, default=None,
                    help="untimed rounds first (default 2; 1 on CUDA)")
    ap.add_argument("--min-rounds", type=int, default=3,
                    help="timed rounds before --max-seconds may stop them (default 3)")
    ap.add_argument("--max-seconds", type=float, default=None,
                    help="end the timed rounds early when the run would pass this many "
                         "seconds (0: never; default 100 on CUDA, 0 on the CPU)")
    ap.add_argument("--batch", type=int, default=32, help="per-rank batch")
    ap.add_argument("--image-size", type=int, default=None,
                    help="input height/width of resnet20 (default 32) and resnet50 "
                         "(default 224)")
    ap.add_argument("--resnet50", choices=["auto", "torchvision", "kfac_hpc"], default="auto",
                    help="ResNet-50 implementation (auto: torchvision when it imports)")
    ap.add_argument("--factor-steps", type=int, default=1)
    ap.add_argument("--inv-steps", type=int, default=10)
    ap.add_argument("--damping", type=float, default=0.003)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--threads", type=int, default=0,
                    help="torch threads per rank (0: cores // ranks, at least 1)")
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                    help="wall: elapsed time; cpu: this process's CPU time (all its threads; "
                         "MPI waits spin, so use it at 1 rank, where other users' load "
                         "makes wall time swing; CPU device only)")
    ap.add_argument("--kaisa-src", default=peer_source("KAISA_SRC", "kaisa", "/tmp/kaisa_src"),
                    help="folder holding KAISA's kfac/ (default $KAISA_SRC, else "
                         "<repo>/.peers/kaisa when present, else /tmp/kaisa_src)")
    ap.add_argument("--low-rank", type=int, default=None, metavar="K",
                    help="kfac_hpc only: low-rank decompositions of factors >= 1024 "
                         "(KAISA has none; the comparison then includes that feature)")
    ap.add_argument("--factor-sync", choices=["step", "inverse"], default="step",
                    help="kfac_hpc only: 'inverse' reduces factors at inverse steps only "
                         "(the same preconditioned gradients, fewer bytes)")
    ap.add_argument("--symmetric-packing", action="store_true",
                    help="kfac_hpc only: factors travel as upper triangles")
    ap.add_argument("--out", type=Path, default=OUT_DIR,
                    help=f"folder of vs_kaisa_n<ranks>[_cuda].json (default {OUT_DIR})")
    ap.add_argument("--json", default="", help="also write the JSON to this file")
    ap.add_argument("--markdown", action="store_true",
                    help="--timing kinds tables as Markdown (schedule's always are)")
    args = ap.parse_args(argv)
    cuda = args.device == "cuda"
    defaults = CUDA_DEFAULTS if cuda else CPU_DEFAULTS
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.timing is None:
        args.timing = "kinds" if cuda else "schedule"
    if args.configs is None:
        args.configs = list(CONFIGS if args.timing == "kinds" else LEGACY_CONFIGS)
    args.configs = [c for c in CONFIGS if c in args.configs]  # fixed order, no repeats
    if cuda and args.clock == "cpu":
        ap.error("--clock cpu measures host CPU time: not GPU work; use --clock wall")
    if args.rounds < 1 or args.warmup < 0:
        ap.error("--rounds must be >= 1 and --warmup >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the comparison; returns the exit status (2: KAISA missing)."""
    args = parse_args(argv)
    try:
        device = select_device(args.device)
    except NoGPUError as e:
        if RANK == 0:
            print(e, file=sys.stderr)
        return 1
    kaisa = None
    if "kaisa" in args.configs:
        kaisa = import_kaisa(args.kaisa_src)
        ok = WORLD.allreduce(int(kaisa is not None), op=MPI.MIN)
        if not ok:
            if RANK == 0:
                print(INSTRUCTIONS, file=sys.stderr)
            return 2
    CLOCK[0] = time.process_time if args.clock == "cpu" else time.perf_counter
    threads = args.threads or max(1, (os.cpu_count() or 1) // SIZE)
    torch.set_num_threads(threads)
    if kaisa is not None:
        wrap_torch_distributed()
        init_gloo()
    kinds = args.timing == "kinds"
    cuda = device.type == "cuda"
    hp = {"lr": args.lr, "damping": args.damping, "low_rank": args.low_rank,
          "factor_sync": args.factor_sync, "symmetric_packing": args.symmetric_packing,
          "factor_steps": args.factor_steps, "inv_steps": args.inv_steps}

    def say(msg: str) -> None:
        if RANK == 0:
            print(msg, flush=True)

    where = (f"{torch.cuda.get_device_name(device)} ({device})" if cuda
             else f"CPU, {threads} threads/rank")
    kaisa_from = (f"KAISA {getattr(kaisa, '__version__', '?')} from "
                  f"{os.path.dirname(os.path.dirname(kaisa.__file__))}"
                  if kaisa is not None else "no KAISA")
    schedule = ("kinds fi/f/p composed into " + ", ".join(f"({f},{i})" for f, i in SCHEDULES)
                if kinds else f"(factor, inv) = ({args.factor_steps}, {args.inv_steps})")
    say(f"ranks {SIZE}, torch {torch.__version__}, {where}, {kaisa_from}, batch "
        f"{args.batch}/rank, configs {' '.join(args.configs)}, {schedule}, damping "
        f"{args.damping}, rounds {args.rounds} after {args.warmup} warm-up, {args.clock} clock"
        + (f", --max-seconds {args.max_seconds:g}" if args.max_seconds > 0 else ""))
    if cuda and kinds and args.models == ["resnet50"]:
        say(f"# nominal wall time on an H200 (ResNet-50, batch 32: fi 1.5 s, f 0.15 s, "
            f"p 0.05 s, SGD 0.02 s per iteration): about "
            f"{nominal_estimate(args.configs, args):.0f} s")
    results: dict[str, Any] = {"ranks": SIZE, "device": str(device), "torch": torch.__version__,
                               "gpu": gpu_info() if cuda else None,
                               "kaisa_version": getattr(kaisa, "__version__", None),
                               "kaisa_source": peer_version(args.kaisa_src) if kaisa else None,
                               "timing": args.timing,
                               "schedules": [list(s) for s in SCHEDULES] if kinds else None,
                               "args": vars(args),
                               "models": {}}
    for name in args.models:
        model, x, y, what = workload(name, args.batch, args.image_size, args.resnet50)
        x, y = x.to(device), y.to(device)
        say(f"## {name}: {what}")
        libs = set_up(args.configs, model, x, y, hp, kaisa, device, kinds)
        if kinds:
            say(estimate(libs, args))
        timed = run_rounds(libs, x, y, args, say)
        res = {lib.label: lib.summary() for lib in libs}
        results["models"][name] = res
        results.setdefault("timed_rounds", {})[name] = timed
        results.setdefault("model_description", {})[name] = what
        if kinds:
            say(f"\n{name}, {SIZE} rank(s), {where}: ms per iteration (median of {timed} "
                f"rounds after {args.warmup} warm-up + the set-up pass); (F,I) = "
                "fi/I + f(1/F - 1/I) + p(1 - 1/F); x SGD, x KAISA: ratio of (F,I) times"
                + ("; peak GPU: own allocations of the configuration" if cuda else ""))
            say(kinds_tables(res, args.markdown, cuda) + "\n")
        elif "kfac_hpc" in res and "KAISA" in res:
            ours, theirs = res["kfac_hpc"], res["KAISA"]
            say(f"{name}: median ratio {ours['median_ms'] / theirs['median_ms']:.2f}, "
                f"mean ratio {ours['mean_ms'] / theirs['mean_ms']:.2f}")
        del libs
        if cuda:
            torch.cuda.empty_cache()
    if not kinds:
        say("\n" + schedule_table(results))
    results["wall_seconds"] = process_seconds()
    say(f"# wall time {results['wall_seconds']:.0f} s (since the process started)")
    if RANK == 0:
        suffix = "_cuda" if cuda else ""
        say(f"wrote {write_json(args.out / f'vs_kaisa_n{SIZE}{suffix}.json', results)}")
        if args.json:
            say(f"wrote {write_json(args.json, results)}")
    if kaisa is not None:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
