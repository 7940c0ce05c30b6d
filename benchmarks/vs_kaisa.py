"""Head-to-head against KAISA (gpauloski/kfac-pytorch): iteration time, bytes, memory.

    launch/local -n P python benchmarks/vs_kaisa.py [--models mlp cnn resnet20]
        [--rounds 20] [--warmup 2] [--batch 32] [--factor-steps 1] [--inv-steps 10]
        [--damping 0.003] [--lr 0.1] [--threads T] [--clock wall|cpu]
        [--kaisa-src /tmp/kaisa_src] [--json FILE]

KAISA is not a dependency of kfac_hpc. Its package (``kfac``) needs only torch, so this
script imports it from an installed copy or, failing that, from a source checkout put on
``sys.path`` (``--kaisa-src``, default ``$KAISA_SRC`` or ``/tmp/kaisa_src``; KAISA's
``__init__`` asks the package metadata for its version, which a bare checkout lacks, so
that one query is answered with ``"0+source"`` while it is imported)::

    git clone https://github.com/gpauloski/kfac-pytorch /tmp/kaisa_src
    # or, in a separate environment: python3 -m venv /tmp/kaisa_venv && \
    #   /tmp/kaisa_venv/bin/pip install torch mpi4py numpy h5py && \
    #   /tmp/kaisa_venv/bin/pip install -e . --no-deps && \
    #   /tmp/kaisa_venv/bin/pip install --no-deps /tmp/kaisa_src

When neither works, rank 0 prints these instructions and every rank exits with status 2.

What runs. The same model (same initial weights), the same fixed synthetic batch per
rank, the same hyper-parameters (``damping``, ``factor_decay`` 0.95, ``kl_clip`` 0.001,
``lr``, ``factor_update_steps``, ``inv_update_steps``, eigendecomposition, fp32) and the
same ranks go to both libraries, with the same distribution strategy (KFAC's COMM-OPT:
``grad_worker_fraction=1.0`` in KAISA, ``strategy="comm-opt"`` here). An iteration is
``zero_grad``, forward, cross-entropy, backward, gradient averaging, the
preconditioner's ``step()``, ``SGD.step()``. Gradient averaging: kfac_hpc's
:class:`kfac_hpc.GradientAverager` over MPI; for KAISA (which leaves it to the user, e.g.
DDP) one ``torch.distributed.all_reduce`` of the flattened gradients over a gloo process
group made from the MPI ranks (``MASTER_ADDR=127.0.0.1``, a free port chosen by rank 0
and broadcast with mpi4py). KAISA's own collectives also run over that gloo group.
The two libraries alternate round-robin, one iteration each per round, after an MPI
barrier; an iteration's time is the slowest rank's (MPI max; wall time, or with
``--clock cpu`` the process's CPU time, which other users' load on a shared machine
barely moves: meaningful at 1 rank, since MPI waits spin); reported are the median
and the mean over ``--rounds`` rounds after ``--warmup`` rounds. With
``inv_update_steps`` > 1 the median is an iteration without a decomposition; the mean
over a whole number of periods (choose ``--rounds`` a multiple of ``--inv-steps``) is
the amortised cost, which is what a training run pays.

Models: ``mlp`` (kfac_hpc.models ``mlp``: 64 features, hidden 256, 128, 10 classes), ``cnn``
(conv 1→16 5x5, pool, conv 16→32 5x5, pool, Linear 1568→128, Linear 128→10 on 1x28x28
inputs: the small CNN of ``benchmarks/curvature_math.py``), ``resnet20`` (CIFAR ResNet-20,
3x32x32).

Bytes per step (per rank, mean over the measured rounds): kfac_hpc, the change of
``Communicator.traffic().total_bytes`` of the preconditioner's communicator and of the
gradient averager's (the size of the message each collective operates on). KAISA: the
module functions of ``torch.distributed`` (``all_reduce``, ``broadcast``, ``reduce``,
``all_gather``, ``all_gather_into_tensor``, ``reduce_scatter_tensor``) are wrapped while
this script runs, counting per call the bytes of the tensor the collective operates on
(the whole vector, as kfac_hpc counts); KAISA calls them as ``dist.<name>`` at call time,
so every collective it issues is counted. Neither is what an MPI/gloo algorithm puts on
a link. Memory per rank: K-FAC state bytes, kfac_hpc ``pre.memory_bytes()`` (factors +
decompositions), KAISA ``preconditioner.memory_usage()["total"]`` (its per-layer factors,
eigenvectors/eigenvalues and batch accumulators); max over ranks, after the last round.

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

Prints a table on rank 0: per model, ms per iteration (median and mean) of each library,
the ratio kfac_hpc/KAISA (< 1: kfac_hpc faster), bytes per step (K-FAC and gradient
averaging) and K-FAC state memory per rank. ``--json`` also writes the numbers.
"""

from __future__ import annotations

import argparse
import copy
import importlib.metadata
import json
import os
import socket
import statistics
import sys
import time
from collections import defaultdict
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from mpi4py import MPI

from kfac_hpc import GradientAverager, KFACPreconditioner
from kfac_hpc.comm import Communicator
from kfac_hpc.models import build_model
from kfac_hpc.units import format_bytes

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()

INSTRUCTIONS = """\
KAISA (gpauloski/kfac-pytorch, Python package `kfac`) is not importable.
Get its source and point this script at it (it needs only torch):
    git clone https://github.com/gpauloski/kfac-pytorch /tmp/kaisa_src
    launch/local -n 2 python benchmarks/vs_kaisa.py --kaisa-src /tmp/kaisa_src
or install it into a separate environment (not a dependency of kfac_hpc):
    python3 -m venv /tmp/kaisa_venv
    /tmp/kaisa_venv/bin/pip install torch mpi4py numpy h5py
    /tmp/kaisa_venv/bin/pip install -e . --no-deps
    /tmp/kaisa_venv/bin/pip install --no-deps /tmp/kaisa_src
and run the script with /tmp/kaisa_venv/bin/python."""


def import_kaisa(src: str) -> Any:
    """KAISA's ``kfac`` module, from an install or from the source tree ``src``."""
    try:
        import kfac  # type: ignore[import-not-found]
        if hasattr(kfac, "preconditioner"):
            return kfac
    except ImportError:
        pass
    if src and os.path.isdir(os.path.join(src, "kfac")):
        sys.path.insert(0, src)
        sys.modules.pop("kfac", None)
        # kfac/__init__.py reads its version from the installed package's metadata; a
        # bare source tree has none, so answer that one query (and only it) here.
        real_version = importlib.metadata.version

        def version(name: str) -> str:
            try:
                return real_version(name)
            except importlib.metadata.PackageNotFoundError:
                if name == "kfac-pytorch":
                    return "0+source"
                raise

        importlib.metadata.version = version
        try:
            import kfac  # type: ignore[import-not-found]
            import kfac.preconditioner  # type: ignore[import-not-found]
            return kfac
        except ImportError as e:
            if RANK == 0:
                print(f"importing KAISA from {src} failed: {e}", file=sys.stderr)
        finally:
            importlib.metadata.version = real_version
    return None


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
    return nn.Sequential(
        nn.Conv2d(1, 16, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(32 * 7 * 7, 128), nn.ReLU(), nn.Linear(128, 10),
    )


def workload(name: str, batch: int) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    if name == "mlp":
        model = build_model("mlp", num_classes=10, input_dim=64, hidden=(256, 128))
        shape: tuple[int, ...] = (64,)
    elif name == "cnn":
        model, shape = small_cnn(), (1, 28, 28)
    elif name == "resnet20":
        model, shape = build_model("resnet20", num_classes=10, in_channels=3), (3, 32, 32)
    else:
        raise ValueError(f"unknown model {name!r}")
    g = torch.Generator().manual_seed(1000 + RANK)
    x = torch.randn(batch, *shape, generator=g)
    y = torch.randint(0, 10, (batch,), generator=g)
    return model, x, y


class Lib:
    """One library's model, optimizer, preconditioner and counters."""

    def __init__(self, label: str, model: nn.Module, hp: dict[str, Any], kaisa: Any) -> None:
        self.label = label
        self.model = copy.deepcopy(model)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=hp["lr"])
        self.times: list[float] = []
        self.kfac_bytes: list[int] = []
        self.grad_bytes: list[int] = []
        common = dict(factor_update_steps=hp["factor_steps"], inv_update_steps=hp["inv_steps"],
                      damping=hp["damping"], factor_decay=0.95, kl_clip=0.001, lr=hp["lr"])
        if kaisa is None:
            self.grad_comm = Communicator(WORLD.Dup(), name="grad-avg")
            self.averager = GradientAverager(self.model, self.grad_comm)
            self.comm = Communicator(WORLD.Dup(), name="kfac")
            self.pre = KFACPreconditioner(self.model, comm=self.comm, strategy="comm-opt",
                                          compute_method="eigen", low_rank=hp["low_rank"],
                                          factor_sync=hp["factor_sync"],
                                          symmetric_packing=hp["symmetric_packing"], **common)
        else:
            self.pre = kaisa.preconditioner.KFACPreconditioner(
                self.model, grad_worker_fraction=1.0, compute_method="eigen", **common)
        self.is_kaisa = kaisa is not None

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

    def iteration(self, x: torch.Tensor, y: torch.Tensor, record: bool) -> None:
        if self.is_kaisa:
            k0, g0 = COUNT["kfac"], COUNT["grad"]
        else:
            k0, g0 = self.comm.traffic().total_bytes, self.grad_comm.traffic().total_bytes
        WORLD.Barrier()
        t0 = CLOCK[0]()
        self.opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(self.model(x), y)
        loss.backward()
        if self.is_kaisa:
            self._average_kaisa()
        else:
            self.averager.synchronize()
        self.pre.step()
        self.opt.step()
        dt = WORLD.allreduce(CLOCK[0]() - t0, op=MPI.MAX)
        if not record:
            return
        self.times.append(dt)
        if self.is_kaisa:
            self.kfac_bytes.append(COUNT["kfac"] - k0)
            self.grad_bytes.append(COUNT["grad"] - g0)
        else:
            self.kfac_bytes.append(self.comm.traffic().total_bytes - k0)
            self.grad_bytes.append(self.grad_comm.traffic().total_bytes - g0)

    def memory(self) -> int:
        if self.is_kaisa:
            mine = int(self.pre.memory_usage()["total"])
        else:
            mine = int(sum(self.pre.memory_bytes().values()))
        return int(WORLD.allreduce(mine, op=MPI.MAX))

    def summary(self) -> dict[str, Any]:
        def per_rank_mean(v: list[int]) -> float:
            return float(WORLD.allreduce(statistics.mean(v), op=MPI.SUM)) / SIZE
        return {
            "median_ms": 1e3 * statistics.median(self.times),
            "mean_ms": 1e3 * statistics.mean(self.times),
            "kfac_bytes_per_step": per_rank_mean(self.kfac_bytes),
            "grad_bytes_per_step": per_rank_mean(self.grad_bytes),
            "kfac_state_bytes": self.memory(),
        }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["mlp", "cnn", "resnet20"],
                    choices=["mlp", "cnn", "resnet20"])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--batch", type=int, default=32, help="per-rank batch")
    ap.add_argument("--factor-steps", type=int, default=1)
    ap.add_argument("--inv-steps", type=int, default=10)
    ap.add_argument("--damping", type=float, default=0.003)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--threads", type=int, default=0,
                    help="torch threads per rank (0: cores // ranks, at least 1)")
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                    help="wall: elapsed time; cpu: this process's CPU time (all its threads; "
                         "MPI waits spin, so use it at 1 rank, where other users' load "
                         "makes wall time swing)")
    ap.add_argument("--kaisa-src", default=os.environ.get("KAISA_SRC", "/tmp/kaisa_src"))
    ap.add_argument("--low-rank", type=int, default=None, metavar="K",
                    help="kfac_hpc only: low-rank decompositions of factors >= 1024 "
                         "(KAISA has none; the comparison then includes that feature)")
    ap.add_argument("--factor-sync", choices=["step", "inverse"], default="step",
                    help="kfac_hpc only: 'inverse' reduces factors at inverse steps only "
                         "(the same preconditioned gradients, fewer bytes)")
    ap.add_argument("--symmetric-packing", action="store_true",
                    help="kfac_hpc only: factors travel as upper triangles")
    ap.add_argument("--json", default="")
    args = ap.parse_args()

    kaisa = import_kaisa(args.kaisa_src)
    ok = WORLD.allreduce(int(kaisa is not None), op=MPI.MIN)
    if not ok:
        if RANK == 0:
            print(INSTRUCTIONS, file=sys.stderr)
        return 2
    CLOCK[0] = time.process_time if args.clock == "cpu" else time.perf_counter
    threads = args.threads or max(1, (os.cpu_count() or 1) // SIZE)
    torch.set_num_threads(threads)
    wrap_torch_distributed()
    init_gloo()
    hp = {"lr": args.lr, "damping": args.damping, "low_rank": args.low_rank,
          "factor_sync": args.factor_sync, "symmetric_packing": args.symmetric_packing,
          "factor_steps": args.factor_steps,
          "inv_steps": args.inv_steps}
    if RANK == 0:
        print(f"ranks {SIZE}, torch {torch.__version__} ({threads} threads/rank), "
              f"KAISA from {os.path.dirname(os.path.dirname(kaisa.__file__))}, "
              f"batch {args.batch}/rank, (factor, inv) = ({args.factor_steps}, "
              f"{args.inv_steps}), damping {args.damping}, rounds {args.rounds} "
              f"after {args.warmup} warm-up, {args.clock} clock", flush=True)
    results: dict[str, Any] = {"ranks": SIZE, "args": vars(args), "models": {}}
    for name in args.models:
        model, x, y = workload(name, args.batch)
        libs = [Lib("kfac_hpc", model, hp, None), Lib("KAISA", model, hp, kaisa)]
        for r in range(args.warmup + args.rounds):
            order = libs if r % 2 == 0 else libs[::-1]
            for lib in order:
                lib.iteration(x, y, record=r >= args.warmup)
        results["models"][name] = {lib.label: lib.summary() for lib in libs}
        if RANK == 0:
            ours, theirs = results["models"][name]["kfac_hpc"], results["models"][name]["KAISA"]
            print(f"{name}: median ratio {ours['median_ms'] / theirs['median_ms']:.2f}, "
                  f"mean ratio {ours['mean_ms'] / theirs['mean_ms']:.2f}", flush=True)
    if RANK == 0:
        print()
        print("| model | ranks | kfac_hpc ms (median / mean) | KAISA ms (median / mean) "
              "| ratio median | ratio mean | K-FAC bytes/step ours / KAISA "
              "| grad bytes/step ours / KAISA | K-FAC state/rank ours / KAISA |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        for name, res in results["models"].items():
            o, k = res["kfac_hpc"], res["KAISA"]
            print(f"| {name} | {SIZE} | {o['median_ms']:.1f} / {o['mean_ms']:.1f} "
                  f"| {k['median_ms']:.1f} / {k['mean_ms']:.1f} "
                  f"| {o['median_ms'] / k['median_ms']:.2f} | {o['mean_ms'] / k['mean_ms']:.2f} "
                  f"| {format_bytes(o['kfac_bytes_per_step'], digits=2)} / "
                  f"{format_bytes(k['kfac_bytes_per_step'], digits=2)} "
                  f"| {format_bytes(o['grad_bytes_per_step'], digits=2)} / "
                  f"{format_bytes(k['grad_bytes_per_step'], digits=2)} "
                  f"| {format_bytes(o['kfac_state_bytes'], digits=2)} / "
                  f"{format_bytes(k['kfac_state_bytes'], digits=2)} |")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=2)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
