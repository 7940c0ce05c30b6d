"""Host time of K-FAC's iteration kinds on the GPU path, measured without a GPU.

    python benchmarks/host_overhead.py [--width 8] [--rounds 7] [--repeats 10]

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
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch
from mpi4py import MPI
from torch import nn

from kfac_hpc import KFACPreconditioner
from kfac_hpc.comm import Communicator
from kfac_hpc.kfac import layers, linalg, stacked, statistics_groups
from kfac_hpc.kfac.capture import StatisticsCapture
from kfac_hpc.kfac.layers import register_layers
from kfac_hpc.models import Bottleneck, ResNet, build_model


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=8, help="channels of every stage")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(1)
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
