"""Host time of K-FAC's iteration kinds on the GPU path, and of Shampoo's plain step, without a GPU.

    python benchmarks/host_overhead.py [--sections kfac shampoo] [--width 8] [--rounds 7]
        [--repeats 10] [--shampoo-scale 32] [--meta-src DIR]

On a GPU, ResNet-50's factor update is host-bound: the host issues K-FAC's operators more
slowly than the device runs them (benchmarks/RESULTS.md, GPU, fourth session). This
script measures that host work on the CPU: ResNet-50's 54 K-FAC layers (bottlenecks
3, 4, 6, 3) at a width of ``--width`` channels, batch 2 of 32x32 images, so the same
operators and Python run with next to no arithmetic, with the GPU path forced on CPU
tensors (``uses_gpu_path``, column-major rows, stacked preconditioning). It prints the
milliseconds per iteration of SGD (no capture, no ``step()``), ``p`` (stale
preconditioning) and ``f`` (factor update), medians of ``--rounds`` rounds of
``--repeats`` iterations, with the statistics of same-shaped layers grouped
(``kfac_hpc.kfac.statistics_groups``, the default) and layer by layer. On the H200 the
host time per operator was about twice this machine's (SGD 24 ms there, about 10 here).
It also counts the statistics' products of a factor update of ResNet-50 at its real
widths (batch 32, 224x224) on the ``meta`` device (shapes only, no arithmetic) for
``GROUP_ROW_BYTES`` and a few other bounds.

Section ``shampoo``: ResNet-50 with every width divided by ``--shampoo-scale`` (stem 7x7
of 64/S channels, bottlenecks 3, 4, 6, 3, 1000/S classes) and ``max_preconditioner_dim``
1024/S, so its blocks are ResNet-50's at ``max_preconditioner_dim`` 1024 up to the
kernel and class dimensions, with 1/S³ of the arithmetic: the milliseconds of one plain
step (stale roots; median of ``--rounds`` rounds of 20 steps, after a root step) of
``torch.optim.AdamW`` (foreach), kfac_hpc's ``DistributedShampoo`` with the settings of
``benchmarks/shampoo_step.py``, and Meta's (when it imports from ``--meta-src``), with
the operators each step dispatches (all, and those that launch work: no views; on the
CPU a multi-tensor ``_foreach_*`` operator is counted once per tensor, as it runs tensor
by tensor there, where CUDA launches a few kernels for the whole list). On an
H200 the plain steps took 3.5 (AdamW), 14.9 (kfac_hpc) and 68.3 ms (Meta's) at full width
(benchmarks/RESULTS.md, GPU, fourth session): host-bound, about 2.6 times this machine's
host milliseconds at S = 32 (5.7 and 24.8 ms).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from common import REPO_DIR, import_peer
from mpi4py import MPI
from torch import nn

from kfac_hpc import KFACPreconditioner
from kfac_hpc.comm import Communicator
from kfac_hpc.kfac import layers, linalg, stacked, statistics_groups
from kfac_hpc.kfac.capture import StatisticsCapture
from kfac_hpc.kfac.layers import register_layers
from kfac_hpc.models import Bottleneck, ResNet, build_model
from kfac_hpc.shampoo import DistributedShampoo

sys.path.insert(0, str(REPO_DIR / "tests"))  # the operator counter the tests use
from op_count import count_ops


def force_gpu_path() -> None:
    """Every device takes the GPU path (CPU tensors included), with CUDA's layouts."""
    for module in (linalg, layers, statistics_groups):
        module.uses_gpu_path = lambda device: True  # type: ignore[attr-defined]
    layers.COLUMN_MAJOR_ROWS_DEVICES = frozenset({"cpu"})
    stacked.STACKED_DEVICES = frozenset({"cpu"})


def measure(width: int, rounds: int, repeats: int) -> dict[str, float]:
    """Median ms per iteration of SGD, ``p`` and ``f``."""
    torch.manual_seed(0)
    stem = nn.Sequential(nn.Conv2d(3, width, 3, padding=1, bias=False),
                         nn.BatchNorm2d(width), nn.ReLU())
    model = ResNet(Bottleneck, (3, 4, 6, 3), (width,) * 4, stem=stem, stem_channels=width,
                   num_classes=10)
    x, y = torch.randn(2, 3, 32, 32), torch.randint(0, 10, (2,))
    opt = torch.optim.SGD(model.parameters(), lr=0.0, momentum=0.9)  # weights stay put
    kind = ["fi"]
    pre = KFACPreconditioner(
        model, comm=Communicator(MPI.COMM_SELF), damping=0.001, kl_clip=0.001, lr=0.01,
        factor_update_steps=lambda k: 1 if kind[0] != "p" else 10**9,
        inv_update_steps=lambda k: 1 if kind[0] == "fi" else 10**9)

    def iteration(name: str) -> None:
        kind[0] = "p" if name == "sgd" else name
        pre.steps = 1  # the schedules above decide the kind
        opt.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x), y).backward()
        if name != "sgd":
            pre.step()
        opt.step()

    for name in ("fi", "fi", "sgd", "p", "f"):
        iteration(name)
    times: dict[str, list[float]] = {"sgd": [], "p": [], "f": []}
    for _ in range(rounds):
        for name, out in times.items():
            start = time.perf_counter()
            for _ in range(repeats):
                iteration(name)
            out.append((time.perf_counter() - start) / repeats * 1e3)
    pre.close()
    return {name: statistics.median(v) for name, v in times.items()}


def count_products(row_bytes: int) -> int:
    """Statistics products of one ResNet-50 factor update (batch 32) with that bound."""
    device = torch.device("meta")
    model = build_model("resnet50", num_classes=1000, image_size=224, stem="imagenet")
    model = model.to(device)
    found, _ = register_layers(model)
    capture = StatisticsCapture(found, dtype_of=lambda _: torch.float32, active=lambda: True,
                                grad_scale=lambda: 1.0, precision="tf32")
    products: list[int] = []
    product, bound = linalg.stacked_covariance, statistics_groups.GROUP_ROW_BYTES
    no_autocast = linalg._no_autocast

    def counted(rows: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        products.append(rows.shape[0])
        return product(rows, *args, **kwargs)  # type: ignore[arg-type]

    linalg.stacked_covariance = counted
    statistics_groups.GROUP_ROW_BYTES = row_bytes
    linalg._no_autocast = lambda t: contextlib.nullcontext()  # no autocast on "meta"
    try:
        model(torch.randn(32, 3, 224, 224, device=device)).sum().backward()
        capture.join()
    finally:
        linalg.stacked_covariance = product
        statistics_groups.GROUP_ROW_BYTES = bound
        linalg._no_autocast = no_autocast
        capture.remove()
    return len(products) + 2 * len(found) - sum(products)


def shampoo_section(scale: int, rounds: int, meta_src: str) -> None:
    """Print the host ms and the operators of one plain step per optimizer (docstring)."""
    width = 64 // scale
    stem = nn.Sequential(nn.Conv2d(3, width, 7, stride=2, padding=3, bias=False),
                         nn.BatchNorm2d(width), nn.ReLU())
    torch.manual_seed(0)
    base = ResNet(Bottleneck, (3, 4, 6, 3), tuple(w // scale for w in (64, 128, 256, 512)),
                  stem=stem, stem_channels=width, num_classes=1000 // scale)
    x, y = torch.randn(2, 3, 32, 32), torch.randint(0, 1000 // scale, (2,))
    max_dim = 1024 // scale
    makers: dict[str, Callable[[nn.Module], Any]] = {
        "AdamW": lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.01,
                                             foreach=True),
        "kfac_hpc": lambda m: DistributedShampoo(
            m.named_parameters(), lr=1e-3, betas=(0.9, 0.999), epsilon=1e-12,
            weight_decay=0.01, decoupled_weight_decay=True, max_preconditioner_dim=max_dim,
            precondition_frequency=1, start_preconditioning_step=1, grafting="adam",
            grafting_beta2=0.999, grafting_epsilon=1e-8, comm=Communicator(MPI.COMM_SELF)),
    }
    meta = import_peer("distributed_shampoo", meta_src, "DistributedShampoo")
    if meta is not None:
        makers["Meta's"] = lambda m: meta.DistributedShampoo(
            m.parameters(), lr=1e-3, betas=(0.9, 0.999), epsilon=1e-12, weight_decay=0.01,
            weight_decay_type=meta.WeightDecayType.DECOUPLED, max_preconditioner_dim=max_dim,
            precondition_frequency=1, start_preconditioning_step=1,
            grafting_config=meta.AdamPreconditionerConfig(beta2=0.999, epsilon=1e-8))
    print(f"# Shampoo's plain step: ResNet-50 at 1/{scale} of its widths, "
          f"max_preconditioner_dim {max_dim}, host ms per step (median of {rounds} x 20)")
    print(f"{'optimizer':<10} {'plain ms':>9} {'operators':>10} {'launching':>10}")
    for name, make in makers.items():
        model = copy.deepcopy(base)  # each its own parameters, the same values
        opt = make(model)
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()  # the first step (roots from it on)
        for group in opt.param_groups:
            group["precondition_frequency"] = 10**9  # both libraries read it every step
        for _ in range(3):
            opt.step()
        medians = []
        for _ in range(rounds):
            start = time.perf_counter()
            for _ in range(20):
                opt.step()
            medians.append((time.perf_counter() - start) / 20 * 1e3)
        counter = count_ops(opt.step)
        print(f"{name:<10} {statistics.median(medians):9.2f} "
              f"{sum(counter.counts.values()):10d} {counter.kernels:10d}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sections", nargs="+", choices=["kfac", "shampoo"],
                        default=["kfac", "shampoo"])
    parser.add_argument("--width", type=int, default=8, help="channels of every stage")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--shampoo-scale", type=int, default=32,
                        help="Shampoo's ResNet-50 widths and block size divided by this")
    parser.add_argument("--meta-src", default=os.environ.get(
        "META_SRC", str(REPO_DIR / ".peers" / "meta")),
        help="folder holding Meta's distributed_shampoo/ (default $META_SRC, else "
             ".peers/meta)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if "shampoo" in args.sections:
        shampoo_section(args.shampoo_scale, args.rounds, args.meta_src)
    if "kfac" not in args.sections:
        return
    force_gpu_path()
    grouped_precisions = statistics_groups.STACKED_PRECISIONS
    print(f"# host ms per iteration, ResNet-50's layers at width {args.width}, GPU path "
          f"forced on the CPU, torch {torch.__version__}, medians of {args.rounds} x "
          f"{args.repeats}")
    print(f"{'statistics':<14} {'SGD':>7} {'p':>7} {'f':>7} {'p - SGD':>8} {'f - p':>7}")
    for label, precisions in (("grouped", grouped_precisions),
                              ("layer by layer", frozenset[str]())):
        statistics_groups.STACKED_PRECISIONS = precisions
        ms = measure(args.width, args.rounds, args.repeats)
        print(f"{label:<14} {ms['sgd']:7.2f} {ms['p']:7.2f} {ms['f']:7.2f} "
              f"{ms['p'] - ms['sgd']:8.2f} {ms['f'] - ms['p']:7.2f}")
    statistics_groups.STACKED_PRECISIONS = grouped_precisions
    bounds = sorted({statistics_groups.GROUP_ROW_BYTES, 256 << 20, 1 << 30, 1 << 42})
    counts = ", ".join(f"{b >> 20} MiB: {count_products(b)}" for b in bounds)
    print(f"# ResNet-50 at batch 32, 108 factors: products per factor update by the bound on "
          f"held rows (GROUP_ROW_BYTES = {statistics_groups.GROUP_ROW_BYTES >> 20} MiB): "
          f"{counts}")


if __name__ == "__main__":
    main()
