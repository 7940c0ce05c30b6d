"""Head-to-head against KAISA (gpauloski/kfac-pytorch): iteration time, bytes, memory.

    launch/local -n P python benchmarks/vs_kaisa.py [--models mlp cnn resnet20 resnet50]
        [--device cpu|cuda]
        [--configs sgd kfac_hpc kfac_hpc-reduce kfac_hpc-subspace kfac_hpc-graphs
         kfac_hpc-eager kfac_hpc-fp32 kaisa]
        [--timing schedule|kinds] [--rounds 20] [--warmup 2] [--batch 32]
        [--image-size S] [--factor-steps 1] [--inv-steps 10] [--damping 0.003] [--lr 0.1]
        [--threads T] [--clock wall|cpu] [--max-seconds S] [--factor-warmup N [N ...]]
        [--kaisa-src DIR]
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
* ``kfac_hpc-subspace``: ``kfac_hpc`` with ``eigen_refresh="subspace"`` (eigenbases after
  the first renewed by one subspace-iteration step from the previous ones).
* ``kfac_hpc-graphs`` (CUDA only): ``kfac_hpc`` with ``cuda_graphs=True`` (the
  preconditioning captured as a CUDA graph at each inverse update and replayed until
  the next; ``kfac_hpc`` does so too on CUDA by default, below a memory bound:
  ``kfac_hpc.step_graph.DEFAULT_DEVICES``).
* ``kfac_hpc-eager``: ``kfac_hpc`` with ``cuda_graphs=False``.
* ``kfac_hpc-fp32``: ``kfac_hpc`` with ``stats_precision`` and ``precondition_precision``
  ``"full"`` (fp32 products, as KAISA's; the default rounds them to TF32 on CUDA).
* ``kaisa``: KAISA's ``KFACPreconditioner``, eigen, COMM-OPT (``grad_worker_fraction=1.0``).

Default: ``kfac_hpc kaisa`` with ``--timing schedule``, every one but
``kfac_hpc-subspace``, ``kfac_hpc-graphs``, ``kfac_hpc-eager`` and ``kfac_hpc-fp32`` with
``--timing kinds``.
The same model (same initial weights), the same fixed synthetic batch per rank, the same
hyper-parameters (``damping``, ``factor_decay`` 0.95, ``kl_clip`` 0.001, ``lr``,
eigendecomposition, fp32 model) and the same ranks go to every library. The products'
precision differs unless asked: kfac_hpc's defaults round the statistics' and the
preconditioning's operands to TF32 on CUDA (``stats_precision``/``precondition_precision``
``"auto"``), KAISA's run in fp32 (torch's TF32 switch is off); ``kfac_hpc-fp32`` is
kfac_hpc with full fp32 products, the like-for-like row. An iteration is
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

Configurations and kinds alternate round-robin, one iteration each per round (the
configurations' order reversed every other round, each one's kinds always fi, f, p, as a
schedule runs them), after an MPI barrier; an iteration's time is the slowest
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
100``. On an H200 an iteration of ResNet-50 at batch 32 (fp32) takes about 1.4 s of
K-FAC ``fi``, 0.07 s of ``f``, 0.04 s of ``p`` and 0.025 s of SGD (:data:`NOMINAL_H200_S`,
from ``benchmarks/RESULTS.md``), so a round of the four configurations is about 4.6 s;
start-up (imports, CUDA context, model) about 20 s, the set-up pass about one round,
1 + 12 rounds about 60 s: about 85 s in all; a factor warm-up of N updates adds about
N x 0.07 s per K-FAC configuration (N = 800 of kfac_hpc and KAISA: about 115 s). rank 0
prints this estimate at the start (``resnet50`` on CUDA only) and, after the set-up
pass, one from the measured first iterations (an upper bound: they include one-time
costs). ``--max-seconds S`` (0: no limit) ends the timed rounds early, after at least
``--min-rounds`` of them, once the elapsed time plus the last round's time would pass S
(time since the process started; the decision is rank 0's, broadcast), so the script
finishes within about S + 20 s even when an iteration is slower than assumed; the
number of timed rounds is printed and recorded. With several row sets
(``--factor-warmup``), each set's rounds end at its share of S: what is left of S when
the set begins, less the estimated time of the warm-ups still to come (from the last
measured time per factor-only update), divided by the sets still to run.

Factor warm-up (``--factor-warmup N [N ...]``, default 0: none). Jacobi's and divide and
conquer's run times depend on the spectrum, and on CUDA ``torch.linalg.eigh`` sends
float32 matrices of 32..512 rows (one matrix per call; batches of at most 32x32 go to the
batched Jacobi solver) to cuSOLVER's Jacobi solver ``syevj``, whose sweeps stop early on
a matrix near diagonal, and every other one (float64 always) to ``syevd``, divide and
conquer (aten/src/ATen/native/cuda/linalg/BatchLinearAlgebraLib.cpp,
``linalg_eigh_cusolver``). KAISA starts each factor at ``I`` and keeps ``0.95^U·I`` of it
after U updates, while its statistics are scaled down by ``b²`` and (convolutions) by
``T²`` (above); kfac_hpc's factors are the data's from the first update. So for its
first hundreds of updates KAISA decomposes near-multiples of ``I``, which a training run
leaves behind early (on ResNet-50 at batch 32, the mean diagonal of KAISA's batch
factors at the initial weights is 7e-16 to 1.1: ``0.95^U`` falls below 1 % of it after
U = 88 to 771 updates, 7,710 steps at ``factor_update_steps`` 10). Before the timed
rounds each K-FAC configuration (SGD has no factors) runs N untimed iterations that
update the factors and nothing else (:meth:`Lib.warm_up`: forward, backward, gradient
averaging, ``step()`` with a factor update and no inverse update; the same batch, and
no ``SGD.step()``, so that the weights do not fit that one batch), after the set-up pass
(``--timing kinds``). Several increasing values give several sets of timed rounds ("row
sets"), the warm-up continuing between them up to each value (``--factor-warmup 0
800``: the rounds of a run without warm-up, then 800 more updates, then the same rounds
again). Each table says the warm-up and, per configuration, the factor updates made
before its rounds (the set-up pass's and earlier rounds' included) and the median over
the factors of their off-diagonal share ``‖F − diag F‖_F / ‖F‖_F``
(:meth:`Lib.factor_structure`; near 0: a multiple of ``I``). With ``--timing schedule``
the warm-up comes first; its step 0 decomposes (both libraries' schedules do at step 0),
the rest do not.

Prints on rank 0: with ``schedule``, per model (and row set) a table of ms per
iteration (median and mean) of kfac_hpc and KAISA, the ratio kfac_hpc/KAISA (< 1:
kfac_hpc faster), bytes per step (K-FAC and gradient averaging), K-FAC state memory per
rank and the factors' off-diagonal share (Markdown); with ``kinds``, per row set the
table described above plus the factor updates and off-diagonal share (Markdown with
``--markdown``) and, at more than one rank, bytes per step per kind. Writes
``vs_kaisa_n<ranks>[_cuda][_warmup<N>].json`` (N: the last ``--factor-warmup``, when
not 0) under ``--out`` (and to ``--json FILE`` when given); its ``models`` are keyed by
model, or by ``"<model> warm-up <N>"`` with several row sets.

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
import itertools
import os
import socket
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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

from kfac_hpc import GradientAverager, KFACPreconditioner, step_graph
from kfac_hpc.comm import Communicator
from kfac_hpc.models import build_model
from kfac_hpc.solves import default_device_streams
from kfac_hpc.units import format_bytes

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()

CONFIGS = ("sgd", "kfac_hpc", "kfac_hpc-reduce", "kfac_hpc-subspace", "kfac_hpc-graphs",
           "kfac_hpc-eager", "kfac_hpc-fp32", "kaisa")
LEGACY_CONFIGS = ("kfac_hpc", "kaisa")  # the default with --timing schedule
KINDS_CONFIGS = ("sgd", "kfac_hpc", "kfac_hpc-reduce", "kaisa")  # the default with kinds
#: kfac_hpc's configurations other than the plain one: their table label and options
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "kfac_hpc-reduce": ("reduce", {"kfac_approx": "reduce"}),
    "kfac_hpc-subspace": ("subspace", {"eigen_refresh": "subspace"}),
    "kfac_hpc-graphs": ("graphs", {"cuda_graphs": True}),
    "kfac_hpc-eager": ("eager", {"cuda_graphs": False}),
    "kfac_hpc-fp32": ("fp32", {"stats_precision": "full", "precondition_precision": "full"}),
}
#: labels in tables and JSON keys ("kfac_hpc" and "KAISA" as before the configurations)
LABELS = {"sgd": "SGD", "kfac_hpc": "kfac_hpc", "kfac_hpc-reduce": "kfac_hpc-reduce",
          "kfac_hpc-subspace": "kfac_hpc-subspace", "kfac_hpc-graphs": "kfac_hpc-graphs",
          "kfac_hpc-eager": "kfac_hpc-eager", "kfac_hpc-fp32": "kfac_hpc-fp32",
          "kaisa": "KAISA"}
KINDS = ("fi", "f", "p")
ITERATION = "it"  # the one kind of SGD, and of every configuration with --timing schedule
SCHEDULES = ((1, 10), (10, 100))
NEVER = 10**9  # an update interval that no step number below it is a multiple of
#: seconds per iteration on an H200, ResNet-50, batch 32, fp32 (the wall-time estimate)
NOMINAL_H200_S = {"sgd": 0.025, "fi": 1.4, "f": 0.07, "p": 0.04}
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
            ``low_rank``, ``factor_sync``, ``symmetric_packing``, ``decomposition_streams``).
        kaisa: KAISA's ``kfac`` module (``kaisa`` configuration only).
        device: where the model copy, its batch and its state live.
        kinds: True: the update steps follow :attr:`mode` (``--timing kinds``); False:
            the constant schedule ``hp["factor_steps"]``, ``hp["inv_steps"]``.
        warmup: whether :meth:`warm_up` will be called (with ``kinds`` False, the
            schedule is then given as callables that :meth:`warm_up` switches to factor
            updates only; without it, as the plain integers of earlier runs).
    """

    def __init__(self, config: str, model: nn.Module, hp: dict[str, Any], kaisa: Any,
                 device: torch.device, kinds: bool, warmup: bool = False) -> None:
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
        self.warming = False  # in warm_up(): factor updates only, whatever the schedule
        self.steps_done = 0  # the preconditioner's step() calls so far
        self.factor_updates = 0  # how many of them updated the factors
        self.warmup_s_per_update: float | None = None  # measured by warm_up()
        self.updates_before_rounds = 0  # factor_updates when the timed rounds began
        self.offdiag: dict[str, float] = {}  # factor_structure() then
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
        elif warmup:
            every, inv_every = hp["factor_steps"], hp["inv_steps"]
            factor_steps = lambda k: 1 if self.warming else every
            inv_steps = lambda k: NEVER if self.warming else inv_every
        self.factor_steps = factor_steps
        common = dict(factor_update_steps=factor_steps, inv_update_steps=inv_steps,
                      damping=hp["damping"], factor_decay=0.95, kl_clip=0.001, lr=hp["lr"])
        if not self.is_kaisa:
            self.grad_comm = Communicator(WORLD.Dup(), name="grad-avg")
            self.averager = GradientAverager(self.model, self.grad_comm)
        if config.startswith("kfac_hpc"):
            self.comm = Communicator(WORLD.Dup(), name="kfac")
            self.pre = KFACPreconditioner(self.model, comm=self.comm, strategy="comm-opt",
                                          compute_method="eigen", low_rank=hp["low_rank"],
                                          factor_sync=hp["factor_sync"],
                                          symmetric_packing=hp["symmetric_packing"],
                                          decomposition_streams=hp["decomposition_streams"],
                                          **VARIANTS.get(config, ("", {}))[1], **common)
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

    def _advance(self, x: torch.Tensor, y: torch.Tensor, train: bool = True) -> None:
        """One iteration (the kind as :attr:`mode` and :attr:`warming` say); ``train``:
        with ``SGD.step()``."""
        self.opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(self.model(x), y)
        loss.backward()
        if self.is_kaisa:
            self._average_kaisa()
        else:
            self.averager.synchronize()
        if self.pre is not None:
            # both libraries' rule: step k updates the factors when k % interval(k) == 0
            k, every = self.steps_done, self.factor_steps
            self.factor_updates += int(k % (every(k) if callable(every) else every) == 0)
            self.pre.step()
            self.steps_done += 1
        if train:
            self.opt.step()

    def iteration(self, x: torch.Tensor, y: torch.Tensor, kind: str, record: bool) -> float:
        """One timed iteration of ``kind``; returns its time (slowest rank, seconds)."""
        self.mode.set(kind)
        k0, g0 = self._counters()
        WORLD.Barrier()
        synchronize(self.device)
        t0 = CLOCK[0]()
        self._advance(x, y)
        synchronize(self.device)
        dt = float(WORLD.allreduce(CLOCK[0]() - t0, op=MPI.MAX))
        if record:
            k1, g1 = self._counters()
            self.times[kind].append(dt)
            self.kfac_bytes[kind].append(k1 - k0)
            self.grad_bytes[kind].append(g1 - g0)
        return dt

    def warm_up(self, x: torch.Tensor, y: torch.Tensor, updates: int) -> None:
        """``updates`` untimed iterations that update the factors and nothing else.

        Forward, backward, gradient averaging, the preconditioner's ``step()`` with a
        factor update and without an inverse update (preconditioning with the
        decompositions it has); the same batch each time and no ``SGD.step()``: the
        weights stay, so the running averages converge to that batch's statistics at the
        weights the timed rounds start from (hundreds of SGD steps on one fixed batch
        would fit it, shrinking the output gradients and hence ``G``, which fresh batches
        in training do not). A preconditioner that has never decomposed (``--timing
        schedule``: nothing ran before) still decomposes at its step 0, as both
        libraries' schedules do at ``k % interval == 0``. No-op for SGD.
        """
        if self.pre is None or updates <= 0:
            return
        self.mode.set("f")
        self.warming = True
        synchronize(self.device)
        t0 = time.perf_counter()
        for _ in range(updates):
            self._advance(x, y, train=False)
        synchronize(self.device)
        self.warmup_s_per_update = float(
            WORLD.allreduce(time.perf_counter() - t0, op=MPI.MAX)) / updates
        self.warming = False

    def seconds_per_update(self) -> float:
        """Time of one factor-only iteration: measured by :meth:`warm_up`, else the
        median of the recorded ``f`` (``--timing schedule``: whole) iterations, else the
        set-up pass's; 0 for SGD or when nothing ran yet."""
        if self.pre is None:
            return 0.0
        if self.warmup_s_per_update is not None:
            return self.warmup_s_per_update
        kind = "f" if "f" in self.kinds else ITERATION
        if self.times.get(kind):
            return statistics.median(self.times[kind])
        return self.first_s.get(kind, 0.0)

    def begin_rounds(self) -> None:
        """Before a set of timed rounds (collective): forget the recorded times and
        bytes, note the factor updates so far and :meth:`factor_structure`."""
        self.times.clear()
        self.kfac_bytes.clear()
        self.grad_bytes.clear()
        self.updates_before_rounds = self.factor_updates
        self.offdiag = self.factor_structure()

    def factor_structure(self) -> dict[str, float]:
        """How far the factors are from a multiple of ``I``, over all ranks (collective).

        Per factor ``F`` (the running average, as the solver reads it: its lower
        triangle mirrored), the off-diagonal share ``‖F − diag F‖_F / ‖F‖_F``: about 0
        for ``c·I`` plus a small data term (KAISA's factors start at ``I`` and decay it by
        ``factor_decay`` per update, and its statistics are scaled down by ``b²`` and
        ``T²``), larger when the data dominates. Factors that are all zero are left out.

        Returns:
            ``{"median", "min", "max", "factors"}`` over the distinct factors the ranks
            hold (empty for SGD and when none is held yet).
        """
        mine: dict[str, float] = {}
        for name, f in self._factors():
            f64 = f.detach().to(torch.float64)
            off2 = 2.0 * float(torch.tril(f64, -1).square().sum())
            total = off2 + float(f64.diagonal().square().sum())
            if total > 0.0:
                mine[name] = (off2 / total) ** 0.5
        merged: dict[str, float] = {}
        for part in WORLD.allgather(mine):
            merged.update(part)
        if not merged:
            return {}
        shares = sorted(merged.values())
        return {"median": statistics.median(shares), "min": shares[0], "max": shares[-1],
                "factors": len(shares)}

    def _factors(self) -> list[tuple[str, torch.Tensor]]:
        """The square factor averages this rank holds, by a name unique over ranks."""
        out: list[tuple[str, torch.Tensor]] = []
        if self.pre is None:
            return out
        if self.is_kaisa:
            for name, layer in self.pre._layers.values():
                for which, f in (("A", layer.a_factor), ("G", layer.g_factor)):
                    if isinstance(f, torch.Tensor):
                        out.append((f"{name}.{which}", f))
        else:
            out = [(name, s.average) for name, s in self.pre.factors.items()
                   if s.average is not None]
        return [(n, f) for n, f in out if f.dim() == 2 and f.shape[0] == f.shape[1]]

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
        if self.pre is not None:
            out["factor_updates_before_rounds"] = self.updates_before_rounds
            out["factor_offdiag_before_rounds"] = self.offdiag
        graph = getattr(self.pre, "step_graph", None)
        if graph is not None:  # whether the timed steps replayed (kfac_hpc.step_graph)
            out["step_graph"] = graph.report()
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
           hp: dict[str, Any], kaisa: Any, device: torch.device, kinds: bool,
           warmup: bool = False) -> list[Lib]:
    """Build the configurations one after the other; with ``kinds``, run each kind once
    per configuration right after building it (untimed warm-up) and record the
    configuration's CUDA peak above what was allocated before it was built. ``warmup``:
    :meth:`Lib.warm_up` will be called."""
    libs = []
    for config in configs:
        reset_cuda_peak(device)
        before, _ = cuda_memory(device)
        lib = Lib(config, model, hp, kaisa, device, kinds, warmup)
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
               say: Callable[[str], None], limit: float = 0.0) -> int:
    """Warm-up and timed rounds, round-robin; returns the number of timed rounds (fewer
    than ``--rounds`` when the rounds would end after ``limit`` seconds of the process,
    0: no limit; see :func:`round_limit`).

    Every other round takes the configurations in reverse order (drifts of a shared
    machine hit all alike), each configuration's kinds always in their order (fi, f,
    p), as a schedule runs them: an inverse update followed by another one (the kinds
    reversed) made the graphed preconditioner capture at ``f`` every other round.
    """
    timed = 0
    for lib in libs:
        lib.begin_rounds()
    for r in range(args.warmup + args.rounds):
        ordered = libs if r % 2 == 0 else libs[::-1]
        order = [(lib, kind) for lib in ordered for kind in lib.kinds]
        round_s = sum(lib.iteration(x, y, kind, record=r >= args.warmup) for lib, kind in order)
        timed += int(r >= args.warmup)
        left = args.warmup + args.rounds - r - 1
        if limit > 0 and left and timed >= args.min_rounds:
            stop = process_seconds() + round_s > limit
            if WORLD.bcast(stop, root=0):
                say(f"# --max-seconds {args.max_seconds:g}: stopping after {timed} timed "
                    f"rounds ({left} left)")
                break
    return timed


def round_limit(libs: list[Lib], args: argparse.Namespace, index: int) -> float:
    """When the timed rounds of row set ``index`` (of ``--factor-warmup``) must end.

    The seconds left of ``--max-seconds``, less the later row sets' warm-up (estimated
    from :meth:`Lib.seconds_per_update`), shared equally by this and the later row sets.

    Returns:
        Seconds since the process started (0: no limit).
    """
    if args.max_seconds <= 0:
        return 0.0
    later = args.factor_warmup[-1] - args.factor_warmup[index]
    warm_s = later * sum(lib.seconds_per_update() for lib in libs)
    now = process_seconds()
    share = (args.max_seconds - now - warm_s) / (len(args.factor_warmup) - index)
    return float(WORLD.bcast(now + max(share, 0.0), root=0))


def warm_up(libs: list[Lib], x: torch.Tensor, y: torch.Tensor, updates: int,
            say: Callable[[str], None]) -> None:
    """``updates`` factor-only iterations of every K-FAC configuration (:meth:`Lib.warm_up`)."""
    kfac = [lib for lib in libs if lib.pre is not None]
    if updates <= 0 or not kfac:
        return
    guess = updates * sum(lib.seconds_per_update() for lib in kfac)
    say(f"# factor warm-up: {updates} factor-only updates of "
        f"{', '.join(lib.label for lib in kfac)}"
        + (f" (about {guess:.0f} s)" if guess > 0 else ""))
    for lib in kfac:
        lib.warm_up(x, y, updates)
    say("# factor warm-up done: " + ", ".join(
        f"{lib.label} {1e3 * (lib.warmup_s_per_update or 0.0):.3g} ms/update" for lib in kfac)
        + f"; {process_seconds():.0f} s so far")


def estimate(libs: list[Lib], args: argparse.Namespace) -> str:
    """The rest of the run from the first iterations' times (an upper bound)."""
    round_s = sum(sum(lib.first_s.values()) for lib in libs)
    warm_s = args.factor_warmup[-1] * sum(lib.first_s.get("f", 0.0) for lib in libs)
    rounds = len(args.factor_warmup) * (args.warmup + args.rounds)
    elapsed = process_seconds()
    total = elapsed + rounds * round_s + warm_s
    capped = (f"; --max-seconds ends the timed rounds at about {args.max_seconds:g} s "
              f"(at least {args.warmup + args.min_rounds} rounds per row set run)"
              if args.max_seconds > 0 and total > args.max_seconds else "")
    warm = (f" + {args.factor_warmup[-1]} factor warm-up updates x "
            f"{warm_s / args.factor_warmup[-1]:.2f} s" if warm_s > 0 else "")
    return (f"# estimated wall time: {elapsed:.0f} s so far + {rounds} rounds x "
            f"{round_s:.2f} s (first iterations){warm} = {total:.0f} s{capped}")


def nominal_estimate(configs: list[str], args: argparse.Namespace) -> float:
    """Seconds for ResNet-50 at batch 32 on an H200 from :data:`NOMINAL_H200_S`."""
    round_s = sum(NOMINAL_H200_S["sgd"] if c == "sgd"
                  else NOMINAL_H200_S["fi"] + NOMINAL_H200_S["f"] + NOMINAL_H200_S["p"]
                  for c in configs)
    rounds = 1 + len(args.factor_warmup) * (args.warmup + args.rounds)  # set-up: ~1 round
    warm_s = args.factor_warmup[-1] * NOMINAL_H200_S["f"] * sum(c != "sgd" for c in configs)
    total = STARTUP_S + rounds * round_s + warm_s
    return float(min(total, args.max_seconds) if args.max_seconds > 0 else total)


def schedule_table(results: dict[str, Any]) -> str:
    """The ``--timing schedule`` table (Markdown): kfac_hpc configurations vs KAISA."""
    def cell(d: dict[str, Any] | None, key: str, fmt: str = ".1f") -> str:
        return "–" if d is None else format(d[key], fmt)

    def size(d: dict[str, Any] | None, key: str) -> str:
        return "–" if d is None else format_bytes(d[key], digits=2)

    def share(d: dict[str, Any] | None) -> str:
        return "–" if d is None else fmt_share(d.get("factor_offdiag_before_rounds", {}))

    lines = ["| model | ranks | kfac_hpc ms (median / mean) | KAISA ms (median / mean) "
             "| ratio median | ratio mean | K-FAC bytes/step ours / KAISA "
             "| grad bytes/step ours / KAISA | K-FAC state/rank ours / KAISA "
             "| factor off-diag ours / KAISA |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, res in results["models"].items():
        k = res.get("KAISA")
        ours: list[str | None] = [c for c in ("kfac_hpc", *VARIANTS) if c in res]
        for c in ours or [None]:
            o = res[c] if c is not None else None
            label = name if c in (None, "kfac_hpc") else f"{name} ({VARIANTS[c][0]})"
            ratio_med = ratio_mean = "–"
            if o is not None and k is not None:
                ratio_med = f"{o['median_ms'] / k['median_ms']:.2f}"
                ratio_mean = f"{o['mean_ms'] / k['mean_ms']:.2f}"
            lines.append(
                f"| {label} | {SIZE} | {cell(o, 'median_ms')} / {cell(o, 'mean_ms')} "
                f"| {cell(k, 'median_ms')} / {cell(k, 'mean_ms')} | {ratio_med} | {ratio_mean} "
                f"| {size(o, 'kfac_bytes_per_step')} / {size(k, 'kfac_bytes_per_step')} "
                f"| {size(o, 'grad_bytes_per_step')} / {size(k, 'grad_bytes_per_step')} "
                f"| {size(o, 'kfac_state_bytes')} / {size(k, 'kfac_state_bytes')} "
                f"| {share(o)} / {share(k)} |")
        if "SGD" in res:
            s = res["SGD"]
            lines.append(f"| {name} SGD | {SIZE} | {s['median_ms']:.1f} / {s['mean_ms']:.1f} "
                         f"| | | | | {format_bytes(s['grad_bytes_per_step'], digits=2)} | | |")
    return "\n".join(lines)


def fmt_share(stats: dict[str, float]) -> str:
    """The median off-diagonal share of :meth:`Lib.factor_structure` ("–": none)."""
    if not stats:
        return "–"
    m = stats["median"]
    return f"{m:.2f}" if m >= 0.01 else f"{m:.1e}"


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
    headers += ["factor updates", "off-diag"]
    rows = []
    for label, r in res.items():
        kinds = r["kinds"]
        row: list[Any] = ([fmt_ms(kinds[k]["median_ms"]) for k in KINDS] if "fi" in kinds
                          else ["–", "–", "–"])
        for f, i in SCHEDULES:
            key = f"({f},{i})"
            ms = r["composed_ms"][key]
            row += [fmt_ms(ms), ratio(ms, sgd, key) if label != "SGD" else "1",
                    # (reduce: another approximation than KAISA's, no like-for-like ratio)
                    ratio(ms, kaisa, key) if label.startswith("kfac_hpc")
                    and label != LABELS["kfac_hpc-reduce"] else "–"]
        if cuda:
            row.append(format_bytes(r["cuda_peak_bytes"], digits=2)
                       if "cuda_peak_bytes" in r else "–")
        row.append(format_bytes(r["kfac_state_bytes"], digits=2) if label != "SGD" else "–")
        row += [str(r.get("factor_updates_before_rounds", "–")),
                fmt_share(r.get("factor_offdiag_before_rounds", {}))]
        rows.append([label, *row])
    out = format_table(headers, rows, markdown=markdown)
    for label, r in res.items():
        if "step_graph" in r:
            out += f"\n{label}: step graph {step_graph.describe(r['step_graph'])}"
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
    ap.add_argument("--factor-warmup", type=int, nargs="+", default=[0], metavar="N",
                    help="factor-only updates of each K-FAC configuration before the timed "
                         "rounds (default 0); several increasing values: one set of timed "
                         "rounds (row set) after each, the warm-up continuing in between")
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
    ap.add_argument("--decomposition-streams", type=int, default=default_device_streams(),
                    metavar="S", help="kfac_hpc only: its decompositions spread over S CUDA "
                    f"streams (default {default_device_streams()}, the library's)")
    ap.add_argument("--out", type=Path, default=OUT_DIR,
                    help=f"folder of vs_kaisa_n<ranks>[_cuda][_warmup<N>].json (default {OUT_DIR})")
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
        args.configs = list(KINDS_CONFIGS if args.timing == "kinds" else LEGACY_CONFIGS)
    args.configs = [c for c in CONFIGS if c in args.configs]  # fixed order, no repeats
    if not cuda and "kfac_hpc-graphs" in args.configs:
        print("kfac_hpc-graphs: CUDA graphs need --device cuda; skipped", flush=True)
        args.configs.remove("kfac_hpc-graphs")
    if cuda and args.clock == "cpu":
        ap.error("--clock cpu measures host CPU time: not GPU work; use --clock wall")
    if args.rounds < 1 or args.warmup < 0:
        ap.error("--rounds must be >= 1 and --warmup >= 0")
    warm = args.factor_warmup
    if warm[0] < 0 or any(b <= a for a, b in itertools.pairwise(warm)):
        ap.error(f"--factor-warmup {' '.join(map(str, warm))}: give counts >= 0 in "
                 "increasing order, e.g. --factor-warmup 0 800")
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
          "decomposition_streams": args.decomposition_streams,
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
        f"{args.damping}, factor warm-up {' then '.join(map(str, args.factor_warmup))}, "
        f"rounds {args.rounds} after {args.warmup} warm-up, {args.clock} clock"
        + (f", --max-seconds {args.max_seconds:g}" if args.max_seconds > 0 else ""))
    if cuda and kinds and args.models == ["resnet50"]:
        nominal = ", ".join(f"{k} {v:g} s" for k, v in NOMINAL_H200_S.items())
        say(f"# nominal wall time on an H200 (ResNet-50, batch 32: {nominal} per "
            f"iteration): about {nominal_estimate(args.configs, args):.0f} s")
    results: dict[str, Any] = {"ranks": SIZE, "device": str(device), "torch": torch.__version__,
                               "gpu": gpu_info() if cuda else None,
                               "kaisa_version": getattr(kaisa, "__version__", None),
                               "kaisa_source": peer_version(args.kaisa_src) if kaisa else None,
                               "timing": args.timing,
                               "schedules": [list(s) for s in SCHEDULES] if kinds else None,
                               "args": vars(args),
                               "factor_warmup": args.factor_warmup,
                               "models": {}}
    for name in args.models:
        model, x, y, what = workload(name, args.batch, args.image_size, args.resnet50)
        x, y = x.to(device), y.to(device)
        say(f"## {name}: {what}")
        libs = set_up(args.configs, model, x, y, hp, kaisa, device, kinds,
                      warmup=args.factor_warmup[-1] > 0)
        if kinds:
            say(estimate(libs, args))
        results.setdefault("model_description", {})[name] = what
        done = 0
        for index, updates in enumerate(args.factor_warmup):
            warm_up(libs, x, y, updates - done, say)
            done = updates
            timed = run_rounds(libs, x, y, args, say, round_limit(libs, args, index))
            res = {lib.label: lib.summary() for lib in libs}
            key = name if len(args.factor_warmup) == 1 else f"{name} warm-up {updates}"
            results["models"][key] = res
            results.setdefault("timed_rounds", {})[key] = timed
            warm = (f"factor warm-up {updates} (factor-only updates of each K-FAC "
                    "configuration before these rounds; factor updates: all so far)")
            if kinds:
                say(f"\n{name}, {SIZE} rank(s), {where}, {warm}: ms per iteration (median "
                    f"of {timed} rounds after {args.warmup} warm-up + the set-up pass); "
                    "(F,I) = fi/I + f(1/F - 1/I) + p(1 - 1/F); x SGD, x KAISA: ratio of "
                    "(F,I) times"
                    + ("; peak GPU: own allocations of the configuration" if cuda else "")
                    + "; off-diag: median over the factors of ||F - diag F||/||F|| before "
                    "the rounds (near 0: a multiple of I)")
                say(kinds_tables(res, args.markdown, cuda) + "\n")
            elif "kfac_hpc" in res and "KAISA" in res:
                ours, theirs = res["kfac_hpc"], res["KAISA"]
                say(f"{name}, {warm}: median ratio "
                    f"{ours['median_ms'] / theirs['median_ms']:.2f}, mean ratio "
                    f"{ours['mean_ms'] / theirs['mean_ms']:.2f}")
        del libs
        if cuda:
            torch.cuda.empty_cache()
    if not kinds:
        say(f"\nfactor warm-up {' then '.join(map(str, args.factor_warmup))} (factor-only "
            "updates before the timed rounds); factor off-diag: median over the factors of "
            "||F - diag F||/||F|| before the rounds (near 0: a multiple of I)")
        say(schedule_table(results))
    results["wall_seconds"] = process_seconds()
    say(f"# wall time {results['wall_seconds']:.0f} s (since the process started)")
    if RANK == 0:
        suffix = ("_cuda" if cuda else "") + (f"_warmup{args.factor_warmup[-1]}"
                                              if args.factor_warmup[-1] > 0 else "")
        say(f"wrote {write_json(args.out / f'vs_kaisa_n{SIZE}{suffix}.json', results)}")
        if args.json:
            say(f"wrote {write_json(args.json, results)}")
    if kaisa is not None:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
