"""Convergence against KAISA: each library with its own recommended hyper-parameters.

    launch/local -n P python benchmarks/vs_kaisa_convergence.py [--tasks digits,resnet20]
        [--seeds 1,2,3] [--configs hpc,kaisa,...] [--batch 32] [--digits-epochs 20]
        [--resnet-epochs 8] [--kaisa-src /tmp/kaisa_src] [--json FILE] [--fig-dir DIR]
    python benchmarks/vs_kaisa_convergence.py --report FILE.json [FILE.json ...] [--fig-dir DIR]

KAISA (gpauloski/kfac-pytorch, package ``kfac``) is found as in ``vs_kaisa.py``: an
installed copy, or a source checkout (``--kaisa-src``). The ``digits`` task needs
scikit-learn (the driver's embedded data), so run from kfac_hpc's own environment with
``--kaisa-src`` pointing at KAISA's source, or install scikit-learn next to KAISA.

What runs. For every task and seed, every configuration trains the same model from the
same initial weights (``torch.manual_seed(seed)`` after loading the data, as ``kfac-hpc
train`` does) on the same data in the same order: the driver's data sets and its
:class:`kfac_hpc.train.data.ShardedLoader` (per-rank batch ``--batch``, seed = the run's
seed), so every rank sees the same batch at the same step in every configuration. Every
configuration runs the same number of steps. One loop serves all: per step the learning
rate from the configuration's schedule, forward, cross-entropy (mean over the local
batch), backward, gradient averaging (one flattened ``torch.distributed.all_reduce`` over a
gloo group made from the MPI ranks, then ``/P``: the same for both libraries, neither
library's own averager), the K-FAC ``step()`` of the configuration's library, then
``torch.optim.SGD.step()`` (momentum 0.9, weight decay 5e-4: what both libraries'
examples use). At the end of every epoch: BatchNorm buffers averaged over ranks, test
loss and accuracy on the whole test set (sharded), and the epoch's mean training loss.

Tasks: ``digits`` (scikit-learn's 8x8 digits, the driver's default: the driver's MLP
64-128-64-10, 1,437/360 split) and ``resnet20`` (CIFAR-style ResNet-20 on the driver's
``synthetic`` images: 3x8x8, 10 classes, 4,096 train / 1,024 test, as
``benchmarks/time_to_accuracy.py``).

Configurations (``--configs``):

* ``hpc``: kfac_hpc (comm-opt) with its own recommendation (:data:`HPC_RECIPE`: the
  driver's defaults and the learning rates ``benchmarks/time_to_accuracy.py`` chose).
* ``kaisa``: KAISA (COMM-OPT, ``grad_worker_fraction=1``) with its own recommendation
  (:data:`KAISA_RECIPE`: the defaults of ``examples/torch_cifar10_resnet.py``; its
  100-epoch schedule is compressed to the run's length, see :func:`kaisa_lr`).
* ``kaisa-lr-literal``: KAISA's recipe with the example's ``lr = 0.1 x P`` taken
  literally (it assumes 128 samples per worker; ``kaisa`` scales 0.1 per 128 samples).
* ``kaisa-hpc-hp`` / ``hpc-kaisa-hp``: KAISA with kfac_hpc's recipe / kfac_hpc with
  KAISA's recipe, exact port (below).
* ``kaisa-hpc-hp-init``: as ``kaisa-hpc-hp`` and KAISA's factors start at the first
  statistics as kfac_hpc's do: then KAISA runs kfac_hpc's algorithm (a control; it
  differs from ``hpc`` only by floating-point rounding).
* ``kaisa-hpc-damping`` / ``hpc-kaisa-damping``: the damping alone ported.

The ported runs separate "library" from "hyper-parameters". Porting rule
(``vs_kaisa.py``'s docstring): the libraries scale the factors differently,
``A⊗G`` of kfac_hpc is ``s`` times KAISA's with ``s = b²`` for a Linear layer and
``s = b²T⁴`` for a Conv2d layer with ``T`` output positions (``b`` = per-rank batch), so
a damping ``γ`` of kfac_hpc is ``γ/s`` in KAISA, and KAISA's preconditioned gradient is
``s`` times kfac_hpc's (which matters whenever the KL clip is not active). Each library
takes one damping number, so the port works per layer: KAISA's layer objects get their
``damping`` argument divided by the layer's ``s`` and (exact port) their preconditioned
gradient divided by ``s`` (:func:`port_kaisa_damping`); kfac_hpc's preconditioning
multiplies both by ``s`` (:func:`per_layer_damping_kfac`). Everything else is ported as
is (learning rate and schedule, factor/inverse update steps, factor decay, KL clip).
What stays library specific: KAISA starts each factor's running average at the identity
(``0.95·I + 0.05·F`` at the first update), kfac_hpc at the first statistics (``F``).

Default ``--configs``: all but the two damping-only ports. Output on rank 0: the
hyper-parameters of every configuration, per task a table of mean +- std over seeds
(the last epoch's mean training loss, final test loss and accuracy, test accuracy at a
quarter, half and three quarters of the run, wall time), a per-epoch table of test
accuracy and training loss, and (with matplotlib) figures
``<fig-dir>/vs_kaisa_convergence_<task>.png``
(test accuracy and training loss against epochs, mean over seeds, std shaded).
``--json`` keeps every run's curves; ``--report`` re-prints the tables and figures from
such a file without running anything.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from common import mean_std

HERE = Path(__file__).resolve().parent
FIG_DIR = HERE / "figures"

# ------------------------------------------------------------------ recipes


@dataclass(frozen=True)
class Recipe:
    """One library's recommended training hyper-parameters (K-FAC on SGD)."""

    lr: float  # peak learning rate, or per 128 samples of global batch (lr_per_128)
    schedule: str  # "cosine" (kfac_hpc driver) | "kaisa-step" (KAISA's CIFAR example)
    warmup: float  # fraction of the run (kaisa-step) or epochs (cosine)
    damping: float  # in the recipe's own library's units
    damping_units: str  # "kfac_hpc" | "kaisa"
    factor_steps: int
    inv_steps: int
    factor_decay: float = 0.95
    kl_clip: float = 0.001
    momentum: float = 0.9
    weight_decay: float = 5e-4
    lr_per_128: bool = False  # lr scales linearly with the global batch (KAISA)
    lr_per_worker: bool = False  # lr times the number of ranks, whatever the batch
    milestones: tuple[float, ...] = ()  # fractions of the run (kaisa-step)
    source: str = ""


# kfac_hpc: `kfac-hpc train` defaults (SGD momentum 0.9, weight decay 5e-4, 1 warm-up
# epoch + cosine to 0, damping 0.1 for the MLP and 0.003 for the ResNets, factor decay
# 0.95, KL clip 0.001) with the peak learning rate and the (5, 10) update intervals of
# benchmarks/time_to_accuracy.py (RESULTS.md "Time to accuracy": K-FAC lr 1 on digits, 4
# on resnet20, each the best of a 1-seed sweep).
HPC_RECIPE: dict[str, Recipe] = {
    "digits": Recipe(lr=1.0, schedule="cosine", warmup=1.0, damping=0.1,
                     damping_units="kfac_hpc", factor_steps=5, inv_steps=10,
                     source="kfac-hpc train defaults (mlp damping 0.1); lr 1 and "
                            "factor/inv 5/10 from time_to_accuracy.py"),
    "resnet20": Recipe(lr=4.0, schedule="cosine", warmup=1.0, damping=0.003,
                       damping_units="kfac_hpc", factor_steps=5, inv_steps=10,
                       source="kfac-hpc train defaults (resnet damping 0.003); lr 4 and "
                              "factor/inv 5/10 from time_to_accuracy.py"),
}

# KAISA: examples/torch_cifar10_resnet.py + examples/vision/optimizers.py (kfac-pytorch
# 0.4.2): SGD lr 0.1 per worker of 128 samples times the number of workers, momentum
# 0.9, weight decay 5e-4; 5 warm-up epochs from lr/P to lr, then x0.1 at epochs 35, 75,
# 90 of 100; K-FAC damping 0.003, factor decay 0.95, KL clip 0.001, factor every step,
# eigenbases every 10 steps, eigen method, COMM-OPT (damping/update-step decay schedules
# off by default). KAISA has no digits/MLP example: the CIFAR recipe serves both tasks.
_KAISA = Recipe(lr=0.1, lr_per_128=True, schedule="kaisa-step", warmup=0.05,
                milestones=(0.35, 0.75, 0.90), damping=0.003, damping_units="kaisa",
                factor_steps=1, inv_steps=10,
                source="kfac-pytorch 0.4.2 examples/torch_cifar10_resnet.py defaults")
KAISA_RECIPE: dict[str, Recipe] = {"digits": _KAISA, "resnet20": _KAISA}
# The example's rule taken literally (``base_lr * world_size``, written for 128 samples
# per worker) at this script's smaller per-rank batch: 4x the per-sample learning rate.
_KAISA_LITERAL = replace(_KAISA, lr_per_128=False, lr_per_worker=True,
                         source="as KAISA, lr = 0.1 x P taken literally (the example "
                                "assumes 128 samples per worker)")
KAISA_LITERAL_RECIPE: dict[str, Recipe] = {"digits": _KAISA_LITERAL,
                                           "resnet20": _KAISA_LITERAL}

CONFIGS: dict[str, tuple[str, str, str]] = {  # name -> (library, recipe, port)
    "hpc": ("kfac_hpc", "kfac_hpc", ""),
    "kaisa": ("KAISA", "KAISA", ""),
    "kaisa-hpc-hp": ("KAISA", "kfac_hpc", "exact"),
    "hpc-kaisa-hp": ("kfac_hpc", "KAISA", "exact"),
    "kaisa-hpc-hp-init": ("KAISA", "kfac_hpc", "exact+init"),
    "kaisa-hpc-damping": ("KAISA", "kfac_hpc", "damping"),
    "hpc-kaisa-damping": ("kfac_hpc", "KAISA", "damping"),
    "kaisa-lr-literal": ("KAISA", "KAISA-literal", ""),
}
DEFAULT_CONFIGS = ("hpc", "kaisa", "kaisa-lr-literal", "kaisa-hpc-hp", "hpc-kaisa-hp",
                   "kaisa-hpc-hp-init")
LABELS = {"hpc": "kfac_hpc, own HPs", "kaisa": "KAISA, own HPs",
          "kaisa-hpc-hp": "KAISA, kfac_hpc's HPs (exact port)",
          "hpc-kaisa-hp": "kfac_hpc, KAISA's HPs (exact port)",
          "kaisa-hpc-hp-init": "KAISA, kfac_hpc's HPs (exact port, kfac_hpc's factor init)",
          "kaisa-hpc-damping": "KAISA, kfac_hpc's HPs (damping port)",
          "hpc-kaisa-damping": "kfac_hpc, KAISA's HPs (damping port)",
          "kaisa-lr-literal": "KAISA, own HPs, lr 0.1 x P"}
COLORS = {"hpc": "tab:blue", "kaisa": "tab:red", "kaisa-hpc-hp": "tab:orange",
          "hpc-kaisa-hp": "tab:cyan", "kaisa-hpc-hp-init": "tab:green",
          "kaisa-hpc-damping": "tab:brown",
          "hpc-kaisa-damping": "tab:purple", "kaisa-lr-literal": "tab:pink"}
STYLES = {"hpc": "-", "kaisa": "-", "kaisa-hpc-hp": "--", "hpc-kaisa-hp": "--",
          "kaisa-hpc-hp-init": "-.",
          "kaisa-hpc-damping": ":", "hpc-kaisa-damping": ":", "kaisa-lr-literal": "-."}


def recipe_for(config: str, task: str) -> Recipe:
    _, recipe, _ = CONFIGS[config]
    return {"kfac_hpc": HPC_RECIPE, "KAISA": KAISA_RECIPE,
            "KAISA-literal": KAISA_LITERAL_RECIPE}[recipe][task]


def peak_lr(r: Recipe, global_batch: int, ranks: int) -> float:
    if r.lr_per_128:
        return r.lr * global_batch / 128
    return r.lr * ranks if r.lr_per_worker else r.lr


def kaisa_lr(step: int, *, base: float, total: int, ranks: int, warmup: float,
             milestones: Sequence[float]) -> float:
    """KAISA's CIFAR schedule (``examples/utils.py: create_lr_schedule``) on a run of
    ``total`` steps: the 100-epoch recipe compressed to the run (warm-up and milestones
    as fractions of it) and evaluated per step (KAISA steps it per epoch, which has no
    meaning once 100 epochs become 8 or 20). Warm-up: ``base/P·(t·(P-1)/w + 1)``, i.e.
    linearly from ``base/P`` to ``base``; then ``base·0.1^(milestones passed)``."""
    t = step / total
    if t < warmup:
        return base / ranks * (t * (ranks - 1) / warmup + 1)
    return base * 0.1 ** sum(1 for m in milestones if t >= m)


def lr_function(r: Recipe, *, global_batch: int, steps_per_epoch: int, total: int,
                ranks: int) -> Callable[[int], float]:
    base = peak_lr(r, global_batch, ranks)
    if r.schedule == "cosine":
        from kfac_hpc.train.optim import lr_at

        warm = round(r.warmup * steps_per_epoch)
        return lambda s: lr_at(s, base_lr=base, total_steps=total, warmup_steps=warm,
                               schedule="cosine")
    return lambda s: kaisa_lr(s, base=base, total=total, ranks=ranks, warmup=r.warmup,
                              milestones=r.milestones)


# ------------------------------------------------------------------ damping port


def layer_scales(model: nn.Module, sample: torch.Tensor, batch: int) -> dict[str, float]:
    """``s`` per Linear/Conv2d layer name: ``γ_kfac_hpc = s · γ_KAISA`` (``b²`` for Linear,
    ``b²T⁴`` for Conv2d with ``T`` output positions; one forward pass finds ``T``)."""
    scales: dict[str, float] = {}
    handles = []
    for name, mod in model.named_modules():
        if isinstance(mod, nn.Linear):
            scales[name] = float(batch) ** 2
        elif isinstance(mod, nn.Conv2d):
            def hook(m: nn.Module, inp: Any, out: torch.Tensor, _name: str = name) -> None:
                positions = out.shape[2] * out.shape[3]
                scales[_name] = float(batch) ** 2 * float(positions) ** 4
            handles.append(mod.register_forward_hook(hook))
    was_training = model.training
    model.eval()
    with torch.no_grad():
        model(sample)
    model.train(was_training)
    for h in handles:
        h.remove()
    return scales


def port_kaisa_damping(pre: Any, model: nn.Module, scales: dict[str, float],
                       exact: bool = True, first_statistics: bool = False) -> None:
    """Make KAISA use ``damping / s`` on each layer (its damping argument is in
    kfac_hpc units): wraps the layer objects' three damping-taking methods. ``exact``:
    also divide its preconditioned gradient by ``s``, which makes it kfac_hpc's
    ``(A⊗G + γI)⁻¹∇W̄`` (KAISA's factors are ``1/s`` of kfac_hpc's, so with the damping
    ported alone its ``V`` is ``s`` times larger, which matters whenever the KL clip is
    not active). ``first_statistics``: start each running average at the first
    statistics, as kfac_hpc does, instead of KAISA's ``0.95·I + 0.05·F`` (the first
    update of a factor runs with ``alpha = 0``)."""
    names = {mod: name for name, mod in model.named_modules()}
    for module, (_, layer) in pre._layers.items():
        s = scales[names[module]]
        if first_statistics:
            for meth, attr in (("update_a_factor", "a_factor"), ("update_g_factor", "g_factor")):
                orig_update = getattr(layer, meth)

                def update(alpha: float = 0.95, _orig: Any = orig_update, _layer: Any = layer,
                           _attr: str = attr) -> Any:
                    return _orig(alpha=0.0 if getattr(_layer, _attr) is None else alpha)

                setattr(layer, meth, update)
        for meth in ("compute_a_inv", "compute_g_inv", "preconditioned_grad"):
            orig = getattr(layer, meth)

            def wrapped(damping: float = 0.001, _orig: Any = orig, _s: float = s,
                        _layer: Any = layer, _v: bool = meth == "preconditioned_grad"
                        ) -> Any:
                out = _orig(damping=damping / _s)
                if _v and exact:  # KAISA's V is s times kfac_hpc's: same units
                    _layer.grad = _layer.grad / _s
                return out

            setattr(layer, meth, wrapped)


def per_layer_damping_kfac(scales: dict[str, float], exact: bool = True) -> type:
    """kfac_hpc's :class:`KFACPreconditioner` whose eigen preconditioning uses
    ``damping · s`` on each layer (its damping argument is in KAISA units); ``exact``:
    also multiplies the preconditioned gradient by ``s`` (KAISA's ``V``)."""
    from kfac_hpc import KFACPreconditioner
    from kfac_hpc.kfac.decomposer import EigenSolve
    from kfac_hpc.kfac.stacked import Stack

    class PerLayerDampingKFAC(KFACPreconditioner):
        def _precondition_my_layers(self, k: int) -> tuple[dict[str, torch.Tensor], list[Stack]]:
            # the library's per-layer loop with each layer's damping scaled (no stacks:
            # they share one damping; the CPU, where this runs, never stacks)
            if self.stack_groups:
                raise NotImplementedError("the damping port supports layer-by-layer "
                                          "preconditioning only (no stack_groups)")
            damping = self.schedules.damping(k)
            out: dict[str, torch.Tensor] = {}
            for name, curv in self.layers.items():
                if not self.placement.is_grad_worker(name, self.comm.rank) \
                        or curv.module.weight.grad is None:
                    continue
                solve = self.decomps.solve(name, damping * scales[name])
                if solve is None:
                    continue
                if not isinstance(solve, EigenSolve):
                    raise NotImplementedError("the damping port supports full eigen "
                                              "decompositions only")
                v = solve(curv.grad_matrix(self.options.inv_dtype))
                out[name] = v * scales[name] if exact else v
            return out, []

    return PerLayerDampingKFAC


# ------------------------------------------------------------------ one run


@dataclass
class TaskSpec:
    name: str
    dataset: str
    model: str
    epochs: int


def load_task(spec: TaskSpec, seed: int, args: argparse.Namespace) -> Any:
    from kfac_hpc.train.data import load_dataset

    return load_dataset(spec.dataset, seed=seed, flat=spec.model == "mlp",
                        input_shape=tuple(int(v) for v in args.resnet_shape.split(",")),
                        num_classes=10, train_size=args.resnet_train_size,
                        test_size=args.resnet_test_size)


def run_one(config: str, spec: TaskSpec, seed: int, splits: Any, model0: nn.Module,
            args: argparse.Namespace, kaisa: Any) -> dict[str, Any]:
    import torch.distributed as dist
    from mpi4py import MPI

    from kfac_hpc import KFACPreconditioner
    from kfac_hpc.comm import Communicator
    from kfac_hpc.train.data import ShardedLoader

    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    library, recipe_name, port = CONFIGS[config]
    r = recipe_for(config, spec.name)
    model = copy.deepcopy(model0)
    loader = ShardedLoader(splits.train, batch_size=args.batch, rank=rank, world_size=size,
                           seed=seed, shuffle=True, drop_last=True)
    spe = len(loader)
    total = spe * spec.epochs
    lr_fn = lr_function(r, global_batch=args.batch * size, steps_per_epoch=spe, total=total,
                        ranks=size)
    opt = torch.optim.SGD(model.parameters(), lr=lr_fn(0), momentum=r.momentum,
                          weight_decay=r.weight_decay)

    def current_lr(_step: int = 0) -> float:
        return float(opt.param_groups[0]["lr"])

    sample = splits.train.get_batch(torch.arange(args.batch))[0]
    scales = layer_scales(model, sample, args.batch)
    assert bool(port) == ((library == "KAISA") != (r.damping_units == "kaisa"))
    comm = None
    pre: Any
    if library == "kfac_hpc":
        comm = Communicator(world.Dup(), name="kfac")
        cls = (per_layer_damping_kfac(scales, exact=port.startswith("exact")) if port
               else KFACPreconditioner)
        pre = cls(model, comm=comm, strategy="comm-opt", compute_method="eigen",
                  damping=r.damping, factor_decay=r.factor_decay, kl_clip=r.kl_clip,
                  lr=current_lr, factor_update_steps=r.factor_steps,
                  inv_update_steps=r.inv_steps)
    else:
        pre = kaisa.preconditioner.KFACPreconditioner(
            model, grad_worker_fraction=1.0, compute_method="eigen", damping=r.damping,
            factor_decay=r.factor_decay, kl_clip=r.kl_clip, lr=current_lr,
            factor_update_steps=r.factor_steps, inv_update_steps=r.inv_steps)
        if port:
            port_kaisa_damping(pre, model, scales, exact=port.startswith("exact"),
                               first_statistics=port.endswith("+init"))

    params = [p for p in model.parameters() if p.requires_grad]

    def average(tensors: list[torch.Tensor]) -> None:
        """Average in place over the ranks, in one flattened allreduce."""
        if size == 1 or not tensors:
            return
        flat = torch.cat([t.reshape(-1) for t in tensors])
        dist.all_reduce(flat)
        flat /= size
        offset = 0
        for t in tensors:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()

    def average_grads() -> None:
        average([p.grad for p in params if p.grad is not None])

    def evaluate() -> tuple[float, float]:
        average([b for b in model.buffers() if b.is_floating_point()])
        model.eval()
        test = splits.test
        bs = max(1, min(512, len(test) // size))
        tl = ShardedLoader(test, batch_size=bs, rank=rank, world_size=size, seed=0,
                           shuffle=False, drop_last=False)
        sums = torch.zeros(3, dtype=torch.float64)
        with torch.no_grad():
            for x, y in tl:
                if y.numel() == 0:
                    continue
                out = model(x)
                sums[0] += float(F.cross_entropy(out, y, reduction="sum"))
                sums[1] += float((out.argmax(1) == y).sum())
                sums[2] += y.numel()
        if size > 1:
            dist.all_reduce(sums)
        model.train()
        return float(sums[0] / sums[2]), float(sums[1] / sums[2])

    epochs: list[dict[str, Any]] = []
    step = 0
    diverged = None
    train_time = 0.0
    model.train()
    for epoch in range(spec.epochs):
        world.Barrier()
        t0 = time.perf_counter()
        stats = torch.zeros(3, dtype=torch.float64)
        for x, y in loader:
            lr = lr_fn(step)
            for group in opt.param_groups:
                group["lr"] = lr
            opt.zero_grad(set_to_none=True)
            out = model(x)
            loss = F.cross_entropy(out, y)
            loss.backward()
            average_grads()
            pre.step()
            opt.step()
            step += 1
            stats[0] += float(loss.detach()) * y.numel()
            stats[1] += float((out.detach().argmax(1) == y).sum())
            stats[2] += y.numel()
        if size > 1:
            dist.all_reduce(stats)
        dt = world.allreduce(time.perf_counter() - t0, op=MPI.MAX)
        train_time += dt
        train_loss = float(stats[0] / stats[2])
        if not math.isfinite(train_loss):
            diverged = step
            epochs.append({"epoch": epoch + 1, "step": step, "lr": lr,
                           "train_loss": train_loss, "train_acc": float(stats[1] / stats[2]),
                           "test_loss": math.nan, "test_acc": math.nan, "time": train_time})
            break
        test_loss, test_acc = evaluate()
        epochs.append({"epoch": epoch + 1, "step": step, "lr": lr, "train_loss": train_loss,
                       "train_acc": float(stats[1] / stats[2]), "test_loss": test_loss,
                       "test_acc": test_acc, "time": train_time})
    if library == "kfac_hpc":
        pre.close()
    if comm is not None:
        comm.free()
    return {"task": spec.name, "config": config, "library": library, "recipe": recipe_name,
            "seed": seed, "steps_per_epoch": spe, "total_steps": total,
            "peak_lr": peak_lr(r, args.batch * size, size), "epochs": epochs,
            "diverged_at_step": diverged, "train_time": train_time,
            "load": os.getloadavg()[0]}


# ------------------------------------------------------------------ analysis


def pm(values: Sequence[float], scale: float = 1.0, digits: int = 2) -> str:
    m, s = mean_std([v * scale for v in values])
    if math.isnan(m):
        return "n/a"
    return f"{m:.{digits}f}" + ("" if math.isnan(s) else f" ± {s:.{digits}f}")


def hp_table(tasks: Sequence[str], ranks: int, batch: int,
             configs: Sequence[str] = ("hpc", "kaisa")) -> str:
    rows = ["| task | recipe | peak lr (at this global batch) | schedule | damping (own units) "
            "| factor / inv steps | factor decay | KL clip | momentum / wd | source |",
            "|---|---|---:|---|---:|---:|---:|---:|---:|---|"]
    for task in tasks:
        recipes = dict.fromkeys(["kfac_hpc", "KAISA"] + [CONFIGS[c][1] for c in configs])
        for name, r in ((n, recipe_for(next(c for c in CONFIGS if CONFIGS[c][1] == n), task))
                        for n in recipes):
            lr = peak_lr(r, batch * ranks, ranks)
            if r.schedule == "cosine":
                sched = f"{r.warmup:g} warm-up epoch, cosine to 0"
            else:
                sched = (f"warm-up {100 * r.warmup:g} % of the run from lr/P, x0.1 at "
                         + ", ".join(f"{100 * m:g}" for m in r.milestones) + " %")
            lr_txt = f"{lr:g}" + (f" (= {r.lr:g} x {batch * ranks}/128)" if r.lr_per_128 else
                                  f" (= {r.lr:g} x {ranks})" if r.lr_per_worker else "")
            rows.append(f"| {task} | {name} | {lr_txt} | {sched} | {r.damping:g} "
                        f"({r.damping_units}) | {r.factor_steps} / {r.inv_steps} "
                        f"| {r.factor_decay:g} | {r.kl_clip:g} | {r.momentum:g} / "
                        f"{r.weight_decay:g} | {r.source} |")
    return "\n".join(rows)


def merge(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """One result from several ``--json`` files of the same ranks and per-rank batch."""
    out = copy.deepcopy(parts[0])
    for p in parts[1:]:
        if (p["ranks"], p["args"]["batch"]) != (out["ranks"], out["args"]["batch"]):
            raise SystemExit("--report: the files differ in ranks or per-rank batch")
        for key in ("tasks", "configs"):
            out["args"][key] = list(dict.fromkeys(out["args"][key] + p["args"][key]))
        out["runs"] += p["runs"]
    return out


def report(results: dict[str, Any], fig_dir: Path | None) -> str:
    runs = results["runs"]
    lines: list[str] = []
    ranks, batch = results["ranks"], results["args"]["batch"]
    lines.append(hp_table(results["args"]["tasks"], ranks, batch, results["args"]["configs"]))
    for task in results["args"]["tasks"]:
        trs = [r for r in runs if r["task"] == task]
        if not trs:
            continue
        configs = [c for c in results["args"]["configs"] if any(r["config"] == c for r in trs)]
        seeds = sorted({r["seed"] for r in trs})
        n_ep = max(len(r["epochs"]) for r in trs)
        spe = trs[0]["steps_per_epoch"]
        lines.append("")
        lines.append(f"#### {task}: {n_ep} epochs x {spe} steps at {ranks} ranks "
                     f"(global batch {batch * ranks}), seeds {','.join(map(str, seeds))}")
        lines.append("")
        q = [max(1, round(f * n_ep)) for f in (0.25, 0.5, 0.75)]
        lines.append("| configuration | diverged | train loss (last epoch's mean) "
                     "| final test loss "
                     f"| test acc % @ epoch {q[0]} | @ {q[1]} | @ {q[2]} "
                     f"| final test acc % (epoch {n_ep}) | train s |")
        lines.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        for c in configs:
            rs = [r for r in trs if r["config"] == c]

            def at(r: dict[str, Any], ep: int, key: str) -> float:
                e = [x for x in r["epochs"] if x["epoch"] == ep]
                return float(e[0][key]) if e else math.nan

            div = sum(1 for r in rs if r["diverged_at_step"] is not None)
            lines.append(
                f"| {LABELS[c]} | {div}/{len(rs)} "
                f"| {pm([at(r, n_ep, 'train_loss') for r in rs], digits=4)} "
                f"| {pm([at(r, n_ep, 'test_loss') for r in rs], digits=4)} "
                + "".join(f"| {pm([at(r, e, 'test_acc') for r in rs], 100)} " for e in q)
                + f"| {pm([at(r, n_ep, 'test_acc') for r in rs], 100)} "
                f"| {pm([r['train_time'] for r in rs], digits=1)} |")
        lines.append("")
        lines.append("Per epoch, mean over seeds: test accuracy % / training loss")
        lines.append("")
        lines.append("| epoch | " + " | ".join(LABELS[c] for c in configs) + " |")
        lines.append("|---:|" + "---:|" * len(configs))
        for ep in range(1, n_ep + 1):
            cells = []
            for c in configs:
                rs = [r for r in trs if r["config"] == c]
                acc = mean_std([x["test_acc"] for r in rs for x in r["epochs"]
                                if x["epoch"] == ep])[0]
                tl = mean_std([x["train_loss"] for r in rs for x in r["epochs"]
                               if x["epoch"] == ep])[0]
                cells.append(f"{100 * acc:.1f} / {tl:.3f}")
            lines.append(f"| {ep} | " + " | ".join(cells) + " |")
        if fig_dir is not None:
            path = plot_task(task, trs, configs, fig_dir)
            lines.append("")
            lines.append(f"figure: {path}" if path else "figure: skipped (no matplotlib)")
    return "\n".join(lines)


def plot_task(task: str, runs: list[dict[str, Any]], configs: list[str],
              fig_dir: Path) -> Path | None:
    try:
        from common import pyplot, save_figure
        plt = pyplot()
    except ImportError:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for c in configs:
        rs = [r for r in runs if r["config"] == c]
        n_ep = max(len(r["epochs"]) for r in rs)
        xs, curves = list(range(1, n_ep + 1)), {}
        for key in ("test_acc", "train_loss"):
            ms, ss = [], []
            for ep in xs:
                m, s = mean_std([x[key] for r in rs for x in r["epochs"] if x["epoch"] == ep])
                ms.append(m * (100 if key == "test_acc" else 1))
                ss.append(0.0 if math.isnan(s) else s * (100 if key == "test_acc" else 1))
            curves[key] = (ms, ss)
        for ax, key in zip(axes, ("test_acc", "train_loss")):
            ms, ss = curves[key]
            ax.plot(xs, ms, STYLES[c], color=COLORS[c], label=LABELS[c])
            low = [m - s if key == "test_acc" else max(m - s, m / 10) for m, s in zip(ms, ss)]
            ax.fill_between(xs, low, [m + s for m, s in zip(ms, ss)], color=COLORS[c],
                            alpha=0.15)
    axes[0].set_ylabel("test accuracy %")
    axes[1].set_ylabel("training loss (epoch mean)")
    axes[1].set_yscale("log")
    for ax in axes:
        ax.set_xlabel("epoch")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"{task}: K-FAC, kfac_hpc vs KAISA (mean over seeds, ±std)")
    return Path(save_figure(fig, fig_dir / f"vs_kaisa_convergence_{task}.png"))


# ------------------------------------------------------------------ main


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--tasks", default="digits,resnet20")
    ap.add_argument("--seeds", default="1,2,3")
    ap.add_argument("--configs", default=",".join(DEFAULT_CONFIGS),
                    help=f"comma-separated, from: {', '.join(CONFIGS)}")
    ap.add_argument("--batch", type=int, default=32, help="per-rank batch")
    ap.add_argument("--digits-epochs", type=int, default=20)
    ap.add_argument("--resnet-epochs", type=int, default=8)
    ap.add_argument("--resnet-shape", default="3,8,8")
    ap.add_argument("--resnet-train-size", type=int, default=4096)
    ap.add_argument("--resnet-test-size", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=0,
                    help="torch threads per rank (0: cores // ranks, at least 1)")
    ap.add_argument("--kaisa-src", default=os.environ.get("KAISA_SRC", "/tmp/kaisa_src"))
    ap.add_argument("--json", default="", help="write every run's curves here")
    ap.add_argument("--fig-dir", type=Path, default=FIG_DIR)
    ap.add_argument("--no-figures", action="store_true")
    ap.add_argument("--report", nargs="+", default=[], metavar="JSON",
                    help="print tables (and figures) from --json files (merged: same ranks "
                         "and batch); runs nothing")
    args = ap.parse_args(argv)
    args.tasks = [t for t in args.tasks.split(",") if t]
    args.configs = [c for c in args.configs.split(",") if c]
    args.seeds = [int(s) for s in args.seeds.split(",") if s]
    for t in args.tasks:
        if t not in HPC_RECIPE:
            ap.error(f"unknown task {t!r}; choose from {', '.join(HPC_RECIPE)}")
    for c in args.configs:
        if c not in CONFIGS:
            ap.error(f"unknown configuration {c!r}; choose from {', '.join(CONFIGS)}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    fig_dir = None if args.no_figures else args.fig_dir
    if args.report:
        print(report(merge([json.loads(Path(f).read_text()) for f in args.report]), fig_dir))
        return 0

    import torch.distributed as dist
    from common import describe, machine
    from mpi4py import MPI
    from vs_kaisa import INSTRUCTIONS, import_kaisa, init_gloo

    from kfac_hpc.models import build_model

    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    kaisa = import_kaisa(args.kaisa_src)
    if not world.allreduce(int(kaisa is not None), op=MPI.MIN):
        if rank == 0:
            print(INSTRUCTIONS, file=sys.stderr)
        return 2
    threads = args.threads or max(1, (os.cpu_count() or 1) // size)
    torch.set_num_threads(threads)
    init_gloo()
    info = machine()
    import importlib.metadata as md

    try:
        kaisa_version = md.version("kfac-pytorch")
    except md.PackageNotFoundError:
        kaisa_version = "source " + os.path.dirname(os.path.dirname(kaisa.__file__))
    specs = {"digits": TaskSpec("digits", "digits", "mlp", args.digits_epochs),
             "resnet20": TaskSpec("resnet20", "synthetic", "resnet20", args.resnet_epochs)}
    results: dict[str, Any] = {
        "ranks": size, "threads": threads, "machine": info, "kaisa": kaisa_version,
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "recipes": {"kfac_hpc": {t: asdict(r) for t, r in HPC_RECIPE.items()},
                    "KAISA": {t: asdict(r) for t, r in KAISA_RECIPE.items()}},
        "runs": []}
    if rank == 0:
        print(f"{describe(info)}; {threads} threads/rank; KAISA {kaisa_version}", flush=True)
    t_all = time.perf_counter()
    for task in args.tasks:
        spec = specs[task]
        for seed in args.seeds:  # configurations interleaved within a seed
            splits = load_task(spec, seed, args)
            torch.manual_seed(seed)
            model0 = build_model(spec.model, **splits.model_kwargs())
            for config in args.configs:
                res = run_one(config, spec, seed, splits, model0, args, kaisa)
                results["runs"].append(res)
                if rank == 0:
                    last = res["epochs"][-1]
                    print(f"  {task:<8} {config:<13} seed {seed}: train loss "
                          f"{last['train_loss']:.4f}  test acc {100 * last['test_acc']:6.2f} %"
                          f"  {res['train_time']:6.1f} s  load {res['load']:.1f}"
                          + (f"  DIVERGED at step {res['diverged_at_step']}"
                             if res["diverged_at_step"] is not None else ""), flush=True)
                if args.json and rank == 0:  # after every run: a partial file survives
                    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
                    Path(args.json).write_text(json.dumps(results, indent=1, default=str))
    results["wall_s"] = time.perf_counter() - t_all
    results["load_end"] = os.getloadavg()[0]
    if rank == 0:
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=1, default=str))
        print(f"\nwhole run {results['wall_s']:.0f} s, load average at the end "
              f"{results['load_end']:.1f}\n")
        print(report(results, fig_dir))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
