"""K-FAC's precondition-only step, layer by layer against stacked by gradient layout.

A ResNet-50 (bottlenecks 3, 4, 6, 3; widths divided by ``--width-divisor``) is
decomposed once; then precondition-only steps (``factor_update_steps`` and
``inv_update_steps`` far away) alternate between the per-layer path and the stacked
path (``kfac_hpc.kfac.stacked``: the layers of one gradient layout preconditioned
together), each round timing ``--steps`` steps from the same gradients (restored
before each step, outside the timing). Printed: median ms per step of each path over
the rounds, the operators each dispatches (``tests/op_count.py``: about one kernel
each on a GPU), and the stacks' bytes. Also runs on CUDA (``--device cuda``).

    python benchmarks/stacked_step.py --width-divisor 8 --rounds 5
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from mpi4py import MPI
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from common import machine, select_device, synchronize
from op_count import count_ops

from kfac_hpc import KFACPreconditioner
from kfac_hpc.comm import Communicator
from kfac_hpc.kfac import stacked
from kfac_hpc.models import Bottleneck, ResNet


def resnet50(divisor: int) -> nn.Module:
    """ResNet-50's 54 K-FAC layers with every width divided by ``divisor``."""
    torch.manual_seed(0)
    widths = tuple(w // divisor for w in (64, 128, 256, 512))
    stem = nn.Sequential(nn.Conv2d(3, widths[0], 3, padding=1, bias=False),
                         nn.BatchNorm2d(widths[0]), nn.ReLU())
    return ResNet(Bottleneck, (3, 4, 6, 3), widths, stem=stem, stem_channels=widths[0],
                  num_classes=1000)


def main() -> None:
    """Time both paths, interleaved; print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--width-divisor", type=int, default=8)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--image-size", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per round")
    args = parser.parse_args()
    device = select_device(args.device)
    stacked.STACKED_DEVICES = frozenset({device.type})  # groups formed at construction
    model = resnet50(args.width_divisor).to(device)
    pre = KFACPreconditioner(model, comm=Communicator(MPI.COMM_SELF), damping=0.001,
                             factor_update_steps=10**9, inv_update_steps=10**9)
    x = torch.randn(args.batch, 3, args.image_size, args.image_size, device=device)
    y = torch.arange(args.batch, device=device) % 1000
    model.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    saved = [(g, g.clone()) for p in model.parameters() if (g := p.grad) is not None]
    pre.step()  # factors and decompositions (the only inverse step)
    groups = pre.stack_groups
    paths = {"per-layer": [], "stacked": groups}

    def restore() -> None:
        for grad, value in saved:
            grad.copy_(value)

    def one_step() -> None:
        restore()
        pre.step()

    for groups_of_path in paths.values():  # warm-up: the stacks are built here
        pre.stack_groups = groups_of_path
        one_step()
    kernels = {}
    for name, groups_of_path in paths.items():
        pre.stack_groups = groups_of_path
        restore()
        kernels[name] = count_ops(pre.step).kernels
    times: dict[str, list[float]] = {name: [] for name in paths}
    for _ in range(args.rounds):
        for name, groups_of_path in paths.items():
            pre.stack_groups = groups_of_path
            per_step = []
            for _ in range(args.steps):
                restore()
                synchronize(device)
                start = time.perf_counter()
                pre.step()
                synchronize(device)
                per_step.append(time.perf_counter() - start)
            times[name].append(statistics.median(per_step) * 1e3)
    info = machine()
    print(f"# {info.get('cpu', '')} torch {torch.__version__} device {device}; "
          f"ResNet-50 widths / {args.width_divisor}, {len(pre.layers)} layers, "
          f"{len(groups)} stacks of {sum(map(len, groups))} layers; "
          f"stacked solves {pre.memory_bytes()['solves'] / 2**20:.1f} MiB beside "
          f"{pre.memory_bytes()['decompositions'] / 2**20:.1f} MiB of decompositions")
    print("| path | ms per step (median of rounds) | min | max | operators |")
    print("|---|---:|---:|---:|---:|")
    for name, ms in times.items():
        print(f"| {name} | {statistics.median(ms):.2f} | {min(ms):.2f} | {max(ms):.2f} | "
              f"{kernels[name]} |")
    pre.close()


if __name__ == "__main__":
    main()
